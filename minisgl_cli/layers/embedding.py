"""Vocab-parallel embedding and LM head: each rank holds a slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.distributed import TPInfo
from minisgl_cli.distributed.comm import all_gather_last_dim, all_reduce
from minisgl_cli.layers import cpu_gemm
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.loader.hf import Weight, whole


def _vocab_rows(loaded: Weight, start: int, size: int) -> Weight | None:
    """This rank's rows of a vocabulary-sized tensor (the last rank's slice may be short, or empty)."""
    rows = min(size, loaded.shape[0] - start)
    return loaded.narrow(0, start, rows) if rows > 0 else None


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo()):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)  # ceil: the last rank's slice may be padded
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden), requires_grad=False)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        part = _vocab_rows(loaded, self.start, self.local_vocab)
        if part is not None:
            self.weight.data[: part.shape[0]].copy_(whole(part))
        cpu_gemm.invalidate(self.weight)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)  # not out[outside] = 0: no host sync, so it graphs
        return all_reduce(out, self.tp)


class ParallelLMHead(nn.Module):
    """Logits = h E^T over this rank's vocabulary slice, gathered to the full vocabulary.

    E is held as `method` says (layers/quant.py). Tied to the embedding, it is the embedding's weight; a
    quantized method makes its own copy of it once loaded (the lookups keep the dense one)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None, tied: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.hidden = hidden
        self.local_vocab = -(-vocab_size // tp.size)
        self.start = tp.rank * self.local_vocab
        self.kernels = kernels or Kernels()
        self.method = method or LinearMethod()
        self.tied = tied is not None
        if tied is not None:
            self.weight = tied.weight
        else:
            self.method.create(self, self.local_vocab, hidden)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        part = _vocab_rows(loaded, self.start, self.local_vocab)
        if part is not None:
            self.method.load(self, part, 0)

    def finish_loading(self) -> None:
        if self.tied and self.method.quantized:
            self.method.create(self, self.local_vocab, self.hidden)
            self.method.load(self, self.weight, 0)
        self.method.finish(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        out = all_gather_last_dim(self.method.apply(self, hidden, None), self.tp)
        return out[..., : self.vocab_size]
