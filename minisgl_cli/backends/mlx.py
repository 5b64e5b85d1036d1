"""The mlx engine: mlx-lm (Apple's MLX; on Linux its CPU build), one request at a time, its prompt cache reused.

Weights: an HF dir loads as it is. A GGUF (the default model too) is converted once more, from the HF dir
loader/gguf.py made of it (llama.cpp's q/k row permutation already undone there), into an mlx-lm folder in
$MINISGL_CACHE_DIR/mlx/ (mlx_lm.convert, at the engine's dtype), which later starts load directly.
Prompt caches: mlx-lm's LRUPromptCache keyed by token ids, as mlx_lm.server keeps them, so the next turn of a
chat prefills only what the last one did not see. Tokens are mlx-lm's (`generate_step`); text is our
IncrementalDetokenizer's, so both engines print the same text for the same tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Generator
from pathlib import Path
from typing import Any

from minisgl_cli import env
from minisgl_cli.backends.serial import SerialClient, refuse
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.resolve import file_lock, resolve_model
from minisgl_cli.messages import DecodedPiece
from minisgl_cli.tokenizer import IncrementalDetokenizer, Tokenizer
from minisgl_cli.types import FinishReason, GenerateRequest, ModelInfo, SamplingParams

log = logging.getLogger("minisgl.backends")

_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16"}
INSTALL = "pip install 'minisgl[mlx]' (mlx-lm; on Linux with mlx[cpu])"


def mlx_model_dir(hf_dir: Path, dtype: str) -> tuple[Path, bool]:
    """The mlx-lm folder of an HF dir at `dtype`, converted on first use ($MINISGL_CACHE_DIR/mlx/NAME-DTYPE);
    (folder, whether this call converted it). The folder appears whole or not at all."""
    out = env.cache_dir() / "mlx" / f"{hf_dir.name}-{dtype}"
    if out.is_dir():
        return out, False
    out.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(out.parent / f"{out.name}.lock"):
        if out.is_dir():  # another process converted it while we waited
            return out, False
        from mlx_lm import convert

        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            with contextlib.redirect_stdout(sys.stderr):  # mlx_lm.convert prints its progress to stdout
                convert(str(hf_dir), str(tmp / "model"), dtype=dtype)
            os.replace(tmp / "model", out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out, True


class MLXClient(SerialClient):
    """The mlx engine behind the EngineClient protocol (no KV page pool: those figures are n/a)."""

    engine = "mlx"
    prefix_cache = "prompt"

    def __init__(self, model: Any, model_dir: Path, name: str, source: str, device: str, dtype: str,
                 max_context_len: int, vocab_size: int, load_s: float = 0.0):
        from mlx_lm.models.cache import LRUPromptCache

        self.model = model
        tokenizer = Tokenizer(model_dir)
        self.eos = sorted(tokenizer.eos_token_ids)
        self.prompt_cache = LRUPromptCache()
        self.key = name  # the LRUPromptCache's model key
        super().__init__(tokenizer, max_context_len)
        self.info = ModelInfo(
            name, source, f"mlx:{device}", dtype, "mlx sdpa", str(model_dir), vocab_size, page_size=1,
            max_running=1, max_context_len=max_context_len, kv_tokens=None, load_s=load_s, overlap=False,
            eos_token_ids=tuple(self.eos), engine=self.engine, prefix_cache=self.prefix_cache,
        )
        self._start()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> MLXClient:
        try:
            import mlx.core as mx
            from mlx_lm.utils import load_model
        except ImportError as exc:
            raise ValueError(f"--engine mlx needs mlx-lm ({exc}): {INSTALL}") from None
        if cfg.load_format == "dummy":
            raise ValueError("--engine mlx loads real weights: --load-format dummy needs --engine torch")
        if cfg.device not in ("auto", "cpu"):
            raise ValueError(f"--engine mlx runs on mlx's own devices: --device auto or cpu, not {cfg.device!r}")
        if cfg.device == "cpu":
            mx.set_default_device(mx.cpu)
        device = "gpu" if mx.default_device().type == mx.gpu else "cpu"
        t0 = time.perf_counter()
        resolved = resolve_model(cfg.model)
        folder = resolved.path
        if resolved.source == "gguf-cache":
            if cfg.dtype != "auto" and cfg.dtype not in _DTYPES:
                raise ValueError(f"unknown dtype {cfg.dtype!r}; choose one of {', '.join(_DTYPES)}")
            dtype = _DTYPES.get(cfg.dtype, "float32" if device == "cpu" else "bfloat16")
            folder, converted = mlx_model_dir(resolved.path, dtype)
            if converted:
                log.warning("converted %s into an mlx-lm folder: %s", resolved.name, folder)
        elif cfg.dtype != "auto":
            raise ValueError("--engine mlx loads an HF dir in its own dtype: --dtype applies to GGUF models, which "
                             "it converts once")
        try:
            model, config = load_model(folder)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"mlx-lm cannot load it ({type(exc).__name__}: {exc})", folder) from None
        dtype = _dtype(model)
        return cls(model, resolved.path, resolved.name, resolved.source, device, dtype,
                   int(config.get("max_position_embeddings", 4096)), int(config["vocab_size"]),
                   time.perf_counter() - t0)

    def _check(self, req: GenerateRequest) -> None:
        p = req.params
        # mlx-lm's presence / frequency / repetition penalties look at a window of 20 tokens, prompt included: not
        # OpenAI's (nor HF's, for the repetition penalty).
        refuse(self.engine, {
            "logprobs": p.wants_logprobs, "presence_penalty": bool(p.presence_penalty),
            "frequency_penalty": bool(p.frequency_penalty), "repetition_penalty": p.repetition_penalized,
            "json_schema": p.json_schema is not None, "regex": p.regex is not None, "ebnf": p.ebnf is not None,
            "structural_tag": p.structural_tag is not None,
        })

    def _generate(self, ids: list[int], params: SamplingParams,
                  stopped: Callable[[], bool]) -> Generator[DecodedPiece, None, None]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
        from mlx_lm.sample_utils import make_logits_processors, make_sampler

        cache, rest = self.prompt_cache.fetch_nearest_cache(self.key, ids)
        if cache is not None and not rest:  # the whole prompt is cached: run its last token again for its logits
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = ids[-1:]
            else:
                cache = None
        if cache is None:
            cache, rest = make_prompt_cache(self.model), list(ids)
        cached = len(ids) - len(rest)
        if params.seed is not None:
            mx.random.seed(params.seed)  # one request at a time: the global generator is this one's
        sampler = make_sampler(params.temperature, top_p=params.top_p, min_p=params.min_p, top_k=max(params.top_k, 0))
        processors = make_logits_processors(logit_bias=params.logit_bias) if params.logit_bias else None
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
        seen = list(ids)  # what the cache holds: generate_step feeds each token before it yields it
        steps = generate_step(mx.array(rest), self.model, max_tokens=params.max_new_tokens, sampler=sampler,
                              logits_processors=processors, prompt_cache=cache)
        whole = True
        try:
            for n, (step, _) in enumerate(steps, 1):
                token = int(step)  # generate_step yields each token as a Python int (its hints say mx.array)
                seen.append(token)
                reason: FinishReason | None = (
                    "stop" if token in ends else "length" if n == params.max_new_tokens else None)
                text = detok.feed([token]) + (detok.flush() if reason else "")
                yield DecodedPiece("", text, [token], reason, cached_tokens=cached)
                if reason is not None or stopped():
                    return
        except Exception:
            whole = False  # a step failed part-way: the cache may not hold `seen`
            raise
        finally:
            steps.close()
            if whole:
                self.prompt_cache.insert_cache(self.key, seen, cache)


def _dtype(model: Any) -> str:
    """The dtype of the model's weights ("float32", ...)."""
    from mlx.utils import tree_flatten

    leaves: Any = tree_flatten(model.parameters())  # [(name, array), ...]
    return str(leaves[0][1].dtype).removeprefix("mlx.core.")
