"""The KV pool's share of a CUDA device's free memory, and what it leaves a process that loads beside it later.

By default the pool takes 0.85 of the memory free after the weights (the rest: CUDA graphs, activations). A KeepFree
on the same device (serve's media worker, which loads its pipeline on the first image request) comes off first; a
device too small for both is refused at start, not at the first image. An explicit --mem-fraction or
--max-total-tokens wins, with a warning where it leaves the neighbour less than it needs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from minisgl_cli.engine.config import KeepFree
from minisgl_cli.notice import notice

if TYPE_CHECKING:
    import torch

log = logging.getLogger("minisgl.engine")

DEFAULT_MEM_FRACTION = 0.85
# The smallest pool the default split may leave beside a neighbour: below it the device is too small for both.
MIN_KV_TOKENS = 4096
GIB = 1 << 30


@dataclass(frozen=True)
class Split:
    """How the free memory after the weights splits: `kv_bytes` for the KV pool, `keep` left to a neighbour."""

    kv_bytes: int
    keep: KeepFree | None = None  # None: no neighbour on this device, or an explicit size (it keeps nothing itself)
    device: str = "cuda"
    warning: str | None = None  # an explicit size leaves the neighbour less than it needs

    def line(self, kv_tokens: int, pool_bytes: int) -> str | None:
        """The start-up line of a split that kept memory (the KV pool then holds `kv_tokens` in `pool_bytes`, at most
        `kv_bytes`: the engine takes no more than its running requests can fill); None for one that kept none."""
        if self.keep is None:
            return None
        return (f"kept {self.keep.nbytes / GIB:.1f} GiB of {self.device} for {self.keep.what}; the KV pool has "
                f"{kv_tokens:,} tokens in its {pool_bytes / GIB:.1f} GiB")

    def report(self, kv_tokens: int, pool_bytes: int) -> None:
        """The start-up line as a notice; the warning of an explicit size that leaves too little."""
        if self.warning:
            log.warning(self.warning)
        if line := self.line(kv_tokens, pool_bytes):
            notice(line)


def shares_device(keep: KeepFree | None, device: str | torch.device) -> KeepFree | None:
    """`keep` when it is on `device` (an index left out is device 0 in every process), else None."""
    if keep is None:
        return None

    def where(d: str) -> tuple[str, int]:
        kind, _, index = d.partition(":")
        return kind, int(index or 0)

    return keep if where(keep.device) == where(str(device)) else None


def split(free: int, keep: KeepFree | None, *, mem_fraction: float | None = None, pool_bytes: int | None = None,
          min_pool: int = 0, device: str = "cuda") -> Split:
    """The KV pool's bytes out of `free` (bytes free after the weights) beside `keep` (None: nothing to keep):
    `pool_bytes` (--max-total-tokens' pool), else `mem_fraction` of `free`, else by default 0.85 of what is left
    once `keep` is kept. ValueError where the default would leave the pool less than `min_pool` (the bytes of
    MIN_KV_TOKENS tokens); a warning in the Split where an explicit size leaves `keep` less than it needs."""
    if pool_bytes is None and mem_fraction is None:
        kv = int(max(0, free - (keep.nbytes if keep is not None else 0)) * DEFAULT_MEM_FRACTION)
        if keep is not None and kv < min_pool:
            raise ValueError(
                f"{device} has {free / GIB:.1f} GiB free after the text model's weights: {keep.what} needs "
                f"{keep.nbytes / GIB:.1f} GiB of it and the KV pool at least {min_pool / GIB:.1f} GiB "
                f"({MIN_KV_TOKENS:,} tokens): {keep.remedy}")
        return Split(kv, keep, device)
    kv = pool_bytes if pool_bytes is not None else int(free * (mem_fraction or DEFAULT_MEM_FRACTION))
    warning = None
    if keep is not None and free - kv < keep.nbytes:
        flag = "--max-total-tokens" if pool_bytes is not None else f"--mem-fraction {mem_fraction:g}"
        warning = (f"{flag} leaves {max(0, free - kv) / GIB:.1f} GiB of {device} beside the KV pool, and "
                   f"{keep.what} needs {keep.nbytes / GIB:.1f} GiB: its first job may run out of memory (leave "
                   f"{flag.split()[0]} out to split the GPU between them)")
    return Split(kv, None, device, warning)
