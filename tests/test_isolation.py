"""No request hurts another, and every ending is counted for what it is (issue 27): on the in-process client and
the multi-process runtime `serve` uses, on the real default model."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_fixtures import shared_client, wait_idle

from minisgl_cli.client.protocol import complete
from minisgl_cli.types import GenerateRequest, SamplingParams

HI = [{"role": "user", "content": "Name three colors."}]


@pytest.fixture(scope="module")
def local_client():
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig

    c = LocalClient(EngineConfig(max_total_tokens=4096, dtype="float32", quantization="none"))
    yield c
    c.close()


@pytest.fixture(params=["in-process", "processes"])
def client(request, local_client):
    return local_client if request.param == "in-process" else shared_client()


def test_a_stop_string_finish_is_a_finish_not_an_abort(client):
    """The client ends a stop string's request before the scheduler sees it: that finish frees the KV at once
    and counts as finished, never as aborted."""
    base = asyncio.run(complete(client, GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=12))))
    stop = next(ch for ch in base.text[2:] if not ch.isspace())  # a character the greedy reply holds, not at once
    wait_idle(client)
    before = client.stats()
    out = asyncio.run(complete(client, GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=12,
                                                                                            stop=[stop]))))
    assert out.finish_reason == "stop" and stop not in out.text and base.text.startswith(out.text)
    wait_idle(client)
    after = client.stats()
    assert after.aborted_requests == before.aborted_requests
    assert after.finished_requests == before.finished_requests + 1
    assert after.tokens_in_use == 0
    client.check_pages()


def test_model_info_says_which_prefix_cache_serves(local_client):
    """--cache naive reuses nothing: the REPL and bench then show n/a, not "radix hit"."""
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.scheduler.config import SchedulerConfig

    assert local_client.info.prefix_cache == "radix"
    naive = LocalClient(EngineConfig(model="smollm2-135m", load_format="dummy", max_total_tokens=256),
                        SchedulerConfig(cache="naive"))
    try:
        assert naive.info.prefix_cache is None
    finally:
        naive.close()


def test_a_request_whose_decoding_fails_frees_its_stream_and_kv(local_client, monkeypatch):
    """An exception while turning one request's tokens into text (injected) reaches that request's consumer only:
    its stream entry is gone, its KV is freed, and the next request runs as before."""
    def broken(params):
        def feed(items):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return feed

    req = GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=8))
    good = asyncio.run(complete(local_client, req))
    with monkeypatch.context() as m:
        m.setattr(local_client, "_decoder", broken)
        with pytest.raises(UnicodeDecodeError):
            asyncio.run(complete(local_client, GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=8))))
    assert not local_client._streams
    wait_idle(local_client)
    assert local_client.stats().tokens_in_use == 0
    local_client.check_pages()
    again = asyncio.run(complete(local_client, GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=8))))
    assert again.text == good.text


def test_a_request_whose_send_or_decoder_fails_leaves_no_stream_behind(local_client, monkeypatch):
    """The steps between a stream's registration and its first output (building its decoder, sending it to the
    scheduler) may raise too (injected here): the caller gets the error, the stream's entry goes with it, and the
    same request id runs again at once (a left entry said "already in flight" for ever)."""
    from minisgl_cli.messages import AddRequest

    send = local_client._send

    def failing_send(msg):
        if isinstance(msg, AddRequest):
            raise RuntimeError("injected: the transport took nothing")
        send(msg)

    def failing_decoder(params):
        raise MemoryError("injected: no decoder")

    req = GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=4))
    for name, broken, error in (("_send", failing_send, RuntimeError), ("_decoder", failing_decoder, MemoryError)):
        with monkeypatch.context() as m:
            m.setattr(local_client, name, broken)
            with pytest.raises(error, match="injected"):
                asyncio.run(complete(local_client, req))
        assert not local_client._streams, name
        assert asyncio.run(complete(local_client, req)).finish_reason == "length", name
    wait_idle(local_client)
    assert local_client.stats().tokens_in_use == 0
    local_client.check_pages()


def test_out_of_vocabulary_ids_get_a_clear_error_and_others_finish_unchanged(local_client, server_url):
    """Token ids are never trusted: a prompt id, a stop id or a logit_bias key outside the vocabulary is refused
    with one clear message (on CUDA such an id would be a device-side assert), beside requests that finish as if
    alone."""
    import httpx

    plain = GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=8))
    alone = asyncio.run(complete(local_client, plain)).text
    vocab = local_client.info.vocab_size
    bad = [GenerateRequest(input_ids=[1, vocab + 5]),
           GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=4, stop_token_ids=[-1])),
           GenerateRequest(messages=HI, params=SamplingParams(max_new_tokens=4, logit_bias={10**9: 5.0}))]

    async def together():
        return await asyncio.gather(*(complete(local_client, r) for r in [*bad, GenerateRequest(
            messages=HI, params=SamplingParams(max_new_tokens=8))]), return_exceptions=True)

    *refused, ok = asyncio.run(together())
    for r, field in zip(refused, ["input_ids", "stop_token_ids", "logit_bias"]):
        assert isinstance(r, ValueError) and f"in {field} is out of range" in str(r), r
    assert ok.text == alone
    wait_idle(local_client)
    local_client.check_pages()

    for body, param in [({"input_ids": [1, 2, 10**7]}, "input_ids"),
                        ({"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids")]:
        r = httpx.post(f"{server_url}/generate", json={**body, "max_new_tokens": 4, "stream": False}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "out of range" in err["message"]


def _serve_with(model, tmp_path, files: dict[str, str]):
    """A real `minisgl serve` whose processes (the children too: a spawned interpreter reads PYTHONPATH) import
    `files` (path under a private dir -> source) first: how a test hides a library or injects a fault."""
    import os

    from serve_process import Serve

    root = tmp_path / "injected"
    for name, source in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    path = ":".join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    return Serve(model, tmp_path, env={"PYTHONPATH": path})


def _chat(server, **extra):
    import httpx

    return httpx.post(f"{server.url}/v1/chat/completions", timeout=120, json={
        "model": "default", "messages": HI, "max_tokens": 12, "temperature": 0, **extra})


# Injected into every process of the server: a request whose stop strings hold this marker cannot be decoded.
FAILING_DECODE = '''
from minisgl_cli import tokenizer

_init, _spans = tokenizer.RequestDecoder.__init__, tokenizer.RequestDecoder.spans


def __init__(self, tok, params):
    _init(self, tok, params)
    self.injected = "<cannot-decode>" in params.stop


def spans(self, items):
    if self.injected:
        raise UnicodeDecodeError("utf-8", b"\\xff", 0, 1, "injected by the test")
    return _spans(self, items)


tokenizer.RequestDecoder.__init__, tokenizer.RequestDecoder.spans = __init__, spans
'''


@pytest.fixture(scope="module")
def injected_server(default_model_dir, tmp_path_factory):
    """One healthy server for both injections below (a start of the default model costs ~10 s of the suite): xgrammar
    hidden, and FAILING_DECODE, which touches only requests that ask for it by their stop strings."""
    server = _serve_with(default_model_dir, tmp_path_factory.mktemp("injected"), {
        "xgrammar/__init__.py": 'raise ImportError("xgrammar is hidden by this test")\n',
        "sitecustomize.py": FAILING_DECODE})
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_structured_output_without_xgrammar_is_a_400_and_the_server_goes_on(injected_server):
    """A plain install lacks xgrammar: a JSON request gets a 400 naming the extra to install, while the requests
    beside it finish, and the server (every process of it) lives on."""
    import concurrent.futures

    server = injected_server
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(_chat, server) for _ in range(3)]
        structured = pool.submit(_chat, server, response_format={"type": "json_object"})
        r = structured.result()
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert 'pip install "minisgl[structured]"' in err["message"] and err["code"] == "unsupported_feature"
        assert all(f.result().status_code == 200 for f in plain)
    assert server.proc.poll() is None and server.answers()


@pytest.mark.slow
def test_a_request_the_detokenizer_cannot_decode_fails_alone(injected_server):
    """In the real multi-process server, the detokenizer's decoding of one request raises (injected): that request
    ends with an engine error, the streams beside it finish with the text they have alone, its KV is freed, and
    the detokenizer (every process) lives on."""
    import concurrent.futures

    import httpx
    import psutil

    server = injected_server
    alone = _chat(server).json()["choices"][0]["message"]["content"]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        plain = [pool.submit(_chat, server, stream=False) for _ in range(3)]
        failing = pool.submit(_chat, server, stop=["<cannot-decode>"]).result()
        assert failing.status_code == 500, failing.text
        err = failing.json()["error"]
        assert err["code"] == "engine_error" and "could not decode the output" in err["message"], err
        assert [f.result().json()["choices"][0]["message"]["content"] for f in plain] == [alone] * 3
    assert server.proc.poll() is None and server.answers()
    assert all(psutil.pid_exists(pid) for pid in server.children().values())
    deadline = time.monotonic() + 30  # the failed request's abort reaches the scheduler after its error
    while (s := httpx.get(f"{server.url}/metrics", timeout=30).json()["scheduler"])["tokens_in_use"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.2)
