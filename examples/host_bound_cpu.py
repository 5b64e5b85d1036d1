"""The scheduler process's own host work per step, on the CPU, old tree against new in one run.

A tiny random Llama (1 layer, 32 wide, a 1,024-word vocab with its own word-level tokenizer, built under --out) makes
the forward pass cheap, so with 256 streams in flight each step's Python (scheduling, the step's uploads, building and
sending its outputs) is much of what the scheduler does, as on the GPU. Each tree runs the same workload (256
requests of 32..64 prompt ids and 128..256 output tokens, greedy, EOS ignored; one torch thread) three ways:

- steps: the scheduler stepped directly with an emit that encodes each step's outputs as rank 0 does; the thread's
  CPU microseconds per step split into the engine's step (forward and sampling) and the rest: the host work;
- offline: `LLM.generate` in one process (the scheduler thread and the consumer under one GIL): tok/s and the
  process's CPU microseconds per step;
- http: `minisgl serve` + `minisgl bench --url` (streaming): tok/s and scheduler rank 0's CPU microseconds per step
  (/metrics; arrivals spread, so its step count varies between runs).

Sides alternate for --rounds rounds; the best of each is shown. CPU time is steadier than wall time on a shared
machine; the `steps` host figure is the one to compare.

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    PYTHONPATH=. python examples/host_bound_cpu.py --old /tmp/base [--rounds 2] [--paths steps,offline,http]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

VOCAB = 1024


def build_model(out: Path) -> Path:
    """A tiny random Llama with a word-level tokenizer of VOCAB words ("w3" .. ), saved like a hub checkpoint."""
    if (out / "model.safetensors").exists():
        return out
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(out)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                   max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1,
                                   eos_token_id=2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(out, safe_serialization=True)
    return out


def workload(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt ids, output tokens): prompts of 32..64 ids, outputs of 128..256 tokens."""
    import random

    rng = random.Random(seed)
    return [([rng.randrange(3, VOCAB) for _ in range(rng.randint(32, 64))], rng.randint(128, 256)) for _ in range(n)]


def offline_child(model: str, streams: int) -> None:
    """In the tree under test (PYTHONPATH): LLM.generate twice (the first warms up); one JSON line."""
    from minisgl_cli import LLM, SamplingParams

    reqs = workload(streams)
    with LLM(model, device="cpu", max_running_requests=streams, max_total_tokens=streams * 400,
             torch_compile="off", num_threads=1) as llm:
        llm.generate([p for p, _ in reqs[:8]], SamplingParams(max_new_tokens=8, ignore_eos=True))
        steps0 = llm.client.stats().steps or 0
        w0, c0 = time.perf_counter(), time.process_time()
        out = llm.generate([p for p, _ in reqs], [SamplingParams(max_new_tokens=n, ignore_eos=True) for _, n in reqs])
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
        steps = (llm.client.stats().steps or 0) - steps0
    tokens = sum(len(o.token_ids) for o in out)
    print(json.dumps({"tok_s": tokens / wall, "us_per_step": 1e6 * cpu / steps, "steps": steps, "tokens": tokens}))


def tree_env(tree: Path) -> dict[str, str]:
    """The environment of a run of `tree`: its code first; one torch thread (a second only spins on 2 shared cores)."""
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def steps_child(model: str, streams: int) -> None:
    """In the tree under test: rank 0's loop without its process, the scheduler stepped directly over the workload with
    an emit that encodes each step's outputs as rank 0 does; the thread's CPU time per step, with the engine's step
    (the tiny forward and sampling) apart from the rest (the host work). Best of 4 runs; one JSON line."""
    import torch
    from timing import accumulate  # examples/ (this script's folder), whichever tree is under test

    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.engine.engine import Engine
    from minisgl_cli.messages import AddRequest, encode
    from minisgl_cli.scheduler.scheduler import Scheduler, SchedulerConfig
    from minisgl_cli.types import SamplingParams

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model=model, device="cpu", max_running_requests=streams,
                                 max_total_tokens=streams * 400, torch_compile="off", num_threads=1))
    spent: dict[str, float] = {}

    # Thread CPU time inside each (methods both trees have).
    accumulate(engine, "step", "engine", spent, time.thread_time)
    for owner, name in ((Scheduler, "_schedule"), (Engine, "build_batch"), (Engine, "sampling_batch"),
                        (Scheduler, "_process"), (Scheduler, "_emit_outputs")):
        accumulate(owner, name, name.strip("_"), spent, time.thread_time)
    left = [0]

    def emit(msg) -> None:
        encode(msg)
        left[0] -= sum(o.finish_reason is not None or o.error is not None for o in msg.outputs)

    best: dict[str, float] = {}
    for _ in range(4):
        sched = Scheduler(engine, SchedulerConfig(), emit)
        reqs = workload(streams)
        left[0], steps = len(reqs), 0
        spent.clear()
        for i, (p, n) in enumerate(reqs):
            sched.handle(AddRequest(f"r{i}", p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        c0 = time.thread_time()
        while left[0] > 0:
            sched.step()
            steps += 1
        cpu = time.thread_time() - c0
        sched.cache.clear()
        # _process includes the emit; the engine's step runs inside the launch (the rest of the host work).
        for k, v in (("us_per_step", cpu), ("engine_us", spent["engine"]), ("host_us", cpu - spent["engine"]),
                     *((f"{k}_us", v) for k, v in spent.items() if k != "engine")):
            best[k] = min(best.get(k, float("inf")), 1e6 * v / steps)
    print(json.dumps({**best, "steps": steps, "tok_s": 0.0}))


def run_child(kind: str, tree: Path, model: Path, streams: int, log: Path) -> dict:
    """offline_child or steps_child in `tree`."""
    env = tree_env(tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), f"--child-{kind}", str(model), "--streams", str(streams)]
    with log.open("w") as f:
        p = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"{kind} run failed in {tree}; see {log}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_http(tree: Path, model: Path, streams: int, out: Path, tag: str) -> dict:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fronts_cpu import stop, wait_healthy  # this tree's helpers: the same for both sides

    from minisgl_cli.api.http_server import free_port

    env = tree_env(tree)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    serve = [sys.executable, "-m", "minisgl_cli.app", "serve", "--model", str(model), "--device", "cpu",
             "--max-running-requests", str(streams), "--max-total-tokens", str(streams * 400),
             "--torch-compile", "off", "--port", str(port)]
    log = out / f"serve-{tag}.log"
    with log.open("w") as f:
        proc = subprocess.Popen(serve, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        metrics = lambda: httpx.get(f"{url}/metrics", timeout=30).json()  # noqa: E731
        m0 = metrics()
        report = out / f"bench-{tag}.json"
        bench = [sys.executable, "-m", "minisgl_cli.app", "bench", "--url", url, "--model", str(model),
                 "--dataset", "random", "--num-prompts", str(streams), "--input-len", "64", "--output-len", "256",
                 "--range-ratio", "0.5", "--concurrency", str(streams), "--warmup", "1", "--output-json", str(report)]
        with (out / f"bench-{tag}.txt").open("w") as f:
            rc = subprocess.run(bench, cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=900).returncode
        m1 = metrics()
    finally:
        stop(proc)
    if rc != 0:
        sys.exit(f"bench failed in {tree}; see {out / f'bench-{tag}.txt'}")
    result = json.loads(report.read_text())["results"][-1]
    cpu = {k: m1["process_cpu_seconds"][k] - m0["process_cpu_seconds"].get(k, 0.0) for k in m1["process_cpu_seconds"]}
    steps = m1["scheduler"]["steps"] - m0["scheduler"]["steps"]  # the warm-up's steps too: so is the CPU
    return {"tok_s": result["output_throughput"], "us_per_step": 1e6 * cpu["scheduler rank 0"] / steps,
            "steps": steps, "cpu": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the base tree (git archive of the old commit); without it only this tree runs")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--paths", default="steps,offline,http", help="which of steps,offline,http")
    ap.add_argument("--out", default="/tmp/host_bound_cpu")
    ap.add_argument("--child-offline", metavar="MODEL", help=argparse.SUPPRESS)
    ap.add_argument("--child-steps", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_offline:
        offline_child(args.child_offline, args.streams)
        return
    if args.child_steps:
        steps_child(args.child_steps, args.streams)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(out / "tiny-model")
    new = Path(__file__).resolve().parents[1]
    sides = ([("old", Path(args.old).resolve())] if args.old else []) + [("new", new)]
    paths = args.paths.split(",")
    best: dict[tuple[str, str], dict] = {}
    for r in range(args.rounds):
        for side, tree in sides:
            for path in paths:
                tag = f"{side}{r}-{path}"
                res = (run_http(tree, model, args.streams, out, tag) if path == "http"
                       else run_child(path, tree, model, args.streams, out / f"{path}-{tag}.log"))
                print(f"{tag}: {res['tok_s']:.0f} tok/s, {res['us_per_step']:.0f} us/step ({res['steps']} steps)"
                      + (f", host {res['host_us']:.0f} + engine {res['engine_us']:.0f} us/step; of the host: "
                         + ", ".join(f"{k[:-3]} {v:.0f}" for k, v in res.items()
                                     if k.endswith("_us") and k[:-3] not in ("host", "engine"))
                         if path == "steps" else "")
                      + (f", cpu s {json.dumps({k: round(v, 1) for k, v in res['cpu'].items()})}"
                         if "cpu" in res else ""), flush=True)
                key = (side, path)
                better = res["host_us"] < best[key]["host_us"] if path == "steps" and key in best else \
                    key not in best or res["tok_s"] > best[key]["tok_s"]
                if better:
                    best[key] = res
    print(f"\n{'path':<9}" + "".join(f"{s + ' tok/s':>14}{s + ' us/step':>14}" for s, _ in sides))
    for path in paths:
        cells = [(f"{b['tok_s']:.0f}" if path != "steps" else "-",
                  f"{b['host_us']:.0f} host" if path == "steps" else f"{b['us_per_step']:.0f}")
                 for b in (best[(s, path)] for s, _ in sides)]
        print(f"{path:<9}" + "".join(f"{t:>14}{u:>14}" for t, u in cells))
    print(f"\n{args.streams} streams, best of {args.rounds} round(s); us/step: CPU microseconds per step (steps: the "
          f"scheduler's host work alone; offline: the whole process; http: rank 0). Logs in {out}. "
          f"Command: {shlex.join(sys.argv)}")


if __name__ == "__main__":
    main()
