#!/usr/bin/env bash
# Issue 35's run on a two-GPU machine, in order of value, within BUDGET seconds (default 400): each part under
# `timeout` (its whole process group), a part that fails or runs out is logged and the next one runs, and a
# summary table ends it. Files under $OUT (a part not run writes none):
#   summary.txt    the table printed at the end (also on stdout)
#   allreduce.log  (a) examples/allreduce_bench.py: NCCL vs one-shot all-reduce, 4 KB-4 MB, eager and in a graph
#   pytest.log     (b) tests/test_gpu_tp.py: one-shot == NCCL bit for bit; TP 2 greedy tokens vs TP 1
#   tp.log         (c) examples/tp_decode.py: Llama-3.1-8B dummy weights, batch-1 decode and greedy tokens at
#                      --tp 1, --tp 2 (--all-reduce auto: the fused all-reduce + RMSNorm), --all-reduce lamport
#                      (the fused kernel flagless), one-shot and nccl; FP8 weights at --tp 1, --tp 2 (auto, lamport);
#                      TP_CONFIGS naming tp2-again / tp2-lamport-again runs that configuration a second time, and
#                      the report says whether its greedy tokens repeated
#   dp.log         (d) examples/dp_scaling.sh, shortened: Qwen3-0.6B --dp 2 vs --dp 1 through HTTP, and the router
#   results.json   the rows of (a), (c) and (d)
#   prof.log       (e) where a batch-1 step's time goes at --tp 1 and --tp 2: each rank's StepProfiler table (wall vs
#                      device-busy ms per step, kernels by device time; scheduler/profile.py)
#                  (g) the same at the nano-vllm preset, --tp 1 and --tp 2 (its throughput in the summary)
#   fronts.log     (f) examples/fronts_cpu.py: Qwen3-0.6B --dp 1 vs --dp 2 through HTTP with each server process's
#                      CPU share (API, detokenizers, ranks) and the client's: what holds --dp 2
#   media.log      (h) examples/media_parallel_gpu.py: one Wan2.1-1.3B video on one GPU and split over two
#                      (MEDIA_VARIANTS, default one,cfg,ulysses; MEDIA_STEPS steps timed, default 5)
#   families.log   (i) tests/test_gpu_tp_families.py: the new families at TP 2 = transformers (FAMILIES, default all
#                      four; FAMILY_TIMEOUT seconds each, default 170)
#
#   OUT=/tmp/two_gpu bash examples/two_gpu.sh
#   PARTS="c g" TP_CONFIGS="tp1 tp2 tp1-fp8 tp2-fp8" PRESET_QUANTS="none fp8" BUDGET=560 bash examples/two_gpu.sh  # TP table
#   PARTS="a c" BUDGET=200 OUT=/tmp/two_gpu bash examples/two_gpu.sh   # some parts only
#   DRY=1 OUT=/tmp/two_gpu bash examples/two_gpu.sh                    # the plan, nothing run
#   PARTS="a b c" TP_MODEL=smollm2-135m TP_ARGS="--output-len 8 --input-len 32 --num-prompts 2 --max-total-tokens 4096" \
#     OUT=/tmp/two_gpu bash examples/two_gpu.sh                         # the flow on a CPU machine (a fails, b skips)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=${PYTHONPATH:-.} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/two_gpu}; mkdir -p "$OUT"
WORK=$(mktemp -d /tmp/two_gpu.XXXXXX)  # everything else: only the files above go to $OUT
PY=${PY:-python3}
BUDGET=${BUDGET:-400}
PARTS=${PARTS:-a b c d e f g}
# (c)'s configurations by tag (TP_CONFIGS="tp1 tp2" for some): tp, --all-reduce, tag, --quantization
TP_ALL=("1 auto tp1 none" "2 auto tp2 none" "2 one-shot tp2-oneshot none" "2 nccl tp2-nccl none" "1 auto tp1-fp8 fp8"
        "2 auto tp2-fp8 fp8" "2 lamport tp2-lamport none" "2 lamport tp2-fp8-lamport fp8"
        "2 auto tp2-again none" "2 lamport tp2-lamport-again none")  # the -again runs: does a TP 2 run repeat itself?
TP_MODEL=${TP_MODEL:-llama-3.1-8b}
read -r -a TP_ARGS <<< "${TP_ARGS:-}"
. examples/parts.sh

{ echo "two_gpu.sh at $(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo ?)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -4
  $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__,
"gpus", torch.cuda.device_count())' 2>&1 | tail -1
  nvidia-smi topo -m 2>&1 | head -4; } > "$WORK/machine.txt"
cat "$WORK/machine.txt"

# (a) the all-reduce micro-benchmark: ~40 s (two ranks start, NCCL and symmetric memory set up, 11 sizes)
want a && part "(a) all-reduce micro-benchmark" 90 30 "$OUT/allreduce.log" \
  $PY examples/allreduce_bench.py --json "$WORK/allreduce.json"

# (b) the two-GPU tests: ~90 s (the sums test ~25 s; Qwen3-0.6B at --tp 1 and --tp 2, one start each)
want b && part "(b) pytest tests/test_gpu_tp.py" 170 60 "$OUT/pytest.log" \
  $PY -m pytest -q -p no:cacheprovider tests/test_gpu_tp.py

# (c) Llama-3.1-8B batch-1 decode and greedy tokens: ~40-60 s per configuration (start, 4x32 greedy tokens,
# warm-up, 3 x 256 tokens at batch 1)
if want c; then
  for cfg in "${TP_ALL[@]}"; do
    read -r tp ar tag quant <<< "$cfg"
    [ -n "$TP_CONFIGS" ] && [[ " $TP_CONFIGS " != *" $tag "* ]] && continue
    part "(c) $TP_MODEL --tp $tp --all-reduce $ar --quantization $quant" 120 45 "$OUT/tp.log" \
      $PY examples/tp_decode.py --model "$TP_MODEL" --tp "$tp" --all-reduce "$ar" --quantization "$quant" \
        "${TP_ARGS[@]}" --json "$WORK/$tag.json"
  done
  # Against TP 1; the fused kernel and the one-shot against NCCL at TP 2 (the same sums: the same tokens); FP8.
  # Reports over the runs that wrote their JSON (a part that failed or was left out drops from its table).
  report() { local f=(); for t in "$@"; do [ -f "$WORK/$t.json" ] && f+=("$WORK/$t.json"); done
             [ "${#f[@]}" -gt 1 ] && { $PY examples/tp_decode.py --report "${f[@]}"; echo; }; }
  [ -z "$DRY" ] && { report tp1 tp2 tp2-lamport tp2-oneshot tp2-nccl; report tp2-nccl tp2 tp2-lamport tp2-oneshot
    report tp1-fp8 tp2-fp8 tp2-fp8-lamport; report tp2 tp2-again; report tp2-lamport tp2-lamport-again
    } > "$WORK/tp_table.txt" 2>&1
  cat "$WORK/tp_table.txt" >> "$OUT/tp.log" 2>/dev/null
fi

# (d) data parallelism through HTTP, shortened (128 requests of the nano-vllm preset, graphs up to 128):
# ~40 s per configuration; whatever finishes is in the table
if want d; then
  part "(d) Qwen3-0.6B --dp 2 vs --dp 1 and the router (HTTP)" 400 90 "$OUT/dp.log" \
    env OUT="$WORK/dp" NUM_PROMPTS=128 GRAPH_BS=128 PY="$PY" bash examples/dp_scaling.sh
  for f in "$WORK"/dp/*.log; do [ -f "$f" ] && { echo "---- $(basename "$f") (last 15 lines)"; tail -15 "$f"; }; done \
    >> "$OUT/dp.log" 2>/dev/null
  [ -z "$DRY" ] && $PY examples/bench_table.py "$WORK/dp" dp1:"serve --dp 1" dp2:"serve --dp 2" \
    router-p1:"router (1 process) over 2 x serve --dp 1" router-p4:"router (4 processes) over 2 x serve --dp 1" \
    > "$WORK/dp_table.txt" 2>&1
fi

# (e) a profile of 50 batch-1 steps on every rank (after 400 busy steps: inside the timed requests), --tp 1 and
# --tp 2: is a TP-2 step waiting for the host or for kernels, and which? ~60 s per configuration
if want e; then
  for tp in ${PROF_TPS:-1 2}; do
    part "(e) $TP_MODEL --tp $tp profiled" 120 45 "$OUT/prof.log" \
      env MINISGL_TORCH_PROFILER_DIR="$WORK/prof-tp$tp" MINISGL_PROFILE_SKIP=${PROF_SKIP:-400} MINISGL_PROFILE_STEPS=${PROF_STEPS:-50} \
      $PY examples/tp_decode.py --model "$TP_MODEL" --tp "$tp" "${TP_ARGS[@]}"
    for f in "$WORK/prof-tp$tp"/*-steps.txt; do [ -f "$f" ] && { echo "---- --tp $tp $(basename "$f")"; cat "$f"; }; done \
      >> "$OUT/prof.log" 2>/dev/null
  done
fi

# (f) --dp 1 vs --dp 2 through HTTP with every process's CPU share (fronts_cpu.py; four client processes so the
# client is not the limit): ~70 s per configuration
want f && part "(f) Qwen3-0.6B --dp 1 vs --dp 2, CPU per process" 300 120 "$OUT/fronts.log" \
  $PY examples/fronts_cpu.py --out "$WORK/fronts" --variant "dp1=--dp 1|--client-procs 4" \
    --variant "dp2=--dp 2|--client-procs 4" ${FRONTS_ARGS:-}

# (g) the nano-vllm preset (256 requests in flight) at --tp 1 and --tp 2, each rank profiled for 20 busy steps after
# 300: throughput, and whether a TP-2 step waits for the host or the kernels. ~60-90 s per configuration
# PRESET_QUANTS="none fp8" adds the FP8 weights' rows (the TP table's preset half).
if want g; then
  for quant in ${PRESET_QUANTS:-none}; do
    for tp in 1 2; do
      addr=(); [ "$tp" -gt 1 ] && addr=(--dist-init-addr "127.0.0.1:$((29700 + tp))")
      part "(g) $TP_MODEL --tp $tp --quantization $quant, the nano-vllm preset" 180 60 "$OUT/tp.log" \
        env MINISGL_TORCH_PROFILER_DIR="$WORK/preset-prof-tp$tp-$quant" MINISGL_PROFILE_SKIP=300 MINISGL_PROFILE_STEPS=20 \
        $PY -m minisgl_cli.app bench --model "$TP_MODEL" --load-format dummy --max-running-requests 256 \
          --max-total-tokens 300000 --tp "$tp" "${addr[@]}" --quantization "$quant" --runtime processes \
          --preset nano-vllm --num-prompts 256 --concurrency 256 --no-baseline --output-json "$WORK/preset-tp$tp-$quant.json"
      for f in "$WORK/preset-prof-tp$tp-$quant"/*-steps.txt; do
        [ -f "$f" ] && { echo "---- preset --tp $tp --quantization $quant $(basename "$f")"; cat "$f"; }
      done >> "$OUT/prof.log" 2>/dev/null
    done
  done
  [ -z "$DRY" ] && $PY - "$WORK" ${PRESET_QUANTS:-none} > "$WORK/preset_table.txt" 2>&1 <<'EOF'
import json, sys
for quant in sys.argv[2:]:
    rows = {}
    for tp in (1, 2):
        try:
            rows[tp] = json.load(open(f"{sys.argv[1]}/preset-tp{tp}-{quant}.json"))["results"][-1]["output_throughput"]
        except (OSError, ValueError, KeyError, IndexError):
            rows[tp] = None
    for tp, v in rows.items():
        ratio = f"{v / rows[1]:.2f}x" if v and rows[1] else "-"
        print(f"--tp {tp} --quantization {quant}: {v or 0:,.0f} out tok/s  {ratio}")
EOF
fi

# (h) one video over two GPUs against one: each variant in a process of its own (build ~30 s, a warm-up call, one
# timed call of MEDIA_STEPS steps extrapolated to 50): ~60-90 s a variant
want h && part "(h) Wan2.1-1.3B over two GPUs (${MEDIA_VARIANTS:-one,cfg,ulysses})" 400 90 "$OUT/media.log" \
  $PY examples/media_parallel_gpu.py --variants "${MEDIA_VARIANTS:-one,cfg,ulysses}" --steps "${MEDIA_STEPS:-5}" \
    --variant-timeout 200 --out "$WORK/media"

# (i) the new families at TP 2 = transformers fp32, one pytest run a family (each starts two ranks and compiles its
# fp32 Triton kernels: 60-150 s)
if want i; then
  for fam in ${FAMILIES:-qwen3_5 gpt_oss gemma3 deepseek_v3}; do
    part "(i) TP 2 = transformers: $fam" "${FAMILY_TIMEOUT:-170}" 60 "$OUT/families.log" \
      $PY -m pytest -q -p no:cacheprovider "tests/test_gpu_tp_families.py::test_new_families_at_tp_2_answer_as_transformers[$fam]"
  done
fi

# The summary, and the rows in one JSON.
{
  cat "$WORK/machine.txt"
  echo; echo "== parts (budget ${BUDGET}s, used $(( $(date +%s) - T0 ))s)"
  printf '%s\n' "${STATUS[@]}"
  echo; echo "== (a) all-reduce, µs per call"
  grep -E "^ *(size|[0-9]+ [KM]B) " "$OUT/allreduce.log" 2>/dev/null || echo "(no table: see allreduce.log)"
  echo; echo "== (b) tests"
  grep -E "passed|failed|error|skipped" "$OUT/pytest.log" 2>/dev/null | tail -3 || echo "(not run)"
  echo; echo "== (c) $TP_MODEL bf16 dummy weights, batch 1"
  cat "$WORK/tp_table.txt" 2>/dev/null || echo "(not run)"
  echo; echo "== (d) Qwen3-0.6B through HTTP, nano-vllm preset x 128 (second draw)"
  cat "$WORK/dp_table.txt" 2>/dev/null || echo "(not run)"
  echo; echo "== (e) wall vs device-busy per step"
  grep -E "^---- |busy steps after" "$OUT/prof.log" 2>/dev/null || echo "(not run)"  # parts e and g
  echo; echo "== (g) $TP_MODEL, the nano-vllm preset"
  cat "$WORK/preset_table.txt" 2>/dev/null || echo "(not run)"
  echo; echo "== (h) one video over two GPUs"
  sed -n '/^Wan /,$p' "$OUT/media.log" 2>/dev/null | head -7 || echo "(not run)"
  echo; echo "== (i) the new families at TP 2"
  grep -E "^== \(i\)|passed|failed|Error" "$OUT/families.log" 2>/dev/null | tail -12 || echo "(not run)"
  echo; echo "== (f) CPU per process through HTTP"
  sed -n '/^ *dp1 /,$p' "$OUT/fronts.log" 2>/dev/null | head -20 || echo "(not run)"
} > "$OUT/summary.txt"
$PY - "$WORK" "$OUT/results.json" <<'EOF'
import glob, json, os, sys
work, out = sys.argv[1:]
def read(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
tp = {os.path.basename(p)[:-5]: read(p) for p in sorted(glob.glob(f"{work}/tp*.json"))}
dp = {}
for p in sorted(glob.glob(f"{work}/dp/*.json")):
    r = read(p)
    dp[os.path.basename(p)[:-5]] = r["results"] if r and "results" in r else None
json.dump({"allreduce": read(f"{work}/allreduce.json"), "tp": tp, "dp": dp}, open(out, "w"), indent=1)
EOF
echo; cat "$OUT/summary.txt"
