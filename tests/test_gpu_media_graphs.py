"""CUDA graphs of the media passes (media/graphs.py) on a CUDA GPU (skipped without one): a graphed Z-Image makes the
same pixels as the eager passes, bit for bit, its encoder and block stacks replaying; a pass that waits on the device
stays eager; a capture that fails leaves the pass eager and the process's random ops working; replays hand back fresh
tensors; past the cap the oldest shape's graph goes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("diffusers")

from minisgl_cli.media.graphs import Graphed, GraphedBlocks, Pool  # noqa: E402
from minisgl_cli.media.image import generate_images  # noqa: E402
from minisgl_cli.media.jobs import ImageJob, ModelSpec  # noqa: E402
from minisgl_cli.media.pipelines import load_pipeline, unload_all  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _images(compile: bool, graphs: bool) -> tuple[list[np.ndarray], object]:
    unload_all()
    torch._dynamo.reset()
    loaded = load_pipeline(ModelSpec.create("image", "tiny-z-image", None, device="cuda", load_format="dummy",
                                            compile=compile, cuda_graphs=graphs))
    # Three prompts of one length (one token bucket), 4 steps each: the DiT's shapes are captured in the first call and
    # replayed, the encoder's (a pass a call) captured in the second and replayed in the third.
    out = [np.asarray(generate_images(loaded, ImageJob(p, 64, 64, steps=4, seed=3)).images[0])
           for p in ("a fox in snow", "a cat in rain", "a dog in mist")]
    return out, loaded


@pytest.mark.parametrize("compile", [False, True])
def test_graphed_z_image_gives_the_eager_pixels_bit_for_bit(compile):
    eager, loaded = _images(compile, graphs=False)
    assert loaded.graphs is None
    graphed, loaded = _images(compile, graphs=True)
    for a, b in zip(graphed, eager, strict=True):
        assert np.array_equal(a, b)
    members = loaded.graphs.members
    assert {m.name for m in members} >= {"text encoder", "ZImageTransformer2DModel.layers"}
    assert all(m.captures > 0 and m.replays > 0 and not m.eager for m in members), [
        (m.name, m.captures, m.replays, m.eager) for m in members]
    assert isinstance(loaded.pipe.transformer.layers, GraphedBlocks)
    unload_all()


def test_a_pass_that_waits_on_the_device_stays_eager():
    g = Graphed(lambda x: x * x.sum().item(), Pool(), "syncs")
    x = torch.arange(4.0, device="cuda")
    for _ in range(4):
        assert torch.equal(g(x), x * 6.0)
    assert g.captures == 0 and len(g.eager) == 1


def test_a_failed_capture_leaves_the_pass_eager_and_random_ops_working():
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        if torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize()  # what a graph cannot hold: the capture fails
        return y + 1

    g = Graphed(fn, Pool(), "fails")
    x = torch.randn(8, device="cuda")
    for _ in range(4):
        assert torch.equal(g(x), x * 2 + 1)
    assert g.captures == 0 and len(g.eager) == 1
    # A failed capture leaves torch's CUDA generator in capture mode unless released: this raised then.
    assert torch.randn(16, device="cuda").isfinite().all()
    assert torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).sum() > 0


def test_replays_hand_back_fresh_tensors_and_the_oldest_graph_goes_past_the_cap():
    g = Graphed(lambda x, s: (x * s, x + 1), Pool(), "pairs", max_graphs=2)
    a, b = torch.ones(3, device="cuda"), torch.full((3,), 2.0, device="cuda")
    for _ in range(3):
        first = g(a, 3)
    second = g(b, 3)  # the same shape: a replay into the graph's buffers
    assert torch.equal(first[0], torch.full((3,), 3.0, device="cuda")) and torch.equal(second[1], b + 1)
    for n in (4, 5):
        x = torch.ones(n, device="cuda")
        for _ in range(3):
            assert torch.equal(g(x, 2)[0], x * 2)
    assert g.captures == 3 and len(g.graphs) == 2 and ((3,), torch.float32) not in [k[0][:2] for k in g.graphs]
