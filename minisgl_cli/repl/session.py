"""Chat session state: settings, the conversation context, the transcript, and slash-command parsing.

Pure logic (no terminal, no engine): the REPL asks this module what a line means and what to send.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from minisgl_cli.types import GenerateRequest, RequestStats, SamplingParams
from minisgl_cli.vision.image_source import ImageError, ImagePolicy, load_image_file

# name -> (argument hint, help); the order here is the order /help and the completer show.
COMMANDS: dict[str, tuple[str, str]] = {
    "/help": ("", "show the commands and keys"),
    "/reset": ("", "clear the conversation (context and transcript)"),
    "/system": ("TEXT", "set the system prompt (no TEXT: show it; 'off': remove it)"),
    "/stats": ("", "engine totals: requests, radix cache hits/misses, KV tokens used/free"),
    "/temp": ("X", "sampling temperature (0 = greedy)"),
    "/max-tokens": ("N", "tokens to generate at most per reply"),
    "/json": ("[on|off]", "replies as one JSON object (grammar-constrained); no argument toggles"),
    "/image": ("PATH", "attach an image to the next prompt (needs a vision-language model); 'off' drops them"),
    "/save": ("FILE", "write the transcript: .json as JSON, anything else as markdown"),
    "/exit": ("", "leave (also Ctrl-D)"),
}
ALIASES = {"/quit": "/exit", "/q": "/exit", "/?": "/help", "/clear": "/reset"}

ActionKind = Literal["generate", "reply", "error", "stats", "help", "exit", "noop"]


@dataclass
class Action:
    """What the REPL should do with one input line."""

    kind: ActionKind
    text: str = ""  # the prompt for "generate"; the message to print for "reply" / "error"


@dataclass
class ChatSettings:
    """Knobs the user sets by flag at start and by slash command during the session."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    system: str | None = None
    multi_turn: bool = False
    json: bool = False  # constrain replies to a JSON object
    logprobs: bool = False  # ask for each token's logprob (--verbose shows them in the log panel)

    def sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                              min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                              json_schema='{"type": "object"}' if self.json else None, logprobs=self.logprobs)


@dataclass
class Turn:
    """One exchange as recorded in the transcript."""

    user: str
    reply: str
    finish_reason: str | None = None
    stats: RequestStats | None = None
    error: str | None = None
    content: list[dict] | None = None  # the user message's parts when it carried images (the context keeps them)
    images: list[str] = field(default_factory=list)  # their paths (the transcript names them)
    system: str | None = None  # the system prompt it was sent with (None: the model's default)


@dataclass
class ChatSession:
    """The conversation: what is sent to the engine next, and what has been said so far."""

    settings: ChatSettings = field(default_factory=ChatSettings)
    history: list[dict] = field(default_factory=list)  # prior user/assistant messages (multi-turn only)
    turns: list[Turn] = field(default_factory=list)
    vision: bool = False  # a vision-language model is loaded: /image may attach images
    images: list[tuple[str, Any]] = field(default_factory=list)  # (path, PIL image) for the next prompt
    image_policy: ImagePolicy = field(default_factory=ImagePolicy)  # the size caps /image applies

    # --- requests ------------------------------------------------------------------------------
    def messages_for(self, user_text: str) -> list[dict]:
        """The chat messages of the next request: system, prior turns (multi-turn), this prompt."""
        msgs: list[dict] = [{"role": "system", "content": self.settings.system}] if self.settings.system else []
        if self.settings.multi_turn:
            msgs.extend(self.history)
        msgs.append({"role": "user", "content": self._content(user_text)})
        return msgs

    def _content(self, user_text: str) -> str | list[dict]:
        """The prompt, or (with images attached) the images then the prompt as chat parts."""
        if not self.images:
            return user_text
        return [*({"type": "image", "image": im} for _, im in self.images), {"type": "text", "text": user_text}]

    def request_for(self, user_text: str) -> GenerateRequest:
        return GenerateRequest(messages=self.messages_for(user_text), params=self.settings.sampling())

    def begin(self, user_text: str) -> tuple[GenerateRequest, Turn]:
        """The next request and its turn (to fill in and `record`); the attached images go with them."""
        req = self.request_for(user_text)
        content = req.messages[-1]["content"] if req.messages else None
        turn = Turn(user=user_text, reply="", content=content if isinstance(content, list) else None,
                    images=[path for path, _ in self.images], system=self.settings.system)
        self.images = []
        return req, turn

    def record(self, turn: Turn) -> None:
        """Add a finished turn to the transcript; only complete replies enter the context.

        An interrupted or failed turn stays out of the context so the next prompt is not
        conditioned on half an answer (the radix cache still holds its prefix either way).
        """
        self.turns.append(turn)
        if turn.error is None and turn.finish_reason in ("stop", "length"):
            self.history.append({"role": "user", "content": turn.content if turn.content is not None else turn.user})
            self.history.append({"role": "assistant", "content": turn.reply})

    def reset(self) -> None:
        self.history.clear()
        self.turns.clear()
        self.images.clear()

    # --- slash commands ------------------------------------------------------------------------
    def handle(self, line: str) -> Action:
        """Interpret one input line: a prompt to generate from, or a slash command applied here."""
        text = line.strip()
        if not text:
            return Action("noop")
        if not text.startswith("/"):
            return Action("generate", line.strip("\n"))
        name, _, arg = text.partition(" ")
        name = ALIASES.get(name.lower(), name.lower())
        arg = arg.strip()
        if name == "/help":
            return Action("help", help_text())
        if name == "/exit":
            return Action("exit")
        if name == "/stats":
            return Action("stats")
        if name == "/reset":
            self.reset()
            return Action("reply", "conversation cleared")
        if name == "/system":
            return self._system(arg)
        if name == "/temp":
            return self._temperature(arg)
        if name == "/max-tokens":
            return self._max_tokens(arg)
        if name == "/save":
            return self._save(arg)
        if name == "/json":
            return self._json(arg)
        if name == "/image":
            return self._image(arg)
        return Action("error", f"unknown command {name}; type /help for the list")

    def _system(self, arg: str) -> Action:
        if not arg:
            current = self.settings.system
            return Action(
                "reply", f"system prompt: {current!r}" if current else "no system prompt (the model's default applies)"
            )
        self.settings.system = None if arg.lower() in ("off", "none") else arg
        return Action("reply", "system prompt removed" if self.settings.system is None else "system prompt set")

    def _temperature(self, arg: str) -> Action:
        value = _at_least(arg, float, 0.0, "/temp needs a number >= 0", f"{self.settings.temperature:g}")
        if isinstance(value, Action):
            return value
        self.settings.temperature = value
        return Action("reply", f"temperature = {value:g}" + (" (greedy)" if value == 0 else ""))

    def _max_tokens(self, arg: str) -> Action:
        value = _at_least(arg, int, 1, "/max-tokens needs a whole number >= 1", str(self.settings.max_new_tokens))
        if isinstance(value, Action):
            return value
        self.settings.max_new_tokens = value
        return Action("reply", f"max new tokens = {value}")

    def _json(self, arg: str) -> Action:
        if arg.lower() not in ("", "on", "off"):
            return Action("error", "/json takes on, off, or nothing (toggle)")
        self.settings.json = not self.settings.json if not arg else arg.lower() == "on"
        return Action("reply", "JSON replies on: each reply is one JSON object" if self.settings.json
                      else "JSON replies off")

    def _image(self, arg: str) -> Action:
        if not self.vision:
            return Action("error", "/image needs a vision-language model: start `minisgl chat --vlm-model PATH` "
                                   "(or --model QWEN2-VL-DIR)")
        if not arg:
            return Action("error", "/image needs a file path ('off' drops the attached images)")
        if arg.lower() == "off":
            n, self.images = len(self.images), []
            return Action("reply", f"dropped {n} attached image(s)")
        try:
            image = load_image_file(arg, self.image_policy)
        except ImageError as exc:
            return Action("error", exc.message)
        self.images.append((arg, image))
        w, h = image.size
        return Action("reply", f"attached {Path(arg).name} ({w}x{h}) to the next prompt "
                               f"({len(self.images)} image(s) attached)")

    def _save(self, arg: str) -> Action:
        if not arg:
            return Action("error", "/save needs a file name (.json for JSON, else markdown)")
        path = Path(arg).expanduser()
        try:
            path.write_text(self.to_json() if path.suffix.lower() == ".json" else self.to_markdown())
        except OSError as exc:
            return Action("error", f"cannot write {path}: {exc.strerror or exc}")
        return Action("reply", f"saved {len(self.turns)} turn(s) to {path}")

    # --- transcript ----------------------------------------------------------------------------
    def to_markdown(self) -> str:
        """The transcript in the order things happened: a system prompt where it was set (before the first turn sent
        with it; after the turns when it was set after the last one)."""
        lines = ["# minisgl chat transcript", ""]
        system: str | None = None
        for i, t in enumerate(self.turns, 1):
            if t.system != system:
                system = t.system
                lines += [_system_line(system), ""]
            lines += [f"## Turn {i}", "", f"**user:** {t.user}", ""]
            lines += [f"_image: {path}_" for path in t.images] + [""] * bool(t.images)
            if t.error:
                lines += [f"**error:** {t.error}", ""]
            else:
                lines += [f"**assistant:** {t.reply}", ""]
                if t.stats:
                    lines += [f"_{t.stats.prompt_tokens} prompt tokens ({t.stats.cached_tokens} cached), "
                              f"{t.stats.completion_tokens} generated, finish: {t.finish_reason}_", ""]
        if self.settings.system != system:
            lines += [_system_line(self.settings.system, "system, from the next turn"), ""]
        return "\n".join(lines)

    def to_json(self) -> str:
        """The settings as they are now, and each turn with the system prompt it was sent with."""
        doc = {
            "settings": asdict(self.settings),
            "turns": [
                {"system": t.system, "user": t.user, "images": t.images, "assistant": t.reply,
                 "finish_reason": t.finish_reason, "error": t.error, "stats": asdict(t.stats) if t.stats else None}
                for t in self.turns
            ],
        }
        return json.dumps(doc, indent=2) + "\n"


def _system_line(system: str | None, label: str = "system") -> str:
    return f"**{label}:** " + (system if system is not None else "_none (the model's default)_")


def help_text() -> str:
    width = max(len(f"{n} {a}".strip()) for n, (a, _) in COMMANDS.items())
    rows = [f"  {f'{n} {a}'.strip():<{width}}  {h}" for n, (a, h) in COMMANDS.items()]
    keys = [
        "  Enter submits; Esc then Enter (or Alt+Enter) inserts a newline; pasted newlines are kept.",
        "  Ctrl-C stops the reply being generated (the request is aborted); at the prompt it clears the line.",
        "  Ctrl-D or /exit leaves. Up/Down walk the saved history.",
    ]
    return "\n".join(["commands:", *rows, "keys:", *keys])


N = TypeVar("N", int, float)


def _at_least(arg: str, kind: Callable[[str], N], least: N, need: str, now: str) -> N | Action:
    """A slash command's number: `arg` read as `kind`, at least `least`; else the error Action saying what it
    needs (and, when `arg` is no number at all, the value it keeps)."""
    try:
        value = kind(arg)
    except ValueError:
        return Action("error", f"{need} (now {now})")
    return value if value >= least else Action("error", need)
