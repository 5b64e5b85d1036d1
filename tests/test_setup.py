"""`make setup` as a newcomer runs it: torch's CPU build where there is no GPU, and the make targets that run."""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TORCH = "torch==2.13.0"


def _make(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})


def test_make_serve_and_bench_run_the_commands():
    out = _make("-n", "serve", "bench", "ARGS=--port 9000").stdout
    assert "minisgl serve --port 9000" in out and "minisgl bench --port 9000" in out


def _index(root: Path, wheel: Path) -> Path:
    """A PEP 503 index of one project, torch, holding `wheel`."""
    page = root / "simple" / "torch"
    page.mkdir(parents=True)
    (page / wheel.name).symlink_to(wheel)
    (page / "index.html").write_text(f'<a href="{wheel.name}">{wheel.name}</a>\n')
    return root / "simple"


@pytest.fixture
def torch_wheel() -> Path:
    wheels = sorted(Path("/opt/wheels").glob("torch-2.13.0+cpu-*.whl")) if Path("/opt/wheels").is_dir() else []
    if not wheels:
        pytest.skip("no local torch CPU wheel to build the test indexes from")
    return wheels[0]


@pytest.mark.slow
@pytest.mark.parametrize("cpu_index", ["reachable", "unreachable"])
def test_make_torch_takes_the_cpu_index_or_falls_back_to_the_plain_name(tmp_path, torch_wheel, cpu_index):
    """The Makefile's torch step, as a pip dry run against two local indexes: PyTorch's CPU index (served over
    HTTP, or a closed port) and the configured one the fallback takes (no pip config of this machine)."""
    fallback = _index(tmp_path / "fallback", torch_wheel)
    server = None
    if cpu_index == "reachable":
        served = _index(tmp_path / "cpu", torch_wheel).parent
        server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(served)))
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}/simple"
    else:
        url = "http://127.0.0.1:9/simple"  # the discard port: nothing listens
    env = {"PIP_CONFIG_FILE": os.devnull, "PIP_FIND_LINKS": "", "PIP_INDEX_URL": fallback.as_uri(),
           "PIP_EXTRA_INDEX_URL": "", "PIP_DEFAULT_TIMEOUT": "5"}
    try:
        result = _make("torch", "GPU=", f"PIP={sys.executable} -m pip", f"TORCH_CPU_INDEX={url}",
                       "PIP_ARGS=-v --dry-run --no-deps --ignore-installed", env=env)
    finally:
        if server is not None:
            server.shutdown()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Would install torch-2.13.0+cpu" in result.stdout
    used = [line for line in result.stdout.splitlines() if line.startswith("Looking in indexes:")]
    assert used[-1] == f"Looking in indexes: {url if cpu_index == 'reachable' else fallback.as_uri()}", used


@pytest.mark.skipif(torch.version.cuda is not None, reason="a CUDA build of torch: its nvidia-* packages belong")
def test_a_cpu_torch_venv_holds_no_nvidia_packages():
    nvidia = sorted(d.metadata["Name"] for d in importlib.metadata.distributions()
                    if d.metadata["Name"].lower().startswith("nvidia"))
    assert nvidia == []
