"""ChoiceStream: one streamed chat choice's deltas as chunk contents -- text, thoughts, tool-call pieces, logprobs,
the end -- which each front (chat completions, Messages, Responses, ollama) writes in its own events.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from minisgl_cli import harmony
from minisgl_cli.server import tools
from minisgl_cli.server.reasoning import HarmonySplit, ReasoningSplit
from minisgl_cli.types import Delta, TokenLogprob


class ChoiceStream:
    """One streamed chat choice: its deltas as chunk contents (text, tool-call pieces, logprobs, the end)."""

    def __init__(self, how: str | None, names: set[str], parallel: bool | None, token_only: bool = False,
                 split: ReasoningSplit | HarmonySplit | None = None):
        self.how, self.parallel = how, parallel
        self.split = split  # with a reasoning parser: the thoughts go out as reasoning_content, apart
        # harmony's calls come whole from its commentary channel (the split's), each as soon as it ends
        self.harmony = isinstance(split, HarmonySplit)
        self.called = 0  # calls sent
        # Without a tokenizer every delta is token ids only: each is sent (empty content) so that clients can
        # time the tokens. With one, text-less deltas (the EOS token, UTF-8 held back) send nothing.
        self.token_only = token_only
        self.names = names
        self.auto = tools.AutoStream(names) if how == "auto" and not self.harmony else None
        self.held = ""  # a `required` reply: parsed once whole
        self.logprobs: list[TokenLogprob] = []  # not yet sent (their text is held back)
        self.named_id: str | None = None

    def feed(self, d: Delta) -> list[dict[str, Any]]:
        self.logprobs += d.logprobs or []
        out: list[dict[str, Any]] = []
        calls: list[tools.Call] = []
        if self.split is not None:
            thoughts, text = self.split.feed(d.text)
            if d.finished:
                more, rest = self.split.finish()
                thoughts, text = thoughts + more, text + rest
            if thoughts:
                out.append({"reasoning_content": thoughts})
            if isinstance(self.split, HarmonySplit):
                found = self.split.take_calls()
                if self.how is None:  # no tool calls asked for: the call's text stays in the content
                    text += "".join(harmony.call_text(*c) for c in found)
                else:
                    calls = tools.harmony_calls(found, self.parallel)
                    calls = calls[: max(0, 1 - self.called)] if self.parallel is False else calls
            d = replace(d, text=text)
        if self.how is None or self.harmony:
            if d.text or (self.token_only and d.token_ids and not d.finish_reason):
                out.append({"content": d.text})
        elif self.how.startswith("named:"):  # the text is the arguments: stream them as they come
            if d.text:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": d.text}}
                if self.named_id is None:
                    self.named_id = tools.new_call_id()
                    call = {"index": 0, "id": self.named_id, "type": "function",
                            "function": {"name": self.how.removeprefix("named:"), "arguments": d.text}}
                out.append({"tool_calls": [call]})
        elif self.auto is not None:
            text = self.auto.feed(d.text)
            if d.finished:
                rest, calls = self.auto.finish(self.parallel)
                text += rest
            if text:
                out.append({"content": text})
        else:
            self.held += d.text
            if d.finished:
                calls = tools.parse_required(self.held)
                if self.parallel is False:
                    calls = calls[:1]
                if not calls and self.held:
                    out.append({"content": self.held})
        if calls:
            out.append({"tool_calls": [
                {"index": self.called + j, **c.to_tool_call().model_dump()} for j, c in enumerate(calls)]})
            self.called += len(calls)
        if d.finish_reason:
            named = self.named_id is not None
            reason = "tool_calls" if (self.called or named) and d.finish_reason == "stop" else d.finish_reason
            out.append({"finish_reason": reason})
        if self.logprobs and out:
            out[0]["logprobs"] = self.logprobs
            self.logprobs = []
        return out
