"""Reasoning parsers: a reply's thoughts (`<think>…</think>`, or harmony's analysis channel) split from its content,
whole or as it streams.

`--reasoning-parser` picks one (`auto`: by the model's family, from its config.json `model_type`):

- `qwen3`: thoughts only where the reply opens with `<think>` (Qwen3's template lets the model open it; with
  `enable_thinking: false` the template closes it in the prompt and the reply is all content);
- `deepseek-r1`: the reply starts inside the thoughts (R1's template opens `<think>` in the prompt; a `<think>` the
  model writes anyway is dropped), until `</think>`;
- `harmony` (gpt-oss; `auto` picks it): the reply's harmony channels (minisgl_cli/harmony.py), its markers kept in
  the text (the request decodes special tokens): `analysis` is the thoughts, `final` (and `commentary` meant for the
  user) the content, and `commentary` messages to `functions.NAME` are tool calls, taken apart here (`HarmonySplit`);
- `none`: no split.

The split holds back text that may be the start of a marker, so a marker cut across deltas never leaks into either
part; the whitespace between `</think>` and the content is dropped.
"""

from __future__ import annotations

import json
from pathlib import Path

from minisgl_cli.harmony import HarmonyParser, Parsed

PARSERS = ("auto", "qwen3", "deepseek-r1", "harmony", "none")
START, END = "<think>", "</think>"
_FAMILIES = {"qwen3": "qwen3", "qwen3_moe": "qwen3", "qwen3_next": "qwen3", "deepseek_v3": "deepseek-r1",
             "gpt_oss": "harmony"}


def resolve_parser(name: str, model_dir: str | None) -> str | None:
    """The parser `name` stands for with this model (None: no split); `auto` reads the model's family."""
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser: {name!r} is not one of {', '.join(PARSERS)}")
    if name != "auto":
        return None if name == "none" else name
    config = Path(model_dir) / "config.json" if model_dir else None
    if config is None or not config.is_file():
        return None
    try:
        model_type = json.loads(config.read_text()).get("model_type")
    except ValueError:
        return None
    return _FAMILIES.get(model_type)


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` may begin `marker` (held until the next text says)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


class ReasoningSplit:
    """One reply's text in, (reasoning, content) out as they become certain."""

    def __init__(self, parser: str):
        self.forced = parser == "deepseek-r1"
        self.state = "lead"  # lead (may open with <think>) -> reasoning -> gap (whitespace after </think>) -> content
        self.held = ""
        self.reasoned = False  # some reasoning was seen

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        while True:
            if self.state == "lead":
                lead = self.held.lstrip()
                if lead.startswith(START):
                    self.held, self.state = lead[len(START):], "reasoning"
                elif START.startswith(lead):  # empty, or a prefix of <think>: wait
                    return reasoning, content
                else:
                    self.state = "reasoning" if self.forced else "content"
            elif self.state == "reasoning":
                self.reasoned = True
                at = self.held.find(END)
                if at < 0:
                    keep = _held(self.held, END)
                    reasoning += self.held[: len(self.held) - keep]
                    self.held = self.held[len(self.held) - keep:]
                    return reasoning, content
                reasoning += self.held[:at]
                self.held, self.state = self.held[at + len(END):], "gap"
            elif self.state == "gap":
                self.held = self.held.lstrip()
                if not self.held:
                    return reasoning, content
                self.state = "content"
            else:
                content += self.held
                self.held = ""
                return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held once the reply has ended: thoughts cut short stay thoughts."""
        held, self.held = self.held, ""
        if self.state == "reasoning":
            return held, ""
        return "", held.strip() if self.state == "gap" else held

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (reasoning or None, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return (r1 + r2 if self.reasoned else None), c1 + c2


class HarmonySplit:
    """ReasoningSplit's verbs over a harmony reply; the tool calls its commentary channel made wait in `calls` until
    the caller takes them (`take_calls`). `prefill`: the reply's start that the prompt wrote (harmony.forced_call)."""

    reasoned = True

    def __init__(self, prefill: str = "") -> None:
        self.parser = HarmonyParser(prefill)
        self.calls: list[tuple[str, str]] = []  # (name, JSON arguments), not yet taken

    def _out(self, parsed: Parsed) -> tuple[str, str]:
        self.calls += parsed.calls
        return parsed.reasoning, parsed.content

    def feed(self, text: str) -> tuple[str, str]:
        return self._out(self.parser.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._out(self.parser.finish())

    def split(self, text: str) -> tuple[str | None, str]:
        reasoning, content = self._out(self.parser.parse(text))
        return reasoning or None, content

    def take_calls(self) -> list[tuple[str, str]]:
        calls, self.calls = self.calls, []
        return calls


def new_split(parser: str, prefill: str = "") -> ReasoningSplit | HarmonySplit:
    """A split of one reply for the parser `resolve_parser` gave (`prefill`: harmony's forced call)."""
    return HarmonySplit(prefill) if parser == "harmony" else ReasoningSplit(parser)
