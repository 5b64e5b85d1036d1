"""torch.compile for the media pipelines: the DiT's repeated blocks (regional compile) and the VAE decode, with the
compiled kernels and graphs kept on disk so a second start skips the cold compile.

Regional compile (`compile_repeated_blocks(fullgraph=True)`): one block class compiled once and reused by all 30
layers; on an H200 Z-Image-Turbo's step went 146 -> 96 ms (static shapes) with a 13 s first call, where the whole
transformer compiles in 52 s with graph breaks (docs/media.md). A DiT that declares no repeated blocks compiles whole.
Inductor's FX graph cache and AOT autograd cache live in env.inductor_cache_dir() (TORCHINDUCTOR_CACHE_DIR,
default ~/.cache/minisgl/inductor, shared with the CPU decode step's build), which outlives /tmp.
"""

from __future__ import annotations

import os
from typing import Any

from minisgl_cli import env

RECOMPILE_LIMIT = 64


def use_persistent_cache() -> None:
    """Point inductor at our cache dir (unless TORCHINDUCTOR_CACHE_DIR says otherwise) with its local caches on."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(env.inductor_cache_dir()))
    import torch._dynamo
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    functorch_config.enable_autograd_cache = True
    # A DiT block meets several variants (modulated or not, a padding mask or none, a batch of one or more, other
    # caption lengths), each a compiled graph; past dynamo's default limit of 8 a fullgraph compile fails the call.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)


def compile_denoiser(denoiser: Any, dynamic: bool | None = None) -> str:
    """Compile the DiT in place; returns "regional" or "whole" (what was compiled). `dynamic` is torch.compile's:
    None (ours) specializes the shapes first seen and recompiles a block once with a changed size symbolic (the
    media worker meets a server's variants ahead of need: batch.warm_up); True starts symbolic (on the tiny CPU
    pipeline 2-3x slower a step than static; on a GPU not measured yet: examples/media_profile.py)."""
    use_persistent_cache()
    if getattr(denoiser, "_repeated_blocks", None) and hasattr(denoiser, "compile_repeated_blocks"):
        denoiser.compile_repeated_blocks(fullgraph=True, dynamic=dynamic)
        return "regional"
    denoiser.compile(dynamic=dynamic)  # in place, so the pipeline keeps its registered module
    return "whole"


def compile_vae_decode(vae: Any) -> bool:
    """Compile the image VAE's decoder network (the decode's convolutions) in place; tiling and scaling stay eager.
    Wan's video VAE decodes frame by frame through a feature cache it mutates, which would recompile per frame:
    it stays eager (False)."""
    if type(vae).__name__ != "AutoencoderKL":
        return False
    use_persistent_cache()
    vae.decoder.compile()
    return True
