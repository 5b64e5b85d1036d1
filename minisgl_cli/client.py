"""EngineClient: the one engine API every front uses — submit(request) -> async stream of deltas; abort.

It owns tokenization and detokenization and runs the scheduler loop on its own thread, so a busy front
(an HTTP server, a REPL) never stalls decoding: torch releases the GIL while the model runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.scheduler.request import Req, TokenOutput
from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
from minisgl_cli.scheduler.stats import SchedulerStats
from minisgl_cli.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer
from minisgl_cli.types import Completion, Delta, GenerateRequest, RequestStats, SamplingParams, new_request_id

log = logging.getLogger("minisgl.client")


@dataclass
class ModelInfo:
    name: str
    source: str
    device: str
    dtype: str
    attention_backend: str
    max_context_len: int
    kv_tokens: int
    load_s: float


class EngineClient:
    def __init__(self, engine_cfg: EngineConfig | None = None, sched_cfg: SchedulerConfig | None = None):
        self.engine = Engine(engine_cfg or EngineConfig())
        loaded = self.engine.loaded
        self.tokenizer = Tokenizer(loaded.model_dir) if loaded.model_dir is not None else None
        eos = self.tokenizer.eos_token_ids if self.tokenizer else frozenset()
        self.scheduler = Scheduler(self.engine, sched_cfg or SchedulerConfig(), eos_token_ids=eos)
        self.scheduler.start()
        e = self.engine
        self.info = ModelInfo(
            loaded.name, loaded.source, str(e.device), str(e.dtype).removeprefix("torch."), e.attn.name,
            e.max_context_len, e.pool.num_pages * e.pool.page_size, loaded.load_s,
        )

    # --- requests ------------------------------------------------------------------------------
    def input_ids(self, req: GenerateRequest) -> list[int]:
        """Token ids of the request's prompt (chat template applied to messages)."""
        if req.input_ids is not None:
            return list(req.input_ids)
        if self.tokenizer is None:
            raise ValueError("this engine has dummy weights and no tokenizer: send input_ids")
        if req.messages is not None:
            if not req.messages:
                raise ValueError("messages must not be empty")
            return self.tokenizer.apply_chat_template(req.messages)
        return self.tokenizer.encode(req.prompt)

    async def submit(self, req: GenerateRequest) -> AsyncIterator[Delta]:
        """Stream a request's output. Closing the stream early aborts the request."""
        ids = self.input_ids(req)
        loop = asyncio.get_running_loop()
        inbox: asyncio.Queue[list[TokenOutput]] = asyncio.Queue()

        def sink(items: list[TokenOutput]) -> None:
            try:
                loop.call_soon_threadsafe(inbox.put_nowait, items)
            except RuntimeError:  # the consumer's event loop is gone: nobody is listening any more
                pass

        params = req.params
        detok = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens) if self.tokenizer else None
        stopper = StopStringMatcher(list(params.stop))
        stats = RequestStats(prompt_tokens=len(ids))
        t0 = time.perf_counter()
        self.scheduler.add(Req(req.rid, ids, params, sink))
        done = False
        try:
            while not done:
                items = await inbox.get()
                while not inbox.empty():  # a slow consumer gets several tokens in one delta
                    items = items + inbox.get_nowait()
                delta, done = self._delta(req.rid, items, detok, stopper, stats, t0)
                if done and delta.finish_reason == "stop" and items[-1].finish_reason != "stop":
                    self.scheduler.abort(req.rid)  # a stop string ended it: free its KV now
                yield delta
        finally:
            if not done:  # the consumer went away (client disconnect, Ctrl-C): free its KV
                self.scheduler.abort(req.rid)

    def _delta(
        self, rid: str, items: list[TokenOutput], detok: IncrementalDetokenizer | None,
        stopper: StopStringMatcher, stats: RequestStats, t0: float,
    ) -> tuple[Delta, bool]:
        now = time.perf_counter()
        tokens = [o.token_id for o in items if o.token_id is not None]
        last = items[-1]
        if tokens and stats.completion_tokens == 0:
            stats.ttft_s = now - t0
            stats.prefill_s = next((o.prefill_s for o in items if o.prefill_s is not None), stats.ttft_s)
        stats.completion_tokens += len(tokens)
        stats.cached_tokens = last.cached_tokens
        if last.error:
            stats.latency_s = now - t0
            return Delta(rid, error=last.error, stats=stats), True
        reason = last.finish_reason
        text = detok.feed(tokens) if detok else ""
        if reason is not None and detok:
            text += detok.flush()
        text, hit_stop = stopper.push(text)
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            text += stopper.flush()
        if log.isEnabledFor(logging.INFO) and tokens:
            log.info("decode %s: token ids %s -> %r", rid, tokens, text)
        if reason is not None:
            stats.latency_s = now - t0
        return Delta(rid, text, tokens, reason, stats if reason else None), reason is not None

    async def complete(self, req: GenerateRequest) -> Completion:
        """Run a request to the end and return the whole result."""
        parts, ids, final = [], [], None
        async for d in self.submit(req):
            if d.error:
                raise ValueError(d.error)
            parts.append(d.text)
            ids.extend(d.token_ids)
            final = d
        return Completion(req.rid, "".join(parts), ids, final.finish_reason, final.stats)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    # --- cache seeding -------------------------------------------------------------------------
    def insert_prefix(self, prefix: str | list[int]) -> threading.Event:
        """Prefill a prefix into the radix cache in the background; the event is set when cached."""
        ids = self.tokenizer.encode(prefix) if isinstance(prefix, str) else list(prefix)
        done = threading.Event()
        params = SamplingParams(max_new_tokens=1, ignore_eos=True)
        self.scheduler.add(Req(new_request_id("warm"), ids, params, lambda items: done.set()))
        return done

    # --- inspection ----------------------------------------------------------------------------
    def stats(self) -> SchedulerStats:
        box: list[SchedulerStats] = []
        self.scheduler.call(lambda: box.append(self.scheduler.snapshot()), timeout=10)
        return box[0] if box else self.scheduler.stats

    def check_pages(self) -> None:
        """Assert exact KV accounting (free + cached + in use == pool), on the scheduler thread."""
        errors: list[BaseException] = []

        def check() -> None:
            try:
                self.scheduler.check_pages()
            except AssertionError as exc:
                errors.append(exc)

        self.scheduler.call(check, timeout=10)
        if errors:
            raise errors[0]

    def close(self) -> None:
        self.scheduler.stop()
