"""The KV pool: per-layer K/V slot tensors, the page table, and the page allocator with exact accounting."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


class KVPool:
    """Pages of `page_size` token slots; slot s of page p is `p * page_size + s`.

    Page 0 is reserved as a scratch page (padded CUDA-graph rows write there), so `num_pages`
    usable pages are 1..num_pages. The page table maps (request slot, position) -> KV slot.
    """

    def __init__(
        self,
        shape: KVShape,
        num_pages: int,
        page_size: int,
        max_reqs: int,
        max_context_len: int,
        device: torch.device | str,
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError("KV pool needs at least one page of at least one slot")
        self.shape = shape
        self.page_size = page_size
        self.num_pages = num_pages
        self.device = torch.device(device)
        num_slots = (num_pages + 1) * page_size
        kv = (num_slots, shape.num_kv_heads, shape.head_dim)
        self.k = [torch.zeros(kv, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.v = [torch.zeros(kv, dtype=shape.dtype, device=device) for _ in range(shape.num_layers)]
        self.max_context_len = max_context_len
        self.page_table = torch.zeros((max_reqs, max_context_len), dtype=torch.int32, device=device)
        self._free_pages: list[int] = list(range(num_pages, 0, -1))  # pop() hands out low pages first
        self._free_req_slots: list[int] = list(range(max_reqs - 1, -1, -1))

    @staticmethod
    def pages_for_budget(shape: KVShape, budget_bytes: int, page_size: int) -> int:
        return max(1, budget_bytes // (shape.bytes_per_token() * page_size))

    # --- pages ---------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def alloc_pages(self, n: int) -> list[int] | None:
        """Take n pages, or None (and take nothing) when fewer are free."""
        if n > len(self._free_pages):
            return None
        taken = self._free_pages[-n:] if n else []
        del self._free_pages[len(self._free_pages) - n :]
        return taken

    def free_pages(self, pages: list[int]) -> None:
        self._free_pages.extend(pages)

    def slots_of_pages(self, pages: list[int]) -> torch.Tensor:
        """All token slots of the given pages, in order."""
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).reshape(-1)

    # --- request slots (rows of the page table) ------------------------------------------------
    @property
    def num_free_req_slots(self) -> int:
        return len(self._free_req_slots)

    def alloc_req_slot(self) -> int | None:
        return self._free_req_slots.pop() if self._free_req_slots else None

    def free_req_slot(self, slot: int) -> None:
        self._free_req_slots.append(slot)

    # --- KV writes -----------------------------------------------------------------------------
    def store(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer_id][loc] = k
        self.v[layer_id][loc] = v
