"""The hf engine: HF transformers `generate` streaming through a TextIteratorStreamer, one request at a time.

The reference stack's baseline as an engine: chat, serve, smoke and bench reach it through the same EngineClient
as ours, and the bench's hf-stream baseline is this engine at concurrency 1. `HFModel` (the transformers model
of the engine's own HF dir) also serves the bench's batched-`generate` baseline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import StoppingCriteria, TextIteratorStreamer

from minisgl_cli.backends.serial import SerialClient, refuse
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.loader.resolve import resolve_model
from minisgl_cli.messages import DecodedPiece
from minisgl_cli.tokenizer import Tokenizer
from minisgl_cli.types import FinishReason, GenerateRequest, ModelInfo, SamplingParams


class HFModel:
    """The HF transformers model and tokenizer of a model dir, on one device and dtype."""

    def __init__(self, model_dir: Path | str, device: str | torch.device, dtype: torch.dtype):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would tear through chat's and bench's
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        # transformers wraps .to() with functools.wraps, which typeshed leaves unbound (self not applied).
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        self.device = torch.device(device)
        gen = self.model.generation_config
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids: list[int] = [e for e in (eos if isinstance(eos, list) else [eos]) if e is not None]
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)

    def gen_kwargs(self, params: SamplingParams, eos_ids: list[int] | None = None) -> dict[str, Any]:
        """generate()'s arguments for `params` (greedy, temperature / top-k / top-p draws); EOS = `eos_ids`
        (default: the checkpoint's) unless ignored, plus the request's stop ids."""
        from transformers import GenerationConfig

        eos = [] if params.ignore_eos else list(self.eos_ids if eos_ids is None else eos_ids)
        eos += [t for t in params.stop_token_ids if t not in eos]
        sample = not params.greedy
        # A fresh config: the checkpoint's own (temperature, top_p...) would only add warnings to greedy.
        cfg = GenerationConfig(
            max_new_tokens=params.max_new_tokens, do_sample=sample, pad_token_id=self.pad_id,
            temperature=params.temperature if sample else None, top_p=params.top_p if sample else None,
            top_k=max(params.top_k, 0) if sample else None,  # 0: no top-k cut (the config's default is 50)
            min_p=params.min_p if sample and params.min_p else None,
            # HF's repetition penalty spans prompt and output, as ours does.
            repetition_penalty=params.repetition_penalty if params.repetition_penalized else None,
            # Nothing may end it early (ignore_eos): it runs to max_new_tokens, EOS kept from being drawn.
            eos_token_id=eos or self.eos_ids or None, min_new_tokens=None if eos else params.max_new_tokens,
        )
        return {"generation_config": cfg}

    def close(self) -> None:
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


class TokenTextStreamer(TextIteratorStreamer):
    """A TextIteratorStreamer whose items are (text, token ids): each new token's id with the text it completes
    (the streamer holds text back until a word ends, so many items carry an id and no text yet)."""

    def __init__(self, tokenizer: Any, **decode_kwargs: Any):
        super().__init__(tokenizer, skip_prompt=True, **decode_kwargs)
        self._ids: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        if not (self.skip_prompt and self.next_tokens_are_prompt):
            self._ids = value.reshape(-1).tolist()
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        ids, self._ids = self._ids, []
        self.text_queue.put((text, ids), timeout=self.timeout)
        if stream_end:
            self.text_queue.put(self.stop_signal, timeout=self.timeout)


class _Stopped(StoppingCriteria):
    """Ends generate() once the request is aborted (checked after every token)."""

    def __init__(self, stopped: Callable[[], bool]):
        self.stopped = stopped

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.stopped(), dtype=torch.bool, device=input_ids.device)


def stream(hf: HFModel, ids: list[int], params: SamplingParams, eos_ids: list[int],
           stopped: Callable[[], bool] = lambda: False) -> Iterator[tuple[str, list[int]]]:
    """generate() on its own thread feeding a TokenTextStreamer; yields (text, token ids) as the streamer does."""
    streamer = TokenTextStreamer(hf.tokenizer, skip_special_tokens=params.skip_special_tokens)
    input_ids = torch.tensor([ids], device=hf.device)
    error: list[BaseException] = []

    def generate() -> None:
        try:
            if params.seed is not None:
                torch.manual_seed(params.seed)  # one request at a time: the global generator is this one's
            with torch.inference_mode():
                hf.model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), streamer=streamer,
                                  stopping_criteria=[_Stopped(stopped)], **hf.gen_kwargs(params, eos_ids))
        except BaseException as exc:  # surface it to the consumer, and unblock the streamer
            error.append(exc)
            streamer.end()

    thread = threading.Thread(target=generate, name="minisgl-hf-generate", daemon=True)
    thread.start()
    try:
        yield from streamer
    finally:
        thread.join()
    if error:
        raise error[0]


class HFClient(SerialClient):
    """The hf engine behind the EngineClient protocol (no prefix cache, no KV pool: those figures are n/a)."""

    engine = "hf"
    prefix_cache = None

    def __init__(self, hf: HFModel, model_dir: Path, name: str, source: str, load_s: float = 0.0):
        self.hf = hf
        tokenizer = Tokenizer(model_dir)
        self.eos = sorted(tokenizer.eos_token_ids)
        cfg = hf.model.config
        super().__init__(tokenizer, int(cfg.max_position_embeddings))
        self.info = ModelInfo(
            name, source, str(hf.device), str(hf.model.dtype).removeprefix("torch."),
            str(getattr(cfg, "_attn_implementation", None) or "eager"), str(model_dir), int(cfg.vocab_size),
            page_size=1, max_running=1, max_context_len=self.max_context_len, kv_tokens=None, load_s=load_s,
            overlap=False, eos_token_ids=tuple(self.eos), engine=self.engine, prefix_cache=None,
        )
        self._start()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> HFClient:
        if cfg.load_format == "dummy":
            raise ValueError("--engine hf loads real weights: --load-format dummy needs --engine torch")
        t0 = time.perf_counter()
        resolved = resolve_model(cfg.model)
        try:
            hf = HFModel(resolved.path, cfg.resolved_device(), cfg.resolved_dtype())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"transformers cannot load it ({type(exc).__name__}: {exc})", resolved.path) from None
        return cls(hf, resolved.path, resolved.name, resolved.source, time.perf_counter() - t0)

    def _check(self, req: GenerateRequest) -> None:
        p = req.params
        refuse(self.engine, {
            "logprobs": p.wants_logprobs, "presence_penalty": bool(p.presence_penalty),
            "frequency_penalty": bool(p.frequency_penalty), "logit_bias": bool(p.logit_bias),
            "json_schema": p.json_schema is not None, "regex": p.regex is not None, "ebnf": p.ebnf is not None,
            "structural_tag": p.structural_tag is not None,
        })

    def _generate(self, ids: list[int], params: SamplingParams,
                  stopped: Callable[[], bool]) -> Generator[DecodedPiece, None, None]:
        out: list[int] = []
        for text, new in stream(self.hf, ids, params, self.eos, stopped):
            out += new
            yield DecodedPiece("", text, new)
        if stopped():
            return  # aborted: the worker ends it
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos))
        reason: FinishReason = "stop" if out and out[-1] in ends else "length"
        yield DecodedPiece("", finish_reason=reason)

    def close(self) -> None:
        super().close()
        self.hf.close()
