"""LocalClient: the in-process EngineClient — engine and scheduler in this process, the loop on its own thread.

The scheduler thread also builds the engine (so the process has one OpenMP pool; torch releases the GIL while the
model runs, so a busy front never stalls decoding) and talks to the client only in `messages`: requests and named
queries in, one `StepOutput` per step out, routed by request id to each request's stream.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import logging
import threading
import time
import weakref
from collections.abc import Callable

import torch

from minisgl_cli.client.base import BaseClient
from minisgl_cli.client.protocol import STALL_S, PrefixWarm
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.engine.host import trim_heap
from minisgl_cli.messages import DecodedPiece, FromScheduler, StepOutput, TokenOutput, ToScheduler
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
from minisgl_cli.tokenizer import RequestDecoder, Tokenizer, prompt_ids
from minisgl_cli.types import ErrorCode, GenerateRequest, Prompt, SamplingParams
from minisgl_cli.vision.processor import VisionProcessor, has_images

log = logging.getLogger("minisgl.client")


def _ended(items: list[TokenOutput]) -> bool:
    return items[-1].finish_reason is not None or items[-1].error is not None


class LocalClient(BaseClient):
    """The in-process EngineClient: engine and scheduler in this process, the loop on a thread;
    each request's tokens are detokenized on its consumer's event loop."""

    def __init__(self, engine_cfg: EngineConfig | None = None, sched_cfg: SchedulerConfig | None = None,
                 engine: Engine | None = None):
        super().__init__()
        self._stop = threading.Event()
        self.tokenizer: Tokenizer | None = None
        # The scheduler thread builds the engine (unless one is given) as well as stepping it: the CPU ops' thread
        # pool (OpenMP's, one per thread that starts parallel work) is then the only one in the process. A second
        # one, made here by loading the weights, makes both spin-wait less: decode ran 2x slower on 2 cores.
        built: concurrent.futures.Future[Scheduler] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(engine, engine_cfg or EngineConfig(),
                                                                sched_cfg or SchedulerConfig(), built),
                                        name="minisgl-scheduler", daemon=True)
        self._thread.start()
        scheduler = built.result()  # re-raises what the build raised (ModelLoadError, ValueError)
        self._tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="minisgl-tokenize")
        self.info = scheduler.model_info()
        # A vision-language model's image prompts: its HF processor, run where this client tokenizes.
        self.processor = VisionProcessor.of(self.info.model_dir) if self.info.images and self.info.model_dir else None
        # Only the thread holds the scheduler (and the engine it built): both go when it ends, weights and KV pool
        # with them, while this client may be kept (an LLM closed but still referenced).
        self._inbox = scheduler.inbox
        self._scheduler = weakref.ref(scheduler)

    def _run(self, engine: Engine | None, engine_cfg: EngineConfig, sched_cfg: SchedulerConfig,
             built: concurrent.futures.Future[Scheduler]) -> None:
        try:
            e = engine or Engine(engine_cfg)
            model_dir = e.spec.model_dir
            self.tokenizer = Tokenizer(model_dir) if model_dir is not None else None
            eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
            scheduler = Scheduler(e, sched_cfg, self._on_output, eos_token_ids=eos)
        except BaseException as exc:  # noqa: BLE001 (handed to the constructor, which raises it)
            built.set_exception(exc)
            return
        built.set_result(scheduler)
        try:
            scheduler.run_forever(self._stop)
        finally:
            if not self._stop.is_set():
                log.error("minisgl: the scheduler thread exited")
                self._fail_all("the scheduler thread exited")

    def _send(self, msg: ToScheduler) -> None:
        self._inbox.put(msg)

    def _error_item(self, rid: str, error: str, code: ErrorCode) -> TokenOutput:
        return TokenOutput(rid, None, None, error=error, error_code=code)

    def _on_output(self, msg: FromScheduler) -> None:
        """On the scheduler thread: route a step's outputs by request id."""
        if not isinstance(msg, StepOutput):
            self._reply(msg.qid, msg)
            return
        by_rid: dict[str, list] = {}
        for o in msg.outputs:
            by_rid.setdefault(o.rid, []).append(o)
        self._route(by_rid, _ended)

    def _decoder(self, params: SamplingParams) -> Callable[[list], DecodedPiece]:
        return RequestDecoder(self.tokenizer, params).feed

    def input_ids(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied to messages), on the calling thread."""
        return prompt_ids(self.tokenizer, req)

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        return (await self.prompt(req)).ids

    async def prompt(self, req: GenerateRequest) -> Prompt:
        processor = self.processor
        if req.tokenized is not None or (processor is None and has_images(req.messages)):
            return await super().prompt(req)  # as made, or refuses the images
        if req.input_ids is not None:
            return self._admitted(Prompt(list(req.input_ids)), req)
        loop = asyncio.get_running_loop()
        if processor is not None and has_images(req.messages):
            messages, tools = req.messages or [], req.tools
            return await loop.run_in_executor(self._tokenize_pool,
                                              lambda: self._admitted(processor.prompt(
                                                  messages, tools, template_kwargs=req.template_kwargs), req))
        # Tokenized and admitted on the pool's thread: neither holds up the caller's event loop.
        return await loop.run_in_executor(self._tokenize_pool, lambda: self._admitted(Prompt(self.input_ids(req)), req))

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        req = GenerateRequest(prompt=prefix) if isinstance(prefix, str) else GenerateRequest(input_ids=list(prefix))
        return self._warm(self._admitted(Prompt(prompt_ids(self.tokenizer, req)), req))

    def healthy(self) -> bool:
        scheduler = self._scheduler()
        return (scheduler is not None and self._thread.is_alive()
                and time.monotonic() - scheduler.heartbeat < STALL_S)

    def failure(self) -> str | None:
        return None if self._thread.is_alive() or self._stop.is_set() else "the scheduler thread exited"

    def close(self) -> None:
        self._stop.set()
        self._inbox.put(None)  # wake an idle loop
        self._thread.join(timeout=30)
        self._tokenize_pool.shutdown(wait=False)
        self._fail_all("the client was closed", ErrorCode.CANCELLED)  # open streams end with an error, not silence
        if not self._thread.is_alive():
            # Free the engine now (its parts refer to each other) and give its CUDA memory back to the device: the
            # next engine in this process sizes its KV pool from the free memory.
            gc.collect()
            trim_heap()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()

