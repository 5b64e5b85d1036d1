"""The engine's bottom layer: what attention, models, engine and scheduler share (step batch, pinned host I/O)."""
