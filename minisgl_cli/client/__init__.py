"""How fronts reach an engine: the EngineClient protocol (protocol.py, imports nothing heavy), what every
implementation shares (base.py) and the in-process client (local.py); the multi-process one is runtime/'s."""
