"""Recurrent-state slots: the per-request memory of linear-attention layers (Gated DeltaNet), beside the KV pages.

A linear-attention layer keeps no KV per token: it carries a fixed-size state from token to token, the last
conv_kernel - 1 columns of its causal conv's input (the mixed q, k, v) and the DeltaNet state matrix, heads x
k_dim x v_dim in fp32. A request holds one slot (every linear layer's state at one index) from admission to its end;
a request that cannot get one waits, like one that cannot get pages. The model finds a request's slot through
`slot_of_row` (indexed by the request's page-table row, on the device), so a decode step reads no host value and
CUDA graphs capture it as it is. Beside the request slots, snapshot slots hold states the hybrid prefix cache keeps
(kvcache/hybrid.py), and the last slot is scratch: rows no request holds point there, and so do the padded rows of a
captured decode graph (the model sends rows whose KV slot is the scratch slot 0 there).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateShape:
    num_layers: int  # linear-attention layers
    conv_dim: int  # channels of the causal conv (2 * key_dim + value_dim)
    conv_width: int  # columns of conv input kept: conv_kernel - 1
    num_heads: int  # value heads (each query / key head is repeated over its group)
    k_dim: int
    v_dim: int
    conv_dtype: torch.dtype  # the engine dtype; the DeltaNet state is fp32

    def bytes_per_slot(self) -> int:
        conv = self.conv_dim * self.conv_width * torch.empty((), dtype=self.conv_dtype).element_size()
        return self.num_layers * (conv + self.num_heads * self.k_dim * self.v_dim * 4)


class StatePool:
    """`num_slots` request slots, `num_snapshots` snapshot slots (a hybrid prefix cache's, kvcache/hybrid.py) and the
    scratch slot, of every linear layer, with their allocators."""

    def __init__(self, shape: StateShape, num_slots: int, max_reqs: int, device: torch.device | str,
                 num_snapshots: int = 0):
        if num_slots < 1:
            raise ValueError("a linear-attention model needs at least one state slot")
        self.shape, self.num_slots, self.num_snapshots = shape, num_slots, num_snapshots
        self.device = torch.device(device)
        n = num_slots + num_snapshots + 1
        # One tensor each across the layers, so that zeroing or copying a slot is one device op; the layers read
        # their own views.
        self._conv = torch.zeros((shape.num_layers, n, shape.conv_dim, shape.conv_width), dtype=shape.conv_dtype,
                                 device=device)
        self._ssm = torch.zeros((shape.num_layers, n, shape.num_heads, shape.k_dim, shape.v_dim), dtype=torch.float32,
                                device=device)
        self.conv, self.ssm = list(self._conv.unbind(0)), list(self._ssm.unbind(0))
        self.scratch = n - 1
        self.slot_of_row = torch.full((max_reqs,), self.scratch, dtype=torch.int64, device=device)
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out low slots first
        self._free_snapshots: list[int] = list(range(num_slots + num_snapshots - 1, num_slots - 1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_free_snapshots(self) -> int:
        return len(self._free_snapshots)

    @property
    def nbytes(self) -> int:
        return (self.num_slots + self.num_snapshots + 1) * self.shape.bytes_per_slot()

    def alloc(self, req_row: int) -> int | None:
        """A free slot for the request in page-table row `req_row`, its state zeroed (a fresh sequence), or None
        (nothing taken) when every slot is held. The zeroing is queued on the device after any step in flight that
        still writes the slot's last holder."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._conv[:, slot].zero_()
        self._ssm[:, slot].zero_()
        self.slot_of_row[req_row] = slot
        return slot

    def free(self, slot: int, req_row: int) -> None:
        self.slot_of_row[req_row] = self.scratch
        self._free.append(slot)

    def alloc_snapshot(self) -> int | None:
        return self._free_snapshots.pop() if self._free_snapshots else None

    def free_snapshot(self, slot: int) -> None:
        self._free_snapshots.append(slot)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` takes slot `src`'s state (every layer's), queued after the steps before it."""
        self._conv[:, dst].copy_(self._conv[:, src])
        self._ssm[:, dst].copy_(self._ssm[:, src])
