#!/usr/bin/env bash
# Same-run A/B on one GPU: examples/gpu_bench.py (default variant, no HF baselines) on an older tree and on
# this one, alternating, then a table of both. Two machines of one kind differ: compare only inside a run.
#
#   git archive OLD_REV | tar -x -C /tmp/old      # where git is at hand
#   OLD=/tmp/old OUT=/tmp/ab [ONLY=qwen,llama] [ROUNDS=1] [ARGS="--quantization fp8"] bash examples/gpu_ab.sh
# ARGS: more gpu_bench.py flags for both sides (e.g. the dtypes: --kv-cache-dtype fp8_e4m3 --quantization fp8).
set -o pipefail
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_ab}; mkdir -p "$OUT"
OLD=$(cd "${OLD:?set OLD to the older tree}" && pwd)  # absolute: each side runs from its own tree
ONLY=${ONLY:-qwen,llama}
ROUNDS=${ROUNDS:-1}
ARGS=${ARGS:-}
NEW=$(pwd)
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee "$OUT/gpu.txt"
for r in $(seq 1 "$ROUNDS"); do
  for side in old new; do
    dir=$OLD; [ "$side" = new ] && dir=$NEW
    mkdir -p "$OUT/$side$r"
    (cd "$dir" && PYTHONPATH="$dir:${PYTHONPATH:-}" timeout ${BENCH_TIMEOUT:-400} python3 examples/gpu_bench.py \
      --main-only --no-hf --only "$ONLY" $ARGS --out "$OUT/$side$r") > "$OUT/$side$r/log.txt" 2>&1 \
      || echo "$side round $r failed: see $OUT/$side$r/log.txt"
  done
done
python3 - "$OUT" "$ROUNDS" <<'EOF'
import json, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def rows(side):
    got = {}
    for r in range(1, rounds + 1):
        try:
            for x in json.load(open(f"{out}/{side}{r}/gpu_bench.json")):
                if "tok_s" in x:
                    got.setdefault((x["model"], x["workload"]), []).append(x["tok_s"])
        except (OSError, ValueError):
            pass
    return got
old, new = rows("old"), rows("new")
print(f"{'model':<14} {'workload':<18} {'old tok/s':>12} {'new tok/s':>12} {'new/old':>8}")
for key in sorted(set(old) | set(new)):
    o, n = old.get(key, []), new.get(key, [])
    mo, mn = (max(o) if o else None), (max(n) if n else None)
    ratio = f"{mn / mo:.3f}" if mo and mn else "-"
    print(f"{key[0]:<14} {key[1]:<18} {mo or '-':>12} {mn or '-':>12} {ratio:>8}")
EOF
