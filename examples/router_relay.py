"""How many SSE frames a second `minisgl router` relays, with --processes 1 and N, in one run (no model, no GPU).

Two stand-in workers (raw asyncio, a process each) answer every POST with a stream of --frames frames: like an
engine's decode step, a ticker writes one frame to every open stream every --tick seconds. A raw asyncio client
(one process) keeps --concurrency streams open through the router, each request after the last on its kept
connection, and counts the frames that come back in a --seconds window after a --warmup. The router is the only
Python that parses HTTP on the way, so its frames/s, and the CPU its processes use, are what the table compares.

    python examples/router_relay.py                                # --processes 1 and 2
    python examples/router_relay.py --processes 1 2 4 --concurrency 512 --tick 0.01

On a machine with few cores the workers and the client share them with the router: the ratio is a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from minisgl_cli.api.http_server import free_port
from minisgl_cli.runtime.cpu import cpu_seconds

FRAME = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
         b'"text":" token","logprobs":null,"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# --- the stand-in worker ----------------------------------------------------------------------------
async def worker(port: int, frames: int, tick: float) -> None:
    streams: dict[asyncio.StreamWriter, list] = {}  # writer -> [frames left, the future its handler waits on]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick)
            for w, state in list(streams.items()):
                if w.is_closing():  # the router left (stopped)
                    del streams[w]
                    continue
                state[0] -= 1
                if state[0] > 0:
                    w.write(chunk(FRAME))
                else:
                    w.write(chunk(DONE) + b"0\r\n\r\n")
                    del streams[w]
                    state[1].set_result(None)

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                line, *fields = head.decode("latin-1").split("\r\n")
                length = next((int(f.split(":", 1)[1]) for f in fields if f.lower().startswith("content-length:")),
                              0)
                await r.readexactly(length)
                if line.startswith("POST"):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    done = asyncio.get_running_loop().create_future()
                    streams[w] = [frames, done]
                    await done
                else:  # /health, /metrics
                    body = b'{"status": "ok", "scheduler": null}'
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                            % (len(body), body))
        except (asyncio.IncompleteReadError, ConnectionError):
            streams.pop(w, None)
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, backlog=4096)
    asyncio.get_running_loop().create_task(ticker())
    async with server:
        await server.serve_forever()


# --- the client ---------------------------------------------------------------------------------------
async def client(port: int, concurrency: int, warmup: float, seconds: float) -> dict:
    counted = {"frames": 0, "requests": 0, "errors": 0}
    window = {"on": False}
    body = b'{"model": "m", "prompt": "hi", "stream": true}'
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while True:
            w.write(request)
            head = await r.readuntil(b"\r\n\r\n")
            if not head.startswith(b"HTTP/1.1 200"):
                counted["errors"] += 1
                size = next((int(x.split(b":")[1]) for x in head.lower().split(b"\r\n")
                             if x.startswith(b"content-length:")), 0)
                print(head.split(b"\r\n")[0].decode(), (await r.readexactly(size))[:300].decode(), file=sys.stderr)
                await asyncio.sleep(0.5)
                continue
            while True:  # chunked body, to its last chunk
                size = int((await r.readuntil(b"\r\n"))[:-2], 16)
                data = await r.readexactly(size + 2)
                if size == 0:
                    break
                if window["on"]:
                    counted["frames"] += data.count(b"data: ")
            if window["on"]:
                counted["requests"] += 1

    tasks = [asyncio.create_task(one()) for _ in range(concurrency)]
    await asyncio.sleep(warmup)
    window["on"] = True
    await asyncio.sleep(seconds)
    window["on"] = False
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return counted


# --- the run ------------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def wait_health(url: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{url} exited with code {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not become healthy")


def measure(args: argparse.Namespace, workers: list[str], processes: int) -> dict:
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", "router", "--port", str(port),
                               "--processes", str(processes), *(x for u in workers for x in ("--worker-url", u))],
                              stderr=subprocess.DEVNULL)
    try:
        wait_health(f"http://127.0.0.1:{port}", router)
        time.sleep(0.5)  # every router process has had its first health check (their start waits on it)
        pids = [router.pid, *(p for p in children(router.pid))]
        before = {p: cpu_seconds(p) or 0.0 for p in pids}
        t0 = time.monotonic()
        counted = asyncio.run(client(port, args.concurrency, args.warmup, args.seconds))
        wall = time.monotonic() - t0
        cpu = sum((cpu_seconds(p) or before[p]) - before[p] for p in pids)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
    return {"processes": processes, "frames_per_s": counted["frames"] / args.seconds,
            "requests_per_s": counted["requests"] / args.seconds, "errors": counted["errors"],
            "router_cores": cpu / wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="router --processes to compare")
    ap.add_argument("--concurrency", type=int, default=256, help="streams open at once")
    ap.add_argument("--frames", type=int, default=64, help="frames per stream")
    ap.add_argument("--tick", type=float, default=0.005, help="seconds between a worker's frames on each stream")
    ap.add_argument("--warmup", type=float, default=3.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--role", choices=["run", "worker"], default="run", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        asyncio.run(worker(args.port, args.frames, args.tick))
        return
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "worker", "--port", str(p), "--frames",
                               str(args.frames), "--tick", str(args.tick)], stderr=subprocess.DEVNULL) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc in zip(urls, procs):
            wait_health(url, proc)
        rows = [measure(args, urls, n) for n in args.processes]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    offered = args.concurrency / args.tick
    print(f"# {os.cpu_count()} cores, {args.concurrency} streams x {args.frames} frames, a frame every {args.tick}s "
          f"per stream (at most {offered:.0f} frames/s offered)")
    print(f"{'processes':>9} {'frames/s':>10} {'vs first':>9} {'requests/s':>11} {'router cores':>13} {'errors':>7}")
    for r in rows:
        print(f"{r['processes']:>9} {r['frames_per_s']:>10.0f} {r['frames_per_s'] / rows[0]['frames_per_s']:>9.2f} "
              f"{r['requests_per_s']:>11.1f} {r['router_cores']:>13.2f} {r['errors']:>7}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
