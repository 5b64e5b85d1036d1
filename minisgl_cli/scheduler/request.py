"""Req: one request's state inside the scheduler, from queued to finished (with its speculative draft budget)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minisgl_cli.kvcache.radix import RadixNode
from minisgl_cli.types import ImageInput, SamplingParams

# A request's draft budget (speculative decoding, speculative.py):
MAX_WAIT = 32  # plain steps at most between a request's probes while none of its drafts is accepted
KEEP = 0.3  # a draft is proposed while the chance its run gets that far is at least this (a row costs ~0.2 of a step)
DECAY = 0.6  # per verify: how fast a request's acceptance rate forgets


@dataclass
class DraftBudget:
    """How many drafts a request proposes next, from its recent verify steps. Its acceptance rate `rate` (of a draft
    whose run got that far; decayed, optimistic at first) sets the longest run d <= k whose last draft is reached
    with a chance of at least KEEP (rate**d), at least one. Where a failed draft costs more than its verify row
    (`pauses`: a proposer that runs a model, or a scheduler that overlaps steps, whose verify steps do not), a verify
    that accepted nothing pauses the request's drafts for 1, 2, 4 .. MAX_WAIT plain steps (doubling while it goes
    on): a request whose drafts keep failing costs a step ~nothing, and one that starts to copy (a quoted passage) is
    found again within MAX_WAIT tokens. Without them (prompt lookup on the CPU) a request keeps drafting: one draft
    row costs a few percent of a step, and a run it starts pays for many."""

    k: int
    pauses: bool = True
    hits: float = 0.0  # accepted drafts (decayed)
    misses: float = 0.0  # rejected ones: at most one per verify, the first that differed
    resume_at: int = 0  # after a verify that accepted nothing: the output length at which it proposes again
    backoff: int = 0

    @property
    def rate(self) -> float:
        return (self.hits + 1) / (self.hits + self.misses + 1)

    def wants(self, outputs: int) -> int:
        """Drafts to ask for at this output length."""
        if outputs < self.resume_at:
            return 0
        d, rate = 1, self.rate
        while d < self.k and rate ** (d + 1) >= KEEP:
            d += 1
        return d

    def update(self, proposed: int, accepted: int, outputs: int) -> None:
        self.hits = DECAY * self.hits + accepted
        self.misses = DECAY * self.misses + (accepted < proposed)
        if accepted:
            self.backoff, self.resume_at = 0, 0
        else:
            self._pause(outputs)

    def found_none(self, outputs: int) -> None:
        """It asked and the proposer had nothing (no earlier match): pause as after a verify that accepted nothing.
        Asking costs the step its overlap (the step in flight is read first), so a request with nothing to copy
        must not ask every step."""
        self._pause(outputs)

    def _pause(self, outputs: int) -> None:
        if not self.pauses:
            return
        self.backoff = min(2 * self.backoff or 1, MAX_WAIT)
        self.resume_at = outputs + self.backoff


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    req_row: int | None = None  # row of the page table while it holds KV
    kv_len: int = 0  # positions whose KV is in the pool
    prefix_len: int = 0  # leading positions owned by the radix tree (locked via prefix_node)
    prefix_node: RadixNode | None = None
    pages: list[int] = field(default_factory=list)  # pages for positions prefix_len.. (owned here)
    dropped: int = 0  # leading pages of `pages` given back behind an all-windowed model's window (0 in the list)
    windows_dropped: int = 0  # leading pages of `pages` whose window pages are given back (sliding and full layers)
    prefix_slots: list[int] = field(default_factory=list)  # KV slots of the matched prefix (host copy)
    state_slot: int | None = None  # its recurrent-state slot while it holds one (linear-attention models)
    done: bool = False  # finished or aborted: an in-flight step's token for it is dropped
    cached_tokens: int = 0  # prefix hit at first admission (reported to the user)
    matched: bool = False
    grammar: Any = None  # xgrammar's GrammarMatcher when the request has a structured output (grammar.py)
    draft: DraftBudget | None = None  # speculative decoding: how many drafts it proposes next
    arrival: float = field(default_factory=time.perf_counter)
    prefill_started_at: float = 0.0  # when it first joined a prefill batch (queueing excluded)
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's images, by placeholder run
    # Its stop facts, set once when queued (Scheduler._enqueue), so each token's check is a set lookup and one compare:
    stop_ids: frozenset[int] = frozenset()  # ids that end it: its stop_token_ids, and EOS unless ignore_eos
    max_output: int = 0  # output tokens it may have: max_new_tokens, short of the context left after its prompt
    # The prompt as the prefix cache keys it: each image's placeholder ids replaced by a number from its content
    # hash, so the same image matches its cached KV and another image with the same placeholders never does.
    key_ids: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.key_ids = self.input_ids
        if self.images:
            self.key_ids = list(self.input_ids)
            for img in self.images:
                self.key_ids[img.offset : img.offset + img.tokens] = [-1 - img.key] * img.tokens  # no token's id

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def all_key_ids(self) -> list[int]:
        """all_ids as the prefix cache keys them (see key_ids)."""
        return self.key_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def remaining_prefill(self) -> int:
        """Tokens still to run before this request can sample (at least the last one)."""
        return self.seq_len - self.kv_len
