"""HostBuffers: the pinned host memory one engine owns for moving step data to and from the device.

Fresh pinned allocations can cost a cudaHostAlloc, which waits for the GPU: with overlap scheduling
that would stall the CPU on the step in flight. So each engine keeps a few pinned buffers and reuses
them. Each engine has its own: two engines in one process never share a slot.
"""

from __future__ import annotations

import array
import ctypes
import ctypes.util
import functools
from collections.abc import Sequence
from typing import Any

import torch

_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f"}


def host_tensor(data: Sequence[float], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a host list, through the array module where the dtype has a C type: a third of the cost of
    `torch.tensor` on a list of Python ints (a step's metadata is a few thousand of them)."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not data:
        return torch.tensor(list(data), dtype=dtype)
    return torch.frombuffer(data if isinstance(data, array.array) else array.array(code, data), dtype=dtype)


@functools.cache
def _libc_trim():
    """glibc's malloc_trim, or None (another C library)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give the C heap's free pages back to the OS. A closed engine's CPU memory (its KV pool, weights, step
    buffers) was allocated from its scheduler thread's malloc arena, which glibc keeps once freed: a process that
    opens and closes engines in turn (tests, notebooks) grew ~0.8 GB an engine without this."""
    trim = _libc_trim()
    if trim is not None:
        trim(0)


class _UploadRing:
    """Reusable pinned byte buffers for host-to-device copies of step metadata. A slot is reused only after the
    event recorded behind its copy has fired: with a few uploads a step, 16 slots put that several steps back (at
    most one step is in flight, so the wait never stalls on it)."""

    SLOTS = 16

    def __init__(self) -> None:
        self._bufs: list[torch.Tensor | None] = [None] * self.SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._next = 0

    def copy(self, data: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.copy_bytes(memoryview(array.array(_ARRAY_CODES[dtype], data)).cast("B"), device).view(dtype)

    def copy_bytes(self, raw: memoryview, device: torch.device) -> torch.Tensor:
        """`raw` on the device (uint8), through the next pinned slot: one host memmove and one async copy."""
        i = self._next
        self._next = (i + 1) % self.SLOTS
        ev = self._events[i]
        if ev is not None:
            ev.synchronize()
        n = raw.nbytes
        buf = self._bufs[i]
        if buf is None or buf.numel() < n:
            with torch.inference_mode(False):  # a normal tensor, written in and out of inference mode alike
                buf = self._bufs[i] = torch.empty(max(n, 32768, 2 * (buf.numel() if buf is not None else 0)),
                                                  dtype=torch.uint8, pin_memory=True)
        if n:  # a plain memmove: a torch copy_ here cost more than the bytes (it dispatches like any op)
            ctypes.memmove(buf.data_ptr(), (ctypes.c_char * n).from_buffer(raw), n)
        out = buf[:n].to(device, non_blocking=True)
        ev = ev or torch.cuda.Event()
        ev.record()
        self._events[i] = ev
        return out


class _ReadbackSlots:
    """Reusable pinned int64 buffers for device-to-host copies of sampled ids. Three slots: a step's
    buffer is read (after its event) before the step two launches later takes the slot again, since
    only one step is ever unread."""

    SLOTS = 3

    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []
        self._next = 0

    def buffer(self, n: int) -> torch.Tensor:
        i = self._next
        self._next = (i + 1) % self.SLOTS
        if len(self._slots) <= i:
            self._slots.append(torch.empty(0, dtype=torch.int64))
        if self._slots[i].numel() < n:
            with torch.inference_mode(False):  # as the upload ring's
                self._slots[i] = torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=True)
        return self._slots[i][:n]


class HostBuffers:
    """One engine's pinned staging memory: uploads of step metadata, read-backs of sampled ids."""

    def __init__(self) -> None:
        self._upload = _UploadRing()
        self._readback = _ReadbackSlots()

    def to_device(self, data: Sequence[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A host list (ints, or floats for a float dtype) on `device`: asynchronously through the pinned ring on
        CUDA, directly elsewhere."""
        if device.type != "cuda":
            return host_tensor(data, dtype).to(device)
        return self._upload.copy(data, dtype, device)

    def to_device_parts(self, parts: Sequence[Sequence[float]], dtype: torch.dtype,
                        device: torch.device) -> list[torch.Tensor]:
        """Several host lists in one upload, each a view of it that starts on a 16-byte boundary. Triton compiles a
        kernel once per alignment of its pointers: views at offsets that vary with a step's sizes made steps of a
        new parity compile a new variant mid-serving (a ~1 s stall, 1 draw in 4 of the nano-vllm preset)."""
        return self.to_device_mixed([(parts, dtype)], device)[0]

    def to_device_mixed(self, groups: Sequence[tuple[Sequence[Sequence[float]], torch.dtype]],
                        device: torch.device) -> list[list[torch.Tensor]]:
        """`to_device_parts` for several dtypes at once: one upload on CUDA (a step's int64 and int32 fields)."""
        flats: list[array.array[Any]] = []
        starts: list[list[int]] = []
        for parts, dtype in groups:
            step = max(1, 16 // dtype.itemsize)
            flat: array.array[Any] = array.array(_ARRAY_CODES[dtype])
            at = []
            for part in parts:
                at.append(len(flat))
                flat.extend(part)
                flat.extend([0] * (-len(flat) % step))
            flats.append(flat)
            starts.append(at)
        raw = bytearray()
        for flat in flats:
            raw += flat.tobytes()
        if device.type == "cuda":  # through the pinned ring, asynchronously
            dev = self._upload.copy_bytes(memoryview(raw), device)
        else:  # the bytes as they are (a CPU tensor shares them)
            dev = torch.frombuffer(raw, dtype=torch.uint8).to(device) if raw else torch.empty(0, dtype=torch.uint8)
        out: list[list[torch.Tensor]] = []
        offset = 0
        for (parts, dtype), flat, at in zip(groups, flats, starts):
            whole = dev[offset : offset + len(flat) * dtype.itemsize].view(dtype)
            offset += len(flat) * dtype.itemsize
            out.append([whole[a : a + len(part)] for a, part in zip(at, parts)])
        return out

    def readback(self, n: int) -> torch.Tensor:
        """A pinned int64 host buffer of n entries to copy sampled ids into (valid until 3 more calls)."""
        return self._readback.buffer(n)
