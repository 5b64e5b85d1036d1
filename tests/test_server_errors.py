"""Bad input gets a 4xx with OpenAI's error body, never a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_fixtures import API_KEY, wait_idle

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, raw body or JSON, expected status)
CASES = [
    (CHAT, b"{not json", 400),
    (CHAT, b"", 400),
    (CHAT, b"[1, 2]", 400),
    (CHAT, {"messages": "hi"}, 400),
    (CHAT, {"messages": []}, 400),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 400),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 400),
    (CHAT, {"messages": MSG, "max_tokens": 10**12}, 400),
    (CHAT, {"messages": MSG, "max_tokens": 100_000}, 400),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 400),
    (CHAT, {"messages": MSG, "top_p": 0}, 400),
    (CHAT, {"messages": MSG, "min_p": 2}, 400),
    (CHAT, {"messages": MSG, "repetition_penalty": 0}, 400),
    ("/v1/completions", {"prompt": "hi", "min_p": -0.1}, 400),
    ("/generate", {"prompt": "hi", "repetition_penalty": 0}, 400),
    ("/generate", {"prompt": "hi", "min_p": 2}, 400),
    (CHAT, {"messages": MSG, "n": 0}, 400),
    (CHAT, {"messages": MSG, "seed": 2**70}, 400),
    (CHAT, {"messages": MSG, "model": "gpt-9"}, 404),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes please"}, 400),
    ("/v1/completions", {"prompt": "x " * 9000, "max_tokens": 1}, 400),
    ("/generate", {"prompt": "hi", "input_ids": [1, 2]}, 400),
    ("/generate", {}, 400),
    ("/generate", {"prompt": "hi", "max_new_tokens": -3}, 400),
    ("/generate", {"input_ids": [-1]}, 400),
    # Every field is implemented or refused, never silently ignored.
    (CHAT, {"messages": MSG, "tools": "nope"}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, 400),
    (CHAT, {"messages": MSG, "tool_choice": "required"}, 400),
    (CHAT, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400),
    (CHAT, {"messages": MSG, "logit_bias": {"abc": "zzz"}}, 400),
    (CHAT, {"messages": MSG, "logit_bias": {"5": 101}}, 400),
    (CHAT, {"messages": MSG, "logit_bias": {"99999999": 1}}, 400),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, 400),
    (CHAT, {"messages": [{"role": "assistant", "content": None}]}, 400),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, 400),
    (CHAT, {"messages": MSG, "response_format": {"type": "xml"}}, 400),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema"}}, 400),
    (CHAT, {"messages": MSG, "response_format": "json"}, 400),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": 5}}}}, 400),
    (CHAT, {"messages": MSG, "regex": "((("}, 400),
    (CHAT, {"messages": MSG, "ebnf": "root ::= "}, 400),
    (CHAT, {"messages": MSG, "regex": "a", "ebnf": 'root ::= "a"'}, 400),
    (CHAT, {"messages": MSG, "logprobs": "maybe"}, 400),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, 400),
    (CHAT, {"messages": MSG, "frobnicate": 1}, 400),
    (CHAT, {"messages": MSG, "audio": {"voice": "alloy"}}, 400),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, 400),
    (CHAT, {"messages": MSG, "store": True}, 400),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": True, "x": 1}}, 400),
    ("/v1/completions", {"prompt": "hi", "echo": True}, 400),
    ("/v1/completions", {"prompt": "hi", "suffix": "!"}, 400),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, 400),
    ("/v1/completions", {"prompt": "hi", "logprobs": 99}, 400),
    ("/generate", {"prompt": "hi", "json_schema": "{not json"}, 400),
    ("/v1/embeddings", {"input": "hi", "model": "default"}, 400),
]


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]
    return err


@pytest.mark.parametrize("body,param", [
    ({"tools": "nope"}, "tools"), ({"logit_bias": {"abc": "zzz"}}, "logit_bias.abc"),
    ({"frobnicate": 1}, "frobnicate"), ({"audio": {}}, "audio"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"regex": "((("}, "regex"), ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"min_p": 2}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
])
def test_bad_field_errors_name_the_field(server_url, body, param):
    err = assert_openai_error(httpx.post(f"{server_url}{CHAT}", json={"messages": MSG, **body}, timeout=60), 400)
    assert err["param"] == param and param.split(".")[0] in err["message"]


@pytest.mark.parametrize("route,body,status", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input(server_url, route, body, status):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
        else {"json": body}
    r = httpx.post(f"{server_url}{route}", timeout=60, **kwargs)
    assert_openai_error(r, status)


def test_stream_errors_are_http_errors(server_url):
    """A streamed request that cannot run fails before any SSE frame: a plain 400, not a broken stream."""
    body = {"messages": [{"role": "user", "content": "x " * 9000}], "stream": True}
    assert_openai_error(httpx.post(f"{server_url}{CHAT}", json=body, timeout=60), 400)


def test_unknown_route_and_method(server_url):
    assert_openai_error(httpx.get(f"{server_url}/v1/nope"), 404)
    assert_openai_error(httpx.get(f"{server_url}{CHAT}"), 405)
    assert_openai_error(httpx.get(f"{server_url}/v1/models/gpt-9"), 404)
    assert_openai_error(httpx.get(f"{server_url}/metrics?format=xml"), 400)


def test_oversized_body(auth_url):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    big = {"messages": [{"role": "user", "content": "a" * (100 * 1024)}]}
    assert_openai_error(httpx.post(f"{auth_url}{CHAT}", json=big, headers=headers), 413)

    def chunks():  # no Content-Length: the cap is enforced while reading
        for _ in range(100):
            yield b"a" * 1024

    r = httpx.post(f"{auth_url}{CHAT}", content=chunks(), headers={**headers, "content-type": "application/json"})
    assert_openai_error(r, 413)


def test_bad_auth(auth_url):
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{auth_url}{CHAT}", json={"messages": MSG, "max_tokens": 1}, headers=headers)
        assert_openai_error(r, 401)


def test_garbage_on_the_socket(server_url):
    """Raw garbage bytes and a half-sent request do not disturb the server."""
    host, port = server_url.removeprefix("http://").split(":")
    for payload in (b"\x00\xff garbage\r\n\r\n", b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 100\r\n\r\n{"):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(payload)
    assert httpx.get(f"{server_url}/health").status_code == 200


def test_still_serving_after_bad_input(server_url, auth_url, engine_client):
    r = httpx.post(f"{server_url}{CHAT}", json={"messages": MSG, "max_tokens": 3}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    r = httpx.post(f"{auth_url}{CHAT}", json={"messages": MSG, "max_tokens": 3},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200
    m = httpx.get(f"{server_url}/metrics").json()
    assert not any(k.endswith(" 500") for k in m["server"]["requests"]), m["server"]["requests"]
    engine_client.check_pages()


# Refusals of the one admission check (the client's, under every route): status, OpenAI code, field, message.
ADMISSION = [
    (CHAT, {"messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 1},
     "context_length_exceeded", "messages", r"the prompt has \d+ tokens; the context limit is 8192"),
    (CHAT, {"messages": MSG, "max_tokens": 100_000}, "context_length_exceeded", "max_tokens",
     r"max_tokens=100000 is too large: the prompt has \d+ tokens"),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, None, "prompt", "the prompt is empty"),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, None, "prompt",
     "token id 1000000000 in prompt is out of range: the vocabulary has 49152 tokens"),
    ("/v1/completions", {"prompt": [[5, 6], [7, 10**9]], "max_tokens": 1}, None, "prompt",
     "token id 1000000000 in prompt is out of range"),
    ("/v1/completions", {"prompt": "x " * 9000, "max_tokens": 1}, "context_length_exceeded", "prompt",
     r"the prompt has \d+ tokens; the context limit is 8192"),
    ("/generate", {"input_ids": [-1]}, None, "input_ids", "token id -1 in input_ids is out of range"),
    ("/generate", {"prompt": "hi", "stop_token_ids": [10**7]}, None, "stop_token_ids",
     "token id 10000000 in stop_token_ids is out of range"),
    ("/generate", {"messages": MSG, "max_new_tokens": 9000}, "context_length_exceeded", "max_new_tokens",
     "max_new_tokens=9000 is too large"),
    ("/generate", {"input_ids": [1] * 8192}, "context_length_exceeded", "input_ids",
     "the prompt has 8192 tokens; the context limit is 8192"),
]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("route,body,code,param,message", ADMISSION, ids=[f"{a[0]}-{a[3]}-{i}"
                                                                         for i, a in enumerate(ADMISSION)])
def test_an_admission_refusal_names_its_field_and_runs_nothing(server_url, engine_client, route, body, code, param,
                                                               message, stream):
    """Whichever layer finds it (the route's budget or the client's admission), a refused request is a 400 before
    any frame, naming its field, with the engine left idle and its page accounting whole."""
    import re

    def counts() -> tuple[int, int, int]:
        server = httpx.get(f"{server_url}/metrics", timeout=60).json()["server"]
        return server["finished"].get("error", 0), server["finished"].get("stop", 0), server["disconnects"]

    before = counts()
    r = httpx.post(f"{server_url}{route}", json={**body, "stream": stream}, timeout=120)
    err = assert_openai_error(r, 400)
    assert (err["code"], err["param"]) == (code, param) and re.match(message, err["message"]), err
    assert counts() == before  # it never ran (a prompt beside it may have started: aborted at once, no disconnect)
    wait_idle(engine_client)
    engine_client.check_pages()
    assert engine_client.stats().tokens_in_use == 0


def test_a_body_the_engine_processes_cannot_carry_is_a_400_and_the_server_goes_on(server_url):
    """An integer past 64 bits inside a tool's JSON schema (found by the schema fuzz): msgpack cannot carry it to the
    tokenizer process. It used to kill the API's sender thread, after which every request hung; now it is that
    request's 400, and the next request is served."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "maximum": 10**30}}}
    r = httpx.post(f"{server_url}{CHAT}", json={"messages": MSG, "tools": [tool], "max_tokens": 2}, timeout=60)
    err = assert_openai_error(r, 400)
    assert err["param"] == "messages" and "past 64 bits" in err["message"], err
    r = httpx.post(f"{server_url}{CHAT}", json={"messages": MSG, "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_a_penalty_that_overflows_the_logits_is_served_and_stalls_nothing(server_url, temperature):
    """repetition_penalty=5e-324 (found by the schema fuzz) divides the logits into inf: the reply's logprobs were
    NaN (a 500: JSON has no NaN), and a sampled row spun the CPU sampler for ever, stalling every request. Now the
    reply is served (logprobs at OpenAI's floor) and the next request too."""
    body = {"messages": MSG, "max_tokens": 2, "logprobs": True, "repetition_penalty": 5e-324,
            "temperature": temperature}
    r = httpx.post(f"{server_url}{CHAT}", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert all(t["logprob"] >= -9999.0 for t in r.json()["choices"][0]["logprobs"]["content"])
    r = httpx.post(f"{server_url}{CHAT}", json={"messages": MSG, "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
