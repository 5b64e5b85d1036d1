"""`--media-parallel`: one video split over two gloo ranks on the CPU (the tiny Wan of tests/media_fixtures.py) has the
frames one process makes, CFG-parallel and Ulysses alike, and leaves no rank behind; a split that cannot be made is
one line and exit 1, before any rank starts."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

pytest.importorskip("diffusers")

from minisgl_cli.app import app  # noqa: E402
from minisgl_cli.media.jobs import MediaError, VideoJob  # noqa: E402
from minisgl_cli.media.parallel import check_job, resolve_mode  # noqa: E402

runner = CliRunner()
# 64x64, 5 frames: 2 latent frames of 4x4 patches, 32 tokens; a negative prompt so both CFG passes differ.
VIDEO = ["video", "-p", "a boat on a lake", "--negative-prompt", "blur", "--height", "64", "--width", "64",
         "--num-frames", "5", "--steps", "2", "--seed", "3", "--format", "frames", "--device", "cpu"]


def video(model_dir: Path, out: Path, *extra: str):
    return runner.invoke(app, [*VIDEO, "--model-dir", str(model_dir), "--output-dir", str(out), *extra])


def frames_of(result) -> np.ndarray:
    assert result.exit_code == 0, (result.stderr, result.exception)
    return np.stack([np.asarray(Image.open(p)) for p in sorted(Path(result.stdout.strip()).glob("*.png"))])


@pytest.fixture(scope="module")
def one_process(tiny_models, tmp_path_factory) -> np.ndarray:
    return frames_of(video(tiny_models["wan"], tmp_path_factory.mktemp("one")))


@pytest.mark.parametrize("mode", ["cfg", "ulysses"])
def test_two_ranks_make_the_frames_one_process_makes(mode, one_process, tiny_models, tmp_path):
    import torch

    tokens: list[int] = []  # the sequence each DiT block call of rank 0 (this process) sees

    def seen(module, args):  # Wan calls its blocks with positional arguments
        if type(module).__name__ == "WanTransformerBlock":
            tokens.append(args[0].shape[1])

    hook = torch.nn.modules.module.register_module_forward_pre_hook(seen)
    try:
        result = video(tiny_models["wan"], tmp_path, "--media-parallel", mode)
    finally:
        hook.remove()
    split = frames_of(result)
    # Rank 0's share: one process makes 2 steps x 2 CFG passes x 2 blocks = 8 block calls over all 32 tokens.
    if mode == "cfg":
        assert tokens == [32] * 4  # the cond pass only
    else:
        assert len(tokens) == 8 and tokens[1::2] == [16] * 4  # half the tokens (block 0's input is split inside it)
    assert f"64x64x5 on cpu x2 ({mode}): 2 steps in " in result.stderr, result.stderr
    assert split.shape == one_process.shape == (5, 64, 64, 3)
    # fp32 on the CPU: the same pixels but for rounding (cfg computes exactly the same calls; ulysses reorders sums)
    assert np.abs(split.astype(int) - one_process.astype(int)).max() <= 1
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minisgl media rank")]


@pytest.mark.slow
def test_cfg_split_with_compile_makes_the_same_frames(one_process, tiny_models, tmp_path):
    """--compile with a CFG split: each rank compiles its DiT's blocks (the split wraps the transformer's forward,
    outside the compiled blocks) and the frames are one process's."""
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    result = video(tiny_models["wan"], tmp_path, "--media-parallel", "cfg", "--compile")
    assert counters["stats"]["unique_graphs"] > graphs  # rank 0 (this process) compiled
    assert "64x64x5 on cpu x2 (cfg): 2 steps in " in result.stderr, result.stderr
    assert np.abs(frames_of(result).astype(int) - one_process.astype(int)).max() <= 1
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minisgl media rank")]


def test_auto_picks_cfg_for_a_guided_job_on_two_ranks_else_ulysses():
    assert resolve_mode("auto", 5.0, 2) == "cfg"
    assert resolve_mode("auto", 1.0, 2) == "ulysses"  # CFG off: one pass a step, nothing to split
    assert resolve_mode("auto", 5.0, 4) == "ulysses"


def test_a_size_whose_tokens_do_not_divide_over_the_ranks_is_refused(tiny_models):
    import torch

    from minisgl_cli.media.pipelines import _from_disk

    pipe = _from_disk(tiny_models["wan"], torch.float32)
    check_job(pipe, "ulysses", 2, VideoJob("x", 64, 64, 5))  # 32 tokens
    with pytest.raises(MediaError, match=r"48x48x1 is 9 tokens, not a multiple of 2 ranks"):
        check_job(pipe, "ulysses", 2, VideoJob("x", 48, 48, 1))
    check_job(pipe, "cfg", 2, VideoJob("x", 48, 48, 1))  # cfg splits the passes, not the tokens


@pytest.fixture(scope="module")
def three_heads(tiny_models, tmp_path_factory) -> Path:
    """The tiny Wan with its config saying 3 attention heads (refused from the config, before any weights load)."""
    d = tmp_path_factory.mktemp("three-heads") / "wan"
    shutil.copytree(tiny_models["wan"], d)
    cfg = json.loads((d / "transformer/config.json").read_text())
    (d / "transformer/config.json").write_text(json.dumps({**cfg, "num_attention_heads": 3}))
    return d


BAD = {
    "heads not divisible": ("@three", ["--media-parallel", "ulysses"],
                            "WanTransformer3DModel's 3 heads do not divide over 2 ranks"),
    "more ranks than devices": ("wan", ["--media-parallel", "ulysses", "--media-parallel-size", "4096"],
                                "--media-parallel-size 4096 is more ranks than this machine's"),
    "cfg on three ranks": ("wan", ["--media-parallel", "cfg", "--media-parallel-size", "3"],
                           "over exactly 2 ranks"),
    "cfg without guidance": ("wan", ["--media-parallel", "cfg", "--guidance-scale", "1"],
                             "guidance 1 runs one (CFG is on above 1): use ulysses"),
    "ulysses with compile": ("wan", ["--media-parallel", "ulysses", "--compile"],
                             "--media-parallel ulysses and --compile do not combine"),
    "one rank": ("wan", ["--media-parallel", "ulysses", "--media-parallel-size", "1"], "needs 2 or more ranks"),
    "no plan": ("z-image", ["--media-parallel", "ulysses"], "ZImageTransformer2DModel has no context-parallel plan"),
    "cfg of a one-call pipeline": ("z-image", ["--media-parallel", "cfg", "--guidance-scale", "4"],
                                   "ZImagePipeline does not make them so"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_a_split_that_cannot_be_made_is_one_line_and_exit_1(case, tiny_models, three_heads, tmp_path):
    model, extra, expected = BAD[case]
    if model == "z-image":
        args = ["image", "--height", "32", "--width", "32", "--steps", "1", "--device", "cpu",
                "--model-dir", str(tiny_models["z-image"]), "--output-dir", str(tmp_path / "out"), *extra]
        result = runner.invoke(app, args)
    else:
        result = video(three_heads if model == "@three" else tiny_models["wan"], tmp_path / "out", *extra)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), (result.stderr, result.exception)
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ") and expected in line, line
    # refused before any rank started (other children of this process, an earlier module's media worker, may live on)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("minisgl media rank")]


@pytest.mark.slow
def test_serve_media_worker_leads_the_ranks_and_leaves_none_behind(one_process, tiny_models):
    """The media worker (a runtime child) is rank 0: the other rank is its child, handed each job; the video the
    route answers has the one-process frames; closing the service (SIGTERM to the worker) ends both processes."""
    import base64
    import io

    import httpx
    import psutil
    from fastapi import FastAPI

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.media.service import MediaService
    from minisgl_cli.media.settings import MediaSettings
    from minisgl_cli.server.errors import install_error_handlers
    from minisgl_cli.server.media import build_media_router

    me = psutil.Process()
    earlier = {p.pid for p in me.children(recursive=True)}  # an earlier module's children: not this test's
    service = MediaService(MediaSettings(video_model_dir=tiny_models["wan"], device="cpu", media_parallel="auto"))
    assert service.settings.spec("video").media_parallel == "cfg"  # auto: the default video job is guided
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(build_media_router(service=service))
    server = BackgroundServer(app)
    url = server.start(healthy=False)
    try:
        r = httpx.post(f"{url}/v1/videos/generations", timeout=300, json={
            "prompt": "a boat on a lake", "negative_prompt": "blur", "size": "64x64", "num_frames": 5, "steps": 2,
            "seed": 3, "guidance_scale": 5.0, "response_format": "frames"})
        assert r.status_code == 200, r.text
        frames = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(f)))) for f in r.json()["data"][0]
                           ["frames"]])
        # (this test process's own multiprocessing resource tracker lives as long as it does)
        below = [p for p in me.children(recursive=True) if p.pid not in earlier
                 and not (p.ppid() == me.pid and "resource_tracker" in " ".join(p.cmdline()))]
        assert any(p.ppid() not in (me.pid, 1) for p in below)  # the worker's own child: rank 1
    finally:
        service.close()
        server.stop()
    assert np.abs(frames.astype(int) - one_process.astype(int)).max() <= 1
    _, alive = psutil.wait_procs(below, timeout=10)
    assert not alive, [(p.pid, p.ppid(), p.cmdline()) for p in alive]


def test_serve_refuses_a_split_it_cannot_make_at_start_up():
    result = runner.invoke(app, ["serve", "--media-parallel", "cfg", "--media-parallel-size", "3"])
    assert result.exit_code == 2, (result.stderr, result.exception)
    (line,) = [x for x in result.stderr.splitlines() if x.strip()]
    assert line == ("error: --media-parallel cfg splits the two CFG passes over exactly 2 ranks, got "
                    "--media-parallel-size 3 (use ulysses for more)"), line


@pytest.mark.slow
def test_sigterm_mid_split_job_ends_every_rank_within_5s(tiny_model_dirs, tiny_models, tmp_path):
    """A real `minisgl serve` whose media worker leads a CFG split: SIGTERM while the split video denoises ends the
    server, the worker and its rank within the issue 46 bar, and the client's request ends (no hang)."""
    import signal
    import threading
    import time

    import httpx
    import psutil
    from serve_process import Serve, gone

    # a tiny chat model in-process: the media worker (a child) and its rank are what this test is about
    s = Serve(tiny_model_dirs["llama"], tmp_path, "--runtime", "in-process", "--video-model-dir",
              str(tiny_models["wan"]), "--media-parallel", "cfg")
    try:
        s.wait_healthy()
        ended: list = []

        def long_video() -> None:  # minutes of steps unless stopped
            try:
                ended.append(httpx.post(f"{s.url}/v1/videos/generations", timeout=120, json={
                    "prompt": "a long one", "size": "32x32", "num_frames": 1, "steps": 1000, "seed": 1}))
            except httpx.HTTPError as exc:
                ended.append(exc)

        call = threading.Thread(target=long_video, daemon=True)
        call.start()

        def media() -> dict:
            return httpx.get(f"{s.url}/metrics", params={"format": "json"}, timeout=30).json()["media"]

        deadline = time.monotonic() + 300
        while not (media()["running"] == 1 and media()["steps"] > 0):
            assert time.monotonic() < deadline and call.is_alive(), (ended, s.stderr())
            time.sleep(0.2)
        server = psutil.Process(s.proc.pid)
        below = server.children(recursive=True)
        worker = psutil.Process(media()["worker_pid"])
        assert [p for p in worker.children() if "resource_tracker" not in " ".join(p.cmdline())], s.stderr()  # rank 1
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(10) == 0, s.stderr()
        assert time.monotonic() - t0 < 5, s.stderr()
        assert gone(below, 1) == [], [(p.pid, p.cmdline()) for p in gone(below, 0)]
        assert "leaked semaphore" not in s.stderr(), s.stderr()  # the rank queues' (the worker leaves by os._exit)
        call.join(10)
        # the request ends: its connection closed, or the worker's 503 on the way out
        assert ended and (isinstance(ended[0], httpx.HTTPError) or ended[0].status_code == 503), ended
    finally:
        s.stop()
