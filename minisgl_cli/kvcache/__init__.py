"""KV cache: the page pool and page table, the radix prefix cache, and the naive (no reuse) cache."""

from __future__ import annotations

from minisgl_cli.kvcache.naive import NaiveCache
from minisgl_cli.kvcache.pool import KVPool, KVShape
from minisgl_cli.kvcache.radix import MatchResult, RadixCache

CACHE_KINDS = ("radix", "naive")


def create_prefix_cache(kind: str, page_size: int) -> RadixCache | NaiveCache:
    if kind not in CACHE_KINDS:
        raise ValueError(f"unknown cache {kind!r}; choose radix or naive")
    return RadixCache(page_size) if kind == "radix" else NaiveCache(page_size)


__all__ = ["KVPool", "KVShape", "MatchResult", "RadixCache", "NaiveCache", "create_prefix_cache"]
