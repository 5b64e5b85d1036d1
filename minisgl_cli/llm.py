"""LLM: the synchronous Python API — `LLM(model=...).generate(prompts or chats, params)`, its engine in this process or
as the multi-process runtime (`processes=True`)."""

from __future__ import annotations

import asyncio
import atexit
import difflib
import logging
import weakref
from dataclasses import fields, replace
from typing import cast

from minisgl_cli.client.protocol import EngineClient, complete
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig, RuntimeMode
from minisgl_cli.runtime.start import runs_as_processes, start_client
from minisgl_cli.scheduler.config import SchedulerConfig
from minisgl_cli.types import Completion, GenerateRequest, SamplingParams

log = logging.getLogger("minisgl.llm")

LLMInput = str | list[int] | list[dict]  # one prompt: text, token ids or a chat
_CONFIGS = (EngineConfig, SchedulerConfig, RuntimeConfig)
_MODES: dict[bool | None, RuntimeMode] = {None: "auto", True: "processes", False: "in-process"}


class LLM:
    """Offline generation over the same client the servers use. Extra keyword arguments go to EngineConfig,
    SchedulerConfig or RuntimeConfig by name (e.g. attention_backend="torch", cache="naive", engine="hf", tp_size=2);
    a name none of them has is a TypeError.
    A Qwen2-VL / Qwen2.5-VL model takes chats whose parts hold images: {"type": "image", "image": <PIL image>}.

    `processes` is where the engine runs (RuntimeConfig's `mode`, `--runtime` on the command line):
    - None (default): in this process, unless tp_size, dp_size or nnodes > 1;
    - False: in this process, the scheduler on a thread: the quickest start, no child processes;
    - True: the multi-process runtime `minisgl serve` runs (a detokenizer, num_tokenizer tokenizer workers, one
      scheduler process per TP rank): the scheduler never shares this process's GIL, so a fast GPU does not wait on
      the caller. Its children are started with the spawn method, which imports the caller's main module again:
      a script needs `if __name__ == "__main__":`. Make it in the thread that outlives it (the main thread): the
      children die with the thread that started them.
    The hf and mlx engines always run in this process (processes=True is refused for them).
    close() (or the `with` block's end) stops every child; an LLM dropped or left open at exit is closed then."""

    def __init__(self, model: str | None = None, *, processes: bool | None = None, **kwargs):
        if processes not in _MODES:
            raise TypeError(f"LLM(processes=...) takes True, False or None, not {processes!r}")
        engine, sched, runtime = _configs(model, processes, kwargs)
        self.client: EngineClient = cast(EngineClient, start_client(engine, sched, runtime, progress=log.info))
        # Stop the engine's children (or its thread) when this LLM is dropped, and at exit: registered now, after the
        # start imported multiprocessing, so it runs before multiprocessing's exit hook (last in, first out), which
        # would wait for ever on children nobody stopped. (weakref's own exit hook may be older than that one.)
        self._close = weakref.finalize(self, self.client.close)
        self._close.atexit = False
        atexit.register(self._close)
        # The scheduler refuses requests past its queue bound: a larger batch is fed in as the queue drains.
        self.window = sched.max_queued_requests or None

    @staticmethod
    def _request(prompt: LLMInput, params: SamplingParams) -> GenerateRequest:
        if isinstance(prompt, str):
            return GenerateRequest(prompt=prompt, params=params)
        if prompt and isinstance(prompt[0], dict):
            return GenerateRequest(messages=prompt, params=params)
        return GenerateRequest(input_ids=list(cast(list[int], prompt)), params=params)  # no dict first: token ids

    def generate(
        self, prompts: LLMInput | list[LLMInput], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[Completion]:
        """One Completion per prompt, all run concurrently (continuous batching; past the scheduler's queue bound,
        max_queued_requests, the rest are submitted as earlier ones finish)."""
        single = isinstance(prompts, str) or (prompts and isinstance(prompts[0], (int, dict)))
        batch = cast(list[LLMInput], [prompts] if single else list(prompts))  # `single` told the two shapes apart
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(batch)

        async def run() -> list[Completion]:
            # The whole text is all a Completion holds: decoded once per request at its end, not per token.
            reqs = [self._request(p, replace(sp, stream_text=False)) for p, sp in zip(batch, plist)]
            window = asyncio.Semaphore(self.window or len(reqs) or 1)

            async def one(r: GenerateRequest) -> Completion:
                async with window:
                    return await complete(self.client, r)

            return list(await asyncio.gather(*(one(r) for r in reqs)))

        return asyncio.run(run())

    def close(self) -> None:
        """Stop the engine: its thread, or every child process (within 5 s). Once; later calls do nothing."""
        atexit.unregister(self._close)
        self._close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _configs(model: str | None, processes: bool | None,
             kwargs: dict) -> tuple[EngineConfig, SchedulerConfig, RuntimeConfig]:
    """LLM's keyword arguments as the three configs, each name to the config that has it; a TypeError naming those
    none has (and what was likely meant), a ValueError for a runtime option that where the engine runs changes
    nothing."""
    names = [{f.name for f in fields(cls)} for cls in _CONFIGS]
    if "mode" in kwargs:
        raise TypeError("LLM takes processes=True / False / None for where the engine runs, not mode=")
    if unknown := [k for k in kwargs if not any(k in n for n in names)]:
        known = sorted(set().union(*names) - {"mode"})
        hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, 1)) else k
                 for k in unknown]
        raise TypeError(f"LLM() got unknown options: {'; '.join(hints)}. It takes the fields of EngineConfig, "
                        "SchedulerConfig and RuntimeConfig")
    engine_kw, sched_kw, runtime_kw = ({k: v for k, v in kwargs.items() if k in n} for n in names)
    if processes is False and any(runtime_kw.get(k, 1) > 1 for k in ("tp_size", "dp_size", "nnodes")):
        raise ValueError("processes=False runs one rank in this process: tp_size, dp_size and nnodes > 1 need "
                         "processes=True (or None)")
    engine = EngineConfig(model=model, **engine_kw)
    runtime = RuntimeConfig(mode=_MODES[processes], **runtime_kw)
    if runtime.node_rank != 0:
        raise ValueError("LLM runs node 0 (the one that takes requests); run the other nodes' ranks with "
                         "`minisgl serve --node-rank N`")
    if processes and not runs_as_processes(engine, runtime, True):
        raise ValueError(f"engine={engine.engine!r} runs in this process, one request at a time: drop processes=True "
                         "or use engine='torch'")
    if not runs_as_processes(engine, runtime, False) and (extra := [k for k, v in runtime_kw.items()
                                                                     if v != getattr(RuntimeConfig, k)]):
        raise ValueError(f"{', '.join(extra)} configure the multi-process runtime, and the engine runs in this "
                         "process: drop them or pass processes=True")
    return engine, SchedulerConfig(**sched_kw), runtime
