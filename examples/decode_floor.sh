#!/usr/bin/env bash
# Issue 50 on one GPU within BUDGET seconds (default 560): where a batch-1 decode step's time goes, model by model.
# Parts (PARTS, default "s h f"), each under examples/parts.sh, logs in $OUT:
#   tests.log      (t) pytest over TESTS (default the decode attention's and the packed experts' GPU tests)
#   attention.log  (a) examples/bench_attention.py --sweep-short: batch-1 decode attention split or in one split
#   fp8_sweep/     (s) examples/gpu_bench.py --only gemv --sweep-fp8: the FP8 GEMV's block shapes on this card
#   host_*.log     (h) examples/decode_host.py --print-ops for each of HOST_MODELS (model[:quantization]): tok/s, the
#                      host's own µs a step, the device's kernels a step (count, µs each); with OLD=DIR the same
#                      on that tree first, in a child (before / after in one call)
#   families.log   (f) examples/families_gpu.py over FAMILY_MODELS with a kernel table each (FAMILY_PROFILE): the
#                      MoE / MLA models' batch-1 and preset rows against their bytes; with OLD=DIR that tree's first
#                      (families_old.log); FAMILY_LIMIT: the part's seconds (default 330)
#   mxfp4.log      (x) examples/mxfp4_bench.py --sizes 1,4 --sweep (or MXFP4_ARGS): gpt-oss's packed experts' tiles
#   moe.log        (m) examples/moe_bench.py --sizes 1 --sweep --sweep-dtypes one_slot --no-engine (MOE_ARGS):
#                      Qwen3-30B-A3B's few-token expert tiles
#   mtp.log        (p) examples/mtp_cost.py over MTP_MODELS: an MTP draft's cost (its extend, its chained row) and the
#                      verify step's, in the model's decode steps (issue 49's --speculative-algorithm mtp)
#   summary.txt    the parts' status and each result line
# HOST_ARGS / FAMILY_ARGS / MTP_ARGS add to those scripts' arguments (e.g. HOST_ARGS=--sampled, FAMILY_ARGS="--also-
# temperature 0.7", MTP_ARGS="--temperature 0.7": sampled rows instead of, or beside, the greedy ones).
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
FAMILY_PROFILE=${FAMILY_PROFILE-$FAMILY_MODELS}  # the models with a kernel table
MTP_MODELS=${MTP_MODELS:-deepseek-v3-5layer-fp8,qwen3.5-9b}
TESTS=${TESTS:-tests/test_attention_kernels.py tests/test_gpu_window_attention.py tests/test_gpu_mxfp4_moe.py}
source "$(dirname "$0")/parts.sh"

want t && part tests 200 60 "$OUT/tests.log" $PY -m pytest -q -p no:cacheprovider $TESTS
want a && part attention 120 30 "$OUT/attention.log" $PY examples/bench_attention.py --sweep-short

want s && part fp8-sweep 200 60 "$OUT/fp8_sweep.log" \
  $PY examples/gpu_bench.py --only gemv --sweep-fp8 --out "$OUT/fp8_sweep"
if want h; then
  for spec in $HOST_MODELS; do
    model=${spec%%:*}; quant=auto; [[ $spec == *:* ]] && quant=${spec#*:}
    part "host $spec" 120 40 "$OUT/host_${model}_${quant}.log" \
      $PY examples/decode_host.py --model "$model" --quantization "$quant" --print-ops --profile-steps 50 \
      ${OLD:+--old "$OLD"} $HOST_ARGS
  done
fi
if want f; then
  if [ -n "$OLD" ]; then  # the old tree's package first on the path (the children inherit it)
    PYTHONPATH=$OLD:$PYTHONPATH part "families (old)" 330 90 "$OUT/families_old.log" \
      $PY examples/families_gpu.py --models "$FAMILY_MODELS" --long "" --profile "$FAMILY_PROFILE" --out "$OUT/old" $FAMILY_ARGS
  fi
  part families "${FAMILY_LIMIT:-330}" 90 "$OUT/families.log" \
    $PY examples/families_gpu.py --models "$FAMILY_MODELS" --long "" --profile "$FAMILY_PROFILE" --out "$OUT" $FAMILY_ARGS
fi
want x && part mxfp4 150 40 "$OUT/mxfp4.log" $PY examples/mxfp4_bench.py ${MXFP4_ARGS:---sizes 1,4 --sweep} --out "$OUT"
want p && part mtp 200 60 "$OUT/mtp.log" $PY examples/mtp_cost.py --models "$MTP_MODELS" --out "$OUT" $MTP_ARGS
want m && part moe 150 40 "$OUT/moe.log" \
  $PY examples/moe_bench.py ${MOE_ARGS:---sizes 1 --sweep --sweep-dtypes one_slot --no-engine} --out "$OUT"

{
  echo "==== decode_floor.sh: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)," \
    "PDL $([ -n "$MINISGL_DISABLE_PDL" ] && echo off || echo on) ===="
  printf '%s\n' "${STATUS[@]}"
  grep -h "passed\|failed" "$OUT/tests.log" 2>/dev/null | tail -2
  grep -h -A25 "^# .*batch-1 decode, µs" "$OUT/attention.log" 2>/dev/null
  grep -h "gemv-fp8\|RESULT\|device busy" "$OUT"/*.log "$OUT"/fp8_sweep/* 2>/dev/null | cut -c1-400
  grep -h -A8 "tok/s, decode step" "$OUT/mtp.log" 2>/dev/null
  for f in families_old families; do
    [ -f "$OUT/$f.log" ] && echo "-- $f" && grep -h "batch-1\|preset" "$OUT/$f.log" | grep -v "^ROW\|RESULT" | sort -u
  done
} > "$OUT/summary.txt"
cat "$OUT/summary.txt"
