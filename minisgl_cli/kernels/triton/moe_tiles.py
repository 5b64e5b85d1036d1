"""The tiles of the fused MoE's two expert GEMMs by batch size, and for FP8 experts which arithmetic runs them.

Triton-free, so the CPU's simulation of the FP8 experts (layers/moe.py) reads the same switch the kernels obey.

FP8 experts (e4m3 weights, an fp32 scale per output row) run one of two ways (kernels/triton/moe.py):
  w8a16  the weight tile widened to the activation dtype in registers, a 16-bit MMA: bandwidth-bound batches,
         where the widening hides under the weight stream and no activation is rounded to 8 bits
  w8a8   the activations quantized per token to e4m3 first (one fp32 scale per row; the gate/up output again after
         SiLU-and-mul, for the down GEMM), an FP8 MMA on both 8-bit tiles with fp32 sums, the token's scale times
         the channel's in the epilogue: from `W8A8_MIN_TOKENS` tokens, where widening each weight tile for a 16-bit
         MMA held the kernel well under the bandwidth (~2.2-2.8 TB/s on an H200, against 3.0-3.3 for w8a8)

MXFP4 experts (gpt-oss's, packed) run w4a16 at every size (`pick_tiles(n, mxfp4=True)`): their own tiles at one
token, the w8a16 table's from two. Their BLOCK_K must be a multiple of 32 (one exponent per 32 values), as every tile
here is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class MoeConfig:
    """Tile of one expert GEMM: BLOCK_M slot rows (the alignment unit), BLOCK_N output columns, BLOCK_K deep.
    BLOCK_M 1: the GEMV form of unaligned one-slot blocks (kernels/triton/moe.py `_expert_gemv_kernel`): a program a
    slot streams BLOCK_N rows of its expert in fp32 multiply-adds, no MMA tile of padding rows."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class MoeTiles:
    """The tiles of a layer's two expert GEMMs: gate/up (K = hidden, two accumulators) and down (K = the expert's
    width) differ in shape, so each has its own; they share BLOCK_M, the unit the slots are aligned to.
    `fp8_act`: FP8 experts run w8a8 (module docstring), the activations quantized per token."""

    gate_up: MoeConfig
    down: MoeConfig
    fp8_act: bool = False

    def __post_init__(self) -> None:
        if self.gate_up.block_m != self.down.block_m:
            raise ValueError("both expert GEMMs take the slots aligned to one BLOCK_M")

    @classmethod
    def both(cls, cfg: MoeConfig, fp8_act: bool = False) -> MoeTiles:
        return cls(cfg, cfg, fp8_act)


def _tiles(m: int, gate_up: tuple[int, int, int, int], down: tuple[int, int, int, int]) -> MoeTiles:
    return MoeTiles(MoeConfig(m, *gate_up), MoeConfig(m, *down))


# (most tokens, tiles) by batch size, first match wins; one table for 16-bit experts, one for FP8 codes. Up to
# 512 tokens from `examples/moe_bench.py --fp8 --sweep --sizes 1,8,64,256` on one H200 (2026-11-27: every
# candidate of each GEMM at each BLOCK_M, Qwen3-30B-A3B's H 2048, I 768, 128 experts, top 8; docs/gpu.md): at a few
# tokens every block holds one or two real rows and the step is a pass over the chosen experts' weights, so
# narrow N tiles give the grid enough programs; from ~16 slots an expert BLOCK_M 32 holds them in one block, each
# weight tile read once. Past 512 tokens (prefill chunks; FP8 experts take the fused path at every size) the seed
# tiles from the shapes' arithmetic, not yet swept: wider, deeper tiles reuse a weight tile across more rows.
_PREFILL = ((2048, _tiles(64, (128, 64, 8, 3), (128, 64, 8, 3))),
            (1 << 62, _tiles(128, (128, 64, 8, 4), (128, 64, 8, 4))))
# One token (batch-1 decode): the GEMV form. At one slot row a block the MMA tile's 15 padding rows and its operand
# shuffles cost more than the weight stream (Qwen3-30B-A3B's experts at 1.8-2.3 TB/s; gpt-oss's packed ones 5x their
# bytes); the tiles are the dense GEMV's (kernels/triton/gemv.py: a few rows a program, 256-512 deep). One H200
# (2026-11-30, `examples/mxfp4_bench.py --sizes 1 --sweep`, gpt-oss-20b's experts, µs a layer in a graph): packed
# 78.2 on the MMA tiles -> 45.4 in the GEMV form; the sweep's best gate/up 29.3 (16, 256, 2 warps) and down 16.2
# (16, 512, 2) against the picks' 29.6 and 16.6 (kept: within the noise).
GEMV_16BIT = _tiles(1, (4, 512, 4, 1), (4, 256, 4, 1))
# the GEMV form's sweep candidates (BLOCK_N, BLOCK_K, warps, stages: no MMA pipeline to stage), for both benchmarks
GEMV_SWEEP = [(n, k, w, 1) for n in (4, 8, 16) for k in (256, 512, 1024) for w in (2, 4, 8)]
# packed MXFP4 experts at one token, swept after the rows-by-words rework (`mxfp4_bench.py --sizes 1 --sweep`, one
# H200, 2026-12-01, gpt-oss-20b): gate/up 27.4 -> 21.1 us (16 rows, 256 deep, 2 warps), down 23.9 -> 11.8 (1024 deep);
# swept again with the fp16-pair loop (2026-12-02): gate/up 512 deep 17.4 against 256's 19.0, down kept (10.4)
GEMV_MXFP4 = _tiles(1, (16, 512, 2, 1), (8, 1024, 4, 1))
MMA_16BIT_FEW = _tiles(16, (32, 128, 4, 4), (64, 128, 4, 3))  # 2-4 tokens; one token's before the GEMV form
TILES_16BIT: tuple[tuple[int, MoeTiles], ...] = (
    (1, GEMV_16BIT),
    (4, MMA_16BIT_FEW),
    (32, _tiles(16, (32, 256, 4, 3), (64, 128, 4, 3))),
    (128, _tiles(16, (128, 128, 4, 3), (128, 128, 4, 3))),
    (512, _tiles(32, (64, 128, 4, 3), (64, 128, 4, 3))),
    *_PREFILL,
)
TILES_FP8: tuple[tuple[int, MoeTiles], ...] = (  # w8a16 (below W8A8_MIN_TOKENS; the rest for moe_bench's column)
    # the few-token path's one-slot blocks: `--sweep --sweep-dtypes one_slot_fp8 --sizes 1` on an H100 (2026-11-28)
    (4, _tiles(16, (32, 128, 4, 3), (16, 128, 2, 3))),
    (32, _tiles(16, (32, 128, 4, 3), (64, 128, 4, 3))),
    (128, _tiles(16, (32, 128, 4, 4), (64, 128, 4, 3))),
    (512, _tiles(32, (64, 128, 8, 3), (64, 128, 4, 3))),
    *_PREFILL,
)
# MXFP4 experts (w4a16): `examples/mxfp4_bench.py --sizes 1,4 --sweep` on one H200 (2026-11-30, gpt-oss-20b's 32
# experts of H 2880, I 2880, top 4; µs a layer in a graph): at one token 256-deep K tiles, gate/up 47.1 -> 43.0 and down
# 25.7 -> 23.6 (a packed weight tile is half the bytes of an FP8 one: a deeper step keeps as many in flight); at
# four the w8a16 tiles were the sweep's best within 0.5%. Larger batches not swept.
TILES_MXFP4: tuple[tuple[int, MoeTiles], ...] = ((1, GEMV_MXFP4), *TILES_FP8)
MMA_MXFP4_ONE = _tiles(16, (32, 256, 4, 3), (16, 256, 2, 3))  # one token on the MMA tiles (examples/mxfp4_bench.py)
# FP8 experts from this many tokens run w8a8 (module docstring), on these tiles. `examples/moe_bench.py --fp8
# --sizes 1,8,16,32,64,128,256,512,1024` on one H200 (2026-11-27, Qwen3-30B-A3B's shapes, 4 layers in a graph, us a
# layer, w8a16 -> w8a8 on the seed tiles): 1 token 40.5 -> 41.3 (a tie: the two quantization launches cost what the
# FP8 MMA saves), 8: 108.6 -> 95.0, 32: 195 -> 167, 64: 213 -> 183, 256: 274 -> 202, 1024: 516 -> 304; so w8a16
# keeps batches under 8 tokens. The tiles up to 512 tokens: `--sweep --sweep-dtypes w8a8 --sizes 32,64,128,256,512`
# (same card and day; fastest gate/up and down per BLOCK_M). FP8 MMAs like deep K tiles (256 at a few slots an
# expert, 128 from BLOCK_M 32); past 512 tokens the BLOCK_M 64 / 128 seeds of the 16-bit prefill rows, K 128.
W8A8_MIN_TOKENS = 8
TILES_W8A8: tuple[tuple[int, MoeTiles], ...] = tuple((most, replace(t, fp8_act=True)) for most, t in (
    (32, _tiles(16, (32, 256, 4, 3), (64, 256, 4, 3))),
    (64, _tiles(16, (64, 256, 4, 3), (64, 256, 4, 3))),
    (128, _tiles(16, (64, 256, 4, 3), (64, 128, 4, 3))),
    (256, _tiles(32, (64, 128, 4, 3), (128, 128, 4, 4))),
    (2048, _tiles(64, (64, 128, 4, 3), (128, 128, 8, 3))),
    (1 << 62, _tiles(128, (128, 128, 8, 3), (128, 128, 8, 3))),
))
# Batches of up to this many tokens take the fused path; larger ones (prefill chunks) torch's grouped GEMM, a
# CUTLASS kernel built for compute-bound shapes. Not yet measured: a first guess between decode batches (<= 256)
# and prefill chunks (16k).
FUSED_MAX_TOKENS = 1024


# Batches of up to this many tokens skip the alignment: a block a (token, choice) slot, routed inside the gate/up pass
# (kernels/triton/moe.py's `one_slot_experts`), so a decode step of a few tokens runs gate, gate/up and down, and
# the next RMSNorm sums the k terms. `examples/moe_bench.py` on an H100 (2026-11-28, Qwen3-30B-A3B's shapes, one
# token, 4 layers in a graph): 40.8 us a layer against 46.4 aligned (gate, route, align, two GEMMs, the sum); at
# 4 tokens 108.0 against 114.8. The tiles are the aligned table's (the one-slot sweep found none faster for bf16).
# Below W8A8_MIN_TOKENS, so FP8 experts there run w8a16 as the CPU simulates.
SMALL_MAX_TOKENS = 4
# In the GEMV form (one token) a model of this many experts or more routes in a launch of its own first: every
# program of a slot picking the token's top-k over E logits before its first weight load cost more than the launch
# (`examples/moe_bench.py --sizes 1` on an H200, 2026-11-30, Qwen3-30B-A3B's 128 experts, µs a layer: routed in
# gate/up 33.4, a route launch then the GEMV form on its choices 30.3). gpt-oss's 32 stay routed in gate/up.
ROUTE_APART_EXPERTS = 128


def fp8_act(n_tokens: int) -> bool:
    """Whether FP8 experts run w8a8 at a batch of `n_tokens` (the CPU simulation asks too)."""
    return n_tokens >= W8A8_MIN_TOKENS


def pick_tiles(n_tokens: int, fp8: bool = False, w8a8: bool | None = None, mxfp4: bool = False) -> MoeTiles:
    """The tiles of a batch of `n_tokens`; FP8 experts: w8a8's (default: where `fp8_act` says) or w8a16's; MXFP4
    experts (w4a16) their own."""
    if mxfp4:
        table = TILES_MXFP4
    elif not fp8:
        table = TILES_16BIT
    else:
        table = TILES_W8A8 if (fp8_act(n_tokens) if w8a8 is None else w8a8) else TILES_FP8
    return next(t for most, t in table if n_tokens <= most)
