"""Bad input gets a 4xx with OpenAI's error body, never a 5xx, and the server keeps serving afterwards."""

from __future__ import annotations

import socket

import httpx
import pytest
from server_fixtures import API_KEY

CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (route, raw body or JSON, expected status)
CASES = [
    (CHAT, b"{not json", 422),
    (CHAT, b"", 422),
    (CHAT, b"[1, 2]", 422),
    (CHAT, {"messages": "hi"}, 422),
    (CHAT, {"messages": []}, 422),
    (CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 422),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 422),
    (CHAT, {"messages": MSG, "max_tokens": -1}, 422),
    (CHAT, {"messages": MSG, "max_tokens": "many"}, 422),
    (CHAT, {"messages": MSG, "max_tokens": 10**12}, 422),
    (CHAT, {"messages": MSG, "max_tokens": 100_000}, 400),
    (CHAT, {"messages": MSG, "temperature": -0.5}, 422),
    (CHAT, {"messages": MSG, "top_p": 0}, 422),
    (CHAT, {"messages": MSG, "n": 0}, 422),
    (CHAT, {"messages": MSG, "seed": 2**70}, 422),
    (CHAT, {"messages": MSG, "model": "gpt-9"}, 404),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 9000}], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": [], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "", "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 1}, 400),
    ("/v1/completions", {"prompt": "hi", "stream": "yes please"}, 422),
    ("/v1/completions", {"prompt": "x " * 9000, "max_tokens": 1}, 400),
    ("/generate", {"prompt": "hi", "input_ids": [1, 2]}, 400),
    ("/generate", {}, 400),
    ("/generate", {"prompt": "hi", "max_new_tokens": -3}, 422),
    ("/generate", {"input_ids": [-1]}, 400),
]


def assert_openai_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["type"]


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
    assert_openai_error(httpx.get(f"{server_url}/metrics?format=xml"), 422)


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
