#!/usr/bin/env bash
# One GPU, this round's checks within BUDGET seconds (default 280), in order of value: the GPU tests of the new
# paths first (correctness before speed), then each issue's micro-benchmark. Parts run under examples/parts.sh
# (skipped when the budget is short, a failure logged and the next part run); every log lands in $OUT as it goes:
#   tests.log      (t) the split Triton sampler, the fused MoE kernels, speculative verify steps under graphs,
#                      Qwen2-VL on CUDA, an out-of-vocabulary id: pytest over two workers (files side by side)
#   sampling.log   (s) examples/bench_sampling.py: the sampler's µs per call, one program a row vs the split path
#   fronts.log     (f) examples/fronts_gpu.py --kv bf16,fp8_e4m3: Qwen3-0.6B preset, the scheduler driven directly
#                      vs LLM(processes=True) vs minisgl bench offline vs serve + bench --url, one prefill budget
#                      (16,384) for all
#   sampled_fronts.log (o) the same, FP8 KV, raw vs HTTP with every request sampled at t=0.7 / top_p=0.9
#   spec.log       (p) examples/spec_bench_gpu.py: a verify step's cost, batch-1 decode plain / oracle / ngram
#   moe.log        (m) examples/moe_bench.py: the MoE layer fused vs grouped (bf16 and FP8 experts), no engine;
#                      MOE_ARGS adds to its arguments (e.g. "--sizes 1,4 --sweep --sweep-dtypes one_slot,one_slot_fp8")
#   moe_decode.log (n) examples/moe_bench.py --sizes 1: Qwen3-30B-A3B batch-1 decode, bf16 and FP8 experts, as
#                      shipped and without the few-token path (MOE_DECODE_ARGS adds, e.g. --profile)
#   bench.log      (g) examples/gpu_bench.py qwen,llama: each preset and batch-1 row greedy, t=0.7/top_p=0.9 and t=1.0
#   models.log     (e) examples/gpu_bench.py --fp8 moe,llama,mixtral: Qwen3-30B-A3B bf16 / FP8 weights beside
#                      Llama-3.1-8B's dtypes, Mixtral-8x7B FP8 (greedy)
#   vlm.log        (v) examples/bench_vlm.py gpu: Qwen2.5-VL-7B dummy, 64 image chats through serve, shared image too
#   families.log   (w) examples/families_gpu.py: MLA, hybrid, sliding-window families' batch-1 / preset rows against
#                      their bytes, a 32k decode with the windows on and off (FAMILY_ARGS adds to its arguments)
#   media_prof.log (z) examples/media_profile.py: Z-Image 1024² kernel classes, compiled, bf16 and FP8
#   summary.txt    the parts' status and each table
#
#   OUT=/tmp/round bash examples/gpu_round.sh
#   PARTS="t s" BUDGET=120 OUT=/tmp/round bash examples/gpu_round.sh   # some parts only
#   TESTS="tests/test_gpu_moe.py" PARTS="t m" OUT=/tmp/round bash examples/gpu_round.sh   # some tests only
#   DRY=1 OUT=/tmp/round bash examples/gpu_round.sh                    # the plan, nothing run
# The speculative GPU test reads the default model's tokenizer from .tok (MINISGL_TEST_TOKENIZER_DIR): copy
# tokenizer.json, tokenizer_config.json and chat_template.jinja of the default model there and carry it.
set -o pipefail
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ -d .tok ] && export MINISGL_TEST_TOKENIZER_DIR=${MINISGL_TEST_TOKENIZER_DIR:-$PWD/.tok}
OUT=${OUT:-/tmp/gpu_round}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/gpu_round.XXXXXX)
PY=${PY:-python3}
BUDGET=${BUDGET:-280}
PARTS=${PARTS:-t s f o p m n g e v}
TESTS=${TESTS:-tests/test_gpu_sampling.py tests/test_gpu_moe.py tests/test_gpu_speculative.py tests/test_gpu_vlm.py \
tests/test_gpu_isolation.py}
. examples/parts.sh

{ echo "gpu_round.sh at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -2
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1 | tail -1
} > "$WORK/machine.txt"
cat "$WORK/machine.txt"

# (t) ~200 s over two workers: Triton compiles, tiny models built with transformers, a few engines (the two Qwen-VL
# tests ~70 s each)
XDIST=$($PY -c 'import xdist' 2>/dev/null && echo "-n 2 --dist loadfile")  # pytest-xdist where installed
# pytest-timeout where installed (the H200 images have it): a test that hangs fails with its traceback and the rest
# run, instead of the part's limit killing pytest before it prints which tests failed
PER_TEST=$($PY -c 'import pytest_timeout' 2>/dev/null && echo "--timeout ${TEST_TIMEOUT:-90}")
want t && part "(t) GPU tests of this round" 240 60 "$OUT/tests.log" \
  $PY -m pytest -q -rfE -p no:cacheprovider $XDIST $PER_TEST $TESTS

# (s) ~25 s, mostly Triton's first compiles
want s && part "(s) sampler micro-benchmark" 60 20 "$OUT/sampling.log" \
  $PY examples/bench_sampling.py --out "$WORK/sampling"

# (f) ~360 s: per KV dtype four engine starts, three timed draws each (raw and LLM in a child, bench offline, the
# server)
want f && part "(f) the fronts against the raw engine" 440 100 "$OUT/fronts.log" \
  $PY examples/fronts_gpu.py --out "$WORK/fronts" --kv bf16,fp8_e4m3

# (o) ~110 s: what chat clients get: the FP8 preset sampled (t=0.7, top_p=0.9), raw against serve + bench --url
want o && part "(o) sampled requests through HTTP" 180 90 "$OUT/sampled_fronts.log" \
  $PY examples/fronts_gpu.py --out "$WORK/sampled_fronts" --kv fp8_e4m3 --paths raw,http --sampled

# (p) ~50 s: Llama-3.1-8B dummy, two batch-1 engines
want p && part "(p) speculative decoding" 100 45 "$OUT/spec.log" \
  $PY examples/spec_bench_gpu.py --out "$WORK/spec"

# (m) ~40 s: the layer table, bf16 and FP8 experts (the engines are (e)'s)
want m && part "(m) fused MoE layer" 150 30 "$OUT/moe.log" \
  $PY examples/moe_bench.py --out "$WORK/moe" --fp8 --no-engine $MOE_ARGS

# (n) ~150 s: two 30B-A3B engines (bf16, FP8), batch-1 decode with each expert path
want n && part "(n) MoE batch-1 decode by expert path" 240 120 "$OUT/moe_decode.log" \
  $PY examples/moe_bench.py --out "$WORK/moe_decode" --fp8 --sizes 1 $MOE_DECODE_ARGS

# (g) ~200 s: Qwen3-0.6B then Llama-3.1-8B, each row greedy and sampled two ways
want g && part "(g) sampled against greedy" 300 120 "$OUT/bench.log" \
  $PY examples/gpu_bench.py --only qwen,llama --main-only --no-hf --also-temperature 1.0 --out "$WORK"

# (e) ~450 s: six engines, one at a time (Llama-8B and Qwen3-30B-A3B bf16 / FP8 w / FP8 w+kv, Mixtral FP8)
want e && part "(e) MoE models beside Llama-8B" 480 200 "$OUT/models.log" \
  $PY examples/gpu_bench.py --only llama,moe,mixtral --fp8 --no-hf --greedy-only --out "$WORK"

# (v) ~150 s: the 7B VLM server's start, 64 chats with distinct images, then 64 with one shared image
want v && part "(v) image chats on Qwen2.5-VL-7B" 240 100 "$OUT/vlm.log" \
  $PY examples/bench_vlm.py gpu --out "$WORK/vlm"

# (w) ~60 s a model, its own child each
want w && part "(w) new families against their bytes" 600 120 "$OUT/families.log" \
  $PY examples/families_gpu.py --out "$WORK" $FAMILY_ARGS

# (z) ~150 s: the 6B DiT built twice, a cold compile each
want z && part "(z) Z-Image kernel profile" 300 150 "$OUT/media_prof.log" \
  $PY examples/media_profile.py --variants compile,compile+fp8 --out "$WORK/media_prof" $MEDIA_PROF_ARGS

{
  cat "$WORK/machine.txt"
  echo; echo "== parts (budget ${BUDGET}s, used $(( $(date +%s) - T0 ))s)"
  printf '%s\n' "${STATUS[@]}"
  echo; echo "== (t) tests"
  grep -E "passed|failed|error" "$OUT/tests.log" 2>/dev/null | tail -3 || echo "(not run)"
  for f in sampling/sampling_bench.txt spec/spec_bench.txt; do
    echo; echo "== $f"; cat "$WORK/$f" 2>/dev/null || echo "(not run)"
  done
  for f in fronts sampled_fronts; do
    echo; echo "== $f"; grep -A14 "^Qwen3-0.6B dummy" "$OUT/$f.log" 2>/dev/null || echo "(not run)"
  done
  echo; echo "== moe layer"; tail -25 "$OUT/moe.log" 2>/dev/null || echo "(not run)"
  echo; echo "== moe decode"; tail -12 "$OUT/moe_decode.log" 2>/dev/null || echo "(not run)"
  for f in bench models; do  # gpu_bench's ratios and dtype table
    echo; echo "== $f"; sed -n '/^==== summary/,$p' "$OUT/$f.log" 2>/dev/null | grep -v "^gemv" | cut -c1-260 \
      || echo "(not run)"
  done
  echo; echo "== vlm"; tail -12 "$OUT/vlm.log" 2>/dev/null || echo "(not run)"
  echo; echo "== families"; sed -n '/^==== families/,$p' "$OUT/families.log" 2>/dev/null || echo "(not run)"
} > "$OUT/summary.txt"
cp "$WORK"/moe_decode/moe_bench.json "$OUT"/moe_decode.json 2>/dev/null
cp "$WORK"/sampling/*.json "$WORK"/moe/*.json "$WORK"/vlm/*.json "$WORK"/families.json "$OUT"/ 2>/dev/null
echo; cat "$OUT/summary.txt"
