"""Resolve the default model: the first call converts its GGUF into the HF cache, later calls just find it."""

import time

from minisgl_cli.loader import resolve_model

for call in (1, 2):
    t0 = time.perf_counter()
    model = resolve_model(None)  # same as `--model smollm2`; honours $MINISGL_CACHE_DIR
    print(f"call {call}: {model.name} -> {model.path} ({model.source}, converted={model.converted}) "
          f"in {time.perf_counter() - t0:.2f}s")
