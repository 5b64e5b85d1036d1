#!/usr/bin/env bash
# Data parallelism through HTTP, in one run: the nano-vllm preset against `minisgl serve --dp 1`, `--dp 2`, and
# `minisgl router --processes N` in front of two `minisgl serve --dp 1` (one GPU each), once per N in ROUTER_PROCS
# (default "1 4": one router process, and four on the same port). Each runs the preset twice (two draws); the
# table reports the second, warm one, and each row's output throughput over --dp 1's. Logs under $OUT.
#
#   OUT=/tmp/dp bash examples/dp_scaling.sh                       # two GPUs: Qwen3-0.6B dummy weights
#   ROUTER_PROCS=4 OUT=/tmp/dp bash examples/dp_scaling.sh        # the router with 4 processes only
#   NUM_PROMPTS=128 GRAPH_BS=128 OUT=/tmp/dp bash examples/dp_scaling.sh   # shorter (examples/two_gpu.sh)
#   MODEL=/tmp/tiny-llama LOAD_FORMAT=auto DEVICE=cpu NUM_PROMPTS=64 MAX_TOTAL_TOKENS=40000 \
#     WORK="--dataset random --input-len 256 --output-len 128" bash examples/dp_scaling.sh   # a CPU check
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/dp_scaling}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen3-0.6b}
LOAD_FORMAT=${LOAD_FORMAT:-dummy}
NUM_PROMPTS=${NUM_PROMPTS:-256}
PORT=${PORT:-8199}
PY=${PY:-python3}
ENGINE=(--model "$MODEL" --load-format "$LOAD_FORMAT" --max-running-requests 256
        --max-total-tokens "${MAX_TOTAL_TOKENS:-300000}")
[ -n "$DEVICE" ] && ENGINE+=(--device "$DEVICE")
[ "${DEVICE:-cuda}" != cpu ] && ENGINE+=(--cuda-graph-max-bs "${GRAPH_BS:-256}")
read -r -a SHAPE <<< "${WORK:---preset nano-vllm}"
BENCH=("${SHAPE[@]}" --num-prompts "$NUM_PROMPTS" --warmup 1 --concurrency "$NUM_PROMPTS" --concurrency "$NUM_PROMPTS")
[ -n "$CLIENT_PROCS" ] && BENCH+=(--client-procs "$CLIENT_PROCS")  # default: one per 64 streams, up to the cores

wait_healthy() {  # port pid
  for _ in $(seq 1 1200); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$1/health")" = 200 ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

bench() {  # name port
  $PY -m minisgl_cli.app bench --url "http://127.0.0.1:$2" --model "$MODEL" "${BENCH[@]}" \
    --output-json "$OUT/$1.json" 2>&1 | tee "$OUT/$1.txt" | grep -E "server@|error" | tail -3
}

# One "device" per replica: a GPU each, or on the CPU half the cores each (as --dp 2 splits them by itself).
ONE=()
[ "${DEVICE:-cuda}" = cpu ] && ONE=(env OMP_NUM_THREADS=$(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 )))

for dp in ${DP_SIZES:-1 2}; do  # DP_SIZES=1: --dp 1 only (the router's baseline)
  echo "== serve --dp $dp"
  run=("${ONE[@]}"); [ "$dp" = 2 ] && run=()
  "${run[@]}" $PY -m minisgl_cli.app serve "${ENGINE[@]}" --dp "$dp" --port "$PORT" > "$OUT/serve-dp$dp.log" 2>&1 &
  pid=$!
  wait_healthy "$PORT" $pid && bench "dp$dp" "$PORT"
  kill -TERM $pid; wait $pid
done

echo "== two serve --dp 1 (one GPU each) for the router"
pids=()
for i in 0 1; do
  CUDA_VISIBLE_DEVICES=$i "${ONE[@]}" $PY -m minisgl_cli.app serve "${ENGINE[@]}" --port $((PORT + 1 + i)) \
    > "$OUT/worker$i.log" 2>&1 &
  pids+=($!)
done
rows=()
if wait_healthy $((PORT + 1)) "${pids[0]}" && wait_healthy $((PORT + 2)) "${pids[1]}"; then
  for n in ${ROUTER_PROCS:-1 4}; do
    echo "== router --processes $n over them"
    $PY -m minisgl_cli.app router --worker-url "http://127.0.0.1:$((PORT + 1))" \
      --worker-url "http://127.0.0.1:$((PORT + 2))" --processes "$n" --port "$PORT" > "$OUT/router-p$n.log" 2>&1 &
    router=$!
    wait_healthy "$PORT" $router && sleep 3 && bench "router-p$n" "$PORT"  # sleep: every process's check sees both
    kill -TERM $router; wait $router
    rows+=("router-p$n:router ($n process$([ "$n" = 1 ] || echo es)) over 2 x serve --dp 1")
  done
fi
kill -TERM "${pids[@]}"; wait "${pids[@]}"

$PY examples/bench_table.py "$OUT" dp1:"serve --dp 1" dp2:"serve --dp 2" "${rows[@]}"
