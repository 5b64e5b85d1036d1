"""CacheManager: the scheduler's view of KV memory — page-table rows, prefix matching, page allocation with
eviction, and handing a finished request's pages to the prefix cache. Keeps pages exactly accounted. For a
linear-attention model also each request's recurrent-state slot (kvcache/state.py), taken with its page-table row and
given back with it.

A hybrid's cached KV is usable only together with its linear layers' state at the same point: its radix cache
(kvcache/hybrid.py) keeps state snapshots, taken here where the state in a request's slot is that of a page boundary
-- the end of a prefill chunk before its last token, and the request's end (finished or retracted, unless it failed)
-- and copied back into a request's slot when it matches them. So that a repeated prompt (and an n > 1 choice) finds
one, a hybrid's prefill is cut at the last page boundary before its last token (`prefill_cut`).

It alone writes the page table (through the engine's `write_page_table`): a request's cached prefix when it is
admitted, the tree's pages where a prefill's duplicated them, and each step's new tokens (`write_rows`, one
device op per step).

KV that follows the window: where every layer of the model attends through a sliding window (Mistral: the engine's
`kv_window`), a request's own pages that fell wholly behind it are given back before each step (`_drop_behind`):
no query of the request reads them again. Their page-table entries stay (attention masks those positions), and a
request that gave pages back caches nothing more in the prefix tree when it ends (its prompt, cached after prefill,
stays: that KV is whole), so a cached prefix always comes with all of its KV. A prompt's pages stay while the tree
holds them (locked by the request); the tokens it writes after its prompt cost at most the window's pages.

Where sliding and full layers mix (Gemma 3 / 4, gpt-oss: the engine's `window` and window pages, kvcache/pool.py), the
full layers keep every page and the sliding layers' window pages follow the window: a request's own pages wholly
behind it give their window pages back before each step (`_drop_windows`), so a request holds its full pages and
about a window (plus the chunk in flight) of window pages. A prompt goes to the prefix tree when its prefill is done
(not chunk by chunk), with the window pages of its last window: a repeat of the prompt finds them there. A match is
cut back to where the window pages its next query reads are all there (`_window_cut`), so the cache stays exact:
a prefix comes with the window KV it needs or is recomputed. The tree's window pages on unlocked nodes are given back,
least recently used first, when a step's window pages run short (`allocate`)."""

from __future__ import annotations

import torch

from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.engine import Engine
from minisgl_cli.kvcache import HybridRadixCache, create_prefix_cache
from minisgl_cli.scheduler.request import Req


class CacheManager:
    def __init__(self, engine: Engine, cache_kind: str):
        self.engine = engine  # its KV memory verbs only: pages, page-table rows, page-table writes, uploads
        self.page_size = engine.spec.page_size
        self.num_pages = engine.spec.num_pages
        self.num_state_slots = engine.spec.num_state_slots
        self.num_snapshots = engine.spec.num_state_snapshots
        # A hybrid with a reusing cache: the tree keeps state snapshots (kvcache/hybrid.py)
        self.snapshots = bool(self.num_state_slots) and cache_kind == "radix"
        self.tree = create_prefix_cache(cache_kind, self.page_size,
                                        engine.free_state_snapshot if self.snapshots else None)
        self.window = engine.spec.kv_window  # > 0: pages behind it are given back (the module docstring)
        # > 0: the sliding layers' window, their KV in window pages that follow it (the module docstring)
        self.window_pages = engine.spec.num_window_pages
        self.sliding = engine.spec.window if self.window_pages else 0

    # --- accounting ----------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return self.engine.num_free_pages

    @property
    def available_pages(self) -> int:
        """Free pages plus what eviction could free right now."""
        return self.engine.num_free_pages + self.tree.evictable_tokens // self.page_size

    def pages_in_use(self, reqs: list[Req]) -> int:
        return sum(len(r.pages) - r.dropped for r in reqs)

    def check(self, reqs: list[Req]) -> None:
        """Free + cached + in-use pages must add up to the pool, free + held state slots to theirs (tests call
        this)."""
        total = self.engine.num_free_pages + self.tree.cached_tokens // self.page_size + self.pages_in_use(reqs)
        assert total == self.num_pages, f"page leak: {total} accounted of {self.num_pages}"
        held = sum(r.state_slot is not None for r in reqs)
        slots = self.engine.num_free_state_slots + held
        assert slots == self.num_state_slots, f"state slot leak: {slots} accounted of {self.num_state_slots}"
        if self.snapshots:
            assert isinstance(self.tree, HybridRadixCache)
            snaps = self.engine.num_free_state_snapshots + self.tree.snapshots
            assert snaps == self.num_snapshots, f"state snapshot leak: {snaps} accounted of {self.num_snapshots}"
        if self.window_pages:
            linked = self.engine.window_pages(self._held_pages(reqs))
            held = sum(w != 0 for w in linked)
            assert len(set(linked) - {0}) == held, "a window page linked to two pages"
            total = self.engine.num_free_window_pages + held
            assert total == self.window_pages, f"window page leak: {total} accounted of {self.window_pages}"

    def _held_pages(self, reqs: list[Req]) -> list[int]:
        """Every full page requests and the tree hold."""
        p = self.page_size
        tree = [s // p for node in self.tree.nodes() for s in node.slots[::p].tolist()]
        return tree + [pg for r in reqs for pg in r.pages[r.dropped :]]

    def _slots_to_pages(self, slots: torch.Tensor) -> list[int]:
        if self.page_size == 1:
            return slots.tolist()
        return (slots[slots % self.page_size == 0] // self.page_size).tolist()

    # --- verbs ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Evict the whole prefix cache into the free pages (no request may be holding any of it)."""
        self.engine.free_pages(self._slots_to_pages(self.tree.evict(self.tree.cached_tokens)))

    def attach(self, req: Req) -> bool:
        """Give `req` a page-table row and attach its longest cached prefix (never the whole sequence: the last
        token must run); False (nothing taken) when no row is free."""
        row = req.req_row = self.engine.alloc_req_row()
        if row is None:
            return False
        if self.num_state_slots:
            req.state_slot = self.engine.alloc_state_slot(row)
            if req.state_slot is None:  # every state slot is held: it waits, like a request short of pages
                self.engine.free_req_row(row)
                req.req_row = None
                return False
        ids = req.all_key_ids
        m = self.tree.match(ids[: len(ids) - 1])
        if self.sliding and m.length:
            keep = self._window_cut(m.slots)
            if keep < m.length:  # its next query would read window KV the tree gave back: recompute from there
                m = self.tree.match(ids[:keep])
        self.tree.lock(m.node)
        req.prefix_node, req.prefix_len, req.kv_len = m.node, m.length, m.length
        req.prefix_slots = m.slots[: m.length].tolist() if m.length else []
        if m.length and req.state_slot is not None:  # a hybrid's match ends at a snapshot: its state comes back
            self.engine.copy_state(m.node.state, req.state_slot)
        if m.length:
            # Through pinned memory, asynchronously: a pageable copy would wait for the step in flight.
            self.engine.write_page_table(row, slice(0, m.length), self.engine.upload(req.prefix_slots, torch.int32))
        return True

    def _window_cut(self, slots: torch.Tensor) -> int:
        """The longest page-aligned prefix of a match (its KV `slots`) after which a query at its end finds every
        window page it reads (positions end - window + 1 .. end - 1), 0 where there is none."""
        p, w = self.page_size, self.sliding
        has = [pg != 0 for pg in self.engine.window_pages((slots[::p] // p).tolist())]
        run: list[int] = []  # run[j]: pages with window pages in a row, ending at page j
        for ok in has:
            run.append(run[-1] + 1 if ok and run else int(ok))
        for j in range(len(has), 0, -1):
            end = j * p
            if run[j - 1] >= j - max(0, end - w + 1) // p:
                return end
        return 0

    def allocate(self, n_pages: int) -> list[int] | None:
        """n pages (each with a window page, where the model has window layers), evicting unlocked cache leaves if
        needed and then the window pages of unlocked cache nodes; None (and nothing taken) if impossible."""
        short = n_pages - self.engine.num_free_pages
        if short > 0:
            self.engine.free_pages(self._slots_to_pages(self.tree.evict(short * self.page_size)))
        short = n_pages - self.engine.num_free_window_pages if self.window_pages else 0
        for node in self.tree.nodes(unlocked=True) if short > 0 else []:  # least recently used first
            short -= self.engine.drop_windows(self._slots_to_pages(node.slots))
            if short <= 0:
                break
        return self.engine.alloc_pages(n_pages)

    def reserve(self, req: Req, n: int) -> bool:
        """Make sure pages cover positions up to kv_len+n (allocating, evicting); False if out of pages."""
        return self.reserve_each([req], n)

    def rewind(self, req: Req) -> None:
        """Give back the pages past `req.kv_len` (a verify step's rejected drafts); the page table's entries past it
        are never read (attention reads each row up to its length) and the next step overwrites them."""
        keep = -(-req.kv_len // self.page_size) - req.prefix_len // self.page_size
        if keep < len(req.pages):
            self.engine.free_pages(req.pages[max(keep, req.dropped) :])  # (pages given back are 0s in the list)
            del req.pages[keep:]
            req.dropped, req.windows_dropped = min(req.dropped, keep), min(req.windows_dropped, keep)

    def can_rewind(self, req: Req, kv_len: int) -> bool:
        """Whether a query at `kv_len` would find all the KV it reads of `req`'s (none of it given back behind a
        window since): a rewind further back than the window must start over."""
        given_back = max(req.dropped, req.windows_dropped)
        window = self.sliding or self.window
        return not given_back or req.prefix_len + given_back * self.page_size <= kv_len - window + 1

    def reserve_each(self, reqs: list[Req], n: int) -> bool:
        """`reserve(req, n)` for every request at once, with one allocation (a decode step's new pages); False, and
        nothing taken, when the pool (after eviction) cannot cover all of them."""
        p = self.page_size
        if self.window:
            for r in reqs:
                self._drop_behind(r)
        if self.sliding:
            for r in reqs:
                self._drop_windows(r, r.kv_len - self.sliding)
        needs = [-(-(r.kv_len + n) // p) - (r.prefix_len // p + len(r.pages)) for r in reqs]
        total = sum(k for k in needs if k > 0)
        if not total:
            return True
        pages = self.allocate(total)
        if pages is None:
            return False
        at = 0
        for r, k in zip(reqs, needs):
            if k > 0:
                r.pages += pages[at : at + k]
                at += k
        return True

    def _drop_behind(self, req: Req) -> None:
        """Give back `req`'s own pages wholly behind the window of its next step's queries (positions >= kv_len; a
        query at q reads positions q - window + 1 .. q), with a position of slack. A step still in flight that reads
        a page given back here runs before any later step can write it (one device stream; on the CPU it has run)."""
        dead = (req.kv_len - self.window) // self.page_size - req.prefix_len // self.page_size
        if dead > req.dropped:
            self.engine.free_pages(req.pages[req.dropped : dead])
            req.pages[req.dropped : dead] = [0] * (dead - req.dropped)  # page 0: the scratch page, never read
            req.dropped = dead

    def _drop_windows(self, req: Req, end: int) -> None:
        """Give back the window pages of `req`'s own pages wholly before position `end` (a query at q reads window
        positions q - window + 1 .. q: before each step, end = kv_len - window keeps a position of slack). A step still
        in flight that reads one runs before any later step can write it (one device stream), as in _drop_behind."""
        dead = end // self.page_size - req.prefix_len // self.page_size
        if dead > req.windows_dropped:
            self.engine.drop_windows(req.pages[req.windows_dropped : dead])
            req.windows_dropped = dead

    def slots(self, req: Req, start: int, end: int) -> list[int]:
        """KV slots of positions start..end-1 (reserved already), computed on the host: no device read."""
        p, first = self.page_size, req.prefix_len
        pre = req.prefix_slots[start:min(end, first)] if start < first else []
        own, lo = req.pages, max(start, first)
        if p == 1:
            return pre + own[lo - first : end - first]
        base = first // p
        return pre + [own[q // p - base] * p + q % p for q in range(lo, end)]

    def write_rows(self, fb: ForwardBatch, locs: list[int]) -> None:
        """page_table[row of each new token of the step, its position] = its KV slot (`locs`, the step's
        out_cache_loc on the host): one device op per step, or none of its own where a decode graph's replay writes
        them (`Engine.write_step_rows`); with window pages another, the slots' window slots."""
        self.engine.write_step_rows(fb)
        if self.window_pages:
            self.engine.write_slot_map(fb.out_cache_loc, self.engine.upload(self.engine.window_slots(locs),
                                                                            torch.int64))

    def prefill_cut(self, req: Req, n: int) -> int:
        """How many of the next n tokens `req` prefills this step: a hybrid's chunk ends at the last page boundary
        before its last token, where its state is snapshot for a repeated prompt to start from."""
        if self.window_pages:  # a chunk takes at most half the window pages: the running requests' windows keep theirs
            n = min(n, max(1, self.window_pages // 2 * self.page_size))
        if not self.snapshots:
            return n
        cut = (req.seq_len - 1) // self.page_size * self.page_size
        return cut - req.kv_len if req.kv_len < cut < req.kv_len + n else n

    def _snapshot(self, req: Req, ids: list[int]) -> int | None:
        """A snapshot of `req`'s state for the tree's node of ids (its state covers exactly ids): a new snapshot slot
        holding it (evicting cache leaves for one where none is free), -1 where that node has one already, None
        where no slot can be had."""
        assert isinstance(self.tree, HybridRadixCache) and req.state_slot is not None
        node = self.tree.node_at(ids)
        if node is not None and node.state >= 0:
            return -1
        snap = self.engine.alloc_state_snapshot()
        while snap is None:
            freed = self.tree.evict(self.page_size)  # LRU leaves, with their snapshots
            if not len(freed):
                return None
            self.engine.free_pages(self._slots_to_pages(freed))
            snap = self.engine.alloc_state_snapshot()
        self.engine.copy_state(req.state_slot, snap)
        return snap

    def cache_prefilled(self, req: Req) -> None:
        """Hand a request's computed prompt to the tree right after prefill, not only at finish, so
        requests arriving meanwhile with the same prefix (a shared system prompt) reuse it. A hybrid's goes where
        the chunk ended on a page boundary before the last token, with a snapshot of its state."""
        if not self.tree.reuses or req.dropped:  # a request that gave pages back holds no whole prompt to cache
            return
        p = self.page_size
        if self.sliding:  # the prompt whole, once, with its last window's window pages (the module docstring)
            if req.kv_len < len(req.input_ids):
                return
            n = len(req.input_ids)
            self._drop_windows(req, n - n % p - self.sliding - p)
        old = req.prefix_len
        snap = -1
        if self.snapshots:
            aligned = req.kv_len  # what the state in its slot covers
            if aligned % p or aligned <= old or aligned >= req.seq_len:
                return
            got = self._snapshot(req, req.all_key_ids[:aligned])
            if got is None:
                return
            snap = got
        else:
            n = min(req.kv_len, len(req.input_ids))
            aligned = n - n % p
            if aligned <= old:
                return
        ids = req.all_key_ids[:aligned]
        existing = self.tree.insert(ids, torch.tensor(self.slots(req, 0, aligned), dtype=torch.int64))
        if snap >= 0:
            assert isinstance(self.tree, HybridRadixCache)
            self.tree.set_state(ids, snap)
        m = self.tree.match(ids)
        self.tree.lock(m.node)
        assert req.prefix_node is not None and req.req_row is not None  # attach() gave both
        self.tree.unlock(req.prefix_node)
        # Pages below `existing` duplicate what another request cached first: point at the tree's, free ours.
        first_own, covered = old // p, aligned // p - old // p
        dup = max(existing, old) // p - first_own
        if dup and self.window_pages:  # the tree's pages take our window KV where they lack it (this request reads it)
            self.engine.adopt_windows((m.slots[old : old + dup * p : p] // p).tolist(), req.pages[:dup])
        self.engine.free_pages(req.pages[:dup])
        req.pages = req.pages[covered:]
        req.windows_dropped = max(0, req.windows_dropped - covered)
        req.prefix_node, req.prefix_len, req.prefix_slots = m.node, aligned, m.slots.tolist()
        if dup:
            end = max(existing, old)
            fix = self.engine.upload(req.prefix_slots[old:end], torch.int32)
            self.engine.write_page_table(req.req_row, slice(old, end), fix)

    def release(self, req: Req, cache: bool = True, state_ok: bool = True) -> None:
        """Give a request's KV back: cache its computed prefix in the tree, free the rest. A hybrid's is cached only
        with a snapshot of its state, where that covers exactly its known tokens up to a page boundary and is
        trustworthy (`state_ok`: not after a failed step, which may have updated it part way)."""
        if req.req_row is None:
            return
        p = self.page_size
        # Under overlap scheduling kv_len may run one ahead of the known tokens: cache what is known.
        n = min(req.kv_len, req.seq_len)
        cache = cache and not req.dropped  # a request that gave pages back holds no whole sequence to cache
        snap = -1
        if cache and self.snapshots and req.kv_len > req.prefix_len:
            got = self._snapshot(req, req.all_key_ids[:n]) if state_ok and n == req.kv_len and n % p == 0 else None
            cache = got is not None
            snap = got if got is not None else -1
        if cache and req.kv_len > req.prefix_len:
            ids = req.all_key_ids[:n]
            slots = torch.tensor(self.slots(req, 0, n), dtype=torch.int64)
            aligned = n - n % p
            existing = self.tree.insert(ids[:aligned], slots[:aligned])
            if snap >= 0:
                assert isinstance(self.tree, HybridRadixCache)
                self.tree.set_state(ids[:aligned], snap)
            # Own pages below `existing` duplicate the tree's; pages past `aligned` hold a partial page.
            first_own = req.prefix_len // p
            keep_from, keep_to = max(existing, req.prefix_len) // p, aligned // p
            if self.window_pages and keep_from > first_own:  # the tree keeps their window KV where it has none
                tree = self.tree.match(ids[: keep_from * p]).slots
                self.engine.adopt_windows((tree[first_own * p :: p] // p).tolist(), req.pages[: keep_from - first_own])
            adopted = set(req.pages[keep_from - first_own : keep_to - first_own])
            self.engine.free_pages([pg for pg in req.pages if pg not in adopted])
        else:
            self.engine.free_pages(req.pages[req.dropped :])
        req.pages, req.dropped, req.windows_dropped = [], 0, 0
        if req.prefix_node is not None:
            self.tree.unlock(req.prefix_node)
            req.prefix_node = None
        req.prefix_len = req.kv_len = 0
        req.prefix_slots = []
        if req.state_slot is not None:
            self.engine.free_state_slot(req.state_slot, req.req_row)
            req.state_slot = None
        self.engine.free_req_row(req.req_row)
        req.req_row = None
