"""The one admission check every request passes before it reaches a scheduler, whichever front sent it.

Token ids in the vocabulary (prompt, stop ids, logit bias keys), a prompt that fits the context, and the features whose
library is missing. Each refusal is an `AdmissionError` with one `ErrorCode`, one message and the field it is about,
so the server, `LLM`, the REPL and `/generate` say the same thing. The prompt is checked once, where its ids are first
known (`admit_prompt`: where it is tokenized, the client in-process or the tokenizer worker, or the client a front
hands ids to); the request's parameters by the client that sends it (`admit_params`). A scheduler trusts what our
clients send it (it keeps only an O(1) guard against an internal bug). The server sizes the token budget from the
prompt's length (`new_tokens`).
"""

from __future__ import annotations

import functools
import importlib

from minisgl_cli.types import ErrorCode, SamplingParams


class AdmissionError(ValueError):
    """A request refused before it runs; `param` names the offending field (OpenAI style) where one does."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST, param: str | None = None):
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


@functools.cache
def structured_output_available() -> bool:
    """xgrammar imports here (it is the `structured` extra; a plain install lacks it)."""
    try:
        importlib.import_module("xgrammar")
    except ImportError:
        return False
    return True


STRUCTURED_MISSING = ('structured output (response_format, regex, ebnf, forced tool calls) needs the xgrammar '
                      'package: pip install "minisgl[structured]"')


def admit_prompt(ids: list[int], vocab_size: int, max_context_len: int, param: str = "prompt") -> None:
    """Raise AdmissionError unless the prompt can run on this engine: not empty, in the vocabulary, shorter than the
    context (`param`: the field it came in)."""
    if not ids:
        raise AdmissionError(f"the {param} is empty", param=param)
    _in_vocab(ids, vocab_size, param)
    if len(ids) >= max_context_len:
        raise AdmissionError(f"the prompt has {len(ids)} tokens; the context limit is {max_context_len}",
                             ErrorCode.CONTEXT_LENGTH, param)


def admit_params(params: SamplingParams, vocab_size: int) -> None:
    """Raise AdmissionError unless the request's parameters can run on this engine: stop ids and logit bias keys in
    the vocabulary, a grammar only where xgrammar is installed."""
    _in_vocab(params.stop_token_ids, vocab_size, "stop_token_ids")
    _in_vocab(list(params.logit_bias or ()), vocab_size, "logit_bias")
    if params.constrained and not structured_output_available():
        raise AdmissionError(STRUCTURED_MISSING, ErrorCode.UNSUPPORTED, grammar_field(params))


def grammar_field(params: SamplingParams) -> str | None:
    """The field that holds the request's grammar (json_schema, regex, ebnf, structural_tag), or None: what a
    grammar's error is about."""
    return next((f for f in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(params, f) is not None),
                None)


def new_tokens(prompt_tokens: int, requested: int | None, max_context_len: int, param: str = "max_tokens",
               what: str = "", prompt_param: str = "prompt") -> int:
    """How many tokens a request may generate: what it asked (`param`), or all that fit (AdmissionError when it asked
    for more than fits, or nothing fits: a prompt, `prompt_param`, as long as the context, which `admit_prompt`
    refuses alike, so only a prompt it never saw meets it here: the transformers VLM's). `what` qualifies the prompt's
    count (" (images included)")."""
    room = max_context_len - prompt_tokens
    if room <= 0:
        raise AdmissionError(f"the prompt has {prompt_tokens} tokens{what}; the context limit is {max_context_len}",
                             ErrorCode.CONTEXT_LENGTH, prompt_param)
    if requested is not None and requested > room:
        raise AdmissionError(f"{param}={requested} is too large: the prompt has {prompt_tokens} tokens{what} and the "
                             f"context limit is {max_context_len}, so at most {room} new tokens fit",
                             ErrorCode.CONTEXT_LENGTH, param)
    return room if requested is None else requested


def _in_vocab(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise AdmissionError(f"token id {bad} in {param} is out of range: the vocabulary has {vocab_size} tokens",
                             param=param)
