#!/usr/bin/env bash
# GPU checks in one go: import check, GPU tests (kernels, fused ops, numerics), then the benchmark (table last).
# Logs under $OUT. SKIP_TESTS=1 runs the benchmark alone; extra arguments go to gpu_bench.py
# (--fp8 --main-only --no-hf: bf16 and FP8 side by side).
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_bench}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "from minisgl_cli import LLM; print('import ok', LLM)" 2>&1 | tee "$OUT/import.txt"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu_ops.py tests/test_attention_kernels.py \
    tests/test_gpu_numerics.py tests/test_gpu_structured.py tests/test_gpu_fp8.py tests/test_gpu_isolation.py \
    -q -s -p no:cacheprovider 2>&1 |
    tee "$OUT/tests.txt" | grep -E "passed|failed|FAIL|Error|vs HF|fp8"
fi
[ -n "$SKIP_BENCH" ] || timeout ${BENCH_TIMEOUT:-420} python3 examples/gpu_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.txt"
