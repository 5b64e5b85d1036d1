"""Dispatch across engine replicas: which one takes each request — rr | fsfs | random | cache_aware.

`Dispatcher` keeps what the policies read of each replica: up or out, its load (requests routed to it and not
finished), the requests routed so far, and for cache_aware a `PrefixTree` of the prompts routed to each, an
approximate mirror of each replica's radix cache. cache_aware is the policy sglang's router documents: the
replica whose tree matches the longest prefix when the match covers more than `cache_threshold` of the
prompt, else the replica with the smallest tree; either way the least-loaded replica instead when the
chosen one's load exceeds it by more than `balance_abs` requests and `balance_rel` times.

The data-parallel pool (runtime/pool.py) routes token ids through it; `minisgl router` (router/workers.py)
routes prompt text across servers. Pure Python; every method is thread-safe.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Collection, Hashable, Sequence
from typing import Literal, get_args

from minisgl_cli.types import ErrorCode

DispatchPolicy = Literal["rr", "fsfs", "random", "cache_aware"]
DISPATCH_POLICIES: tuple[str, ...] = get_args(DispatchPolicy)

# sglang router's defaults (--cache-threshold, --balance-abs-threshold, --balance-rel-threshold).
CACHE_THRESHOLD = 0.3
BALANCE_ABS = 64
BALANCE_REL = 1.5
TREE_ITEMS = 1 << 22  # per replica, when the caller does not know its cache size (tokens or characters)


class Busy(Exception):
    """Every replica that is up has its cap of requests in flight (the server answers 429 + Retry-After)."""

    code = ErrorCode.OVERLOADED


class NoReplica(Exception):
    """No replica is up (or every one was tried)."""


# --- the prefix tree -------------------------------------------------------------------------------------
class _Node:
    __slots__ = ("key", "children", "tenants", "parent")

    def __init__(self, key: Sequence[Hashable], parent: _Node | None):
        self.key = key  # the edge into this node: token ids (a tuple) or characters (a str)
        self.children: dict[Hashable, _Node] = {}
        self.tenants: dict[int, float] = {}  # replica -> when a request routed to it last passed here
        self.parent = parent


def _frozen(seq: Sequence[Hashable]) -> Sequence[Hashable]:
    """A str as it is, anything else as a tuple (the tree keeps slices of it)."""
    return seq if isinstance(seq, str | tuple) else tuple(seq)


def _common(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixTree:
    """A radix tree of sequences shared by several tenants (replicas): each node knows which tenants routed a
    request through it. Four verbs: insert, match, remove (a tenant), and LRU eviction past a tenant's limit."""

    def __init__(self) -> None:
        self.root = _Node((), None)
        self.sizes: dict[int, int] = {}  # tenant -> items (tokens or characters) its nodes hold

    def insert(self, seq: Sequence[Hashable], tenant: int, limit: int | None = None) -> None:
        seq = _frozen(seq)
        now = time.monotonic()
        node = self.root
        self._touch(node, tenant, now)
        while seq:
            child = node.children.get(seq[0])
            if child is None:
                child = _Node(seq, node)
                node.children[seq[0]] = child
                self._touch(child, tenant, now)
                break
            k = _common(child.key, seq)
            if k < len(child.key):
                child = self._split(child, k)
            self._touch(child, tenant, now)
            node, seq = child, seq[k:]
        if limit is not None and self.sizes.get(tenant, 0) > limit:
            self._evict(tenant, limit)

    def match(self, seq: Sequence[Hashable]) -> dict[int, int]:
        """tenant -> how many leading items of seq its routed requests share."""
        seq = _frozen(seq)
        out = dict.fromkeys(self.root.tenants, 0)
        node, depth = self.root, 0
        while seq:
            child = node.children.get(seq[0])
            if child is None:
                break
            k = _common(child.key, seq)
            for t in child.tenants:
                out[t] = depth + k
            if k < len(child.key):
                break
            node, depth, seq = child, depth + k, seq[k:]
        return out

    def remove(self, tenant: int) -> None:
        """Forget a tenant (its replica is out: its cache is gone)."""
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.tenants.pop(tenant, None) is None:
                continue
            stack.extend(node.children.values())
            self._prune(node)
        self.sizes.pop(tenant, None)

    def size(self, tenant: int) -> int:
        return self.sizes.get(tenant, 0)

    def _touch(self, node: _Node, tenant: int, now: float) -> None:
        if tenant not in node.tenants:
            self.sizes[tenant] = self.sizes.get(tenant, 0) + len(node.key)
        node.tenants[tenant] = now

    def _split(self, child: _Node, k: int) -> _Node:
        """Cut child's edge after k items; returns the new upper node (same tenants, so sizes hold)."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.key[:k], parent)
        upper.tenants = dict(child.tenants)
        parent.children[child.key[0]] = upper
        child.key = child.key[k:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _prune(self, node: _Node) -> None:
        """Drop node (and parents left empty) once no tenant holds it."""
        while node.parent is not None and not node.tenants and not node.children:
            del node.parent.children[node.key[0]]
            node = node.parent

    def _evict(self, tenant: int, limit: int) -> None:
        """Drop the tenant's least recently used leaves until it holds at most `limit` items."""

        def leaf(n: _Node) -> bool:
            return not any(tenant in c.tenants for c in n.children.values())

        heap: list[tuple[float, int, _Node]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            kids = [c for c in n.children.values() if tenant in c.tenants]
            if n is not self.root and not kids:
                heap.append((n.tenants[tenant], id(n), n))
            stack.extend(kids)
        heapq.heapify(heap)
        while heap and self.sizes.get(tenant, 0) > limit:
            _, _, n = heapq.heappop(heap)
            del n.tenants[tenant]
            self.sizes[tenant] -= len(n.key)
            parent = n.parent
            self._prune(n)
            if parent is not None and parent is not self.root and tenant in parent.tenants and leaf(parent):
                heapq.heappush(heap, (parent.tenants[tenant], id(parent), parent))


# --- the router ------------------------------------------------------------------------------------------
class Dispatcher:
    """Picks a replica for each request and counts it in flight there until `done`.

    `cap`: requests in flight per replica at most (MAX_INFLIGHT_PER_ENGINE; None: no cap) — past it on every
    replica `pick` raises Busy. `capacity`: each replica's free-place measure for fsfs (its cap, else the
    requests its scheduler decodes together). `tree_items`: each replica's cache size, the limit of its tree."""

    def __init__(self, n: int, mode: str = "rr", cap: int | None = None, capacity: Sequence[int] | None = None,
                 tree_items: Sequence[int] | None = None, up: bool = True, seed: int | None = None,
                 cache_threshold: float = CACHE_THRESHOLD, balance_abs: int = BALANCE_ABS,
                 balance_rel: float = BALANCE_REL):
        if mode not in DISPATCH_POLICIES:
            raise ValueError(f"--dispatch must be one of {', '.join(DISPATCH_POLICIES)}, not {mode!r}")
        if n < 1:
            raise ValueError("a dispatcher needs at least one replica")
        self.n, self.mode, self.cap = n, mode, cap
        self.capacity = [cap] * n if cap is not None else list(capacity) if capacity is not None else [1] * n
        self.tree_items = list(tree_items) if tree_items is not None else [TREE_ITEMS] * n
        self.up = [up] * n
        self.load = [0] * n
        self.routed = [0] * n
        self.tree = PrefixTree()
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self._rng = random.Random(seed)
        self._next = 0  # rr: where the rotation goes on
        self._lock = threading.Lock()

    # --- picking -------------------------------------------------------------------------------------
    def pick(self, key: Sequence[Hashable] | None = None, exclude: Collection[int] = ()) -> int:
        """The replica for a request whose prompt is `key` (token ids or text; None: none to match), not one
        of `exclude`; it counts as in flight there until `done`. NoReplica / Busy when there is none."""
        with self._lock:
            up = [i for i in range(self.n) if self.up[i] and i not in exclude]
            if not up:
                raise NoReplica("no replica is up" if not exclude else "no other replica is up")
            free = [i for i in up if self.cap is None or self.load[i] < self.cap]
            if not free:
                raise Busy(f"server busy: every replica has {self.cap} requests in flight "
                           "(MAX_INFLIGHT_PER_ENGINE); retry shortly")
            i = self._choose(free, key)
            self.load[i] += 1
            self.routed[i] += 1
            if key and self.mode == "cache_aware":
                self.tree.insert(key, i, self.tree_items[i])
            return i

    def _choose(self, free: list[int], key: Sequence[Hashable] | None) -> int:
        least = min(free, key=lambda i: (self.load[i], i))
        if self.mode == "rr":
            i = next(j % self.n for j in range(self._next, self._next + self.n) if j % self.n in free)
            self._next = i + 1
            return i
        if self.mode == "random":
            return self._rng.choice(free)
        if self.mode == "fsfs":
            return next((i for i in free if self.load[i] < self.capacity[i]), least)
        # cache_aware
        matched = self.tree.match(key) if key else {}
        best = max(free, key=lambda i: (matched.get(i, 0), -self.load[i], -i))
        if key and matched.get(best, 0) / len(key) > self.cache_threshold:
            chosen = best
        else:  # nothing worth matching: the replica with the most room in its cache
            chosen = min(free, key=lambda i: (self.tree.size(i), self.load[i], i))
        lo, hi = self.load[least], self.load[chosen]
        if hi - lo > self.balance_abs and hi > lo * self.balance_rel:
            return least
        return chosen

    def done(self, i: int) -> None:
        """A request routed to replica i finished (or failed, or was retried elsewhere)."""
        with self._lock:
            self.load[i] -= 1

    # --- replicas coming and going -------------------------------------------------------------------
    def set_up(self, i: int, up: bool) -> bool:
        """Mark replica i up or out; True if that changed anything. Out forgets its tree (its cache is gone)."""
        with self._lock:
            if self.up[i] == up:
                return False
            self.up[i] = up
            if not up:
                self.tree.remove(i)
            return True
