"""Qwen2-VL and Qwen2.5-VL on our engine (tiny random models built with transformers, examples/
make_tiny_media_models.py): greedy ids equal HF fp32 `generate` with one image, two of different sizes and an
image cut across prefill chunks; the radix cache reuses an image's KV for the same image, never for another."""

from __future__ import annotations

import asyncio
import multiprocessing
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


def test_image_requests_retracted_for_kv_re_prefill_to_the_same_tokens(tiny_vlms):
    """A pool too small for all four at once: the newest are retracted (their KV cached, maybe evicted) and come
    back, their images embedded again where needed; each reply is a prefix of its roomy-pool reply (a request left
    alone without room ends at the pool's limit)."""
    chats = [*CHATS, chat(picture(40, 40, 9), "Third?"), chat("Fourth", picture(56, 24, 4))]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    with LLM(str(tiny_vlms["qwen2-vl"]), **EXACT) as llm:
        want = [r.token_ids for r in llm.generate(chats, params)]
    with LLM(str(tiny_vlms["qwen2-vl"]), **EXACT, max_total_tokens=150, max_prefill_tokens=16) as llm:
        got = [r.token_ids for r in llm.generate(chats, params)]
        stats = llm.client.stats()
        llm.client.check_pages()
    assert stats.retracted_requests > 0
    assert all(g == w[: len(g)] and len(g) >= 20 for g, w in zip(got, want)), (got, want)


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


# --- the multi-process runtime and the real server ---------------------------------------------------------


def _greedy_remote_and_local(model_dir: Path, chats: list[list[dict]], tp: int) -> tuple[list, list]:
    from minisgl_cli.client.local import LocalClient
    from minisgl_cli.client.protocol import complete
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.runtime.config import RuntimeConfig
    from minisgl_cli.runtime.launch import launch
    from minisgl_cli.scheduler.config import SchedulerConfig

    def greedy(client) -> list[list[int]]:
        async def run():
            reqs = [GenerateRequest(messages=c, params=SamplingParams(max_new_tokens=N, ignore_eos=True))
                    for c in chats]
            return await asyncio.gather(*(complete(client, r) for r in reqs))
        return [c.token_ids for c in asyncio.run(run())]

    cfg = EngineConfig(model=str(model_dir), max_total_tokens=2048, dtype="float32", quantization="none")
    local = LocalClient(cfg)
    try:
        want = greedy(local)
    finally:
        local.close()
    rt = RuntimeConfig(tp_size=tp)
    remote = launch(cfg, SchedulerConfig(max_prefill_tokens=9), rt)  # 9-token chunks: images cut on both ranks
    try:
        got = greedy(remote)
        remote.check_pages()
    finally:
        remote.close()
    return got, want


@pytest.mark.slow
def test_tp2_equals_one_process_with_images_and_leaves_no_shared_memory(tiny_vlms):
    from minisgl_cli.vision import pixels

    chats = [*CHATS, [{"role": "user", "content": "Text only, beside the images."}]]
    before = set(pixels._ROOT.glob(f"{pixels.PREFIX}*"))
    got, want = _greedy_remote_and_local(tiny_vlms["qwen2.5-vl"], chats, tp=2)
    assert got == want
    assert not set(pixels._ROOT.glob(f"{pixels.PREFIX}*")) - before, "pixel segments left behind"


@pytest.mark.slow
def test_requests_made_from_one_image_prompt_each_get_their_own_pixels(tiny_vlms):
    """n choices (or a retry) are requests made from one processed prompt: each hands the scheduler its own copy of
    the prompt's pixels, so one request's end (its rank unlinks what it was given) cannot take them from the next;
    the prompt's own segment goes when the prompt is dropped."""
    import gc

    from minisgl_cli.client.protocol import complete
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.runtime.config import RuntimeConfig
    from minisgl_cli.runtime.launch import launch
    from minisgl_cli.scheduler.config import SchedulerConfig
    from minisgl_cli.vision import pixels

    before = set(pixels._ROOT.glob(f"{pixels.PREFIX}*"))
    cfg = EngineConfig(model=str(tiny_vlms["qwen2-vl"]), max_total_tokens=2048, dtype="float32", quantization="none")
    remote = launch(cfg, SchedulerConfig(), RuntimeConfig())
    try:
        async def run() -> list[list[int]]:
            prompt = await remote.prompt(GenerateRequest(messages=CHATS[0]))
            params = SamplingParams(max_new_tokens=N, ignore_eos=True)
            out = []
            for _ in range(2):  # one after the other: the first has ended (its segment unlinked) when the next goes
                req = GenerateRequest(tokenized=prompt, params=params)
                out.append((await complete(remote, req)).token_ids)
            return out

        first, second = asyncio.run(run())
        assert first == second and len(first) == N
        remote.check_pages()
    finally:
        remote.close()
    gc.collect()
    assert not set(pixels._ROOT.glob(f"{pixels.PREFIX}*")) - before, "pixel segments left behind"


def _png_url(w: int, h: int, seed: int) -> str:
    import base64
    import io

    buf = io.BytesIO()
    picture(w, h, seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.mark.slow
def test_eight_concurrent_image_chats_through_the_server_equal_their_one_at_a_time_replies(tiny_vlms, tmp_path):
    """`serve --model QWEN2-VL-DIR`: the VLM is the served model; every text-request feature works with images."""
    import concurrent.futures

    import httpx
    import openai
    from serve_process import Serve

    server = Serve(tiny_vlms["qwen2-vl"], tmp_path, "--dtype", "float32", "--quantization", "none",
                   kv_tokens=4096)
    try:
        server.wait_healthy()
        oc = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i: int) -> tuple[str | None, int]:
            messages = [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": _png_url(40 + 8 * i, 32, i)}},
                {"type": "text", "text": f"Question {i}?"}]}]
            r = oc.chat.completions.create(model="qwen2-vl", messages=messages, max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True})
            return r.choices[0].message.content, r.usage.completion_tokens

        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # first, cold: prefills batch different images
            together = list(pool.map(ask, range(8)))
        alone = [ask(i) for i in range(8)]
        assert together == alone and len({text for text, _ in alone}) > 1

        one = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_url(50, 40, 1)}},
                                            {"type": "text", "text": "Hi"}]}]
        r = oc.chat.completions.create(model="qwen2-vl", messages=one, max_tokens=4, logprobs=True, top_logprobs=2,
                                       n=2, temperature=0.8, seed=3, frequency_penalty=0.5, presence_penalty=0.2,
                                       logit_bias={"5": -5})
        assert len(r.choices) == 2 and all(len(c.logprobs.content) == 4 for c in r.choices), r
        assert len(r.choices[0].logprobs.content[0].top_logprobs) == 2
        r = oc.chat.completions.create(model="qwen2-vl", messages=one, max_tokens=10, extra_body={"regex": "(yes|no)"})
        assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
        chunks = list(oc.chat.completions.create(model="qwen2-vl", messages=one, max_tokens=5, stream=True,
                                                 stream_options={"include_usage": True}))
        assert chunks[-1].usage.completion_tokens == 5
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=60,
                          json={"messages": one, "stream": True, "max_tokens": 500, "ignore_eos": True}) as resp:
            for line in resp.iter_lines():
                if '"content"' in line:
                    break  # hang up mid-reply: the request is aborted, its KV and pixels freed
        broken = {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}}  # not a picture
        bad = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": [broken]}]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages.0.content.0.image_url.url"
        text = oc.chat.completions.create(model="qwen2-vl", messages=[{"role": "user", "content": "Hello"}],
                                          max_tokens=3)
        assert text.usage.completion_tokens == 3  # the same model serves text

        metrics = httpx.get(f"{server.url}/metrics", params={"format": "json"}, timeout=10).json()
        sched = metrics["scheduler"]
        assert sched["images_encoded"] >= 9 and sched["vision_s"] > 0
        assert metrics["server"]["disconnects"] >= 1 and sched["running"] == sched["waiting"] == 0
        prom = httpx.get(f"{server.url}/metrics", params={"format": "prometheus"}, timeout=10).text
        assert "minisgl_images_encoded_total" in prom and "minisgl_vision_seconds_total" in prom
    finally:
        server.stop()


def test_pixel_segments_round_trip_copy_inline_and_sweep():
    """vision/pixels.py: what the tokenizer step writes a rank reads back exactly (from the segment, a request's copy,
    or the bytes sent inline to another host); a gone segment is a clear error; a dead writer's are swept."""
    import os

    from minisgl_cli.vision import pixels

    rows = torch.randn(6, 384)
    try:
        name = pixels.write(rows)
        copy = pixels.copy(name, [6, 384])
        assert torch.equal(pixels.read(name, [6, 384]), rows) and torch.equal(pixels.read(copy, [6, 384]), rows)
        data = pixels.read_bytes(name)
        assert data is not None and torch.equal(pixels.from_bytes(data, [6, 384]), rows)
        with pytest.raises(ValueError, match="are 9216 bytes, not 2304"):
            pixels.read(name, [6, 96])
        pixels.unlink(name)
        pixels.unlink(name)  # twice is fine: owner and reader may both clean up
        with pytest.raises(ValueError, match="pixels are gone"):
            pixels.read(name, [6, 384])
        assert pixels.read_bytes(name) is None
        assert pixels.sweep(os.getpid()) >= 1  # the copy
        assert not list(pixels._ROOT.glob(f"{pixels.owner_tag()}*"))
    finally:
        pixels.sweep(os.getpid())


def test_an_image_prompt_refused_at_admission_leaves_no_pixels(tiny_vlms):
    """The tokenizer worker shares an image prompt's pixels before it admits the prompt: one it refuses (too long for
    the context) takes none of them out of shared memory's reach, with the runtime still serving."""
    from minisgl_cli.admission import AdmissionError
    from minisgl_cli.engine.config import EngineConfig
    from minisgl_cli.runtime.config import RuntimeConfig
    from minisgl_cli.runtime.launch import launch
    from minisgl_cli.scheduler.config import SchedulerConfig
    from minisgl_cli.vision import pixels

    cfg = EngineConfig(model=str(tiny_vlms["qwen2-vl"]), max_total_tokens=2048, dtype="float32", quantization="none",
                       max_context_len=8)
    remote = launch(cfg, SchedulerConfig(), RuntimeConfig())
    try:
        with pytest.raises(AdmissionError):
            asyncio.run(remote.prompt(GenerateRequest(messages=CHATS[0])))
        # This runtime's processes only: a test in the other pytest process may hold segments of its own meanwhile.
        ours = [pixels.owner_tag(p.pid) for p in multiprocessing.active_children()]
        left = [f for f in pixels._ROOT.glob(f"{pixels.PREFIX}*") if f.name.startswith(tuple(ours))]
        assert ours and not left, "a refused prompt's pixels left behind"
    finally:
        remote.close()
