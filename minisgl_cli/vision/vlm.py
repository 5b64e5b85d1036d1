"""Vision-language chat in process on HF transformers: AutoModelForImageTextToText + AutoProcessor, one reply
streamed as `Delta`s, the same objects the text engine streams.

What runs where: the whole VLM (vision tower, connector and its decoder) runs here, in transformers'
`generate`, beside the text engine and off its path: no paged KV, no radix cache, no batching; one
generation at a time per loaded model (later requests wait their turn). Families: SmolVLM / Idefics3, and any
model AutoModelForImageTextToText loads and whose processor takes `images=`. Qwen2-VL and Qwen2.5-VL run on the
engine instead (models/qwen2_vl.py; `on_engine` says where a --vlm-model goes), unless a front pairs one with
another served model.

Messages are chat dicts whose content is text or a list of parts: `{"type": "text", "text": ...}` and
`{"type": "image", "image": <PIL image>}` (vision/image_source.py turns URLs and files into those).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_cli.admission import new_tokens
from minisgl_cli.device import pick_device, pick_dtype
from minisgl_cli.types import (
    Delta,
    ErrorCode,
    FinishReason,
    GenerateRequest,
    RequestStats,
    SamplingParams,
    error_code_of,
)
from minisgl_cli.vision.processor import load_processor

log = logging.getLogger("minisgl.vlm")


class VlmLoadError(Exception):
    """The VLM could not be found or loaded; str() is one line naming the path and the fix."""


@dataclass
class LoadedVlm:
    model: Any  # an AutoModelForImageTextToText
    processor: Any  # its AutoProcessor (or the image-only fallback below)
    model_dir: Path
    name: str
    device: str
    max_context_len: int
    eos_ids: list[int]
    # transformers' generate is not re-entrant per model: generations on one model take turns.
    lock: threading.Lock

    @property
    def tokenizer(self) -> Any:
        return self.processor.tokenizer


@dataclass
class Prepared:
    """A request's processor outputs, on the model's device: input ids, pixel values and the family's extras."""

    inputs: Any  # transformers BatchFeature
    prompt_tokens: int
    images: int


_cache: dict[tuple[str, str], LoadedVlm] = {}
_cache_lock = threading.Lock()


def is_vlm_config(config: dict) -> bool:
    """Whether an HF config.json names a model AutoModelForImageTextToText can load."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return config.get("model_type") in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def resolve_vlm_dir(model: str | Path) -> Path:
    """The local HF dir of a VLM (a dir, or a hub id fetched where the hub is reachable), checked to hold one."""
    from minisgl_cli.loader.errors import ModelLoadError
    from minisgl_cli.loader.resolve import resolve_model

    try:
        path = resolve_model(str(model)).path
    except ModelLoadError as exc:
        raise VlmLoadError(f"vision-language model: {exc}") from None
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise VlmLoadError(f"vision-language model {path}: cannot read config.json ({exc})") from None
    if not is_vlm_config(config):
        raise VlmLoadError(f"{path} holds a {config.get('model_type')!r} model, not a vision-language model "
                           "(expected one AutoModelForImageTextToText loads: SmolVLM / Idefics3, Qwen2-VL, "
                           "Qwen2.5-VL, ...)")
    return path


def on_engine(model: str | Path, engine_model: str | None) -> tuple[str | None, str | None, str]:
    """Where `--vlm-model` runs, beside the engine's `--model` (None: the default): (the engine's model to use
    instead, the VLM the transformers chat loads, the one line that says so). A Qwen2-VL / Qwen2.5-VL directory runs
    on the engine as its served model (text and images), unless --model names another model; every other family
    runs here, in transformers. VlmLoadError when the VLM cannot be found."""
    from minisgl_cli.vision.processor import VisionProcessor

    if engine_model is not None and Path(engine_model).is_dir() and VisionProcessor.of(engine_model) is not None:
        raise VlmLoadError(f"--model {engine_model} takes images itself (on the engine): drop --vlm-model")
    path = resolve_vlm_dir(model)
    family = json.loads((path / "config.json").read_text()).get("model_type")
    if VisionProcessor.of(path) is None:
        return None, str(model), (f"--vlm-model {path.name} ({family}) runs in transformers beside the engine, one "
                                  "request at a time (Qwen2-VL / Qwen2.5-VL run on the engine)")
    if engine_model is None:
        return str(path), None, (f"--vlm-model {path.name} ({family}) runs on the engine as the served model: text "
                                 "and images, batched and cached")
    return None, str(model), (f"--vlm-model {path.name} ({family}) runs in transformers beside --model "
                              f"{engine_model}, one request at a time; give it as --model to run it on the engine")


def load_vlm(model: str | Path, device: str | None = None) -> LoadedVlm:
    """The cached VLM for (dir, device), loading it on first use. VlmLoadError (one line) when it cannot."""
    model_dir = resolve_vlm_dir(model)
    dev = pick_device(device)
    key = (str(model_dir.resolve()), dev)
    with _cache_lock:  # loads are rare; two first requests must not load the weights twice
        if key in _cache:
            return _cache[key]
        from transformers import AutoModelForImageTextToText
        from transformers.utils import logging as tlog

        tlog.disable_progress_bar()  # its weight-loading bar would garble the REPL and the server log
        t0 = time.perf_counter()
        try:
            processor = load_processor(model_dir)
            vlm: Any = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=pick_dtype(dev))
            vlm = vlm.to(dev).eval()
        except (OSError, ValueError, ImportError, KeyError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise VlmLoadError(f"cannot load the vision-language model in {model_dir}: {first}") from None
        text_cfg = vlm.config.get_text_config()
        eos = vlm.generation_config.eos_token_id
        eos = eos if isinstance(eos, list) else [eos] if eos is not None else []
        if not eos and processor.tokenizer.eos_token_id is not None:
            eos = [processor.tokenizer.eos_token_id]
        loaded = LoadedVlm(vlm, processor, model_dir, model_dir.name, dev,
                           int(getattr(text_cfg, "max_position_embeddings", 0) or 4096), [int(e) for e in eos],
                           threading.Lock())
        log.info("VLM loaded: %s (%s) on %s in %.1fs", loaded.name, vlm.config.model_type, dev,
                 time.perf_counter() - t0)
        _cache[key] = loaded
        return loaded


# --- one request ---------------------------------------------------------------------------------------
def refused_fields(params: SamplingParams) -> list[str]:
    """The sampling fields this VLM chat cannot honour (transformers' generate has no equivalent here)."""
    return [name for name, on in (
        ("logprobs", params.wants_logprobs),
        ("response_format", params.constrained),
        ("logit_bias", bool(params.logit_bias)),
        ("presence_penalty", bool(params.presence_penalty)),
        ("frequency_penalty", bool(params.frequency_penalty)),
    ) if on]


def has_images(messages: list[dict]) -> bool:
    return any(isinstance(m.get("content"), list) and any(p.get("type") == "image" for p in m["content"])
               for m in messages)


def _hf_message(m: dict) -> dict:
    """A chat message as VLM chat templates take it: content always a list of typed parts."""
    content = m.get("content")
    parts = [{"type": "text", "text": content or ""}] if not isinstance(content, list) else content
    return {"role": m.get("role", "user"), "content": parts}


def prepare(loaded: LoadedVlm, messages: list[dict], template_kwargs: dict[str, Any] | None = None) -> Prepared:
    """Chat template (given `template_kwargs`, e.g. enable_thinking) + processor: the prompt's ids with image tokens
    expanded, and the pixel values. ValueError when the messages do not fit the model (the caller's input)."""
    chat = [_hf_message(m) for m in messages]
    images = [p["image"] for m in chat for p in m["content"] if p.get("type") == "image"]
    template = getattr(loaded.processor, "chat_template", None) or loaded.tokenizer.chat_template
    if not template:
        raise ValueError(f"{loaded.name} has no chat template")
    text = loaded.tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False,
                                                add_generation_prompt=True, **(template_kwargs or {}))
    kwargs: dict[str, Any] = {"text": [text], "return_tensors": "pt"}
    if images:
        kwargs["images"] = [images]  # one sample holding all of its images
    inputs = loaded.processor(**kwargs).to(loaded.device)
    if "pixel_values" in inputs and inputs["pixel_values"].is_floating_point():
        inputs["pixel_values"] = inputs["pixel_values"].to(loaded.model.dtype)
    return Prepared(inputs, int(inputs["input_ids"].shape[1]), len(images))


def check_budget(loaded: LoadedVlm, prepared: Prepared, requested: int | None, param: str = "max_tokens") -> int:
    """max_new_tokens for the request: what was asked, or what fits (AdmissionError, a ValueError, naming the
    context limit)."""
    return new_tokens(prepared.prompt_tokens, requested, loaded.max_context_len, param, " (images included)",
                      "messages")


async def stream(loaded: LoadedVlm, prepared: Prepared, params: SamplingParams, rid: str,
                 cancel: threading.Event | None = None) -> AsyncGenerator[Delta]:
    """The reply as Deltas (text pieces; the last has the finish reason and stats). Closing the stream early,
    or setting `cancel`, stops the generation at its next token."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Delta | None] = asyncio.Queue()
    stop = cancel or threading.Event()

    def emit(item: Delta | None) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            stop.set()

    def work() -> None:
        try:
            _generate(loaded, prepared, params, rid, stop, emit)
        except Exception as exc:  # its set-up failed: the stream ends with the error instead of waiting for ever
            log.exception("rid=%s VLM generation failed", rid)
            emit(Delta(rid, error=f"internal error: VLM generation failed: {type(exc).__name__}: {exc}",
                       error_code=ErrorCode.ENGINE_FAILED))
            emit(None)

    worker = threading.Thread(target=work, name=f"vlm-{rid}", daemon=True)
    worker.start()
    try:
        while (item := await queue.get()) is not None:
            yield item
    finally:
        stop.set()


class VlmChat:
    """One vision-language model, loaded on first use (or by `load()`): what a front holds to chat with images."""

    def __init__(self, model: str | Path, device: str | None = None):
        self.model, self.device = str(model), device

    @property
    def name(self) -> str:
        return Path(self.model).name or self.model

    def load(self) -> LoadedVlm:
        return load_vlm(self.model, self.device)

    async def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta]:
        """Like `EngineClient.submit` for a chat whose messages hold image parts: bad input (a field the VLM chat
        cannot honour, a prompt past the context) ends the stream with an error Delta."""
        assert req.messages is not None, "a VLM request is a chat: give messages"
        refused = refused_fields(req.params)
        if refused:
            yield Delta(req.rid, error=f"{', '.join(refused)}: not supported with images (the VLM runs in "
                                       "transformers)", error_code=ErrorCode.UNSUPPORTED)
            return
        loop = asyncio.get_running_loop()
        try:
            loaded = await loop.run_in_executor(None, self.load)
            prepared = await loop.run_in_executor(None, prepare, loaded, req.messages, req.template_kwargs)
            room = check_budget(loaded, prepared, None)  # a reply stops at the context limit, as the engine's do
            params = dataclasses.replace(req.params, max_new_tokens=min(req.params.max_new_tokens, room))
        except (ValueError, VlmLoadError) as exc:
            yield Delta(req.rid, error=str(exc), error_code=error_code_of(exc))
            return
        async with contextlib.aclosing(stream(loaded, prepared, params, req.rid)) as deltas:
            async for d in deltas:
                yield d


@dataclass
class _Progress:
    """What the streamer has seen of one generation (written on its worker thread only)."""

    prompt_seen: bool = False  # generate pushes the prompt's ids first
    tokens: int = 0
    last: int | None = None
    stopped: bool = False  # a stop string matched
    first_at: float = 0.0


def _generate(loaded: LoadedVlm, prepared: Prepared, params: SamplingParams, rid: str, cancel: threading.Event,
              emit: Callable[[Delta | None], None]) -> None:
    """The worker thread: transformers' generate with a streamer that decodes, cuts at stop strings, emits."""
    import torch
    from transformers import (
        LogitsProcessor,
        LogitsProcessorList,
        MinPLogitsWarper,
        StoppingCriteria,
        StoppingCriteriaList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )
    from transformers.generation.streamers import BaseStreamer

    from minisgl_cli.tokenizer import IncrementalDetokenizer, StopStringMatcher

    arrival = time.perf_counter()
    detok = IncrementalDetokenizer(loaded.tokenizer, params.skip_special_tokens)  # duck-typed: decode(ids, skip)
    stopper = StopStringMatcher(list(params.stop))
    state = _Progress()

    class Streamer(BaseStreamer):
        def put(self, value: torch.Tensor) -> None:
            if not state.prompt_seen:  # generate pushes the prompt first
                state.prompt_seen = True
                return
            if state.stopped:
                return
            ids = [int(t) for t in value.reshape(-1).tolist()]
            state.tokens += len(ids)
            state.last = ids[-1]
            state.first_at = state.first_at or time.perf_counter()
            text, state.stopped = stopper.push(detok.feed(ids))
            emit(Delta(rid, text=text, token_ids=ids))

        def end(self) -> None:
            pass

    class Stop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kw: Any) -> torch.Tensor:
            done = cancel.is_set() or state.stopped
            return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)

    class Draw(LogitsProcessor):
        """Samples with this request's own generator (seeded or not) and leaves only the drawn token for generate's
        greedy pick: the process-wide RNG, which other threads draw from, is never reseeded."""

        def __init__(self) -> None:
            self.warp = LogitsProcessorList([TemperatureLogitsWarper(params.temperature)])
            if params.top_k > 0:
                self.warp.append(TopKLogitsWarper(params.top_k))
            if params.top_p < 1.0:
                self.warp.append(TopPLogitsWarper(params.top_p))
            if params.min_p > 0:
                self.warp.append(MinPLogitsWarper(params.min_p))
            self.gen = torch.Generator(loaded.device)
            if params.seed is not None:
                self.gen.manual_seed(params.seed % 2**64)
            else:
                self.gen.seed()

        def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
            probs = self.warp(input_ids, scores.float()).softmax(dim=-1)
            drawn = torch.multinomial(probs, 1, generator=self.gen)
            return torch.full_like(scores, float("-inf")).scatter_(1, drawn, 0.0)  # type: ignore[return-value]

    max_new = params.max_new_tokens
    eos = loaded.eos_ids + [t for t in params.stop_token_ids if t not in loaded.eos_ids]
    gen: dict[str, Any] = dict(
        max_new_tokens=max_new, do_sample=False, streamer=Streamer(),
        stopping_criteria=StoppingCriteriaList([Stop()]), eos_token_id=eos or None,
        pad_token_id=loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else (eos or [0])[0],
    )
    # The model's generation_config may carry sampling defaults: Draw does the sampling, so generate ignores them.
    gen.update(temperature=None, top_p=None, top_k=None)
    if not params.greedy:
        gen["logits_processor"] = LogitsProcessorList([Draw()])
    if params.repetition_penalized:  # transformers' spans prompt and output, as the engine's does
        gen["repetition_penalty"] = params.repetition_penalty
    if params.ignore_eos:
        gen["min_new_tokens"] = max_new
    error = None
    prefill_at = arrival
    try:
        with loaded.lock:
            prefill_at = time.perf_counter()
            if max_new > 0 and not cancel.is_set():
                with torch.inference_mode():
                    loaded.model.generate(**prepared.inputs, **gen)
    except Exception as exc:  # a model fault, not the input's: the stream ends with it
        log.exception("rid=%s VLM generation failed", rid)
        error = f"internal error: VLM generation failed: {type(exc).__name__}: {exc}"
    now = time.perf_counter()
    n, last = state.tokens, state.last
    if error:
        emit(Delta(rid, error=error, error_code=ErrorCode.ENGINE_FAILED))
        emit(None)
        return
    reason: FinishReason
    if cancel.is_set() and not state.stopped:
        reason = "abort"
    elif state.stopped or (last in eos and not params.ignore_eos):
        reason = "stop"
    else:
        reason = "length" if n >= max_new else "stop"
    first = state.first_at or now
    stats = RequestStats(prompt_tokens=prepared.prompt_tokens, completion_tokens=n, ttft_s=first - arrival,
                         latency_s=now - arrival, prefill_s=first - prefill_at if n else 0.0)
    rest = "" if state.stopped else stopper.push(detok.flush())[0] + stopper.flush()
    emit(Delta(rid, text=rest, finish_reason=reason, stats=stats))
    emit(None)
