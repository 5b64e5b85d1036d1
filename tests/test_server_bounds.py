"""Bounded by default: one body cannot become unbounded work, and a flood past the in-flight cap is refused with
429 + Retry-After, all decided before any tokenizing, with nothing lost (no leaked KV page, nothing left running)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_fixtures import wait_idle
from test_server import _hold_stream
from test_server_errors import assert_openai_error

COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
# A generous bound (the old code took minutes: every prompt tokenized, one at a time); the refusal itself is
# measured in the test's output (-s): 0.25-1.2 s on 2 cores shared with other work, 2.1 s once, nearly all of it
# parsing the 4 MB of JSON.
REFUSED_WITHIN_S = 5.0


def engine_counts(url: str) -> tuple:
    """What the engine and the server have run so far: unchanged when a request never reached the engine."""
    m = httpx.get(f"{url}/metrics", timeout=60).json()
    e, s = m["scheduler"], m["server"]
    return (e["finished_requests"], e["aborted_requests"], e["prefill_tokens"], e["decode_tokens"],
            sum(s["finished"].values()))


def four_mb_of_prompts(**extra) -> bytes:
    prompts = ["hi"] * (4 * 1024 * 1024 // len('"hi", '))
    return json.dumps({"model": "default", "prompt": prompts, "max_tokens": 1, **extra}).encode()


def timed_post(server_url: str, path: str, body: bytes) -> tuple[httpx.Response, float]:
    """POST a JSON body on a connection already open: the seconds are the server's."""
    with httpx.Client(timeout=120) as http:
        http.get(f"{server_url}/health")
        t0 = time.perf_counter()
        r = http.post(f"{server_url}{path}", content=body, headers={"content-type": "application/json"})
        return r, time.perf_counter() - t0


@pytest.mark.parametrize("n", [1, 16])
def test_a_4mb_body_of_short_prompts_is_refused_quickly_and_reaches_no_engine(server_url, engine_client, n):
    body = four_mb_of_prompts(n=n)
    assert len(body) >= 4 * 1024 * 1024
    wait_idle(engine_client)
    before = engine_counts(server_url)
    r, took = timed_post(server_url, COMPLETIONS, body)
    print(f"\n4 MB body of {len(body) // 6} prompts, n={n}: {r.status_code} in {took * 1000:.0f} ms")
    err = assert_openai_error(r, 400)
    assert err["param"] == "prompt" and "at most 2048" in err["message"], err
    assert took < REFUSED_WITHIN_S
    assert engine_counts(server_url) == before
    engine_client.check_pages()
    r = httpx.post(f"{server_url}{COMPLETIONS}", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/generate"])
def test_a_4mb_chat_of_tiny_messages_is_refused_before_its_messages_are_read(server_url, engine_client, route):
    """127,000 messages: refused at 8192, before the rest are validated (1.4 s here) or rendered and tokenized
    (32 s of the tokenizer's time here)."""
    messages = HI * (4 * 1024 * 1024 // len(json.dumps(HI[0])))
    body = json.dumps({"messages": messages, "stream": False}).encode()
    wait_idle(engine_client)
    before = engine_counts(server_url)
    r, took = timed_post(server_url, route, body)
    print(f"\n4 MB chat of {len(messages)} messages to {route}: {r.status_code} in {took * 1000:.0f} ms")
    err = assert_openai_error(r, 400)
    assert err["param"] == "messages" and "at most 8192" in err["message"], err
    assert took < REFUSED_WITHIN_S
    assert engine_counts(server_url) == before


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": ["hi"] * 2049}, "prompt", "2049 prompts"),
    ({"prompt": [[1, 2]] * 2049}, "prompt", "2049 prompts"),  # token-id prompts count alike
    ({"prompt": ["hi"] * 200, "n": 16}, "n", "3200 completions"),
    ({"prompt": ["hi"] * 4, "n": 16, "best_of": 16}, None, None),  # 64: served (best_of = n multiplies nothing)
    ({"prompt": "hi", "stop": ["x" * 1025]}, "stop", "1025 characters"),
    ({"prompt": "hi", "regex": "a" * (64 * 1024 + 1)}, "regex", "65536"),
    ({"prompt": "hi", "ebnf": "a" * (64 * 1024 + 1)}, "ebnf", "65536"),
    ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"description": "a" * 64 * 1024}}}}, "response_format.json_schema.schema", "65536"),
    ({"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
])
def test_each_multiplier_and_grammar_is_bounded_naming_its_field(server_url, engine_client, body, param, message):
    wait_idle(engine_client)
    before = engine_counts(server_url)
    r = httpx.post(f"{server_url}{COMPLETIONS}", json={"max_tokens": 1, **body}, timeout=120)
    if param is None:
        assert r.status_code == 200 and len(r.json()["choices"]) == 64, r.text
        return
    err = assert_openai_error(r, 400)
    assert err["param"] == param and message in err["message"], err
    assert engine_counts(server_url) == before


@pytest.mark.parametrize("route,body,param", [
    ("/v1/chat/completions", {"messages": HI, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"description": "a" * 64 * 1024}}}]}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {"messages": HI, "stop": "x" * 1025}, "stop"),
    ("/v1/chat/completions", {"messages": HI, "n": 17}, "n"),
    ("/generate", {"prompt": "hi", "json_schema": {"description": "a" * 64 * 1024}}, "json_schema"),
    ("/generate", {"prompt": "hi", "regex": "a" * (64 * 1024 + 1)}, "regex"),
    ("/generate", {"prompt": "hi", "stop": ["x" * 1025]}, "stop"),
])
def test_chat_and_generate_share_the_bounds(server_url, route, body, param):
    err = assert_openai_error(httpx.post(f"{server_url}{route}", json=body, timeout=60), 400)
    assert err["param"] == param, err


def test_the_default_server_caps_requests_in_flight(server_url, engine_client):
    """No --max-inflight-total: 16 x the engine's running slots (64 here), at least 2048 (the most one body may ask
    for)."""
    assert engine_client.info.max_running == 64
    assert httpx.get(f"{server_url}/metrics", timeout=60).json()["server"]["max_inflight_total"] == 2048


def test_more_completions_than_the_cap_is_a_413_naming_n(capped_url, engine_client):
    before = engine_counts(capped_url)
    r = httpx.post(f"{capped_url}/v1/chat/completions", json={"messages": HI, "n": 3}, timeout=60)
    err = assert_openai_error(r, 413)
    assert err["param"] == "n" and err["code"] == "request_too_large", err
    r = httpx.post(f"{capped_url}{COMPLETIONS}", json={"prompt": ["a", "b", "c"], "max_tokens": 1}, timeout=60)
    assert assert_openai_error(r, 413)["param"] == "prompt"
    assert engine_counts(capped_url) == before


def test_a_busy_server_answers_429_before_tokenizing(capped_url, engine_client):
    """The cap is checked first: a prompt too long for the context gets the 429 while the server is full (it used
    to be tokenized first, then refused as too long), and the context's 400 once there is room."""
    body = {"prompt": "x " * 9000, "max_tokens": 1, "n": 2}
    with httpx.Client(timeout=120) as http:
        held = _hold_stream(capped_url, http)  # one of the two slots is taken while this stream is open
        try:
            r = http.post(f"{capped_url}{COMPLETIONS}", json=body)
            assert assert_openai_error(r, 429)["code"] == "too_many_requests" and r.headers["Retry-After"] == "1"
        finally:
            held.__exit__(None, None, None)
    wait_idle(engine_client)
    assert assert_openai_error(httpx.post(f"{capped_url}{COMPLETIONS}", json=body, timeout=120), 400)["param"] == \
        "prompt"


def test_a_flood_past_the_cap_gets_429s_and_loses_nothing(capped_url, engine_client):
    """40 requests at once at a server capped at 2 in flight: each is served (the same greedy text as alone) or
    refused with 429 + Retry-After; afterwards nothing is in flight, every page is accounted for, and the engine ran
    exactly the requests that were served."""
    wait_idle(engine_client)
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    alone = httpx.post(f"{capped_url}{COMPLETIONS}", json=body, timeout=120).json()["choices"][0]["text"]
    before_engine = engine_client.stats().finished_requests
    before_429 = httpx.get(f"{capped_url}/metrics", timeout=60).json()["server"]["rejected_429"]

    async def flood() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=50, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return list(await asyncio.gather(*(http.post(f"{capped_url}{COMPLETIONS}", json=body) for _ in range(40))))

    answers = asyncio.run(flood())
    served = [r for r in answers if r.status_code == 200]
    refused = [r for r in answers if r.status_code != 200]
    print(f"\nflood of 40 at a cap of 2: {len(served)} served, {len(refused)} refused with 429")
    assert served and refused
    for r in refused:
        assert assert_openai_error(r, 429)["type"] == "rate_limit_error" and r.headers["Retry-After"] == "1"
    for r in served:
        text = r.json()["choices"][0]["text"]
        assert alone.startswith(text) and text, (text, alone)  # greedy; the adaptive cut may shorten it
    wait_idle(engine_client)
    engine_client.check_pages()
    stats = engine_client.stats()
    assert stats.tokens_in_use == 0 and stats.finished_requests - before_engine == len(served)
    server = httpx.get(f"{capped_url}/metrics", timeout=60).json()["server"]
    assert server["inflight"] == 0 and server["rejected_429"] - before_429 == len(refused)
