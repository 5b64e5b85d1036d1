"""Grammars: structured output (JSON schema, regex, EBNF) compiled by xgrammar into per-request token matchers.

A request with `json_schema`, `regex`, `ebnf` or `structural_tag` (xgrammar's: text, special tokens and JSON schemas
combined, as harmony's forced tool calls need) gets a matcher at admission (compiling is milliseconds and cached by
grammar text, and doing it in the loop keeps every TP rank's schedule identical). Before each step that samples for
such a request, its matcher writes the allowed next tokens into one row of a bitmask the sampler applies; after the
step it accepts the token drawn. A verify step (speculative decoding) has a row per draft: the matcher walks the
drafts to fill them and rolls back, then accepts what the step kept. xgrammar's index of the tokenizer is built on a
thread when the scheduler starts serving (`prepare`), so the first constrained request does not stall every running
one for the seconds it takes; without xgrammar nothing is built and such requests are refused at admission
(admission.py), never reaching `matcher`.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import re
import threading
from pathlib import Path
from typing import Any

import torch

from minisgl_cli.admission import STRUCTURED_MISSING, structured_output_available
from minisgl_cli.types import SamplingParams

log = logging.getLogger("minisgl.grammar")

_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:83: " before a message


class GrammarError(ValueError):
    """A grammar that does not compile: the request's fault."""


class Grammars:
    """One engine's grammar compiler (built on first use from its tokenizer) and the bitmask buffers it fills."""

    SLOTS = 3  # as with sampled-id read-backs: a buffer is reused only after its step has been read

    def __init__(self, model_dir: Path | None, vocab_size: int, stop_ids: frozenset[int], device: torch.device):
        self.model_dir, self.vocab_size, self.stop_ids, self.device = model_dir, vocab_size, stop_ids, device
        self._compiler = None
        self._stop_text: dict[str, int] = {}  # each stop token's text -> its id
        self._building: threading.Thread | None = None
        self._buffers: list[torch.Tensor] = []
        self._next = 0

    def prepare(self) -> None:
        """Build the compiler in the background, where there is a tokenizer and xgrammar imports."""
        if self.model_dir is not None and structured_output_available() and self._building is None:
            self._building = threading.Thread(target=self._build_quietly, name="minisgl-grammar", daemon=True)
            self._building.start()

    def close(self) -> None:
        """Wait for a background build still running: a process that exits while xgrammar's native code runs on
        that thread aborts ("terminate called without an active exception"), which a quick start-and-quit hits."""
        if self._building is not None:
            self._building.join()

    def _build_quietly(self) -> None:
        try:
            self.compiler()
        except Exception:  # noqa: BLE001 (the first request that needs it builds again and gets the error)
            log.exception("grammar compiler: background build failed")

    def compiler(self):
        if self._building is not None and self._building is not threading.current_thread():
            self._building.join()
        if self._compiler is None:
            if self.model_dir is None:
                raise GrammarError("structured output needs the model's tokenizer; this engine has dummy weights "
                                   "and none")
            if not structured_output_available():
                raise GrammarError(STRUCTURED_MISSING)
            import xgrammar as xgr
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(self.model_dir))
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                      stop_token_ids=sorted(self.stop_ids) or None)
            xgr_version = importlib.metadata.version("xgrammar")
            self._stop_text = {tok.convert_ids_to_tokens(i): i for i in self.stop_ids if i < len(tok)}
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            log.info("grammar compiler ready: xgrammar %s, vocab %d, stop ids %s", xgr_version, self.vocab_size,
                     sorted(self.stop_ids))
        return self._compiler

    def matcher(self, p: SamplingParams):
        """A fresh matcher for the request's grammar (GrammarError if it does not compile)."""
        compiler = self.compiler()  # first: it raises GrammarError where xgrammar is missing
        import xgrammar as xgr

        kind = next(k for k in ("json_schema", "regex", "ebnf", "structural_tag") if getattr(p, k) is not None)
        stops = None
        try:
            if p.json_schema is not None:
                # Compact JSON: free whitespace would let a small model pad with newlines until max_tokens.
                compiled = compiler.compile_json_schema(p.json_schema, any_whitespace=False, strict_mode=True)
            elif p.regex is not None:
                compiled = compiler.compile_regex(p.regex)
            elif p.ebnf is not None:
                compiled = compiler.compile_grammar(p.ebnf)
            elif p.structural_tag is not None:  # its tokens named by their text resolve through the vocabulary
                tag, stops = self._ending(p.structural_tag)
                compiled = compiler.compile_structural_tag(tag)
        except Exception as exc:  # xgrammar raises RuntimeError (and others) with its parser's message
            message = _CPP_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else "")
            raise GrammarError(f"invalid {kind}: {message or type(exc).__name__}") from None
        return xgr.GrammarMatcher(compiled, override_stop_tokens=stops)  # rolls back any number of tokens

    def _ending(self, tag: str) -> tuple[str, list[int] | None]:
        """A structural tag whose format is a sequence ending in one of the stop tokens (harmony's forced call, in
        `<|call|>`): xgrammar keeps stop tokens out of a grammar's body, so it compiles without that last token, and
        its matcher takes that one alone as the end (not any other stop token)."""
        spec: Any = json.loads(tag)
        fmt = spec.get("format") if isinstance(spec, dict) else None
        if not (isinstance(fmt, dict) and fmt.get("type") == "sequence" and fmt.get("elements")):
            return tag, None
        last = fmt["elements"][-1]
        token = last.get("token") if isinstance(last, dict) and last.get("type") == "token" else None
        stop = token if isinstance(token, int) else self._stop_text.get(token) if isinstance(token, str) else None
        if stop not in self.stop_ids:
            return tag, None
        fmt["elements"] = fmt["elements"][:-1]
        return json.dumps(spec), [stop]

    @staticmethod
    def trim(matcher, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the grammar allows after what `matcher` accepted (ending at a token that
        completes it); the matcher is left as it was."""
        n = 0
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    def bitmask(self, rows: list[tuple[Any, list[int]]]) -> torch.Tensor | None:
        """Allowed-token bitmask [rows, ceil(V/32)] int32 for one step (None when no row is constrained). `rows`: per
        request, its matcher (None: unconstrained) and the drafts its verify rows feed (allowed: `trim`ed), each
        request's rows in order: the first from the matcher's state, each next one after the draft before it.
        Other rows allow everything. Pinned on CUDA, so its upload is async."""
        if all(m is None for m, _ in rows):
            return None
        n, words = sum(1 + len(d) for _, d in rows), (self.vocab_size + 31) // 32
        i = self._next
        self._next = (i + 1) % self.SLOTS
        if len(self._buffers) <= i:
            self._buffers.append(torch.empty(0, words, dtype=torch.int32))
        if self._buffers[i].shape[0] < n:
            self._buffers[i] = torch.empty(max(n, 64), words, dtype=torch.int32,
                                           pin_memory=self.device.type == "cuda")
        mask = self._buffers[i][:n]
        mask.fill_(-1)
        at = 0
        for m, drafts in rows:
            if m is not None:
                for j in range(len(drafts) + 1):
                    if j:
                        m.accept_token(drafts[j - 1])
                    if not m.is_terminated():
                        m.fill_next_token_bitmask(mask, at + j)
                if drafts:
                    m.rollback(len(drafts))
            at += 1 + len(drafts)
        return mask
