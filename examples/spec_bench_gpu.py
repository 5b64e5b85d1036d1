"""Speculative decoding on the GPU, one run (~50 s on an H100, model loads included): what a verify step costs against
a decode step, and an oracle run whose drafts replay the model's own greedy output (every draft accepted: the
mechanism's ceiling).

    PYTHONPATH=. python examples/spec_bench_gpu.py [--model llama-3.1-8b] [--k 4] [--out DIR]
    PYTHONPATH=. python examples/spec_bench_gpu.py --smoke   # the same code on the CPU, a small model, a few steps

1. Step cost: dummy weights (bf16), B requests with 512 tokens of context each (B = 1 and 64); a decode step (B rows)
   and a verify step (B x (k + 1) rows: the decode rows of each request's k drafts) through Engine.step -- CUDA graphs
   captured up to 64 x (k + 1) rows, greedy --, each timed from building the batch to its tokens on the host, 20 steps
   apiece, interleaved; the median. Goal: verify / decode <= 1.15 at batch 1.
2. Batch 1 through the scheduler (LLM) on the same dummy weights, in fp32 on CUDA (near ties round alike), one
   128-token prompt, 256 new tokens greedy, EOS ignored, decode tok/s (best of 2): plain; then one speculating
   engine whose proposer first replays the plain run's tokens (the oracle: k drafts a step, all accepted; goal >=
   2.5x plain), then is prompt lookup (ngram) over the same request -- with random weights the answer's own loops
   are what it finds, not a real text's repetition.
Prints a table and writes it to DIR/spec_bench.txt, every figure to DIR/spec_bench.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.scheduler import speculative
from minisgl_cli.scheduler.ngram import NgramProposer

CONTEXT = 512


def step_costs(model: str, k: int, batches: tuple[int, ...], device: str, steps: int = 20) -> list[dict]:
    most = max(batches)
    engine = Engine(EngineConfig(model=model, load_format="dummy", device=device, max_running_requests=most,
                                 max_total_tokens=most * (CONTEXT + k + 8), cuda_graph_max_bs=most * (k + 1)))
    g = torch.Generator().manual_seed(0)
    rows, slots = [], []
    for _ in range(most):  # each request: a page-table row and CONTEXT + k + 1 slots, its context prefilled
        row, pages = engine.alloc_req_row(), engine.alloc_pages(-(-(CONTEXT + k + 1) // engine.spec.page_size))
        assert row is not None and pages is not None
        s = engine.pool.slots_of_pages(pages)[: CONTEXT + k + 1]
        engine.write_page_table(row, slice(0, CONTEXT + k + 1), s.to(torch.int32).to(engine.device))
        engine.forward(ForwardBatch.build("prefill", torch.randint(3, 30000, (CONTEXT,), generator=g).tolist(), [row],
                                          [0], [CONTEXT], s[:CONTEXT].tolist(), engine.device, engine.host))
        engine.set_sampling_row(row, SamplingParams(), [], [])
        rows.append(row)
        slots.append(s.tolist())

    def run(b: int, per: int) -> float:
        """One step of b requests with `per` rows each; seconds from building it to its tokens on the host."""
        t0 = time.perf_counter()
        ids = torch.randint(3, 30000, (b * per,), generator=g).tolist()
        row_slots = [rows[i] for i in range(b) for _ in range(per)]
        fb = engine.build_batch("decode", ids, row_slots, [CONTEXT + j for _ in range(b) for j in range(per)],
                                [1] * (b * per), [slots[i][CONTEXT + j] for i in range(b) for j in range(per)])
        drafts = [ids[i * per + 1 : (i + 1) * per] for i in range(b)] if per > 1 else None
        out = engine.step(fb, engine.sampling_batch(fb, row_slots, [True] * (b * per), drafts))
        out.next_ids.tolist()
        return time.perf_counter() - t0

    results = []
    for b in batches:
        for per in (1, k + 1):  # warm-up
            run(b, per)
        times: dict[int, list[float]] = {1: [], k + 1: []}
        for _ in range(steps):
            for per in (1, k + 1):
                times[per].append(run(b, per))
        decode, verify = statistics.median(times[1]), statistics.median(times[k + 1])
        results.append(dict(kind="step", model=model, batch=b, k=k, decode_ms=round(decode * 1e3, 3),
                            verify_ms=round(verify * 1e3, 3), ratio=round(verify / decode, 3)))
        print(f"step cost  batch {b:>3}: decode {decode * 1e3:7.2f} ms  verify (k={k}, {b * (k + 1)} rows) "
              f"{verify * 1e3:7.2f} ms  ratio {verify / decode:.3f}", flush=True)
    return results


class _Replay:
    """The oracle: proposes the next k tokens of the plain run's answer; with `replay` off, prompt lookup's drafts."""

    name = "oracle"
    free = True

    def __init__(self, answer: list[int]):
        self.answer, self.replay, self.ngram = answer, True, NgramProposer(1, 12)

    def propose(self, reqs, budgets):
        if not self.replay:
            return self.ngram.propose(reqs, budgets)
        return [self.answer[len(r.output_ids) : len(r.output_ids) + n] for r, n in zip(reqs, budgets)]

    def release(self, req) -> None:
        self.ngram.release(req)

    def close(self) -> None:
        self.ngram.close()


def batch_one(model: str, k: int, device: str, new_tokens: int = 256) -> list[dict]:
    """Batch-1 decode: plain, the oracle's drafts, prompt lookup's (part 2 of the module docstring)."""
    prompt = torch.randint(3, 30000, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    # fp32 on CUDA: random weights give flat logits, and in bf16 a 5-row verify step and a 1-row decode step round a
    # near tie apart within a few tokens (the oracle's replay then misses every later draft: seen on an H200).
    kw = dict(load_format="dummy", max_running_requests=1, device=device,  # graphs: 1 row, k + 1 speculating
              **({"dtype": "float32"} if device == "cuda" else {}))

    def best(llm: LLM) -> tuple[float, float, bool]:
        """(best decode tok/s of two runs, their mean accept length, both gave the plain answer)."""
        runs = [llm.generate(prompt, params)[0] for _ in range(2)]
        return (max(r.stats.decode_tok_s for r in runs), statistics.mean(r.stats.accept_length for r in runs),
                all(r.token_ids == answer for r in runs))

    with LLM(model, **kw) as llm:
        llm.generate(prompt, SamplingParams(max_new_tokens=8))
        answer = llm.generate(prompt, params)[0].token_ids
        plain, _, plain_same = best(llm)
    proposer = _Replay(answer)
    speculative.create_proposer = lambda cfg, engine: proposer  # this process's schedulers: the oracle
    with LLM(model, **kw, speculative_algorithm="ngram", num_speculative_tokens=k) as llm:
        llm.generate(prompt, SamplingParams(max_new_tokens=8))
        oracle, oracle_len, oracle_same = best(llm)
        proposer.replay = False
        ngram, ngram_len, ngram_same = best(llm)
    rows = []
    runs = [("plain", plain, 1.0, plain_same), ("oracle (every draft right)", oracle, oracle_len, oracle_same),
            ("ngram (random weights)", ngram, ngram_len, ngram_same)]
    for run, tok_s, accept, same in runs:
        rows.append(dict(kind="batch1", run=run, model=model, k=k, new_tokens=new_tokens, tok_s=round(tok_s, 1),
                         ratio=round(tok_s / plain, 3), accept_length=round(accept, 2), same_tokens=same))
        print(f"batch 1 {run:<27} {tok_s:8.1f} tok/s  x{tok_s / plain:.2f}  accept length {accept:.2f}  "
              f"same tokens {same}", flush=True)
    return rows


def table(device: str, rows: list[dict], seconds: float) -> str:
    lines = [f"spec_bench_gpu: {device}, {seconds:.0f} s", "",
             "| part | batch | decode ms | verify ms | verify / decode | tok/s | x plain | accept len | same |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        if r["kind"] == "step":
            lines.append(f"| step cost k={r['k']} | {r['batch']} | {r['decode_ms']} | {r['verify_ms']} | "
                         f"**{r['ratio']}** | | | | |")
        else:
            lines.append(f"| {r['run']} | 1 | | | | {r['tok_s']} | **{r['ratio']}** | {r['accept_length']} | "
                         f"{'yes' if r['same_tokens'] else 'NO'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a built-in config (dummy weights)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU, smollm2-135m dummy weights, a few steps (a code check)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.smoke:
        name, rows = "cpu (smoke)", step_costs("smollm2-135m", args.k, (1, 4), "cpu", steps=2)
        rows += batch_one("smollm2-135m", args.k, "cpu", new_tokens=24)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (--smoke runs the code on the CPU)")
        name = f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
        print(name, flush=True)
        rows = step_costs(args.model, args.k, (1, 64), "cuda")
        gc.collect()  # that engine's memory back before the LLMs start
        torch.cuda.empty_cache()
        rows += batch_one(args.model, args.k, "cuda")
    text = table(name, rows, time.perf_counter() - t0)
    print(text, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_bench.txt").write_text(text + "\n")
    (out / "spec_bench.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
