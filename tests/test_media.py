"""`minisgl image` / `minisgl video` and the media HTTP routes, end to end on tiny real pipelines."""

from __future__ import annotations

import base64
import io
import os
import subprocess
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"  # model hubs are unreachable: fail fast instead of timing out

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))
from media_fixtures import REPO  # noqa: E402

pytest.importorskip("diffusers")
imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")

from minisgl_cli.app import app  # noqa: E402

runner = CliRunner()


def run_cli(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, (result.output, result.stderr, result.exception)
    return result


def image_cli(model_dir: Path, out: Path, *extra: str) -> list[Path]:
    result = run_cli("image", "--model-dir", str(model_dir), "--output-dir", str(out), "--steps", "2", *extra)
    return [Path(line) for line in result.stdout.split()]


def pixels(path: Path) -> np.ndarray:
    return np.asarray(Image.open(path).convert("RGB"))


def mp4_frames(data: bytes, tmp_path: Path) -> list[np.ndarray]:
    path = tmp_path / "check.mp4"
    path.write_bytes(data)
    reader = imageio_ffmpeg.read_frames(str(path))
    meta = next(reader)
    w, h = meta["size"]
    return [np.frombuffer(f, np.uint8).reshape(h, w, 3) for f in reader]


# --- CLI ---------------------------------------------------------------------------------------


def test_image_cli_size_and_count(tiny_models, tmp_path):
    paths = image_cli(
        tiny_models["z-image"], tmp_path, "--height", "64", "--width", "32", "--num-images", "2", "--seed", "7"
    )
    assert len(paths) == 2 and all(p.suffix == ".png" and p.is_file() for p in paths)
    for p in paths:
        im = Image.open(p)
        assert im.size == (32, 64) and im.mode == "RGB"
    assert np.isfinite(pixels(paths[0]).astype(float)).all() and pixels(paths[0]).std() > 0
    assert not np.array_equal(pixels(paths[0]), pixels(paths[1]))  # one generator, two different draws


def test_image_cli_seed_determinism(tiny_models, tmp_path):
    size = ("--height", "32", "--width", "32")
    a = image_cli(tiny_models["z-image"], tmp_path, *size, "--seed", "11")[0]
    b = image_cli(tiny_models["z-image"], tmp_path, *size, "--seed", "11")[0]
    c = image_cli(tiny_models["z-image"], tmp_path, *size, "--seed", "12")[0]
    assert a != b  # a second run never overwrites the first
    assert np.array_equal(pixels(a), pixels(b))
    assert not np.array_equal(pixels(a), pixels(c))


def test_image_cli_aspect_sets_size(tiny_models, tmp_path):
    (path,) = image_cli(tiny_models["z-image"], tmp_path, "--aspect", "16:9", "--width", "64", "--seed", "1")
    assert Image.open(path).size == (64, 32)  # 64 * 9/16 = 36, rounded to a multiple of 16


def test_video_cli_mp4(tiny_models, tmp_path):
    result = run_cli(
        "video", "-p", "a paper boat on a river", "--model-dir", str(tiny_models["wan"]), "--output-dir", str(tmp_path),
        "--num-frames", "9", "--height", "32", "--width", "48", "--steps", "2", "--fps", "8", "--seed", "3",
    )
    mp4 = Path(result.stdout.strip())
    assert mp4.suffix == ".mp4" and mp4.is_file()
    frames = mp4_frames(mp4.read_bytes(), tmp_path)
    assert len(frames) == 9 and frames[0].shape == (32, 48, 3)
    fps = next(imageio_ffmpeg.read_frames(str(mp4)))["fps"]
    assert fps == pytest.approx(8, rel=0.01)


def test_video_cli_frames(tiny_models, tmp_path):
    result = run_cli(
        "video", "-p", "a paper boat", "--model-dir", str(tiny_models["wan"]), "--output-dir", str(tmp_path),
        "--num-frames", "5", "--height", "32", "--width", "32", "--steps", "1", "--format", "frames", "--seed", "3",
    )
    frames = sorted(Path(result.stdout.strip()).glob("*.png"))
    assert len(frames) == 5 and Image.open(frames[0]).size == (32, 32)


def test_image_cli_missing_model_is_one_line(tmp_path):
    # The real entry point in a fresh process: no traceback, one line naming the fix.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("Z_IMAGE_MODEL_DIR", None)
    proc = subprocess.run(
        [sys.executable, "-m", "minisgl_cli.app", "image", "--model-dir", str(tmp_path / "absent"), "--steps", "1"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert "--model-dir" in lines[0] and str(tmp_path / "absent") in lines[0] and "Traceback" not in proc.stderr


def test_image_cli_bad_size_is_clear(tiny_models, tmp_path):
    result = runner.invoke(app, ["image", "--model-dir", str(tiny_models["z-image"]), "--height", "50"])
    assert result.exit_code == 1 and "multiple of 16" in result.stderr


def test_commands_import_without_diffusers():
    code = "import sys, commands.image, commands.video; print('diffusers' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    assert out.split() == ["False", "False"]


# --- HTTP (official openai client against a live uvicorn server) -------------------------------


def openai_client(base_url: str):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def decode(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


def test_http_images_generate(live_server):
    client = openai_client(f"{live_server}/v1")
    gen = lambda seed: client.images.generate(  # noqa: E731
        model="z-image-turbo", prompt="a red lantern", n=2, size="48x32", response_format="b64_json",
        extra_body={"seed": seed, "steps": 2},
    )
    first = gen(5)
    images = [decode(d.b64_json) for d in first.data]
    assert len(images) == 2 and all(im.size == (48, 32) for im in images)
    again, other = gen(5), gen(6)
    assert np.array_equal(np.asarray(images[0]), np.asarray(decode(again.data[0].b64_json)))
    assert not np.array_equal(np.asarray(images[0]), np.asarray(decode(other.data[0].b64_json)))
    # Where the server's time went (ms): the pipeline call and the PNGs inside the whole of it.
    raw = client.images.with_raw_response.generate(model="z-image-turbo", prompt="a red lantern", size="48x32",
                                                   extra_body={"seed": 5, "steps": 2})
    timing = dict(part.split(";dur=") for part in raw.headers["server-timing"].split(", "))
    generate, encode, total = (float(timing[k]) for k in ("generate", "encode", "total"))
    assert 0 < generate and 0 < encode and generate + encode <= total


def test_http_image_url_format_is_400(live_server):
    import openai

    client = openai_client(f"{live_server}/v1")
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model="z-image-turbo", prompt="x", size="32x32", response_format="url")
    body = err.value.response.json()["error"]
    assert body["param"] == "response_format" and "b64_json" in body["message"] and body["type"]


def test_http_missing_model_error_body(live_server):
    import httpx

    r = httpx.post(f"{live_server}/missing/v1/images/generations", json={"prompt": "x", "size": "32x32"}, timeout=30)
    assert r.status_code == 404
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "model_not_found" and "Z_IMAGE_MODEL_DIR" in err["message"]
    assert "--image-model-dir" in err["message"] and "--model-dir" in err["message"]
    r = httpx.post(f"{live_server}/missing/v1/videos/generations", json={"prompt": "x", "size": "32x32"}, timeout=30)
    assert r.status_code == 404 and "--video-model-dir" in r.json()["error"]["message"]


def test_http_video_mp4_and_frames(live_server, tmp_path):
    import httpx

    req = {"prompt": "waves", "size": "32x32", "num_frames": 9, "steps": 1, "fps": 8, "seed": 2}
    r = httpx.post(f"{live_server}/v1/videos/generations", json=req, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["num_frames"] == 9 and body["data"][0]["mime_type"] == "video/mp4"
    assert len(mp4_frames(base64.b64decode(body["data"][0]["b64_json"]), tmp_path)) == 9
    r = httpx.post(f"{live_server}/v1/videos/generations", json={**req, "response_format": "frames"}, timeout=120)
    frames = r.json()["data"][0]["frames"]
    assert len(frames) == 9 and decode(frames[0]).size == (32, 32)


def test_image_cli_cuda_only_options_fail_clearly_on_cpu(tiny_models, tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only error path")
    for flag in (["--cpu-offload"], ["--attention-backend", "flash2"]):
        result = runner.invoke(
            app,
            [
                "image",
                "--model-dir",
                str(tiny_models["z-image"]),
                "--device",
                "cpu",
                "--height",
                "32",
                "--width",
                "32",
                *flag,
            ],
        )
        assert result.exit_code == 1 and "needs" in result.stderr and "CUDA" in result.stderr, result.stderr


def test_image_cli_wrong_pipeline_kind(tiny_models):
    result = runner.invoke(app, ["image", "--model-dir", str(tiny_models["wan"]), "--height", "32", "--width", "32"])
    assert result.exit_code == 1 and "minisgl video" in result.stderr


def test_a_job_out_of_device_memory_is_a_503_that_says_what_to_change():
    import torch

    from minisgl_cli.media.worker import failure

    status, _, code, message = failure(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert (status, code) == (503, "out_of_memory")
    assert "Tried to allocate 2.00 GiB" in message and "--mem-fraction" in message
    assert failure(RuntimeError("boom"))[::2] == (500, "generation_failed")


def test_png_bytes_round_trips_every_layout_through_its_threaded_deflate():
    """media/encode.py's own PNG writer: PIL reads back the very pixels for RGB, RGBA, grey, odd sizes, a 1x1 and an
    image large enough to deflate in several pieces on several threads."""
    import io

    import numpy as np
    from PIL import Image

    from minisgl_cli.media import encode

    rng = np.random.default_rng(0)
    big = rng.integers(0, 256, (1024, 700, 3), dtype=np.uint8)
    big[:, :350] //= 16  # a half that deflates well, so pieces differ in size
    assert len(big.tobytes()) > 2 * encode.PNG_PIECE
    for arr in (big, big[:37, :53], big[:, :, 0], np.dstack([big, big[:, :, :1]]), big[:1, :1]):
        back = np.asarray(Image.open(io.BytesIO(encode.png_bytes(Image.fromarray(arr)))))
        assert back.shape == arr.shape and (back == arr).all(), arr.shape


def test_images_made_8_bit_on_their_device_equal_diffusers_pil_output():
    """batch.rgb_images from a pipeline's "pt" output: the same bytes as diffusers' own "pil" postprocess."""
    import numpy as np
    import torch
    from diffusers.image_processor import VaeImageProcessor

    from minisgl_cli.media.batch import rgb_images

    decoded = torch.randn(2, 3, 33, 17, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 1.2
    proc = VaeImageProcessor()
    want = [np.asarray(im.convert("RGB")) for im in proc.postprocess(decoded, output_type="pil")]
    got = [np.asarray(im) for im in rgb_images(proc.postprocess(decoded, output_type="pt"))]
    assert all(g.dtype == np.uint8 and (g == w).all() for g, w in zip(got, want, strict=True))


def test_video_frames_made_8_bit_on_their_device_equal_the_numpy_path():
    """batch.uint8_frames from a video pipeline's "pt" output: the same bytes as from its "np" output (what it took
    before), frame for frame."""
    import numpy as np
    import torch
    from diffusers.video_processor import VideoProcessor

    from minisgl_cli.media.batch import uint8_frames

    decoded = torch.randn(1, 3, 5, 33, 17, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 1.2
    proc = VideoProcessor()
    want = uint8_frames(proc.postprocess_video(decoded, output_type="np")[0])
    got = uint8_frames(proc.postprocess_video(decoded, output_type="pt")[0])
    assert len(got) == len(want) == 5
    assert all(g.dtype == np.uint8 and g.shape == (33, 17, 3) and (g == w).all() for g, w in zip(got, want))
