"""What an MTP draft costs beside the step it saves (`--speculative-algorithm mtp`, issue 49): one request decodes
(greedy, or sampled with --temperature) through `LLM` in this process, once plainly and once with MTP drafts: first
untimed, for its tok/s, then again with every forward of the target and of the MTP engine timed by its kind (the
device synchronized around each, which the tok/s must not pay).

Printed, per model: the target's decode step (one row), its verify step by rows (k + 1), the MTP layer's forwards
by rows (a write of a request's rows from the target's states: an extend, or decode rows where few; a chained draft's
row), tok/s both ways, and the acceptance a verify of k drafts needs to break even: with random (dummy) weights no
draft is accepted, so the speed-up real weights give is (1 + accepted) / (verify + proposal) in plain steps, from
these figures. `--profile` prints each kind's op table from its first timed call, which then stays out of the
figures (a kind called once has none).

    PYTHONPATH=. python examples/mtp_cost.py --models deepseek-v3-5layer-fp8,qwen3.5-9b      # an H200
    PYTHONPATH=. python examples/mtp_cost.py --models deepseek-tiny --device cpu --tokens 48   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.engine.engine import Engine
from minisgl_cli.models.mtp import MtpHead

_ORIGINAL = Engine.forward


def _kind(engine: Engine, batch) -> str:  # type: ignore[no-untyped-def]
    rows = batch.num_tokens
    if isinstance(engine.model, MtpHead):
        # a write of a few rows runs as decode rows, one a token (scheduler/mtp.py's DECODE_FORM_ROWS), like a chained
        # draft's row: told apart by their count only
        return "mtp extend" if not batch.is_decode else f"mtp {rows} decode row{'s' * (rows > 1)}"
    return ("target prefill" if not batch.is_decode else
            "target decode" if rows == batch.batch_size and batch.runs is None else f"target verify {rows} rows")


def _timed(times: dict[str, list[float]], sync: Callable[[], None], tables: dict[str, str] | None) -> Callable:
    """Engine.forward wrapped: each call's wall time (device synchronized before and after) under its kind; with
    `tables`, each kind's first call runs under torch's profiler instead (in the engine's thread), its op table kept
    and its time left out of the figures (the profiler's own cost would be in it)."""
    forward = Engine.forward

    def timed(self: Engine, batch):  # type: ignore[no-untyped-def]
        kind = _kind(self, batch)
        sync()
        if tables is not None and kind not in tables:
            with torch.profiler.profile(activities=_ACTIVITIES[self.device.type]) as prof:
                out = forward(self, batch)
                sync()
            by = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            tables[kind] = "\n".join(prof.key_averages().table(sort_by=k, row_limit=15, max_name_column_width=60)
                                     for k in dict.fromkeys((by, "self_cpu_time_total")))
            return out
        t0 = time.perf_counter()
        out = forward(self, batch)
        sync()
        times[kind].append((time.perf_counter() - t0) * 1e3)
        return out

    return timed


_ACTIVITIES = {"cuda": [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
               "cpu": [torch.profiler.ProfilerActivity.CPU]}


def run(model: str, device: str, tokens: int, k: int, spec: bool, temperature: float, profile: bool = False) -> dict:
    """One request of `tokens` tokens (greedy at `temperature` 0, else sampled, seeded) after a 128-token prompt,
    through `LLM` in this process once a first request (8 tokens, right after the start: its seconds reported too) has
    warmed it: its tok/s (untimed), then the forwards' ms by kind (a second run, timed; `profile`: each kind's first
    call profiled instead, its op table printed)."""
    times: dict[str, list[float]] = defaultdict(list)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    kw = dict(speculative_algorithm="mtp", num_speculative_tokens=k) if spec else {}
    prompt = [list(range(100, 228))]
    params = SamplingParams(max_new_tokens=tokens, ignore_eos=True, temperature=temperature, seed=1)
    with LLM(model, load_format="dummy", device=device, processes=False, **kw) as llm:
        t0 = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_new_tokens=8, ignore_eos=True))  # the first: kernels compile
        first_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = llm.generate([list(range(300, 428))], params)[0]
        wall = time.perf_counter() - t0
        stats = llm.client.stats()
        tables: dict[str, str] | None = {} if profile else None
        Engine.forward = _timed(times, sync, tables)  # type: ignore[method-assign]
        try:  # the same request again (its prompt now cached), each forward timed
            llm.generate([list(range(300, 428))], params)
        finally:
            Engine.forward = _ORIGINAL  # type: ignore[method-assign]
        for kind, table in (tables or {}).items():
            print(f"-- {model}{' with mtp' if spec else ''}: a {kind}'s ops (its first call in the timed run)\n{table}")
    return {"tok_s": len(out.token_ids) / wall, "first_s": first_s,
            "ms": {kind: statistics.median(v) for kind, v in times.items()},
            "calls": {kind: len(v) for kind, v in times.items()}, "drafted": stats.spec_draft_tokens,
            "accepted": stats.spec_accepted_tokens}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deepseek-v3-5layer-fp8,qwen3.5-9b")  # bf16's 5 layers + MTP: past 141 GB
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("-k", type=int, default=3, help="--num-speculative-tokens")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else sampled (seeded) requests")
    ap.add_argument("--profile", action="store_true",
                    help="print each kind's op table (torch.profiler; that call is left out of the figures)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    results = {}
    how = "greedy" if args.temperature == 0 else f"sampled at {args.temperature:g}"
    for model in args.models.split(","):
        plain, mtp = (run(model, args.device, args.tokens, args.k, spec, args.temperature, args.profile)
                       for spec in (False, True))
        results[model] = {"plain": plain, "mtp": mtp, "temperature": args.temperature}
        step = plain["ms"].get("target decode", float("nan"))
        print(f"{model} ({args.device}, {how}, through LLM): plain {plain['tok_s']:.1f} tok/s, decode step "
              f"{step:.3f} ms, first request {plain['first_s']:.1f} s; with mtp k={args.k} "
              f"{mtp['tok_s']:.1f} tok/s, first {mtp['first_s']:.1f} s ({mtp['accepted']} of {mtp['drafted']} drafts "
              "accepted: random weights)")
        for kind, ms in sorted(mtp["ms"].items()):
            print(f"  {kind:<24} {ms:8.3f} ms  x{mtp['calls'][kind]:<5} = {ms / step:5.2f} decode steps")
        verify = mtp["ms"].get(f"target verify {args.k + 1} rows")
        # After a verify that accepted none, the proposal writes 1 row (as a decode row) then chains k - 1: k one-row
        # forwards (the prompt's write, the one extend, is not a verify's)
        row = mtp["ms"].get("mtp 1 decode row")
        if verify and row:
            cost = (verify + args.k * row) / step  # a verify of k drafts and its proposal, in plain steps
            print(f"  k={args.k}: a verify and its proposal cost {cost:.2f} decode steps: MTP pays where more than "
                  f"{cost - 1:.2f} drafts a verify are accepted")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "mtp_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
