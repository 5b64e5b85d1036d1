"""KV cache: the page pool and page table, recurrent-state slots, the radix prefix cache (with state snapshots for
linear-attention hybrids), and the naive (no reuse) cache."""

from __future__ import annotations

from collections.abc import Callable

from minisgl_cli.kvcache.hybrid import HybridRadixCache
from minisgl_cli.kvcache.naive import NaiveCache
from minisgl_cli.kvcache.pool import KVPool, KVShape
from minisgl_cli.kvcache.radix import MatchResult, RadixCache

CACHE_KINDS = ("radix", "naive")


def create_prefix_cache(kind: str, page_size: int,
                        free_state: Callable[[int], None] | None = None) -> RadixCache | NaiveCache:
    """`free_state`: a linear-attention hybrid's (its radix cache keeps state snapshots, handed back through it)."""
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache {kind!r}; choose radix or naive")
    if kind == "naive":
        return NaiveCache(page_size)
    return RadixCache(page_size) if free_state is None else HybridRadixCache(page_size, free_state)


__all__ = ["KVPool", "KVShape", "MatchResult", "RadixCache", "HybridRadixCache", "NaiveCache", "create_prefix_cache"]
