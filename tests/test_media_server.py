"""The media worker behind the server: batching, FIFO order, admission caps, cancellation between denoise steps,
streaming, the Videos API and a clean SIGTERM; on tiny real pipelines, through real servers and the `openai` SDK.

The first tests run on `live_server` (the media routes alone on a real uvicorn); those marked slow on a real
`minisgl serve` process with the default chat model beside the media worker (its /metrics counts every job).
"""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import httpx
import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).parent))
from serve_process import Serve, gone  # noqa: E402

from minisgl_cli.media.jobs import MediaError  # noqa: E402
from minisgl_cli.media.prompts import PromptLimit  # noqa: E402

pytest.importorskip("diffusers")
openai = pytest.importorskip("openai")
imageio_ffmpeg = pytest.importorskip("imageio_ffmpeg")

pytestmark = pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")  # the SDK's videos.* say so

# One long job's work (128x128 x 1000 steps = 16.4 megapixel-steps) fits the slow server's cap of 20; a second
# beside it does not. A long image runs ~14 s here (a 32x32 one ran 3 s: a race with the tests' waits).
MAX_WORK = "20"
LONG = {"prompt": "a long job", "size": "128x128", "steps": 1000, "seed": 1}


def client(url: str):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).astype(int)


def image(url: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/images/generations", json={"size": "32x32", "steps": 2, **body}, timeout=300)


def wait_for(what: Callable[[], bool], timeout: float = 120, message: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, message or "timed out"
        time.sleep(0.05)


# --- the media routes alone ------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x" * (1 << 20)}, "prompt"),  # 1 MB: refused before tokenizing
    ({"prompt": "x" * 600}, "prompt"),  # 600 tokens of the tiny byte-level tokenizer; the pipeline reads 512
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "steps": 1001}, "steps"),
    ({"prompt": "x", "output_format": "gif"}, "output_format"),
    ({"prompt": "x", "output_format": "png", "output_compression": 50}, "output_compression"),
    ({"prompt": "x", "output_format": "jpeg", "output_compression": 101}, "output_compression"),
    ({"prompt": "x", "background": "transparent"}, "background"),
    ({"prompt": "x", "style": "vivid"}, "style"),
    ({"prompt": "x", "response_format": "url"}, "response_format"),
    ({"prompt": "x", "quality": "ultra"}, "quality"),
    ({"prompt": "x", "quality": "high", "steps": 3}, "quality"),
    ({"prompt": "x", "partial_images": 4, "stream": True}, "partial_images"),
    ({"prompt": "x", "partial_images": 2}, "partial_images"),  # previews only come in a stream
    ({"prompt": "x", "svg": True}, "svg"),  # a field this server does not know: refused, not ignored
    ({"prompt": "x", "size": "33x33"}, "size"),
    ({"prompt": "", "n": 1}, "prompt"),
])
def test_bad_image_requests_are_400_naming_the_field(live_server, body, param):
    r = image(live_server, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"] == "invalid_request_error", err


def test_streamed_partial_images_as_the_sdk_parses_them(live_server):
    c = client(live_server)
    events = list(c.images.generate(prompt="a red lantern", size="32x32", stream=True, partial_images=2,
                                    extra_body={"steps": 4, "seed": 3}))
    assert [e.type for e in events] == ["image_generation.partial_image"] * 2 + ["image_generation.completed"]
    assert [e.partial_image_index for e in events[:2]] == [0, 1]
    done = events[-1]
    assert done.usage.input_tokens > 0 and done.output_format == "png" and done.size == "32x32"
    previews = [pixels(e.b64_json) for e in events[:2]]
    assert all(p.shape == (32, 32, 3) for p in previews)
    plain = c.images.generate(prompt="a red lantern", size="32x32", extra_body={"steps": 4, "seed": 3})
    assert np.array_equal(pixels(done.b64_json), pixels(plain.data[0].b64_json))


def test_a_built_in_dummy_pipeline_is_served_and_its_prompt_limit_read(live_server):
    """--media-load-format dummy has no pipeline dir: the worker reads the prompt limit from its built-in config
    (it looked for a dir and answered 404 before)."""
    ok = httpx.post(f"{live_server}/dummy/v1/images/generations", json={"prompt": "a cat", "size": "64x64", "seed": 3},
                    timeout=300)
    assert ok.status_code == 200, ok.text
    assert base64.b64decode(ok.json()["data"][0]["b64_json"])[:8] == b"\x89PNG\r\n\x1a\n"
    long = httpx.post(f"{live_server}/dummy/v1/images/generations", json={"prompt": "word " * 700, "size": "64x64"},
                      timeout=300)
    assert long.status_code == 400 and long.json()["error"]["param"] == "prompt", long.text


def test_a_prompt_past_the_rotary_table_is_400_not_cut():
    """The tiny built-in Z-Image's rotary table holds 224 caption tokens (axes_lens 256), fewer than the 512 its
    pipeline reads: a 300-token prompt was cut there silently; it is refused naming the table's limit."""
    limit = PromptLimit.builtin("tiny-z-image")
    assert limit.max_tokens == 224
    with pytest.raises(MediaError, match="at most 224"):
        limit.check("word " * 60)


@pytest.mark.parametrize("fmt, pil", [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")])
def test_output_formats(live_server, fmt, pil):
    extra = {"output_compression": 80} if fmt != "png" else {}
    r = client(live_server).images.generate(prompt="a boat", size="32x32", output_format=fmt, quality="low",
                                            extra_body={"seed": 2}, **extra)
    assert r.output_format == fmt and Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))).format == pil


def test_video_api_through_the_sdk(live_server, tmp_path):
    c = client(live_server)
    video = c.videos.create(prompt="waves", size="32x32", extra_body={"num_frames": 9, "steps": 2, "seed": 4})
    assert video.status in ("queued", "in_progress") and video.object == "video"
    wait_for(lambda: c.videos.retrieve(video.id).status in ("completed", "failed"))
    done = c.videos.retrieve(video.id)
    assert done.status == "completed" and done.progress == 100, done
    mp4 = tmp_path / "v.mp4"
    mp4.write_bytes(c.videos.download_content(video.id).content)
    assert len(list(imageio_ffmpeg.read_frames(str(mp4)))) - 1 == 9  # the reader's first item is its metadata
    assert video.id in [v.id for v in c.videos.list()]
    assert c.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        c.videos.retrieve(video.id)


def test_video_api_refuses_what_it_does_not_do(live_server):
    r = httpx.post(f"{live_server}/v1/videos", json={"prompt": "x", "size": "32x32", "quality": "hd"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "quality"
    r = httpx.post(f"{live_server}/v1/videos", files={"input_reference": ("a.png", b"\x89PNG", "image/png")},
                   data={"prompt": "x"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_reference"
    assert httpx.get(f"{live_server}/v1/videos/video_nope", timeout=60).status_code == 404


# --- a real `minisgl serve` --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def serve(default_model_dir, tiny_models, tmp_path_factory):
    s = Serve(default_model_dir, tmp_path_factory.mktemp("media-serve"), "--image-model-dir",
              str(tiny_models["z-image"]), "--video-model-dir", str(tiny_models["wan"]), "--media-max-batch", "4",
              "--media-max-queue", "4", "--media-max-work", MAX_WORK)
    try:
        s.wait_healthy()
        yield s
    finally:
        s.stop()


def media(s: Serve) -> dict:
    return httpx.get(f"{s.url}/metrics", params={"format": "json"}, timeout=30).json()["media"]


def idle(s: Serve) -> bool:
    m = media(s)
    return m["queued"] == 0 and m["running"] == 0 and m["work_in_flight"] == 0


class Background:
    """An HTTP call on a thread: its response (or error) when it ends."""

    def __init__(self, call: Callable[[], httpx.Response]):
        self.result: httpx.Response | Exception | None = None
        self.ended_at = 0.0
        self.thread = threading.Thread(target=self._run, args=(call,), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[], httpx.Response]) -> None:
        try:
            self.result = call()
        except Exception as exc:  # noqa: BLE001 - the test reads it
            self.result = exc
        self.ended_at = time.monotonic()

    def response(self, timeout: float = 300) -> httpx.Response:
        self.thread.join(timeout)
        assert isinstance(self.result, httpx.Response), self.result
        return self.result


def long_video(s: Serve, **extra) -> str:
    """A video job of 16.4 megapixel-steps (~3 s of the tiny Wan's steps at any size): its id (to DELETE it)."""
    r = httpx.post(f"{s.url}/v1/videos", json={"prompt": "a long one", "size": "128x128", "num_frames": 1,
                                               "steps": 1000, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def cancel(s: Serve, video_id: str) -> None:
    assert httpx.delete(f"{s.url}/v1/videos/{video_id}", timeout=60).status_code == 200


@pytest.mark.slow
def test_batched_images_equal_alone(serve):
    blocker = long_video(serve)
    wait_for(lambda: media(serve)["running"] == 1)
    batches = media(serve)["batches"]["count"]
    # Queued behind the blocker, then taken together: 2 + 1 images in one pipeline call.
    a = Background(lambda: image(serve.url, prompt="a red lantern", n=2, seed=5))
    b = Background(lambda: image(serve.url, prompt="a blue boat at dawn on the sea", seed=9))
    wait_for(lambda: media(serve)["queued"] == 2)
    cancel(serve, blocker)
    batched = [pixels(d["b64_json"]) for d in a.response().json()["data"] + b.response().json()["data"]]
    m = media(serve)
    assert m["batches"]["count"] == batches + 1 and m["batches"]["last_size"] == 3, m
    # Image i of a request is drawn from seed + i: each alone, n=1.
    alone = [pixels(image(serve.url, prompt=p, seed=seed).json()["data"][0]["b64_json"])
             for p, seed in (("a red lantern", 5), ("a red lantern", 6), ("a blue boat at dawn on the sea", 9))]
    for x, y in zip(batched, alone, strict=True):
        assert np.abs(x - y).max() <= 1  # within 1/255
    assert not np.array_equal(batched[0], batched[1])


@pytest.mark.slow
def test_jobs_finish_in_arrival_order(serve):
    blocker = long_video(serve)
    wait_for(lambda: media(serve)["running"] == 1)
    calls = []
    for i in range(4):  # n=3 each: two never fit one batch of 4, so each runs alone, in turn
        calls.append(Background(lambda i=i: image(serve.url, prompt=f"job {i}", n=3, seed=i)))
        wait_for(lambda i=i: media(serve)["queued"] == i + 1)
    cancel(serve, blocker)
    for call in calls:
        assert call.response().status_code == 200
    ends = [call.ended_at for call in calls]
    assert ends == sorted(ends), ends


@pytest.mark.slow
def test_delete_frees_the_worker_within_one_step(serve):
    video_id = long_video(serve, size="96x96", steps=400)  # steps of tens of ms: a step count tells when it stopped
    wait_for(lambda: media(serve)["steps"] > 0 and media(serve)["running"] == 1)
    before = media(serve)
    cancel(serve, video_id)
    told = media(serve)  # as DELETE answered: the worker has been told
    wait_for(lambda: idle(serve), 60, "the cancelled job still holds the worker")
    after = media(serve)
    assert after["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1
    # Steps the service had not yet counted when DELETE answered, then the one in progress.
    assert after["steps"] - told["steps"] <= 3, (told, after)


@pytest.mark.slow
def test_a_client_hang_up_cancels_its_job(serve):
    before = media(serve)
    # A client that hangs up once its job has stepped (a read timeout raced the job: CI once got the image).
    body = json.dumps(LONG).encode()
    with socket.create_connection(("127.0.0.1", serve.port), timeout=60) as conn:
        conn.sendall(b"POST /v1/images/generations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: media(serve)["steps"] > before["steps"])
    wait_for(lambda: idle(serve), 60, "the hung-up job still holds the worker")
    after = media(serve)
    assert after["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1
    assert after["steps"] - before["steps"] < 1000
    # and the same for a stream closed early
    before = after
    with httpx.stream("POST", f"{serve.url}/v1/images/generations", json={**LONG, "stream": True}, timeout=60):
        wait_for(lambda: media(serve)["steps"] > before["steps"])
    wait_for(lambda: idle(serve), 60, "the closed stream's job still holds the worker")
    assert media(serve)["jobs"]["cancelled"] == before["jobs"]["cancelled"] + 1


@pytest.mark.slow
def test_queue_and_work_caps_answer_429_and_503_with_retry_after(serve):
    r = image(serve.url, prompt="x", size="256x256", n=16, steps=1000)  # alone past --media-max-work: 400 at once
    assert r.status_code == 400 and "megapixel-steps" in r.json()["error"]["message"]
    blocker = long_video(serve)
    wait_for(lambda: media(serve)["running"] == 1)
    queued = [long_video(serve, steps=10) for _ in range(4)]
    r = httpx.post(f"{serve.url}/v1/videos", json={"prompt": "one more", "size": "32x32", "num_frames": 1,
                                                   "steps": 10}, timeout=60)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.json()["error"]["type"] == "rate_limit_error"
    for video_id in queued:
        cancel(serve, video_id)
    r = image(serve.url, prompt="too much beside the blocker", size="64x64", steps=1000)  # 4.1 + 16.4 > 20
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    cancel(serve, blocker)
    wait_for(lambda: idle(serve), 60)
    refused = media(serve)["jobs"]["refused"]
    assert refused.get("429", 0) >= 1 and refused.get("503", 0) >= 1
    prom = httpx.get(f"{serve.url}/metrics", params={"format": "prometheus"}, timeout=30).text
    assert "minisgl_media_jobs_queued" in prom and "minisgl_media_jobs_cancelled_total" in prom


@pytest.mark.slow
def test_chat_completes_while_an_image_job_runs(serve):
    with httpx.stream("POST", f"{serve.url}/v1/images/generations", json={**LONG, "stream": True}, timeout=120):
        wait_for(lambda: media(serve)["running"] == 1)
        reply = client(serve.url).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0)
        assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
        assert media(serve)["running"] == 1  # the image job was still running all along
    wait_for(lambda: idle(serve), 60)


@pytest.mark.slow
def test_sigterm_mid_job_stops_everything_within_5s(default_model_dir, tiny_models, tmp_path):
    s = Serve(default_model_dir, tmp_path, "--image-model-dir", str(tiny_models["z-image"]))
    try:
        s.wait_healthy()
        call = Background(lambda: httpx.post(f"{s.url}/v1/images/generations", json=LONG, timeout=120))
        wait_for(lambda: media(s)["running"] == 1 and media(s)["steps"] > 0, 300)
        pids = list(s.children().values())
        assert media(s)["worker_pid"] in pids
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 0, s.stderr()
        assert time.monotonic() - t0 < 5, s.stderr()
        assert gone(pids, 1) == []
        call.thread.join(10)
        assert call.result is not None
    finally:
        s.stop()
