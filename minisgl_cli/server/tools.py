"""Tool calling: OpenAI tools -> the grammar of forced calls; tool calls parsed out of model output, whole or streamed.

The tools reach the model through its chat template (`Tokenizer.apply_chat_template`; templates that know
no tools get Qwen2.5's Hermes prompt). What comes back depends on `tool_choice`:

- `auto`: free text, parsed for calls in the formats of the families we serve: Hermes `<tool_call>{...}
  </tool_call>` (Qwen2 / Qwen3, and our prompt for other templates) and Llama 3.1's bare JSON
  (`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several joined by `;`); gpt-oss's
  come from its harmony commentary channel (`to=functions.NAME`), which the harmony parser reads (`harmony_calls`).
- `required`: the grammar forces a JSON array of `{"name", "arguments"}` calls, each one of the tools with
  arguments following its schema (one call at most with `parallel_tool_calls: false`).
- a named function: the grammar forces that function's arguments object; the whole output is the arguments.

Harmony's calls (gpt-oss) are its own commentary messages: the prompt ends inside the call (`harmony.forced_call`), and
the grammar, an xgrammar structural tag, holds the rest of it: for `required` the header on from `to=functions` with
the name one of the tools' (`harmony.forced_header`, its markers as the single special tokens they are), then that
tool's arguments, then the call's end, `<|call|>` (a stop token: the grammar's only end, scheduler/grammar.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from minisgl_cli import harmony
from minisgl_cli.api import protocol as p

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MARKER = re.compile("(" + "|".join(map(re.escape, harmony.MARKERS)) + ")")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Call:
    name: str
    arguments: str  # JSON text

    def to_tool_call(self) -> p.ToolCall:
        return p.ToolCall(id=new_call_id(), function=p.FunctionCall(name=self.name, arguments=self.arguments))


def _arguments_schema(tool: p.Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def forced_grammar(body: p.ChatCompletionRequest, harmony_choice: Any = None) -> dict[str, str]:
    """The grammar the output must follow for `required` and named choices, as SamplingParams fields (empty for auto
    / none): a JSON schema, or on a harmony model (`harmony_choice`: the tool choice its prompt ends in,
    `harmony.forced_call`) a structural tag of the calls that may follow (`_harmony_call`)."""
    mode, tools = body.tool_mode, body.tools or []
    if mode not in ("named", "required"):
        return {}
    if mode == "named":
        name = body.tool_choice.function.name  # type: ignore[union-attr]
        tools = [next(t for t in tools if t.function.name == name)]
    if harmony_choice is not None:  # one of the calls, then its end (scheduler/grammar.py makes it the only one)
        call = {"type": "or", "elements": [_harmony_call(harmony_choice, t) for t in tools]}
        end = {"type": "token", "token": harmony.CALL}
        return {"structural_tag": json.dumps({"type": "structural_tag",
                                              "format": {"type": "sequence", "elements": [call, end]}})}
    if mode == "named":
        return {"json_schema": json.dumps(_arguments_schema(tools[0]))}
    calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _arguments_schema(t)},
              "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {"json_schema": json.dumps(schema)}


def _harmony_call(choice: Any, tool: p.Tool) -> dict[str, Any]:
    """A forced harmony call to `tool` after the prompt's end, as a structural tag's element: what is left of its
    header (text, and each marker as its one special token: spelled out in other tokens it would not be the marker)
    and its arguments, JSON (one whitespace at most in a row: gpt-oss writes them compact) that follows the schema."""
    header = [x for x in _MARKER.split(harmony.forced_header(choice, tool.function.name)) if x]
    return {"type": "sequence", "elements": [
        *({"type": "token", "token": x} if x in harmony.MARKERS else {"type": "const_string", "value": x}
          for x in header),
        {"type": "json_schema", "json_schema": _arguments_schema(tool), "max_whitespace_cnt": 1}]}


def _call(obj: Any, names: set[str]) -> Call | None:
    """A call from a parsed JSON object, if it names one of the tools."""
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _json_values(text: str) -> list[Any] | None:
    """Every JSON value in `text`, separated by whitespace or ';' (Llama 3.1), or None if anything else is there."""
    dec, values, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
    return values


def parse_auto(text: str, names: set[str]) -> tuple[str | None, list[Call]]:
    """(content, calls) of free output: Hermes tags anywhere, or the whole output as Llama-3.1 JSON calls."""
    if _OPEN in text:
        calls = []
        for m in _HERMES.finditer(text):
            values = _json_values(m.group(1))
            call = _call(values[0], names) if values and len(values) == 1 else None
            if call is None:
                return text, []  # not a well-formed call: leave the text as it is
            calls.append(call)
        content = text[: text.index(_OPEN)].strip()
        return content or None, calls
    stripped = text.strip().removeprefix(_PYTHON_TAG)
    if stripped.startswith("{"):
        values = _json_values(stripped)
        calls = [c for c in (_call(v, names) for v in values or []) if c is not None]
        if values and len(calls) == len(values):
            return None, calls
    return text, []


def parse_required(text: str) -> list[Call]:
    """The calls of a `required` choice's output (a JSON array the grammar produced)."""
    try:
        items = json.loads(text)
    except ValueError:
        return []  # cut short (finish_reason length)
    return [Call(c["name"], json.dumps(c["arguments"], ensure_ascii=False)) for c in items
            if isinstance(c, dict) and "name" in c and "arguments" in c]


def harmony_calls(found: list[tuple[str, str]], parallel: bool | None) -> list[Call]:
    """The calls of a harmony reply's commentary channel, (name, arguments) as the parser found them: each one the
    model made, whether or not the request offered its tool (as vLLM's gpt-oss parser: the client decides; dropping
    it would lose the reply), its arguments as JSON text where they parse, else as written."""
    calls = []
    for name, args in found:
        try:
            args = json.dumps(json.loads(args), ensure_ascii=False)
        except ValueError:
            pass
        calls.append(Call(name, args))
    return calls[:1] if parallel is False else calls


def parse(mode: str, text: str, names: set[str], parallel: bool | None) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole reply under tool mode `mode` ("auto", "required", "named:<name>")."""
    if mode == "required":
        calls = parse_required(text)
        content = None if calls else text
    elif mode.startswith("named:"):
        calls, content = [Call(mode.removeprefix("named:"), text)], None
    else:
        content, calls = parse_auto(text, names)
    if parallel is False:
        calls = calls[:1]
    return content, calls


class AutoStream:
    """Streams the content of an `auto` reply while holding back what may be a tool call.

    Text that may begin `<tool_call>` is held until it does or cannot; from a `<tool_call>` (or, for Llama
    3.1, a reply whose first text is `{` or `<|python_tag|>`) on, everything is held and parsed at the end.
    """

    def __init__(self, names: set[str]):
        self.names = names
        self.held = ""  # not yet sent
        self.sent = False  # some content went out already
        self.capturing = False  # a call started: hold the rest

    def feed(self, text: str) -> str:
        """The content that can go out now."""
        self.held += text
        if self.capturing:
            return ""
        if not self.sent:
            lead = self.held.lstrip()
            if lead.startswith(("{", _PYTHON_TAG)):
                self.capturing = True  # Llama 3.1: the whole reply is the calls
                return ""
            if not lead or _PYTHON_TAG.startswith(lead):
                return ""  # may still become the tag
        at = self.held.find(_OPEN)
        if at >= 0:
            self.capturing = True
            out, self.held = self.held[:at], self.held[at:]
        else:
            keep = next((n for n in range(min(len(_OPEN) - 1, len(self.held)), 0, -1)
                         if _OPEN.startswith(self.held[-n:])), 0)
            out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        self.sent = self.sent or bool(out.strip())
        return out

    def finish(self, parallel: bool | None) -> tuple[str, list[Call]]:
        """(content still to send, calls) once the reply has ended."""
        held, self.held = self.held, ""
        if not self.capturing:
            return held, []
        content, calls = parse_auto(held, self.names)
        if parallel is False:
            calls = calls[:1]
        return (content or "") if calls else held, calls
