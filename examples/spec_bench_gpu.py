"""Speculative decoding on the GPU, one run (~3 min on an H100): what a verify step costs against a decode step, and an
oracle run whose drafts replay the model's own greedy output (every draft accepted: the mechanism's ceiling).

    PYTHONPATH=. python examples/spec_bench_gpu.py [--model llama-3.1-8b] [--k 4] [--out DIR]
    PYTHONPATH=. python examples/spec_bench_gpu.py --smoke   # the same code on the CPU, a small model, a few steps

1. Step cost: dummy weights (bf16), B requests with 512 tokens of context each (B = 1 and 64); a decode step (B rows)
   and a verify step (B x (k + 1) rows: the decode rows of each request's k drafts) through Engine.step -- CUDA graphs
   captured up to 64 x (k + 1) rows, greedy --, each timed from building the batch to its tokens on the host, 40 steps
   apiece, interleaved; the median. Goal: verify / decode <= 1.15 at batch 1.
2. Oracle, batch 1: the scheduler (LLM) on the same dummy weights, one 128-token prompt, 256 new tokens greedy, EOS
   ignored: plain, then speculating with a proposer that replays the plain run's tokens (k drafts a step, all
   accepted); decode tok/s of each (best of 2) and their ratio, labelled as an oracle. Goal: >= 2.5x.
Prints a table and writes it, with every figure, to DIR/spec_bench.json.
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
from minisgl_cli.core.batch import ForwardBatch
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine
from minisgl_cli.scheduler import speculative

CONTEXT = 512


def step_costs(model: str, k: int, batches: tuple[int, ...], device: str, steps: int = 40) -> list[dict]:
    most = max(batches)
    engine = Engine(EngineConfig(model=model, load_format="dummy", device=device, max_running_requests=most,
                                 max_total_tokens=most * (CONTEXT + k + 8), cuda_graph_max_bs=most * (k + 1)))
    g = torch.Generator().manual_seed(0)
    rows, slots = [], []
    for _ in range(most):  # each request: a page-table row and CONTEXT + k + 1 slots, its context prefilled
        row, pages = engine.alloc_req_slot(), engine.alloc_pages(-(-(CONTEXT + k + 1) // engine.spec.page_size))
        assert row is not None and pages is not None
        s = engine.pool.slots_of_pages(pages)[: CONTEXT + k + 1]
        engine.write_page_table(row, slice(0, CONTEXT + k + 1), s.to(torch.int32).to(engine.device))
        engine.forward(ForwardBatch.build("extend", torch.randint(3, 30000, (CONTEXT,), generator=g).tolist(), [row],
                                          [0], [CONTEXT], s[:CONTEXT].tolist(), engine.device, engine.host))
        engine.admit_sampling(row, SamplingParams(), [], [])
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
    """The oracle: proposes the next k tokens of the plain run's answer."""

    name = "oracle"

    def __init__(self, answer: list[int]):
        self.answer = answer

    def propose(self, reqs, budgets):
        return [self.answer[len(r.output_ids) : len(r.output_ids) + n] for r, n in zip(reqs, budgets)]

    def release(self, req) -> None:
        pass

    def close(self) -> None:
        pass


def oracle(model: str, k: int, device: str, new_tokens: int = 256) -> dict:
    prompt = torch.randint(3, 30000, (128,), generator=torch.Generator().manual_seed(1)).tolist()
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    kw = dict(load_format="dummy", max_running_requests=4, device=device)
    with LLM(model, **kw) as llm:
        llm.generate(prompt, SamplingParams(max_new_tokens=8))
        runs = [llm.generate(prompt, params)[0] for _ in range(2)]
    answer = runs[0].token_ids
    plain = max(r.stats.decode_tok_s for r in runs)
    speculative.create_proposer = lambda cfg, engine: _Replay(answer)  # this process's schedulers: the oracle
    with LLM(model, **kw, speculative_algorithm="ngram", num_speculative_tokens=k) as llm:
        llm.generate(prompt, SamplingParams(max_new_tokens=8))
        runs = [llm.generate(prompt, params)[0] for _ in range(2)]
        stats = llm.client.stats()
    spec = max(r.stats.decode_tok_s for r in runs)
    same = all(r.token_ids == answer for r in runs)
    row = dict(kind="oracle", model=model, k=k, new_tokens=new_tokens, plain_tok_s=round(plain, 1),
               oracle_tok_s=round(spec, 1), ratio=round(spec / plain, 3), accept_length=stats.spec_accept_length,
               same_tokens=same)
    print(f"oracle (every draft accepted) batch 1: plain {plain:.1f} tok/s, speculating {spec:.1f} tok/s, "
          f"x{spec / plain:.2f}, accept length {stats.spec_accept_length:.2f}, same tokens {same}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-3.1-8b", help="a built-in config (dummy weights)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--out", default=".")
    ap.add_argument("--smoke", action="store_true", help="CPU, smollm2-135m dummy weights, a few steps (a code check)")
    args = ap.parse_args()
    if args.smoke:
        name, rows = "cpu (smoke)", step_costs("smollm2-135m", args.k, (1, 4), "cpu", steps=2)
        rows.append(oracle("smollm2-135m", args.k, "cpu", new_tokens=24))
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (--smoke runs the code on the CPU)")
        name = torch.cuda.get_device_name()
        print(f"{name}, torch {torch.__version__}", flush=True)
        rows = step_costs(args.model, args.k, (1, 64), "cuda")
        gc.collect()  # that engine's memory back before the LLMs start
        torch.cuda.empty_cache()
        rows.append(oracle(args.model, args.k, "cuda"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec_bench.json").write_text(json.dumps({"device": name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
