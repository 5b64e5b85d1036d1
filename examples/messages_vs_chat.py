"""What a front costs: the same prompt streamed through Anthropic's /v1/messages and OpenAI's /v1/chat/completions
on one `minisgl serve`, alternating, one request at a time: TTFT (first text on the wire) and decode tok/s (output
tokens after the first over the time from the first text to the end), median over the rounds, and their ratio.

    python examples/messages_vs_chat.py                               # starts `minisgl serve --device cpu`
    python examples/messages_vs_chat.py --url http://127.0.0.1:8000   # an already running server

Greedy with a fixed max_tokens, so both fronts run the same tokens; the first round of each is a warm-up (not
counted). Both requests hit the prefix cache alike after it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import httpx

from minisgl_cli.api.http_server import free_port

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def stream(url: str, api: str, max_tokens: int) -> tuple[float, float, int]:
    """One streamed request: (TTFT s, decode tok/s, output tokens)."""
    messages = [{"role": "user", "content": PROMPT}]
    if api == "messages":
        path, body = "/v1/messages", {"model": "default", "max_tokens": max_tokens, "messages": messages}
    else:
        path, body = "/v1/chat/completions", {"model": "default", "max_tokens": max_tokens, "messages": messages,
                                              "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    tokens = 0
    with httpx.stream("POST", url + path, json={**body, "stream": True, "temperature": 0}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            text = (data.get("delta", {}).get("text") if api == "messages"
                    else (data["choices"][0]["delta"].get("content") if data.get("choices") else None))
            if text and first is None:
                first = time.perf_counter()
            if api == "messages" and data["type"] == "message_delta":
                tokens = data["usage"]["output_tokens"]
            if api == "chat" and data.get("usage"):
                tokens = data["usage"]["completion_tokens"]
    end = time.perf_counter()
    assert first is not None, f"{api}: no text came back"
    return first - t0, (tokens - 1) / (end - first), tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (else one is started on the CPU)")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--serve-args", default="--device cpu --max-total-tokens 8192")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", "serve", *args.serve_args.split(),
                                 "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while True:
            assert proc.poll() is None, "serve exited while starting"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    try:
        got: dict[str, list[tuple[float, float, int]]] = {"chat": [], "messages": []}
        for i in range(args.rounds + 1):
            for api in ("chat", "messages") if i % 2 else ("messages", "chat"):  # alternate who goes first
                figures = stream(url, api, args.max_tokens)
                if i:  # round 0 warms up
                    got[api].append(figures)
        med = {api: (statistics.median(f[0] for f in v), statistics.median(f[1] for f in v), v[0][2])
               for api, v in got.items()}
        for api, (ttft, tok_s, n) in med.items():
            print(f"{api:9s} TTFT {ttft * 1000:7.1f} ms   decode {tok_s:6.1f} tok/s   ({n} tokens, median of "
                  f"{args.rounds})")
        (ct, cs, _), (mt, ms, _) = med["chat"], med["messages"]
        print(f"messages / chat: TTFT x{mt / ct:.3f}, tok/s x{ms / cs:.3f}")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
