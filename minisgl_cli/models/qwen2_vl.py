"""Qwen2-VL and Qwen2.5-VL: the vision tower (patch embedding, ViT blocks, 2x2 patch merger) over our TP linear
layers, and the Qwen2 decoder of models/llama.py with M-RoPE.

Images reach the decoder as embeddings written into their placeholder rows at prefill (`ForwardBatch.images`:
the engine runs the tower, vision/state.py); each token then turns by its time / height / width positions. A
decode step turns by the plain position plus the request's M-RoPE delta (`rope_deltas`, by page-table row, so a
CUDA graph replays it). The tower's attention heads, MLP and merger are split across TP ranks as the decoder's are.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.attention.torch_backend import sdpa
from minisgl_cli.distributed import TPInfo
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.linear import ColumnParallelLinear, RowParallelLinear, divide
from minisgl_cli.layers.norm import RMSNorm
from minisgl_cli.layers.quant import LinearMethod
from minisgl_cli.layers.rotary import MRotaryEmbedding
from minisgl_cli.loader.hf import Weight, whole
from minisgl_cli.models.config import ModelConfig, VisionConfig
from minisgl_cli.models.llama import LlamaForCausalLM

Grid = tuple[int, int, int]  # an image's (t, h, w) in patches


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm that loads from a checkpoint (Qwen2-VL's tower)."""

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        getattr(self, name).data.copy_(whole(loaded))


def _norm(vc: VisionConfig, dim: int, kernels: Kernels) -> nn.Module:
    return LayerNorm(dim, eps=1e-6) if vc.version == "2" else RMSNorm(dim, 1e-6, kernels)


class PatchEmbed(nn.Module):
    """The Conv3d whose kernel is its stride (temporal x patch x patch): one matrix over each flattened patch."""

    def __init__(self, vc: VisionConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vc.hidden_size, vc.in_channels * vc.temporal_patch_size
                                               * vc.patch_size**2), requires_grad=False)

    def load_shard(self, name: str, loaded: Weight, shard: int = 0) -> None:
        self.weight.data.copy_(whole(loaded).reshape(self.weight.shape))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return F.linear(pixels.to(self.weight.dtype), self.weight)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [S, H, D] turned by cos / sin [S, D] in fp32 (as HF's vision RoPE), back in x's dtype."""
    xf = x.float()
    half = x.shape[-1] // 2
    turned = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos[:, None] + turned * sin[:, None]).to(x.dtype)


class Segments:
    """Runs of rows that attend among themselves and not across (an image, a frame or a window), grouped by length
    once per forward: each group's rows as one index (a batch for SDPA), made on the device before the first layer."""

    def __init__(self, lengths: list[int], device: torch.device):
        self.whole = len(lengths) == 1
        starts: dict[int, list[int]] = {}
        at = 0
        for n in lengths:
            starts.setdefault(n, []).append(at)
            at += n
        self.groups = [(n, len(firsts), (torch.tensor(firsts)[:, None] + torch.arange(n)).reshape(-1).to(device))
                       for n, firsts in starts.items()]


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segments: Segments) -> torch.Tensor:
    """Bidirectional attention of q, k, v [S, H, D] within each segment, none across: the segments of one length go
    through SDPA together, as a batch."""
    S, H, D = q.shape
    scale = D**-0.5
    if segments.whole:  # (torch_backend.sdpa: not cuDNN's on CUDA, which plans each new image size anew)
        o = sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None, scale)
        return o[0].transpose(0, 1)
    out = torch.empty_like(q)
    for n, m, rows in segments.groups:
        qs, ks, vs = (t[rows].view(m, n, H, D).transpose(1, 2) for t in (q, k, v))
        out[rows] = sdpa(qs, ks, vs, None, scale).transpose(1, 2).reshape(m * n, H, D)
    return out


class VisionAttention(nn.Module):
    def __init__(self, vc: VisionConfig, tp: TPInfo, kernels: Kernels):
        super().__init__()
        dim = vc.hidden_size
        self.head_dim = dim // vc.num_heads
        self.local_heads = divide(vc.num_heads, tp, "vision attention heads")
        self.qkv = ColumnParallelLinear(dim, [dim] * 3, bias=True, tp=tp, kernels=kernels, method=LinearMethod())
        self.proj = RowParallelLinear(dim, dim, bias=True, tp=tp, kernels=kernels, method=LinearMethod())

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.local_heads, self.head_dim).unbind(1)
        o = segment_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v, segments)
        return self.proj(o.reshape(x.shape[0], -1))


class VisionMLP(nn.Module):
    """Qwen2-VL: fc1, QuickGELU, fc2. Qwen2.5-VL: gate and up (one merged matrix), SiLU(gate) * up, down."""

    def __init__(self, vc: VisionConfig, tp: TPInfo, kernels: Kernels):
        super().__init__()
        self.gated = vc.version != "2"
        dim, inner = vc.hidden_size, vc.intermediate_size
        self.up = ColumnParallelLinear(dim, [inner] * (2 if self.gated else 1), bias=True, tp=tp, kernels=kernels,
                                       method=LinearMethod())
        self.down = RowParallelLinear(inner, dim, bias=True, tp=tp, kernels=kernels, method=LinearMethod())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.gated:
            return self.down.forward_silu_mul(h)
        return self.down(h * torch.sigmoid(1.702 * h))  # QuickGELU


class VisionBlock(nn.Module):
    def __init__(self, vc: VisionConfig, tp: TPInfo, kernels: Kernels):
        super().__init__()
        self.norm1 = _norm(vc, vc.hidden_size, kernels)
        self.norm2 = _norm(vc, vc.hidden_size, kernels)
        self.attn = VisionAttention(vc, tp, kernels)
        self.mlp = VisionMLP(vc, tp, kernels)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: Segments) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2x2 block of patches (merge x merge, adjacent rows of the tower) -> one decoder-wide embedding."""

    def __init__(self, vc: VisionConfig, tp: TPInfo, kernels: Kernels):
        super().__init__()
        self.width = vc.hidden_size * vc.spatial_merge_size**2
        self.ln_q = _norm(vc, vc.hidden_size, kernels)
        self.fc1 = ColumnParallelLinear(self.width, [self.width], bias=True, tp=tp, kernels=kernels,
                                        method=LinearMethod())
        self.fc2 = RowParallelLinear(self.width, vc.out_hidden_size, bias=True, tp=tp, kernels=kernels,
                                     method=LinearMethod())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.ln_q(x).view(-1, self.width))))


class VisionTower(nn.Module):
    """Pixel rows of some images -> their embeddings, one row per placeholder token, images in order."""

    inv_freq: torch.Tensor  # the 2-D RoPE's frequencies (a buffer, registered below)

    def __init__(self, vc: VisionConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None):
        super().__init__()
        kernels = kernels or Kernels()
        self.vc = vc
        self.patch_embed = PatchEmbed(vc)
        self.blocks = nn.ModuleList(VisionBlock(vc, tp, kernels) for _ in range(vc.depth))
        self.merger = PatchMerger(vc, tp, kernels)
        rot = vc.hidden_size // vc.num_heads // 2  # each of h and w turns a quarter of a head
        self.register_buffer("inv_freq", 1.0 / vc.rope_theta ** (torch.arange(0, rot, 2, dtype=torch.float) / rot),
                             persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.weight.dtype

    def tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.vc.spatial_merge_size**2

    def _positions(self, grids: list[Grid]) -> torch.Tensor:
        """[patches, 2]: each patch's (row, column), patches in the processor's order (merge blocks row-major)."""
        m, out = self.vc.spatial_merge_size, []
        for t, h, w in grids:
            rows = torch.arange(h)[:, None].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            cols = torch.arange(w)[None, :].expand(h, w).reshape(h // m, m, w // m, m).transpose(1, 2).reshape(-1)
            out.append(torch.stack((rows, cols), -1).repeat(t, 1))
        return torch.cat(out)

    def _windows(self, grids: list[Grid]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merge units in window order, and each window's length in patches."""
        m = self.vc.spatial_merge_size
        side = self.vc.window_size // m // self.vc.patch_size  # a window's side, in merge units
        order, lengths, base = [], [], 0
        for t, h, w in grids:
            gh, gw = h // m, w // m
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            ph, pw = -gh % side, -gw % side
            nh, nw = (gh + ph) // side, (gw + pw) // side
            padded = F.pad(index, (0, pw, 0, ph), value=-1).reshape(t, nh, side, nw, side)
            padded = padded.permute(0, 1, 3, 2, 4).reshape(t * nh * nw, side * side)
            for window in padded:
                kept = window[window >= 0]
                if len(kept):
                    order.append(kept + base)
                    lengths.append(len(kept) * m * m)
            base += t * gh * gw
        return torch.cat(order), lengths

    def forward(self, pixels: torch.Tensor, grids: list[Grid]) -> torch.Tensor:
        device = self.patch_embed.weight.device
        x = self.patch_embed(pixels.to(device))
        pos = self._positions(grids).to(device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # [S, D/2]: the row's, then the column's
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        whole_images = Segments([h * w for t, h, w in grids for _ in range(t)], device)
        windows = whole_images
        order = None
        if self.vc.version != "2":
            order, window_lengths = self._windows(grids)
            windows = Segments(window_lengths, device)
            order = order.to(device)
            unit = self.vc.spatial_merge_size**2

            def permute(a: torch.Tensor) -> torch.Tensor:
                return a.view(-1, unit, a.shape[-1])[order].view(-1, a.shape[-1])

            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            full = self.vc.version == "2" or i in self.vc.fullatt_block_indexes
            x = block(x, cos, sin, whole_images if full else windows)
        out = self.merger(x)
        return out if order is None else out[torch.argsort(order)]

    # Checkpoint names below `visual.` -> (our module, shard) for the merged matrices.
    _RENAMES = ((re.compile(r"merger\.mlp\.0\."), "merger.fc1."), (re.compile(r"merger\.mlp\.2\."), "merger.fc2."),
                (re.compile(r"patch_embed\.proj\."), "patch_embed."), (re.compile(r"mlp\.fc1\."), "mlp.up."),
                (re.compile(r"mlp\.fc2\."), "mlp.down."), (re.compile(r"mlp\.down_proj\."), "mlp.down."))

    def load(self, name: str, tensor: Weight) -> None:
        """One `visual.`-relative checkpoint tensor into place (q / k / v and gate / up into their merged shards)."""
        for pattern, to in self._RENAMES:
            name = pattern.sub(to, name)
        path, _, leaf = name.rpartition(".")
        modules = dict(self.named_modules())
        if path.endswith("attn.qkv"):
            dim = self.vc.hidden_size
            for i in range(3):
                modules[path].load_shard(leaf, tensor.narrow(0, i * dim, dim), i)
            return
        shard = 0
        gated = re.fullmatch(r"(.*mlp)\.(gate|up)_proj", path)
        if gated:
            path, shard = f"{gated[1]}.up", int(gated[2] == "up")
        module = modules.get(path)
        if module is None or not hasattr(module, "load_shard"):
            raise KeyError(f"checkpoint tensor visual.{name} has no place in the vision tower")
        module.load_shard(leaf, tensor, shard)


def _hf_name(name: str) -> str:
    """transformers 5's names (model.language_model., model.visual.) as the hub's checkpoints spell them."""
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("model.") if name.startswith("model.visual.") else name


class Qwen2VLForConditionalGeneration(LlamaForCausalLM):
    """Qwen2-VL / Qwen2.5-VL: the Qwen2 decoder (M-RoPE) and `visual`, the vision tower the engine runs on images."""

    rope: MRotaryEmbedding

    def __init__(self, cfg: ModelConfig, tp: TPInfo = TPInfo(), kernels: Kernels | None = None,
                 method: LinearMethod | None = None):
        super().__init__(cfg, tp, kernels, method)
        vc = cfg.vision
        assert vc is not None  # the config's architecture chose this class
        # The tower splits its heads, MLP and merger across TP ranks where they divide evenly (Qwen2.5-VL-7B's MLP
        # of 3420 does not at TP 8); else every rank runs all of it, the same numbers, no collective.
        split = all(n % tp.size == 0 for n in (vc.num_heads, vc.intermediate_size,
                                                vc.hidden_size * vc.spatial_merge_size**2))
        self.visual = VisionTower(vc, tp if split else TPInfo(), self.kernels)
        # Each page-table row's M-RoPE delta (its request's last position minus its length), for decode steps: the
        # engine sizes it (`bind_slots`) and writes a row when a request takes it.
        self.rope_deltas = torch.zeros(1, dtype=torch.int64)

    def bind_slots(self, slots: int) -> torch.Tensor:
        self.rope_deltas = torch.zeros(slots, dtype=torch.int64, device=self.embed_tokens.weight.device)
        return self.rope_deltas

    def forward(self, batch: ForwardBatch, attn: AttentionBackend) -> torch.Tensor:
        h = self.embed_tokens(batch.input_ids)
        images = batch.images
        if batch.is_decode:
            rope = self.rope.table(batch.positions + self.rope_deltas[batch.req_rows])
        elif images is None:
            rope = self.rope.table(batch.positions)
        else:
            if images.rows is not None and images.embeds is not None:
                h = h.index_copy(0, images.rows, images.embeds.to(h.dtype))
            rope = self.rope.table_3d(images.positions)
        return self.decode_layers(h, batch, attn, rope)

    def load_weights(self, weights: Iterable[tuple[str, Weight]]) -> set[str]:
        used: set[str] = set()

        def text() -> Iterator[tuple[str, Weight]]:
            for name, tensor in weights:
                name = _hf_name(name)
                if name.startswith("visual."):
                    self.visual.load(name.removeprefix("visual."), tensor)
                    used.add(name)
                else:
                    yield name, tensor

        return super().load_weights(text()) | used


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    pass
