"""MtpProposer: speculative decoding with the model's own multi-token-prediction layer (`--speculative-algorithm
mtp`: DeepSeek-V3's, Qwen3-Next's, Qwen3.5's; models/mtp.py), run by an engine of its own beside the target's, on a
one-layer KV pool.

The target's engine keeps every row's hidden state (`Engine.keep_hidden_states`); the scheduler hands each step's
kept rows here (`observe`: a prompt chunk's, a decode step's row, a verify step's accepted rows). The MTP layer's row
at position q takes token q + 1 and the target's state at q, so once a request's last token t_n is known every row up
to n - 1 can be written. A proposal writes the rows not written yet in one forward (its last row's logits give the
first draft): an extend, or where they are few (after a verify: 1 + the drafts accepted) decode rows, one a token,
which on CUDA replay a graph. It then chains: the draft and the MTP layer's own output go in as the next row's token
and state, one decode step a draft. Those chain rows are given back before the next proposal; the rows from the
target's states stay.

A request's MTP rows start at the first position whose state this proposer saw (a prompt's first uncached token): a
cached prefix's states were computed by another request and are not kept, so its rows attend over what follows it
only (RoPE scores depend on distances alone, so the rows sit at positions counted from there). Drafts are greedy
(q = 1: scheduler/speculative.py's rule keeps the output exactly the target's).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from minisgl_cli.scheduler.cache import CacheManager
from minisgl_cli.scheduler.draft_model import take_slots
from minisgl_cli.scheduler.request import Req

if TYPE_CHECKING:
    from minisgl_cli.engine.batch import Mode
    from minisgl_cli.engine.engine import Engine


FLUSH_ROWS = 512  # a prompt's states are written once this many wait (bounds what a long prompt holds)
# An extend of at most this many rows (on CUDA: as many as the decode graphs take) runs as decode rows, one a token,
# each over its request's page-table row up to its own position: on CUDA a graph's replay, not an eager extend
# (DeepSeek-V3's MTP extend took 6.2 ms eagerly on an H200, a decode row 1.1: docs/benchmarks.md).
DECODE_FORM_ROWS = 8


@dataclass
class _Track:
    """One request's MTP rows: `shadow` (in the MTP engine's cache) holds them at positions 0.. for the request's
    base.. ; the first `done` are the target's states' (kept), any after them the last proposal's chain."""

    shadow: Req
    base: int
    done: int = 0
    pending: torch.Tensor | None = None  # the target's states for positions base + done.. not written yet

    @property
    def seen(self) -> int:
        """The next position whose state is not here yet."""
        return self.base + self.done + (0 if self.pending is None else self.pending.shape[0])


class MtpProposer:
    """The `mtp` proposer (see the module docstring)."""

    name = "mtp"
    free = False

    def __init__(self, target: Engine):
        self.engine = target.mtp_engine()
        target.keep_hidden_states()
        self.cache = CacheManager(self.engine, "naive")
        self.tracks: dict[str, _Track] = {}

    def observe(self, req: Req, start: int, hidden: torch.Tensor) -> None:
        t = self.tracks.get(req.rid)
        if t is not None and not t.base + t.done <= start <= t.seen:
            if t.base <= start < t.base + t.done:  # rows computed again (a failed step, a retracted request): redo
                t.done, t.pending = start - t.base, None
            else:  # a gap (positions whose states it never saw) or before its base: start over from here
                self.release(req)
                t = None
        if t is None:
            shadow = Req(req.rid, [], req.params)
            if not self.cache.attach(shadow):
                return  # no row in the MTP engine's page table now: no drafts for it
            t = self.tracks[req.rid] = _Track(shadow, base=start)
        kept = 0 if t.pending is None else start - t.base - t.done
        t.pending = hidden if not kept else torch.cat((t.pending[:kept], hidden))  # type: ignore[index]
        # A long prompt's states are written as its chunks come (each row's next token is a prompt token), not held
        # to its first proposal; the last one waits for it.
        ready = min(t.pending.shape[0], len(req.all_ids) - 1 - t.base - t.done) - 1
        if ready >= FLUSH_ROWS:
            self._write([(t, req.all_ids, ready)])

    def _write(self, work: list[tuple[_Track, list[int], int]]) -> list[tuple[int, torch.Tensor] | None]:
        """Write the first n pending rows of each track (`work`: the track, its request's tokens, n) in one extend,
        after giving back the last proposal's chain rows: per track its last row's greedy token and output, or None
        where the pool had no room (its rows stay pending)."""
        rows = []
        for t, ids, n in work:
            t.shadow.kv_len = t.done
            self.cache.rewind(t.shadow)
            del t.shadow.input_ids[t.done:]
            q = t.base + t.done
            assert t.pending is not None
            rows.append((t, ids[q + 1 : q + 1 + n], t.pending[:n]))
        out = self._rows("prefill", rows)
        for (t, _, n), got in zip(work, out):
            if got is not None:
                assert t.pending is not None
                t.done += n
                t.pending = t.pending[n:].clone() if n < t.pending.shape[0] else None  # not the whole chunk's
        return out

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in reqs]
        work: list[tuple[int, _Track, list[int], int]] = []  # (index, track, its tokens, its rows to write)
        for i, req in enumerate(reqs):
            t = self.tracks.get(req.rid)
            ids = req.all_ids
            # every state up to the last token's position - 1 seen, and one row at least to write
            if t is None or t.pending is None or t.seen != len(ids) - 1:
                continue
            work.append((i, t, ids, t.pending.shape[0]))
        if not work:
            return out
        firsts = self._write([(t, ids, n) for _, t, ids, n in work])
        chains: dict[int, list[int]] = {}
        live: list[tuple[int, _Track, torch.Tensor]] = []
        for (i, t, _, _), first in zip(work, firsts):
            if first is not None:
                chains[i] = [first[0]]
                if budgets[i] > 1:
                    live.append((i, t, first[1]))
        while live:
            nexts = self._rows("decode", [(t, [chains[i][-1]], state) for i, t, state in live])
            step: list[tuple[int, _Track, torch.Tensor]] = []
            for (i, t, _), nxt in zip(live, nexts):
                if nxt is not None:
                    chains[i].append(nxt[0])
                    if len(chains[i]) < budgets[i]:
                        step.append((i, t, nxt[1]))
            live = step
        for i, chain in chains.items():
            out[i] = chain
        return out

    def _rows(self, mode: Mode, work: list[tuple[_Track, list[int], torch.Tensor]]
              ) -> list[tuple[int, torch.Tensor] | None]:
        """One forward of the MTP layer over each track's rows (`work`: the track, the rows' tokens, their input
        states): per track its last row's greedy token and output state, or None where the pool had no room."""
        ids: list[int] = []
        rows: list[int] = []
        starts: list[int] = []
        lens: list[int] = []
        locs: list[int] = []
        states: list[torch.Tensor] = []
        last: list[int | None] = []  # each track's last row in the step
        for t, tokens, state in work:
            start = t.shadow.kv_len
            slots = take_slots(self.cache, t.shadow, tokens)
            if slots is None:
                last.append(None)
                continue
            assert t.shadow.req_row is not None  # attached
            ids += tokens
            rows.append(t.shadow.req_row)
            starts.append(start)
            lens.append(len(tokens))
            locs += slots
            states.append(state)
            last.append(len(rows) - 1)
        if not ids:
            return [None] * len(work)
        engine = self.engine
        graphs = engine.graphs
        ends = list(itertools.accumulate(lens))  # each track's last row + 1
        if mode == "decode" or len(ids) <= (graphs.max_bs if graphs is not None else DECODE_FORM_ROWS):
            # one row a token (a verify step's layout): every row's logits, a track's last at its end - 1
            batch = engine.build_batch("decode", ids, [r for r, n in zip(rows, lens) for _ in range(n)],
                                       [s + j for s, n in zip(starts, lens) for j in range(n)], [1] * len(ids), locs)
            picks = [e - 1 for e in ends]
        else:  # an extend: each track's last row's logits
            batch = engine.build_batch(mode, ids, rows, starts, lens, locs)
            picks = list(range(len(rows)))
        self.cache.write_rows(batch, locs)
        batch.prev_hidden = torch.cat(states)
        greedy = engine.forward(batch).argmax(dim=-1).tolist()
        tokens_out = [greedy[p] for p in picks]
        out = batch.hidden
        assert out is not None  # the MTP layer keeps every row's output
        return [None if r is None else (tokens_out[r], out[ends[r] - 1 : ends[r]]) for r in last]

    def release(self, req: Req) -> None:
        t = self.tracks.pop(req.rid, None)
        if t is not None:
            self.cache.release(t.shadow, cache=False)

    def close(self) -> None:
        for t in self.tracks.values():
            self.cache.release(t.shadow, cache=False)
        self.tracks.clear()
