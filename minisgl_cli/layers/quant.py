"""Linear methods: how a linear layer holds its weight and computes x W^T — dense, int4 / int8 copies on CPU, or
FP8 weights (Hopper; simulated on CPU).

A method is stateless (one per engine); what it makes lives on the layer. A layer calls `create` once,
`load` per checkpoint shard (a dense tensor, or a GGUF's quantized groups: loader/blocks.py), `finish`
once every shard is in, then `apply` per forward (`apply_silu_mul` for the down projection, whose input
is a fused gate-up). METHODS maps the `--quantization` values to the methods; `devices` says where each
runs (EngineConfig refuses the others with a one-line error).

  none  the weight, dense in the engine dtype (layers/cpu_gemm.py's GEMMs, or the Triton GEMV on CUDA)
  int4  plus its 4-bit copy: groups of 32 inputs with a scale and a zero each. A GGUF's Q4_0 / Q4_1 blocks
        load as they are; a dense checkpoint quantizes like Q4_1 (min and (max - min) / 15 per group)
  int8  plus its 8-bit copy, one scale per output channel (re-quantized per row from a GGUF's Q8_0)
  fp8   e4m3 weights with one fp32 scale per output channel (the whole row's), made at load from the
        dense checkpoint (kernels/fp8.py). More than one row: activations quantized per token on the fly, one
        GEMM through torch._scaled_mm (row-wise scales, bf16 out). One row (batch-1 decode): the Triton GEMV
        reads the 8-bit weights against the 16-bit row (kernels/triton/gemv.py). On the CPU (and on CUDA
        with the fused ops off) the same numbers by quantize / dequantize in fp32: the simulation the
        kernels are tested against and the quality checks run on.
  fp8-block  a block-wise FP8 checkpoint's weights as shipped (DeepSeek-V3's: e4m3 with one fp32 scale per
        128 x 128 block, loader/blocks.py's Fp8Blocks), CUDA 8.9+ only: activations quantized per token per
        128 columns, then kernels/triton/fp8_block.py's block-scaled GEMM (at one row too). Not a --quantization
        choice: auto takes it for such a checkpoint on such a GPU; elsewhere (the CPU, --quantization none) its
        weights are dequantized at load and run dense. The LM head is dense (dequantized) here; MoE experts keep
        their blocks too (layers/moe.py's Experts, the fused Triton experts: w8a16, or w8a8 with the activations
        per token per 128 columns from moe_tiles.W8A8_MIN_TOKENS tokens) where a TP rank's expert width is whole
        blocks, else they are dense as well.
  mxfp4  an MXFP4 checkpoint's MoE experts as shipped (gpt-oss's: two e2m1 codes a byte, an e8m0 exponent per 32
        values; layers/moe.py's Experts hold them, kernels/triton/moe.py runs them w4a16), every linear dense as under
        none. CUDA only, not a --quantization choice either: auto takes it for such a checkpoint on a CUDA GPU
        (loader/mxfp4.py's `packs` says where the experts can stay packed); elsewhere, and under --quantization none,
        the experts are dequantized at load.

The int4 copy runs minisgl's own kernel where the CPU has AVX512-BF16 (kernels/cpu/int4.py: 1.3x PyTorch's at one
row, ~2x at 16), else PyTorch's `_weight_int4pack_mm_for_cpu`; the int8 copy runs `_weight_int8pack_mm`; all with
bf16 activations (PyTorch's only vectorized path, on AVX2 and AVX-512 alike; fp32 in and out around them). Reading 4
or 8 bits per weight, they win while a step has few rows (decode), but their cost grows with every row, so an extend
step (prefill) runs the dense weight: the GEMM is compute-bound there, and the prompt is read with the model's exact
weights. The step's kind picks the copy, never its row count (`apply`'s `decode`): a prompt's last token takes the
same arithmetic whether it is prefilled cold or extended alone after a prefix hit, and a decode row the same
whatever the batch size (each kernel gives each row the same result whatever the rows beside it), so a greedy answer
does not depend on the cache.

The LM head of an int4 / int8 model is held as int8 per channel and multiplied with the activations quantized per
row on the fly, as two int8 rows (codes, then their remainder's; int32 sums, fp32 logits): 8 bits because 4-bit
logits cost SmolLM2 6% perplexity (8-bit: 0.2%), and int8 sums because they are the fastest 8-bit kernel at every
batch size here, exact whatever the batch, and not rounded to bf16 (near-tied greedy choices stay as exact). Where
the CPU lacks VNNI the head stays dense instead (see _FBGEMM).

Under fp8 the LM head, the embedding, the norms and the first and last decoder layers stay in the engine
dtype (as vLLM and sglang keep the head): on SmolLM2-135M (the second story of tests/data/perplexity_en.txt,
FP8 KV on) an e4m3 head alone costs ~1.3% perplexity and the edge layers most of the rest (docs/gpu.md), against the 2%
that FP8 weights + KV may cost in all.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl_cli.kernels import fp8
from minisgl_cli.kernels.cpu import int4 as cpu_int4
from minisgl_cli.layers import cpu_gemm
from minisgl_cli.layers.activation import silu_and_mul
from minisgl_cli.layers.kernel_choice import Kernels
from minisgl_cli.layers.rotary import RopeTable
from minisgl_cli.loader.blocks import (
    Fp8Blocks,
    Int4Groups,
    Int8Groups,
    int8_scales,
    quantize_fp8_blocks,
    quantize_int4,
    quantize_int8,
)
from minisgl_cli.loader.hf import Weight, whole

Layer = Any  # the linear layer or LM head a method fills: it sets attributes (weight, qweight, ...) on it

INT4_GROUP = cpu_int4.GROUP  # GGUF's block size (ATen's kernel also takes 64 / 128 / 256)
_KERNEL_DTYPE = torch.bfloat16  # activations, scales and zeros of the int4 / int8 weight-only kernels
_N_ALIGN = 16  # the int4 pack takes output rows in multiples of 16: pad with zero rows


def gemv_ops(x: torch.Tensor, weight: torch.Tensor, kernels: Kernels) -> ModuleType | None:
    """The Triton ops when x's few CUDA rows (a small decode batch) take their GEMV: it beats cuBLAS there
    (Kernels.gemv_rows)."""
    return kernels.gemv_rows(x, weight)


class LinearMethod:
    """The dense method (`none`): the layer's weight [out_features, in_features] in the engine dtype."""

    name = "none"
    quantized = False
    devices: tuple[str, ...] = ("cpu", "cuda")
    takes_blocks = False  # loads a GGUF's int4 / int8 blocks as shipped (else the dense checkpoint)
    decode_copy = False  # decode steps run a low-bit copy beside the dense weight (`low_bit_copy`)

    def create(self, layer: Layer, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)

    def load(self, layer: Layer, w: Weight, row: int, full: Weight | None = None) -> None:
        """Write `w` (this rank's columns already) into the layer's rows row .. row + len(w). `full`: a row-split
        layer's unsplit rows, of which w is this rank's columns: a method with one scale per output channel takes it
        from the whole row, so that every TP rank holds its columns of TP 1's numbers (not a finer scale of its own)."""
        layer.weight.data.narrow(0, row, w.shape[0]).copy_(whole(w))
        cpu_gemm.invalidate(layer.weight)

    def finish(self, layer: Layer) -> None:
        """Called once all rows are loaded."""

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, decode: bool = False) -> torch.Tensor:
        """x W^T (+ bias) through the fastest kernel for the shape: Triton GEMV, CPU packs, or F.linear. `decode`:
        x is a decode step's rows (the quantized CPU methods run their low-bit copy for them, else the dense one)."""
        ops = gemv_ops(x, layer.weight, layer.kernels)
        if ops is not None:
            return ops.gemv(x.contiguous(), layer.weight, bias, pdl=layer.kernels.pdl)
        return cpu_gemm.linear(x, layer.weight, bias, layer.kernels.cpu_gemm)

    def apply_silu_mul(self, layer: Layer, gate_up: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """apply(silu(gate) * up) of a fused [T, 2I] gate-up: at one CUDA row, one GEMV that reads the gate-up."""
        ops = gemv_ops(gate_up, layer.weight, layer.kernels)
        if ops is None:
            return self.apply(layer, silu_and_mul(gate_up, layer.kernels), None, decode)
        return ops.gemv(gate_up.contiguous(), layer.weight, act_mul=True, pdl=layer.kernels.pdl)

    def apply_gate_up_silu(self, layer: Layer, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a merged gate-up layer's x W^T (no bias) in one GEMV, the SiLU-and-mul in its epilogue,
        where the kernels do that for x (Kernels.gate_up_silu); None: the caller runs apply, then the activation."""
        ops = layer.kernels.gate_up_silu(x, layer.weight)
        if ops is None:
            return None
        return ops.gemv(x.contiguous(), layer.weight, pdl=layer.kernels.pdl, gate_up=True)

    def apply_rope_kv(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, rope: RopeTable,
                      heads: tuple[int, int, int], kv: fp8.KVCache) -> torch.Tensor | None:
        """A fused qkv layer's x W^T (+ bias) with RoPE on its q and k heads (heads: Hq, Hkv, D) and k, v stored to
        `kv` (attention.base.KVBuffers) in one GEMV, where the kernels do that for x (Kernels.qkv_rope); None: the
        caller runs apply, then the RoPE and the store."""
        ops = layer.kernels.qkv_rope(x, layer.weight)
        if ops is None:
            return None
        return ops.gemv_rope_kv(x, layer.weight, bias, rope.rows, rope.cos, rope.sin, *heads, kv,
                                pdl=layer.kernels.pdl)

    def takes_fp8_rows(self, layer: Layer, x: torch.Tensor) -> bool:
        """Whether `apply_fp8_rows` takes x quantized per token (kernels/fp8.Fp8Rows, from the norm before it)."""
        return False

    def apply_fp8_rows(self, layer: Layer, rows: fp8.Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        """`apply` of rows already quantized per token: only for a method whose `takes_fp8_rows` said so."""
        raise TypeError(f"the {self.name!r} linear method takes no FP8 rows")

    def low_bit_copy(self, holder: nn.Module, w: torch.Tensor, shards: Sequence[Weight] | None = None,
                     full: Weight | None = None) -> None:
        """Give `holder` a decode copy of the dense matrix w: only for a method with `decode_copy`."""
        raise TypeError(f"the {self.name!r} linear method keeps no decode copy")

    def for_lm_head(self) -> LinearMethod:
        """The method of the model's LM head (the vocabulary projection)."""
        return self

    def for_layer(self, layer_id: int, num_layers: int) -> LinearMethod:
        """The method of decoder layer `layer_id`'s linears (fp8 keeps the sensitive edge layers dense)."""
        return self


class _WeightOnly(LinearMethod):
    """The dense weight for prefill steps plus a low-bit copy (int4 / int8) for decode steps."""

    quantized = True
    devices = ("cpu",)
    takes_blocks = True
    decode_copy = True

    def low_bit_copy(self, holder: nn.Module, w: torch.Tensor, shards: Sequence[Weight] | None = None,
                     full: Weight | None = None) -> None:
        """Give `holder` the decode copy of a dense matrix w [n, k] already in place (an MoE expert's) and w itself
        as its `weight`, a view, not a second dense copy: `apply(holder, x, None, decode=True)` then multiplies by
        the copy, as a linear layer's decode rows are. The copy is made of `shards` (w's rows top to bottom, e.g. a
        GGUF's blocks as shipped) where given, else quantized from w; `full` as `load` says (one shard)."""
        staged = self._stage(*w.shape)
        row = 0
        for shard in shards if shards is not None else [w]:
            for dst, part in zip(staged, self._convert(shard, full)):
                dst.narrow(0, row, part.shape[0]).copy_(part)
            row += shard.shape[0]
        assert row == w.shape[0], (row, w.shape)
        for name, t in zip(("qweight", "qscale"), self._pack(staged)):
            holder.register_buffer(name, t, persistent=False)
        holder.weight = w

    def create(self, layer: Layer, out_features: int, in_features: int) -> None:
        super().create(layer, out_features, in_features)
        layer.staged = self._stage(out_features, in_features)

    def load(self, layer: Layer, w: Weight, row: int, full: Weight | None = None) -> None:
        super().load(layer, w, row)
        for dst, part in zip(layer.staged, self._convert(w, full)):
            dst.narrow(0, row, part.shape[0]).copy_(part)

    def finish(self, layer: Layer) -> None:
        # Buffers, not plain attributes: an exported step (cpu_step/compiled.py) names them by module path.
        staged = layer.staged
        del layer.staged  # the staging copies go with the load
        for name, t in zip(("qweight", "qscale"), self._pack(staged)):
            layer.register_buffer(name, t, persistent=False)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, decode: bool = False) -> torch.Tensor:
        if not decode:
            return super().apply(layer, x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        n = layer.weight.shape[0]
        y = self._mm(x2.to(_KERNEL_DTYPE).contiguous(), layer)[:, :n].to(x.dtype).view(*x.shape[:-1], n)
        return y + bias if bias is not None else y

    def apply_silu_mul(self, layer: Layer, gate_up: torch.Tensor, decode: bool = False) -> torch.Tensor:
        return self.apply(layer, silu_and_mul(gate_up, layer.kernels), None, decode)

    def apply_gate_up_silu(self, layer: Layer, x: torch.Tensor) -> torch.Tensor | None:
        return None  # the low-bit copy's kernels have no epilogue

    def apply_rope_kv(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, rope: RopeTable,
                      heads: tuple[int, int, int], kv: fp8.KVCache) -> torch.Tensor | None:
        return None

    def for_lm_head(self) -> LinearMethod:
        # Where fbgemm's int8 would run 7-bit activations (no VNNI, see _FBGEMM) the head stays dense: exact logits,
        # at the cost of reading fp32 weights (docs/benchmarks.md, issue 53).
        return Int8LogitsMethod() if _FBGEMM else LinearMethod()

    # What each method fills in: staging planes, a checkpoint shard as planes, the kernel's layout, the kernel.
    def _stage(self, n: int, k: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def _convert(self, w: Weight, full: Weight | None = None) -> tuple[torch.Tensor, ...]:
        """w as the staging planes; `full` as `load` says."""
        raise NotImplementedError

    def _pack(self, staged: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def _mm(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        raise NotImplementedError


class Int4Method(_WeightOnly):
    """4-bit groups of 32 inputs: w = scale * q + min per group, q in 0..15 (Q4_1's form)."""

    name = "int4"

    def _stage(self, n: int, k: int) -> tuple[torch.Tensor, ...]:
        if k % INT4_GROUP:
            raise ValueError(f"--quantization int4 needs in_features divisible by {INT4_GROUP}, got {k}")
        g = k // INT4_GROUP
        # Rows a shard never writes (a TP rank's vocabulary padding) keep scale = min = 0, so weight 0.
        return torch.empty(n, k, dtype=torch.uint8), torch.zeros(n, g), torch.zeros(n, g)

    def _convert(self, w: Weight, full: Weight | None = None) -> tuple[torch.Tensor, ...]:
        # Groups of 32 inputs: a rank's columns start on a group (loader/blocks.py checks), so they need no `full`.
        if not (isinstance(w, Int4Groups) and w.group == INT4_GROUP):
            w = quantize_int4(whole(w), INT4_GROUP)
        return w.q, w.scale, w.min

    def _pack(self, staged: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale, low = staged
        pad = -q.shape[0] % _N_ALIGN
        q, scale, low = (F.pad(t, (0, 0, 0, pad)) for t in (q, scale, low))
        if cpu_int4.kernel() == "minisgl":
            return cpu_int4.pack(q, scale, low)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)
        # The kernel computes (q - 8) * scale + zero, so Q4_1's min becomes zero = min + 8 * scale.
        scale_zero = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)  # [K / group, N, 2]
        return packed, scale_zero.to(_KERNEL_DTYPE).contiguous()

    def _mm(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        if layer.qweight.dim() == 3:  # packed for minisgl::int4_mm
            return cpu_int4.mm(x, layer.qweight, layer.qscale)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.qweight, INT4_GROUP, layer.qscale)


class Int8Method(_WeightOnly):
    """8 bits per weight, one scale per output channel: w = scale * q, q in -127..127."""

    name = "int8"

    def _stage(self, n: int, k: int) -> tuple[torch.Tensor, ...]:
        return torch.zeros(n, k, dtype=torch.int8), torch.zeros(n, 1)

    def _convert(self, w: Weight, full: Weight | None = None) -> tuple[torch.Tensor, ...]:
        if not (isinstance(w, Int8Groups) and w.group == w.shape[1]):  # per channel already: narrow kept its scale
            w = quantize_int8(whole(w), None if full is None else int8_scales(whole(full)))
        return w.q, w.scale

    def _pack(self, staged: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = staged
        return q, scale[:, 0].to(_KERNEL_DTYPE)

    def _mm(self, x: torch.Tensor, layer: Layer) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x, layer.qweight, layer.qscale)


class Int8LogitsMethod(LinearMethod):
    """The LM head of the quantized methods: int8 weights per channel times the activations quantized on the fly as two
    8-bit rows each (codes, then their remainder's codes), int32 sums, fp32 logits. fbgemm's dynamic int8 linear
    (`quantized::linear_dynamic`: 2-3x faster than torch._int_mm here at every batch size) runs it; where this torch
    no longer builds its packed weight (its qint8 tensors are deprecated since 2.13), torch._int_mm does. It keeps
    no dense copy (a tied head reads the embedding's).

    fbgemm quantizes its whole input with one scale and zero point, from the input's min and max: rows (each
    activation row's two) scaled to +-127 first, plus two anchor columns at +-127 (zero weights) so that min and
    max, and with them every row's codes, are the same whatever the other rows of the batch hold."""

    name = "int8-logits"
    quantized = True
    devices = ("cpu",)

    def create(self, layer: Layer, out_features: int, in_features: int) -> None:
        layer.staged = (torch.zeros(out_features, in_features, dtype=torch.int8), torch.zeros(out_features, 1))

    def load(self, layer: Layer, w: Weight, row: int, full: Weight | None = None) -> None:
        q = quantize_int8(whole(w))  # the head splits the vocabulary: each rank holds whole rows
        for dst, part in zip(layer.staged, (q.q, q.scale)):
            dst.narrow(0, row, part.shape[0]).copy_(part)

    def finish(self, layer: Layer) -> None:
        q, scale = layer.staged
        del layer.staged
        layer.fbgemm = _fbgemm_pack(F.pad(q, (0, _ANCHORS.shape[1])), scale[:, 0])  # the anchors' zero weights
        if layer.fbgemm is None:
            layer.qweight_t, layer.qscale = q.t(), scale[:, 0]  # _int_mm takes [K, N]: this transposed view is fastest

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, decode: bool = False) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).float()
        m = x2.shape[0]
        # Each row in two 8-bit rows: its codes at its own scale, then what they left out at that remainder's scale.
        # One 8-bit row loses a hidden state's small features beside its outliers (SmolLM2's "What is the capital of
        # France?" then opened "L'Étoile, ..."); two carry ~15 bits for the same weight bytes, one pass over them
        # (tests/test_quant.py: a row with an outlier feature within 0.1% of the int8 weights' exact product).
        hi_scale = x2.abs().amax(-1, keepdim=True).clamp_(min=1e-12) / 127
        hi = (x2 / hi_scale).round_().clamp_(-127, 127)
        rest = x2 - hi * hi_scale
        lo_scale = rest.abs().amax(-1, keepdim=True).clamp_(min=1e-12) / 127
        rows, scales = torch.cat([hi, rest / lo_scale]), torch.cat([hi_scale, lo_scale])
        if layer.fbgemm is not None:  # one input scale for fbgemm: rows scaled alike, anchors fix its min and max
            xa = torch.cat([rows.clamp_(-127, 127), _ANCHORS.expand(2 * m, -1)], dim=1)
            y = torch.ops.quantized.linear_dynamic(xa, layer.fbgemm, False) * scales
        else:
            y = torch._int_mm(rows.round_().to(torch.int8), layer.qweight_t) * scales * layer.qscale  # fp32 logits
        y = (y[:m] + y[m:]).view(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y


# fbgemm multiplies uint8 activations by int8 weights; without VNNI its 16-bit pair sums can saturate, so it would
# keep activations to 7 bits there (reduce_range): too coarse for logits (the default model's answer to "What is the
# capital of France?" changed at its first token on an AVX2 CPU). There the quantized methods keep a dense head, and
# Int8LogitsMethod itself (asked for directly) runs torch._int_mm's exact int32 sums (3x slower there than dense).
_FBGEMM = torch.cpu._is_vnni_supported()
# The input's min and max whatever its rows (clamped to them: rounding may leave a scaled row a hair past 127). fbgemm
# spreads [min, max] over 255 steps: [-128, 127] makes its step exactly 1 (zero point 128), so the integer codes pass
# through as they are (at [-127, 127] each moved by up to half a step: 17x the two rows' logit error).
_ANCHORS = torch.tensor([[127.0, -128.0]])


def _fbgemm_pack(q: torch.Tensor, scale: torch.Tensor) -> Any | None:
    """fbgemm's packed form of int8 weights [N, K] with a scale per row, or None where it is not used (no VNNI) or
    torch cannot make it."""
    if not _FBGEMM:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # qint8 tensors are deprecated (pytorch/pytorch#184982)
            zero = torch.zeros(q.shape[0], dtype=torch.long)
            wq = torch._make_per_channel_quantized_tensor(q, scale.double(), zero, 0)
            return torch.ops.quantized.linear_prepack(wq, None)
    except (AttributeError, RuntimeError):
        return None


class Fp8Method(LinearMethod):
    """e4m3 weights with a per-output-channel fp32 scale; activations per token (see the module docstring).

    The layer holds `weight` (e4m3 [N, K]) and `weight_scale` (fp32 [N]); on the CPU also `weight_dense`, the
    dequantized weight in fp32 that the quantize / dequantize path multiplies by."""

    name = "fp8"
    quantized = True

    def create(self, layer: Layer, out_features: int, in_features: int) -> None:
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8.FP8), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.ones(out_features, dtype=torch.float32), requires_grad=False)

    def load(self, layer: Layer, w: Weight, row: int, full: Weight | None = None) -> None:
        # Whole rows arrive (a merged shard's rows, or a row-split layer's local columns at once): quantize now, by
        # the whole row's scale (`full`'s) where w is a row-split layer's columns.
        x = whole(w).to(layer.weight.device)
        scale = fp8.row_scales(x if full is None else whole(full).to(x.device))
        codes = fp8.quantize(x, scale)
        layer.weight.data.narrow(0, row, codes.shape[0]).copy_(codes)
        layer.weight_scale.data.narrow(0, row, codes.shape[0]).copy_(scale[:, 0])

    def finish(self, layer: Layer) -> None:
        if layer.weight.device.type == "cpu":
            layer.weight_dense = fp8.dequantize(layer.weight.data, layer.weight_scale.data[:, None])

    def for_lm_head(self) -> LinearMethod:
        return LinearMethod()

    def for_layer(self, layer_id: int, num_layers: int) -> LinearMethod:
        # The first and last decoder layers stay dense: on SmolLM2-135M they carry most of FP8's perplexity
        # cost (docs/gpu.md: with them in FP8, or all but their down projections, it passes the 2% bar).
        edge = num_layers > 2 and layer_id in (0, num_layers - 1)
        return LinearMethod() if edge else self

    def takes_fp8_rows(self, layer: Layer, x: torch.Tensor) -> bool:
        # Where apply would quantize the rows itself for torch._scaled_mm (the kernels, more than one row).
        return self._ops(layer, x) is not None and x.reshape(-1, x.shape[-1]).shape[0] > 1

    def apply_fp8_rows(self, layer: Layer, rows: fp8.Fp8Rows, bias: torch.Tensor | None) -> torch.Tensor:
        return self._scaled_mm(rows.codes, rows.scales, layer, bias, rows.dtype)

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, decode: bool = False) -> torch.Tensor:
        ops = self._ops(layer, x)
        if ops is None:
            return self._reference(layer, x, bias)
        pdl, n = layer.kernels.pdl, layer.weight.shape[0]
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] == 1:
            return ops.gemv(x2.contiguous(), layer.weight, bias, pdl=pdl, scale=layer.weight_scale).view(
                *x.shape[:-1], n)
        xq, xs = ops.quant_rows(x2.contiguous(), pdl=pdl)
        return self._scaled_mm(xq, xs, layer, bias, x.dtype).view(*x.shape[:-1], n)

    def apply_silu_mul(self, layer: Layer, gate_up: torch.Tensor, decode: bool = False) -> torch.Tensor:
        ops = self._ops(layer, gate_up)
        if ops is None or gate_up.dim() != 2:
            return self._reference(layer, silu_and_mul(gate_up, layer.kernels), None)
        if gate_up.shape[0] == 1:
            return ops.gemv(gate_up.contiguous(), layer.weight, act_mul=True, pdl=layer.kernels.pdl,
                            scale=layer.weight_scale)
        xq, xs = ops.quant_rows(gate_up.contiguous(), act="silu_mul", pdl=layer.kernels.pdl)  # SiLU-and-mul fused in
        return self._scaled_mm(xq, xs, layer, None, gate_up.dtype)

    def apply_gate_up_silu(self, layer: Layer, x: torch.Tensor) -> torch.Tensor | None:
        ops = layer.kernels.gate_up_silu(x, layer.weight) if self._ops(layer, x) is not None else None
        if ops is None:
            return None
        return ops.gemv(x.contiguous(), layer.weight, pdl=layer.kernels.pdl, scale=layer.weight_scale, gate_up=True)

    @staticmethod
    def _ops(layer: Layer, x: torch.Tensor) -> ModuleType | None:
        """The Triton ops where the kernels run this layer (CUDA, fused ops on, and a weight whose sides are
        multiples of 16, as _scaled_mm wants); None: the reference path."""
        n, k = layer.weight.shape
        return None if k % 16 or n % 16 else layer.kernels.triton(x)

    @staticmethod
    def _scaled_mm(xq: torch.Tensor, xs: torch.Tensor, layer: Layer, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
        # Row-wise scaling: x's per-token scales [M, 1] and the weight's per-channel ones [1, N], fp32 sums,
        # bf16 out (the only output type row-wise scaling takes).
        y = torch._scaled_mm(xq, layer.weight.t(), scale_a=xs, scale_b=layer.weight_scale[None, :],
                             out_dtype=torch.bfloat16).to(dtype)
        return y + bias if bias is not None else y

    @staticmethod
    def _reference(layer: Layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The same numbers in fp32 by quantize / dequantize: activations per token unless x is one row."""
        x2 = x.reshape(-1, x.shape[-1])
        xf = x2.float() if x2.shape[0] == 1 else fp8.round_trip_rows(x2)
        w = getattr(layer, "weight_dense", None)
        if w is None:  # CUDA: dequantized per call (a reference path, not a fast one)
            w = fp8.dequantize(layer.weight, layer.weight_scale[:, None])
        y = F.linear(xf, w).to(x.dtype).view(*x.shape[:-1], w.shape[0])
        return y + bias if bias is not None else y


class Fp8BlockMethod(LinearMethod):
    """A block-wise FP8 checkpoint's weights kept as shipped (see the module docstring): the layer holds `weight`
    (e4m3 [N, K]) and `weight_scale_inv` (fp32 [ceil(N / bn), ceil(K / bk)]). Shards arrive as Fp8Blocks (a TP
    rank's or a merged projection's rows start on a block); a dense one (rows a model reordered across blocks, or
    --load-format dummy) is quantized into blocks the same way the checkpoint's were."""

    name = "fp8-block"
    quantized = True
    devices = ("cuda",)

    def __init__(self, block: tuple[int, int] = (128, 128)):
        self.block = block

    def create(self, layer: Layer, out_features: int, in_features: int) -> None:
        bn, bk = self.block
        layer.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=fp8.FP8), requires_grad=False)
        layer.weight_scale_inv = nn.Parameter(torch.ones(-(-out_features // bn), -(-in_features // bk)),
                                              requires_grad=False)

    def load(self, layer: Layer, w: Weight, row: int, full: Weight | None = None) -> None:
        bn = self.block[0]
        if not (isinstance(w, Fp8Blocks) and w.block == self.block):
            w = quantize_fp8_blocks(whole(w), self.block)
        if row % bn:
            raise ValueError(f"a block-wise FP8 shard starts at row {row}, inside a block of {bn} rows")
        layer.weight.data.narrow(0, row, w.q.shape[0]).copy_(w.q)
        layer.weight_scale_inv.data.narrow(0, row // bn, w.scale_inv.shape[0]).copy_(w.scale_inv)

    def for_lm_head(self) -> LinearMethod:
        return LinearMethod()

    def apply(self, layer: Layer, x: torch.Tensor, bias: torch.Tensor | None, decode: bool = False) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.kernels.triton(x2) is not None:
            from minisgl_cli.kernels.triton.fp8_block import block_fp8_linear

            y = block_fp8_linear(x2, layer.weight, layer.weight_scale_inv, self.block)
        else:  # the same numbers in fp32 (fused ops off): activations per token group, blocks dequantized
            codes, scales = fp8.quantize_groups(x2, self.block[1])
            w = Fp8Blocks(layer.weight, layer.weight_scale_inv, self.block).dequantize()
            y = F.linear(fp8.dequantize_groups(codes, scales, self.block[1]), w).to(x.dtype)
        y = y.view(*x.shape[:-1], y.shape[-1])
        return y + bias if bias is not None else y

    def apply_silu_mul(self, layer: Layer, gate_up: torch.Tensor, decode: bool = False) -> torch.Tensor:
        # not the dense method's one-row GEMV: that one knows no block scales
        return self.apply(layer, silu_and_mul(gate_up, layer.kernels), None, decode)

    def apply_gate_up_silu(self, layer: Layer, x: torch.Tensor) -> torch.Tensor | None:
        return None  # the block-scaled GEMM has no epilogue


class Mxfp4Method(LinearMethod):
    """MXFP4 experts kept packed (see the module docstring); the linears are the dense method's."""

    name = "mxfp4"
    devices = ("cuda",)


METHODS: dict[str, type[LinearMethod]] = {"none": LinearMethod, "int4": Int4Method, "int8": Int8Method,
                                           "fp8": Fp8Method, "fp8-block": Fp8BlockMethod, "mxfp4": Mxfp4Method}
