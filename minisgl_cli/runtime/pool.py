"""EnginePool: data parallelism — one EngineClient over N engine replicas, each request routed to one of them.

Each replica is a whole engine with its own scheduler process(es) and devices (a RemoteClient); the `Dispatcher`
(dispatch.py) picks one per request by --dispatch, never one at its MAX_INFLIGHT_PER_ENGINE cap
(`routing.Busy` past it on all: the server answers 429). Prompts are tokenized first (by one replica's
tokenizer worker, in turn) so cache_aware matches the token ids each replica's radix cache will see: their ids come
back to this process (launch.py turns the replicas' `keep_prompts` off), and go to whichever replica serves them.

A replica that dies is taken out: the rest of its processes are stopped, its open streams end with an error,
and a request that had no output yet is retried on another replica; the pool serves on with the others and
fails (`failure()`) only once every replica is gone. Stats are the replicas' sum, each replica's own beside.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Sequence

from minisgl_cli.admission import AdmissionError
from minisgl_cli.client.protocol import EngineClient, EngineGone, PrefixWarm
from minisgl_cli.dispatch import Dispatcher, NoReplica
from minisgl_cli.types import Delta, GenerateRequest, Prompt, ReplicaStats, RequestStats, SchedulerStats

log = logging.getLogger("minisgl.runtime")


class EnginePool:
    def __init__(self, replicas: Sequence[EngineClient], mode: str = "rr", cap: int | None = None,
                 seed: int | None = None):
        self.replicas = list(replicas)
        infos = [r.info for r in replicas]
        kv = [i.kv_tokens or 0 for i in infos]  # replicas are our engine's (--dp refuses hf and mlx): a KV pool each
        self.info = dataclasses.replace(infos[0], max_running=sum(i.max_running for i in infos), kv_tokens=sum(kv),
                                        dp_size=len(replicas))
        self.dispatcher = Dispatcher(len(replicas), mode, cap, capacity=[i.max_running for i in infos], tree_items=kv,
                                     seed=seed)
        self.out: list[str | None] = [None] * len(replicas)  # why each replica is out (None: serving)
        self._where: dict[str, int] = {}  # request id -> the replica serving it
        self._turn = itertools.count()  # whose tokenizer is next
        self._lock = threading.Lock()

    # --- replicas --------------------------------------------------------------------------------
    def take_out(self, i: int, reason: str) -> None:
        """Replica i is gone (from any thread; once): route around it and stop the rest of its processes."""
        with self._lock:
            if self.out[i] is not None:
                return
            self.out[i] = reason
        self.dispatcher.set_up(i, False)
        serving = self.out.count(None)
        log.error("minisgl: replica %d is out (%s); %d of %d replicas serving", i, reason, serving, len(self.out))
        threading.Thread(target=self.replicas[i].close, name=f"minisgl-close-replica-{i}", daemon=True).start()

    def _serving(self) -> list[int]:
        """The replicas still up (noticing any that died since the last look)."""
        for i, r in enumerate(self.replicas):
            if self.out[i] is None and (reason := r.failure()) is not None:
                self.take_out(i, reason)
        return [i for i, why in enumerate(self.out) if why is None]

    def _gone(self, i: int) -> bool:
        """Whether replica i has died (taking it out if that is news)."""
        reason = self.replicas[i].failure()
        if reason is not None:
            self.take_out(i, reason)
        return self.out[i] is not None

    # --- requests --------------------------------------------------------------------------------
    async def submit(self, req: GenerateRequest) -> AsyncGenerator[Delta, None]:
        try:
            prompt = await self.prompt(req)
        except AdmissionError as exc:  # a stream of one error, as a replica's own refusal
            yield Delta(req.rid, error=exc.message, error_code=exc.code, error_param=exc.param,
                        stats=RequestStats(latency_s=0.0))
            return
        ids = prompt.ids
        tried: set[int] = set()
        while True:
            self._serving()
            try:
                i = self.dispatcher.pick(ids, tried)
            except NoReplica:
                raise EngineGone(self.failure() or "no replica left to try") from None
            self._where[req.rid] = i
            finished = False
            started = False
            try:
                async with contextlib.aclosing(self.replicas[i].submit(GenerateRequest(
                        tokenized=prompt, params=req.params, rid=req.rid, prompt_param=req.prompt_field))) as stream:
                    async for delta in stream:
                        if delta.error and not started and self._gone(i):
                            break  # it died before this request got anything: another replica takes it
                        started = True
                        if delta.finished:
                            finished = True
                            self.dispatcher.done(i)  # before the consumer sees the end, so a new request finds the slot
                        yield delta
                    else:
                        return
            except RuntimeError:
                if started or not self._gone(i):
                    raise  # not a dead replica's refusal at the start
            finally:
                if not finished:
                    self.dispatcher.done(i)
                self._where.pop(req.rid, None)
            log.warning("minisgl: request %s retried: replica %d died before it started", req.rid, i)
            tried.add(i)

    async def tokenize(self, req: GenerateRequest) -> list[int]:
        if req.input_ids is not None:
            return list(req.input_ids)
        return (await self.prompt(req)).ids

    async def prompt(self, req: GenerateRequest) -> Prompt:
        while serving := self._serving():
            i = serving[next(self._turn) % len(serving)]
            try:
                return await self.replicas[i].prompt(req)
            except RuntimeError:
                if not self._gone(i):
                    raise
        raise EngineGone(str(self.failure()))

    def abort(self, rid: str) -> None:
        i = self._where.get(rid)
        for j in [i] if i is not None else self._serving():
            self.replicas[j].abort(rid)

    def insert_prefix(self, prefix: str | list[int]) -> PrefixWarm:
        """Prefill the prefix into every replica's cache; done once every replica has it. (cache_aware's trees
        leave it out: on every replica alike, it changes no choice.)"""
        warms = [self.replicas[i].insert_prefix(prefix) for i in self._serving()]
        if not warms:
            raise EngineGone(str(self.failure()))
        both = PrefixWarm(warms[0].tokens)

        def wait_all() -> None:
            for w in warms:
                w.wait()
            both.done.set()

        threading.Thread(target=wait_all, name="minisgl-warm-replicas", daemon=True).start()
        return both

    # --- figures and health ----------------------------------------------------------------------
    def stats(self, timeout: float = 10.0) -> SchedulerStats:
        """The replicas' sum (those serving), each replica's own in `.replicas`."""
        serving = set(self._serving())
        per = []
        for i, r in enumerate(self.replicas):
            stats = None
            if i in serving:
                with contextlib.suppress(TimeoutError, RuntimeError):  # it died or stalled just now
                    stats = r.stats(timeout)
            per.append(ReplicaStats(i, i in serving, self.dispatcher.routed[i], self.dispatcher.load[i], stats))
        total = SchedulerStats.total([p.stats for p in per if p.stats is not None])
        total.replicas = per
        return total

    def check_pages(self, timeout: float = 10.0) -> None:
        for i in self._serving():
            self.replicas[i].check_pages(timeout)

    def healthy(self) -> bool:
        return any(self.replicas[i].healthy() for i in self._serving())

    def failure(self) -> str | None:
        """None while any replica serves; once every one is gone, why each went."""
        if self._serving():
            return None
        return "every replica is gone: " + "; ".join(why for why in self.out if why)

    def close(self) -> None:
        """Stop every replica side by side (each within 5 s, so all of them within 5 s too)."""
        closing = [threading.Thread(target=r.close, name="minisgl-close-replica") for r in self.replicas]
        for t in closing:
            t.start()
        for t in closing:
            t.join()
