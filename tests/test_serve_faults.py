"""`minisgl serve` whose engine dies or hangs under load answers what a client (or a router) can act on.

A dead child — the scheduler rank, the tokenizer worker or the detokenizer — is a 503 with Retry-After for every
request it leaves unfinished (never the input's 400), or, for a stream already under way, an `engine_unavailable`
error frame; requests waiting at the tokenizer then get the same 503. A hung scheduler (SIGSTOP) ends its requests
by their deadline (504, or a `request_timeout` frame), and once it runs again their KV pages are back in the pool.

Real servers of the default model with a tokenizer worker (`--num-tokenizer 1`), a few concurrent clients (the
official `openai` client; httpx for /generate), each fault in a server of its own (a dead child stops the server).
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import openai
import psutil
import pytest
from serve_process import Serve, gone

pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "Tell me a long story about a lighthouse."}]
LONG = 1500  # tokens: no reply of that length ends on the CPU within these tests


@dataclass
class Outcome:
    """How one request ended: its HTTP status (None: no connection), Retry-After, the error code (of the body or of
    the stream's error frame) and the frames it streamed before."""

    what: str
    status: int | None
    retry_after: str | None = None
    code: str | None = None
    frames: int = 0


def chat(url: str, stream: bool, started: threading.Event | None = None, **extra) -> Outcome:
    what = f"chat {'stream' if stream else 'json'}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    frames = 0
    try:
        if not stream:
            client.chat.completions.create(model="default", messages=MSG, max_tokens=LONG,  # type: ignore[arg-type]
                                           extra_body={"ignore_eos": True, **extra})
            return Outcome(what, 200)
        for _ in client.chat.completions.create(model="default", messages=MSG, max_tokens=LONG,  # type: ignore
                                                stream=True, extra_body={"ignore_eos": True, **extra}):
            frames += 1
            if started is not None:
                started.set()
        return Outcome(what, 200, frames=frames)
    except openai.APIStatusError as e:
        return Outcome(what, e.status_code, e.response.headers.get("retry-after"), _code(e.body))
    except openai.APIConnectionError:
        return Outcome(what, None)
    except openai.APIError as e:  # the error frame of a stream under way
        return Outcome(what, 200, None, _code(e.body), frames)


def completions(url: str, stream: bool, max_tokens: int = LONG, **extra) -> Outcome:
    what = f"completions {'stream' if stream else 'json'}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    frames = 0
    try:
        reply = client.completions.create(model="default", prompt="Once upon a time", max_tokens=max_tokens,
                                          stream=stream, extra_body={"ignore_eos": True, **extra})
        for _ in reply if stream else ():  # type: ignore[union-attr]
            frames += 1
        return Outcome(what, 200, frames=frames)
    except openai.APIStatusError as e:
        return Outcome(what, e.status_code, e.response.headers.get("retry-after"), _code(e.body))
    except openai.APIConnectionError:
        return Outcome(what, None)
    except openai.APIError as e:
        return Outcome(what, 200, None, _code(e.body), frames)


def generate(url: str, stream: bool, started: threading.Event | None = None, **extra) -> Outcome:
    what = f"generate {'stream' if stream else 'json'}"
    body = {"prompt": "Once upon a time", "max_new_tokens": LONG, "ignore_eos": True, "stream": stream, **extra}
    try:
        with httpx.stream("POST", f"{url}/generate", json=body, timeout=120) as r:
            if r.status_code != 200:
                r.read()
                try:
                    error = r.json().get("error")
                except ValueError:  # not our error body (uvicorn's own 500 is plain text): name it in the outcome
                    error = {"code": f"not JSON: {r.text[:60]!r}"}
                return Outcome(what, r.status_code, r.headers.get("retry-after"), _code(error))
            frames, last = 0, {}
            for line in r.iter_lines():
                if line:
                    frames, last = frames + 1, json.loads(line)
                    if started is not None:
                        started.set()
        return Outcome(what, 200, None, _code(last.get("error")), frames)
    except httpx.TransportError:
        return Outcome(what, None)


def _code(error: object) -> str | None:
    return error.get("code") if isinstance(error, dict) else None


def start_serve(default_model_dir, tmp_path, *args: str) -> tuple[Serve, dict[str, psutil.Process]]:
    """A healthy server and its children as psutil sees them under it."""
    s = Serve(default_model_dir, tmp_path, "--num-tokenizer", "1", *args, kv_tokens=8192)  # room for the replies
    s.wait_healthy()
    tree = {p.pid: p for p in psutil.Process(s.proc.pid).children(recursive=True)}
    children = {name: tree[pid] for name, pid in s.children().items()}  # KeyError: not serve's child
    assert set(children) == {"scheduler rank 0", "tokenizer 0", "detokenizer"}
    return s, children


def wait_connections(s: Serve, n: int) -> None:
    """Until the server holds `n` client connections."""
    server = psutil.Process(s.proc.pid)
    connections = getattr(server, "net_connections", None) or server.connections  # psutil < 6: connections
    deadline = time.monotonic() + 60
    while sum(c.status == psutil.CONN_ESTABLISHED and c.laddr.port == s.port for c in connections("tcp")) < n:
        assert time.monotonic() < deadline, f"fewer than {n} connections"
        time.sleep(0.05)


def under_way(pool: ThreadPoolExecutor, url: str) -> list[Future[Outcome]]:
    """Streams that have their first frames, and replies not streamed, running on the engine."""
    started = [threading.Event(), threading.Event()]
    running = [pool.submit(chat, url, True, started[0]), pool.submit(generate, url, True, started[1]),
               pool.submit(completions, url, False), pool.submit(generate, url, False)]
    for event in started:
        assert event.wait(180), [f.result() for f in running if f.done()]
    return running


@pytest.mark.parametrize("kind", ["scheduler rank 0", "tokenizer 0", "detokenizer"])
def test_a_dead_child_is_a_503_with_retry_after_or_an_engine_unavailable_frame_never_a_400(default_model_dir,
                                                                                            tmp_path, kind):
    """Then serve exits non-zero with one line naming the child, and every process under it is gone (as
    test_serve_lifecycle.py's dead-child test asks of an idle server: these kinds die here, under load)."""
    s, children = start_serve(default_model_dir, tmp_path)
    tree = psutil.Process(s.proc.pid).children(recursive=True)
    tokenizer = children["tokenizer 0"]
    try:
        with ThreadPoolExecutor(8) as pool:
            running = under_way(pool, s.url)
            # Requests waiting to be tokenized when the child dies: the tokenizer worker holds them (stopped).
            tokenizer.suspend()
            held = [pool.submit(chat, s.url, False), pool.submit(completions, s.url, True),
                    pool.submit(generate, s.url, False)]
            wait_connections(s, len(running + held))
            time.sleep(0.5)  # their bodies follow their connections: they reach the tokenizer
            children[kind].kill()
            outcomes = [f.result(timeout=60) for f in running + held]
            if kind != "tokenizer 0":
                tokenizer.resume()
            # Until the server stops: each new request is a 503 too, or finds the port closed.
            after: list[Outcome] = []
            while s.proc.poll() is None and len(after) < 20:
                after.append(completions(s.url, False, max_tokens=1))
        assert s.proc.wait(30) != 0
    finally:
        if tokenizer.is_running():
            tokenizer.resume()
        s.stop()
    lines = s.stderr().strip().splitlines()
    last = lines[next(i for i, line in enumerate(lines) if line.startswith("minisgl: serving ")) + 1:]
    assert len(last) == 1, lines
    assert last[0].startswith("error: ") and f"{kind} (pid {children[kind].pid}) exited with code -9" in last[0], lines
    assert gone(tree) == []
    tail = lines[-15:]  # the server's last lines: a traceback behind an unexpected answer
    assert not [o for o in outcomes + after if o.status == 400], (outcomes + after, tail)
    for o in outcomes[:2]:  # the streams under way: their error frame
        assert (o.status, o.code) == (200, "engine_unavailable") and o.frames > 0, (o, tail)
    for o in outcomes[2:] + [o for o in after if o.status is not None]:
        if o.status == 200 and o.frames:  # a stream (held) whose head went out before the engine's end was known
            assert o.code == "engine_unavailable", (o, tail)
        else:
            assert (o.status, o.code) == (503, "engine_unavailable") and o.retry_after, (o, tail)


def test_a_hung_scheduler_ends_every_request_by_its_deadline_and_frees_them_once_it_runs_again(default_model_dir,
                                                                                                tmp_path):
    deadline = 8
    s, children = start_serve(default_model_dir, tmp_path, "--request-timeout", str(deadline))
    scheduler = children["scheduler rank 0"]
    try:
        with ThreadPoolExecutor(8) as pool:
            running = under_way(pool, s.url)
            scheduler.suspend()  # SIGSTOP: alive, silent
            stopped = time.monotonic()
            later = [pool.submit(chat, s.url, False), pool.submit(completions, s.url, True, timeout=2)]
            outcomes = [f.result(timeout=120) for f in running + later]
            waited = time.monotonic() - stopped
        scheduler.resume()
        # The aborts reach the scheduler as it runs again: nothing of those requests stays in the pool.
        for _ in range(600):
            sched = httpx.get(f"{s.url}/metrics", timeout=30).json()["scheduler"]
            if sched["running"] == sched["waiting"] == sched["tokens_in_use"] == 0:
                break
            time.sleep(0.1)
        assert sched["running"] == sched["waiting"] == sched["tokens_in_use"] == 0, sched
        assert s.answers()
    finally:
        if scheduler.is_running():
            scheduler.resume()
        s.stop()
    assert waited < deadline + 30, waited  # by the deadline (generous: 2 shared cores)
    for o in outcomes:
        if o.frames:  # a stream under way: its error frame
            assert (o.status, o.code) == (200, "request_timeout"), o
        else:
            assert (o.status, o.code) == (504, "request_timeout"), o
    assert [o.frames > 0 for o in outcomes] == [True, True, False, False, False, False], outcomes
