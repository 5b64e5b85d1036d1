#!/usr/bin/env bash
# The media engine on the GPU in one go: install the media wheels from a carried folder (no network there), the
# GPU import check, tests/test_gpu_media.py (SKIP_TESTS=1 skips it), then examples/media_bench.py (its table
# last). Logs and the JSON under $OUT.
#   WHEELS=shared/wheels bash examples/media_gpu.sh --skip-video          # Z-Image, default variants (~4 min)
#   bash examples/media_gpu.sh --skip-image                               # Wan at 10 steps, extrapolated (~8 min)
#   bash examples/media_gpu.sh --skip-image --wan-steps 50 --video-variants plain,compile+fp8+fbcache
# Extra arguments go to media_bench.py. The wheels: diffusers 0.42.1, cache-dit 1.5.3 (torchao optional), e.g.
#   pip download --no-deps -d shared/wheels diffusers==0.42.1 cache-dit==1.5.3
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/media_gpu}; mkdir -p "$OUT"
WHEELS=${WHEELS:-shared/wheels}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
if [ -d "$WHEELS" ]; then
  python3 -m pip install -q --no-deps --no-index "$WHEELS"/diffusers-*.whl "$WHEELS"/cache_dit-*.whl 2>&1 |
    tail -3 | tee "$OUT/install.txt"
fi
python3 -c "import diffusers, cache_dit, torch; print('import ok: diffusers', diffusers.__version__, 'cache-dit',
cache_dit.__version__, 'torch', torch.__version__)" 2>&1 | tee "$OUT/import.txt"
if [ -z "$SKIP_TESTS" ]; then
  timeout ${TEST_TIMEOUT:-300} python3 -m pytest tests/test_gpu_media.py -q -s -p no:cacheprovider 2>&1 |
    tee "$OUT/tests.txt" | grep -E "passed|failed|FAIL|Error|PSNR|built in"
fi
timeout ${BENCH_TIMEOUT:-560} python3 examples/media_bench.py --out "$OUT" "$@" 2>&1 | tee "$OUT/bench.txt" |
  grep -v "^\[.*Cache-DiT\]"
