"""The harmony chat format (gpt-oss): chat messages and tools rendered as its prompt, its replies' channels parsed back.

A harmony conversation is a run of messages `<|start|>{role}[ to={recipient}]<|channel|>{channel}[ <|constrain|>json]
<|message|>{text}` ended by `<|end|>`, or by `<|return|>` (the reply is done) or `<|call|>` (a tool call waits for its
result). The model writes its thoughts in the `analysis` channel, its answer in `final`, and calls a tool with a
`commentary` message addressed `to=functions.NAME` whose text is the JSON arguments. `render` writes the prompt as
openai-harmony renders it (system message with the reasoning effort, developer message with the instructions and the
tools as a TypeScript-like `functions` namespace, then the turns); `HarmonyParser` reads a reply back, whole or as it
streams, into thoughts, content and tool calls. A `tool_choice` that forces a call (`forced_call`) ends the prompt with
the start of that call, so the reply begins inside it: the parser is told the same start (its `prefill`), and the
grammar of forced calls (server/tools.py) the rest of the header (`forced_header`) and the arguments' schema.

openai-harmony (PyPI) is the reference implementation, but it fetches its o200k vocabulary file over the network on
first use, which these machines cannot do; the format's markers are plain text here, each one special token of the
model's tokenizer (`is_harmony` checks that they are).
"""

from __future__ import annotations

import json
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

START, END, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"
RETURN, CALL, ENDOFTEXT = "<|return|>", "<|call|>", "<|endoftext|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_ENDS = (END, RETURN, CALL, ENDOFTEXT, START)  # what ends a message's text (a <|start|>: one the model left open)

# OpenAI's reasoning efforts onto harmony's three (gpt-oss always thinks: none / minimal think least)
EFFORTS = {"none": "low", "minimal": "low", "low": "low", "medium": "medium", "high": "high", "xhigh": "high"}
IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."


def is_harmony(vocab: Container[str]) -> bool:
    """Whether a tokenizer's vocabulary has harmony's markers (gpt-oss's o200k_harmony does)."""
    return all(m in vocab for m in MARKERS)


# --- the prompt ------------------------------------------------------------------------------------------------
def render(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
           template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True) -> str:
    """The prompt text of a chat (messages as the chat templates take them: role, content, tool_calls, thinking,
    tool_call_id). `template_kwargs`: `reasoning_effort` (OpenAI's names), or `enable_thinking` false (low),
    `model_identity`, `tool_choice` (OpenAI's: `required` or a named function end the prompt in the call,
    `forced_call`). ValueError for what the format cannot say."""
    kw = template_kwargs or {}
    effort = kw.get("reasoning_effort") or ("low" if kw.get("enable_thinking") is False else "medium")
    if effort not in EFFORTS:
        raise ValueError(f"reasoning_effort {effort!r} is not one of {', '.join(EFFORTS)}")
    functions = [t.get("function", t) for t in tools or []]
    system = (f"{kw.get('model_identity') or IDENTITY}\nKnowledge cutoff: 2024-06\n"
              f"Current date: {time.strftime('%Y-%m-%d')}\n\nReasoning: {EFFORTS[effort]}\n\n"
              "# Valid channels: analysis, commentary, final. Channel must be included for every message.")
    if functions:
        system += "\nCalls to these tools must go to the commentary channel: 'functions'."
    out = [_message("system", system)]
    instructions = "\n\n".join(m.get("content") or "" for m in messages if m.get("role") in ("system", "developer"))
    if instructions or functions:
        parts = [f"# Instructions\n\n{instructions}"] * bool(instructions)
        if functions:
            parts.append("# Tools\n\n## functions\n\nnamespace functions {\n\n"
                         + "".join(_function(f) for f in functions) + "} // namespace functions")
        out.append(_message("developer", "\n\n".join(parts)))
    turns = [m for m in messages if m.get("role") not in ("system", "developer")]
    names: dict[str, str] = {}  # tool call id -> its function's name
    last_call: str | None = None
    for i, m in enumerate(turns):
        role, content = m.get("role"), m.get("content") or ""
        if role == "user":
            out.append(_message("user", content))
        elif role == "assistant" and m.get("tool_calls"):
            # Thoughts are kept only for a tool-calling turn no final answer has followed yet (as gpt-oss's template)
            thoughts = m.get("thinking") or content
            answered = any(t.get("role") == "assistant" and not t.get("tool_calls") for t in turns[i + 1:])
            if thoughts and not answered:
                out.append(_message("assistant", thoughts, "analysis"))
            for c in m["tool_calls"]:
                fn = c.get("function", c)
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                last_call = fn.get("name")
                names[c.get("id") or ""] = last_call or ""
                out.append(f"{START}assistant{_call_header(last_call or '')}{args}{CALL}")
        elif role == "assistant":
            out.append(_message("assistant", content, "final"))
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "") or last_call
            if name is None:
                raise ValueError("a tool message with no assistant tool call before it")
            out.append(f"{START}functions.{name} to=assistant{CHANNEL}commentary{MESSAGE}{content}{END}")
        else:
            raise ValueError(f"role {role!r}: harmony takes system, developer, user, assistant and tool messages")
    if add_generation_prompt:
        out.append(f"{START}assistant{forced_call(kw.get('tool_choice'))}")
    return "".join(out)


def forced_call(tool_choice: Any) -> str:
    """The start of the reply a `tool_choice` (OpenAI's: "required", or `{"type": "function", "function": {"name":
    N}}`) forces, which the prompt ends with: for a named function its call's whole header, as a call is rendered (the
    reply is then the arguments); for `required` the commentary channel to some function, the model writing on from
    its name's `.` (a pretokenizer boundary: `=functions` and `.name` are words of their own). "": nothing forced."""
    if tool_choice == "required":
        return f"{CHANNEL}commentary to=functions"
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    return _call_header(name) if name else ""


def forced_header(tool_choice: Any, name: str) -> str:
    """What of a forced call's header the model still writes after the prompt's end (`forced_call`) when it calls
    `name`, up to its arguments: nothing for a named function, `.NAME <|constrain|>json<|message|>` for `required`
    (a grammar holds the reply to it)."""
    return _call_header(name).removeprefix(forced_call(tool_choice))


def call_text(name: str, arguments: str) -> str:
    """A tool call as the model writes it (a reply's own words, for where no tool call can go)."""
    return f"{_call_header(name)}{arguments}{CALL}"


def _call_header(name: str) -> str:
    return f"{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}"


def _message(role: str, text: str, channel: str | None = None) -> str:
    return f"{START}{role}{f'{CHANNEL}{channel}' if channel else ''}{MESSAGE}{text}{END}"


def _function(fn: dict[str, Any]) -> str:
    """One tool as the namespace lists it: its description, then its type from the arguments' JSON schema."""
    head = f"// {fn['description']}\n" if fn.get("description") else ""
    params = fn.get("parameters") or {}
    props = params.get("properties") or {}
    if not props:
        return f"{head}type {fn['name']} = () => any;\n\n"
    required = params.get("required") or []
    lines = []
    for name, spec in props.items():
        note = f"// {spec['description']}\n" if spec.get("description") else ""
        default = f" // default: {_default(spec['default'])}" if "default" in spec else ""
        lines.append(f"{note}{name}{'' if name in required else '?'}: {_ts_type(spec)},{default}\n")
    return f"{head}type {fn['name']} = (_: {{\n{''.join(lines)}}}) => any;\n\n"


def _default(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _ts_type(spec: dict[str, Any]) -> str:
    """A JSON schema as a TypeScript-like type."""
    variants = spec.get("oneOf") or spec.get("anyOf")
    kind = spec.get("type")
    if variants:
        out = " | ".join(_ts_type(v) for v in variants)
    elif isinstance(kind, list):
        out = " | ".join(_ts_type({**spec, "type": k}) for k in kind)
    elif "enum" in spec:
        out = " | ".join(json.dumps(v) for v in spec["enum"])
    elif kind == "string":
        out = "string"
    elif kind in ("number", "integer"):
        out = "number"
    elif kind == "boolean":
        out = "boolean"
    elif kind == "null":
        out = "null"
    elif kind == "array":
        items = spec.get("items")
        out = f"{_ts_type(items)}[]" if isinstance(items, dict) and items else "any[]"
    elif kind == "object" and spec.get("properties"):
        required = spec.get("required") or []
        fields = [f"{k}{'' if k in required else '?'}: {_ts_type(v)}" for k, v in spec["properties"].items()]
        out = "{\n" + ",\n".join(fields) + ",\n}"
    elif kind == "object":
        out = "object"
    else:
        out = "any"
    return f"{out} | null" if spec.get("nullable") else out


# --- the reply ---------------------------------------------------------------------------------------------------
@dataclass
class Parsed:
    """What some reply text added: thoughts (analysis), content (final, and commentary meant for the user), and
    the tool calls it completed (function name, JSON arguments text)."""

    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        return Parsed(self.reasoning + other.reasoning, self.content + other.content, self.calls + other.calls)


def _held(text: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `text` may begin one of `markers` (held until the next text says)."""
    return max((n for m in markers for n in range(min(len(m) - 1, len(text)), 0, -1) if m.startswith(text[-n:])),
               default=0)


class HarmonyParser:
    """One reply's text (its markers kept: the request decodes special tokens) in, `Parsed` pieces out as they become
    certain. A reply that does not open with a marker (a grammar forced its output) is content as it is. `prefill`:
    the start of the reply the prompt wrote (`forced_call`), read before the reply's own text."""

    def __init__(self, prefill: str = "") -> None:
        self.held = prefill
        # lead -> header (role, recipient, channel) -> body -> between -> header ... | raw
        self.state = "header" if prefill else "lead"
        self.channel = ""
        self.recipient = ""
        self.args = ""  # a tool call's arguments so far

    def feed(self, text: str) -> Parsed:
        self.held += text
        out = Parsed()
        while True:
            if self.state == "lead":
                lead = self.held.lstrip()
                if len(lead) < 2 and "<|".startswith(lead):  # nothing yet, or maybe a marker's first character
                    return out
                self.state = "header" if lead.startswith("<|") else "raw"
            elif self.state == "raw":
                out.content += self.held
                self.held = ""
                return out
            elif self.state in ("header", "between"):
                if self.state == "between":  # after a message's end: the next one's <|start|> (or its header)
                    at = self.held.find(START)
                    if at < 0 and CHANNEL not in self.held:
                        self.held = self.held[len(self.held) - _held(self.held, (START, CHANNEL)):]
                        return out
                    self.state = "header"
                at = self.held.find(MESSAGE)
                if at < 0:
                    return out
                self._header(self.held[:at])
                self.held, self.state = self.held[at + len(MESSAGE):], "body"
            else:  # body
                ends = [(i, m) for m in _ENDS if (i := self.held.find(m)) >= 0]
                if not ends:
                    keep = _held(self.held, _ENDS)
                    self._text(self.held[: len(self.held) - keep], out)
                    self.held = self.held[len(self.held) - keep:]
                    return out
                at, marker = min(ends)
                self._text(self.held[:at], out)
                self._close(out)
                self.held, self.state = self.held[at + (0 if marker == START else len(marker)):], "between"

    def finish(self) -> Parsed:
        """What is still held once the reply has ended: a message cut short keeps what it said (a tool call only if
        its arguments are whole JSON)."""
        out = Parsed()
        if self.state in ("raw", "body"):
            self._text(self.held, out)
            if self.state == "body":
                self._close(out, cut=True)
        self.held, self.state = "", "between"
        return out

    def parse(self, text: str) -> Parsed:
        """A whole reply."""
        return self.feed(text).add(self.finish())

    def _header(self, header: str) -> None:
        """A message's header: `[<|start|>]role[ to=R][<|channel|>channel[ to=R][ <|constrain|>json]]`."""
        header = header.replace(START, " ").replace(CONSTRAIN, " ")
        role, _, channel = header.partition(CHANNEL)
        words = role.split() + channel.split()
        self.recipient = next((w[3:] for w in words if w.startswith("to=")), "")
        self.channel = channel.split()[0] if channel.split() else ""
        self.args = ""

    def _text(self, text: str, out: Parsed) -> None:
        if self.state == "raw":
            out.content += text
        elif self.recipient:
            self.args += text
        elif self.channel == "analysis":
            out.reasoning += text
        else:  # final, and commentary for the user (a preamble before tool calls)
            out.content += text

    def _close(self, out: Parsed, cut: bool = False) -> None:
        if self.recipient.startswith("functions.") and (not cut or _is_json(self.args)):
            out.calls.append((self.recipient.removeprefix("functions."), self.args.strip()))
        self.recipient = ""


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
