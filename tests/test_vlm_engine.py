"""Qwen2-VL and Qwen2.5-VL on our engine (tiny random models built with transformers, examples/
make_tiny_media_models.py): greedy ids equal HF fp32 `generate` with one image, two of different sizes and an
image cut across prefill chunks; the radix cache reuses an image's KV for the same image, never for another."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from PIL import Image

from minisgl_cli import LLM, SamplingParams
from minisgl_cli.types import GenerateRequest

pytest.importorskip("transformers")

EXACT = dict(dtype="float32", quantization="none", attention_backend="torch")
N = 8  # new tokens per reply
QWEN_VLMS = ["qwen2-vl", "qwen2.5-vl"]


def picture(w: int, h: int, seed: int) -> Image.Image:
    """Noise: every pixel matters (a flat colour would make images alike)."""
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy())


def chat(*parts: str | Image.Image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": p} if isinstance(p, Image.Image)
                                         else {"type": "text", "text": p} for p in parts]}]


CHATS = [
    chat(picture(50, 40, 1), "What is in the picture?"),
    chat("Compare", picture(64, 32, 2), "with", picture(30, 60, 3), "please."),  # two images, two sizes
]


def hf_greedy(model_dir: Path, chats: list[list[dict]]) -> list[list[int]]:
    from minisgl_cli.vision.vlm import load_vlm, prepare

    loaded = load_vlm(model_dir, "cpu")
    out = []
    for c in chats:
        p = prepare(loaded, c)
        gen = loaded.model.generate(**p.inputs, max_new_tokens=N, min_new_tokens=N, do_sample=False)
        out.append(gen[0, p.prompt_tokens:].tolist())
    return out


def ours(model_dir: Path, chats: list[list[dict]], **kw) -> list[list[int]]:
    with LLM(str(model_dir), **EXACT, **kw) as llm:
        res = llm.generate(chats, SamplingParams(max_new_tokens=N, ignore_eos=True))
        llm.client.check_pages()
        stats = llm.client.stats()
    assert stats.images_encoded >= 3 and stats.vision_s > 0
    return [r.token_ids for r in res]


@pytest.mark.parametrize("name", QWEN_VLMS)
def test_greedy_ids_equal_hf_with_images_whole_and_cut_across_prefill_chunks(tiny_vlms, name):
    theirs = hf_greedy(tiny_vlms[name], CHATS)
    assert theirs[0] != theirs[1], "degenerate tiny model: replies do not depend on the prompt"
    assert ours(tiny_vlms[name], CHATS) == theirs
    # 7-token chunks: every image (6 to 16 placeholder tokens) is cut, its rest embedded from the cache.
    assert ours(tiny_vlms[name], CHATS, max_prefill_tokens=7) == theirs


def test_same_image_reuses_its_kv_and_another_image_never_does(tiny_vlms):
    with LLM(str(tiny_vlms["qwen2-vl"]), **EXACT) as llm:
        params = SamplingParams(max_new_tokens=2, ignore_eos=True)
        red, blue = picture(48, 48, 7), picture(48, 48, 8)  # same size: the same placeholder ids
        first = llm.generate(chat(red, "Describe it."), params)[0]
        image = asyncio.run(llm.client.prompt(GenerateRequest(messages=chat(red, "x")))).images[0]
        again = llm.generate(chat(red, "What colour dominates?"), params)[0]
        other = llm.generate(chat(blue, "What colour dominates?"), params)[0]
        stats = llm.client.stats()
        llm.client.check_pages()
    assert first.stats.cached_tokens <= image.offset
    assert again.stats.cached_tokens >= image.offset + image.tokens  # the image's tokens came from the cache
    assert other.stats.cached_tokens <= image.offset  # the same ids before and in the image: no hit past it
    assert stats.images_encoded == 2  # red once (its second request reused the KV, not even the tower), blue once
