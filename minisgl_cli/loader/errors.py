"""Loader errors: one exception type whose message is a single line naming the path and what was expected."""

from __future__ import annotations

from pathlib import Path

EXPECTED_MODEL = (
    "a directory with config.json and *.safetensors, a .gguf file, or a built-in name such as smollm2-135m-instruct"
)


class ModelLoadError(Exception):
    """A model could not be found, read or converted; str() is always one line, fit to print as-is.

    Either pass a finished message (`ModelLoadError("no weights in /x (expected *.safetensors files)")`)
    or the parts (`ModelLoadError("model not found", path, expected)`), which format as
    "<problem>: <path> (expected <expected>)".
    """

    def __init__(self, message: str, path: str | Path | None = None, expected: str | None = None) -> None:
        self.path = None if path is None else str(path)
        self.expected = expected if path is None else (expected or EXPECTED_MODEL)
        if path is not None:
            message = f"{message}: {path} (expected {self.expected})"
        super().__init__(_one_line(message))


def _one_line(text: str) -> str:
    # Wrapped library errors may carry newlines; the message contract is a single line.
    return " ".join(str(text).split())
