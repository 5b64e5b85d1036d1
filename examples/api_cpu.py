"""The API process's CPU per streamed token, old tree against new in one run, with the engine replaced by a stand-in.

`minisgl serve`'s own process (uvicorn, the routes, the SSE streams, the RemoteClient that reads the detokenizer's
messages; an EnginePool over `--replicas` of them, as `--dp`) runs from the tree under test, exactly as `serve` runs
it, but each engine behind it is one small process of this script: it answers tokenize queries and, every `--step-ms`,
sends one DetokOutput with a piece of text (ASCII, accented, emoji, quotes, newlines) for every running request,
as the detokenizer does after each scheduler step, until the request has its max_tokens. That costs the stand-in
little, so on a small machine the API process and the bench client (`minisgl bench --url`, streaming) are what runs,
and the stand-in's fixed step makes every side see the same arrivals: the API's CPU per token is the figure.

Sides alternate for --rounds rounds; the table shows each run: output tokens/s, SSE chunks per token (below one
where the API fell behind and sent several tokens' text in one chunk), the API process's CPU seconds and
microseconds per token and per chunk (and the share of it in the kernel: mostly the socket writes, one per chunk),
the stand-ins' and the client's CPU.

    git archive main | (mkdir -p /tmp/base && tar -x -C /tmp/base)
    PYTHONPATH=. python examples/api_cpu.py --old /tmp/base --rounds 3
    PYTHONPATH=. python examples/api_cpu.py --old /tmp/base --replicas 2 --bench-args "--api chat"
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PIECES = [" the", " café", " 😀", "\n", ' "quoted"', " naïve", " 東京", "\\", " w", "\t"]  # what JSON must escape too


def engine_child(root: str, step_s: float) -> None:
    """The stand-in engine (this tree's code): the tokenizer worker's and the detokenizer's sockets of one replica."""
    import zmq

    from minisgl_cli.messages import (
        AbortRequest,
        AddRequest,
        CheckPagesQuery,
        CheckPagesReply,
        DecodedPiece,
        DetokOutput,
        Heartbeat,
        StatsQuery,
        StatsReply,
        TokenizeQuery,
        TokenizeReply,
        decode,
    )
    from minisgl_cli.runtime.ipc import Endpoints, pull, push, send
    from minisgl_cli.types import SchedulerStats

    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    ctx = zmq.Context()
    ep = Endpoints(root)
    inbox, out = pull(ctx, ep.detokenizer), push(ctx, ep.api)
    live: dict[str, list[int]] = {}  # rid -> [tokens left, tokens made, prompt tokens]
    words = itertools.cycle(PIECES)
    due = beat = time.monotonic()
    while True:
        while inbox.poll(max(0.0, due - time.monotonic()) * 1000):
            msg = decode(inbox.recv())
            if isinstance(msg, AddRequest):
                live[msg.rid] = [msg.params.max_new_tokens, 0, len(msg.input_ids)]
            elif isinstance(msg, AbortRequest):
                live.pop(msg.rid, None)
            elif isinstance(msg, TokenizeQuery):
                text = msg.req.prompt or json.dumps(msg.req.messages)
                send(out, TokenizeReply(msg.qid, [3 + i % 1000 for i in range(max(1, len(text) // 4))]))
            elif isinstance(msg, StatsQuery):
                send(out, StatsReply(msg.qid, SchedulerStats(running=len(live))))
            elif isinstance(msg, CheckPagesQuery):
                send(out, CheckPagesReply(msg.qid, None))
        due += step_s
        pieces = []
        for rid, state in list(live.items()):
            state[0] -= 1
            state[1] += 1
            last = state[0] <= 0
            pieces.append(DecodedPiece(rid, next(words), [3 + state[1] % 1000], "length" if last else None,
                                       prefill_s=0.001 if state[1] == 1 else None))
            if last:
                del live[rid]
        if pieces:
            send(out, DetokOutput(pieces))
        if time.monotonic() - beat > 1.0:
            beat = time.monotonic()
            send(out, Heartbeat(time.time()))


def api_child(roots: list[str], port: int, model_dir: str, streams: int) -> None:
    """The API process (the tree under test's code): `serve`'s life over RemoteClients of the stand-ins."""
    from minisgl_cli.runtime.ipc import Endpoints
    from minisgl_cli.runtime.remote import RemoteClient
    from minisgl_cli.server.launch import LaunchConfig, serve
    from minisgl_cli.server.settings import ServerSettings
    from minisgl_cli.types import ModelInfo

    class StandInRuntime:
        """What a RemoteClient asks of its Runtime: the stand-in lives as long as this script wants it to."""

        dead = None

        def on_death(self, hook) -> None: ...
        def cpu_seconds(self) -> dict[str, float]: return {}
        def alive(self) -> bool: return True
        def shutdown(self) -> None: ...

    info = ModelInfo(name="stand-in", source=model_dir, device="cpu", dtype="float32", attention_backend="none",
                     model_dir=model_dir, vocab_size=1024, page_size=1, max_running=streams, max_context_len=8192,
                     kv_tokens=streams * 2048, load_s=0.0, overlap=False)

    def make_client(stop):
        clients = [RemoteClient(info, Endpoints(r), 0, StandInRuntime()) for r in roots]  # type: ignore[arg-type]
        if len(clients) == 1:
            return clients[0]
        from minisgl_cli.runtime.pool import EnginePool

        return EnginePool(clients)

    serve(make_client, ServerSettings(), LaunchConfig(port=port))


def cpu_s(pid: int) -> tuple[float, float]:
    """The process's user and system CPU seconds so far (it must be alive: the bench's figures need them)."""
    from minisgl_cli.process_cpu import cpu_times

    times = cpu_times(pid)
    if times is None:
        sys.exit(f"process {pid} is gone: no CPU seconds to read")
    return times


def run(tree: Path, args: argparse.Namespace, model: Path, out: Path, tag: str) -> dict:
    """One stand-in engine per replica, the API process from `tree`, one `minisgl bench --url` (this tree's)."""
    import httpx

    sys.path.insert(0, str(HERE))
    from fronts_cpu import chunks, py_spy, stop, tree_env, wait_healthy

    from minisgl_cli.api.http_server import free_port

    me = [sys.executable, str(Path(__file__).resolve())]
    roots = [tempfile.mkdtemp(prefix="api-cpu-") for _ in range(args.replicas)]
    engines = [subprocess.Popen([*me, "--child-engine", r, "--step-ms", str(args.step_ms)]) for r in roots]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = out / f"api-{tag}.log"
    with log.open("w") as f:
        api = subprocess.Popen([*me, "--child-api", ",".join(roots), "--port", str(port), "--model-dir", str(model),
                                "--streams", str(args.streams)], cwd=tree, env=tree_env(tree), stdout=f,
                               stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, api, log, timeout=120)
        httpx.get(f"{url}/v1/models", timeout=10)
        report = out / f"bench-{tag}.json"
        bench = [sys.executable, "-m", "minisgl_cli.app", "bench", "--url", url, "--model", str(model), "--dataset",
                 "random", "--num-prompts", str(args.streams), "--concurrency", str(args.streams), "--input-len", "64",
                 "--output-len", str(args.tokens), "--range-ratio", "1.0", "--warmup", "1", "--output-json",
                 str(report), *shlex.split(args.bench_args)]
        c0 = cpu_s(api.pid), sum(sum(cpu_s(e.pid)) for e in engines)
        with (out / f"bench-{tag}.txt").open("w") as f:
            running = subprocess.Popen(bench, stdout=f, stderr=subprocess.STDOUT)
            if args.py_spy:
                time.sleep(2.0)
                py_spy({"api": api.pid}, args.py_spy, tag, out)
            rc = running.wait(900)
        c1 = cpu_s(api.pid), sum(sum(cpu_s(e.pid)) for e in engines)
    finally:
        stop(api)
        for e in engines:
            e.terminate()
            e.wait(10)
    if rc != 0:
        sys.exit(f"bench failed in {tree}; see {out / f'bench-{tag}.txt'}")
    results = json.loads(report.read_text())["results"]
    tokens = sum(r["total_output_tokens"] for r in results)
    n_chunks = sum(map(chunks, results))
    api_s, engine_s = sum(c1[0]) - sum(c0[0]), c1[1] - c0[1]
    last = results[-1]
    return {"tok_s": last["output_throughput"], "tokens": tokens, "chunks": n_chunks, "api_s": api_s,
            "api_sys": (c1[0][1] - c0[0][1]) / max(api_s, 1e-9),
            "api_us_tok": 1e6 * api_s / tokens, "api_us_chunk": 1e6 * api_s / n_chunks, "engine_s": engine_s,
            "client_s": max(last.get("client_cpu_seconds") or [0.0])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="the base tree (git archive of the old commit); without it only this tree runs")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--streams", type=int, default=256, help="requests, all in flight")
    ap.add_argument("--tokens", type=int, default=256, help="output tokens of each")
    ap.add_argument("--step-ms", type=float, default=25.0, help="the stand-in engine's step: one token per stream")
    ap.add_argument("--replicas", type=int, default=1, help="stand-in engines behind an EnginePool (as serve --dp)")
    ap.add_argument("--bench-args", default="--client-procs 2", help="more `minisgl bench --url` flags")
    ap.add_argument("--out", default="/tmp/api_cpu")
    ap.add_argument("--py-spy", type=int, default=0, metavar="SECONDS",
                    help="sample the API process this long, 2 s into each bench (fronts_cpu.py's summary and files)")
    ap.add_argument("--child-engine", metavar="ROOT", help=argparse.SUPPRESS)
    ap.add_argument("--child-api", metavar="ROOTS", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_engine:
        engine_child(args.child_engine, args.step_ms / 1000)
        return
    if args.child_api:
        api_child(args.child_api.split(","), args.port, args.model_dir, args.streams)
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from host_bound_cpu import build_model  # examples/, beside this script: the tiny model's tokenizer for the bench

    model = build_model(out / "tiny-model")
    sides = ([("old", Path(args.old).resolve())] if args.old else []) + [("new", HERE.parent)]
    rows = []
    for r in range(args.rounds):
        for side, tree in sides:
            res = run(tree, args, model, out, f"{side}{r}")
            rows.append((f"{side}{r}", res))
            print(f"{side}{r}: {res['tok_s']:.0f} tok/s, {res['chunks'] / res['tokens']:.3f} chunks/token, API "
                  f"{res['api_s']:.2f}s = {res['api_us_tok']:.1f} us/token, {res['api_us_chunk']:.1f} us/chunk; "
                  f"stand-ins {res['engine_s']:.2f}s, busiest client {res['client_s']:.2f}s", flush=True)
    print(f"\n{'run':<8}{'tok/s':>9}{'chunks/tok':>12}{'API s':>8}{'of it sys':>11}{'API us/tok':>12}"
          f"{'API us/chunk':>14}{'stand-ins s':>13}{'client s':>10}")
    for name, res in rows:
        print(f"{name:<8}{res['tok_s']:>9.0f}{res['chunks'] / res['tokens']:>12.3f}{res['api_s']:>8.2f}"
              f"{res['api_sys']:>11.0%}{res['api_us_tok']:>12.1f}{res['api_us_chunk']:>14.1f}{res['engine_s']:>13.2f}"
              f"{res['client_s']:>10.2f}")
    for side, _ in sides:
        best = min(res["api_us_tok"] for name, res in rows if name.startswith(side))
        print(f"{side}: best {best:.1f} us/token")
    print(f"\n{args.streams} streams x {args.tokens} tokens, a {args.step_ms:g} ms step, {args.replicas} replica(s); "
          f"CPU seconds of the bench's timed runs and its warm-up. Logs in {out}. Command: {shlex.join(sys.argv)}")


if __name__ == "__main__":
    main()
