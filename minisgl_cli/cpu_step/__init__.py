"""The CPU decode step compiled ahead of time: how it is stored and loaded (compiled.py), and its builder (build.py)."""
