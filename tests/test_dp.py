"""Data parallelism on the CPU: --dp 2 runs two engine replicas (each its own processes) behind one client.

cache_aware keeps each system prompt on one replica, so a shared-prefix workload hits the radix caches where
rr spreads every prompt over both; caps answer 429; warming reaches every replica; /metrics reports each
replica; and a replica killed mid-run is taken out while `minisgl serve --dp 2` serves on.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import threading
import time

import httpx
import pytest
import torch
from serve_process import Serve, gone

from minisgl_cli.api.http_server import BackgroundServer, free_port
from minisgl_cli.client.protocol import complete
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.launch import launch
from minisgl_cli.runtime.pool import EnginePool
from minisgl_cli.scheduler.config import SchedulerConfig
from minisgl_cli.server.app import ServerSettings, create_app, json_metrics
from minisgl_cli.server.control import ControlChannel
from minisgl_cli.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau".split()


@pytest.fixture(scope="module")
def pool(tiny_model_dirs):
    # 1200 KV tokens a replica: room for about two of the workload's ~450-token system prompts, not four.
    client = launch(EngineConfig(model=str(tiny_model_dirs["llama"]), max_total_tokens=1200), SchedulerConfig(),
                    RuntimeConfig(dp_size=2, dispatch="cache_aware"))
    assert isinstance(client, EnginePool) and client.info.dp_size == 2
    yield client
    client.close()


def _hit_rate(pool: EnginePool, mode: str, seed: int, requests: int = 64) -> float:
    """Radix-cache hit rate over both replicas of `requests` chats, one at a time, each with one of 4 system
    prompts (drawn at random), routed by `mode`."""
    rng = random.Random(seed)
    systems = [f"You are assistant {seed}-{k}. " + " ".join(rng.choice(WORDS) for _ in range(380)) for k in range(4)]
    router = EnginePool(pool.replicas, mode)
    before = [r.stats() for r in pool.replicas]

    async def run() -> None:
        for q in range(requests):
            msgs = [{"role": "system", "content": rng.choice(systems)}, {"role": "user", "content": f"Question {q}?"}]
            await complete(router, GenerateRequest(messages=msgs, params=SamplingParams(max_new_tokens=2)))

    asyncio.run(run())
    after = [r.stats() for r in pool.replicas]
    hit = sum(a.cache_hit_tokens - b.cache_hit_tokens for a, b in zip(after, before))
    miss = sum(a.cache_miss_tokens - b.cache_miss_tokens for a, b in zip(after, before))
    assert router.dispatcher.routed[0] > 0 and router.dispatcher.routed[1] > 0
    return hit / (hit + miss)


def test_cache_aware_keeps_each_system_prompt_on_one_replica(pool):
    rr = _hit_rate(pool, "rr", seed=1)
    cache_aware = _hit_rate(pool, "cache_aware", seed=2)
    assert cache_aware >= 0.90, (rr, cache_aware)
    assert 0.35 <= rr <= 0.65, (rr, cache_aware)  # each replica sees all four prompts and holds two
    pool.check_pages()


def test_per_replica_cap_answers_429_and_metrics_report_each_replica(pool):
    capped = EnginePool(pool.replicas, "rr", cap=1)
    body = {"model": "default", "prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True}
    schedulers = [r.runtime.procs["scheduler rank 0"].pid for r in pool.replicas]
    app = create_app(capped, ServerSettings())
    with BackgroundServer(app) as url, httpx.Client(timeout=60) as http:
        for pid in schedulers:  # held still, so the two requests stay in flight while the third comes
            os.kill(pid, signal.SIGSTOP)
        try:
            held = [threading.Thread(target=http.post, args=(f"{url}/v1/completions",), kwargs={"json": body})
                    for _ in range(2)]
            for t in held:
                t.start()
            _wait(lambda: capped.dispatcher.load == [1, 1])  # one on each replica
            busy = http.post(f"{url}/v1/completions", json=body)
            assert busy.status_code == 429 and busy.headers["Retry-After"] == "1", busy.text
            assert "every replica has 1 requests in flight" in busy.json()["error"]["message"]
        finally:
            for pid in schedulers:
                os.kill(pid, signal.SIGCONT)
        for t in held:
            t.join(60)
        _wait(lambda: capped.dispatcher.load == [0, 0])
        assert http.post(f"{url}/v1/completions", json=body).status_code == 200

        finished = [r.stats().finished_requests for r in pool.replicas]
        assert capped.insert_prefix("A prefix warmed on every replica, " * 8).wait(60)
        metrics = http.get(f"{url}/metrics").json()["scheduler"]
        replicas = metrics["replicas"]
        assert [r["replica"] for r in replicas] == [0, 1] and all(r["alive"] for r in replicas)
        assert sum(r["requests"] for r in replicas) == 3 and all(r["inflight"] == 0 for r in replicas)
        assert [r["scheduler"]["finished_requests"] for r in replicas] == [n + 1 for n in finished]  # warmed
        assert metrics["tokens_total"] == sum(r["scheduler"]["tokens_total"] for r in replicas)
        prom = http.get(f"{url}/metrics", params={"format": "prometheus"}).text
        assert 'minisgl_replica_up{model_name="llama",replica="1"} 1' in prom
        assert 'minisgl_replica_requests_total{model_name="llama",replica="0"}' in prom
        control = ControlChannel(f"tcp://127.0.0.1:{free_port()}", lambda: json_metrics(app), lambda text: 0)
        assert [r["requests"] for r in control.handle("metrics")["metrics"]["scheduler"]["replicas"]] == \
            [r["requests"] for r in replicas]  # the ZMQ control channel's metrics: the same, per replica
    pool.check_pages()


def _wait(cond, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_serve_keeps_serving_when_a_replica_is_killed_mid_run(tiny_model_dirs, tmp_path):
    """Replica 1's scheduler is stopped, then killed: its started stream ends with an error, a request that
    was waiting on it (no output yet) is retried on replica 0, new requests keep coming back, /health stays 200,
    /metrics shows replica 1 out, its detokenizer is stopped, and SIGTERM still stops everything."""
    s = Serve(tiny_model_dirs["llama"], tmp_path, "--dp", "2", "--scheduler-mode", "rr")
    try:
        s.wait_healthy()
        children = s.children()
        assert set(children) == {f"replica {i} {k}" for i in (0, 1) for k in ("detokenizer", "scheduler rank 0")}
        long = {"model": "default", "prompt": [9, 8, 7], "max_tokens": 900, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", f"{s.url}/v1/completions", json=long) as on_0, \
                    http.stream("POST", f"{s.url}/v1/completions", json=long) as on_1:
                lines_1 = on_1.iter_lines()
                next(on_0.iter_lines()), next(lines_1)  # rr: the first on replica 0, the second on replica 1
                os.kill(children["replica 1 scheduler rank 0"], signal.SIGSTOP)
                assert s.answers()  # rr: replica 0
                waiting: dict = {}
                waiter = threading.Thread(target=lambda: waiting.update(r=http.post(
                    f"{s.url}/v1/completions", json={**long, "stream": False, "max_tokens": 8})))
                waiter.start()  # rr: replica 1, which is stopped: no output yet
                time.sleep(1.0)
                os.kill(children["replica 1 scheduler rank 0"], signal.SIGKILL)
                rest = "\n".join(lines_1)  # the started stream ends, with an error naming the replica
                assert "replica 1 scheduler rank 0" in rest and "error" in rest, rest
                waiter.join(60)
                assert waiting["r"].status_code == 200, waiting["r"].text  # retried on replica 0
                assert waiting["r"].json()["usage"]["completion_tokens"] == 8
            assert all(s.answers() for _ in range(4))
            assert s.health() == 200
            replicas = http.get(f"{s.url}/metrics").json()["scheduler"]["replicas"]
            assert [r["alive"] for r in replicas] == [True, False]
        assert gone([children["replica 1 detokenizer"]]) == []
        assert "replica 1 is out (replica 1 scheduler rank 0" in s.stderr()
        s.proc.terminate()
        assert s.proc.wait(15) == 0, s.stderr()
        assert gone(list(children.values())) == []
    finally:
        s.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_replicas_take_a_gpu_each_and_answer_alike():
    pool = launch(EngineConfig(model="qwen3-0.6b", load_format="dummy", max_total_tokens=20000), SchedulerConfig(),
                  RuntimeConfig(dp_size=2))
    assert isinstance(pool, EnginePool)
    try:
        assert [r.info.device for r in pool.replicas] == ["cuda:0", "cuda:1"]
        req = GenerateRequest(input_ids=[1, 2, 3, 4], params=SamplingParams(max_new_tokens=16, ignore_eos=True))
        first, second = (asyncio.run(complete(r, req)).token_ids for r in pool.replicas)
        assert first == second  # the same dummy weights on each
    finally:
        pool.close()
