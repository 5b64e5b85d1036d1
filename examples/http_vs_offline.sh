#!/usr/bin/env bash
# The nano-vllm preset three ways in one run: offline (`minisgl bench`, engine in this process), and through
# HTTP (`minisgl bench --url`) against `minisgl serve` with the multi-process runtime and with the in-process
# one. Each runs the preset twice (two draws); the table reports the second, warm one. Logs under $OUT.
#
#   OUT=/tmp/http bash examples/http_vs_offline.sh                 # GPU: Qwen3-0.6B dummy weights
#   MODEL=smollm2-135m NUM_PROMPTS=2 DEVICE=cpu MAX_TOTAL_TOKENS=8192 bash examples/http_vs_offline.sh  # CPU check
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/http_vs_offline}; mkdir -p "$OUT"
MODEL=${MODEL:-qwen3-0.6b}
NUM_PROMPTS=${NUM_PROMPTS:-256}
PORT=${PORT:-8199}
PY=${PY:-python3}
ENGINE=(--model "$MODEL" --load-format dummy --max-running-requests 256 --max-total-tokens "${MAX_TOTAL_TOKENS:-300000}")
[ -n "$DEVICE" ] && ENGINE+=(--device "$DEVICE")
[ "${DEVICE:-cuda}" != cpu ] && ENGINE+=(--cuda-graph-max-bs 256)
LEVELS=(--concurrency 256 --concurrency 256)
WORK=(--preset nano-vllm --num-prompts "$NUM_PROMPTS" --warmup 1)

echo "== offline"
$PY -m minisgl_cli.app bench "${WORK[@]}" "${LEVELS[@]}" --no-baseline "${ENGINE[@]}" \
  --output-json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.txt" | grep -E "minisgl|error" | tail -3

for runtime in processes in-process; do
  echo "== HTTP, serve --runtime $runtime"
  $PY -m minisgl_cli.app serve "${ENGINE[@]}" --runtime "$runtime" --port "$PORT" > "$OUT/serve-$runtime.log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    [ "$(curl -s -o /dev/null -w '%{http_code}' "localhost:$PORT/health")" = 200 ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.5
  done
  $PY -m minisgl_cli.app bench --url "http://127.0.0.1:$PORT" --model "$MODEL" "${WORK[@]}" "${LEVELS[@]}" \
    --output-json "$OUT/http-$runtime.json" 2>&1 | tee "$OUT/http-$runtime.txt" | grep -E "server@|error" | tail -3
  kill -TERM $pid; wait $pid
done

$PY examples/bench_table.py "$OUT" offline:"offline (in-process)" http-processes:"HTTP, runtime processes" \
  http-in-process:"HTTP, runtime in-process"
