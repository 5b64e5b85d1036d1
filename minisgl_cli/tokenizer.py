"""Tokenize, apply the chat template (tools included), detokenize incrementally (UTF-8 safe), cut at stop strings.

`RequestDecoder` puts the output side together for one request: the scheduler's token outputs in,
text pieces (and token logprobs, when asked) out, ended by a finish reason, a stop string or an error.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from minisgl_cli import harmony
from minisgl_cli.loader.errors import ModelLoadError
from minisgl_cli.messages import DecodedPiece, TokenOutput
from minisgl_cli.types import GenerateRequest, SamplingParams, TokenLogprob, TopLogprob

# Qwen2.5's tool prompt (Hermes-style): what a template that knows no tools gets as its system prompt.
_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class Tokenizer:
    """The model's HF tokenizer plus what the engine needs from it: EOS ids and the chat template."""

    def __init__(self, model_dir: Path | str):
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(model_dir))
        except Exception as exc:
            raise ModelLoadError(
                f"tokenizer unreadable ({type(exc).__name__}: {exc})",
                model_dir,
                "tokenizer files (tokenizer.json, tokenizer_config.json)",
            ) from None
        self.eos_token_ids = self._eos_ids(Path(model_dir))
        self.vocab_size = len(self.hf)
        # Templates that render `tools` themselves (Qwen2.5/3, Llama 3.1); others get the Hermes prompt below.
        self.template_takes_tools = "tools" in (getattr(self.hf, "chat_template", None) or "")
        # gpt-oss's vocabulary: its chats are rendered in the harmony format (harmony.py), whatever template ships
        self.harmony = harmony.is_harmony(self.hf.get_vocab())
        self._token_text: dict[int, str] = {}

    def _eos_ids(self, model_dir: Path) -> frozenset[int]:
        ids = set()
        if self.hf.eos_token_id is not None:
            ids.add(self.hf.eos_token_id)
        gen = model_dir / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        return frozenset(ids)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        if self.harmony:
            return self.hf.encode(harmony.render(messages, tools, template_kwargs, add_generation_prompt),
                                  add_special_tokens=False)
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; send a plain prompt instead")
        if not self.template_takes_tools:
            messages, tools = hermes_messages(messages, tools), None
        as_tools = cast("list[dict | Callable] | None", tools or None)  # transformers also takes functions
        text = self.hf.apply_chat_template(messages, tools=as_tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))
        return self.hf.encode(text, add_special_tokens=False)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), as logprobs report it."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = cast(str, self.hf.decode([token_id], skip_special_tokens=False))
        return text

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return cast(str, self.hf.decode(ids, skip_special_tokens=skip_special_tokens))  # one id list: one string

    def decode_batch(self, seqs: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        """Several id lists, each straight through the Rust tokenizer where the HF one has it and adds no clean-up
        pass of its own (each string is then what `decode` gives, at a quarter of its cost: the HF wrapper's Python
        is most of a short decode); `decode` each otherwise. Not the Rust `decode_batch`: its thread pool, woken
        for a few ids, cost 10x more than it saved."""
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None and not getattr(self.hf, "clean_up_tokenization_spaces", True):
            return [backend.decode(ids, skip_special_tokens=skip_special_tokens) for ids in seqs]
        return [self.decode(ids, skip_special_tokens) for ids in seqs]


@dataclass
class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas without splitting a UTF-8 character.

    It decodes a short window (from `prefix` to the end) and emits what the newest tokens added;
    a window ending in U+FFFD means a multi-byte character is still incomplete, so it waits.
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    ids: list[int] = field(default_factory=list)
    prefix: int = 0  # window start: context tokens so spaces merge as in a full decode
    read: int = 0  # tokens whose text has been emitted

    def feed(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self.advance(*self._decoded())

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        return self.advance(*self._decoded(), final=True)

    def _decoded(self) -> tuple[str, str]:
        # decode(ids, skip) only: the VLM and mlx paths hand in their own tokenizers, duck-typed.
        window, emitted = (self.tokenizer.decode(ids, self.skip_special_tokens) for ids in self.spans())
        return window, emitted

    def spans(self) -> list[list[int]]:
        """The two id lists to decode for the text the newest ids add: the window, and its part already emitted."""
        return [self.ids[self.prefix :], self.ids[self.prefix : self.read]]

    def advance(self, window: str, emitted: str, final: bool = False) -> str:
        """The new text, given the spans' decoded strings; "" while the window ends in an incomplete character
        (unless final: then what there is)."""
        if final:
            self.read = len(self.ids)
            return window[len(emitted) :]
        if window.endswith("\ufffd"):
            return ""
        # The window restarts at the last emitted token, so each decode stays a few tokens long.
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(emitted) :]


@dataclass
class StopStringMatcher:
    """Holds back text that could start a stop string; reports the text to emit and whether to stop."""

    stops: list[str]
    pending: str = ""
    matched: str | None = None  # the stop string that ended the text (Anthropic's `stop_sequence` names it)

    def push(self, text: str) -> tuple[str, bool]:
        if not self.stops:
            return text, False
        buf = self.pending + text
        hits = [(buf.find(s), s) for s in self.stops if s and s in buf]
        if hits:
            pos, self.matched = min(hits)
            self.pending = ""
            return buf[:pos], True
        # Keep the longest tail that is a prefix of some stop string.
        keep = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), 0, -1):
                if s.startswith(buf[-n:]):
                    keep = max(keep, n)
                    break
        self.pending = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        text, self.pending = self.pending, ""
        return text


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template that knows no tools: the tool list in the system prompt, assistant tool calls as
    `<tool_call>` text and tool results as user turns in `<tool_response>` tags (Qwen2.5's format)."""
    out: list[dict] = []
    for m in messages:
        role, content = m.get("role"), m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = [c.get("function", c) for c in m["tool_calls"]]
            tags = [f"<tool_call>\n{json.dumps({'name': c.get('name'), 'arguments': c.get('arguments')})}\n</tool_call>"
                    for c in calls]
            content = "\n".join([content] * bool(content) + tags)
            out.append({"role": "assistant", "content": content})
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            out.append({**m, "content": content})
    if tools:
        prompt = _TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def prompt_ids(tokenizer: Tokenizer | None, req: GenerateRequest) -> list[int]:
    """Token ids of a request's prompt: its ids, its text encoded, or its messages through the chat template."""
    if req.input_ids is not None:
        return list(req.input_ids)
    if tokenizer is None:
        raise ValueError("this engine has dummy weights and no tokenizer: send input_ids")
    if req.messages is not None:
        if not req.messages:
            raise ValueError("messages must not be empty")
        return tokenizer.apply_chat_template(req.messages, tools=req.tools, template_kwargs=req.template_kwargs)
    if req.tools:
        raise ValueError("tools need messages (a chat), not a plain prompt")
    return tokenizer.encode(req.prompt or "")


class RequestDecoder:
    """One request's output side: token ids -> text (UTF-8 safe), stop strings, finish reason."""

    def __init__(self, tokenizer: Tokenizer | None, params: SamplingParams):
        self.tokenizer = tokenizer
        self.with_logprobs = params.wants_logprobs
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens) if tokenizer else None
        self.stopper = StopStringMatcher(list(params.stop))
        # Text only at the end: the ids are kept and decoded once when the request ends (no per-token decode).
        self.whole = not params.stream_text and not params.stop

    def _text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer else ""

    def _logprobs(self, items: list[TokenOutput]) -> list[TokenLogprob]:
        return [TokenLogprob(o.token_id, self._text(o.token_id), o.logprob,
                             [TopLogprob(t, self._text(t), lp) for t, lp in zip(o.top_ids or [], o.top_logprobs or [])])
                for o in items if o.token_id is not None and o.logprob is not None]

    def one_by_one(self, items: list[TokenOutput]) -> bool:
        """Whether these outputs must be decoded a token at a time: several tokens of a request with stop strings
        (a verify step's accepted run), which end at the token that completes a stop string, as without speculation."""
        return bool(self.stopper.stops) and sum(o.token_id is not None for o in items) > 1

    def feed(self, items: list[TokenOutput]) -> DecodedPiece:
        """The piece these outputs add (decoding on its own; `decode_steps` decodes many requests' at once)."""
        if self.one_by_one(items):
            pieces: list[DecodedPiece] = []
            for o in items:
                pieces.append(self.feed([o]))
                if pieces[-1].finished:
                    break  # a stop string (or the end): the tokens after it are not the request's
            return _joined(pieces)
        spans = self.spans(items)
        texts = self.tokenizer.decode_batch(spans, self.detok.skip_special_tokens) if spans and self.detok and \
            self.tokenizer else []
        return self.piece(items, texts)

    def spans(self, items: list[TokenOutput]) -> list[list[int]]:
        """Take the outputs' token ids in; the id lists whose decoded strings `piece` needs for their text."""
        last = items[-1]
        if self.detok is None or last.error:
            return []
        self.detok.ids.extend(o.token_id for o in items if o.token_id is not None)
        if self.whole:  # the whole text once, at the end
            return [list(self.detok.ids)] if last.finish_reason is not None else []
        return self.detok.spans()

    def piece(self, items: list[TokenOutput], texts: list[str]) -> DecodedPiece:
        """The piece for the outputs `spans` took in, given its spans' decoded strings."""
        tokens = [o.token_id for o in items if o.token_id is not None]
        last = items[-1]
        prefill_s = next((o.prefill_s for o in items if o.prefill_s is not None), None)
        if last.error:
            return DecodedPiece(last.rid, "", tokens, None, last.error, last.cached_tokens, prefill_s,
                                error_code=last.error_code)
        logprobs = self._logprobs(items) if self.with_logprobs else None
        reason = last.finish_reason
        if self.detok is None or not texts:
            text = ""
        elif self.whole:
            text = texts[0]
        else:  # the end also takes what an incomplete character held back
            text = self.detok.advance(texts[0], texts[1], final=reason is not None)
        text, hit_stop = self.stopper.push(text)
        early = hit_stop and reason is None
        if hit_stop:
            reason = "stop"
        elif reason is not None:
            text += self.stopper.flush()
        drafted = sum(o.drafted for o in items if o.token_id is not None)
        return DecodedPiece(last.rid, text, tokens, reason, None, last.cached_tokens, prefill_s, early, logprobs,
                            drafted=drafted, stop_string=self.stopper.matched if hit_stop else None)


def _joined(pieces: list[DecodedPiece]) -> DecodedPiece:
    """Consecutive pieces of one request as one."""
    last = pieces[-1]
    lps = [lp for p in pieces for lp in p.logprobs or []]
    return DecodedPiece(last.rid, "".join(p.text for p in pieces), [t for p in pieces for t in p.token_ids],
                        last.finish_reason, last.error, last.cached_tokens,
                        next((p.prefill_s for p in pieces if p.prefill_s is not None), None), last.stopped_early,
                        lps if any(p.logprobs is not None for p in pieces) else None, last.error_code,
                        sum(p.drafted for p in pieces), last.stop_string)


def decode_steps(tokenizer: Tokenizer | None,
                 work: list[tuple[RequestDecoder, list[TokenOutput]]]) -> list[DecodedPiece | BaseException]:
    """Many requests' outputs of one step as pieces, their text decoded in one pass per skip_special_tokens value
    (`Tokenizer.decode_batch`) instead of two HF calls per request; a request whose decoding fails gets its
    exception in its place."""
    spans: list[list[list[int]] | BaseException] = []
    for decoder, items in work:
        if decoder.one_by_one(items):
            spans.append([])  # decoded alone below
            continue
        try:
            spans.append(decoder.spans(items))
        except Exception as exc:  # noqa: BLE001 -- that request fails alone
            spans.append(exc)
    texts: list[list[str]] = [[] for _ in work]
    if tokenizer is not None:
        for skip in (True, False):
            rows = [i for i, (d, _) in enumerate(work)
                    if isinstance(spans[i], list) and spans[i] and d.detok and d.detok.skip_special_tokens == skip]
            if not rows:
                continue
            try:
                flat = tokenizer.decode_batch([ids for i in rows for ids in cast(list, spans[i])], skip)
            except Exception:  # noqa: BLE001 -- some request's ids: find it by decoding each request alone
                for i in rows:
                    try:
                        texts[i] = tokenizer.decode_batch(cast(list, spans[i]), skip)
                    except Exception as exc:  # noqa: BLE001
                        spans[i] = exc
                continue
            at = 0
            for i in rows:
                n = len(cast(list, spans[i]))
                texts[i], at = flat[at : at + n], at + n
    out: list[DecodedPiece | BaseException] = []
    for (decoder, items), span, text in zip(work, spans, texts):
        if isinstance(span, BaseException):
            out.append(span)
            continue
        try:
            out.append(decoder.feed(items) if decoder.one_by_one(items) else decoder.piece(items, text))
        except Exception as exc:  # noqa: BLE001 -- that request fails alone
            out.append(exc)
    return out
