"""Shared fixtures for the media tests: tiny real pipelines and VLMs on disk, and a live uvicorn server."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _builder():
    # The one copy of the tiny-model code lives in examples/ (also used by docs/media.md).
    spec = importlib.util.spec_from_file_location("make_tiny_media_models", REPO / "examples/make_tiny_media_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    """{"z-image": dir, "wan": dir}: random-weight ZImagePipeline and WanPipeline saved with save_pretrained."""
    return _builder().build_all(tmp_path_factory.mktemp("tiny-media"))


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory) -> dict[str, Path]:
    """{"idefics3": dir, "qwen2-vl": dir, "qwen2.5-vl": dir}: random-weight VLMs with their tokenizer and
    processor, saved with save_pretrained (loaded back through from_pretrained by the runner)."""
    return _builder().build_vlms(tmp_path_factory.mktemp("tiny-vlm"))


@pytest.fixture(scope="session")
def live_server(tiny_models, tmp_path_factory) -> Iterator[str]:
    """A real uvicorn server on a loopback port. Routes at / serve the tiny models (their media worker starts on the
    first request); routes under /missing point at an empty dir, to exercise the missing-model error; routes under
    /dummy serve the built-in tiny Z-Image config (no dir)."""
    from fastapi import FastAPI

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.media.settings import MediaSettings
    from minisgl_cli.server.errors import install_error_handlers
    from minisgl_cli.server.media import build_media_router

    app = FastAPI()
    install_error_handlers(app)  # OpenAI error bodies, as `serve` answers
    app.include_router(
        build_media_router(MediaSettings(image_model_dir=tiny_models["z-image"], video_model_dir=tiny_models["wan"]))
    )
    empty = tmp_path_factory.mktemp("no-model")
    app.include_router(
        build_media_router(MediaSettings(image_model_dir=empty, video_model_dir=empty)), prefix="/missing"
    )
    # A built-in config with random weights, as GPU speed runs serve it (--media-load-format dummy): no dir at all.
    app.include_router(build_media_router(MediaSettings(image_model="tiny-z-image", load_format="dummy")),
                       prefix="/dummy")
    server = BackgroundServer(app)
    yield server.start(healthy=False)  # the media routes alone: no /health to wait for
    server.stop()
