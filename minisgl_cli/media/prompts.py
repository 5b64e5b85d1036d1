"""The longest prompt a pipeline reads: its text tokenizer and the `max_sequence_length` its call defaults to.

A longer prompt would be cut silently by the pipeline (or fail in it): it is refused as a 400 before any model work.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from minisgl_cli.media.jobs import MediaError
from minisgl_cli.media.limits import caption_tokens


@dataclass
class PromptLimit:
    tokenizer: Any  # the pipeline's own (its `tokenizer` folder), None when it has none
    max_tokens: int | None  # None: the pipeline names no limit

    @classmethod
    def load(cls, model_dir: Path) -> PromptLimit:
        """Read from the pipeline dir without loading any weights."""
        import diffusers
        from transformers import AutoTokenizer

        index = json.loads((model_dir / "model_index.json").read_text())
        folder = model_dir / "tokenizer"
        transformer = model_dir / "transformer" / "config.json"
        return cls.of(getattr(diffusers, index.get("_class_name", ""), None),
                      AutoTokenizer.from_pretrained(folder) if folder.is_dir() else None,
                      json.loads(transformer.read_text()) if transformer.is_file() else {})

    @classmethod
    def builtin(cls, name: str) -> PromptLimit:
        """A built-in config's (`load_format="dummy"`, no dir to read): its pipeline class and the byte tokenizer it is
        built with, without building any weights."""
        import diffusers

        from minisgl_cli.media.configs import PIPELINES, builtin_kind, byte_tokenizer

        builtin_kind(name)  # an unknown name: the MediaError that names the choices
        _, pipeline, parts = PIPELINES[name]
        return cls.of(getattr(diffusers, pipeline), byte_tokenizer(), parts["transformer"][1])

    @classmethod
    def of(cls, pipeline: type | None, tokenizer: Any, transformer_config: dict[str, Any]) -> PromptLimit:
        """A pipeline class's limit with its tokenizer, lowered to what its DiT's rotary table holds (the worker calls
        the pipeline with `max_sequence_length` lowered alike: limits.prompt_kwargs)."""
        default = None
        if pipeline is not None:
            param = inspect.signature(pipeline.__call__).parameters.get("max_sequence_length")
            if param is not None and isinstance(param.default, int):
                default = param.default
        if default is None and tokenizer is not None and tokenizer.model_max_length < 1_000_000:
            default = tokenizer.model_max_length  # else transformers' "no limit" sentinel
        table = caption_tokens(transformer_config)
        return cls(tokenizer, table if default is None or (table is not None and table < default) else default)

    def count(self, prompt: str) -> int:
        if self.tokenizer is None:
            return 0
        return len(self.tokenizer(prompt, add_special_tokens=False).input_ids)

    def check(self, prompt: str | None, param: str = "prompt") -> int:
        """The prompt's token count; MediaError (400) past the limit."""
        if not prompt:
            return 0
        n = self.count(prompt)
        if self.max_tokens is not None and n > self.max_tokens:
            raise MediaError(f"{param} is {n} tokens; this pipeline reads at most {self.max_tokens}", param)
        return n
