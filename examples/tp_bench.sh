#!/usr/bin/env bash
# Tensor parallelism, one run: --tp 1 vs --tp N on the same model (dummy weights) — greedy tokens compared on a
# fixed prompt set, batch-1 decode (TPOT), and the nano-vllm preset. Logs under $OUT, a table at the end.
#
#   OUT=/tmp/tp bash examples/tp_bench.sh                       # 2 GPUs: Llama-3.1-8B, --tp 2 vs --tp 1
#   MODEL=smollm2-135m DEVICE=cpu MAX_TOTAL_TOKENS=4096 OUTPUT_LEN=16 SKIP_PRESET=1 bash examples/tp_bench.sh  # CPU
set -o pipefail
export PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 NCCL_NVLS_ENABLE=0
OUT=${OUT:-/tmp/tp_bench}; mkdir -p "$OUT"
MODEL=${MODEL:-llama-3.1-8b}
TP=${TP:-2}
NUM_PROMPTS=${NUM_PROMPTS:-256}
OUTPUT_LEN=${OUTPUT_LEN:-512}
PY=${PY:-python3}
ENGINE=(--model "$MODEL" --load-format dummy --max-running-requests 256 --max-total-tokens "${MAX_TOTAL_TOKENS:-300000}")
[ -n "$DEVICE" ] && ENGINE+=(--device "$DEVICE")

for tp in 1 "$TP"; do
  addr=()  # where the ranks meet: --tp 1 has one rank (and refuses the flag)
  [ "$tp" -gt 1 ] && addr=(--dist-init-addr "127.0.0.1:$((29600 + tp))")
  echo "== --tp $tp: greedy tokens"
  # A file, not stdin: multiprocessing's spawn re-runs the parent's __main__ file in each child.
  cat > "$OUT/tokens.py" <<'EOF'
import asyncio, json, random, sys
from commands.common import EngineOptions
from minisgl_cli.client import complete
from minisgl_cli.types import GenerateRequest, SamplingParams

def main() -> None:
    tp, out, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    opts = dict(zip((a.lstrip("-").replace("-", "_") for a in args[::2]), args[1::2]))
    opts["max_running_requests"], opts["max_total_tokens"] = int(opts["max_running_requests"]), int(opts["max_total_tokens"])
    client = EngineOptions.from_params({**opts, "tp_size": tp}, processes=True).client()
    rnd = random.Random(0)
    prompts = [[rnd.randrange(10000) for _ in range(n)] for n in (17, 100, 250, 600)]

    async def run():
        reqs = [GenerateRequest(input_ids=p, params=SamplingParams(max_new_tokens=32, ignore_eos=True)) for p in prompts]
        return [c.token_ids for c in await asyncio.gather(*(complete(client, r) for r in reqs))]

    try:
        json.dump(asyncio.run(run()), open(out, "w"))
        print(f"tp {tp}: tokens written")
    finally:
        client.close()


if __name__ == "__main__":  # spawn re-imports this file in every child process
    main()
EOF
  $PY "$OUT/tokens.py" "$tp" "$OUT/tokens-tp$tp.json" "${ENGINE[@]}" "${addr[@]}" 2>&1 | tail -2
  echo "== --tp $tp: batch-1 decode"
  $PY -m minisgl_cli.app bench "${ENGINE[@]}" "${addr[@]}" --tp "$tp" --runtime processes --dataset random \
    --num-prompts 4 --input-len 128 --output-len "$OUTPUT_LEN" --range-ratio 1 --concurrency 1 --no-baseline \
    --output-json "$OUT/b1-tp$tp.json" > "$OUT/b1-tp$tp.txt" 2>&1 || echo "failed: $OUT/b1-tp$tp.txt"
  [ -n "$SKIP_PRESET" ] && continue
  echo "== --tp $tp: nano-vllm preset"
  $PY -m minisgl_cli.app bench "${ENGINE[@]}" "${addr[@]}" --tp "$tp" --runtime processes --preset nano-vllm \
    --num-prompts "$NUM_PROMPTS" --concurrency 256 --concurrency 256 --no-baseline \
    --output-json "$OUT/preset-tp$tp.json" > "$OUT/preset-tp$tp.txt" 2>&1 || echo "failed: $OUT/preset-tp$tp.txt"
done

$PY - "$OUT" "$TP" <<'EOF'
import json, sys
out, tp = sys.argv[1], sys.argv[2]
def last(name):
    try:
        return json.load(open(f"{out}/{name}.json"))["results"][-1]
    except (OSError, ValueError, IndexError, KeyError):
        return None
try:
    a, b = (json.load(open(f"{out}/tokens-tp{t}.json")) for t in ("1", tp))
    same = sum(x == y for x, y in zip(a, b))
    print(f"greedy tokens, --tp {tp} vs --tp 1: {same}/{len(a)} prompts identical")
except (OSError, ValueError) as exc:
    print(f"greedy tokens: not compared ({exc})")
print(f"{'':<10} {'batch-1 tok/s (1/TPOT)':>24} {'preset out tok/s':>18}")
rows = {}
for t in ("1", tp):
    b1, pre = last(f"b1-tp{t}"), last(f"preset-tp{t}")
    rows[t] = (1000 / b1["median_tpot_ms"] if b1 and b1["median_tpot_ms"] else None, pre["output_throughput"] if pre else None)
    fmt = lambda v: f"{v:.1f}" if v else "-"
    print(f"--tp {t:<5} {fmt(rows[t][0]):>24} {fmt(rows[t][1]):>18}")
if all(rows["1"]) and all(rows[tp]):
    print(f"--tp {tp} / --tp 1: batch-1 {rows[tp][0] / rows['1'][0]:.2f}x, preset {rows[tp][1] / rows['1'][1]:.2f}x")
EOF
