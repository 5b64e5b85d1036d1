"""The build of the compiled CPU decode step (cpu_step/compiled.py): the build process that exports and compiles it
into the store, and `prebuild` (`minisgl serve --prebuild`). Apart from compiled.py because it builds an Engine,
which imports compiled.py."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path

import torch

from minisgl_cli import env
from minisgl_cli.attention.torch_backend import TorchBackend
from minisgl_cli.cpu_step.compiled import _KEY, MAX_ROWS, BuildJob, DecodeStep, StepKey, _stored_key
from minisgl_cli.engine.config import EngineConfig
from minisgl_cli.engine.engine import Engine

log = logging.getLogger("minisgl.compile")


def partial_path(job: BuildJob) -> Path:
    """Where this process writes its package before renaming it into place."""
    return job.path.with_suffix(f".{os.getpid()}.partial.pt2")


def build(job: BuildJob) -> None:
    """Compile the decode step of the engine `job.engine` describes into `job.path` (in this process: minutes), unless
    it is stored. The caller holds the key's lock: no other build runs, so a partial package there is a dead one's."""
    if _stored_key(job.path) == job.key.to_json():
        return
    for stale in job.path.parent.glob(f"{job.path.stem}.*.partial.pt2"):  # a killed build's
        log.info("removing %s: a build that stopped before its end", stale)
        stale.unlink()
    torch.set_num_threads(1)
    cfg = dataclasses.replace(job.engine, torch_compile="off", max_total_tokens=256, max_running_requests=1,
                              num_threads=1)
    engine = Engine(cfg)
    if engine.spec.model_dir is not None and engine.loaded.source != "dummy":
        key = StepKey.of(cfg, engine.model_cfg, engine.spec.model_dir, engine.loaded.source, engine.dtype,
                         engine.kv_dtype, engine.quantization)
        assert key.to_json() == job.key.to_json(), "the model or minisgl changed since the engine started"
    assert isinstance(engine.attn, TorchBackend)
    delattr(engine.model, "lm_head")  # the head stays eager: its fbgemm weight cannot be exported
    step, pool = DecodeStep(engine.model, engine.attn), engine.pool
    b, n = 2, 32  # example sizes: dynamic below (export specializes on 1)
    args = (torch.full((b,), 5), torch.full((b,), n - 1), torch.zeros(b, dtype=torch.long),
            torch.zeros(b, n, dtype=torch.long), torch.full((b,), n), pool.k, pool.v)
    rows = torch.export.Dim("rows", min=1, max=MAX_ROWS)
    keys = 16 * torch.export.Dim("keys16", min=1, max=-(-engine.model_cfg.max_position_embeddings // 16))
    slots = torch.export.Dim("slots", min=2)
    kv = [{0: slots}] * len(pool.k)
    dims = ({0: rows}, {0: rows}, {0: rows}, {0: rows, 1: keys}, {0: rows}, kv, kv)
    t0 = time.perf_counter()
    with torch.no_grad():
        program = torch.export.export(step, args, dynamic_shapes=dims, strict=False)
    log.info("exported the decode step in %.0fs", time.perf_counter() - t0)
    partial = partial_path(job)
    _gather_in_aten()
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs={
            "compile_threads": 1,  # no worker pool: the serving engine decodes on the other cores
            "emulate_precision_casts": True,
            "aot_inductor.metadata": {_KEY: job.key.to_json()},
        })
        with open(partial, "rb") as f:  # on the disk before it has the name engines load
            os.fsync(f.fileno())
        os.replace(partial, job.path)
    finally:
        partial.unlink(missing_ok=True)
    _prune(job.key, job.path)


def _gather_in_aten() -> None:
    """Inductor keeps `index_select` (KVPool.read: the attention's gather of the KV pool) an ATen call, not a loop of
    its own. Its loops run on one thread (built with one), so the main thread would write all of a step's gathered
    keys and values, and SDPA's second thread read its half of them out of the first core's cache: where the two
    cores sit far apart (a VM whose host moves its vCPUs: cache-line round trips of ~650 ns, not ~160) that doubled
    the attention, and the 16-row SmolLM2 step went from ~41 to ~58 ms for dozens of steps at a time. ATen's
    index_select splits the rows over the threads as SDPA splits its batch (the first half on the first thread), so
    each thread attends over keys it gathered itself. A copy: no value changes. It is not in AOTInductor's C shim:
    the package calls it through its proxy executor (two calls a layer, cheaper than the pull they save)."""
    from torch._inductor import decomposition, lowering

    decomposition.decompositions.pop(torch.ops.aten.index_select.default, None)
    lowering.make_fallback(torch.ops.aten.index_select, warn=False)


def _prune(key: StepKey, keep: Path) -> None:
    """Remove the store's packages this build supersedes: the same model and mode on this CPU, built by another
    torch or another minisgl source (each is ~100 MB; nothing would load them again)."""
    same = ("weights", "config", "quantization", "kernels", "dtype", "kv_dtype", "cpu")
    for path in keep.parent.glob("decode-*.pt2"):
        stored = _stored_key(path)
        if path == keep or stored is None:
            continue
        other = json.loads(stored)
        if all(other.get(f, getattr(key, f)) == getattr(key, f) for f in same):  # a field it predates: alike
            log.info("removing %s: superseded by %s", path, keep)
            path.unlink(missing_ok=True)
            path.with_suffix(".lock").unlink(missing_ok=True)


def prebuild(cfg: EngineConfig) -> Path:
    """Build the compiled decode step of the engine `cfg` describes, in the foreground, unless it is stored already
    (`minisgl serve --prebuild`: a container image that starts at full speed). Its package's path; ValueError where
    that engine decodes eagerly, RuntimeError where the build fails."""
    on = "on" if cfg.torch_compile == "auto" else cfg.torch_compile
    engine = Engine(dataclasses.replace(cfg, torch_compile=on, max_total_tokens=256, max_running_requests=1))
    compiled = engine.compiled
    if compiled is None:
        raise ValueError("this engine decodes eagerly (--torch-compile off, or no int4 / int8 CPU mode at TP 1): "
                         "there is no compiled step to build")
    if not compiled.wait():
        raise RuntimeError(f"building the compiled CPU decode step failed ({compiled.error}; see "
                           f"{compiled.path.with_suffix('.log')})")
    return compiled.path


def _main() -> None:
    """The build process: build the BuildJob pickled on stdin, holding its lock; on its own, not its starter's child
    (it outlives it). A SIGTERM / SIGINT, or its time limit, ends it and the compiler it runs, its partial package
    removed; a SIGKILL leaves that package to the next build, which removes it."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(env.inductor_cache_dir()))  # outlives /tmp: reused
    job: BuildJob = pickle.load(sys.stdin.buffer)
    if job.lock_fd is None:  # started by hand: take the lock (waiting for a build under way)
        lock = open(job.path.with_suffix(".lock"), "w")  # noqa: SIM115 - held until this process ends
        fcntl.flock(lock, fcntl.LOCK_EX)

    def stop(why: str) -> None:  # the whole process group: this process and the compiler it runs
        log.error("stopping the build: %s", why)
        partial_path(job).unlink(missing_ok=True)
        logging.shutdown()
        os.killpg(0, signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: stop(signal.Signals(signum).name))
    limit = threading.Timer(job.limit_s, stop, (f"still running after {job.limit_s:.0f}s",))
    limit.daemon = True
    limit.start()
    log.info("building %s (pid %d; at most %.0fs)", job.path, os.getpid(), job.limit_s)
    os.nice(5)  # the engines that wait for it serve on the same cores: they come first
    code = 0
    try:
        build(job)
        job.path.with_suffix(".log").unlink(missing_ok=True)  # this process's own output: kept only on a failure
    except BaseException:  # noqa: BLE001 - told in the build's log, which the engine's warning names
        log.exception("the build failed")
        code = 1
    logging.shutdown()
    os._exit(code)  # not a normal exit: the timer thread may still wait


if __name__ == "__main__":
    from minisgl_cli.cpu_step import build as cpu_build  # the module's own functions, not __main__'s copies

    cpu_build._main()
