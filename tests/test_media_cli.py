"""`minisgl image` / `minisgl video` as a user meets them: the progress summary, and every bad input (or a size past
what the pipeline can make) one line and exit 1, never a traceback. Tiny real pipelines (tests/media_fixtures.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
from PIL import Image
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("diffusers")

from minisgl_cli.app import app  # noqa: E402

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args))


def stderr_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def test_image_summary_line_off_a_terminal(tiny_models, tmp_path):
    """Off a TTY no bar is drawn: stderr is the one summary line with seconds, s/step, it/s, per-image s and seed."""
    result = invoke("image", "--model-dir", str(tiny_models["z-image"]), "--output-dir", str(tmp_path),
                    "--height", "32", "--width", "32", "--steps", "3", "-n", "2", "--seed", "5")
    assert result.exit_code == 0, (result.stderr, result.exception)
    (line,) = stderr_lines(result)
    assert line.startswith("32x32 x2 on cpu: 3 steps in ") and line.endswith(", seed 5"), line
    assert "s/step" in line and "it/s" in line and "s an image" in line
    assert "━" not in result.stderr and "\r" not in result.stderr
    assert len(result.stdout.split()) == 2  # both images of the one batched call


def test_video_default_size_adapts_to_a_small_pipeline(tiny_models, tmp_path):
    """Issue 46: the default 832x480 overflowed the tiny Wan's rotary table (a traceback); now it shrinks to fit."""
    result = invoke("video", "-p", "a boat", "--model-dir", str(tiny_models["wan"]), "--output-dir", str(tmp_path),
                    "--num-frames", "1", "--steps", "1", "--format", "frames", "--seed", "1")
    assert result.exit_code == 0, (result.stderr, result.exception)
    note, summary = stderr_lines(result)
    assert note.startswith("note: the default 832x480x1 is more than this WanPipeline can make") and "512x288" in note
    (frame,) = sorted(Path(result.stdout.strip()).glob("*.png"))
    assert Image.open(frame).size == (512, 288) and summary.startswith("512x288x1 on cpu: 1 step in ")


def test_image_default_size_adapts_to_a_small_pipeline(tiny_models, tmp_path):
    result = invoke("image", "--model-dir", str(tiny_models["z-image"]), "--output-dir", str(tmp_path),
                    "--steps", "1", "--aspect", "16:9", "--seed", "1")
    assert result.exit_code == 0, (result.stderr, result.exception)
    assert "using 256x144" in stderr_lines(result)[0]
    assert Image.open(result.stdout.strip()).size == (256, 144)


def test_image_long_prompt_fits_a_small_rotary_table(tiny_models, tmp_path):
    """The tiny Z-Image's caption axis holds 256 positions; a 2800-token prompt is truncated as the pipeline does."""
    result = invoke("image", "--model-dir", str(tiny_models["z-image"]), "--output-dir", str(tmp_path),
                    "--steps", "1", "--height", "32", "--width", "32", "-p", "a red lantern " * 200)
    assert result.exit_code == 0, (result.stderr, result.exception)


BAD = {
    "image too large": (["image", "--height", "512", "--width", "256"],
                        "256x512 is too large for this ZImagePipeline: at most 256x256"),
    "image side not 16k": (["image", "--height", "50", "--width", "32"], "multiple of 16"),
    "image steps 0": (["image", "--steps", "0", "--height", "32", "--width", "32"], "steps must be in [1, 1000]"),
    "image n 0": (["image", "-n", "0", "--height", "32", "--width", "32"], "number of images must be in [1, 16]"),
    "image n 17": (["image", "-n", "17", "--height", "32", "--width", "32"], "number of images must be in [1, 16]"),
    "image seed -1": (["image", "--seed", "-1", "--height", "32", "--width", "32"], "seed must be in"),
    "image empty prompt": (["image", "-p", " ", "--height", "32", "--width", "32"], "prompt must not be empty"),
    "image negative cfg": (["image", "--guidance-scale", "-1", "--height", "32", "--width", "32"],
                           "guidance_scale must be >= 0"),
    "image bad device": (["image", "--device", "tpu", "--height", "32", "--width", "32"], "unknown device 'tpu'"),
    "image on a video pipeline": (["image", "--height", "32", "--width", "32", "@wan"], "use `minisgl video`"),
    "video frames not 4k+1": (["video", "-p", "x", "--num-frames", "6", "--height", "32", "--width", "32"],
                              "num_frames must be 4k+1 for WanPipeline (e.g. 5 or 9), got 6"),
    "video too many frames": (["video", "-p", "x", "--num-frames", "129", "--height", "32", "--width", "32"],
                              "num_frames 129 is too many for this WanPipeline: at most 125"),
    "video too wide": (["video", "-p", "x", "--num-frames", "1", "--height", "32", "--width", "832"],
                       "832x32 is too large for this WanPipeline: at most 512x512"),
    "video frames 0": (["video", "-p", "x", "--num-frames", "0", "--height", "32", "--width", "32"],
                       "num_frames must be in [1, 1024]"),
    "video fps 0": (["video", "-p", "x", "--fps", "0", "--height", "32", "--width", "32"], "fps must be in"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_one_line_and_exit_1(case, tiny_models, tmp_path):
    args, expected = BAD[case]
    kind = args[0]
    model = tiny_models["wan"] if "@wan" in args or kind == "video" else tiny_models["z-image"]
    args = [a for a in args if a != "@wan"]
    result = invoke(*args, "--model-dir", str(model), "--output-dir", str(tmp_path / "out"),
                    *(["--steps", "1"] if "--steps" not in args else []))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.stderr, result.exception)
    (line,) = stderr_lines(result)
    assert line.startswith("error: ") and expected in line, line
    assert not list(tmp_path.glob("out/*"))  # refused before anything was written


def test_unwritable_output_dir_is_refused_before_generating(tiny_models, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a dir")
    result = invoke("image", "--model-dir", str(tiny_models["z-image"]), "--output-dir", str(blocker / "out"),
                    "--height", "32", "--width", "32", "--steps", "1")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.exception
    (line,) = stderr_lines(result)
    assert line.startswith(f"error: cannot write {blocker / 'out'}"), line


def test_http_size_past_the_pipeline_is_a_400(live_server):
    """The same limits through the routes: a 400 naming the field, not a 500 from inside the model."""
    import httpx

    r = httpx.post(f"{live_server}/v1/images/generations", json={"prompt": "x", "size": "512x512", "steps": 1},
                   timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "size", r.text
    r = httpx.post(f"{live_server}/v1/videos/generations",
                   json={"prompt": "x", "size": "32x32", "num_frames": 6, "steps": 1}, timeout=60)
    assert r.status_code == 400 and "4k+1" in r.json()["error"]["message"], r.text
