"""`minisgl bench --media` end to end: the bench starts a real `minisgl serve` on a tiny Z-Image pipeline (and a tiny
LLM), times image requests one at a time and concurrently, then plain diffusers in-process; JSON and PNG out."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import REPO  # noqa: E402

pytest.importorskip("diffusers")


def test_bench_media_json_has_every_figure(tiny_models, tiny_model_dirs, tmp_path):
    out, png = tmp_path / "media.json", tmp_path / "media.png"
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl_cli.app", "bench", "--media", "--model", str(tiny_model_dirs["llama"]),
         "--media-model-dir", str(tiny_models["z-image"]), "--size", "32x32", "--steps", "2", "--num-prompts", "3",
         "--concurrency", "2", "--output-json", str(out), "--plot", str(png)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["mode"] == "media" and data["kind"] == "image" and data["size"] == "32x32" and data["steps"] == 2
    assert data["url"].startswith("http://127.0.0.1:")  # the server it started (and stopped)
    runs = {(r["stack"], r["concurrency"]): r for r in data["runs"]}
    assert set(runs) == {("minisgl serve", 1), ("minisgl serve", 2), ("diffusers", 1)}
    for r in runs.values():
        assert r["requests"] == 3 and r["failed"] == 0 and len(r["latencies_s"]) == 3, r
        assert 0 < r["p50_s"] <= r["p99_s"] <= max(r["latencies_s"]) and r["s_per_item"] > 0
        assert r["items_per_min"] > 0 and r["duration_s"] > 0
    assert data["speedup_vs_diffusers"] > 0
    # the warm-up is untimed at each level (a compiled DiT compiles again for a new batch size); the cold start apart
    assert [len(runs[("minisgl serve", c)]["warmup_s"]) for c in (1, 2)] == [1, 2]
    for stack in ("minisgl serve", "diffusers"):
        assert data["cold"][stack]["start_s"] > 0 and data["cold"][stack]["first_request_s"] > 0, data["cold"]
    assert "cold, minisgl serve: start to /health" in proc.stdout and "cold, diffusers: start" in proc.stdout
    assert "s/image" in proc.stdout and "images/min" in proc.stdout and "plain diffusers" in proc.stdout
    if importlib.util.find_spec("matplotlib"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_media_refuses_chat_options(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl_cli.app", "bench", "--media", "--url", "http://127.0.0.1:9",
         "--dataset", "random"], capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --media benchmarks image / video generation: drop --dataset (chat bench options)"]
    proc = subprocess.run([sys.executable, "-m", "minisgl_cli.app", "bench", "--size", "32x32"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "add --media" in proc.stderr
