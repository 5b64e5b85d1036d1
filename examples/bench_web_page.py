"""Does the web page cost throughput? The same HTTP workload with the page at / open in headless Chromium and
with no page, alternating in one run on ONE engine and server; prints each round and the ratio.

    python examples/bench_web_page.py                                  # 32 prompts x 48 tokens, 3 rounds
    python examples/bench_web_page.py --rounds 5 --interval 0.2        # the page refreshing 5 times a second
    python examples/bench_web_page.py --screenshot docs/web_page.png   # also a picture of the page under load

The page is what a user opens: the chat pane idle, the live pane polling /metrics/live (one stats query and
one small JSON reply per interval). The browser runs on the same machine as the server, so its own CPU use counts
too (the worst case: usually the browser is on another machine). Rounds alternate which phase goes first.
Needs Debian's `chromium` and `pip install playwright` (no browser download).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
from bench_online import make_prompts, online  # the same streaming client as examples/bench_online.py

# The load runs on its own thread: Playwright's sync API holds an event loop on the main one.
_load = ThreadPoolExecutor(1)


def start_load(url: str, prompts: list[str], max_tokens: int, concurrency: int) -> Future:
    """online() on the load thread: its future gives (completion tokens, seconds)."""
    return _load.submit(online, url, prompts, max_tokens, concurrency)


def browser_cpu_s() -> float:
    """CPU seconds used so far by the Chromium processes under this one (0 without psutil)."""
    try:
        import psutil
    except ImportError:
        return 0.0
    total = 0.0
    for proc in psutil.Process().children(recursive=True):
        try:
            if "chrom" in proc.name():
                t = proc.cpu_times()
                total += t.user + t.system
        except psutil.Error:  # a helper process that just exited
            pass
    return total


def poll_cost_ms(url: str, n: int = 200) -> float:
    """Round trip of one GET /metrics/live (what the page asks once per interval), idle engine, in ms."""
    with httpx.Client() as http:
        http.get(f"{url}/metrics/live").raise_for_status()
        t0 = time.perf_counter()
        for _ in range(n):
            http.get(f"{url}/metrics/live")
        return (time.perf_counter() - t0) * 1000 / n


def open_page(browser, url: str, interval: float):
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    page.goto(f"{url}/?interval={interval}")
    page.wait_for_function("() => document.getElementById('conn').textContent === 'live'")
    page.wait_for_function("() => document.getElementById('m-running').textContent !== '–'")
    return page


def screenshot(browser, url: str, prompts: list[str], max_tokens: int, concurrency: int, path: str) -> None:
    """The page mid-load: one chat answered, then the workload running behind it (taken once the first
    `concurrency` requests have finished, while the next ones run)."""
    page = open_page(browser, url, 1.0)
    page.fill("#prompt", "What is the capital of France?")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant[data-finish]", timeout=120_000)
    done = int(page.inner_text("#m-finished").replace(",", ""))
    load = start_load(url, prompts, max_tokens, concurrency)
    page.wait_for_function(
        "() => { const n = (id) => Number(document.getElementById(id).textContent.replace(/,/g, ''));"
        f" return n('m-finished') >= {done + concurrency} && n('m-running') > 0; }}", timeout=600_000)
    page.screenshot(path=path)
    load.result()
    page.close()
    print(f"screenshot -> {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="Model (default: the bundled SmolLM2-135M-Instruct).")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3, help="Each round runs the workload once closed, once open.")
    ap.add_argument("--interval", type=float, default=1.0, help="The page's refresh interval in s (its default 1).")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    ap.add_argument("--screenshot", default=None, help="Also save a PNG of the page under load here.")
    args = ap.parse_args()

    from playwright.sync_api import sync_playwright

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.llm import LLM
    from minisgl_cli.server.app import create_app

    prompts = make_prompts(args.num_prompts)
    rates: dict[str, list[float]] = {"closed": [], "open": []}
    page_cpu, page_wall = 0.0, 0.0
    llm = LLM(args.model, max_running_requests=args.concurrency, cache="naive")
    try:
        with BackgroundServer(create_app(llm.client)) as url, sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=args.chromium)
            start_load(url, prompts[: args.concurrency], 4, args.concurrency).result()  # warm-up
            for r in range(args.rounds):
                for phase in ("closed", "open") if r % 2 == 0 else ("open", "closed"):
                    page = open_page(browser, url, args.interval) if phase == "open" else None
                    cpu0 = browser_cpu_s()
                    tokens, secs = start_load(url, prompts, args.max_tokens, args.concurrency).result()
                    if page is not None:
                        page_cpu, page_wall = page_cpu + browser_cpu_s() - cpu0, page_wall + secs
                        shown = int(page.inner_text("#m-finished").replace(",", ""))
                        page.close()
                        assert shown > 0, "the page did not follow the engine"
                    rates[phase].append(tokens / secs)
                    print(f"round {r + 1} page {phase:6s} {tokens} tokens in {secs:6.2f}s = {tokens / secs:6.1f} tok/s",
                          flush=True)
            if args.screenshot:
                screenshot(browser, url, prompts, args.max_tokens, args.concurrency, args.screenshot)
            browser.close()
            cost = poll_cost_ms(url)
    finally:
        llm.close()
    info = llm.client.info
    if not args.rounds:
        return
    closed, opened = statistics.mean(rates["closed"]), statistics.mean(rates["open"])
    print(f"model   {info.name} on {info.device}, {args.num_prompts} prompts x {args.max_tokens} tokens, "
          f"concurrency {args.concurrency}, page interval {args.interval:g}s, {args.rounds} rounds")
    print(f"closed  mean {closed:.1f} tok/s (min {min(rates['closed']):.1f}, max {max(rates['closed']):.1f})")
    print(f"open    mean {opened:.1f} tok/s (min {min(rates['open']):.1f}, max {max(rates['open']):.1f})")
    print(f"ratio   open/closed = {opened / closed:.1%}")
    print(f"browser {page_cpu:.2f} CPU s over {page_wall:.1f} s with the page open "
          f"({page_cpu / page_wall:.1%} of one core)")
    print(f"server  {cost:.2f} ms per GET /metrics/live, round trip (one per {args.interval:g} s per open page)")


if __name__ == "__main__":
    main()
