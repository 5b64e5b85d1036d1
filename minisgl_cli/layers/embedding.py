"""Vocab-parallel embedding and LM head: each rank holds a slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_gather_last_dim, all_reduce
from minisgl_cli.layers import cpu_kernels
from minisgl_cli.layers.fused import Kernels
from minisgl_cli.layers.linear import matmul
from minisgl_cli.loader.hf import Weight


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)  # ceil: the last rank's slice may be padded
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden), requires_grad=False)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        rows = min(self.local_vocab, loaded.shape[0] - self.start)  # the last rank's slice may be short
        if rows > 0:
            self.weight.data[:rows].copy_(loaded.narrow(0, self.start, rows))
        cpu_kernels.invalidate(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)  # not out[outside] = 0: no host sync, so it graphs
        return all_reduce(out, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits = h E^T over this rank's vocabulary slice, gathered to the full vocabulary."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo(), kernels: Kernels | None = None):
        super().__init__(vocab_size, hidden, tp)
        self.kernels = kernels or Kernels()

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = all_gather_last_dim(matmul(hidden, self.weight, None, self.kernels), self.tp)
        return out[..., : self.vocab_size]
