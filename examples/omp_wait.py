"""The OpenMP wait policy's effect on the CPU decode: the default model, in-process, one greedy stream through the
stored compiled step (or eager where none is stored), in a fresh process per setting, alternating, so that the
settings share whatever load the machine has (report it: the policy matters on shared cores).

    python examples/omp_wait.py [--tokens 16] [--rounds 2]

Prints ms per token for each round of: libgomp's default (minisgl's), OMP_WAIT_POLICY=PASSIVE, ACTIVE (spin
at every barrier), a short spin (GOMP_SPINCOUNT=10000), and one thread (default and passive), with the load average
after each. `--busy` keeps one other process busy meanwhile (a pure-Python loop): cores shared with another job.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

OWN = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")  # what the settings below decide
SETTINGS = {"gomp default": {}, "PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"}, "ACTIVE": {"OMP_WAIT_POLICY": "ACTIVE"},
            "spin 10k": {"GOMP_SPINCOUNT": "10000"}, "default, 1 thread": {"OMP_NUM_THREADS": "1"},
            "PASSIVE, 1 thread": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}}

CHILD = """
import sys, time
import torch  # first: libgomp reads its settings now, from the environment this process was given
from minisgl_cli import LLM, SamplingParams
with LLM(torch_compile="auto") as llm:
    p = SamplingParams(max_new_tokens=int(sys.argv[1]), ignore_eos=True)
    llm.generate("Hello", p)
    t0 = time.perf_counter()
    o = llm.generate("Tell me a story about a dog.", p)[0]
    print(f"{1000 * (time.perf_counter() - t0) / len(o.token_ids):.1f} {llm.client.stats().decode_step}")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--busy", action="store_true", help="one other busy process beside every measurement")
    args = ap.parse_args()
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    print("| round | setting | ms/token | decode step | load average after |\n|---:|---|---:|---|---|")
    for r in range(args.rounds):
        for name, extra in SETTINGS.items():
            env = {k: v for k, v in os.environ.items() if k not in OWN}
            out = subprocess.run([sys.executable, "-c", CHILD, str(args.tokens)], env={**env, **extra},
                                 capture_output=True, text=True, check=True).stdout.split()
            load = " ".join(open("/proc/loadavg").read().split()[:3])
            print(f"| {r + 1} | {name} | {out[-2]} | {out[-1]} | {load} |", flush=True)
    if busy is not None:
        busy.kill()


if __name__ == "__main__":
    main()
