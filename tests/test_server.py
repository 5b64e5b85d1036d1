"""`minisgl serve` end to end: a real uvicorn server on loopback, the official openai client, raw httpx."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest
from server_fixtures import API_KEY, wait_idle

openai = pytest.importorskip("openai")

HI = [{"role": "user", "content": "hi"}]


def oai(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)


def test_health_and_models(server_url, engine_client):
    assert httpx.get(f"{server_url}/health").json() == {"status": "ok"}
    models = oai(server_url).models.list().data
    assert [m.id for m in models] == [engine_client.info.name]
    assert oai(server_url).models.retrieve("default").id == engine_client.info.name


def test_health_is_503_once_the_scheduler_is_stopped():
    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.server.app import create_app

    client = LocalClient(EngineConfig(model="smollm2-135m", load_format="dummy", max_total_tokens=256))
    try:
        with BackgroundServer(create_app(client)) as url:  # starts once /health answers 200
            client.close()  # stops the scheduler loop
            r = httpx.get(f"{url}/health")
    finally:
        client.close()
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "the engine's scheduler is not running or has stalled",
                                  "type": "server_error", "param": None, "code": None}}


def test_chat_non_stream(server_url):
    r = oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0 and 0 < r.usage.completion_tokens <= 6
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # The same prompt again hits the radix cache.
    again = oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_with_usage(server_url):
    stream = oai(server_url).chat.completions.create(
        model="default", messages=HI, max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text and reasons in (["stop"], ["length"])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_a_chat_stream_carries_no_empty_content(server_url):
    """After the role chunk (OpenAI's own shape: role + ""), every chunk carries text until the finish chunk:
    the EOS token, which has no text, sends no chunk of its own."""
    first, *rest = oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=64, stream=True)
    assert first.choices[0].delta.role == "assistant"
    *texts, last = rest
    assert last.choices[0].finish_reason == "stop" and not last.choices[0].delta.content  # ended on EOS
    assert texts and all(c.choices[0].delta.content for c in texts), [c.choices[0].delta for c in texts]


def test_stream_equals_non_stream_greedy(server_url):
    full = oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=8)
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=8,
                                                                        stream=True) if c.choices)
    assert streamed == full.choices[0].message.content


def test_async_client_n2_stream_and_non_stream(server_url):
    async def run():
        client = openai.AsyncOpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0, timeout=120)
        r = await client.chat.completions.create(model="default", messages=HI, max_tokens=4, n=2)
        assert sorted(c.index for c in r.choices) == [0, 1]
        texts: dict[int, str] = {0: "", 1: ""}
        finished = set()
        async for chunk in await client.chat.completions.create(model="default", messages=HI, max_tokens=4, n=2,
                                                                stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finished.add(c.index)
        assert finished == {0, 1} and all(texts.values())
        await client.close()

    asyncio.run(run())


def test_completions(server_url):
    client = oai(server_url)
    r = client.completions.create(model="default", prompt=["The capital of France is", "1, 2, 3,"], max_tokens=4, n=2)
    assert r.object == "text_completion" and [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.text for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy: both samples of a prompt agree
    assert r.usage.completion_tokens == sum(1 for _ in r.choices) * 4 or r.usage.completion_tokens <= 16
    ids = client.completions.create(model="default", prompt=[504, 3575, 282], max_tokens=3)
    assert ids.usage.prompt_tokens == 3
    chunks = list(client.completions.create(model="default", prompt="Once upon a time", max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.prompt_tokens > 0


def test_stop_strings_and_penalties(server_url):
    client = oai(server_url)
    base = client.chat.completions.create(model="default", messages=HI, max_tokens=8).choices[0].message.content
    stop = next(ch for ch in base[1:] if not ch.isspace())  # a character the greedy reply contains
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=8, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].message.content and base.startswith(r.choices[0].message.content)
    r = client.chat.completions.create(model="default", messages=HI, max_tokens=4, stop=stop,
                                       presence_penalty=1.5, frequency_penalty=1.0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_seed_reproducible(server_url):
    client = oai(server_url)

    def sample(seed: int) -> str:
        return client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Tell a story"}],
                                              max_tokens=8, temperature=1.0, seed=seed).choices[0].message.content

    assert sample(1234) == sample(1234)
    assert len({sample(s) for s in (1, 2, 3)}) > 1  # sampling really is random across seeds


def test_generate_json_lines(server_url):
    body = {"prompt": "The capital of France is", "max_new_tokens": 5, "temperature": 0}
    with httpx.stream("POST", f"{server_url}/generate", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    *deltas, done = lines
    assert deltas and all(set(d) == {"text_delta"} for d in deltas)
    assert done["event"] == "done" and done["finish_reason"] in ("stop", "length")
    for key in ("prompt_tokens", "cached_tokens", "completion_tokens", "ttft_ms", "latency_ms"):
        assert key in done
    assert done["completion_tokens"] <= 5
    r = httpx.post(f"{server_url}/generate", json={**body, "stream": False}, timeout=120).json()
    assert r["event"] == "done" and r["text"] == "".join(d["text_delta"] for d in deltas)


# Characters JSON escapes or writes as more than one byte: what a frame made from a template must write as
# json.dumps(..., ensure_ascii=False) does.
TRICKY = ["", "plain", "café naïve", "世界 🎉", 'say "hi"', "back\\slash", "line\nbreak\ttab\r", "\x00\x1f\x7f",
          "\u2028\u2029", "\ud800 lone surrogate", "\u0000text\u0000"]


def test_a_templated_frame_is_byte_for_byte_the_json_of_its_chunk():
    from minisgl_cli.api import protocol as p
    from minisgl_cli.server.runs import sse, templated

    def chunk(text: str) -> str:
        return sse(p.completion_chunk("cmpl-1", 7, "m", 0, text, None, True))

    made = templated(chunk)
    assert made is not chunk  # the template was taken
    for text in TRICKY:
        assert made(text) == chunk(text) == f"data: {json.dumps(json.loads(chunk(text)[6:]), ensure_ascii=False)}\n\n"
    # Where the text cannot be put in the same way, the frame is made whole each time.
    ascii_only = lambda text: json.dumps({"t": text}) + "\n"  # noqa: E731 - ensure_ascii on: "é" is \\u00e9
    twice = lambda text: json.dumps({"a": text, "b": text}, ensure_ascii=False)  # noqa: E731
    assert templated(ascii_only) is ascii_only and templated(twice) is twice


def test_every_route_streams_the_text_of_its_reply_byte_for_byte(server_url, default_model_dir):
    """Sampling biased to the byte tokens of multi-byte characters (and quotes, backslashes, newlines) splits them
    across tokens; each route's stream, joined, is the text of the same request not streamed, and each text frame is
    its object's JSON as json.dumps writes it (ensure_ascii off)."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(default_model_dir)).encode('世界 🎉 über naïve "q" \\ \n the')
    sampling = {"temperature": 1.0, "seed": 3, "logit_bias": {str(i): 30 for i in set(ids)}, "ignore_eos": True}
    routes = {  # path: (body, the text of a reply not streamed, the text of one streamed object)
        "/v1/completions": ({"prompt": "hi", "max_tokens": 24}, lambda o: o["choices"][0]["text"],
                            lambda o: "".join(c["text"] for c in o["choices"])),
        "/v1/chat/completions": ({"messages": HI, "max_tokens": 24}, lambda o: o["choices"][0]["message"]["content"],
                                 lambda o: "".join(c["delta"].get("content") or "" for c in o["choices"])),
        "/generate": ({"prompt": "hi", "max_new_tokens": 24}, lambda o: o["text"], lambda o: o.get("text_delta", "")),
    }
    with httpx.Client(base_url=server_url, timeout=120) as http:
        for path, (body, whole, piece) in routes.items():
            want = whole(http.post(path, json={**body, **sampling, "stream": False}).json())
            assert any(ord(ch) > 127 for ch in want), want  # the case this test is about
            streamed = ""
            with http.stream("POST", path, json={**body, **sampling, "stream": True}) as r:
                for line in r.iter_lines():
                    raw = line.removeprefix("data: ")
                    if not raw or raw == "[DONE]":
                        continue
                    obj = json.loads(raw)
                    if "event" not in obj:  # /generate's done line is the pydantic model's own JSON
                        assert raw == json.dumps(obj, ensure_ascii=False)
                    streamed += piece(obj)
            assert streamed == want, path


def test_metrics_json_and_prometheus(server_url):
    oai(server_url).chat.completions.create(model="default", messages=HI, max_tokens=2)
    m = httpx.get(f"{server_url}/metrics", timeout=30).json()
    for key in ("waiting", "running", "cache_hit_tokens", "cache_miss_tokens", "decode_tok_s"):
        assert key in m["scheduler"]
    assert m["server"]["inflight"] == 0
    assert m["latency"]["window"] > 0 and m["latency"]["ttft_ms"]["p50"] > 0 and m["latency"]["e2e_ms"]["p99"] > 0
    assert "completion_tok_s" in m["throughput"]
    assert m["engine"]["sampler"] == "torch" and m["engine"]["attention_backend"] == "torch"  # the CPU's kernels
    for r in (httpx.get(f"{server_url}/metrics?format=prometheus", timeout=30),
              httpx.get(f"{server_url}/metrics", headers={"Accept": "text/plain"}, timeout=30)):
        assert r.headers["content-type"].startswith("text/plain")
        text = r.text
        assert "# TYPE minisgl_num_requests_running gauge" in text
        assert re.search(r"^minisgl_cache_hit_tokens_total\{[^}]*\} \d+$", text, re.M)
        assert re.search(r'^minisgl_time_to_first_token_seconds_bucket\{.*le="\+Inf"\} [1-9]', text, re.M)
        assert "minisgl_e2e_request_latency_seconds_count" in text
        assert re.search(r'^minisgl_engine_info\{.*sampler="torch".*\} 1$', text, re.M)


def test_auth(auth_url):
    assert httpx.get(f"{auth_url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{auth_url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        oai(auth_url, "wrong").models.list()
    r = oai(auth_url, API_KEY).chat.completions.create(model="default", messages=HI, max_tokens=2)
    assert r.choices[0].message.content
    assert httpx.get(f"{auth_url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200


def _hold_stream(url: str, client: httpx.Client):
    """Open a long stream and read its first chunk; the caller closes it (aborting the request)."""
    body = {"prompt": "Count: 1 2 3", "max_new_tokens": 400, "ignore_eos": True}
    cm = client.stream("POST", f"{url}/generate", json=body, timeout=120)
    r = cm.__enter__()
    assert r.status_code == 200
    lines = r.iter_lines()
    next(lines)
    cm.lines = lines  # keep the iterator alive: a collected one closes the response
    return cm


def test_backpressure_429_and_adaptive_downscale(capped_url, engine_client):
    with httpx.Client() as http:
        held = _hold_stream(capped_url, http)
        try:
            # One of two slots taken: load 50% -> max_tokens halved, and reported.
            r = httpx.post(f"{capped_url}/generate", json={"prompt": "Hi", "max_new_tokens": 16, "stream": False},
                           timeout=120)
            assert r.status_code == 200
            assert r.headers["X-Minisgl-Max-Tokens-Downscaled"] == "16->8"
            assert r.json()["max_new_tokens_downscaled"] == "16->8" and r.json()["completion_tokens"] <= 8
            # n=2 needs two slots while one is held: over the cap.
            r = httpx.post(f"{capped_url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 2})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["type"] == "rate_limit_error"
        finally:
            held.__exit__(None, None, None)
    wait_idle(engine_client)
    m = httpx.get(f"{capped_url}/metrics").json()["server"]
    assert m["inflight"] == 0 and m["rejected_429"] >= 1 and m["disconnects"] >= 1
    r = httpx.post(f"{capped_url}/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "n": 2}, timeout=120)
    assert r.status_code == 200


def test_disconnect_frees_pages(server_url, engine_client):
    with httpx.Client() as http:
        _hold_stream(server_url, http).__exit__(None, None, None)
    wait_idle(engine_client)
    engine_client.check_pages()
    s = engine_client.stats()
    assert s.tokens_in_use == 0 and s.aborted_requests >= 1


def test_zmq_control(server_url, engine_client):
    zmq = pytest.importorskip("zmq")
    from minisgl_cli.api.http_server import free_port
    from minisgl_cli.server.control import ControlChannel

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    chan = ControlChannel(endpoint, lambda: {"scheduler": engine_client.stats().to_dict()},
                          lambda text: (engine_client.insert_prefix(text), 3)[1])
    chan.start()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        def ask(msg: str) -> dict:
            sock.send_string(msg)
            return json.loads(sock.recv())

        assert ask("ping") == {"ok": True, "reply": "pong"}
        assert "running" in ask("metrics")["metrics"]["scheduler"]
        assert ask("warm You are a helpful assistant.")["ok"] is True
        assert ask("bogus")["ok"] is False and ask("warm")["ok"] is False
    finally:
        sock.close()
        chan.stop()


def test_serve_help_lists_env_vars():
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    out = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    for name in ("MAX_INFLIGHT_TOTAL", "MAX_INFLIGHT_PER_ENGINE", "WARM_PREFIXES", "SCHEDULER_MODE", "ZMQ_CONTROL",
                 "ZMQ_CONTROL_ENDPOINT", "MODEL_NAME", "MODEL_LOCAL_DIR", "ADAPTIVE_MAX_NEW_TOKENS",
                 "MINISGL_API_KEY", "MAX_QUEUED_REQUESTS", "MAX_BODY_BYTES", "--port", "--host", "--image-model-dir"):
        assert name in out, name


@pytest.mark.parametrize("args,total", [
    ([], None),  # the server's default cap: 16 x the running slots, at least 2048 (test_server_bounds.py)
    (["--max-inflight-total", "0"], 0),  # no cap, asked for
    (["--max-inflight-total", "7"], 7),
    (["--max-inflight-per-engine", "3"], 3),
    (["--max-inflight-total", "0", "--max-inflight-per-engine", "3"], 3),
])
def test_serve_caps_reach_the_server_settings(monkeypatch, args, total):
    """What `serve`'s cap flags hand the server (the launch itself replaced: nothing starts)."""
    from typer.testing import CliRunner

    from minisgl_cli.app import app
    from minisgl_cli.server import launch

    seen = []
    monkeypatch.setattr(launch, "serve", lambda make_client, settings, cfg: seen.append(settings))
    out = CliRunner().invoke(app, ["serve", *args])
    assert out.exit_code == 0, out.output
    assert seen[0].max_inflight_total == total and seen[0].max_body_bytes == 32 * 1024 * 1024


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_gpu_engine_flags_reach_the_engine_config(command):
    """--cuda-graph-max-bs / --disable-cuda-graph / --attention-backend are listed and land in EngineConfig;
    sizes below 1 are refused with a usage error (exit 2) before any model loads (page size 0 used to
    crash with a ZeroDivisionError)."""
    from typer.testing import CliRunner

    from commands.common import EngineOptions
    from minisgl_cli.app import app

    out = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"}).output
    for flag in (
        "--cuda-graph-max-bs",
        "--disable-cuda-graph",
        "--disable-overlap",
        "--attention-backend",
        "--mem-fraction",
    ):
        assert flag in out, flag
    for flag in ("--cuda-graph-max-bs", "--page-size", "--max-running-requests", "--max-prefill-tokens",
                 "--mem-fraction"):
        bad = CliRunner().invoke(app, [command, flag, "0"], env={"COLUMNS": "200"})
        assert bad.exit_code == 2 and flag in bad.output, (flag, bad.output)
    cfg = EngineOptions.from_params(
        dict(cuda_graph_max_bs=48, disable_cuda_graph=True, attention_backend="triton")
    ).engine
    assert (cfg.cuda_graph_max_bs, cfg.disable_cuda_graph, cfg.attention_backend) == (48, True, "triton")


def test_engine_options_from_command_params():
    """Only engine options are taken from a command's params; overrides win."""
    from commands.common import EngineOptions

    params = {"model": "m", "cache": ["radix", "naive"], "port": 8000, "cuda_graph_max_bs": 16, "verbose": True}
    opts = EngineOptions.from_params(params, cache="naive")
    assert (opts.engine.model, opts.scheduler.cache, opts.engine.cuda_graph_max_bs, opts.engine.page_size) == (
        "m", "naive", 16, 1)


def test_a_command_gets_the_engine_options_it_offers_as_one_object():
    """engine_options() adds the offered flags (with their env vars) to a command and hands it one EngineOptions;
    --model-local-dir / MODEL_LOCAL_DIR overrides --model; a flag the command does not offer is a usage error."""
    import typer
    from typer.testing import CliRunner

    from commands.common import MODEL, EngineOptions, engine_options

    app, seen = typer.Typer(), []

    @app.command()
    @engine_options((*MODEL, "cache"))
    def probe(*, opts: EngineOptions) -> None:
        seen.append(opts)

    ok = CliRunner().invoke(app, ["-m", "other", "--attention-backend", "triton", "--cache", "naive"],
                            env={"MODEL_LOCAL_DIR": "/models/x"})
    assert ok.exit_code == 0, ok.output
    got = seen[0]
    assert (got.engine.model, got.engine.attention_backend, got.scheduler.cache) == ("/models/x", "triton", "naive")
    bad = CliRunner().invoke(app, ["--page-size", "4"])
    assert bad.exit_code == 2 and "--page-size" in bad.output


def test_stream_interval_is_refused_where_no_detokenizer_process_runs():
    from typer.testing import CliRunner

    from minisgl_cli.app import app

    for args in (["--runtime", "in-process", "--stream-interval", "2"], ["--engine", "hf", "--stream-interval", "2"],
                 ["--stream-interval", "0"]):
        bad = CliRunner().invoke(app, ["serve", *args], env={"COLUMNS": "200"})
        assert bad.exit_code == 2 and "--stream-interval" in bad.output, (args, bad.output)
