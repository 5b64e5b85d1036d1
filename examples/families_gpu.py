"""Issues 48 / 49 on one GPU: each new family's batch-1 decode and nano-vllm preset (dummy weights), a batch-1 step's
bytes against the card's copy bandwidth, and a 32k-context decode with a model's windows on and off.

    PYTHONPATH=. python examples/families_gpu.py [--models deepseek-v2-lite,qwen3.5-9b,...] [--long gemma-3-12b]
        [--quantization none]

Each model runs in a child process of its own (an engine's memory is all given back between models, and one that
fails costs only its own rows); the rows are examples/gpu_bench.py's (greedy, CUDA graphs and overlap on), plus:
  * floor_ms: the bytes one batch-1 step must read -- every weight but the unused experts (an MoE layer reads
    top_k of its E experts; an untied embedding table one row), the context's KV (or latent) rows, a hybrid's
    recurrent state read and written -- over the bandwidth of a device-to-device copy measured in the same child;
    of_floor = floor_ms / step_ms (1.0: the step reads at the copy's speed).
  * --long: one request of a 32k-token prompt decoding 256 tokens, once as the model is and once with every layer
    made full attention (the window off), each with the KV bytes its request holds from the engine's own pool.
  * --quantization: every engine's (default auto: gpt-oss's MXFP4 experts packed, the w4a16 path; none: them
    dequantized to bf16); each row names the weights it ran.
  * --also-temperature T: a sampled row (temperature T, the seeded device sampler) beside each greedy one: what a
    chat client that samples gets.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time

DEFAULT = "deepseek-v2-lite,deepseek-v3-5layer,qwen3.5-9b,qwen3.5-35b-a3b,gpt-oss-20b,gemma-3-12b"


def copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy of 2 GiB (read + write)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 10
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * src.element_size() * n / (time.perf_counter() - t0)


def step_bytes(engine, context: int) -> int:
    """What one batch-1 decode step reads at `context` tokens (see the module docstring)."""
    mc = engine.model_cfg
    seen, total = set(), 0
    params = dict(engine.model.named_parameters())
    head = params.get("lm_head.weight")
    for name, p in params.items():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        n = p.numel() * p.element_size()
        if "embed_tokens" in name and head is not None and head.data_ptr() != p.data_ptr():
            n = p.shape[-1] * p.element_size()  # an untied table: one row a token
        elif mc.num_experts and p.dim() >= 3 and p.shape[0] == mc.num_experts:
            n = n * mc.num_experts_per_tok // mc.num_experts
        total += n
    for name, b in engine.model.named_buffers():  # FP8 weights' scales and the like
        if b.data_ptr() not in seen and "cos_sin" not in name and "rope" not in name:
            total += b.numel() * b.element_size()
    total += context * engine.pool.shape.bytes_per_token()
    if engine.state is not None:  # a hybrid's recurrent state: read and written
        total += 2 * engine.state.shape.bytes_per_slot()
    return total


def one(name: str, long: bool, profile: bool = False, quantization: str = "auto",
        temperature: float | None = None) -> None:
    import gpu_bench as gb  # beside this script; imported, its SAMPLED is empty (greedy rows only) unless asked
    import torch

    gb.DTYPES["quantization"] = quantization
    if temperature is not None:
        gb.SAMPLED.append(dict(temperature=temperature))
    if long:
        return one_long(name)
    bw = copy_bandwidth()  # the floor's bandwidth, in this child
    print(f"[{name}] device copy {bw / 1e12:.2f} TB/s", flush=True)
    e = gb.make_engine(name)  # 300k tokens of KV: the preset's ~290k held at once, the rest for activations
    start = len(gb.ROWS)
    gb.bench_engine(name, e, True, [(True, True)], [(True, True)], profile)
    nbytes = step_bytes(e, 128 + 256)  # at the 512-token decode's middle context
    floor = nbytes / bw * 1e3
    for r in gb.ROWS[start:]:
        r["kernels"] = f"{e.attn.name} attention, {e.quantization} weights"
        if r["workload"] == "batch-1 decode":
            r.update(floor_ms=round(floor, 3), of_floor=round(floor / r["step_ms"], 3),
                     gbytes_step=round(nbytes / 1e9, 3))
        print("ROW " + json.dumps(r), flush=True)
    torch.cuda.synchronize()


def one_long(name: str) -> None:
    """A 32k-token prompt, 256 new tokens, with the windows as configured and with every layer full."""
    import gpu_bench as gb
    import torch

    from minisgl_cli.loader import configs

    full = configs.builtin_config(name)
    full["layer_types"] = ["full_attention"] * full["num_hidden_layers"]
    full.pop("sliding_window_pattern", None)
    configs.BUILTIN_CONFIGS[f"{name}-nowindow"] = full
    g = random.Random(3)
    prompt = [g.randint(0, 10000) for _ in range(32_768)]
    for variant in (name, f"{name}-nowindow"):
        e = gb.make_engine(variant, max_total_tokens=40_000, max_running_requests=4, cuda_graph_max_bs=4)
        gb.run_requests(e, [prompt[:2048]], [8], overlap=True)  # warm-up
        st = gb.run_requests(e, [prompt], [256], overlap=True, prefill_tokens=8192)
        tps = (st.tokens - 1) / (st.last_tok - st.first_tok)
        r = dict(model=variant, workload="32k-context decode", tok_s=round(tps, 1), step_ms=round(1e3 / tps, 3),
                 kv_bytes_per_token=e.pool.shape.bytes_per_token(), kernels=f"{e.attn.name} attention",
                 pool_tokens=gb.kv_tokens(e))
        print("ROW " + json.dumps(r), flush=True)
        gb.drop_engine(e)
        del e
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=DEFAULT)
    ap.add_argument("--long", default="gemma-3-12b", help="models for the 32k-context window on / off rows ('' none)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--timeout", type=int, default=240, help="seconds a model's child may take")
    ap.add_argument("--profile", default="", help="models whose batch-1 step gets a kernel table (torch.profiler)")
    ap.add_argument("--quantization", default="auto", help="every engine's --quantization (auto, none, fp8)")
    ap.add_argument("--also-temperature", type=float, default=None, help="a sampled row beside each greedy one")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--one-long", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one or args.one_long:
        return one(args.one or args.one_long, bool(args.one_long), args.profile == "yes", args.quantization,
                   args.also_temperature)
    rows: list[dict] = []
    jobs = [("--one", m) for m in args.models.split(",") if m] + [("--one-long", m) for m in args.long.split(",") if m]
    for flag, m in jobs:
        t0 = time.perf_counter()
        try:
            prof = ["--profile", "yes"] if m in args.profile.split(",") else []
            cmd = [sys.executable, __file__, flag, m, "--out", args.out, "--quantization", args.quantization, *prof]
            if args.also_temperature is not None:
                cmd += ["--also-temperature", str(args.also_temperature)]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            text, rc = p.stdout + p.stderr, p.returncode
        except subprocess.TimeoutExpired as exc:
            text, rc = (exc.stdout or b"").decode() + (exc.stderr or b"").decode(), "timeout"
        if rc or prof:  # the failure, or the profile's kernel tables
            print(text[-4000:] if rc else text[:12000], flush=True)
        else:
            print("\n".join(ln for ln in text.splitlines() if "engine up" in ln), flush=True)
        got = [json.loads(ln[4:]) for ln in text.splitlines() if ln.startswith("ROW ")]
        got = got or [dict(model=m, workload=flag, error=f"exit {rc}")]
        rows += got
        print(f"-- {m} {flag}: exit {rc} in {time.perf_counter() - t0:.0f}s", flush=True)
        for r in got:
            show(r)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "families.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n==== families (one GPU, dummy weights, graphs + overlap) ====")
    for r in rows:
        show(r)


def show(r: dict) -> None:
    """One row of the table (printed as each child ends, and again at the end)."""
    if "error" in r:
        print(f"{r['model']:<24} {r['workload']:<20} ERROR {r['error']}")
    elif r["workload"] == "batch-1 decode":
        print(f"{r['model']:<24} batch-1 {r.get('sampling', 'greedy'):<14} {r['tok_s']:>8.1f} tok/s  step "
              f"{r['step_ms']:.3f} ms  floor {r['floor_ms']:.3f} ms ({r['gbytes_step']} GB)  of floor "
              f"{r['of_floor']:.2f}  cpu/step {r['cpu_ms_per_step']} ms  {r['kernels']}")
    elif r["workload"] == "nano-vllm preset":
        print(f"{r['model']:<24} preset  {r.get('sampling', 'greedy'):<14} {r['tok_s']:>8.1f} tok/s  wall "
              f"{r['wall_s']} s  {r['kernels']}")
    else:
        print(f"{r['model']:<24} 32k     {r['tok_s']:>8.1f} tok/s  step {r['step_ms']:.3f} ms  "
              f"KV {r['kv_bytes_per_token']} B/token  {r['kernels']}")


if __name__ == "__main__":
    main()
