"""CompiledDecode: the CPU's decode forward through torch.compile, compiled in the background.

A CPU decode step of a small model is mostly op overhead, not arithmetic: SmolLM2-135M's int4 step runs
~1,300 torch ops, and its int4 GEMVs are under a third of the step (docs/benchmarks.md). Inductor fuses
the norms, RoPE, residual adds and the rest into a few C++ loops around the GEMV calls, which takes ~30%
off the step. Compiling both shapes costs ~2.5 min of one core the first time and ~1 min once inductor's
cache (in the minisgl cache dir) holds the kernels, so it runs on a thread once the scheduler starts serving: steps run
eagerly until the compiled function has run once per shape on a dummy batch (row 0 of the page table, KV
written to the scratch slot 0), then decode batches of up to `max_bs` rows use it. Two shapes are compiled:
one row, and 2..max_bs rows (dynamic); the context length is dynamic in both. The LM head stays eager (one
int8 GEMM already).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from minisgl_cli import env
from minisgl_cli.attention.base import AttentionBackend
from minisgl_cli.core.batch import ForwardBatch
from minisgl_cli.core.host import HostBuffers
from minisgl_cli.notice import notice

log = logging.getLogger("minisgl.compile")

_COMPILE_SWITCH_S = 1e-4  # the GIL's switch interval while compiling (see _warm)
_WARM_LEN = 16  # the dummy batches' context: past 1, which torch.compile would specialize on


def _step_guards_only(entries: list[Any]) -> list[bool]:
    """Drop the guards on the model and the attention backend (~900 tensors and their attributes per shape: 1.5 ms
    of a 10 ms step to check), keep the rest (the step's batch, the shapes, globals). Neither changes after the
    engine is built: the weights and the KV pool are fixed, only their contents move."""
    return [e.name.split(".")[0].split("[")[0] not in ("self", "attn") for e in entries]


class CompiledDecode:
    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, max_bs: int, device: torch.device):
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(env.inductor_cache_dir()))  # read when it compiles
        self.attn = attn
        self.max_bs = max_bs
        self.device = device
        self.fn: Callable[[ForwardBatch, AttentionBackend], torch.Tensor] = torch.compile(
            model.forward, dynamic=True, options={"guard_filter_fn": _step_guards_only})
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self.steps = self.declined = 0  # batches it ran / sent back to eager
        self._thread = threading.Thread(target=self._warm, name="minisgl-compile", daemon=True)

    def start(self) -> None:
        """Start compiling (once): when serving starts, not beside the start-up, which it slowed 3x on two cores."""
        if self._thread.ident is not None:
            return
        notice("compiling the CPU decode in the background (torch.compile, ~1-3 min); until it is done, decoding "
               "runs eagerly, several times slower")
        self._thread.start()
        # A daemon thread inside torch's C++ when the interpreter finalizes aborts the process ("terminate
        # called without an active exception"): an exit waits for the compile instead.
        atexit.register(self._thread.join)

    def wait(self, timeout: float | None = None) -> bool:
        """Start if not started, then block until compiled (True) or failed / timed out (False)."""
        self.start()
        self._thread.join(timeout)
        return self.ready.is_set()

    @property
    def compiling(self) -> bool:
        """Not compiled yet: not started, or compiling."""
        return self._thread.ident is None or self._thread.is_alive()

    def can_run(self, batch: ForwardBatch) -> bool:
        return self.ready.is_set() and batch.is_decode and batch.batch_size <= self.max_bs

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode batch (as the model's forward), or None where the compiled
        function would have to compile again (a shape it has not seen): the caller runs it eagerly."""
        self.attn.prepare(batch)
        try:
            # Never compile on the caller's thread: a compile there would stall every request for ~30 s.
            with torch.compiler.set_stance("fail_on_recompile"):
                hidden = self.fn(batch, self.attn)
        except RuntimeError as exc:
            if "recompil" not in str(exc).lower():
                raise
            self.declined += 1
            (log.warning if self.declined == 1 else log.debug)(
                "compiled CPU decode declined a batch of %d rows; decoding it eagerly: %s", batch.batch_size, exc)
            return None
        self.steps += 1
        return hidden

    def _dummy(self, bs: int, host: HostBuffers) -> ForwardBatch:
        # Row 0's first _WARM_LEN page-table entries are valid slots whatever they hold (only read);
        # the new K/V go to the scratch slot 0.
        return ForwardBatch.build("decode", [0] * bs, [0] * bs, [_WARM_LEN - 1] * bs, [1] * bs, [0] * bs,
                                  self.device, host)

    def _warm(self) -> None:
        import torch._inductor.config as inductor
        import torch.fx.experimental._config as fx_config

        # (torch's compile settings are per thread: set on the thread that compiles.)
        inductor.compile_threads = 1  # no worker pool: it would take the cores the engine decodes on
        # Equal sizes are not the same size: the batch size happening to equal a weight's dimension (or a
        # slice's offset) must not become a guard that the next batch size fails.
        fx_config.use_duck_shape = False
        t0 = time.perf_counter()
        host = HostBuffers()  # not the engine's: its step may be building a batch right now
        # The compile is Python holding the GIL for seconds; each of the eager step's GIL hand-offs (an op that
        # releases it) then waits out a whole switch interval: 5 ms by default, which made requests 50x slower.
        switch_s = sys.getswitchinterval()
        sys.setswitchinterval(_COMPILE_SWITCH_S)
        try:
            for bs in sorted({1, min(2, self.max_bs)}):
                batch = self._dummy(bs, host)  # built as the scheduler builds its batches: not inference tensors
                with torch.inference_mode():  # run as Engine.forward runs
                    self.attn.prepare(batch)
                    self.fn(batch, self.attn)
        except Exception as exc:  # a compile failure costs speed, never the server
            self.error = exc
            log.warning("torch.compile of the CPU decode failed; decoding eagerly (%s)", exc)
            return
        finally:
            sys.setswitchinterval(switch_s)
        self.ready.set()
        notice(f"CPU decode compiled in {time.perf_counter() - t0:.0f}s: decoding at full speed now")
        log.info("torch.compile's cache: %s", env.inductor_cache_dir())
