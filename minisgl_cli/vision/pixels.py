"""Image pixels between processes: POSIX shared memory, written once where a prompt is processed, read by each
scheduler rank, unlinked once every rank holds its copy.

A segment is a file on the shared-memory filesystem (/dev/shm: what shm_open creates), written and read here
directly rather than through multiprocessing.shared_memory, whose resource tracker (Python 3.11) unlinks a
segment when any process that merely attached to it exits, and warns about segments other processes unlinked.
Names carry a per-process prefix, so a runtime can sweep what a dead process left (`sweep`). torch loads only
where pixels are read or written.
"""

from __future__ import annotations

import itertools
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_ROOT = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
PREFIX = "minisgl-px"  # every segment's name starts so: `sweep` finds them
_ids = itertools.count()


def _path(name: str) -> Path:
    if "/" in name or not name.startswith(PREFIX):
        raise ValueError(f"not a pixel segment name: {name!r}")
    return _ROOT / name


def owner_tag(pid: int | None = None) -> str:
    """The name prefix of the segments process `pid` (default: this one) writes."""
    return f"{PREFIX}-{pid or os.getpid()}-"


def write(pixels: torch.Tensor) -> str:
    """Put a float32 tensor's bytes into a new segment; its name (read it with `read(name, shape)`)."""
    import torch

    return _write_bytes(pixels.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())


def _write_bytes(data: bytes) -> str:
    name = f"{owner_tag()}{next(_ids)}"
    with os.fdopen(os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600), "wb") as f:
        f.write(data)
    return name


def read(name: str, shape: list[int]) -> torch.Tensor:
    """The segment's pixels as a tensor of this process (ValueError naming the segment when it is gone or short)."""
    import torch

    path = _path(name)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = None
    numel = _checked_numel(name, size, shape)
    if not numel:
        return torch.empty(shape, dtype=torch.float32)
    # A private mapping: pages are read from the segment, nothing is written back, and unlinking it is safe.
    return torch.from_file(str(path), shared=False, size=numel, dtype=torch.float32).view(shape)


def read_bytes(name: str) -> bytes | None:
    """The segment's bytes (None when it is gone): what ranks on other hosts get inline."""
    try:
        return _path(name).read_bytes()
    except FileNotFoundError:
        return None


def from_bytes(data: bytes, shape: list[int]) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(data), dtype=torch.float32).view(shape)


def copy(name: str, shape: list[int]) -> str:
    """A new segment holding what segment `name` holds (one request's own copy of a shared image: every image
    request makes one, so bytes to bytes, no tensor between)."""
    data = read_bytes(name)
    _checked_numel(name, None if data is None else len(data), shape)
    assert data is not None
    return _write_bytes(data)


def _checked_numel(name: str, size: int | None, shape: list[int]) -> int:
    """The float32 count of `shape`, once a segment's `size` in bytes (None: it is gone) is known to hold it."""
    numel = 1
    for n in shape:
        numel *= n
    if size is None:
        raise ValueError(f"the image's pixels are gone (shared-memory segment {name})")
    if size != numel * 4:
        raise ValueError(f"the image's pixels are {size} bytes, not {numel * 4} (shared-memory segment {name})")
    return numel


def unlink(name: str) -> None:
    """Remove a segment (already gone is fine: its owner and a reader may both clean up)."""
    try:
        _path(name).unlink()
    except FileNotFoundError:
        pass


def sweep(pid: int) -> int:
    """Unlink every segment process `pid` wrote (it is gone: nobody will read them); how many there were."""
    found = list(_ROOT.glob(f"{owner_tag(pid)}*"))
    for path in found:
        path.unlink(missing_ok=True)
    return len(found)
