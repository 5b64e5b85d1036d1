"""The radix prefix cache of a linear-attention hybrid: cached KV counts only where its linear layers' state is known.

A full-attention layer can continue from any cached prefix; a Gated DeltaNet layer only from its state at that very
point. So a node may carry a snapshot of that state at its end (a slot of kvcache/state.py's pool, `RadixNode.state`),
taken where a request's prefill chunk or the request itself ended on a page boundary, and a match is cut back to the
deepest matched node that has one: a request then restores both the KV of the full-attention layers (the pages up to
there) and the linear layers' state (the snapshot copied into its own slot). A snapshot lives and dies with its node:
evicting the node (LRU, unlocked leaves first, as any cached KV) frees its snapshot slot; when the snapshot slots run
out, the cache manager evicts leaves until one is free. The snapshots' memory is their own budget (the pool's
snapshot slots), apart from the KV pages.
"""

from __future__ import annotations

from collections.abc import Callable

from minisgl_cli.kvcache.radix import MatchResult, RadixCache, RadixNode


class HybridRadixCache(RadixCache):
    def __init__(self, page_size: int, free_state: Callable[[int], None]):
        """`free_state`: hands an evicted node's snapshot slot back to the state pool."""
        super().__init__(page_size)
        self.free_state = free_state

    @property
    def snapshots(self) -> int:
        """Snapshot slots the tree holds."""
        return sum(node.state >= 0 for node in self._nodes())

    def match(self, ids: list[int]) -> MatchResult:
        """The longest cached prefix of ids whose end has a snapshot (marks the path as recently used)."""
        m = super().match(ids)
        node, length = m.node, m.length
        while node is not self.root and node.state < 0:
            length -= len(node.key)
            assert node.parent is not None
            node = node.parent
        return MatchResult(node, m.slots[:length], length)

    def node_at(self, ids: list[int]) -> RadixNode | None:
        """The node ending exactly after ids (page aligned), or None where the tree does not hold all of ids."""
        m = super().match(ids)
        return m.node if m.length == len(ids) and ids else None

    def set_state(self, ids: list[int], slot: int) -> None:
        """The node ending after ids (inserted just now) takes snapshot `slot`."""
        node = self.node_at(ids)
        assert node is not None and node.state < 0, "a snapshot goes to a node of ids with none yet"
        node.state = slot

    def _dropped(self, node: RadixNode) -> None:
        if node.state >= 0:
            self.free_state(node.state)
            node.state = -1
