"""No request hurts another, and every ending is counted for what it is (issue 27): on the in-process client and
the multi-process runtime `serve` uses, on the real default model."""

from __future__ import annotations

import asyncio

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
