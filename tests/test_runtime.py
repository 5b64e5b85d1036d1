"""The multi-process runtime on the CPU: detokenizer, tokenizer workers and TP scheduler ranks (gloo) as
real child processes. TP 2 must give the same greedy tokens as one process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from serve_process import Serve, gone

from minisgl_cli.api.http_server import free_port
from minisgl_cli.client.local import LocalClient
from minisgl_cli.client.protocol import complete
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.runtime.config import RuntimeConfig
from minisgl_cli.runtime.launch import launch
from minisgl_cli.scheduler.scheduler import SchedulerConfig
from minisgl_cli.types import GenerateRequest, SamplingParams

pytestmark = pytest.mark.slow

CHATS = [[{"role": "user", "content": q}] for q in
         ("What is the capital of France?", "Name three colors.", "Count from one to five.")]


def _greedy(client, n: int = 12) -> list[list[int]]:
    async def run():
        reqs = [GenerateRequest(messages=m, params=SamplingParams(max_new_tokens=n + i, ignore_eos=True))
                for i, m in enumerate(CHATS)]
        return await asyncio.gather(*(complete(client, r) for r in reqs))

    return [c.token_ids for c in asyncio.run(run())]


# The exact mode: the default GGUF's int4 weights run bf16 activations, whose sums differ between one and two
# ranks; fp32 dense weights give the same greedy tokens whatever the split.
EXACT = dict(dtype="float32", quantization="none")


def _launch(model: str, tp: int, num_tokenizer: int = 0):
    rt = RuntimeConfig(tp_size=tp, num_tokenizer=num_tokenizer)
    return launch(EngineConfig(model=model, max_total_tokens=2048, **EXACT), SchedulerConfig(), rt)


def _same_tokens_as_one_process(model: str, tp: int, num_tokenizer: int = 0) -> None:
    local = LocalClient(EngineConfig(model=model, max_total_tokens=2048, **EXACT))
    try:
        want = _greedy(local)
    finally:
        local.close()
    remote = _launch(model, tp, num_tokenizer)
    try:
        assert remote.info.tp_size == tp
        assert _greedy(remote) == want
        remote.check_pages()
    finally:
        remote.close()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])  # llama's: test_tp2_logprobs_and_grammars_equal_one_process
def test_tp2_equals_one_process_on_tiny_models(tiny_model_dirs, arch):
    _same_tokens_as_one_process(str(tiny_model_dirs[arch]), tp=2)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_tp2_equals_one_process_on_tiny_moe_models(tiny_moe_dirs, arch):
    """Each rank runs its slice of every expert; the all-reduce after the MoE block makes the whole."""
    _same_tokens_as_one_process(str(tiny_moe_dirs[arch]), tp=2)


def test_tp2_equals_one_process_on_the_default_model(default_model_dir):
    # SmolLM2 has 9 query / 3 KV heads: rank 0 takes 2 KV heads (6 query), rank 1 one (3).
    _same_tokens_as_one_process(str(default_model_dir), tp=2, num_tokenizer=2)


def test_two_nodes_on_one_host_give_the_tokens_of_one_process(tiny_model_dirs, tmp_path):
    """--nnodes 2 as two groups of processes: node 1 runs rank 1 only (no HTTP), node 0 the API and rank 0;
    they meet through torch.distributed's rendezvous at --dist-init-addr."""
    model = tiny_model_dirs["qwen3"]
    prompts = [[5, 17, 99, 4000, 12], [7, 7, 300]]
    local = LocalClient(EngineConfig(model=str(model), max_total_tokens=2048))
    try:
        want = [_text(local, ids) for ids in prompts]
    finally:
        local.close()
    common = ("--tp", "2", "--nnodes", "2", "--dist-init-addr", f"127.0.0.1:{free_port()}")
    worker = Serve(model, tmp_path, *common, "--node-rank", "1")
    head = Serve(model, tmp_path, *common, "--node-rank", "0")
    try:
        head.wait_healthy()
        deadline = time.monotonic() + 30  # the worker says so a moment after its rank reports ready
        while "node 1: ranks 1..1 serving" not in worker.stderr():
            assert time.monotonic() < deadline, worker.stderr()
            time.sleep(0.1)
        got = [httpx.post(f"{head.url}/v1/completions", timeout=60, json={
            "model": "default", "prompt": ids, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
        }).json()["choices"][0]["text"] for ids in prompts]
        assert got == want
        pids = [*head.children().values(), *worker.children().values()]
        head.proc.terminate()
        assert head.proc.wait(10) == 0, head.stderr()
        worker.proc.terminate()
        worker.proc.wait(10)
        assert gone(pids) == []
    finally:
        head.stop()
        worker.stop()


def _text(client, ids: list[int]) -> str:
    req = GenerateRequest(input_ids=ids, params=SamplingParams(max_new_tokens=10, ignore_eos=True))
    return asyncio.run(complete(client, req)).text


def test_smoke_with_tp_2_answers_paris():
    """In the exact mode, whose answer is HF's (the 4-bit mode's first token here is a near tie, "The" against "L",
    that any rounding change at TP 2 may flip: "L'Étoile, ...")."""
    out = subprocess.run([sys.executable, "-m", "minisgl_cli.app", "smoke", "--tp", "2",
                          "--dist-init-addr", f"127.0.0.1:{free_port()}", "What is the capital of France?",
                          "--max-new-tokens", "12", "--dtype", "float32", "--quantization", "none"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "scheduler rank 1 ready" in out.stderr


def test_tp2_logprobs_and_grammars_equal_one_process(tiny_model_dirs):
    """Logprobs cross the processes (scheduler -> detokenizer -> API) and grammars stay in step on every rank; the
    tiny Llama's greedy tokens are one process's too, as the other tiny models' (one launch for both checks)."""
    import json
    import re

    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2),
              SamplingParams(max_new_tokens=16, regex=r"(yes|no), [a-c]{1,5}\.", logprobs=True),
              SamplingParams(max_new_tokens=16, json_schema=json.dumps(schema), temperature=0.8, seed=2)]

    def run(client):
        async def go():
            return await asyncio.gather(*(complete(client, GenerateRequest(messages=m, params=p))
                                          for m, p in zip(CHATS, params)))
        return asyncio.run(go())

    model = str(tiny_model_dirs["llama"])
    local = LocalClient(EngineConfig(model=model, max_total_tokens=2048, **EXACT))
    try:
        want, want_greedy = run(local), _greedy(local)
    finally:
        local.close()
    remote = _launch(model, tp=2)
    try:
        assert remote.info.tp_size == 2
        got, got_greedy = run(remote), _greedy(remote)
        remote.check_pages()
    finally:
        remote.close()
    assert got_greedy == want_greedy
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert re.fullmatch(r"(yes|no), [a-c]{1,5}\.", got[1].text) and json.loads(got[2].text)["answer"] in ("yes", "no")
    for g, w in zip(got[:2], want[:2]):
        assert [t.token for t in g.logprobs] == [t.token for t in w.logprobs]
        assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(g.logprobs, w.logprobs))
    assert all(len(t.top) == 2 for t in got[0].logprobs)


@pytest.fixture(scope="module")
def qwen3_serve(tiny_model_dirs, tmp_path_factory) -> Iterator[Serve]:
    """`minisgl serve` of the tiny Qwen3 with a tokenizer worker: the metrics test's server and the stream-interval
    test's reference (one start for both; neither changes what the other reads)."""
    serve = Serve(tiny_model_dirs["qwen3"], tmp_path_factory.mktemp("qwen3_serve"), "--num-tokenizer", "1")
    try:
        serve.wait_healthy()
        yield serve
    finally:
        serve.stop()


def test_metrics_count_each_processs_cpu_seconds_while_requests_run(qwen3_serve):
    with httpx.Client(base_url=qwen3_serve.url, timeout=60) as http:
        before = http.get("/metrics").json()["process_cpu_seconds"]
        assert set(before) == {"api", "detokenizer", "tokenizer 0", "scheduler rank 0"}
        for _ in range(3):
            http.post("/v1/completions", json={"prompt": [5, 17, 99], "max_tokens": 64, "ignore_eos": True})
        after = http.get("/metrics").json()["process_cpu_seconds"]
        prom = http.get("/metrics", params={"format": "prometheus"}).text
    assert after["scheduler rank 0"] > before["scheduler rank 0"]  # 192 decode steps: many clock ticks
    assert all(after[name] >= before[name] for name in before)
    assert 'minisgl_process_cpu_seconds_total{model_name=' in prom and 'process="detokenizer"}' in prom


def _sse_text(http: httpx.Client, body: dict) -> tuple[dict[int, str], dict[int, int]]:
    """A streamed completion's text per choice index, and how many frames carried text for each."""
    text: dict[int, str] = {}
    frames: dict[int, int] = {}
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line[6:]).get("choices", []):
                if c.get("text"):
                    text[c["index"]] = text.get(c["index"], "") + c["text"]
                    frames[c["index"]] = frames.get(c["index"], 0) + 1
    return text, frames


def _sse_arguments(http: httpx.Client, body: dict) -> str:
    """A streamed chat completion's first tool call's arguments, its pieces joined."""
    parts = []
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:]).get("choices", []):
                    parts += [t["function"].get("arguments") or "" for t in c["delta"].get("tool_calls") or []]
    return "".join(parts)


def test_stream_interval_sends_fewer_frames_and_the_same_text(tiny_model_dirs, qwen3_serve, tmp_path):
    """Random weights through the real tokenizer: multi-byte characters split across tokens are common. With
    --stream-interval 4, text, stop strings, logprobs, n and tool calls behave as with 1; the stream is the same
    text in fewer frames."""
    model = tiny_model_dirs["qwen3"]
    every, fourth = qwen3_serve, Serve(model, tmp_path, "--stream-interval", "4")
    try:
        fourth.wait_healthy()
        with httpx.Client(base_url=every.url, timeout=120) as a, httpx.Client(base_url=fourth.url, timeout=120) as b:
            # Seeded draws are the same on both servers; biased to the byte tokens of multi-byte characters (and
            # a few words), they split characters across tokens.
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model))
            ids = tok.encode("世界 🎉 über naïve the cat", add_special_tokens=False)
            base = {"prompt": [5, 17, 99, 4000, 12], "max_tokens": 24, "ignore_eos": True, "temperature": 1.0,
                    "seed": 3, "logit_bias": {str(i): 30 for i in set(ids)}}
            plain = a.post("/v1/completions", json=base).json()["choices"][0]["text"]
            assert any(ord(ch) > 127 for ch in plain), plain  # the case this test is about
            stop = plain[8:11]
            for body in (base, {**base, "logprobs": 2}, {**base, "stop": [stop]}, {**base, "n": 2}):
                want, got = a.post("/v1/completions", json=body).json(), b.post("/v1/completions", json=body).json()
                assert got["choices"] == want["choices"], body
                assert got["usage"]["completion_tokens"] == want["usage"]["completion_tokens"], body
                streamed, frames = _sse_text(b, body)
                assert streamed == {c["index"]: c["text"] for c in got["choices"] if c["text"]}, body
            _, frames = _sse_text(b, base)
            assert frames[0] <= 1 + 6 + 1  # the first token, then groups of 4 (the last with the end)
            assert _sse_text(a, base)[1][0] > frames[0]
            # A tool call (its arguments held to the schema by the grammar): the same call from both servers, and
            # the streamed argument pieces add up to the whole.
            params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                      "required": ["city"]}
            chat = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "max_tokens": 40,
                    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": params}}],
                    "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0}
            want = a.post("/v1/chat/completions", json=chat).json()["choices"]
            got = b.post("/v1/chat/completions", json=chat).json()["choices"]
            assert [c["message"]["tool_calls"][0]["function"] for c in got] == \
                [c["message"]["tool_calls"][0]["function"] for c in want]
            assert _sse_arguments(b, chat) == want[0]["message"]["tool_calls"][0]["function"]["arguments"]
    finally:
        fourth.stop()


def test_a_shutdown_stops_every_rank_through_its_clean_up_and_each_child_exits_0(tiny_model_dirs, capfd):
    """The runtime's shutdown (SIGTERM) while requests run: rank 0 finishes its step and hands rank 1 the stop, so
    both leave their loops at the same step through the scheduler's clean-up (every KV page back in the pool, the
    prefix cache's too), and every child exits 0 within the 5 s, none killed."""
    import logging
    import re

    logging.getLogger("minisgl").setLevel(logging.INFO)  # the children log at the launcher's level
    try:
        remote = _launch(str(tiny_model_dirs["llama"]), tp=2, num_tokenizer=1)
    finally:
        logging.getLogger("minisgl").setLevel(logging.NOTSET)
    procs = remote.runtime.procs

    async def start_then_stop() -> None:
        streams = [remote.submit(GenerateRequest(input_ids=[5, 17, 99 + i], params=SamplingParams(
            max_new_tokens=900, ignore_eos=True))) for i in range(3)]
        for s in streams:
            await anext(s)  # every request decoding, its pages held
        t0 = time.monotonic()
        remote.runtime.shutdown()
        assert time.monotonic() - t0 < 5
        for s in streams:
            await s.aclose()

    try:
        asyncio.run(start_then_stop())
    finally:
        remote.close()
    assert {name: p.exitcode for name, p in procs.items()} == dict.fromkeys(procs, 0)
    err = capfd.readouterr().err
    stopped = re.findall(r"rank(\d) minisgl\.runtime: scheduler rank \d stopped: (\d+) of (\d+) KV tokens free", err)
    assert sorted(r for r, _, _ in stopped) == ["0", "1"] and all(free == total for _, free, total in stopped), err
    assert "Traceback" not in err, err


def test_closing_engines_in_turn_gives_their_memory_back():
    """An app (a notebook, a test suite) that opens and closes engines in turn stays at one engine's memory: each
    closed engine's CPU memory goes back to the OS (engine/host.py trim_heap), not into a thread's malloc arena."""
    import os

    from minisgl_cli import LLM, SamplingParams

    def rss_mb() -> int:
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20

    after = []
    for _ in range(3):
        with LLM() as llm:  # the default model: a 1 GiB KV pool
            llm.generate("Hi", SamplingParams(max_new_tokens=2))
        after.append(rss_mb())
    assert after[2] - after[0] < 300, after
