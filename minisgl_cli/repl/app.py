"""The chat loop: read a line (prompt-toolkit on a terminal, plain stdin on a pipe), act on it, stream replies.

Keys (terminal): Enter submits; Esc then Enter (Alt+Enter) inserts a newline; Ctrl-C during a reply
cancels the generation task, which closes the engine stream and so aborts the request and frees its KV;
Ctrl-C at the prompt clears the line; Ctrl-D or /exit leaves. History persists in
$MINISGL_HOME/chat_history (default ~/.local/state/minisgl/chat_history).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import termios
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from prompt_toolkit import PromptSession
from prompt_toolkit.completion import Completer, Completion
from prompt_toolkit.document import Document
from prompt_toolkit.formatted_text import HTML
from prompt_toolkit.history import FileHistory, History, InMemoryHistory
from prompt_toolkit.input import Input
from prompt_toolkit.key_binding import KeyBindings
from prompt_toolkit.output import Output
from prompt_toolkit.patch_stdout import patch_stdout

from minisgl_cli import env
from minisgl_cli.client.protocol import EngineClient
from minisgl_cli.repl.session import COMMANDS, ChatSession, Turn
from minisgl_cli.repl.view import ChatView
from minisgl_cli.vision.vlm import VlmChat, has_images

log = logging.getLogger("minisgl.chat")


def history_path() -> Path:
    return env.state_dir() / "chat_history"


def open_history(path: Path | None) -> History:
    """A FileHistory at path; an in-memory one when the directory cannot be created (read-only home)."""
    if path is None:
        return InMemoryHistory()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(exist_ok=True)
    except OSError:
        return InMemoryHistory()
    return FileHistory(str(path))


class SlashCompleter(Completer):
    """Completes slash-command names (with their help as meta) while the line is just '/name'."""

    def get_completions(self, document: Document, complete_event) -> Iterator[Completion]:
        text = document.text_before_cursor
        if not text.startswith("/") or " " in text:
            return
        for name, (arg, help_) in COMMANDS.items():
            if name.startswith(text.lower()):
                yield Completion(name, start_position=-len(text), display=f"{name} {arg}".strip(), display_meta=help_)


class LineSource(Protocol):
    async def read(self) -> str | None:
        """The next input line; None at end of input. May raise KeyboardInterrupt (Ctrl-C at the prompt)."""

    def hold(self) -> contextlib.AbstractContextManager[None]:
        """While a reply streams: input typed meanwhile waits for the next read, and is not shown in the reply."""


class PromptLines:
    """Lines from a prompt-toolkit PromptSession: history, completion, Esc+Enter for newlines."""

    def __init__(self, session: ChatSession, history: History, input: Input | None = None,
                 output: Output | None = None):
        keys = KeyBindings()

        # Registered after prompt-toolkit's own bindings, so this wins over its Meta+Enter = accept.
        @keys.add("escape", "enter")
        def _newline(event) -> None:
            event.current_buffer.insert_text("\n")

        self.chat = session
        self.prompt: PromptSession[str] = PromptSession(
            history=history, completer=SlashCompleter(), complete_while_typing=True, key_bindings=keys,
            multiline=False, input=input, output=output, bottom_toolbar=self._toolbar,
            prompt_continuation=lambda width, line_no, wrap: "... ".rjust(width),
        )

    def _toolbar(self) -> HTML:
        s = self.chat.settings
        mode = "multi-turn" if s.multi_turn else "single-turn"
        return HTML(f" {mode} · temp {s.temperature:g} · max {s.max_new_tokens} tok · "
                    "Esc+Enter newline · Ctrl-C stop · /help")

    async def read(self) -> str | None:
        try:
            # Lines another thread prints meanwhile (a notice: the compiled CPU decode is built) go above the
            # prompt, which is drawn again under them, not into the line being typed.
            with patch_stdout(raw=True):
                return await self.prompt.prompt_async(HTML("<b><ansicyan>you</ansicyan></b> › "))
        except EOFError:
            return None

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """The terminal's echo off while a reply streams: keys typed then are not written into the reply (a tty echoes
        them as they come, outside prompt-toolkit); its line discipline keeps them, and the next prompt reads them
        as typed there (Enter included: a line typed ahead is sent). Ctrl-C still interrupts (ISIG stays on)."""
        try:
            fd = self.prompt.input.fileno()
            old = termios.tcgetattr(fd)
        except (OSError, NotImplementedError, termios.error, ValueError):  # not a terminal (a test's pipe)
            yield
            return
        quiet = list(old)
        quiet[3] &= ~(termios.ECHO | termios.ECHONL)  # the local modes
        termios.tcsetattr(fd, termios.TCSANOW, quiet)  # not TCSAFLUSH: what was typed stays
        try:
            yield
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, old)


class PipedLines:
    """Lines from a non-terminal stdin: one prompt (or slash command) per line."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdin

    async def read(self) -> str | None:
        line = await asyncio.get_running_loop().run_in_executor(None, self.stream.readline)
        return line.rstrip("\n") if line else None

    def hold(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()  # the next lines wait in the pipe; nothing echoes them


class ChatApp:
    """Runs the REPL: one line at a time, one reply streaming at a time, interruptible."""

    def __init__(self, client: EngineClient, session: ChatSession, view: ChatView, lines: LineSource,
                 catch_sigint: bool = True, vlm: VlmChat | None = None):
        self.client = client
        self.vlm = vlm  # chats with images (/image) go to it
        session.vision = vlm is not None or client.info.images  # /image: the transformers VLM's, or the engine's
        self.session = session
        self.view = view
        self.lines = lines
        self.catch_sigint = catch_sigint
        self.current: asyncio.Task | None = None
        self.streaming = asyncio.Event()  # set once the current reply has streamed its first delta

    @property
    def busy(self) -> bool:
        return self.current is not None and not self.current.done()

    def interrupt(self) -> bool:
        """Cancel the reply in progress (what Ctrl-C does); True when there was one."""
        if not self.busy:
            return False
        assert self.current is not None  # busy: a reply task is running
        self.current.cancel()
        return True

    async def run(self) -> int:
        self.view.attach_logs()
        try:
            while True:
                try:
                    line = await self.lines.read()
                except KeyboardInterrupt:
                    continue  # Ctrl-C at the prompt: drop the line, stay in the REPL
                if line is None:
                    break
                action = self.session.handle(line)
                if action.kind == "exit":
                    break
                if action.kind == "generate":
                    await self.turn(action.text)
                elif action.kind == "stats":
                    self.show_stats()
                elif action.kind == "error":
                    self.view.error(action.text)
                elif action.kind in ("reply", "help"):
                    self.view.note(action.text)
        finally:
            self.view.detach_logs()
        return 0

    async def turn(self, text: str) -> Turn | None:
        """Generate one reply as a task Ctrl-C can cancel; record it in the session."""
        self.streaming.clear()
        task = asyncio.create_task(self._generate(text))
        self.current = task
        try:
            with self._sigint_cancels(), self.lines.hold():
                await asyncio.wait([task])
        finally:
            if not task.done():  # the REPL itself is being torn down
                task.cancel()
            self.current = None
        if task.cancelled():  # cancelled before the stream opened: nothing to abort yet
            self.view.note("interrupted", style="yellow")
            return None
        turn = task.result()
        self.session.record(turn)
        if turn.error:
            self.view.error(turn.error)
        return turn

    async def _generate(self, text: str) -> Turn:
        parts: list[str] = []
        try:
            req, turn = self.session.begin(text)
        except ValueError as exc:
            return Turn(user=text, reply="", error=str(exc))
        assert req.messages is not None  # a chat session sends messages
        # A chat that holds images goes to the vision-language model; /image attaches them only when one is loaded.
        source = self.vlm.submit(req) if self.vlm is not None and has_images(req.messages) else self.client.submit(req)
        with self.view.reply() as stream:
            try:
                # aclosing: leaving early (cancel, error) closes the stream, which aborts the request.
                async with contextlib.aclosing(source) as deltas:
                    async for delta in deltas:
                        self.streaming.set()
                        if delta.error:
                            turn.error = delta.error
                            break
                        if delta.text:
                            log.info("chunk streamed: %r", delta.text)
                            parts.append(delta.text)
                            stream.feed(delta.text)
                        if delta.finished:
                            turn.finish_reason, turn.stats = delta.finish_reason, delta.stats
            except asyncio.CancelledError:
                turn.finish_reason = "abort"
                stream.end_interrupted()
            except ValueError as exc:  # the prompt could not be tokenized
                turn.error = str(exc)
            else:
                if turn.error is None:
                    stream.finish(turn.stats, turn.finish_reason)
        turn.reply = "".join(parts)
        return turn

    @contextlib.contextmanager
    def _sigint_cancels(self) -> Iterator[None]:
        """While a reply streams, SIGINT cancels it instead of raising KeyboardInterrupt in the loop."""
        loop = asyncio.get_running_loop()
        try:
            if not self.catch_sigint:
                raise ValueError("off")
            loop.add_signal_handler(signal.SIGINT, self.interrupt)
        except (ValueError, RuntimeError):  # off, or not the main thread: signals are the main thread's
            yield
            return
        try:
            yield
        finally:
            loop.remove_signal_handler(signal.SIGINT)  # restores Python's default KeyboardInterrupt

    def show_stats(self) -> None:
        stats = [t.stats for t in self.session.turns if t.stats]
        prompt = sum(s.prompt_tokens for s in stats)
        cached = sum(s.cached_tokens for s in stats)
        out = sum(s.completion_tokens for s in stats)
        rows = [
            ("session turns (in context)", f"{len(self.session.turns)} ({len(self.session.history) // 2})"),
            ("session prompt / cached tokens", f"{prompt:,} / {cached:,} ({cached / prompt if prompt else 0:.0%})"
             if self.client.info.prefix_cache else f"{prompt:,} / n/a"),
            ("session generated tokens", f"{out:,}"),
        ]
        self.view.stats(self.client.stats(), self.client.info.page_size, rows)


def load_engine(
    view: ChatView, model: str | None, load_format: str, make_client: Callable[[], EngineClient]
) -> EngineClient:
    """Load the engine step by step under a spinner that names each step. ModelLoadError propagates."""
    if load_format != "dummy":
        from minisgl_cli.loader.resolve import resolve_model

        with view.loading(f"resolving model {model or 'default (bundled SmolLM2-135M-Instruct GGUF)'} "
                          "(a GGUF converts once to a cached HF dir) ..."):
            resolved = resolve_model(model)
        if resolved.converted:
            view.note(f"converted GGUF -> {resolved.path}", style="dim")
        where = resolved.name
    else:
        where = f"{model or 'smollm2-135m'} (random weights)"
    with view.loading(f"loading weights of {where}, sizing and allocating the KV pool ..."):
        return make_client()


def run_chat(client: EngineClient, session: ChatSession, view: ChatView, interactive: bool,
             vlm: VlmChat | None = None) -> int:
    """Run the REPL to the end on a fresh event loop (terminal: prompt-toolkit; pipe: stdin lines)."""
    lines: LineSource = PromptLines(session, open_history(history_path())) if interactive else PipedLines()
    s = session.settings
    view.ready(client.info, [
        "multi-turn" if s.multi_turn else "single-turn (each prompt stands alone)",
        f"temperature {s.temperature:g}", f"max {s.max_new_tokens} new tokens",
        *([f"images: /image PATH ({vlm.name})"] if vlm is not None else
          ["images: /image PATH"] if client.info.images else []),
        *(["/help for commands, Ctrl-D to leave"] if interactive else [])])
    return asyncio.run(ChatApp(client, session, view, lines, vlm=vlm).run())
