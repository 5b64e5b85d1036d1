"""Vision: everything about images going into a language model — their sources, the VLM processor, pixel transport
between processes, the engine's image state; the towers themselves are models/."""
