"""CompiledDecode: the CPU decode step compiled ahead of time (AOTInductor), stored on disk, loaded in a second.

A CPU decode step of a small model is mostly op overhead, not arithmetic: SmolLM2-135M's int4 step runs ~1,300 torch
ops, and its int4 GEMVs are under a third of the step (docs/benchmarks.md). Exported (torch.export) and compiled by
AOTInductor, the step is one shared library: inductor's C++ loops for the norms, RoPE, residual adds and the rest
around the same GEMV, KV gather (build._gather_in_aten) and attention kernels eager calls, run with no Python, no
guards and no per-op dispatch.

Built once per machine, by one build process (`python -m minisgl_cli.cpu_step.build`, minutes of one core; the
engines decode eagerly meanwhile) that holds the key's lock file and outlives the engine that started it (a short chat
still leaves the step built), into a package under env.compiled_dir() named by the digest of its StepKey: the weights
(inside the package), the model's shapes, the linear method, the dtypes, torch's version, this CPU (the C++ targets
its ISA) and the source of the modules the step runs. The package is written under a temporary name and renamed into
place whole. Every later start with the same key loads it before serving, and an engine started during the build
loads it once it is stored; a package whose stored key is not the engine's is rebuilt, never loaded.

One graph takes every decode batch (1..MAX_ROWS rows, any context length, any pool size), and gives a row the same
arithmetic whatever the rows beside it (the GEMV and attention kernels are eager's; inductor's loops run per row),
so in the compiled mode too a greedy answer does not depend on the batch. The LM head stays eager (fbgemm's packed
int8 weight is no tensor AOTInductor can hold).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import pickle
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minisgl_cli import env
from minisgl_cli.attention.torch_backend import TorchBackend, TorchDecodeMeta, decode_mask
from minisgl_cli.engine.batch import ForwardBatch
from minisgl_cli.kernels.cpu import int4 as cpu_int4
from minisgl_cli.kernels.cpu import library as cpu_library
from minisgl_cli.notice import notice

if TYPE_CHECKING:
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.models import ModelConfig

log = logging.getLogger("minisgl.compile")

MAX_ROWS = 1024  # decode rows a step takes at most (past them it runs eagerly)
_FORMAT = 2  # DecodeStep's inputs and outputs: bump on a change
_CODE = (".py", ".cpp", ".h")  # the source files of _TRACED (kernels/cpu/csrc: the C++ kernels the step calls)
_KEY = "minisgl_step_key"  # the package's metadata entry holding its StepKey
_ROOT = Path(__file__).resolve().parents[1]  # minisgl_cli/
# The code the step runs and the code that builds it: an edit there rebuilds (StepKey.source).
_TRACED = ("models", "layers", "attention", "kernels", "kvcache", "engine/batch.py", "engine/host.py", "cpu_step")
_UNTRACED = ("kernels/triton",)  # CUDA's kernels, never in a CPU step: an edit there keeps the stored steps


@dataclass(frozen=True)
class StepKey:
    """What a stored step was compiled for: a package serves only an engine of an equal key."""

    weights: str  # the model files' names, sizes and mtimes (the package holds the weights), or dummy's seed
    config: str  # the model's shapes: its ModelConfig
    quantization: str
    dtype: str
    kv_dtype: str
    torch_version: str
    cpu: str  # model name and flags: the C++ is compiled for this CPU's ISA
    source: str  # digest of the traced modules' source: an edit rebuilds
    kernels: str  # the C++ kernels the step calls: the int4 GEMM (kernels/cpu/int4.py: its op and weight layout) and
    # the decode attention (minisgl's own or SDPA: attention/torch_backend.py)
    format: int = _FORMAT

    @staticmethod
    def of(cfg: EngineConfig, model_cfg: ModelConfig, model_dir: Path | None, source: str, dtype: torch.dtype,
           kv_dtype: torch.dtype, quantization: str) -> StepKey:
        """The key of an engine: its config, model, where the weights came from (`source`: dummy or a loader's)."""
        if source == "dummy" or model_dir is None:
            weights = f"dummy seed={cfg.seed}"
        else:
            files = sorted(p for p in model_dir.iterdir() if p.is_file())
            weights = _digest(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}".encode() for p in files)
        return StepKey(weights, json.dumps(dataclasses.asdict(model_cfg), sort_keys=True), quantization,
                       str(dtype), str(kv_dtype), torch.__version__, _cpu(), _source(),
                       f"int4={cpu_int4.kernel() if quantization == 'int4' else ''} "
                       f"attention={'sdpa' if cpu_library.missing('decode_attn') else 'minisgl'}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @property
    def path(self) -> Path:
        """Where the package of this key lives."""
        return env.compiled_dir() / f"decode-{_digest([self.to_json().encode()])}.pt2"


def _digest(parts: Any) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part)
        h.update(b"\0")
    return h.hexdigest()[:24]


def _cpu() -> str:
    """This CPU's model name and feature flags (/proc/cpuinfo), or what the platform says of it elsewhere."""
    try:
        info = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return f"{platform.machine()} {platform.processor()} {torch.backends.cpu.get_cpu_capability()}"
    fields = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info.splitlines())}
    return " | ".join(fields.get(k, "") for k in ("vendor_id", "model name", "flags"))


def _source() -> str:
    files = sorted(f for part in _TRACED for f in ([_ROOT / part] if part.endswith(".py") else
                                                    (p for p in (_ROOT / part).rglob("*") if p.suffix in _CODE)))
    skip = tuple(_ROOT / part for part in _UNTRACED)
    return _digest(f.read_bytes() for f in files if not any(f.is_relative_to(d) for d in skip))


class DecodeStep(nn.Module):
    """The model's decode forward as a function of tensors: what torch.export traces. Its attention backend and pool
    are copies whose K and V are the step's inputs: the pool's tensors, [slots, heads, dim] per layer (one tensor for
    all layers would be written through views, which inductor does on a copy of the whole pool)."""

    def __init__(self, model: nn.Module, attn: TorchBackend):
        super().__init__()
        self.model = model
        self.attn = copy.copy(attn)
        self.attn.pool = copy.copy(attn.pool)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor,
                slots: torch.Tensor, lens: torch.Tensor, k: list[torch.Tensor], v: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step: `slots` [B, L] and `lens` [B] as TorchBackend.prepare makes
        them (L a multiple of 16)."""
        pool = self.attn.pool
        pool.k, pool.v = k, v
        none = torch.empty(0, dtype=torch.int32)  # fields a decode forward never reads
        mask = None if self.attn.own_decode else decode_mask(lens, slots.shape[1], pool.shape.dtype)
        batch = ForwardBatch("decode", input_ids, positions, out_cache_loc, none, none, none, [], [], none, none,
                             TorchDecodeMeta(slots.reshape(-1), slots.shape[1], lens, mask))
        return self.model(batch, self.attn)


def _inputs(batch: ForwardBatch, attn: TorchBackend) -> list[torch.Tensor] | None:
    """DecodeStep's inputs for a prepared decode batch, or None where its keys are not padded to 16 (a page table
    narrower than the padding cut them)."""
    meta = batch.attn_meta
    if meta.max_len % 16:
        return None
    return [batch.input_ids, batch.positions, batch.out_cache_loc, meta.slots.view(batch.batch_size, -1), meta.lens,
            *attn.pool.k, *attn.pool.v]


BUILD_LIMIT_S = 3600  # a build still running after this gives up (its own watchdog): never an orphan for ever
_POLL_S = 0.5  # how often an engine waiting for a build looks at the store


@dataclass(frozen=True)
class BuildJob:
    """What the build process needs (pickled to its stdin)."""

    engine: EngineConfig
    key: StepKey
    path: Path
    lock_fd: int | None = None  # the build's lock, taken by the process that started it (_claim), inherited
    limit_s: float = BUILD_LIMIT_S


def _claim(path: Path) -> int | None:
    """A descriptor holding the build lock of the package at `path` (a builder inherits it), or None where a builder
    holds it. An flock: it goes with the last process that holds it, however that process ends (no stale lock)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _builder(path: Path) -> str:
    """Which process holds the build lock of `path`, as its starter wrote it in the lock file."""
    try:
        return path.with_suffix(".lock").read_text().strip() or "another process"
    except OSError:
        return "another process"


def spawn_build(job: BuildJob, lock_fd: int) -> subprocess.Popen:
    """Start the build process of `job`, handing it the lock `lock_fd` (from _claim: closed here). Its own session: it
    outlives this process (a chat that ends mid-build), and a Ctrl-C in the terminal does not reach it."""
    try:
        with open(job.path.with_suffix(".log"), "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "minisgl_cli.cpu_step.build"], stdin=subprocess.PIPE,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True, pass_fds=(lock_fd,))
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"pid {proc.pid}\n".encode(), 0)
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps(dataclasses.replace(job, lock_fd=lock_fd)))
        proc.stdin.close()
    finally:
        os.close(lock_fd)
    return proc


def _stored_key(path: Path) -> str | None:
    """The key a package was built for, read without loading its code; None where there is none (or no package)."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as z:
            name = next(n for n in z.namelist() if n.endswith(".wrapper_metadata.json"))
            return json.loads(z.read(name)).get(_KEY)
    except (OSError, zipfile.BadZipFile, StopIteration, ValueError):
        return None


def _load(path: Path, key: StepKey) -> Any | None:
    """The stored step at `path` when it was built for `key` (its runner), else None: a package of another key is
    removed (then rebuilt), never loaded."""
    if not path.exists():
        return None
    stored = _stored_key(path)
    if stored != key.to_json():
        log.warning("the stored CPU decode step %s was built for another engine; rebuilding it", path)
        path.unlink(missing_ok=True)
        return None
    # The loader unpacks the package (~130 MB: its library and weights) into a temp dir it removes only when it is
    # destroyed, which a process ended by a signal or os._exit never does: each start left its copy in /tmp. Unpacked
    # into our own dir instead, emptied once loaded; the library and weights stay mapped.
    unpack = _unpack_dir()
    with env.temp_dir(unpack):
        try:  # the package's runner alone: aoti_load_package first reads the whole archive in Python (~2.5 s here)
            return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        except (AttributeError, TypeError):  # another torch's binding: the public call
            return torch._inductor.aoti_load_package(str(path)).loader
        finally:  # still one load at a time (temp_dir's lock): no other load's copy is in it
            for entry in unpack.iterdir():
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


_UNPACK: Path | None = None  # this process's unpack dir, once made


def _unpack_dir() -> Path:
    """This process's dir for the loader's unpacked copies, <temp dir>/minisgl-unpack-<pid>: kept while the process
    lives, so a child started while a load had TMPDIR naming it (TMPDIR is the process's, every thread's) still has a
    temp dir that exists; removed at exit. Dirs of processes no longer alive (killed) are removed with the first
    call."""
    global _UNPACK
    if _UNPACK is None:
        root = Path(tempfile.gettempdir())
        for old in root.glob("minisgl-unpack-*"):
            pid = old.name.removeprefix("minisgl-unpack-")
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        _UNPACK = root / f"minisgl-unpack-{os.getpid()}"
        atexit.register(shutil.rmtree, _UNPACK, ignore_errors=True)
    # made again where gone: another process sweeping /tmp (one in another PID namespace sees this pid as dead)
    _UNPACK.mkdir(exist_ok=True)
    return _UNPACK


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class CompiledDecode:
    """One engine's compiled decode step: loaded from the store at once, or, where none is stored, built there by one
    build process per key on this machine (started with `start` by the first engine that finds none and no build
    under way) while the engines decode eagerly; each engine waiting for it loads it once it is stored. The build
    outlives the engine that started it; one that dies unlocks the key, and the next engine to look takes over."""

    def __init__(self, cfg: EngineConfig, attn: TorchBackend, key: StepKey, builds: bool):
        """`builds`: build the step when none is stored (else the engine decodes eagerly)."""
        self.cfg = cfg
        self.attn = attn
        self.key = key
        self.path = key.path
        self.builds = builds
        self.error: str | None = None  # why a build failed
        self.steps = self.declined = 0  # batches it ran / sent back to eager
        self._proc: subprocess.Popen | None = None  # the build this engine started, if it started one
        self._watch: threading.Thread | None = None
        self.serving = True  # the engine decodes while it builds (not a prebuild)
        t0 = time.perf_counter()
        self._runner = _load(self.path, key)
        if self._runner is not None:
            notice(f"CPU decode: the compiled step, loaded from {self.path.parent} in {time.perf_counter() - t0:.1f}s")

    @property
    def state(self) -> str:
        """compiled, building (decoding eagerly meanwhile) or eager."""
        return "compiled" if self._runner is not None else "building" if self.compiling else "eager"

    @property
    def compiling(self) -> bool:
        """A build is under way, or will start with serving."""
        return self._runner is None and self.builds and self.error is None and (
            self._watch is None or self._watch.is_alive())

    def start(self, serving: bool = True) -> None:
        """Serving starts (`serving`; else a prebuild waits for it): where no step is stored, start its build, or
        wait for the one under way (once)."""
        if not self.compiling or self._watch is not None:
            return
        self.serving = serving
        if not self._build():
            notice(f"the compiled CPU decode step is being built by {_builder(self.path)} (its lock: "
                   f"{self.path.with_suffix('.lock')}): " + ("decoding eagerly until it is stored" if serving else
                                                             "waiting for it"))
        if self.error is not None:
            return
        self._watch = threading.Thread(target=self._await_build, name="minisgl-compile", daemon=True)
        self._watch.start()

    def _build(self) -> bool:
        """Start the build where no build holds the key's lock (once per engine); False where one does."""
        try:
            fd = _claim(self.path)
            if fd is None:
                return False
            self._proc = spawn_build(BuildJob(self.cfg, self.key, self.path), fd)
        except OSError as exc:  # the store cannot be written (a full disk, a read-only dir): eager, said once
            self.error = f"it could not start: {exc}"
            log.warning("building the compiled CPU decode step failed (%s): decoding stays eager", self.error)
            return True
        cost = "~3 min on 2 cores, once for this model, torch and CPU; it goes on if this process ends"
        notice(f"starting the compiled CPU decode build (pid {self._proc.pid}) in the background: {cost} "
               "(`serve --prebuild` does it ahead); until then decoding runs eagerly, several times slower while the "
               "build shares the cores" if self.serving else
               f"starting the compiled CPU decode build (pid {self._proc.pid}): {cost}")
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Start the build if needed, then block until the step runs (True) or the build failed / timed out."""
        self.start(serving=False)
        if self._watch is not None:
            self._watch.join(timeout)
        return self._runner is not None

    def _await_build(self) -> None:
        """Until the step is stored: load it once it is; take the build over where its builder died (once)."""
        t0 = time.perf_counter()
        log_path = self.path.with_suffix(".log")
        while True:
            runner = None
            try:
                runner = _load(self.path, self.key)
            except Exception as exc:  # noqa: BLE001 - a broken package costs speed, never the server
                log.warning("loading the compiled CPU decode step failed: %s", exc)
                self.error = "its package does not load"
                return
            if runner is not None:
                break
            if self._proc is not None and self._proc.poll() is None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(_POLL_S)
                continue
            fd = _claim(self.path)
            if fd is None:  # another process builds
                time.sleep(_POLL_S)
                continue
            if self.path.exists():  # stored since it looked (no build runs now): load it
                os.close(fd)
                continue
            if self._proc is None:  # nothing stored, no build under way: its builder died; this engine takes over
                try:
                    self._proc = spawn_build(BuildJob(self.cfg, self.key, self.path), fd)
                except OSError as exc:
                    self.error = f"it could not start: {exc}"
                    log.warning("building the compiled CPU decode step failed (%s): decoding stays eager", self.error)
                    return
                notice(f"starting the compiled CPU decode build (pid {self._proc.pid}) again: the last one stopped")
                continue
            os.close(fd)
            code = self._proc.returncode
            self.error = f"the build exited with {code}" if code else "it stored no package"
            log.warning("building the compiled CPU decode step failed (%s; see %s): decoding stays eager",
                        self.error, log_path)
            return
        self._runner = runner
        notice(f"CPU decode: the compiled step is built ({time.perf_counter() - t0:.0f}s) and stored in "
               f"{self.path.parent}" + (": decoding at full speed now" if self.serving else ""))
        if self._proc is not None:  # its own build, past the rename (removing superseded packages): reaped, no zombie
            self._proc.wait()

    def can_run(self, batch: ForwardBatch) -> bool:
        return self._runner is not None and batch.is_decode and batch.batch_size <= MAX_ROWS

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode batch (as the model's forward), or None: run it eagerly."""
        self.attn.prepare(batch)
        inputs = _inputs(batch, self.attn)
        if inputs is None:
            self.declined += 1
            return None
        assert self._runner is not None  # can_run said so
        self.steps += 1
        return self._runner.run(inputs)[0]
