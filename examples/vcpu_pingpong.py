"""How far apart two CPUs are right now: a cache line bounced between two threads pinned to them, ns a round trip.

    python examples/vcpu_pingpong.py [--seconds 30] [--cpus 0 1] [--every 1.0]

On a VM whose host moves its vCPUs, the same two "cores" are near in some minutes and far in others, and anything
that hands data from one thread to the other (an OpenMP barrier, a gather on one thread read by another) slows
with them: on the 2-core machine of docs/benchmarks.md the CPU decode's 16-row step ran at ~41 ms in near phases
and ~58 ms in far ones, where a first version of this probe (20,000 round trips, its thread's start counted) read
~160 and 520-670 ns; this one counts 100,000 and reads lower (66-330 ns within 5 s there). Run it beside a
benchmark (or before each of an A/B's runs) to say which phase a figure was taken in. Builds its C once with the
system compiler (cc, which the compiled CPU step needs anyway) into a temporary directory; prints one line per
--every seconds: the mean over 100,000 round trips (fewer would count the second thread's start and its first
migration to its CPU).
"""

from __future__ import annotations

import argparse
import ctypes
import subprocess
import tempfile
import time
from pathlib import Path

ROUNDS = 100_000
C = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>
static _Atomic long flag __attribute__((aligned(64)));
static long rounds;
static int cpu_a, cpu_b;
static void pin(int c) {
  cpu_set_t s; CPU_ZERO(&s); CPU_SET(c, &s); pthread_setaffinity_np(pthread_self(), sizeof s, &s);
}
static void *answer(void *arg) {
  (void)arg; pin(cpu_b);
  for (long i = 0; i < rounds; i++) {
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 1) {}
    atomic_store_explicit(&flag, 2 * i + 2, memory_order_release);
  }
  return 0;
}
/* ns a round trip over n round trips between CPUs a and b (the caller's affinity restored after) */
double pingpong(int a, int b, long n) {
  rounds = n; cpu_a = a; cpu_b = b; flag = 0;
  cpu_set_t old; pthread_getaffinity_np(pthread_self(), sizeof old, &old); pin(cpu_a);
  pthread_t t; pthread_create(&t, 0, answer, 0);
  struct timespec t0, t1; clock_gettime(CLOCK_MONOTONIC, &t0);
  for (long i = 0; i < n; i++) {
    atomic_store_explicit(&flag, 2 * i + 1, memory_order_release);
    while (atomic_load_explicit(&flag, memory_order_acquire) != 2 * i + 2) {}
  }
  clock_gettime(CLOCK_MONOTONIC, &t1); pthread_join(t, 0);
  pthread_setaffinity_np(pthread_self(), sizeof old, &old);
  return ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / n;
}
"""


def load() -> ctypes.CDLL:
    """The probe, compiled into a temporary directory."""
    tmp = Path(tempfile.mkdtemp(prefix="pingpong-"))
    (tmp / "pp.c").write_text(C)
    subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-pthread", "-o", str(tmp / "pp.so"), str(tmp / "pp.c")],
                   check=True)
    lib = ctypes.CDLL(str(tmp / "pp.so"))
    lib.pingpong.restype = ctypes.c_double
    lib.pingpong.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--cpus", type=int, nargs=2, default=[0, 1])
    ap.add_argument("--every", type=float, default=1.0, help="seconds between lines")
    args = ap.parse_args()
    lib = load()
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        ns = lib.pingpong(*args.cpus, ROUNDS)
        print(f"{time.strftime('%H:%M:%S')} cpu {args.cpus[0]} <-> {args.cpus[1]}: {ns:.0f} ns a round trip",
              flush=True)
        time.sleep(args.every)


if __name__ == "__main__":
    main()
