"""SamplingState: every request's sampling parameters, seed and token counts on the device, one row per page-table row.

A request's row is written when it takes a page-table row (and again after a retraction), and each step
gathers the rows of the batch's requests: no step turns a Python list of parameters into a device tensor. Writes of a
step are packed into one int64 and one float32 upload through the engine's pinned `HostBuffers` (non-blocking: a
pageable copy would wait for the step in flight). Which sampler paths a step runs (any top-p row? any penalty?)
is decided from host facts recorded when a request takes its row (`Need`), never from a device value.

Token counts for presence / frequency penalties (output tokens) and the seen-set of the repetition penalty
(prompt and output tokens) are [rows, vocab] tables, allocated when the first request that needs them arrives
and updated on the device by each step's sampled ids (`record`), so a penalized request needs no host round trip
between steps. `logit_bias` is a padded sparse table: (token id, bias) pairs per row, as wide as the largest
bias seen.

A verify step (speculative decoding) samples a row per position of each request's drafts: row j of a request draws
the token after its first j drafts, so its penalties count those drafts too (`Drafts.prior`), and only the rows of
the accepted run (every draft before them drawn as proposed) are counted into the tables (`Drafts.kept`).
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import torch

from minisgl_cli.engine.host import HostBuffers
from minisgl_cli.types import SamplingParams

# Columns of the float and int tables.
_TEMPERATURE, _TOP_P, _MIN_P, _PRESENCE, _FREQUENCY, _REPETITION = range(6)
_TOP_K, _SEED_LO, _SEED_HI, _GREEDY = range(4)
_M32 = 0xFFFFFFFF
# A top-k cut up to this many candidates runs through topk + a sort of the candidates, not of the vocabulary.
MAX_BOUNDED_TOP_K = 1024


class Need(enum.IntFlag):
    """What a row asks of the sampler beyond an argmax (the step's flags are the union over its rows)."""

    NONE = 0
    SAMPLED = enum.auto()  # a random draw (temperature > 0, top_k != 1)
    TOP_K = enum.auto()  # sampled with a top-k cut below the vocabulary
    TOP_P = enum.auto()  # sampled with top_p < 1
    MIN_P = enum.auto()  # sampled with min_p > 0
    PENALTY = enum.auto()  # presence or frequency penalty
    REPETITION = enum.auto()  # repetition penalty != 1
    BIAS = enum.auto()  # logit_bias
    LOGPROBS = enum.auto()  # logprobs / top_logprobs


def needs_of(p: SamplingParams, vocab: int) -> Need:
    n = Need.NONE
    if not p.greedy:
        n |= Need.SAMPLED
        n |= Need.TOP_K if 0 < p.top_k < vocab else Need.NONE
        n |= Need.TOP_P if p.top_p < 1.0 else Need.NONE
        n |= Need.MIN_P if p.min_p > 0.0 else Need.NONE
    n |= Need.PENALTY if p.penalized else Need.NONE
    n |= Need.REPETITION if p.repetition_penalized else Need.NONE
    n |= Need.BIAS if p.logit_bias else Need.NONE
    n |= Need.LOGPROBS if p.wants_logprobs else Need.NONE
    return n


@dataclass(frozen=True)
class _HostRow:
    needs: Need
    top_k: int  # the cut of a TOP_K row, else 0
    top_logprobs: int


@dataclass
class _Pending:
    """A row to write at the next flush."""

    params: SamplingParams
    seed: int  # 64-bit
    seen: list[int]  # repetition penalty: prompt + output ids
    outputs: list[int]  # presence / frequency: output ids so far (non-empty after a retraction)


@dataclass
class RowParams:
    """A batch's rows of the state: [B] device tensors."""

    temperature: torch.Tensor  # float32 (1 for greedy rows)
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    presence: torch.Tensor  # float32
    frequency: torch.Tensor  # float32
    repetition: torch.Tensor  # float32
    top_k: torch.Tensor  # int64 (the vocabulary size where there is no cut)
    seed_lo: torch.Tensor  # int64, 32 bits
    seed_hi: torch.Tensor  # int64, 32 bits
    greedy: torch.Tensor  # bool


@dataclass
class Drafts:
    """A verify step's rows beyond decode's: [T] device tensors, one entry per row."""

    next: torch.Tensor  # int64: the draft the row's drawn token must equal for its request's run to go on (-1: none)
    first: torch.Tensor  # int64: the row of its request's first row
    prior: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) for each draft before each row (penalties only)

    def kept(self, next_ids: torch.Tensor) -> torch.Tensor:
        """[T] bool: rows whose drawn token is output (every earlier row of the request drew its draft)."""
        miss = (next_ids != self.next).to(torch.int32)  # a request's last row always "misses": it has no draft
        before = miss.cumsum(0) - miss
        return before == before[self.first]


def draft_rows(drafts: list[list[int]], penalized: bool) -> tuple[list[int], list[int], list[int], list[int]]:
    """Host lists of a verify step's `Drafts` (per request: the drafts after its first row): next, first, and the
    prior pairs' rows and tokens (empty unless `penalized`)."""
    nxt: list[int] = []
    first: list[int] = []
    prior_rows: list[int] = []
    prior_ids: list[int] = []
    row = 0
    for d in drafts:
        n = len(d)
        nxt += d + [-1]
        first += [row] * (n + 1)
        if penalized:
            for j, tok in enumerate(d):  # draft j precedes rows j+1..n
                prior_rows += range(row + j + 1, row + n + 1)
                prior_ids += [tok] * (n - j)
        row += n + 1
    return nxt, first, prior_rows, prior_ids


@dataclass
class SamplingBatch:
    """One step's rows for the sampler: where each row's state lives, and the host facts choosing the paths."""

    req_rows: torch.Tensor  # [B] int64: each batch row's page-table row
    positions: torch.Tensor  # [B]: the position of the token each row draws (the counter of its random stream)
    needs: Need  # union over the rows
    k_bound: int  # > 0: every sampled row with a top-k / top-p cut has top_k <= k_bound (candidates: topk(k_bound))
    lp_rows: list[int]  # rows that report logprobs (on this rank)
    lp_index: torch.Tensor | None  # the same on the device
    top_logprobs: int  # the most top candidates any lp row asked for
    produced: torch.Tensor | None  # rows whose drawn token is real (None: all) -- prompt chunks draw none
    drafts: Drafts | None = None  # a verify step's

    @property
    def plain(self) -> bool:
        """Greedy with nothing on top: the argmax of the logits as they are."""
        return not self.needs


class SamplingState:
    def __init__(self, max_rows: int, vocab: int, device: torch.device, host: HostBuffers, seed: int = 0):
        self.vocab = vocab
        self.device = device
        self.host = host
        # A row no request has taken yet holds a greedy row's neutral values, not zeros: a captured sampler graph
        # (sampling/graphs.py) draws for padded rows too, and top_k 0 there keeps the Triton kernel's
        # rejection rounds going forever (no token has fewer than 0 tokens above it).
        self.floats = torch.zeros((max_rows, 6), dtype=torch.float32, device=device)
        self.floats[:, [_TEMPERATURE, _TOP_P, _REPETITION]] = 1.0
        self.ints = torch.zeros((max_rows, 4), dtype=torch.int64, device=device)
        self.ints[:, _TOP_K] = vocab
        self.ints[:, _GREEDY] = 1
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32: output token counts
        self.seen: torch.Tensor | None = None  # [rows, vocab] bool: prompt + output tokens
        self.bias_ids: torch.Tensor | None = None  # [rows, width] int64 (padding: token 0 with bias 0)
        self.bias_vals: torch.Tensor | None = None  # [rows, width] float32
        self._rows: list[_HostRow] = [_HostRow(Need.NONE, 0, 0)] * max_rows
        self._pending: dict[int, _Pending] = {}
        # Seeds of unseeded requests: the same sequence on every TP rank (they admit the same requests in order).
        self._rng = random.Random(seed)

    # --- a request takes a row ----------------------------------------------------------------
    def set_row(self, req_row: int, params: SamplingParams, input_ids: list[int], output_ids: list[int]) -> None:
        """Give `req_row` this request's parameters (written on the device with the next step's uploads)."""
        needs = needs_of(params, self.vocab)
        self._rows[req_row] = _HostRow(needs, params.top_k if needs & Need.TOP_K else 0, params.top_logprobs)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(64)
        self._pending.pop(req_row, None)  # a row given twice before a flush: the later request's row wins
        self._pending[req_row] = _Pending(
            params, seed & ((1 << 64) - 1),
            input_ids + output_ids if needs & Need.REPETITION else [],
            list(output_ids) if needs & Need.PENALTY else [],
        )

    def _flush(self) -> None:
        """Write the pending rows: one int64 and one float32 upload, then device-side scatters."""
        pend, self._pending = self._pending, {}
        req_rows = list(pend)
        n = len(req_rows)
        if any(p.params.logit_bias for p in pend.values()):
            self._bias_width(max(len(p.params.logit_bias or {}) for p in pend.values()))
        if any(p.params.penalized for p in pend.values()) and self.counts is None:
            self.counts = torch.zeros((len(self._rows), self.vocab), dtype=torch.int32, device=self.device)
        if any(p.seen for p in pend.values()) and self.seen is None:
            self.seen = torch.zeros((len(self._rows), self.vocab), dtype=torch.bool, device=self.device)
        width = 0 if self.bias_ids is None else self.bias_ids.shape[1]
        ints: list[int] = []  # per row: top_k, seed (two halves), greedy, then its logit_bias ids
        floats: list[float] = []
        bias_vals: list[float] = []
        zero_counts: list[int] = []  # rows whose counts restart (penalized requests)
        count_at: list[int] = []  # (row, token) of each output token so far (after a retraction)
        count_ids: list[int] = []
        zero_seen: list[int] = []
        seen_at: list[int] = []
        seen_ids: list[int] = []
        for req_row, pe in pend.items():
            p = pe.params
            greedy = p.greedy
            top_k = p.top_k if not greedy and 0 < p.top_k < self.vocab else self.vocab
            ints += [top_k, pe.seed & _M32, pe.seed >> 32, int(greedy)]
            # A greedy row's draw is replaced by the argmax: keep its cut a no-op.
            floats += [1.0, 1.0, 0.0] if greedy else [p.temperature, p.top_p, p.min_p]
            floats += [p.presence_penalty, p.frequency_penalty, p.repetition_penalty]
            bias = list((p.logit_bias or {}).items())
            bias += [(0, 0.0)] * (width - len(bias))
            ints += [t for t, _ in bias]
            bias_vals += [b for _, b in bias]
            if p.penalized:
                zero_counts.append(req_row)
                count_at += [req_row] * len(pe.outputs)
                count_ids += pe.outputs
            if pe.seen:
                zero_seen.append(req_row)
                seen_at += [req_row] * len(pe.seen)
                seen_ids += pe.seen
        idx, flat_i, zc, ca, ci, zs, sa, si = self.host.to_device_parts(
            [list(req_rows), ints, zero_counts, count_at, count_ids, zero_seen, seen_at, seen_ids], torch.int64,
            self.device)
        flat_f, flat_bias = self.host.to_device_parts([floats, bias_vals], torch.float32, self.device)
        rows_i = flat_i.view(n, 4 + width)
        self.ints.index_copy_(0, idx, rows_i[:, :4])
        self.floats.index_copy_(0, idx, flat_f.view(n, 6))
        if self.bias_ids is not None and self.bias_vals is not None:
            self.bias_ids.index_copy_(0, idx, rows_i[:, 4:])
            self.bias_vals.index_copy_(0, idx, flat_bias.view(n, width))
        if zero_counts and self.counts is not None:
            self.counts.index_fill_(0, zc, 0)
            if count_ids:
                self.counts.index_put_((ca, ci), torch.ones_like(ci, dtype=torch.int32), accumulate=True)
        if zero_seen and self.seen is not None:
            self.seen.index_fill_(0, zs, False)
            self.seen[sa, si] = True

    def _bias_width(self, width: int) -> None:
        """Widen the bias table to `width` entries per req_row (new entries: token 0, bias 0)."""
        old = 0 if self.bias_ids is None else self.bias_ids.shape[1]
        if width <= old:
            return
        ids = torch.zeros((len(self._rows), width), dtype=torch.int64, device=self.device)
        vals = torch.zeros((len(self._rows), width), dtype=torch.float32, device=self.device)
        if self.bias_ids is not None and self.bias_vals is not None:
            ids[:, :old] = self.bias_ids
            vals[:, :old] = self.bias_vals
        self.bias_ids, self.bias_vals = ids, vals

    # --- per step -------------------------------------------------------------------------------
    def batch(self, req_rows: list[int], req_rows_dev: torch.Tensor, positions: torch.Tensor, produces: list[bool],
              logprobs: bool = True, drafts: list[list[int]] | None = None) -> SamplingBatch:
        """The step's rows (`req_rows_dev`: `req_rows` on the device; `positions`: each row's drawn token's position).

        `logprobs`: whether this rank reports them (rank 0 only). `drafts`: a verify step's, per request (the tokens
        its rows after the first feed; the rows are in request order)."""
        if self._pending:
            self._flush()
        rows = [self._rows[s] for s in req_rows]
        needs = Need.NONE
        for n in {r.needs for r in rows}:  # a few distinct flag sets: an IntFlag `|` per row cost ~1 us
            needs |= n
        if not logprobs:
            needs &= ~Need.LOGPROBS
        k_bound = 0
        if needs & (Need.TOP_K | Need.TOP_P):
            cut = [r for r in rows if r.needs & (Need.TOP_K | Need.TOP_P)]
            if all(r.top_k for r in cut) and max(r.top_k for r in cut) <= MAX_BOUNDED_TOP_K:
                k_bound = max(r.top_k for r in cut)
        lp_rows = [i for i, r in enumerate(rows) if r.needs & Need.LOGPROBS] if needs & Need.LOGPROBS else []
        track = (self.counts is not None or self.seen is not None) and not all(produces)
        produced_rows = [i for i, p in enumerate(produces) if p] if track else []
        verify = drafts is not None and any(drafts)
        parts: list[list[int]] = []
        if verify:
            assert drafts is not None and not track  # a verify step is a decode step: every row draws
            parts = list(draft_rows(drafts, bool(needs & (Need.PENALTY | Need.REPETITION))))
        lp_index = produced = verified = None
        if lp_rows or track or verify:  # one upload for all of them
            lp_dev, produced_dev, *drafted = self.host.to_device_parts([lp_rows, produced_rows, *parts], torch.int64,
                                                                        self.device)
            lp_index = lp_dev if lp_rows else None
            produced = produced_dev if track else None
            if verify:
                nxt, first, prior_rows, prior_ids = drafted
                verified = Drafts(nxt, first, (prior_rows, prior_ids) if prior_rows.numel() else None)
        return SamplingBatch(
            req_rows_dev, positions, needs, k_bound, lp_rows, lp_index,
            max((rows[i].top_logprobs for i in lp_rows), default=0), produced, verified,
        )

    def params(self, req_rows: torch.Tensor) -> RowParams:
        f = self.floats[req_rows]
        i = self.ints[req_rows]
        return RowParams(
            f[:, _TEMPERATURE], f[:, _TOP_P], f[:, _MIN_P], f[:, _PRESENCE], f[:, _FREQUENCY], f[:, _REPETITION],
            i[:, _TOP_K], i[:, _SEED_LO], i[:, _SEED_HI], i[:, _GREEDY].bool(),
        )

    def penalize(self, logits: torch.Tensor, batch: SamplingBatch, p: RowParams) -> None:
        """Repetition penalty, then presence / frequency penalties, then logit bias, in place on fp32 logits.

        Every row of the batch goes through the same ops: a row without a penalty has the neutral values
        (repetition 1, presence / frequency 0, bias 0), which change no logit."""
        req_rows = batch.req_rows
        prior = batch.drafts.prior if batch.drafts is not None else None  # a verify row's drafts before it
        if batch.needs & Need.REPETITION and self.seen is not None:
            r = p.repetition[:, None]
            penalized = torch.where(logits > 0, logits / r, logits * r)
            seen = self.seen[req_rows]
            if prior is not None:
                seen[prior] = True
            logits.copy_(torch.where(seen, penalized, logits))
        if batch.needs & Need.PENALTY and self.counts is not None:
            counts = self.counts[req_rows].to(logits.dtype)
            if prior is not None:
                counts.index_put_(prior, torch.ones_like(prior[1], dtype=counts.dtype), accumulate=True)
            logits -= p.frequency[:, None] * counts + p.presence[:, None] * (counts > 0).to(logits.dtype)
        if batch.needs & Need.BIAS and self.bias_ids is not None and self.bias_vals is not None:
            logits.scatter_add_(1, self.bias_ids[req_rows], self.bias_vals[req_rows])

    def record(self, batch: SamplingBatch, next_ids: torch.Tensor) -> None:
        """Count the step's drawn tokens into the penalty tables (on the device, in stream order)."""
        if self.counts is None and self.seen is None:
            return
        req_rows, ids = batch.req_rows, next_ids
        if batch.produced is not None:
            req_rows, ids = req_rows[batch.produced], ids[batch.produced]
        if batch.drafts is not None:
            kept = batch.drafts.kept(next_ids)
            req_rows, ids = req_rows[kept], ids[kept]
        if self.counts is not None:
            self.counts.index_put_((req_rows, ids), torch.ones_like(ids, dtype=torch.int32), accumulate=True)
        if self.seen is not None:
            self.seen[req_rows, ids] = True

