"""Shared fixtures for the server tests: ONE engine on the default model, real uvicorn servers on it.

The engine runs as `minisgl serve` runs it: the multi-process runtime (a detokenizer and a scheduler
process behind a RemoteClient). The client is a process-wide singleton (not just a session fixture) so
every test module that uses these fixtures shares the same loaded model.
"""

from __future__ import annotations

import atexit
import functools
import time
from collections.abc import Iterator

import pytest

from minisgl_cli.api.http_server import BackgroundServer
from minisgl_cli.server.app import ServerSettings, create_app

API_KEY = "test-key-123"


@functools.cache
def shared_client():
    from commands.common import EngineOptions

    # 16k KV tokens: room for 100+ short requests at once; the context limit stays the model's 8192. The exact
    # mode (fp32, dense): logprobs are compared with HF fp32 and across prefix-cache hits to 1e-3.
    client = EngineOptions.from_params(dict(max_running_requests=64, max_total_tokens=16384, dtype="float32",
                                            quantization="none"), processes=True).client()
    atexit.register(client.close)
    return client


def wait_idle(client, timeout: float = 60.0) -> None:
    """Until no request is waiting or running (aborts are processed asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = client.stats()
        if s.running == 0 and s.waiting == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"engine not idle after {timeout}s: {client.stats().to_dict()}")


def _serve(settings: ServerSettings) -> Iterator[str]:
    app = create_app(shared_client(), settings)
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="session")
def engine_client():
    return shared_client()


@pytest.fixture(scope="session")
def server_url() -> Iterator[str]:
    """The default server: no key, the default caps."""
    yield from _serve(ServerSettings())


@pytest.fixture(scope="session")
def auth_url() -> Iterator[str]:
    """Same engine behind an API key and a 64 KiB body cap."""
    yield from _serve(ServerSettings(api_key=API_KEY, max_body_bytes=64 * 1024))


@pytest.fixture(scope="session")
def capped_url() -> Iterator[str]:
    """Same engine with an inflight cap of 2 and adaptive max_new_tokens on."""
    yield from _serve(ServerSettings(max_inflight_total=2, adaptive_max_new_tokens=True, adaptive_min_tokens=4))
