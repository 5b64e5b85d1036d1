"""The MoE layer on one GPU: the fused Triton experts against torch's grouped GEMM, then Qwen3-30B-A3B's batch-1 decode.

    PYTHONPATH=. python examples/moe_bench.py [--out DIR] [--sizes 1,8,64,256] [--fp8] [--sweep] [--no-engine]

1. The MoE block of Qwen3-30B-A3B (H 2048, 128 experts of I 768, top 8; gate included) at M = 1, 8, 64, 256
   tokens (--sizes; past FUSED_MAX_TOKENS the block itself takes the grouped GEMM), random bf16 weights, `LAYERS`
   blocks captured back to back in one CUDA graph (so weights come from DRAM, as in a decode step): fused Triton
   (kernels/triton/moe.py, the tile its table picks) vs the block on torch's grouped GEMM; the gate +
   routing + alignment alone; --fp8: the fused kernels over e4m3 weights (per-row scales): the table's pick, then
   w8a16 and w8a8 each on its own tiles (kernels/triton/moe_tiles), with their errors against the bf16 weights; up to 8
   tokens also the few-token path (`one_slot_experts`: a block a slot, routed in gate/up) with its launches one at a
   time, and the aligned path with PDL on (FP8: PDL on and off). The bytes
   of the experts the tokens chose over the fused time give an effective TB/s. `--sweep` also times every
   candidate tile of each GEMM per BLOCK_M, bf16 and (--fp8) w8a16 and w8a8 (--sweep-dtypes picks), for the
   TILES tables; `--sweep-dtypes one_slot,one_slot_fp8`: the few-token path's (at one token the GEMV form's, BLOCK_M 1).
   At one token also the few-token path on the MMA tiles (`one_slot_mma`) beside the GEMV form the table picks.
2. Qwen3-30B-A3B with dummy weights (bf16; --fp8: then FP8 experts and linears, a second engine): one 128-token
   prompt, 256 new tokens, EOS ignored, CUDA graphs and overlap on; decode tok/s with the fused experts as shipped,
   without the few-token path ("aligned"), and as shipped again (graphs recaptured; every other fused op stays
   on); --profile: the shipped step's kernels.

Prints a table and writes moe_bench.json under --out ($OUT). One H100, defaults: ~70 s (Triton compiles on a cold
cache, the 61 GB engine's start); each of --fp8 and --sweep adds ~10-30 s.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import drop_engine, run_requests  # noqa: E402  (the scheduler driver)
from timing import graph_us as _graph_us  # noqa: E402

from minisgl_cli.distributed import TPInfo  # noqa: E402
from minisgl_cli.engine.config import EngineConfig  # noqa: E402
from minisgl_cli.engine.engine import Engine  # noqa: E402
from minisgl_cli.kernels.fp8 import quantize_rows  # noqa: E402
from minisgl_cli.kernels.triton import moe as triton_moe  # noqa: E402
from minisgl_cli.kernels.triton import ops as triton_ops
from minisgl_cli.layers import moe  # noqa: E402
from minisgl_cli.layers.kernel_choice import Kernels  # noqa: E402
from minisgl_cli.layers.moe import MoE  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B
LAYERS = 4  # 4 x 1.2 GB of experts: none stays in the 50 MB L2 between its calls
# The sweep's candidates for one GEMM (BLOCK_N, BLOCK_K, warps, stages) and BLOCK_M by batch size (the slots an
# expert holds at T tokens: T k / E on average).
SWEEP_NK = [(n, k, w, st) for n in (32, 64, 128) for k in (64, 128, 256) for w, st in ((4, 3), (4, 4), (8, 3))] + [
    (256, 64, 8, 3), (256, 128, 8, 3)] + [(16, k, w, st) for k in (128, 256) for w, st in ((4, 3), (4, 4), (2, 3))]


def sweep_block_m(m: int) -> tuple[int, ...]:
    return (16,) if m <= 64 else (16, 32) if m <= 256 else (32, 64) if m <= 1024 else (64, 128)


@contextlib.contextmanager
def grouped_experts():
    """The MoE blocks take torch's grouped GEMM at every size; the other fused ops (norms, RoPE, GEMV) stay on."""
    ops = triton_ops
    saved = ops.MOE_FUSED_MAX_TOKENS
    ops.MOE_FUSED_MAX_TOKENS = 0
    try:
        yield
    finally:
        ops.MOE_FUSED_MAX_TOKENS = saved


@contextlib.contextmanager
def aligned_only():
    """Every batch takes route + align + the two grouped passes (no few-token path)."""
    saved = triton_moe.SMALL_MAX_TOKENS
    triton_moe.SMALL_MAX_TOKENS = 0
    try:
        yield
    finally:
        triton_moe.SMALL_MAX_TOKENS = saved


def fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    codes, scale = quantize_rows(w)  # as --quantization fp8 loads an expert
    return codes, scale[..., 0]


def time_size(m: int, blocks: list[MoE], q: list | None, g: torch.Generator, sweep: set[str]) -> dict:
    """One row of the layer table: M tokens through every block, fused / fused FP8 / grouped."""
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=g)
    chosen = len(set(blocks[0].gate(x).topk(TOP_K, dim=-1).indices.flatten().tolist()))

    def fused(b, qb=None, w8a8=None):
        w, ids = triton_moe.route(b.gate(x), TOP_K, True)
        e = b.experts
        if qb is None:
            return triton_moe.fused_experts(x, e.gate_up_proj, e.down_proj, w, ids)
        return triton_moe.fused_experts(x, qb[0][0], qb[1][0], w, ids, qb[0][1], qb[1][1],
                                        tiles=triton_moe.pick_tiles(m, True, w8a8))

    def one_slot(b, qb=None, pdl=True):  # the few-token path, summed
        e = b.experts
        w = (e.gate_up_proj, e.down_proj, None, None) if qb is None else (qb[0][0], qb[1][0], qb[0][1], qb[1][1])
        return triton_moe.one_slot_experts(x, b.gate(x), w[0], w[1], TOP_K, True, w[2], w[3], pdl=pdl)

    us = {"fused": _graph_us([lambda b=b: fused(b) for b in blocks])}  # the block's own choice may be grouped
    us["aligned_pdl"] = _graph_us([lambda b=b: triton_moe.fused_experts(
        x, b.experts.gate_up_proj, b.experts.down_proj, *triton_moe.route(b.gate(x), TOP_K, True, True), pdl=True)
        for b in blocks])
    if m <= 8:  # the few-token path (one-slot blocks routed by gate/up), whatever SMALL_MAX_TOKENS says
        us["one_slot"] = _graph_us([lambda b=b: one_slot(b) for b in blocks])
        if m == 1:  # one token on the MMA tiles, against the GEMV form the table picks
            us["one_slot_mma"] = _graph_us([lambda b=b: triton_moe.one_slot_experts(
                x, b.gate(x), b.experts.gate_up_proj, b.experts.down_proj, TOP_K, True, pdl=True,
                tiles=triton_moe.MMA_16BIT_FEW) for b in blocks])
        if q is not None:
            us["one_slot_fp8_pdl"] = _graph_us([lambda b=b, qb=qb: one_slot(b, qb) for b, qb in zip(blocks, q)])
            us["one_slot_fp8"] = _graph_us([lambda b=b, qb=qb: one_slot(b, qb, pdl=False) for b, qb in zip(blocks, q)])
            us["aligned_fp8_pdl"] = _graph_us([lambda b=b, qb=qb: triton_moe.fused_experts(
                x, qb[0][0], qb[1][0], *triton_moe.route(b.gate(x), TOP_K, True, True), qb[0][1], qb[1][1], pdl=True)
                for b, qb in zip(blocks, q)])
        # the block's launches one at a time (4 layers each): where its time goes
        parts = []
        for b in blocks:
            sl = triton_moe.Slots(None, torch.empty(m * TOP_K, dtype=torch.int32, device="cuda"), None,
                                  torch.empty(m * TOP_K, device="cuda"), TOP_K)
            h = torch.empty(m * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)
            o = torch.empty(m * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
            parts.append((b, sl, h, o, triton_moe.Route(b.gate(x), True)))
        t1 = triton_moe.pick_tiles(m)
        us["one_slot_gate_up"] = _graph_us([lambda p=p: triton_moe.expert_gemm(
            x, p[0].experts.gate_up_proj, None, p[2], p[1], t1.gate_up, True, pdl=True, route=p[4]) for p in parts])
        us["one_slot_down"] = _graph_us([lambda p=p: triton_moe.expert_gemm(
            p[2], p[0].experts.down_proj, None, p[3], p[1], t1.down, False, pdl=True) for p in parts])
        us["sum_k"] = _graph_us([lambda p=p: p[3].view(m, TOP_K, HIDDEN).sum(dim=1) for p in parts])
        gate = [b.gate for b in blocks]
        us["router_only"] = _graph_us([lambda g_=g_: g_(x) for g_ in gate])
        us["router_route"] = _graph_us([lambda g_=g_: triton_moe.route(g_(x), TOP_K, True, True) for g_ in gate])
    block_m = triton_moe.pick_tiles(m).gate_up.block_m  # the gate, the routing and the alignment alone:
    us["route_align"] = _graph_us([lambda b=b: triton_moe.align(triton_moe.route(b.gate(x), TOP_K, True)[1], EXPERTS,
                                                                block_m) for b in blocks])
    if q is not None:  # FP8: the table's pick, then each arithmetic on its own tiles
        for key, w8a8 in (("fused_fp8", None), ("fp8_w8a16", False), ("fp8_w8a8", True)):
            us[key] = _graph_us([lambda b=b, qb=qb, w8a8=w8a8: fused(b, qb, w8a8) for b, qb in zip(blocks, q)])
    with grouped_experts():
        us["grouped"] = _graph_us([lambda b=b: b(x) for b in blocks])
    e = blocks[0].experts  # the same routes through the grouped GEMM (bf16 logits can tie: the routes may differ)
    w, ids = triton_moe.route(blocks[0].gate(x), TOP_K, True)
    ref = moe.fused_experts(x, e.gate_up_proj, e.down_proj, w, ids, Kernels(), grouped=True).float()
    def rel_err(y: torch.Tensor) -> str:
        return f"{((y.float() - ref).norm() / ref.norm()).item():.1e}"

    errs = {"rel_err_vs_grouped": rel_err(triton_moe.fused_experts(x, e.gate_up_proj, e.down_proj, w, ids))}
    if m <= 8:
        errs["rel_err_one_slot"] = rel_err(triton_moe.one_slot_experts(x, blocks[0].gate(x), e.gate_up_proj,
                                                                       e.down_proj, TOP_K, True))
    if q is not None:  # FP8 against the bf16 weights they were quantized from
        (gu, gs), (dn, ds) = q[0]
        for name, w8a8 in (("w8a16", False), ("w8a8", True)):
            errs[f"rel_err_fp8_{name}"] = rel_err(triton_moe.fused_experts(
                x, gu, dn, w, ids, gs, ds, tiles=triton_moe.pick_tiles(m, True, w8a8)))
    best = sweep_tiles(m, x, blocks, q, sweep) if sweep else None
    expert_bytes = 3 * HIDDEN * INTER * 2  # one expert's bf16 gate, up, down (FP8: half, the scales aside)
    r = dict(M=m, experts_chosen=chosen, **{f"{k}_us": round(v, 1) for k, v in us.items()},
             fused_tbs=round(chosen * expert_bytes / us["fused"] / 1e6, 2), **errs,
             picked=str(triton_moe.pick_tiles(m)))
    if q is not None:
        r.update({f"{k}_tbs": round(chosen * expert_bytes / 2 / us[k] / 1e6, 2)
                  for k in ("fused_fp8", "fp8_w8a16", "fp8_w8a8")}, picked_fp8=str(triton_moe.pick_tiles(m, True)))
    if best is not None:
        r.update(best)
    return r


def sweep_tiles(m: int, x: torch.Tensor, blocks: list[MoE], q: list | None, dtypes: set[str]) -> dict:
    """For each expert arithmetic of `dtypes` (bf16; FP8 weights: fp8 = w8a16, w8a8), the fastest tiles of each GEMM
    at M tokens: every SWEEP_NK candidate for gate/up and for down at each BLOCK_M of `sweep_block_m` (the slots
    aligned once per BLOCK_M), the block's best total."""
    routes = [triton_moe.route(b.gate(x), TOP_K, True) for b in blocks]
    weights = {"bf16": [(b.experts.gate_up_proj, None, b.experts.down_proj, None) for b in blocks]}
    weights["one_slot"] = weights["bf16"]
    if q is not None:
        weights["fp8"] = weights["w8a8"] = weights["one_slot_fp8"] = [(gu[0], gu[1], dn[0], dn[1]) for gu, dn in q]
    found = {}
    for dtype, experts in weights.items():
        if dtype not in dtypes:
            continue
        w8a8 = dtype == "w8a8"  # the GEMMs' inputs as the kernels get them: e4m3 codes and row scales
        a = triton_ops.quant_rows(x, pdl=False) if w8a8 else (x, None)
        best = None
        one_slot = dtype.startswith("one_slot")  # a slot a block, gate/up routing them (the few-token path)
        for bm in ((1,) if m == 1 else (16,)) if one_slot else sweep_block_m(m):
            layers = []
            for (w, ids), e, b in zip(routes, experts, blocks):
                h = torch.randn(m * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)
                slots = (triton_moe.Slots(None, ids.view(-1).clone(), None, w.view(-1).clone(), TOP_K) if one_slot
                         else triton_moe.Slots(*triton_moe.align(ids, EXPERTS, bm), w.view(-1), TOP_K))
                layers.append((slots, *e, h, torch.empty(m * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16),
                               triton_ops.quant_rows(h, pdl=False) if w8a8 else (h, None),
                               triton_moe.Route(b.gate(x), True) if one_slot else None))
            picks = [min(_sweep_gemm(a, layers, bm, gated), key=lambda t: t[0]) for gated in (True, False)]
            print(f"  M={m} {dtype} BLOCK_M={bm}: gate/up {picks[0]}, down {picks[1]}", flush=True)
            if best is None or picks[0][0] + picks[1][0] < best[0][0] + best[1][0]:
                best = picks
        assert best is not None
        (gu_us, gu_cfg), (dn_us, dn_cfg) = best
        found[f"best_{dtype}"] = dict(gate_up=list(vars(gu_cfg).values()), gate_up_us=round(gu_us, 1),
                                      down=list(vars(dn_cfg).values()), down_us=round(dn_us, 1))
    return found


def _sweep_gemm(a: tuple, layers: list[tuple], bm: int, gated: bool) -> list[tuple[float, triton_moe.MoeConfig]]:
    """(µs a layer, tile) of one GEMM over `layers` (slots, gate/up codes and scale, down codes and scale, h, out,
    down's input and its row scales) for every SWEEP_NK candidate at BLOCK_M bm; `a`: gate/up's input, row scales."""
    def call(layer: tuple, cfg: triton_moe.MoeConfig) -> None:
        slots, gu, gs, dn, ds, h, out, ha, route = layer
        if gated:
            triton_moe.expert_gemm(a[0], gu, gs, h, slots, cfg, gated=True, a_scale=a[1], route=route)
        else:
            triton_moe.expert_gemm(ha[0], dn, ds, out, slots, cfg, gated=False, a_scale=ha[1])

    times = []
    for n, k, w, st in triton_moe.GEMV_SWEEP if bm == 1 else SWEEP_NK:
        cfg = triton_moe.MoeConfig(bm, n, k, w, st)
        try:
            times.append((_graph_us([lambda layer=layer, cfg=cfg: call(layer, cfg) for layer in layers]), cfg))
        except Exception as exc:  # a tile past the SM's shared memory: not a candidate
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
    return times


def bench_layer(sizes: list[int], fp8: bool, sweep: set[str], rows: list[dict]) -> None:
    kernels = Kernels()
    g = torch.Generator("cuda").manual_seed(0)
    blocks = []
    for _ in range(LAYERS):
        b = MoE(EXPERTS, TOP_K, HIDDEN, INTER, True, TPInfo(), kernels).to("cuda", torch.bfloat16)
        for p in b.parameters():
            p.data.normal_(0, p.shape[-1] ** -0.5, generator=g)
        blocks.append(b)
    q = [(fp8_rows(b.experts.gate_up_proj), fp8_rows(b.experts.down_proj)) for b in blocks] if fp8 else None
    for m in sizes:
        rows.append(time_size(m, blocks, q, g, sweep))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    del blocks, q
    gc.collect()
    torch.cuda.empty_cache()


def bench_decode(quantization: str, rows: list[dict], profile: bool = False) -> None:
    t0 = time.perf_counter()
    e = Engine(EngineConfig(model="qwen3-30b-a3b", load_format="dummy", max_running_requests=4, cuda_graph_max_bs=4,
                            max_total_tokens=16_384, quantization=quantization))
    up = time.perf_counter() - t0
    print(f"[qwen3-30b-a3b {quantization}] engine up in {up:.1f}s (graphs: {e.graphs is not None})", flush=True)
    g = random.Random(1)
    prompt = [[g.randint(0, 10000) for _ in range(128)]]
    # as shipped (the start's graphs); without the few-token path; as shipped again (recaptured, as "aligned" is)
    for experts in ("fused", "aligned", "fused-recaptured"):
        ctx = aligned_only() if experts == "aligned" else None
        with ctx or contextlib.nullcontext():
            if experts != "fused":
                e.capture_graphs()
            run_requests(e, prompt, [16], overlap=True)  # warm-up: every kernel of the path compiled
            st = run_requests(e, prompt, [256], overlap=True)
            if profile and experts == "fused":  # where a step's GPU time goes, kernel by kernel
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    run_requests(e, prompt, [9], overlap=True)
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=24), flush=True)
        tps = (st.tokens - 1) / (st.last_tok - st.first_tok)
        r = dict(model="Qwen3-30B-A3B", workload="batch-1 decode", weights=quantization, experts=experts,
                 tok_s=round(tps, 1), step_ms=round(1e3 / tps, 3), engine_up_s=round(up, 1))
        rows.append(r)
        print("RESULT " + json.dumps(r), flush=True)
    drop_engine(e)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="1,8,64,256", help="token counts of the layer table")
    ap.add_argument("--fp8", action="store_true", help="also the fused kernels over e4m3 expert weights")
    ap.add_argument("--sweep", action="store_true", help="also time a few tiles per M (for the TILES tables)")
    ap.add_argument("--sweep-dtypes", default="bf16,fp8,w8a8",
                    help="--sweep: which arithmetics (fp8: w8a16); the few-token path's tiles: one_slot, "
                         "one_slot_fp8 (w8a16)")
    ap.add_argument("--no-engine", action="store_true", help="the layer table only")
    ap.add_argument("--profile", action="store_true", help="the batch-1 step's kernels as shipped (torch profiler)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    rows: list[dict] = []
    sections = [("layer", lambda: bench_layer([int(m) for m in args.sizes.split(",")], args.fp8,
                                                     set(args.sweep_dtypes.split(",")) if args.sweep else set(), rows))]
    if not args.no_engine:
        sections.append(("decode", lambda: bench_decode("none", rows, args.profile)))
        if args.fp8:
            sections.append(("decode-fp8", lambda: bench_decode("fp8", rows, args.profile)))
    for name, fn in sections:
        try:
            fn()
        except Exception as exc:  # one broken section must not cost the other's numbers
            import traceback

            traceback.print_exc()
            rows.append(dict(section=name, error=f"{type(exc).__name__}: {exc}"))
    with open(os.path.join(args.out, "moe_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n==== MoE layer, Qwen3-30B-A3B shapes, {LAYERS} layers in a graph ({torch.cuda.get_device_name()}) ====")
    print(f"{'M':>6} {'experts':>8} {'fused us':>9} {'grouped us':>11} {'speedup':>8} {'fused fp8 us':>13} "
          f"{'route+align us':>15} {'fused TB/s':>11} {'rel err':>8}  picked")
    for r in rows:
        if "M" in r:
            print(f"{r['M']:>6} {r['experts_chosen']:>8} {r['fused_us']:>9} {r['grouped_us']:>11} "
                  f"{r['grouped_us'] / r['fused_us']:>7.2f}x {r.get('fused_fp8_us', '-'):>13} "
                  f"{r['route_align_us']:>15} {r['fused_tbs']:>11} "
                  f"{r['rel_err_vs_grouped']:>8}  {r['picked']}")
            if "one_slot_us" in r:
                print(f"{'':>6} few-token (one-slot) {r['one_slot_us']} us (fp8 {r.get('one_slot_fp8_us', '-')}), "
                      f"aligned with PDL "
                      f"{r['aligned_pdl_us']} us; gate {r['router_only_us']}, + route {r['router_route_us']};"
                      f" one-slot gate/up {r['one_slot_gate_up_us']}, down {r['one_slot_down_us']},"
                      f" sum {r['sum_k_us']}")
            if "one_slot_fp8_pdl_us" in r:
                print(f"{'':>6} fp8 PDL on / off: one-slot {r['one_slot_fp8_pdl_us']} / {r['one_slot_fp8_us']} us, "
                      f"aligned {r['aligned_fp8_pdl_us']} / {r['fused_fp8_us']} us")
            if "fp8_w8a8_us" in r:
                print(f"{'':>6} fp8: table {r['fused_fp8_us']} us {r['fused_fp8_tbs']} TB/s ({r['picked_fp8']}); "
                      f"w8a16 {r['fp8_w8a16_us']} us {r['fp8_w8a16_tbs']} TB/s err {r['rel_err_fp8_w8a16']}; "
                      f"w8a8 {r['fp8_w8a8_us']} us {r['fp8_w8a8_tbs']} TB/s err {r['rel_err_fp8_w8a8']}")
            for key in ("best_bf16", "best_fp8", "best_w8a8"):
                if key in r:
                    print(f"{'':>6} {key}: {r[key]}")
        elif "tok_s" in r:
            print(f"{r['model']} {r['workload']} ({r['weights']} weights, {r['experts']} experts): "
                  f"{r['tok_s']:,.1f} tok/s ({r['step_ms']} ms/step)")
        else:
            print(r)
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
