"""Request deadlines: a request's `timeout` (and the server's --request-timeout) ends it with a 504 `request_timeout`
(a stream with that error frame) on every generation route, aborts it in the engine (its KV pages come back), and
a request may shorten the server's deadline but not lengthen it.

The shared engine (server_fixtures) behind real servers; a reply of thousands of tokens takes the CPU engine
far longer than the deadlines here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest
from server_fixtures import _serve, wait_idle

from minisgl_cli.server.app import ServerSettings

LONG = {"max_tokens": 4000, "ignore_eos": True}
MSG = [{"role": "user", "content": "Tell me a long story."}]


@pytest.fixture(scope="module")
def strict_url() -> Iterator[str]:
    """The shared engine behind a server whose deadline is one second (--request-timeout 1)."""
    yield from _serve(ServerSettings(request_timeout_s=1.0))


def _assert_timed_out(r: httpx.Response) -> None:
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["code"] == "request_timeout" and error["type"] == "server_error", error
    assert "timed out" in error["message"]


def _idle(engine_client) -> None:
    wait_idle(engine_client)
    engine_client.check_pages()
    assert engine_client.stats().tokens_in_use == 0


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": MSG, **LONG}),
    ("/v1/completions", {"prompt": ["Once upon a time", "In a land far away"], "n": 2, **LONG}),
    ("/generate", {"prompt": "Once upon a time", "max_new_tokens": 4000, "ignore_eos": True, "stream": False}),
], ids=["chat", "completions", "generate"])
def test_a_request_past_its_timeout_answers_504_and_frees_its_kv(server_url, engine_client, route, body):
    r = httpx.post(f"{server_url}{route}", json={**body, "timeout": 1}, timeout=120)
    _assert_timed_out(r)
    _idle(engine_client)


def test_a_stream_past_its_timeout_ends_with_a_request_timeout_frame(server_url, engine_client):
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)
    stream = client.chat.completions.create(model="default", messages=MSG, stream=True,
                                            extra_body={**LONG, "timeout": 1})
    texts = []
    with pytest.raises(openai.APIError) as caught:
        for chunk in stream:
            texts.append(chunk.choices[0].delta.content or "")
    assert "".join(texts)  # it streamed before its deadline
    assert caught.value.body["code"] == "request_timeout", caught.value.body  # type: ignore[index]
    with httpx.stream("POST", f"{server_url}/generate", json={"prompt": "Once upon a time", "max_new_tokens": 4000,
                                                              "ignore_eos": True, "timeout": 1}, timeout=120) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[0].get("text_delta") is not None
    assert lines[-1]["event"] == "error" and lines[-1]["error"]["code"] == "request_timeout", lines[-1]
    _idle(engine_client)


def test_the_servers_deadline_applies_to_every_request_and_may_only_be_shortened(strict_url, engine_client):
    _assert_timed_out(httpx.post(f"{strict_url}/v1/chat/completions", json={"messages": MSG, **LONG}, timeout=120))
    r = httpx.post(f"{strict_url}/v1/chat/completions", json={"messages": MSG, **LONG, "timeout": 5}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
    assert "--request-timeout" in r.json()["error"]["message"]
    r = httpx.post(f"{strict_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "timeout": 0.9}, timeout=120)
    assert r.status_code == 200, r.text  # a short request within its deadline
    _idle(engine_client)


@pytest.mark.parametrize("timeout", [0, -1, "soon", 10**9])
def test_a_timeout_that_is_not_a_duration_is_a_400_naming_it(server_url, timeout):
    r = httpx.post(f"{server_url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1, "timeout": timeout})
    assert r.status_code == 400 and r.json()["error"]["param"] == "timeout", r.text
