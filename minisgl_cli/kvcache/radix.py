"""Radix prefix cache: token-id prefixes -> KV slots, with four verbs: match, insert, lock, evict.

Nodes hold runs of token ids and the KV slots computed for them. A request matches its longest
cached prefix, locks it while it runs (reference counts up to the root), and inserts its tokens when it
finishes. Unlocked leaves are evicted least-recently-used first. With pages larger than one token,
only whole pages are cached, so every node's length is a multiple of the page size.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import torch

_clock = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    parent: RadixNode | None = None
    children: dict = field(default_factory=dict)
    lock_ref: int = 0
    last_used: int = 0
    state: int = -1  # a hybrid's snapshot of its linear layers' state at this node's end (kvcache/hybrid.py), or -1

    def __lt__(self, other: RadixNode) -> bool:
        return self.last_used < other.last_used


@dataclass
class MatchResult:
    node: RadixNode  # deepest matched node: lock it while the prefix is in use
    slots: torch.Tensor  # [length] KV slots of the matched prefix
    length: int


class RadixCache:
    reuses = True  # whether inserted prefixes are kept for later matches

    def __init__(self, page_size: int = 1):
        self.page_size = page_size
        self.root = RadixNode(lock_ref=1)  # the root is never evicted
        self.evictable_tokens = 0
        self.protected_tokens = 0

    @property
    def cached_tokens(self) -> int:
        return self.evictable_tokens + self.protected_tokens

    def _head(self, ids: list[int]):
        return ids[0] if self.page_size == 1 else tuple(ids[: self.page_size])

    def _common(self, a: list[int], b: list[int]) -> int:
        n = 0
        for x, y in zip(a, b):
            if x != y:
                break
            n += 1
        return n - n % self.page_size

    def _split(self, node: RadixNode, n: int) -> RadixNode:
        """Cut node's run after n tokens; returns the new upper part (same locks, same place)."""
        parent = node.parent
        assert parent is not None  # never the root: it holds no tokens to cut
        upper = RadixNode(node.key[:n], node.slots[:n], parent, {}, node.lock_ref, node.last_used)
        parent.children[self._head(upper.key)] = upper
        node.key, node.slots, node.parent = node.key[n:], node.slots[n:], upper
        upper.children[self._head(node.key)] = node
        return upper

    def match(self, ids: list[int]) -> MatchResult:
        """Longest cached prefix of ids (page aligned); marks the path as recently used."""
        node, pos, parts = self.root, 0, []
        stamp = next(_clock)
        while pos < len(ids):
            child = node.children.get(self._head(ids[pos:]))
            if child is None:
                break
            n = self._common(child.key, ids[pos:])
            if n == 0:
                break
            if n < len(child.key):
                child = self._split(child, n)
            child.last_used = stamp
            parts.append(child.slots)
            pos += n
            node = child
        slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return MatchResult(node, slots, pos)

    def insert(self, ids: list[int], slots: torch.Tensor) -> int:
        """Cache ids -> slots (page aligned). Returns how many leading tokens were already cached:
        the caller still owns (and must free) its slots for those, the tree owns the rest."""
        n_total = len(ids) - len(ids) % self.page_size
        node, pos = self.root, 0
        stamp = next(_clock)
        while pos < n_total:
            child = node.children.get(self._head(ids[pos:]))
            if child is None:
                new = RadixNode(list(ids[pos:n_total]), slots[pos:n_total].clone(), node, {}, 0, stamp)
                node.children[self._head(new.key)] = new
                self.evictable_tokens += len(new.key)
                return pos
            n = self._common(child.key, ids[pos:n_total])
            if n < len(child.key):
                child = self._split(child, n)
            child.last_used = stamp
            pos += n
            node = child
        return pos

    def lock(self, node: RadixNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_tokens -= len(node.key)
                self.protected_tokens += len(node.key)
            node.lock_ref += 1
            assert node.parent is not None  # every node below the root has one
            node = node.parent

    def unlock(self, node: RadixNode) -> None:
        while node is not self.root:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.protected_tokens -= len(node.key)
                self.evictable_tokens += len(node.key)
            assert node.parent is not None  # every node below the root has one
            node = node.parent

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop unlocked leaves, least recently used first, until num_tokens are freed (or none are
        left). Returns the freed slots."""
        leaves = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(leaves)
        freed: list[torch.Tensor] = []
        count = 0
        while leaves and count < num_tokens:
            leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[self._head(leaf.key)]
            self.evictable_tokens -= len(leaf.key)
            self._dropped(leaf)
            freed.append(leaf.slots)
            count += len(leaf.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(leaves, parent)
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def nodes(self, unlocked: bool = False) -> list[RadixNode]:
        """The cached nodes, least recently used first (only those no request holds where `unlocked`)."""
        return sorted(n for n in self._nodes() if not unlocked or n.lock_ref == 0)

    def _dropped(self, node: RadixNode) -> None:
        """`node` left the tree (evicted): a subclass frees what else it held."""

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())
