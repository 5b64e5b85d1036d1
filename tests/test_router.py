"""`minisgl router` in front of two real `minisgl serve` processes: clients see one unchanged OpenAI server;
a worker killed mid-run is taken out (its started stream ends with an error frame, the request it had taken
answers 502 and is not replayed, requests that had not reached it go to the other), and put back once it is
restarted and answers its health check again. A client that hangs up on a non-streamed request gets it aborted
at the worker; a stopped (SIGSTOP) worker's requests answer 504 after --request-timeout and new ones go to the
other; a worker whose scheduler dies under load answers 503, and its requests finish on the other. With
--processes 2, both router processes serve the one port and /metrics counts them all; a stop or a dead router
process leaves no process behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
import openai
import pytest
from serve_process import Serve, gone

pytestmark = pytest.mark.slow

WORKER = "x-minisgl-worker"


@pytest.fixture(scope="module")
def cluster(tiny_model_dirs, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    model = tiny_model_dirs["llama"]
    workers = [Serve(model, tmp, "--runtime", "in-process") for _ in range(2)]
    router = _router(workers, tmp, "--processes", "1")  # one process: one rr turn for the whole router
    started = [*workers, router]
    try:
        for w in workers:
            w.wait_healthy()
        _wait(lambda: _metrics(router)["total"]["workers_up"] == 2, router)
        yield model, tmp, workers, router, started
    finally:
        for s in started:
            s.stop()


def _router(workers: list[Serve], tmp, *args: str) -> Serve:
    return Serve(None, tmp, "router", *(x for w in workers for x in ("--worker-url", w.url)),
                 "--scheduler-mode", "rr", "--health-interval", "0.3", *args)


def _metrics(router: Serve) -> dict:
    return httpx.get(f"{router.url}/metrics", timeout=10).json()


def _routed(router: Serve, worker: Serve) -> int:
    """Requests the router has sent to `worker` so far."""
    return next(w["requests"] for w in _metrics(router)["workers"] if w["url"] == worker.url)


def _wait(cond, s: Serve, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except httpx.HTTPError:
            pass
        assert s.proc.poll() is None, s.stderr()
        assert time.monotonic() < deadline, s.stderr()
        time.sleep(0.1)


def test_clients_see_one_openai_server_and_rr_alternates_workers(cluster):
    _, _, workers, router, _ = cluster
    direct = httpx.post(f"{workers[0].url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0})
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none")
    seen = set()
    for _ in range(2):
        raw = client.completions.with_raw_response.create(model="default", prompt="The capital of France is",
                                                          max_tokens=6, temperature=0)
        seen.add(raw.headers[WORKER])
        assert raw.parse().choices[0].text == direct.json()["choices"][0]["text"]  # same greedy text either way
    assert seen == {w.url for w in workers}
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=5, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list()] == [direct.json()["model"]]
    lines = [json.loads(x) for x in httpx.post(f"{router.url}/generate", timeout=60, json={
        "prompt": "Hello", "max_new_tokens": 4, "stream": True}).text.splitlines()]
    assert lines[-1]["event"] == "done" and lines[-1]["completion_tokens"] <= 4
    bad = httpx.post(f"{router.url}/v1/completions", json={"model": "default", "prompt": "x", "max_tokens": -1})
    assert bad.status_code == 400 and "error" in bad.json()  # the worker's own error, passed through


def test_bench_url_against_the_router(cluster, tmp_path):
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    model, _, _, router, _ = cluster
    out = tmp_path / "bench.json"
    result = CliRunner().invoke(app, ["bench", "--url", router.url, "--model", str(model), "--case", "short",
                                      "--repeat", "1", "--warmup", "0", "--max-new-tokens", "4", "--num-prompts", "4",
                                      "--max-concurrency", "2", "--output-json", str(out)])
    assert result.exit_code == 0, result.output
    (r,) = json.loads(out.read_text())["results"]
    assert r["completed"] == 4 and r["failed"] == 0 and r["total_output_tokens"] > 0


def _worker_metrics(workers: list[Serve]) -> list[dict]:
    return [httpx.get(f"{w.url}/metrics", params={"format": "json"}, timeout=10).json() for w in workers]


def test_a_client_that_hangs_up_on_a_non_streamed_request_gets_it_aborted_at_the_worker(cluster):
    _, _, workers, router, _ = cluster
    before = _worker_metrics(workers)
    body = json.dumps({"model": "default", "prompt": [9, 8, 7], "max_tokens": 900, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", router.port)) as client:
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        _wait(lambda: any(m["scheduler"]["running"] for m in _worker_metrics(workers)), router)  # it runs there
    # The client is gone: the router closes the worker's request, which the worker aborts (its KV freed).
    _wait(lambda: not any(m["scheduler"]["running"] or m["scheduler"]["waiting"] for m in _worker_metrics(workers)),
          router)
    after = _worker_metrics(workers)
    delta = [(a["scheduler"]["aborted_requests"] - b["scheduler"]["aborted_requests"],
              a["server"]["disconnects"] - b["server"]["disconnects"]) for a, b in zip(after, before)]
    assert sorted(delta) == [(0, 0), (1, 1)], delta  # aborted, not run to its 900 tokens
    assert all(m["scheduler"]["tokens_in_use"] == 0 for m in after)
    assert _metrics(router)["total"]["inflight"] == 0


def test_a_stopped_worker_times_out_per_the_flag_and_new_requests_go_to_the_other(cluster):
    _, tmp, workers, main_router, started = cluster
    router = _router(workers, tmp, "--processes", "1", "--request-timeout", "3")
    started.append(router)
    _wait(lambda: _metrics(router)["total"]["workers_up"] == 2, router)
    victim, survivor = workers
    short = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 3}
    victim.proc.send_signal(signal.SIGSTOP)  # hung: it takes connections and never answers
    try:
        timed_out = 0
        deadline = time.monotonic() + 120
        while _alive(router, victim):  # until request timeouts (or health checks) take it out
            t0 = time.monotonic()
            r = httpx.post(f"{router.url}/v1/completions", json=short, timeout=60)
            if r.headers[WORKER] == victim.url:
                assert r.status_code == 504 and r.json()["error"]["code"] == "worker_timeout", r.text
                assert time.monotonic() - t0 >= 3 and r.headers["x-should-retry"] == "false"
                timed_out += 1
            else:
                assert r.status_code == 200 and r.headers[WORKER] == survivor.url, r.text
            assert time.monotonic() < deadline, router.stderr()
        assert timed_out >= 1
        for _ in range(3):
            r = httpx.post(f"{router.url}/v1/completions", json=short, timeout=60)
            assert r.status_code == 200 and r.headers[WORKER] == survivor.url, r.text
    finally:
        victim.proc.send_signal(signal.SIGCONT)
    for rt in (router, main_router):  # back in both routers, for the tests after
        _wait(lambda rt=rt: _metrics(rt)["total"]["workers_up"] == 2, rt)
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(10) == 0, router.stderr()


def _alive(router: Serve, worker: Serve) -> bool:
    return next(w["alive"] for w in _metrics(router)["workers"] if w["url"] == worker.url)


def _inflight(router: Serve, worker: Serve) -> int:
    return next(w["inflight"] for w in _metrics(router)["workers"] if w["url"] == worker.url)


def test_a_dead_worker_is_taken_out_and_put_back_when_it_answers_again(cluster):
    model, tmp, workers, router, started = cluster
    long = {"model": "default", "prompt": [9, 8, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
    short = {"model": "default", "prompt": [1, 2, 3], "max_tokens": 3}
    waiting: dict = {}
    with httpx.stream("POST", f"{router.url}/v1/completions", json=long, timeout=60) as resp:
        victim = next(w for w in workers if w.url == resp.headers[WORKER])
        survivor = next(w for w in workers if w is not victim)
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.post(f"{router.url}/v1/completions", json=short, timeout=60).headers[WORKER] == survivor.url
        routed, served = _routed(router, victim), _routed(router, survivor)
        victim.proc.send_signal(signal.SIGSTOP)  # held: the next request (rr: the victim's turn) gets no answer
        waiter = threading.Thread(target=lambda: waiting.update(
            r=httpx.post(f"{router.url}/v1/completions", json=short, timeout=60)))
        waiter.start()
        _wait(lambda: _routed(router, victim) == routed + 1, router)
        victim.proc.send_signal(signal.SIGKILL)
        rest = [x for x in lines if x]
    error = json.loads(rest[-2].removeprefix("data: "))["error"]  # a started stream ends with an error frame
    assert error["code"] == "worker_failed" and victim.url in error["message"] and rest[-1] == "data: [DONE]"
    waiter.join(60)  # the request the victim took and never answered is not replayed: it may be what killed it
    r = waiting["r"]
    assert r.status_code == 502 and r.headers[WORKER] == victim.url and r.headers["x-should-retry"] == "false"
    assert r.json()["error"]["code"] == "worker_failed" and _routed(router, survivor) == served
    for _ in range(4):  # rr would pick the dead one every other time: those are retried on the survivor
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": "default", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200 and r.headers[WORKER] == survivor.url, r.text
    assert httpx.get(f"{router.url}/health").status_code == 200
    dead = next(w for w in _metrics(router)["workers"] if w["url"] == victim.url)
    assert dead["alive"] is False and dead["reason"]

    restarted = Serve(model, tmp, "--runtime", "in-process", port=victim.port)
    started.append(restarted)
    restarted.wait_healthy()
    workers[workers.index(victim)] = restarted  # the cluster's workers are the live ones, for the tests after
    _wait(lambda: all(w["alive"] for w in _metrics(router)["workers"]), router)
    used = {httpx.post(f"{router.url}/v1/completions", timeout=60, json={
        "model": "default", "prompt": [1, 2, 3], "max_tokens": 3}).headers[WORKER] for _ in range(2)}
    assert used == {w.url for w in workers}  # rr reaches the restarted worker again
    prom = httpx.get(f"{router.url}/metrics", params={"format": "prometheus"}).text
    assert f'minisgl_router_worker_up{{worker="{victim.url}"}} 1' in prom
    assert "worker " + victim.url + " is out" in router.stderr() and "is back" in router.stderr()
    os.kill(router.proc.pid, signal.SIGTERM)
    assert router.proc.wait(10) == 0, router.stderr()


def _started(workers: list[Serve], tmp, started: list[Serve], processes: int) -> tuple[Serve, dict[str, int]]:
    """A router with --processes over the workers, serving both; its processes' pids by name ("router 0")."""
    router = _router(workers, tmp, "--processes", str(processes))
    started.append(router)
    _wait(lambda: f"in {processes} processes at" in router.stderr(), router)  # every one of them ready
    _wait(lambda: _metrics(router)["total"]["workers_up"] == 2, router)
    pids = router.children()
    assert sorted(pids) == [f"router {i}" for i in range(processes)], router.stderr()
    return router, pids


def test_router_processes_share_the_port_and_metrics_count_them_all(cluster):
    _, tmp, workers, _, started = cluster
    router, pids = _started(workers, tmp, started, 2)
    for _ in range(12):  # each on a connection of its own: the kernel spreads them over the processes
        r = httpx.post(f"{router.url}/v1/completions", timeout=60,
                       json={"model": "default", "prompt": [1, 2, 3], "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none")
    chunks = list(client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=5, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    m = _metrics(router)
    assert {p["pid"] for p in m["processes"]} == set(pids.values())
    assert all(p["requests"] > 0 for p in m["processes"]), m["processes"]  # both served
    assert m["total"]["requests"] == sum(p["requests"] for p in m["processes"]) == 13
    assert sum(w["requests"] for w in m["workers"]) == 13 and m["total"]["inflight"] == 0
    prom = httpx.get(f"{router.url}/metrics", params={"format": "prometheus"}).text
    assert 'minisgl_router_process_requests_total{process="1"}' in prom
    router.proc.send_signal(signal.SIGINT)  # Ctrl-C: the router stops its processes
    assert router.proc.wait(20) == 0, router.stderr()
    assert gone(list(pids.values())) == []


def test_sigterm_stops_every_router_process(cluster):
    _, tmp, workers, _, started = cluster
    router, pids = _started(workers, tmp, started, 2)
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(20) == 0, router.stderr()
    assert gone(list(pids.values())) == []


def test_a_router_process_that_dies_takes_the_router_down_in_one_line(cluster):
    _, tmp, workers, _, started = cluster
    router, pids = _started(workers, tmp, started, 2)
    os.kill(pids["router 1"], signal.SIGKILL)
    assert router.proc.wait(20) == 1
    assert f"error: router 1 (pid {pids['router 1']}) exited with code -9" in router.stderr().splitlines()
    assert gone([pids["router 0"]]) == []


def test_killing_a_workers_scheduler_mid_load_moves_its_requests_to_the_other_worker(cluster):
    model, tmp, workers, _, started = cluster
    survivor = next(w for w in workers if w.health() == 200)
    victim = Serve(model, tmp)  # the multi-process runtime: a scheduler child to kill
    started.append(victim)
    victim.wait_healthy()
    router = _router([victim, survivor], tmp, "--processes", "1")
    started.append(router)
    _wait(lambda: _metrics(router)["total"]["workers_up"] == 2, router)
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)  # no retry to hide a failure
    done: list[tuple[bool, str | None, int, Exception | None]] = []  # (streamed, worker, chunks, error)
    stop = threading.Event()

    def load(i: int) -> None:
        while not stop.is_set():
            worker, chunks = None, 0
            try:
                if i % 3:  # token ids, and chats (tokenized by the worker: a dead engine must not read as a 400)
                    raw = client.completions.with_raw_response.create(model="default", prompt=[1, 2, 3, i],
                                                                      max_tokens=16, stream=bool(i % 2))
                else:
                    raw = client.chat.completions.with_raw_response.create(
                        model="default", messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=16,
                        stream=bool(i % 2))
                worker = raw.headers[WORKER]
                if i % 2:
                    for _ in raw.parse():
                        chunks += 1
                else:
                    chunks = len(raw.parse().choices)
                done.append((bool(i % 2), worker, chunks, None))
            except openai.APIError as exc:
                done.append((bool(i % 2), worker, chunks, exc))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        _wait(lambda: sum(w == victim.url for _, w, _, _ in done) >= 4, router)  # both workers serve the load
        _wait(lambda: _inflight(router, victim) >= 2, router)  # and requests run there as its scheduler dies
        os.kill(victim.children()["scheduler rank 0"], signal.SIGKILL)
        victim.proc.wait(30)  # serve exits once a child dies; its open requests answered 503 first
        n = len(done)
        _wait(lambda: len(done) >= n + 12, router)  # the load goes on, on the survivor
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    failed = [(streamed, worker, chunks, repr(exc)) for streamed, worker, chunks, exc in done if exc is not None]
    # Only a stream the victim had started can fail (its error frame); every other request finished elsewhere.
    assert all(streamed and worker == victim.url and chunks >= 1 for streamed, worker, chunks, _ in failed), failed
    assert done[-1][1] == survivor.url and not _alive(router, victim)
