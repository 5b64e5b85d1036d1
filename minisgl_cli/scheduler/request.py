"""Req: one request's state inside the scheduler, from admission to finish."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from minisgl_cli.kvcache.radix import RadixNode
from minisgl_cli.types import ImageInput, SamplingParams


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    req_slot: int | None = None  # row of the page table while it holds KV
    kv_len: int = 0  # positions whose KV is in the pool
    prefix_len: int = 0  # leading positions owned by the radix tree (locked via prefix_node)
    prefix_node: RadixNode | None = None
    pages: list[int] = field(default_factory=list)  # pages for positions prefix_len.. (owned here)
    prefix_slots: list[int] = field(default_factory=list)  # KV slots of the matched prefix (host copy)
    done: bool = False  # finished or aborted: an in-flight step's token for it is dropped
    cached_tokens: int = 0  # prefix hit at first admission (reported to the user)
    matched: bool = False
    grammar: Any = None  # xgrammar's GrammarMatcher when the request has a structured output (grammar.py)
    arrival: float = field(default_factory=time.perf_counter)
    prefill_started_at: float = 0.0  # when it first joined a prefill batch (queueing excluded)
    images: list[ImageInput] = field(default_factory=list)  # a VLM prompt's images, by placeholder run
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
