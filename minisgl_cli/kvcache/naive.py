"""The naive cache (`--cache naive`): the radix cache's verbs with no reuse, for comparison."""

from __future__ import annotations

import torch

from minisgl_cli.kvcache.radix import MatchResult, RadixNode


class NaiveCache:
    reuses = False  # whether inserted prefixes are kept for later matches

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.root = RadixNode(lock_ref=1)
        self.evictable_tokens = 0
        self.protected_tokens = 0
        self.cached_tokens = 0

    def match(self, ids: list[int]) -> MatchResult:
        return MatchResult(self.root, torch.empty(0, dtype=torch.int64), 0)

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        return len(ids)  # nothing is kept: the caller frees every slot

    def lock(self, node: RadixNode) -> None:
        pass

    def unlock(self, node: RadixNode) -> None:
        pass

    def evict(self, num_tokens: int) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    def nodes(self, unlocked: bool = False) -> list[RadixNode]:
        return []
