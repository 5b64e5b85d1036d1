"""How many SSE frames a second `minisgl router` relays, with --processes 1 and N, in one run (no model, no GPU).

Two stand-in workers (raw asyncio, a process each) answer every POST with a stream of `max_tokens` frames: like
an engine's decode step, a ticker writes one frame to every open stream every --tick seconds (skipping a stream
whose last frame the router has not taken yet). A raw asyncio client
(one process) sends --concurrency streams through the router at once, lengths uniform in --min-frames..--frames
(seeded), and when all have ended sends them again (--waves times): the shape of
examples/dp_scaling.sh's bench (all requests in flight, two draws). The router is the only Python that parses
HTTP on the way, so its frames/s, and the CPU its processes use, are what the table compares.

    python examples/router_relay.py                                # --processes 1 and 2
    python examples/router_relay.py --processes 1 2 4 --concurrency 512 --tick 0.01

On a machine with few cores the workers and the client share them with the router: the ratio is a floor.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fronts_cpu import stop, wait_healthy  # examples/, beside this script

from minisgl_cli.api.http_server import free_port
from minisgl_cli.process_cpu import cpu_seconds

FRAME = (b'data: {"id":"cmpl-0","object":"text_completion","created":0,"model":"m","choices":[{"index":0,'
         b'"text":" token","logprobs":null,"finish_reason":null}]}\n\n')
DONE = b"data: [DONE]\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


# --- the stand-in worker ----------------------------------------------------------------------------
async def worker(port: int, tick: float) -> None:
    streams: dict[asyncio.StreamWriter, list] = {}  # writer -> [frames left, the future its handler waits on]

    async def ticker() -> None:
        while True:
            await asyncio.sleep(tick)
            for w, state in list(streams.items()):
                if w.is_closing():  # the router left (stopped)
                    del streams[w]
                    continue
                if w.transport.get_write_buffer_size():  # the router has not taken the last one: wait, as
                    continue  # uvicorn's flow control makes a real worker wait (else its backlog grows unbounded)
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
                body = await r.readexactly(length)
                if line.startswith("POST"):
                    w.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
                    done = asyncio.get_running_loop().create_future()
                    streams[w] = [json.loads(body)["max_tokens"], done]
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
async def client(port: int, lengths: list[int], waves: int) -> list[dict]:
    """Each wave: every stream at once, each on a connection of its own; its frames/s and first-frame latencies."""

    async def one(n: int, t0: float) -> tuple[int, float]:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": n, "stream": True}).encode()
        w.write(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body))
        head = await r.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(head.decode("latin-1").splitlines()[0])
        frames, first = 0, 0.0
        while True:  # the chunked body, to its last chunk
            size = int((await r.readuntil(b"\r\n"))[:-2], 16)
            data = await r.readexactly(size + 2)
            if size == 0:
                w.close()
                return frames, first
            if not frames:
                first = time.monotonic() - t0
            frames += data.count(b"data: ")

    out = []
    for _ in range(waves):
        t0 = time.monotonic()
        done = await asyncio.gather(*(one(n, t0) for n in lengths), return_exceptions=True)
        seconds = time.monotonic() - t0
        ok = [d for d in done if not isinstance(d, BaseException)]
        for e in {repr(d) for d in done if isinstance(d, BaseException)}:
            print("error:", e, file=sys.stderr)
        frames = sum(f for f, _ in ok)
        out.append({"frames": frames, "frames_per_s": frames / seconds, "seconds": seconds,
                    "first_frame_p50_ms": 1000 * statistics.median(t for _, t in ok) if ok else None,
                    "errors": len(done) - len(ok)})
    return out


# --- the run ------------------------------------------------------------------------------------------
def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def measure(args: argparse.Namespace, workers: list[str], processes: int, logs: Path) -> dict:
    port = free_port()
    log = logs / f"router-p{processes}.log"
    router = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", "router", "--port", str(port),
                               "--processes", str(processes), *(x for u in workers for x in ("--worker-url", u))],
                              stderr=log.open("w"))
    try:
        wait_healthy(f"http://127.0.0.1:{port}", router, log, 60)
        time.sleep(0.5)  # every router process has had its first health check (their start waits on it)
        pids = [router.pid, *children(router.pid)]
        before = {p: cpu_seconds(p) or 0.0 for p in pids}
        lengths = random.Random(0).choices(range(args.min_frames, args.frames + 1), k=args.concurrency)
        waves = asyncio.run(client(port, lengths, args.waves))
        cpu = sum((cpu_seconds(p) or before[p]) - before[p] for p in pids)
    finally:
        stop(router)
    return {"processes": processes, "waves": waves, "router_cpu_s": cpu}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2], help="router --processes to compare")
    ap.add_argument("--concurrency", type=int, default=256, help="streams sent at once")
    ap.add_argument("--min-frames", type=int, default=100, help="frames per stream: uniform in min..max")
    ap.add_argument("--frames", type=int, default=1024, help="frames per stream, at most")
    ap.add_argument("--tick", type=float, default=0.005, help="seconds between a worker's frames on each stream")
    ap.add_argument("--waves", type=int, default=2, help="times every stream is sent (the table reports the last)")
    ap.add_argument("--role", choices=["run", "worker"], default="run", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.role == "worker":
        asyncio.run(worker(args.port, args.tick))
        return
    logs = Path(tempfile.mkdtemp(prefix="router_relay-"))
    ports = [free_port(), free_port()]
    procs = [subprocess.Popen([sys.executable, __file__, "--role", "worker", "--port", str(p), "--tick",
                               str(args.tick)], stderr=(logs / f"worker-{p}.log").open("w")) for p in ports]
    try:
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url, proc, p in zip(urls, procs, ports):
            wait_healthy(url, proc, logs / f"worker-{p}.log", 60)
        rows = [measure(args, urls, n, logs) for n in args.processes]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    print(f"# {os.cpu_count()} cores; {args.concurrency} streams of {args.min_frames}..{args.frames} frames at once, a "
          f"frame every {args.tick}s on each (at most {args.concurrency / args.tick:.0f} frames/s), {args.waves} waves")
    print(f"{'processes':>9} {'frames/s':>10} {'vs first':>9} {'first wave':>11} {'1st frame p50 ms':>17} "
          f"{'router CPU s':>13} {'CPU us/frame':>13} {'errors':>7}")
    base = rows[0]["waves"][-1]["frames_per_s"]
    for r in rows:
        last, first = r["waves"][-1], r["waves"][0]
        print(f"{r['processes']:>9} {last['frames_per_s']:>10.0f} {last['frames_per_s'] / base:>9.2f} "
              f"{first['frames_per_s']:>11.0f} {last['first_frame_p50_ms']:>17.0f} {r['router_cpu_s']:>13.1f} "
              f"{1e6 * r['router_cpu_s'] / sum(w['frames'] for w in r['waves']):>13.1f} "
              f"{sum(w['errors'] for w in r['waves']):>7}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
