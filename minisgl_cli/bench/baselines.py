"""Baselines and peers on the same weights and prompts: HF transformers streaming (the hf engine: a
TextIteratorStreamer, one request at a time, as the reference stack measures it), HF batched `generate`, and
llama.cpp on the GGUF."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, cast

import torch

from minisgl_cli.bench.metrics import RequestTiming
from minisgl_cli.bench.offline import EngineTarget
from minisgl_cli.bench.target import OnDone, RunOutput
from minisgl_cli.bench.workloads import BenchRequest, Case

BASELINES = ("hf-stream", "hf-batched")
PEERS = ("llama-cpp",)


class _OneAtATime:
    """Runs requests strictly one after another (the reference baseline's way), whatever the concurrency."""

    def _one(self, req: BenchRequest) -> RequestTiming:
        raise NotImplementedError

    def warmup(self, requests: list[BenchRequest]) -> None:
        for r in requests:
            self._one(r)

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput:
        t0 = time.perf_counter()
        timings = []
        for r in case.requests:
            timings.append(self._one(r))
            on_done()
        return RunOutput(timings, time.perf_counter() - t0)


class HFStreamTarget(EngineTarget):
    """The hf engine (HF `generate` feeding a TextIteratorStreamer, one request at a time) through its client."""

    sequential = True

    def __init__(self, model_dir: Path | str, device: str, dtype: torch.dtype):
        from minisgl_cli.backends.hf import HFClient, HFModel

        super().__init__(HFClient(HFModel(model_dir, device, dtype), Path(model_dir), Path(model_dir).name, "hf-dir"),
                         "hf-stream")


class HFBatchedTarget:
    """HF `generate` on static batches of `concurrency` left-padded requests: no streaming, so no TTFT;
    a batch runs to its longest request, which is exactly the cost continuous batching removes."""

    name = "hf-batched"
    sequential = False

    def __init__(self, model_dir: Path | str, device: str, dtype: torch.dtype):
        from minisgl_cli.backends.hf import HFModel

        self.hf = HFModel(model_dir, device, dtype)

    def _batch(self, reqs: list[BenchRequest]) -> list[RequestTiming]:
        hf = self.hf
        width = max(r.prompt_tokens for r in reqs)
        ids = torch.full((len(reqs), width), hf.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(reqs):
            ids[i, width - r.prompt_tokens:] = torch.tensor(r.input_ids)
            mask[i, width - r.prompt_tokens:] = 1
        new = max(r.max_new_tokens for r in reqs)
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                params = reqs[0].sampling.params(new, all(r.ignore_eos for r in reqs))
                out = hf.model.generate(input_ids=ids.to(hf.device), attention_mask=mask.to(hf.device),
                                        **hf.gen_kwargs(params))
        except Exception as exc:
            dt = time.perf_counter() - t0
            return [RequestTiming(r.prompt_tokens, latency_s=dt, success=False, error=f"{type(exc).__name__}: {exc}")
                    for r in reqs]
        dt = time.perf_counter() - t0
        timings = []
        for i, r in enumerate(reqs):
            gen = out[i, width:].tolist()[: r.max_new_tokens]
            # Count up to and including the first EOS, like the engine (rows after EOS are padding).
            n = next((k + 1 for k, t in enumerate(gen) if t in hf.eos_ids and not r.ignore_eos), len(gen))
            text = cast(str, hf.tokenizer.decode(gen[:n], skip_special_tokens=True))  # one id list: one string
            timings.append(RequestTiming(r.prompt_tokens, n, latency_s=dt, text=text))
        return timings

    def warmup(self, requests: list[BenchRequest]) -> None:
        if requests:
            self._batch(requests)

    def run(self, case: Case, concurrency: int, on_done: OnDone) -> RunOutput:
        t0 = time.perf_counter()
        timings: list[RequestTiming] = []
        size = max(1, concurrency)
        for start in range(0, len(case.requests), size):
            batch = self._batch(case.requests[start:start + size])
            timings += batch
            for _ in batch:
                on_done()
        return RunOutput(timings, time.perf_counter() - t0)

    def close(self) -> None:
        self.hf.close()


def llama_cpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCppTarget(_OneAtATime):
    """llama.cpp (llama-cpp-python) on the GGUF the engine converted from, streaming, one request at a time.
    It runs the GGUF's own quantized weights: the comparison is stack against stack, not bit for bit."""

    name = "llama-cpp"
    sequential = True

    def __init__(self, gguf_path: Path | str, on_gpu: bool, n_ctx: int = 4096):
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_gpu_layers=-1 if on_gpu else 0,
                         seed=0, verbose=False)

    def _one(self, req: BenchRequest) -> RequestTiming:
        sp = req.sampling
        kwargs: dict[str, Any] = {"max_tokens": req.max_new_tokens, "temperature": sp.temperature, "top_p": sp.top_p,
                                  "top_k": max(sp.top_k, 0), "min_p": sp.min_p, "stream": True}
        if req.ignore_eos:
            kwargs["logit_bias"] = {self.llm.token_eos(): -1e9}
        timing = RequestTiming(prompt_tokens=req.prompt_tokens)
        parts: list[str] = []
        t0 = time.perf_counter()
        try:
            for chunk in self.llm.create_completion(prompt=req.input_ids, **kwargs):
                now = time.perf_counter() - t0
                timing.ttft_s = now if timing.ttft_s is None else timing.ttft_s
                timing.chunk_times_s.append(now)
                timing.output_tokens += 1  # llama-cpp-python streams one chunk per token
                parts.append(chunk["choices"][0].get("text") or "")
        except Exception as exc:
            timing.success, timing.error = False, f"{type(exc).__name__}: {exc}"
        timing.latency_s = time.perf_counter() - t0
        timing.text = "".join(parts)
        return timing

    def close(self) -> None:
        if hasattr(self.llm, "close"):  # older llama-cpp-python has no close()
            self.llm.close()
