"""One table from several `minisgl bench --output-json` files: each one's last (warm) result, and its output
throughput over the first row's. The benchmark shell scripts print their summary with it.

    python examples/bench_table.py OUT_DIR offline:"offline (in-process)" http-processes:"HTTP, processes"
"""

from __future__ import annotations

import json
import sys


def last(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)["results"][-1]
    except (OSError, ValueError, IndexError, KeyError):
        return None


def main(out: str, rows: list[str]) -> None:
    named = [row.split(":", 1) for row in rows]
    results = [(label, last(f"{out}/{name}.json")) for name, label in named]
    base = results[0][1]
    width = max(len(label) for label, _ in results) + 2
    print(f"{'run':<{width}} {'out tok/s':>10} {'vs ' + named[0][0]:>12} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12} "
          f"{'ITL p50 ms':>11} {'failed':>7}")
    for label, r in results:
        if r is None:
            print(f"{label:<{width}} failed: see {out}")
            continue
        ratio = r["output_throughput"] / base["output_throughput"] if base else float("nan")
        print(f"{label:<{width}} {r['output_throughput']:>10.0f} {ratio:>12.3f} {r['median_ttft_ms']:>12.1f} "
              f"{r['median_tpot_ms']:>12.2f} {r['median_itl_ms']:>11.2f} {r['failed']:>7}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
