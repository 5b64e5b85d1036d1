"""The scheduler process's own host work per step, on the CPU, old tree against new in one run.

A tiny random Llama (1 layer, 32 wide, a 1,024-word vocab with its own word-level tokenizer, built under --out) makes
the forward pass cheap, so with 256 streams in flight each step's Python (scheduling, the step's uploads, building and
sending its outputs) is most of what the scheduler does, as on the GPU. Each tree serves the same workload twice:

- offline: `LLM.generate` in one process (the scheduler thread and the consumer under one GIL);
- http: `minisgl serve` + `minisgl bench --url` (streaming), the scheduler in its own process.

and the table gives output tok/s and the scheduler's CPU microseconds per step (offline: the whole process's CPU over
its steps; http: scheduler rank 0's, from /metrics). The forward is the same work in both trees, so the difference of
two µs/step figures is host work saved. Sides alternate for --rounds rounds; the best of each is shown.

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    PYTHONPATH=. python examples/host_bound_cpu.py --old /tmp/base [--rounds 2] [--streams 256]
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


def run_offline(tree: Path, model: Path, streams: int, log: Path) -> dict:
    env = tree_env(tree)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child-offline", str(model), "--streams", str(streams)]
    with log.open("w") as f:
        p = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"offline run failed in {tree}; see {log}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_http(tree: Path, model: Path, streams: int, out: Path, tag: str) -> dict:
    import httpx

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fronts_cpu import wait_healthy  # this tree's helper: the same for both sides

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
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
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
    ap.add_argument("--paths", default="offline,http", help="which of offline,http")
    ap.add_argument("--out", default="/tmp/host_bound_cpu")
    ap.add_argument("--child-offline", metavar="MODEL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_offline:
        offline_child(args.child_offline, args.streams)
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
                res = (run_offline(tree, model, args.streams, out / f"offline-{tag}.log") if path == "offline"
                       else run_http(tree, model, args.streams, out, tag))
                print(f"{tag}: {res['tok_s']:.0f} tok/s, {res['us_per_step']:.0f} us/step ({res['steps']} steps)"
                      + (f", cpu s {json.dumps({k: round(v, 1) for k, v in res['cpu'].items()})}"
                         if "cpu" in res else ""), flush=True)
                key = (side, path)
                if key not in best or res["tok_s"] > best[key]["tok_s"]:
                    best[key] = res
    print(f"\n{'path':<9}" + "".join(f"{s + ' tok/s':>14}{s + ' us/step':>14}" for s, _ in sides))
    for path in paths:
        print(f"{path:<9}" + "".join(f"{best[(s, path)]['tok_s']:>14.0f}{best[(s, path)]['us_per_step']:>14.0f}"
                                     for s, _ in sides))
    print(f"\n{args.streams} streams, best of {args.rounds} round(s); us/step: scheduler CPU microseconds per step "
          f"(offline: the whole process). Logs in {out}. Command: {shlex.join(sys.argv)}")


if __name__ == "__main__":
    main()
