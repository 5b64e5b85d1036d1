"""A real `minisgl serve` (or `minisgl router`) process for tests: its port, its children (from its start-up
lines), its stderr."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from minisgl_cli.api.http_server import free_port


class Serve:
    """One `minisgl serve --model MODEL ARGS...` process (MODEL: a path or a built-in alias; on a free port unless
    given, stderr to a file in `tmp`).

    With model None, `minisgl ARGS...` (e.g. `router --worker-url ...`) on the same terms; `kv_tokens` None: no
    --max-total-tokens (the hf and mlx engines have no pool)."""

    def __init__(self, model: Path | str | None, tmp: Path, *args: str, kv_tokens: int | None = 2048,
                 port: int | None = None, env: dict[str, str] | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.err_path = tmp / f"serve-{self.port}-{time.monotonic_ns()}.err"
        command = ["serve", "--model", str(model)] if model is not None else []
        kv = ["--max-total-tokens", str(kv_tokens)] if kv_tokens and model is not None else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minisgl_cli.app", *command, *kv, *args, "--port", str(self.port)],
            stdout=subprocess.DEVNULL, stderr=self.err_path.open("w"),
            env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        )

    def stderr(self) -> str:
        return self.err_path.read_text()

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", timeout=2).status_code
        except httpx.HTTPError:
            return None

    def wait_healthy(self, timeout: float = 240) -> list[int]:
        """Poll /health until 200; the statuses seen on the way."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"serve exited early (code {self.proc.returncode}):\n{self.stderr()}"
            status = self.health()
            if status is not None and (not seen or seen[-1] != status):
                seen.append(status)
            if status == 200:
                return seen
            time.sleep(0.1)
        raise AssertionError(f"not healthy after {timeout}s:\n{self.stderr()}")

    def children(self) -> dict[str, int]:
        """Child pids by name, from the 'starting NAME (pid N)' lines."""
        return {m["name"]: int(m["pid"]) for m in re.finditer(r"starting (?P<name>.+?) \(pid (?P<pid>\d+)\)",
                                                              self.stderr())}

    def answers(self) -> bool:
        r = httpx.post(f"{self.url}/v1/completions", json={"model": "default", "prompt": [1, 2, 3], "max_tokens": 4,
                                                          "temperature": 0}, timeout=60)
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def gone(procs: list[int] | list[psutil.Process], timeout: float = 10) -> list:
    """Those of `procs` (pids, or psutil's processes, which tell a reused pid apart) still running after `timeout`
    (zombies count as gone: their parent is dead or reaping)."""
    deadline = time.monotonic() + timeout
    alive: list = list(procs)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _running(p)]
        time.sleep(0.1)
    return alive


def _running(p: int | psutil.Process) -> bool:
    try:
        proc = psutil.Process(p) if isinstance(p, int) else p
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
