"""gpt-oss-20b's MoE experts on one GPU: MXFP4 kept packed (w4a16) against the same experts dequantized to bf16, both in
the fused Triton kernels; with --sweep, the packed path's tiles (for kernels/triton/moe_tiles.py's TILES_MXFP4).

    PYTHONPATH=. python examples/mxfp4_bench.py [--out DIR] [--sizes 1,4,16,64] [--sweep]

`LAYERS` layers of gpt-oss-20b's experts (32 of H 2880 and I 2880, top 4, biases, the clamped SwiGLU), random bytes
and exponents, run back to back in one CUDA graph (the weights come from DRAM, as in a decode step). Per M tokens:
µs a layer of the experts as the engine runs them (`routed_experts`: the few-token path up to SMALL_MAX_TOKENS, else
route + align; the gate's logits given), packed and dequantized (one token: also packed without PDL, and packed on
the MMA tiles); the bytes of the experts chosen over that time (TB/s:
the packed path reads 17/64 of bf16's bytes); the packed output's largest difference from the bf16 one, in units of
its largest value (bf16 rounding: ~1e-2 at most). --sweep: each GEMM of the packed path at every candidate tile
(few-token slots up to SMALL_MAX_TOKENS, aligned blocks above), the fastest printed. Prints RESULT lines and writes
mxfp4_bench.json under --out ($OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import graph_us  # noqa: E402

from minisgl_cli.kernels.triton import moe as triton_moe  # noqa: E402
from minisgl_cli.loader.mxfp4 import dequantize  # noqa: E402

HIDDEN, INTER, EXPERTS, TOP_K = 2880, 2880, 32, 4  # gpt-oss-20b
LAYERS = 4  # 4 x 1.6 GB of bf16 experts (0.4 GB packed): none stays in the 50 MB L2 between its calls
SWEEP = [(n, k, w, st) for n in (16, 32, 64, 128) for k in (64, 128, 256) for w, st in ((4, 3), (4, 4), (2, 3), (8, 3))]


def make_layers(g: torch.Generator) -> list[dict]:
    layers = []
    for _ in range(LAYERS):
        packed = []
        for rows, cols in ((2 * INTER, HIDDEN), (HIDDEN, INTER)):
            b = torch.randint(0, 256, (EXPERTS, rows, cols // 2), device="cuda", dtype=torch.uint8, generator=g)
            s = torch.randint(119, 122, (EXPERTS, rows, cols // 32), device="cuda", dtype=torch.uint8, generator=g)
            packed.append((b, s))
        (gu, gs), (dn, ds) = packed
        dense = [dequantize(w.unflatten(-1, (-1, 16)), s, torch.bfloat16) for w, s in packed]
        swiglu = triton_moe.SwiGLUExperts(
            torch.randn(EXPERTS, 2 * INTER, device="cuda", generator=g).bfloat16() * 0.1,
            torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g).bfloat16() * 0.1, 7.0, 1.702)
        gate = torch.randn(EXPERTS, HIDDEN, device="cuda", generator=g).bfloat16() * HIDDEN**-0.5
        layers.append(dict(packed=(gu, dn, gs, ds), bf16=(dense[0], dense[1], None, None), swiglu=swiglu, gate=gate))
    return layers


def time_size(m: int, layers: list[dict], g: torch.Generator, sweep: bool) -> dict:
    x = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = [x @ layer["gate"].t() for layer in layers]
    chosen = len(set(logits[0].topk(TOP_K, dim=-1).indices.flatten().tolist()))

    def run(i: int, kind: str, pdl: bool = True) -> torch.Tensor:
        w = layers[i][kind]
        return triton_moe.routed_experts(x, logits[i], w[0], w[1], TOP_K, True, w[2], w[3], pdl=pdl, terms=True,
                                         swiglu=layers[i]["swiglu"])

    us = {kind: graph_us([lambda i=i, kind=kind: run(i, kind) for i in range(LAYERS)]) for kind in ("packed", "bf16")}
    if m == 1:  # the GEMV form launched without PDL (as before it took it), then one token on the MMA tiles
        us["packed_no_pdl"] = graph_us([lambda i=i: run(i, "packed", pdl=False) for i in range(LAYERS)])
        us["packed_mma"] = graph_us([lambda i=i: triton_moe.one_slot_experts(
            x, logits[i], *layers[i]["packed"][:2], TOP_K, True, *layers[i]["packed"][2:], pdl=True, terms=True,
            swiglu=layers[i]["swiglu"], tiles=triton_moe.MMA_MXFP4_ONE) for i in range(LAYERS)])
    got, want = run(0, "packed").float(), run(0, "bf16").float()
    bf16_bytes = chosen * 3 * HIDDEN * INTER * 2
    r = dict(M=m, experts_chosen=chosen, **{f"{k}_us": round(v, 1) for k, v in us.items()},
             packed_tbs=round(bf16_bytes * 17 / 64 / us["packed"] / 1e6, 2),
             bf16_tbs=round(bf16_bytes / us["bf16"] / 1e6, 2),
             max_diff=f"{((got - want).abs().max() / want.abs().max()).item():.1e}",
             picked=str(triton_moe.pick_tiles(m, mxfp4=True)))
    if sweep:
        r.update(sweep_tiles(m, x, logits, layers))
    return r


def sweep_tiles(m: int, x: torch.Tensor, logits: list[torch.Tensor], layers: list[dict]) -> dict:
    """The fastest tile of each packed GEMM at M tokens (a layer's µs, `LAYERS` layers in a graph)."""
    one_slot = m <= triton_moe.SMALL_MAX_TOKENS
    found = {}
    for bm in ((1,) if m == 1 else (16,)) if one_slot else (16, 32) if m <= 256 else (32, 64):
        state = []
        for lg, layer in zip(logits, layers):
            h = torch.empty(m * TOP_K, INTER, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(m * TOP_K, HIDDEN, device="cuda", dtype=torch.bfloat16)
            if one_slot:
                slots = triton_moe.Slots(None, torch.empty(m * TOP_K, dtype=torch.int32, device="cuda"), None,
                                         torch.empty(m * TOP_K, device="cuda"), TOP_K)
                route = triton_moe.Route(lg, True)
            else:
                w, ids = triton_moe.route(lg, TOP_K, True)
                slots, route = triton_moe.Slots(*triton_moe.align(ids, EXPERTS, bm), w.view(-1), TOP_K), None
            state.append((layer, slots, route, h, out))

        def gemm(s: tuple, cfg: triton_moe.MoeConfig, gated: bool) -> None:
            layer, slots, route, h, out = s
            gu, dn, gs, ds = layer["packed"]
            if gated:
                triton_moe.expert_gemm(x, gu, gs, h, slots, cfg, gated=True, route=route, swiglu=layer["swiglu"])
            else:
                triton_moe.expert_gemm(h, dn, ds, out, slots, cfg, gated=False, swiglu=layer["swiglu"])

        for gated in (True, False):  # gate/up first: it writes the one-slot blocks' experts and weights for down
            times = []
            for n, k, warps, stages in triton_moe.GEMV_SWEEP if bm == 1 else SWEEP:
                cfg = triton_moe.MoeConfig(bm, n, k, warps, stages)
                try:
                    calls = [lambda s=s, cfg=cfg, gated=gated: gemm(s, cfg, gated) for s in state]
                    times.append((graph_us(calls), cfg))
                except Exception as exc:  # a tile past the SM's shared memory: not a candidate
                    print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
            t, cfg = min(times, key=lambda t: t[0])
            name = f"best_{'gate_up' if gated else 'down'}_bm{bm}"
            found[name] = dict(tile=list(vars(cfg).values()), us=round(t, 1))
            print(f"  M={m} {name}: {found[name]}", flush=True)
            gemm_picked = triton_moe.pick_tiles(m, mxfp4=True)
            cfg = gemm_picked.gate_up if gated else gemm_picked.down
            if cfg.block_m == bm:
                found[f"picked_{'gate_up' if gated else 'down'}_us"] = round(
                    graph_us([lambda s=s, cfg=cfg, gated=gated: gemm(s, cfg, gated) for s in state]), 1)
    return found


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sizes", default="1,4,16,64", help="token counts")
    ap.add_argument("--sweep", action="store_true", help="also each packed GEMM at every candidate tile")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    g = torch.Generator("cuda").manual_seed(0)
    layers = make_layers(g)
    rows = []
    for m in (int(s) for s in args.sizes.split(",")):
        rows.append(time_size(m, layers, g, args.sweep))
        print("RESULT " + json.dumps(rows[-1]), flush=True)
    with open(os.path.join(args.out, "mxfp4_bench.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
