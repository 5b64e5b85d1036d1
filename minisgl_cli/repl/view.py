"""Rich rendering for chat: the streaming reply, the per-turn status line, /stats, and the verbose log panel.

On a terminal the reply streams inside a rich Live region (with the log panel under it when --verbose);
on a pipe everything is plain text, no escape codes: replies on one console, notes on another.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterator

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from minisgl_cli.types import ModelInfo, RequestStats, SchedulerStats

LOGGERS = "minisgl"  # parent of minisgl.scheduler / .client / .engine / .chat


def status_line(stats: RequestStats | None, finish_reason: str | None, prefix_cache: str | None = "radix",
                speculative: bool = False) -> str:
    """One compact line of per-turn figures: prompt, cached share (`prefix_cache` names the engine's cache;
    None: it has none, n/a), prefill/TTFT, decode speed (with `speculative`: tokens per step and accepted draft
    tokens per second), finish."""
    if stats is None:
        return f"finish {finish_reason or '?'}"
    hit = stats.cached_tokens / stats.prompt_tokens if stats.prompt_tokens else 0.0
    parts = [
        f"prompt {stats.prompt_tokens} tok",
        f"cached {stats.cached_tokens} ({hit:.0%} {prefix_cache} hit)" if prefix_cache else "cached n/a",
        # Prefill excludes queueing; TTFT (submit to first token) includes it.
        f"prefill {stats.prefill_s * 1000:.0f} ms",
        f"TTFT {stats.ttft_s * 1000:.0f} ms",
        f"decode {stats.decode_tok_s:.1f} tok/s",
        *([f"accept {stats.accept_length:.2f} tok/step ({stats.drafted_tok_s:.1f} drafted tok/s)"]
          if speculative else []),
        f"{stats.completion_tokens} tok out",
        f"finish {finish_reason or '?'}",
    ]
    return " · ".join(parts)


class LogPanel(logging.Handler):
    """A logging handler that keeps the turn's engine log for the verbose panel.

    Prefill lines are pinned (there are few and they carry the cache story); decode and chunk lines
    keep only a tail so the panel stays a fixed size. Records arrive from the scheduler thread as well
    as the event loop, hence the lock.
    """

    def __init__(self, tail: int = 12, pinned: int = 4):
        super().__init__(logging.INFO)
        self.pinned: deque[str] = deque(maxlen=pinned)
        self.tail: deque[str] = deque(maxlen=tail)
        self.dropped = 0
        self.buf_lock = threading.Lock()  # not `lock`: logging.Handler uses that name itself
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = self.format(record).removeprefix(LOGGERS + ".")
        except Exception:  # a bad log call must never break the chat
            return
        with self.buf_lock:
            if record.name.endswith("scheduler"):
                self.pinned.append(line)
            else:
                self.dropped += len(self.tail) == self.tail.maxlen
                self.tail.append(line)

    def clear(self) -> None:
        with self.buf_lock:
            self.pinned.clear()
            self.tail.clear()
            self.dropped = 0

    def __rich__(self) -> RenderableType:
        with self.buf_lock:
            lines = list(self.pinned)
            if self.dropped:
                lines.append(f"... {self.dropped} earlier decode/chunk lines")
            lines.extend(self.tail)
        body = "\n".join(lines) or "(waiting for the engine)"
        return Panel(Text(body, overflow="ellipsis", no_wrap=True), title="engine log", title_align="left",
                     border_style="dim", box=box.ROUNDED)


class ReplyStream:
    """One reply being streamed: feed text as it arrives, then finish with the status line."""

    def __init__(self, view: ChatView):
        self.view = view
        self.text = Text()
        self.footer: Text | None = None
        self.live: Live | None = None

    def __rich__(self) -> RenderableType:
        parts: list[RenderableType] = [self.text]
        if self.footer is not None:
            parts.append(self.footer)
        if self.view.panel is not None:
            parts.append(self.view.panel)
        return Group(*parts)

    def feed(self, text: str) -> None:
        if not text:
            return
        self.text.append(text)
        if self.live is None:  # plain output: write through as it comes
            self.view.console.file.write(text)
            self.view.console.file.flush()

    def finish(self, stats: RequestStats | None, finish_reason: str | None) -> None:
        line = status_line(stats, finish_reason, self.view.prefix_cache, self.view.speculative)
        if self.live is not None:
            self.footer = Text(line, style="dim")
            self.live.refresh()
        else:
            self.view.console.file.write("\n")
            self.view.console.file.flush()
            self.view.note(line, style="dim")

    def end_interrupted(self) -> None:
        message = "interrupted (request aborted)"
        if self.live is None:
            self.view.console.file.write("\n")
            self.view.console.file.flush()
            self.view.note(message, style="yellow")
        else:
            self.footer = Text(message, style="yellow")
            self.live.refresh()


class ChatView:
    """Everything chat prints. `console` gets replies; `notes` gets status lines, tables, errors."""

    def __init__(self, console: Console, notes: Console | None = None, verbose: bool = False):
        self.console = console
        self.notes = notes or console
        self.verbose = verbose
        self.live_ok = console.is_terminal  # Live regions and spinners only on a real terminal
        self.panel: LogPanel | None = LogPanel() if verbose and self.live_ok else None
        self._handler: logging.Handler | None = None
        self.prefix_cache: str | None = "radix"  # the engine's (ModelInfo.prefix_cache), from ready()
        self.speculative = False  # the engine speculates (ModelInfo.speculative), from ready()

    # --- logging -------------------------------------------------------------------------------
    def attach_logs(self) -> None:
        """Route minisgl INFO logs to the log panel (terminal) or plain lines on the notes console."""
        if not self.verbose:
            return
        if self.panel is not None:
            handler: logging.Handler = self.panel
        else:
            handler = logging.StreamHandler(self.notes.file)
            handler.setFormatter(logging.Formatter("[log] %(name)s: %(message)s"))
        logger = logging.getLogger(LOGGERS)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False  # the panel replaces stderr; logs must not scribble over the Live view
        self._handler = handler

    def detach_logs(self) -> None:
        if self._handler is not None:
            logger = logging.getLogger(LOGGERS)
            logger.removeHandler(self._handler)
            logger.propagate = True
            self._handler = None

    # --- start-up ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def loading(self, message: str) -> Iterator[None]:
        """A spinner naming the current start-up step (terminal); a plain line under --verbose otherwise."""
        if self.notes.is_terminal:
            with self.notes.status(message, spinner="dots"):
                yield
        else:
            if self.verbose:
                self.note(message)
            yield

    def ready(self, info: ModelInfo, settings: list[str]) -> None:
        """The header: what was loaded, then the chat's settings (`settings`: its parts)."""
        self.prefix_cache = info.prefix_cache
        self.speculative = bool(info.speculative)
        kv = "n/a" if info.kv_tokens is None else f"{info.kv_tokens:,} tokens"
        if info.kv_cache_dtype not in ("", info.dtype):
            kv = f"{info.kv_cache_dtype} {kv}"
        if info.dp_size > 1:
            kv += f" over {info.dp_size} replicas"
        model = [f"model {info.name} ({info.source})", f"engine {info.engine} on {info.device} {info.dtype}",
                 *([] if info.quantization == "none" else [f"{info.quantization} weights"]),
                 f"attention {info.attention_backend}",
                 *([f"sampler {info.sampler}"] if info.sampler else []),
                 *([f"speculative {info.speculative}"] if info.speculative else []), f"KV pool {kv}",
                 f"context {info.max_context_len:,}", f"loaded in {info.load_s:.1f}s"]
        self.note(self._dotted(model), style="green")
        self.note(self._dotted(settings), style="dim")

    def _dotted(self, parts: list[str]) -> str:
        """Parts joined by ' · ', broken into lines between parts where the terminal is narrower (never a '·' left
        dangling at a line's end); one line on a pipe."""
        if not self.notes.is_terminal:
            return " · ".join(parts)
        lines = [parts[0]]
        for part in parts[1:]:
            if len(lines[-1]) + 3 + len(part) <= self.notes.width:
                lines[-1] += " · " + part
            else:
                lines.append(part)
        return "\n".join(lines)

    # --- turns ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def reply(self) -> Iterator[ReplyStream]:
        stream = ReplyStream(self)
        if self.panel is not None:
            self.panel.clear()
        if not self.live_ok:
            yield stream
            return
        with Live(stream, console=self.console, refresh_per_second=12, transient=False,
                  vertical_overflow="visible") as live:
            stream.live = live
            yield stream

    def note(self, message: str, style: str | None = None) -> None:
        self.notes.print(message, style=style if self.notes.is_terminal else None, markup=False, highlight=False)

    def error(self, message: str) -> None:
        self.note(f"error: {message}", style="bold red")

    def help(self, text: str) -> None:
        self.note(text)

    def stats(self, s: SchedulerStats, page_size: int, session_rows: list[tuple[str, str]]) -> None:
        table = Table(box=box.SIMPLE, show_header=True, header_style="bold", title="engine totals",
                      title_justify="left")
        table.add_column("what")
        table.add_column("value", justify="right")

        def pages(n: int | None) -> str:
            return "n/a" if n is None else f"{n:,} tok / {n // max(page_size, 1):,} pages"

        cache, rate = self.prefix_cache or "prefix", s.cache_hit_rate
        rows = [
            ("requests ended (of them aborted)", f"{s.finished_requests} ({s.aborted_requests})"),
            ("requests running / waiting", f"{s.running} / {s.waiting}"),
            (f"{cache} cache hit tokens", _count(s.cache_hit_tokens)),
            (f"{cache} cache miss tokens", _count(s.cache_miss_tokens)),
            (f"{cache} cache hit rate", "n/a" if rate is None else f"{rate:.1%}"),
            ("cache hit / miss requests", f"{_count(s.cache_hit_requests)} / {_count(s.cache_miss_requests)}"),
            ("KV total", pages(s.tokens_total)),
            ("KV free", pages(s.tokens_free)),
            ("KV cached (radix tree)", pages(s.tokens_cached)),
            ("KV in use (running)", pages(s.tokens_in_use)),
            ("prefill / decode tokens", f"{s.prefill_tokens:,} / {s.decode_tokens:,}"),
            ("CPU decode step", s.decode_step),
            *session_rows,
        ]
        for k, v in rows:
            table.add_row(k, v)
        self.notes.print(table)


def _count(n: int | None) -> str:
    return "n/a" if n is None else f"{n:,}"
