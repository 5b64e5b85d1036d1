"""A prompt's path through the API: tokenized once, checked once, its ids shipped only where they are needed.

Counted on the real tokenizer, the real admission check and the real message encoder, in a real server of each
runtime: in-process (a LocalClient under uvicorn; the counters wrap this process's objects) and `minisgl serve` (the
same counters injected into every one of its processes). "Checked" counts the scans of the prompt's ids against the
vocabulary (the context check sits beside each); "shipped" counts the messages that carry them across a process; and
a prompt whose ids a tokenizer worker keeps is let go once its requests are done.
"""

from __future__ import annotations

import collections
import os
import time

import httpx
import pytest

CHAT = "/v1/chat/completions"
# Long enough that no other message or check has this many ids.
TEXT = "Tell me about the tides, the moon and the sea. " * 30

# The counters, injected into every process of a `minisgl serve` (a sitecustomize on PYTHONPATH): one line per event,
# "<what> <how many ids>", appended to the file $PROMPT_PATH_LOG.
COUNTERS = '''
import os

from minisgl_cli import admission, messages, tokenizer

LOG = os.environ["PROMPT_PATH_LOG"]


def note(what, n):
    with open(LOG, "a") as f:
        f.write(f"{what} {n}\\n")


def counted(owner, name, what, size):
    real = getattr(owner, name)

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        n = size(args, out)
        if n:
            note(what, n)
        return out

    setattr(owner, name, wrapper)


def shipped(args, out):
    msg = args[0]
    if isinstance(msg, messages.AddRequest):
        return len(msg.input_ids)
    if isinstance(msg, messages.TokenizeReply):
        if msg.ids is None and msg.error is None:
            note("kept", msg.qid)
        return len(msg.ids or ())
    if type(msg).__name__ == "ForgetPrompt":
        note("forgot", msg.key)
    return 0


counted(tokenizer.Tokenizer, "encode", "tokenized", lambda args, out: len(out))
counted(tokenizer.Tokenizer, "apply_chat_template", "tokenized", lambda args, out: len(out))
counted(admission, "_in_vocab", "checked", lambda args, out: len(args[0]))
counted(messages, "encode", "shipped", shipped)
'''


def _post(url: str, which: str) -> int:
    """One request (`which` of `_BODIES`), its prompt_tokens as usage reports it."""
    route, body, usage = _BODIES[which]
    r = httpx.post(f"{url}{route}", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return usage(r.json())


_BODIES = {
    "chat": (CHAT, {"messages": [{"role": "user", "content": TEXT}], "max_tokens": 2},
             lambda j: j["usage"]["prompt_tokens"]),
    "cmpl": ("/v1/completions", {"prompt": TEXT, "max_tokens": 2, "n": 2}, lambda j: j["usage"]["prompt_tokens"]),
    "gen": ("/generate", {"input_ids": list(range(5, 400)), "max_new_tokens": 2, "stream": False},
            lambda j: j["prompt_tokens"]),
}


def _counts(lines: list[str], tokens: int) -> dict[str, int]:
    """How many times a prompt of `tokens` ids was tokenized, checked and shipped."""
    c: collections.Counter[str] = collections.Counter()
    for line in lines:
        what, n = line.split()
        if what in ("tokenized", "checked", "shipped") and int(n) == tokens:
            c[what] += 1
    return {what: c[what] for what in ("tokenized", "checked", "shipped")}


def _held(lines: list[str]) -> set[str]:
    """The keys of the prompts a worker kept and the API process has not let go."""
    kept = {line.split()[1] for line in lines if line.startswith("kept ")}
    return kept - {line.split()[1] for line in lines if line.startswith("forgot ")}


def _assert_once(log: list[list[str]], usage: dict[str, int], processes: bool) -> None:
    chat, cmpl, gen = log
    assert usage["gen"] == 395  # the ids as given
    # The chat and the completion: tokenized once, where the design puts it, and checked there, once; the scheduler
    # trusts it. Across processes the ids go once per engine request, from the tokenizer worker to the scheduler
    # (the API process gets their number only): the chat's one, the completion's two choices.
    assert _counts(chat, usage["chat"]) == {"tokenized": 1, "checked": 1, "shipped": 1 if processes else 0}
    assert _counts(cmpl, usage["cmpl"]) == {"tokenized": 1, "checked": 1, "shipped": 2 if processes else 0}
    # Ids given to the API: checked there, once; they go to the tokenizer worker and on to the scheduler.
    assert _counts(gen, 395) == {"tokenized": 0, "checked": 1, "shipped": 2 if processes else 0}


@pytest.mark.slow
def test_a_prompt_is_tokenized_and_checked_once_and_its_ids_cross_once_in_serve(default_model_dir, tmp_path):
    from serve_process import Serve

    root = tmp_path / "injected"
    root.mkdir()
    (root / "sitecustomize.py").write_text(COUNTERS)
    log = tmp_path / "prompt-path.log"
    log.touch()
    path = ":".join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)
    server = Serve(default_model_dir, tmp_path, kv_tokens=4096, env={"PYTHONPATH": path, "PROMPT_PATH_LOG": str(log)})
    try:
        server.wait_healthy()
        per_request, usage = [], {}
        for name in _BODIES:
            start = len(log.read_text().splitlines())
            usage[name] = _post(server.url, name)
            per_request.append(log.read_text().splitlines()[start:])
        _assert_once(per_request, usage, processes=True)
        # Every prompt a worker kept is let go once its requests are done (their runs close just after the reply).
        deadline = time.monotonic() + 30
        while (held := _held(log.read_text().splitlines())) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not held
    finally:
        server.stop()


@pytest.mark.slow
def test_a_prompt_is_tokenized_and_checked_once_in_process(default_model_dir, monkeypatch):
    from minisgl_cli import admission
    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.server.app import ServerSettings, create_app

    lines: list[str] = []

    def counted(owner, name: str, what: str, size) -> None:
        real = getattr(owner, name)

        def wrapper(*args, **kwargs):
            out = real(*args, **kwargs)
            if n := size(args, out):
                lines.append(f"{what} {n}")
            return out

        monkeypatch.setattr(owner, name, wrapper)

    client = LocalClient(EngineConfig(max_total_tokens=4096, dtype="float32", quantization="none"))
    try:
        counted(client.tokenizer, "encode", "tokenized", lambda args, out: len(out))
        counted(client.tokenizer, "apply_chat_template", "tokenized", lambda args, out: len(out))
        counted(admission, "_in_vocab", "checked", lambda args, out: len(args[0]))
        with BackgroundServer(create_app(client, ServerSettings())) as url:
            per_request, usage = [], {}
            for name in _BODIES:
                start = len(lines)
                usage[name] = _post(url, name)
                per_request.append(lines[start:])
        _assert_once(per_request, usage, processes=False)
    finally:
        client.close()
