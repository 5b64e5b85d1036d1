"""Radix prefix cache: match, split, insert, lock, LRU eviction order, page alignment."""

from __future__ import annotations

import torch

from minisgl_cli.kvcache.radix import RadixCache


def slots(a: int, b: int) -> torch.Tensor:
    return torch.arange(a, b, dtype=torch.int64)


def test_match_returns_longest_prefix_and_its_slots():
    t = RadixCache()
    assert t.insert([1, 2, 3, 4], slots(10, 14)) == 0
    m = t.match([1, 2, 3, 9])
    assert m.length == 3 and m.slots.tolist() == [10, 11, 12]
    assert t.match([7, 8]).length == 0


def test_insert_splits_node_and_reports_already_cached_prefix():
    t = RadixCache()
    t.insert([1, 2, 3, 4], slots(10, 14))
    assert t.insert([1, 2, 5, 6], slots(20, 24)) == 2  # [1, 2] was cached: caller frees 20, 21
    assert t.match([1, 2, 5, 6]).slots.tolist() == [10, 11, 22, 23]
    assert t.match([1, 2, 3, 4]).slots.tolist() == [10, 11, 12, 13]
    assert t.cached_tokens == 6


def test_lock_protects_path_and_unlock_releases():
    t = RadixCache()
    t.insert([1, 2, 3], slots(0, 3))
    m = t.match([1, 2, 3])
    t.lock(m.node)
    assert (t.protected_tokens, t.evictable_tokens) == (3, 0)
    assert t.evict(10).numel() == 0  # nothing unlocked
    t.unlock(m.node)
    assert (t.protected_tokens, t.evictable_tokens) == (0, 3)
    assert sorted(t.evict(10).tolist()) == [0, 1, 2]
    assert t.cached_tokens == 0


def test_lock_survives_a_split_below_the_locked_node():
    t = RadixCache()
    t.insert([1, 2, 3, 4], slots(0, 4))
    m = t.match([1, 2, 3, 4])
    t.lock(m.node)
    t.match([1, 2, 9])  # splits [1,2,3,4] into [1,2] + [3,4]
    assert t.protected_tokens == 4 and t.evict(100).numel() == 0
    t.unlock(m.node)
    assert t.evictable_tokens == 4


def test_evicts_least_recently_used_leaf_first_and_stops_at_budget():
    t = RadixCache()
    t.insert([1, 1], slots(0, 2))
    t.insert([2, 2], slots(2, 4))
    t.insert([3, 3], slots(4, 6))
    t.match([1, 1])  # touch: [2,2] is now the oldest
    assert t.evict(2).tolist() == [2, 3]
    assert t.evict(1).tolist() == [4, 5]  # whole leaves only
    assert t.match([1, 1]).length == 2


def test_parent_becomes_evictable_after_its_children():
    t = RadixCache()
    t.insert([1, 2, 3], slots(0, 3))
    t.insert([1, 2, 4], slots(10, 13))  # [1,2] shared, children [3] and [4]
    assert sorted(t.evict(100).tolist()) == [0, 1, 2, 12]
    assert t.cached_tokens == 0


def test_pages_larger_than_one_token_cache_whole_pages_only():
    t = RadixCache(page_size=4)
    assert t.insert(list(range(10)), slots(100, 110)) == 0
    assert t.cached_tokens == 8  # the partial third page is not cached
    m = t.match(list(range(7)) + [99])
    assert m.length == 4 and m.slots.tolist() == [100, 101, 102, 103]
