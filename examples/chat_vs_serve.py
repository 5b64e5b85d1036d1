"""`minisgl chat` against `minisgl serve` at one stream: the same prompts, greedy, the decode rate each reports.

    python examples/chat_vs_serve.py [--rounds 2] [--max-new-tokens 128] [--model ...] [--out DIR]

Each round runs `minisgl chat` piped (each prompt a line; its stats lines on stderr give `decode N tok/s`), then
starts `minisgl serve`, sends the same prompts one at a time to `/generate` as chat messages (the same template,
greedy, the same token budget) and reads each reply's `decode_tok_s` (RequestStats.decode_tok_s, the figure chat's
stats line prints), then stops it. Both decode through the stored compiled CPU step (built first if missing: the
first serve waits for it). Prints each reply's rate and the medians; logs under --out.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
           "Describe a walk through a forest in autumn.", "Tell me about the history of tea."]
PORT = 8193


def run_chat(minisgl: str, args: argparse.Namespace, log: Path) -> list[float]:
    """Decode tok/s of each reply, from chat's stats lines."""
    proc = subprocess.run([minisgl, "chat", "-n", str(args.max_new_tokens), *args.model_args],
                          input="\n".join(PROMPTS) + "\n", capture_output=True, text=True, timeout=900)
    log.write_text(proc.stderr)
    rates = [float(m) for m in re.findall(r"decode ([0-9.]+) tok/s", proc.stderr)]
    if proc.returncode or len(rates) != len(PROMPTS):
        sys.exit(f"chat failed (exit {proc.returncode}); see {log}")
    return rates


def run_serve(minisgl: str, args: argparse.Namespace, log: Path) -> list[float]:
    """Decode tok/s of each reply, from /generate's final line, once the server decodes through its compiled step."""
    with open(log, "w") as out:
        server = subprocess.Popen([minisgl, "serve", "--port", str(PORT), *args.model_args], stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:  # healthy, and the compiled step in use (not building)
            try:
                if httpx.get(f"{url}/metrics", timeout=5).json()["scheduler"]["decode_step"] == "compiled":
                    break
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            if server.poll() is not None:
                sys.exit(f"serve exited; see {log}")
            time.sleep(1)
        rates = []
        for prompt in PROMPTS:
            r = httpx.post(f"{url}/generate", json={"messages": [{"role": "user", "content": prompt}],
                                                    "max_new_tokens": args.max_new_tokens, "temperature": 0,
                                                    "stream": False}, timeout=300)
            r.raise_for_status()
            rates.append(float(r.json()["decode_tok_s"]))
        return rates
    finally:
        server.terminate()
        server.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--model", default=None, help="--model for both (default: theirs)")
    ap.add_argument("--out", default="/tmp/chat_vs_serve")
    args = ap.parse_args()
    args.model_args = ["--model", args.model] if args.model else []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    minisgl = str(Path(sys.executable).with_name("minisgl"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    seen: dict[str, list[float]] = {"chat": [], "serve": []}
    for i in range(args.rounds):
        for name, fn in (("serve", run_serve), ("chat", run_chat)):  # serve first: it builds a missing step
            rates = fn(minisgl, args, out / f"{name}-{i}.log")
            seen[name] += rates
            print(f"round {i + 1} {name:5s} decode tok/s: {', '.join(f'{r:.1f}' for r in rates)}", flush=True)
    chat, serve = statistics.median(seen["chat"]), statistics.median(seen["serve"])
    print(f"median decode tok/s: chat {chat:.1f}, serve {serve:.1f}; chat / serve {chat / serve:.2f}")


if __name__ == "__main__":
    main()
