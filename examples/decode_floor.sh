#!/usr/bin/env bash
# Issue 50 on one GPU within BUDGET seconds (default 560): where a batch-1 decode step's time goes, model by model.
# Parts (PARTS, default "s h f"), each under examples/parts.sh, logs in $OUT:
#   fp8_sweep/     (s) examples/gpu_bench.py --only gemv --sweep-fp8: the FP8 GEMV's block shapes on this card
#   host_*.log     (h) examples/decode_host.py --print-ops for each of HOST_MODELS (model[:quantization]): tok/s, the
#                      host's own µs a step, the device's kernels a step (count, µs each)
#   families.log   (f) examples/families_gpu.py over FAMILY_MODELS with a kernel table each: the MoE / MLA models'
#                      batch-1 and preset rows against their bytes
#   mxfp4.log      (x) examples/mxfp4_bench.py --sizes 1,4 --sweep: gpt-oss's packed experts' tiles
#   moe.log        (m) examples/moe_bench.py --sizes 1 --sweep --sweep-dtypes one_slot --no-engine: Qwen3-30B-A3B's
#                      few-token expert tiles
#   summary.txt    the parts' status and each result line
# MINISGL_DISABLE_PDL=1 in the environment: every kernel waits for the one before, so the kernel tables' µs are each
# kernel's own (with PDL a kernel's time also counts its wait for its predecessor).
#
#   OUT=/tmp/floor bash examples/decode_floor.sh
#   PARTS="h" HOST_MODELS="llama-3.1-8b:fp8" OUT=/tmp/floor bash examples/decode_floor.sh
set -o pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/decode_floor}; mkdir -p "$OUT"
PY=${PY:-python3}
BUDGET=${BUDGET:-560}
PARTS=${PARTS:-s h f}
HOST_MODELS=${HOST_MODELS:-qwen3-0.6b llama-3.1-8b llama-3.1-8b:fp8}
FAMILY_MODELS=${FAMILY_MODELS:-qwen3-30b-a3b,gpt-oss-20b,deepseek-v2-lite}
source "$(dirname "$0")/parts.sh"

want s && part fp8-sweep 200 60 "$OUT/fp8_sweep.log" \
  $PY examples/gpu_bench.py --only gemv --sweep-fp8 --out "$OUT/fp8_sweep"
if want h; then
  for spec in $HOST_MODELS; do
    model=${spec%%:*}; quant=auto; [[ $spec == *:* ]] && quant=${spec#*:}
    part "host $spec" 120 40 "$OUT/host_${model}_${quant}.log" \
      $PY examples/decode_host.py --model "$model" --quantization "$quant" --print-ops --profile-steps 50
  done
fi
want f && part families 330 90 "$OUT/families.log" \
  $PY examples/families_gpu.py --models "$FAMILY_MODELS" --long "" --profile "$FAMILY_MODELS" --out "$OUT"
want x && part mxfp4 150 40 "$OUT/mxfp4.log" $PY examples/mxfp4_bench.py --sizes 1,4 --sweep --out "$OUT"
want m && part moe 150 40 "$OUT/moe.log" \
  $PY examples/moe_bench.py --sizes 1 --sweep --sweep-dtypes one_slot --no-engine --out "$OUT"

{
  echo "==== decode_floor.sh: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)," \
    "PDL $([ -n "$MINISGL_DISABLE_PDL" ] && echo off || echo on) ===="
  printf '%s\n' "${STATUS[@]}"
  grep -h "gemv-fp8\|RESULT\|device busy" "$OUT"/*.log "$OUT"/fp8_sweep/* 2>/dev/null | cut -c1-400
  grep -h "batch-1\|preset" "$OUT/families.log" 2>/dev/null | grep -v "^ROW"
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
