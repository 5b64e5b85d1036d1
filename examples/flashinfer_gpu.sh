#!/usr/bin/env bash
# Issue 50's FlashInfer measurement on one GPU, in three calls while the machine stays warm: flashinfer-python 0.7.4 is
# a 101 MB wheel, over one call's 64 MiB carry (the tree's own ~5 MB included), so it travels in three pieces of
# ~34 MB, each in a git-ignored folder of its own.
#   here, once:  STEP=split bash examples/flashinfer_gpu.sh    (downloads the wheel and nvidia-ml-py, the one package
#                                                               `import flashinfer` needs beyond this project's wheels)
#   call A:      carry [".fi-a"]                  STEP=a bash examples/flashinfer_gpu.sh   (its piece to /tmp/fi; any
#                                                 call may do this as its last step, carrying .fi-a beside its own)
#   call A2:     carry [".fi-c"]                  STEP=a bash examples/flashinfer_gpu.sh   (the second piece)
#   call B:      carry [".fi-b", ".whl", ".tok"]  STEP=b OUT=$OUT bash examples/flashinfer_gpu.sh
# Each call must start within the warm machine's idle release (~30 s) of the one before, or /tmp/fi is gone with it.
# Step b joins and checks the wheel, installs it beside the carried wheels, then within BUDGET seconds (default 540):
#   tests.log      tests/test_attention_kernels.py with flashinfer among its backends (its kernels JIT-compile with the
#                  machine's nvcc on first use: that time lands here)
#   attention.log  examples/bench_attention.py: decode and prefill, triton vs torch vs flashinfer, KV-read GB/s
#   bench.log      examples/gpu_bench.py --only qwen --attention-backend flashinfer, then triton: batch-1 and preset
set -o pipefail
STEP=${STEP:?STEP=split, a or b}
WHEEL=flashinfer_python-0.7.4-py3-none-any.whl
case $STEP in
  split)
    tmp=$(mktemp -d)
    pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
      flashinfer-python==0.7.4 nvidia-ml-py -d "$tmp"
    rm -rf .fi-a .fi-b .fi-c && mkdir .fi-a .fi-b .fi-c
    (cd "$tmp" && sha256sum "$WHEEL") > .fi-b/SHA256
    split -b 34M "$tmp/$WHEEL" .fi-a/part.
    mv .fi-a/part.ab .fi-c/ && mv .fi-a/part.ac .fi-b/ && mv "$tmp"/nvidia_ml_py-*.whl .fi-b/
    du -sh .fi-a .fi-c .fi-b ;;
  a)  # whichever piece this call carried
    mkdir -p /tmp/fi && cp .fi-a/part.* .fi-c/part.* /tmp/fi/ 2>/dev/null; ls -la /tmp/fi ;;
  b)
    for piece in aa ab; do
      [ -f /tmp/fi/part.$piece ] || { echo "no /tmp/fi/part.$piece: its call did not run on this machine"; exit 2; }
    done
    cat /tmp/fi/part.aa /tmp/fi/part.ab .fi-b/part.ac > "/tmp/fi/$WHEEL" \
      && (cd /tmp/fi && sha256sum -c "$OLDPWD/.fi-b/SHA256") || exit 2
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site --upgrade "/tmp/fi/$WHEEL" \
      .fi-b/*.whl || exit 2
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 MINISGL_TEST_TOKENIZER_DIR=$PWD/.tok
    python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" || exit 2
    OUT=${OUT:-/tmp/fi_out}; mkdir -p "$OUT"; BUDGET=${BUDGET:-540}; PARTS=${PARTS:-t a g}; PY=python3
    source "$(dirname "$0")/parts.sh"
    want t && part tests 240 60 "$OUT/tests.log" $PY -m pytest -q -p no:cacheprovider tests/test_attention_kernels.py
    want a && part attention 120 30 "$OUT/attention.log" $PY examples/bench_attention.py --quick
    if want g; then
      for backend in flashinfer triton; do
        part "bench $backend" 150 60 "$OUT/bench.log" $PY examples/gpu_bench.py --only qwen --main-only --no-hf \
          --greedy-only --attention-backend "$backend" --out "$OUT/$backend"
      done
    fi
    printf '%s\n' "${STATUS[@]}" | tee "$OUT/summary.txt"
    grep -h "passed\|failed" "$OUT/tests.log" | tail -1 | tee -a "$OUT/summary.txt" ;;
esac
