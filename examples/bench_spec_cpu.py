"""Single-stream decode tok/s with and without n-gram speculation (prompt lookup), interleaved in one run, on three
workloads of the default model: rewrite a paragraph, edit a code listing, open chat (the prompts are
`minisgl bench`'s datasets rewrite, code-edit and open-chat).

    python examples/bench_spec_cpu.py [--new-tokens 256] [--repeat 3] [--k 4] [--torch-compile off|on] [--model PATH]

(`--model` takes another model, e.g. the default model's GGUF on a GPU machine, where it runs on CUDA in bf16.
`--temperature T` samples instead, with a fixed seed: speculation then draws the very same tokens, so `same` still
checks it.)

Two in-process engines of the same model and mode (the default: the GGUF's int4 weights) -- one plain, one with
`--speculative-algorithm ngram` -- answer each prompt in turn, `--repeat` times, greedy, one request at a time. tok/s is
the request's output tokens after the first over the time after its first token (decode); the table gives the best of
the runs of each (the least disturbed on a shared machine) and their ratio; `cpu` is the same per second of this
process's CPU time over the whole request (median of the runs): with `--threads 1` the engine's work alone, which
other processes on the cores do not stretch. Then the acceptance length, and whether the two answers are the same
tokens. The load average is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from minisgl_cli.bench.workloads import CHAT_PROMPTS as WORKLOADS  # also `minisgl bench --dataset NAME`


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--k", type=int, default=3, help="--num-speculative-tokens")
    ap.add_argument("--torch-compile", default="off", choices=("off", "on"))
    ap.add_argument("--model", default=None, help="a model path (default: the default model)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (seed 1); 0: greedy")
    ap.add_argument("--workload", action="append", choices=list(WORKLOADS), help="(repeatable; default: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: torch's; 1 on a shared machine: threads that wait on each other "
                         "turn its contention into noise)")
    args = ap.parse_args()
    import torch

    from minisgl_cli import LLM, SamplingParams

    kw = dict(model=args.model, torch_compile=args.torch_compile, num_threads=args.threads)
    plain, spec = LLM(**kw), LLM(**kw, speculative_algorithm="ngram", num_speculative_tokens=args.k)
    for llm in (plain, spec):  # a compiled decode: wait for it, as serving would
        while llm.client.stats().decode_compiling:
            time.sleep(1)
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=args.temperature,
                            seed=1 if args.temperature else None)
    print(f"load average before: {os.getloadavg()[0]:.2f}; k={args.k}, torch_compile={args.torch_compile}, "
          f"threads={torch.get_num_threads()}, new_tokens<={args.new_tokens}, repeat={args.repeat}, "
          f"temperature={args.temperature:g}")
    print(f"{'workload':12}{'tokens':>8}{'plain tok/s':>13}{'ngram tok/s':>13}{'ratio':>8}{'cpu ratio':>11}"
          f"{'accept len':>12}{'verifies':>10}{'same':>6}{'load':>7}")
    for name in args.workload or WORKLOADS:
        prompt = WORKLOADS[name]
        chat = [{"role": "user", "content": prompt}]
        plain.generate(chat, SamplingParams(max_new_tokens=4))  # the prompt's prefill, once each
        spec.generate(chat, SamplingParams(max_new_tokens=4))
        rates: dict[str, list[float]] = {"plain": [], "ngram": []}
        cpu: dict[str, list[float]] = {"plain": [], "ngram": []}
        answers = {}
        before = spec.client.stats()
        for _ in range(args.repeat):
            for label, llm in (("plain", plain), ("ngram", spec)):
                t0 = time.process_time()
                out = llm.generate(chat, params)[0]
                cpu[label].append(len(out.token_ids) / (time.process_time() - t0))
                rates[label].append(out.stats.decode_tok_s)
                answers[label] = out.token_ids
        after = spec.client.stats()
        verifies = after.spec_verifies - before.spec_verifies
        accept = (after.spec_accepted_tokens - before.spec_accepted_tokens + verifies) / verifies if verifies else 0
        p, s = max(rates["plain"]), max(rates["ngram"])
        cpu_ratio = statistics.median(cpu["ngram"]) / statistics.median(cpu["plain"])
        print(f"{name:12}{len(answers['plain']):>8}{p:>13.1f}{s:>13.1f}{s / p:>8.2f}{cpu_ratio:>11.2f}{accept:>12.2f}"
              f"{verifies:>10}{str(answers['plain'] == answers['ngram']):>6}{os.getloadavg()[0]:>7.2f}", flush=True)
    plain.close()
    spec.close()


if __name__ == "__main__":
    main()
