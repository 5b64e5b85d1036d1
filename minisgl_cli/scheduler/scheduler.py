"""Scheduler: continuous batching over one engine — waiting queue, running set, one decision per step.

Each step either prefills waiting requests under a token budget (long prompts in chunks) or decodes
every running request; new requests join between steps. On CUDA the next step is launched before the
last one's tokens are read (overlap scheduling, see `overlap.py`; `disable_overlap` turns it off). When
pages run short, the prefix cache is evicted first, then the newest running request is retracted (its KV
cached, it re-queues) — nothing is dropped and nothing crashes.
Requests with a grammar (structured output) get a matcher at admission; each step's allowed tokens come
from it (`grammar.py`). With speculative decoding a decode step carries each request's draft tokens as extra rows
and keeps the accepted run (`speculative.py`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import cast

import torch

from minisgl_cli.engine.batch import Mode
from minisgl_cli.engine.engine import Engine
from minisgl_cli.env import disable_overlap_scheduling as overlap_disabled_by_env
from minisgl_cli.messages import (
    AbortRequest,
    AddRequest,
    CheckPagesQuery,
    CheckPagesReply,
    FromScheduler,
    StatsQuery,
    StatsReply,
    StepOutput,
    TokenOutput,
    ToScheduler,
)
from minisgl_cli.sampling.sampler import Sampled
from minisgl_cli.scheduler import speculative
from minisgl_cli.scheduler.cache import CacheManager
from minisgl_cli.scheduler.config import SchedulerConfig
from minisgl_cli.scheduler.grammar import GrammarError, Grammars
from minisgl_cli.scheduler.overlap import Launched, RowLogprobs, feed_input_ids
from minisgl_cli.scheduler.profile import StepProfiler, StepTrace
from minisgl_cli.scheduler.request import DraftBudget, Req
from minisgl_cli.scheduler.speculative import accepted_run
from minisgl_cli.scheduler.stats import RollingRate
from minisgl_cli.types import ErrorCode, FinishReason, ModelInfo, SchedulerStats

log = logging.getLogger("minisgl.scheduler")


class StepFailed(Exception):
    """A step raised (its cause chained): the requests it ran and, with `lost`, that its results could not be read,
    so what the device wrote for it (and for any step after it) is unknown."""

    def __init__(self, reqs: list[Req], lost: bool = False):
        super().__init__(f"a {'read' if lost else 'launch'} of a step of {len(reqs)} requests failed")
        self.reqs, self.lost = reqs, lost


class Scheduler:
    """Reads `ToScheduler` messages from `inbox` between steps; reports through `emit(FromScheduler)`."""

    def __init__(self, engine: Engine, cfg: SchedulerConfig, emit: Callable[[FromScheduler], None],
                 eos_token_ids: frozenset[int] = frozenset()):
        self.engine = engine
        self.cfg = cfg
        self.emit = emit
        spec = engine.spec
        self.cache = CacheManager(engine, cfg.cache)
        self.eos = frozenset(eos_token_ids) | spec.eos_token_ids
        self.max_running = spec.max_requests
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.inbox: queue.SimpleQueue[ToScheduler | None] = queue.SimpleQueue()
        self.stats = SchedulerStats()
        self._prefill_rate, self._decode_rate = RollingRate(), RollingRate(active=True)
        self._accepted_rate = RollingRate(active=True)  # accepted draft tokens
        self._last_was_decode = False
        on = spec.device.type == "cuda" or cfg.overlap_on_cpu
        self.overlap = on and not cfg.disable_overlap and not overlap_disabled_by_env()
        self._inflight: Launched | None = None  # overlap: the launched step whose tokens are unread
        self.grammars = Grammars(spec.model_dir, spec.vocab_size, self.eos, spec.device)
        self.heartbeat = time.monotonic()  # last time the loop came round: a stalled loop stops updating it
        self.proposer = speculative.create_proposer(cfg, engine)  # None: no speculative decoding
        self.trace = StepTrace.from_env()  # None unless MINISGL_STEP_TRACE_DIR is set
        if self.proposer is not None:  # verify steps are decode steps of up to k + 1 rows a request
            engine.decode_rows(self.max_running * (cfg.num_speculative_tokens + 1))

    # --- loop ----------------------------------------------------------------------------------
    def run_forever(self, stop: threading.Event, receive: Callable[[bool], list[ToScheduler]] | None = None) -> None:
        """Step until `stop` is set. `receive(block)` gives the messages to handle before each step (default:
        this scheduler's inbox; TP ranks pass one that keeps every rank's messages identical)."""
        receive = receive or self.drain
        self.engine.start_serving()
        self.grammars.prepare()
        profiler = StepProfiler.from_env(self.engine.spec.device)
        while not stop.is_set():
            self.heartbeat = time.monotonic()
            msgs = receive(not (self.waiting or self.running or self._inflight))
            if stop.is_set():  # set while receiving (TP ranks learn rank 0's stop there): no step after it
                break
            for msg in msgs:
                self.handle(msg)
            try:
                busy = bool(self.waiting or self.running)
                if not busy and self.trace is not None:
                    self.trace.flush()  # idle: the run so far is on disk
                self.step()
                if busy:
                    profiler.busy_step_done()
            except Exception as exc:  # a bug or a fault must not kill the loop: fail what it touched, go on
                log.exception("scheduler step failed")
                self.recover(exc)
        # Stopped: hand every page back, the prefix cache's too (the engine may serve a next scheduler). Whoever
        # stopped the loop ends the requests' streams; a step still in flight on the GPU finishes before any later
        # use of its pages (one stream).
        self._inflight = None
        for req in list(self.running) + list(self.waiting):
            self._release(req, "abort")
        self.cache.clear()
        if self.trace is not None:
            self.trace.close()
        self.grammars.close()
        if self.proposer is not None:
            self.proposer.close()

    def drain(self, block: bool) -> list[ToScheduler]:
        """Every message in the inbox (waiting up to 0.5 s for the first one if `block`); None only wakes."""
        msgs: list[ToScheduler] = []
        try:
            msg = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            while True:
                if msg is not None:
                    msgs.append(msg)
                msg = self.inbox.get_nowait()
        except queue.Empty:
            return msgs

    def recover(self, exc: Exception) -> None:
        """After a step raised: end what it touched with an engine error, keep the prefix cache exact, go on.

        A step that raised while launching (`StepFailed`, not `lost`) had its requests' KV lengths put back to
        before it, so they cache only KV earlier steps wrote; those requests fail and every other one goes on (a step
        still in flight is read next step as usual). A step whose results could not be read (`lost`: on CUDA, a device
        fault) leaves no KV it or any later step wrote trustworthy, and the prefix cache holds pages it inserted at
        launch: every request fails and the cache is emptied. Any other exception (scheduling, reading outputs) fails
        every request; their KV up to their known tokens was computed by steps already read."""
        failed = exc.reqs if isinstance(exc, StepFailed) and not exc.lost else None
        if failed is None:
            self._inflight = None
            failed = list(self.running) + list(self.waiting)
        for req in failed:
            if not req.done:
                self._finish(req, None, error="internal error in the engine step (see server log)",
                             code=ErrorCode.ENGINE_FAILED)
        if isinstance(exc, StepFailed) and exc.lost:
            self.cache.clear()

    def handle(self, msg: ToScheduler) -> None:
        if isinstance(msg, AddRequest):
            self._enqueue(Req(msg.rid, msg.input_ids, msg.params, images=msg.images))
        elif isinstance(msg, AbortRequest):
            self._abort(msg.rid, msg.reason)
        elif isinstance(msg, StatsQuery):
            self.emit(StatsReply(msg.qid, self.snapshot()))
        elif isinstance(msg, CheckPagesQuery):
            try:
                self.check_pages()
                self.emit(CheckPagesReply(msg.qid, None))
            except AssertionError as exc:
                self.emit(CheckPagesReply(msg.qid, str(exc) or "KV page accounting is off"))
        else:
            raise TypeError(f"unknown scheduler message {type(msg).__name__}")

    def _enqueue(self, req: Req) -> None:
        bound = self.cfg.max_queued_requests
        if bound and len(self.waiting) >= bound:  # what bypasses the server's cap (LLM, in-process) stays bounded
            self._finish(req, None, error=f"overloaded: {bound} requests are waiting already (--max-queued-requests); "
                         "retry shortly", code=ErrorCode.OVERLOADED)
            return
        # Our clients admitted it (admission.py: the prompt where it was tokenized, the parameters where it was sent):
        # trusted, but for this O(1) guard against a bug of ours, which the page and budget arithmetic rely on.
        if not 0 < len(req.input_ids) < self.engine.spec.max_context_len:
            self._finish(req, None, error=f"internal error: a prompt of {len(req.input_ids)} tokens reached the "
                         "scheduler unadmitted", code=ErrorCode.ENGINE_FAILED)
            return
        try:
            self.engine.load_images(req.images)
        except ValueError as exc:  # its images: pixels gone, or a model that takes none
            self._finish(req, None, error=str(exc))
            return
        p = req.params
        req.stop_ids = frozenset(p.stop_token_ids) if p.ignore_eos else self.eos.union(p.stop_token_ids)
        req.max_output = min(p.max_new_tokens, self.engine.spec.max_context_len - len(req.input_ids))
        if p.max_new_tokens == 0:
            self._finish(req, "length")
        elif req.params.constrained and not self._compile(req):
            return
        else:
            if self.proposer is not None:
                req.draft = DraftBudget(self.cfg.num_speculative_tokens,
                                        pauses=self.overlap or not self.proposer.free)
            self.waiting.append(req)

    def _compile(self, req: Req) -> bool:
        try:
            req.grammar = self.grammars.matcher(req.params)
            return True
        except GrammarError as exc:
            self._finish(req, None, error=str(exc))
            return False

    def _abort(self, rid: str, reason: FinishReason = "abort") -> None:
        for req in list(self.waiting) + self.running:
            if req.rid == rid:
                self._finish(req, reason)
                return

    def step(self) -> None:
        if self._inflight is not None and self._may_draft():
            # Proposals need every token on the host: read the step in flight first (this step does not overlap).
            unread, self._inflight = self._inflight, None
            self._process(unread)
        batch = self._schedule()
        launched = self._launch(*batch) if batch is not None else None
        if not self.overlap or (launched is not None and launched.drafts is not None):
            if launched is not None:  # a verify step's accepted lengths decide the next step: read it now
                self._process(launched)
            return
        # Overlap: read the previous step's tokens while the GPU runs the one just launched (unless
        # `_launch` already had to, see there).
        prev, self._inflight = self._inflight, launched
        if prev is not None:
            self._process(prev)

    def _may_draft(self) -> bool:
        """Whether a running request would ask for drafts in a decode step now."""
        return any(r.draft is not None and r.draft.wants(len(r.output_ids)) for r in self.running)

    def _schedule(self) -> tuple[Mode, list[Req], list[int], list[list[int]] | None] | None:
        prefill_turn = self.cfg.policy == "prefill-first" or self._last_was_decode or not self.running
        if self.waiting and prefill_turn:
            batch = self._prefill_batch()
            if batch is not None:
                return batch
        if self.running:
            return self._decode_batch()
        return None

    def _prefill_batch(self) -> tuple[Mode, list[Req], list[int], None] | None:
        budget = self.cfg.max_prefill_tokens
        reqs: list[Req] = []
        lens: list[int] = []
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(reqs) >= self.max_running:
                break
            if req.req_row is None:
                if any(r.key_ids == req.key_ids for r in reqs):
                    continue  # the same prompt (n > 1 choices): next step, from the cache this step fills
                if not self.cache.attach(req):
                    break
                assert req.req_row is not None  # attach gave it a row
                self.engine.set_sampling_row(req.req_row, req.params, req.input_ids, req.output_ids)
                self.engine.set_image_row(req.req_row, req.input_ids, req.images)
                if not req.matched:
                    self._count_match(req)
            n = self.cache.prefill_cut(req, min(req.remaining_prefill, budget))
            # Keep one page per running request free for its next decode step.
            reserve = len(self.running) + len(reqs)
            ok = False
            if self.cache.available_pages - reserve >= -(-n // self.cache.page_size):
                ok = self.cache.reserve(req, n)
            if not ok:
                if req.kv_len == req.prefix_len:  # no progress held: give the slot back, retry later
                    self.cache.release(req, cache=False)
                if not reqs and not self.running and req.kv_len == 0:
                    self.waiting.remove(req)
                    self._finish(req, None, error="the request needs more KV cache than the pool holds",
                                 code=ErrorCode.CONTEXT_LENGTH)
                    continue
                break
            reqs.append(req)
            lens.append(n)
            budget -= n
        return ("prefill", reqs, lens, None) if reqs else None

    def _count_match(self, req: Req) -> None:
        req.matched = True
        req.prefill_started_at = time.perf_counter()
        req.cached_tokens = req.prefix_len
        self.stats.add(cache_hit_tokens=req.prefix_len, cache_miss_tokens=len(req.input_ids) - req.prefix_len,
                       cache_hit_requests=int(req.prefix_len > 0), cache_miss_requests=int(req.prefix_len == 0))

    def _decode_batch(self) -> tuple[Mode, list[Req], list[int], list[list[int]] | None] | None:
        retracted = False
        # Most steps: one allocation covers every request's next token. Otherwise request by request, making room.
        for req in [] if self.cache.reserve_each(self.running, 1) else list(self.running):
            if retracted and req not in self.running:
                continue  # retracted below while making room
            while not self.cache.reserve(req, 1):
                victim = max(self.running, key=lambda r: r.arrival)
                if victim is req and len(self.running) == 1:
                    if self._pending(req):
                        return None  # its last token is still on the device: decide once it is read
                    self._finish(req, "length")  # alone and still out of room: the pool is its limit
                    break
                self._retract(victim)
                retracted = True
                if victim is req:
                    break
        if not self.running:
            return None
        reqs = list(self.running)
        drafts = self._drafts(reqs) if self.proposer is not None and self._inflight is None else None
        return "decode", reqs, [1] * len(reqs), drafts

    def _drafts(self, reqs: list[Req]) -> list[list[int]] | None:
        """Each request's drafts for this step (None when none has any): as many as its budget asks, short of its
        max_new_tokens and the context (the token after the drafts comes too), trimmed to what its grammar allows,
        and only where pages for them can be had (no retraction for drafts)."""
        assert self.proposer is not None
        limit = self.engine.spec.max_context_len
        asks = []
        for r in reqs:
            assert r.draft is not None  # every request of a speculating scheduler has one
            asks.append(min(r.draft.wants(len(r.output_ids)), r.params.max_new_tokens - len(r.output_ids) - 1,
                            limit - r.seq_len - 1))
        chosen = [i for i, n in enumerate(asks) if n > 0]
        if not chosen:
            return None
        drafts: list[list[int]] = [[] for _ in reqs]
        proposed = self.proposer.propose([reqs[i] for i in chosen], [asks[i] for i in chosen])
        for i, d in zip(chosen, proposed):
            req = reqs[i]
            d = d[: asks[i]]
            if d and req.grammar is not None:
                d = self.grammars.trim(req.grammar, d)
            if d and self.cache.reserve(req, 1 + len(d)):
                drafts[i] = d
            elif not d:
                assert req.draft is not None
                req.draft.found_none(len(req.output_ids))
        return drafts if any(drafts) else None

    def _retract(self, req: Req) -> None:
        """Free a running request's pages (caching its KV) and queue it first for re-prefill."""
        self.running.remove(req)
        self.cache.release(req)
        self.waiting.appendleft(req)
        self.stats.add(retracted_requests=1)
        log.info("retract %s (%d tokens) to free KV pages", req.rid, req.seq_len)

    def _pending(self, req: Req) -> bool:
        """Whether the launched-but-unread step sampled a token for `req` (overlap only)."""
        return self._inflight is not None and id(req) in self._inflight.rows

    def _launch(self, mode: Mode, reqs: list[Req], lens: list[int], drafts: list[list[int]] | None = None) -> Launched:
        """Build the step's batch on the host, have its page-table rows written, and start it on the device. A decode
        step with `drafts` (per request) is a verify step: a request with k drafts takes k + 1 decode rows."""
        if mode == "prefill" and log.isEnabledFor(logging.INFO):
            log.info("prefill: %d req, %d tokens (%s)", len(reqs), sum(lens),
                     ", ".join(f"{r.rid}: +{n} after {r.kv_len} cached" for r, n in zip(reqs, lens)))
        before = [r.kv_len for r in reqs]
        try:
            sampled, produces, hidden = self._run(mode, reqs, lens, drafts)
        except Exception as exc:
            # Nothing this step wrote is known to be written: its requests' KV ends where it began (what a release
            # caches), and the pages it reserved are freed with them.
            for req, kv_len in zip(reqs, before):
                req.kv_len = kv_len
            if isinstance(exc, StepFailed):  # reading the step in flight failed inside it: that failure says more
                raise
            raise StepFailed(reqs) from exc
        if mode == "prefill":  # after the launch: the step still writes the pages this may free
            for req in reqs:
                self.cache.cache_prefilled(req)
        step = Launched.start(mode, reqs, lens, produces, sampled, self.engine,
                              async_copy=self.overlap and drafts is None, drafts=drafts)
        step.starts, step.hidden = before, hidden
        return step

    def _run(self, mode: Mode, reqs: list[Req], lens: list[int],
             drafts: list[list[int]] | None) -> tuple[Sampled, list[bool], torch.Tensor | None]:
        """`_launch`'s work up to the device: the step's rows (raising each request's kv_len to what it will have
        computed), its page-table writes, the forward and the sampling; the sampled ids, which requests produce and
        the rows' hidden states (where the engine keeps them)."""
        prev_rows = self._inflight.rows if self._inflight is not None else {}
        ids: list[int] = []
        locs: list[int] = []
        starts: list[int] = []
        row_slots: list[int] = []  # decode: each row's page-table row (a verify step repeats a request's)
        src: list[int] = []  # decode: row of the in-flight step that sampled the request's input, or -1
        produces: list[bool] = []
        slots_of = self.cache.slots
        for i, (req, n) in enumerate(zip(reqs, lens)):
            start = req.kv_len
            assert req.req_row is not None  # each scheduled request holds a slot
            if mode == "decode":
                extra = drafts[i] if drafts is not None else []
                n_rows = 1 + len(extra)
                row = prev_rows.get(id(req), -1)  # never for a verify step: it runs with no step in flight
                src.append(row)
                prompt = len(req.input_ids)
                if row >= 0:
                    ids.append(0)  # sampled by the in-flight step: gathered on the device below
                else:
                    ids.append(req.input_ids[start] if start < prompt else req.output_ids[start - prompt])
                ids += extra
                starts += range(start, start + n_rows)
                row_slots += [req.req_row] * n_rows
                locs += slots_of(req, start, start + n_rows)
                produces.append(True)
                req.kv_len = start + n_rows
            else:
                starts.append(start)
                locs += slots_of(req, start, start + n)
                ids += req.all_ids[start : start + n]
                produces.append(start + n >= req.seq_len)
                req.kv_len = start + n
        engine = self.engine
        req_rows = cast(list[int], [r.req_row for r in reqs])
        if mode == "decode":
            fb = engine.build_batch(mode, ids, row_slots, starts, [1] * len(ids), locs)
            if drafts is not None:
                fb.runs = [1 + len(d) for d in drafts]
        else:
            fb = engine.build_batch(mode, ids, req_rows, starts, lens, locs)
        self.cache.write_rows(fb, locs)
        if prev_rows and any(r >= 0 for r in src):
            assert self._inflight is not None and drafts is None  # prev_rows came from it; src is per row then
            fb.input_ids = feed_input_ids(fb.input_ids, src, self._inflight, engine)
        if mode == "prefill":
            for req, done_prefill in zip(reqs, produces):
                if done_prefill and req in self.waiting:
                    self.waiting.remove(req)
                    self.running.append(req)
        else:
            req_rows, row_produces = row_slots, [True] * len(ids)
        self._last_was_decode = mode == "decode"
        rows = engine.sampling_batch(fb, req_rows, produces if mode == "prefill" else row_produces, drafts)
        if any(src_row >= 0 and r.grammar is not None for src_row, r in zip(src, reqs)):
            # A grammar depends on the token the in-flight step is still sampling: run the forward, read
            # that step while it runs (the CPU work still overlaps), then mask and sample.
            logits = engine.forward(fb)
            unread, self._inflight = self._inflight, None
            assert unread is not None  # the src rows came from it
            self._process(unread)
            sampled = engine.sample(logits, rows, self._bitmask(reqs, produces, drafts))
        else:
            sampled = engine.step(fb, rows, self._bitmask(reqs, produces, drafts))
        if self.trace is not None:
            self.trace.record(mode, len(reqs), len(ids), len(self.running), len(self.waiting))
        return sampled, produces, fb.hidden

    def _bitmask(self, reqs: list[Req], produces: list[bool], drafts: list[list[int]] | None) -> torch.Tensor | None:
        """The grammar rows' allowed next tokens (None when no request in the step has a grammar)."""
        return self.grammars.bitmask([(r.grammar if p and not r.done else None, drafts[i] if drafts else [])
                                      for i, (r, p) in enumerate(zip(reqs, produces))])

    def _process(self, step: Launched) -> None:
        """Read a step's tokens (the one wait on the device), append them, stop finished requests. A verify step's
        request appends its accepted run (stopping inside it where a token ends the request) and gives the KV of its
        rejected drafts back."""
        try:
            tokens, logprobs = step.read()
        except Exception as exc:
            raise StepFailed(step.reqs, lost=True) from exc
        now = time.perf_counter()
        out: list[TokenOutput] = []
        emitted = accepted = 0
        row = 0
        runs: list[int] = []  # a verify step's drafts accepted, per request
        if step.drafts is not None:
            for d in step.drafts:
                runs.append(accepted_run(d, tokens[row : row + len(d)]))
                row += 1 + len(d)
            row = 0
            self.engine.commit_verify([1 + n for n in runs])  # linear-attention states advance over the kept rows
        if step.hidden is not None and self.proposer is not None:
            self._observe(step, runs)
        for i, (req, produced) in enumerate(zip(step.reqs, step.produces)):
            drafts = step.drafts[i] if step.drafts is not None else []
            first, row = row, row + 1 + len(drafts)
            if not produced or req.done:
                continue  # a prompt chunk, or the extra token of a request that finished one step earlier
            n = runs[i] if drafts else 0
            if drafts:
                req.kv_len -= len(drafts) - n  # rejected drafts: their KV is given back
                self.cache.rewind(req)
                assert req.draft is not None  # it proposed
                req.draft.update(len(drafts), n, len(req.output_ids) + n + 1)
                self.stats.add(spec_verifies=1, spec_draft_tokens=len(drafts), spec_accepted_tokens=n)
                accepted += n
            for j in range(first, first + n + 1):
                tok = tokens[j]
                first_token = not req.output_ids
                req.output_ids.append(tok)
                emitted += 1
                error = None
                if req.grammar is not None and not req.grammar.accept_token(tok):
                    error = f"internal error: the grammar rejected token {tok} it had allowed"
                reason = self._stop_reason(req, tok)
                o = TokenOutput(req.rid, tok, reason, len(req.input_ids), req.cached_tokens, error,
                                now - req.prefill_started_at if first_token else None,
                                error_code=ErrorCode.ENGINE_FAILED if error is not None else None,
                                drafted=j < first + n)
                if logprobs and j in logprobs:
                    _attach_logprobs(o, logprobs[j], req.params.top_logprobs)
                out.append(o)
                if error is not None:
                    reason = "abort"
                if reason is not None:
                    self._release(req, reason)
                    break
        if step.drafts is not None:
            log.info("verify: %d req, %d drafts, %d accepted", len(step.reqs), sum(map(len, step.drafts)), accepted)
        self._account(step.mode, step.lens, emitted, accepted, now)
        if out:
            self._emit_outputs(out)

    def _observe(self, step: Launched, runs: list[int]) -> None:
        """Hand the proposer each request's rows the step kept (an MTP proposer's input: a prompt chunk's rows, a
        decode row, a verify step's row and its accepted drafts'), before any of them finishes."""
        assert step.hidden is not None and self.proposer is not None
        first = 0  # the request's first row in step.hidden
        for i, req in enumerate(step.reqs):
            drafts = step.drafts[i] if step.drafts is not None else []
            rows = step.lens[i] if step.mode == "prefill" else 1 + len(drafts)
            if not req.done:
                kept = 1 + runs[i] if drafts else rows
                self.proposer.observe(req, step.starts[i], step.hidden[first : first + kept])
            first += rows

    def _stop_reason(self, req: Req, tok: int) -> FinishReason | None:
        if tok in req.stop_ids:
            return "stop"
        if req.grammar is not None and req.grammar.is_terminated():
            return "stop"  # the grammar is complete (and accepted a stop token)
        if len(req.output_ids) >= req.max_output:
            return "length"
        return None

    def _release(self, req: Req, reason: FinishReason) -> None:
        req.done = True
        if req in self.running:
            self.running.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        self.cache.release(req, state_ok=reason != "abort")  # an error's abort may have left a step half done
        if self.proposer is not None:
            self.proposer.release(req)
        self.engine.drop_images(req.images)
        self.stats.finished_requests += 1
        self.stats.aborted_requests += reason == "abort"

    def _finish(self, req: Req, reason: FinishReason | None, error: str | None = None,
                code: ErrorCode = ErrorCode.INVALID_REQUEST) -> None:
        """End a request outside a step's output (abort, error: `code` says what kind) and report it."""
        self._release(req, reason or "abort")
        self._emit_outputs([TokenOutput(req.rid, None, reason, len(req.input_ids), req.cached_tokens, error,
                                        error_code=code if error is not None else None)])

    def _emit_outputs(self, outputs: list[TokenOutput]) -> None:
        """A consumer that fails must not take the scheduler loop down with it."""
        try:
            self.emit(StepOutput(outputs))
        except Exception:
            log.exception("dropping a step's output (%d requests): its consumer failed", len(outputs))

    def _account(self, mode: str, lens: list[int], emitted: int, accepted: int, now: float) -> None:
        s = self.stats
        s.add(steps=1)
        if mode == "prefill":
            s.prefill_tokens += sum(lens)
            self._prefill_rate.add(sum(lens), now)
        else:
            s.decode_tokens += emitted
            self._decode_rate.add(emitted, now)
            if self.proposer is not None:
                self._accepted_rate.add(accepted, now)

    # --- inspection (on the scheduler's own thread: queries arrive as messages) -----------------
    def snapshot(self) -> SchedulerStats:
        s = self.stats
        tree, p = self.cache.tree, self.cache.page_size
        s.waiting, s.running = len(self.waiting), len(self.running)
        s.tokens_total = self.cache.num_pages * p
        s.tokens_free = self.cache.num_free_pages * p
        s.tokens_cached = tree.cached_tokens
        s.tokens_in_use = self.cache.pages_in_use(self.running + list(self.waiting)) * p
        spec = self.engine.spec
        s.window_tokens_total = spec.num_window_pages * p
        s.window_tokens_free = self.engine.num_free_window_pages * p
        full, window = spec.page_bytes
        s.kv_bytes_total = spec.num_pages * full + spec.num_window_pages * window
        s.kv_bytes_used = s.kv_bytes_total - (self.cache.num_free_pages * full
                                              + self.engine.num_free_window_pages * window)
        s.state_slots_total, s.state_slots_free = self.cache.num_state_slots, self.engine.num_free_state_slots
        s.prefill_tok_s, s.decode_tok_s = self._prefill_rate.rate(), self._decode_rate.rate()
        s.spec_accepted_tok_s = self._accepted_rate.rate()
        s.decode_compiling = int(self.engine.compiling)
        s.decode_compiled = int(self.engine.decode_step == "compiled")
        s.images_encoded, s.image_cache_hits, s.vision_s = self.engine.vision_stats()
        return SchedulerStats(**{k: getattr(s, k) for k in s.__dataclass_fields__})

    def model_info(self) -> ModelInfo:
        """What a front may know of the engine this scheduler drives (in whichever process they live)."""
        spec = f"{self.proposer.name} k={self.cfg.num_speculative_tokens}" if self.proposer is not None else ""
        return self.engine.model_info(overlap=self.overlap, eos_token_ids=self.eos, speculative=spec,
                                      prefix_cache=None if self.cfg.cache == "naive" else "radix")  # naive reuses none

    def check_pages(self) -> None:
        self.cache.check(self.running + list(self.waiting))


def _attach_logprobs(o: TokenOutput, lp: RowLogprobs, top_n: int) -> None:
    o.logprob = lp[0]
    if top_n:
        o.top_ids, o.top_logprobs = lp[1][:top_n], lp[2][:top_n]
