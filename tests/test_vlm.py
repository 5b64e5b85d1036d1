"""Vision-language chat: images read under the server's policy, tiny VLMs of both families (Idefics3 / SmolVLM and
Qwen2-VL, built from configs) through the runner, the real server and the official `openai` client."""

from __future__ import annotations

import asyncio
import base64
import io
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from minisgl_cli.types import GenerateRequest, SamplingParams
from minisgl_cli.vision.image_source import ImageError, ImagePolicy, load_image_file, load_image_url
from minisgl_cli.vision.vlm import VlmChat, VlmLoadError, load_vlm, prepare, resolve_vlm_dir, stream

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def png(w: int = 50, h: int = 40, color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), color).save(buf, format="PNG")
    return buf.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(raw).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(url: str, text: str = "What is in the picture?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, image_part(url)]}]


# --- image sources ------------------------------------------------------------------------------------


def test_data_urls_decode_and_bad_ones_say_why():
    policy = ImagePolicy()
    assert load_image_url(data_url(png(7, 5)), policy).size == (7, 5)
    cases = {
        "data:image/png;base64,AAAA": "could not be decoded",
        "data:image/png;base64,@@@": "not valid base64",
        "data:text/plain;base64,AAAA": "not an image",
        "data:image/png,rawbytes": "must be base64",
        "data:image/png;base64": "no ','",
        "ftp://example.com/x.png": "unsupported image URL scheme",
    }
    for url, why in cases.items():
        with pytest.raises(ImageError, match=why):
            load_image_url(url, policy, "p")


def test_caps_and_sources_are_refused_unless_allowed(tmp_path):
    (tmp_path / "ok.png").write_bytes(png())
    (tmp_path / "big.png").write_bytes(png(300, 300))
    outside = tmp_path.parent / f"{tmp_path.name}-outside.png"
    outside.write_bytes(png())
    with pytest.raises(ImageError, match="--allow-remote-images"):  # the default: never fetch a URL
        load_image_url("http://127.0.0.1:9/x.png", ImagePolicy())
    with pytest.raises(ImageError, match="--allow-local-images"):
        load_image_url(str(tmp_path / "ok.png"), ImagePolicy())
    local = ImagePolicy(local_dir=tmp_path)
    assert load_image_url(str(tmp_path / "ok.png"), local).size == (50, 40)
    assert load_image_url("ok.png", local).size == (50, 40)  # relative to the allowed dir
    assert load_image_url(f"file://{tmp_path / 'ok.png'}", local).size == (50, 40)
    for escape in (str(outside), f"../{outside.name}", f"file://{outside}"):
        with pytest.raises(ImageError, match="outside the allowed directory"):
            load_image_url(escape, local)
    with pytest.raises(ImageError, match="pixels; the limit is 10,000"):
        load_image_url(str(tmp_path / "big.png"), ImagePolicy(local_dir=tmp_path, max_pixels=10_000))
    with pytest.raises(ImageError, match="the limit is 0.0 MiB"):
        load_image_url(data_url(png()), ImagePolicy(max_bytes=16))
    with pytest.raises(ImageError, match="no image file"):
        load_image_file(tmp_path / "missing.png", local)


# --- the runner on tiny VLMs of both families ------------------------------------------------------------


@pytest.fixture(scope="module")
def vlms(tiny_vlms):
    return {name: load_vlm(path) for name, path in tiny_vlms.items()}


def chat_with(image) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "What?"}]}]


def test_image_reaches_the_processor_as_pixel_values_of_the_right_shape(vlms):
    image = Image.new("RGB", (50, 40), (0, 128, 255))
    # Idefics3: resized to 64 on its longest side, split into 2x2 tiles of 32 plus a global tile; each tile is
    # 4x4 patches of 8, pixel-shuffled by 2 into 4 <image> tokens.
    idefics = vlms["idefics3"]
    got = prepare(idefics, chat_with(image))
    assert tuple(got.inputs["pixel_values"].shape) == (1, 5, 3, 32, 32) and got.images == 1
    image_id = idefics.tokenizer.convert_tokens_to_ids("<image>")
    assert (got.inputs["input_ids"] == image_id).sum().item() == 5 * 4
    # Qwen2-VL / 2.5-VL: resized to multiples of 16 (32 x 48), 8x8 patches flattened with 2 frames each
    # (3*2*8*8 = 384 values), 2x2 patches merged per <|image_pad|> token.
    for name in ("qwen2-vl", "qwen2.5-vl"):
        qwen = vlms[name]
        got = prepare(qwen, chat_with(image))
        assert got.inputs["image_grid_thw"].tolist() == [[1, 4, 6]]
        assert tuple(got.inputs["pixel_values"].shape) == (24, 384)
        pad = qwen.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        assert (got.inputs["input_ids"] == pad).sum().item() == 24 // 4
    # A different picture gives different pixels: the image itself got there, not a placeholder.
    other = prepare(vlms["qwen2-vl"], chat_with(Image.new("RGB", (50, 40), (255, 255, 0))))
    assert not other.inputs["pixel_values"].equal(got.inputs["pixel_values"])


@pytest.mark.parametrize("name", ["idefics3", "qwen2-vl"])
def test_runner_stream_is_greedy_generate_token_for_token(vlms, name):
    loaded = vlms[name]
    prepared = prepare(loaded, chat_with(Image.new("RGB", (50, 40), (10, 200, 10))))

    async def run() -> list:
        return [d async for d in stream(loaded, prepared, SamplingParams(max_new_tokens=6, ignore_eos=True), "r")]

    deltas = asyncio.run(run())
    ids = [t for d in deltas for t in d.token_ids]
    reference = loaded.model.generate(**prepared.inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
    assert ids == reference[0, prepared.prompt_tokens:].tolist()
    final = deltas[-1]
    assert final.finish_reason == "length" and final.stats.completion_tokens == 6
    assert final.stats.prompt_tokens == prepared.prompt_tokens


def test_a_seeded_sampled_reply_repeats_and_leaves_the_process_rng_alone(vlms):
    """A seed draws from the request's own generator: the same seed gives the same tokens, and the process-wide
    RNG (which the text engine's sampler and other threads draw from) is neither reseeded nor advanced."""
    import torch

    loaded = vlms["qwen2-vl"]
    prepared = prepare(loaded, chat_with(Image.new("RGB", (50, 40), (10, 200, 10))))

    def ids(seed: int) -> list[int]:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=1.5, seed=seed)

        async def run() -> list:
            return [d async for d in stream(loaded, prepared, params, f"s{seed}")]
        return [t for d in asyncio.run(run()) for t in d.token_ids]

    torch.manual_seed(1234)
    state = torch.get_rng_state()
    first, again, other = ids(7), ids(7), ids(8)
    assert first == again and len(first) == 8 and other != first
    assert torch.equal(torch.get_rng_state(), state)


def test_runner_refuses_what_it_cannot_do_and_bad_models(vlms, tiny_vlms, tmp_path, default_model_dir):
    runner = VlmChat(tiny_vlms["idefics3"])

    async def first(params: SamplingParams) -> str | None:
        req = GenerateRequest(messages=chat_with(Image.new("RGB", (8, 8))), params=params)
        async for d in runner.submit(req):
            return d.error
        return None

    assert "logprobs" in asyncio.run(first(SamplingParams(logprobs=True)))
    assert "presence_penalty" in asyncio.run(first(SamplingParams(presence_penalty=1.0)))
    with pytest.raises(VlmLoadError, match="not a vision-language model"):
        resolve_vlm_dir(default_model_dir)  # a text model
    with pytest.raises(VlmLoadError, match="model not found"):
        resolve_vlm_dir(tmp_path / "nowhere")


# --- the real server, the official client ---------------------------------------------------------------


@pytest.fixture(scope="module")
def image_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("images")
    (d / "red.png").write_bytes(png())
    (d / "huge.png").write_bytes(png(200, 200))
    (d / "notes.txt").write_text("not an image")
    return d


def _vision_server(model: Path, policy: ImagePolicy) -> Iterator[str]:
    from server_fixtures import shared_client

    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.server.app import ServerSettings, create_app
    from minisgl_cli.server.settings import VisionSettings

    app = create_app(shared_client(), ServerSettings(vision=VisionSettings(model=str(model), images=policy)))
    with BackgroundServer(app) as url:
        yield url


@pytest.fixture(scope="module")
def idefics_url(tiny_vlms, image_dir) -> Iterator[str]:
    """Idefics3 behind the server; local files under image_dir allowed, remote URLs at their default (refused)."""
    yield from _vision_server(tiny_vlms["idefics3"], ImagePolicy(local_dir=image_dir, max_pixels=100 * 100))


@pytest.fixture(scope="module")
def image_host(image_dir) -> Iterator[str]:
    """A plain HTTP server holding image_dir: what a remote image URL points at."""
    from fastapi import FastAPI
    from fastapi.responses import Response

    from minisgl_cli.api.http_server import BackgroundServer

    app = FastAPI()

    @app.get("/img/{name}")
    def img(name: str) -> Response:
        path = image_dir / name
        return Response(path.read_bytes(), media_type="image/png") if path.is_file() else Response(status_code=404)

    server = BackgroundServer(app)
    yield server.start(healthy=False)  # no /health here
    server.stop()


@pytest.fixture(scope="module")
def qwen_url(tiny_vlms) -> Iterator[str]:
    """Qwen2-VL behind the server, with remote image URLs allowed."""
    yield from _vision_server(tiny_vlms["qwen2-vl"], ImagePolicy(allow_remote=True))


def client(url: str):
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)


def post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


@pytest.mark.slow
def test_chat_with_an_image_streams_and_not_with_the_same_reply_and_usage(idefics_url, tiny_vlms, vlms):
    oc = client(idefics_url)
    messages = ask(data_url(png()))
    whole = oc.chat.completions.create(model="idefics3", messages=messages, max_tokens=6)
    assert whole.object == "chat.completion" and whole.model == "idefics3"
    assert whole.choices[0].finish_reason in ("stop", "length") and whole.choices[0].message.role == "assistant"
    picture = Image.open(io.BytesIO(png()))
    expected_prompt = prepare(vlms["idefics3"], [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"}, {"type": "image", "image": picture}]}])
    u = whole.usage
    assert u.prompt_tokens == expected_prompt.prompt_tokens and 0 < u.completion_tokens <= 6
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens

    chunks = list(oc.chat.completions.create(model="idefics3", messages=messages, max_tokens=6, stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same reply either way
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == u.model_dump()
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)

    # A local file under --allow-local-images, and a text-only request: that one goes to the text engine.
    local = oc.chat.completions.create(model="default", messages=ask("red.png"), max_tokens=2)
    assert local.model == "idefics3" and local.usage.prompt_tokens == u.prompt_tokens
    text_only = oc.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert text_only.model != "idefics3" and text_only.usage.completion_tokens > 0


@pytest.mark.slow
def test_every_bad_image_or_field_is_a_400_naming_it(idefics_url, image_dir):
    url = data_url(png())
    cases = [
        (ask("http://127.0.0.1:9/cat.png"), "--allow-remote-images", "messages.0.content.1.image_url.url"),
        (ask("/etc/hostname"), "outside the allowed directory", "messages.0.content.1.image_url.url"),
        (ask("data:image/png;base64,QUJD"), "could not be decoded", "messages.0.content.1.image_url.url"),
        (ask("data:image/png;base64,%%%"), "not valid base64", "messages.0.content.1.image_url.url"),
        (ask("huge.png"), "the limit is 10,000", "messages.0.content.1.image_url.url"),
        (ask("notes.txt"), "could not be decoded", "messages.0.content.1.image_url.url"),
    ]
    for messages, why, param in cases:
        r = post(idefics_url, {"messages": messages})
        err = r.json()["error"]
        assert r.status_code == 400 and why in err["message"] and err["param"] == param, (why, r.text)
    for extra, field in [({"logprobs": True}, "logprobs"), ({"n": 2}, "n"), ({"regex": "a+"}, "regex"),
                         ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                         ({"frequency_penalty": 1.0}, "frequency_penalty")]:
        r = post(idefics_url, {"messages": ask(url), **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        assert "not supported with images" in r.json()["error"]["message"]
    r = post(idefics_url, {"messages": ask(url), "max_tokens": 10**6})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = post(idefics_url, {"messages": ask(url), "model": "gpt-4o"})
    assert r.status_code == 404 and "idefics3" in r.json()["error"]["message"]
    # Images only in user messages, and only on the chat route.
    r = post(idefics_url, {"messages": [{"role": "system", "content": [image_part(url)]}]})
    assert r.status_code == 400
    r = httpx.post(f"{idefics_url}/generate", json={"messages": ask(url)}, timeout=30)
    assert r.status_code == 400 and "/v1/chat/completions" in r.json()["error"]["message"]
    assert post(idefics_url, {"messages": ask(url), "max_tokens": 1}).status_code == 200  # it still serves


@pytest.mark.slow
def test_without_a_vlm_images_get_a_400_naming_the_flag(server_url):
    r = post(server_url, {"messages": ask(data_url(png()))})
    err = r.json()["error"]
    assert r.status_code == 400 and "--vlm-model" in err["message"] and err["code"] == "vlm_not_loaded"


@pytest.mark.slow
def test_qwen2_vl_with_remote_images_allowed(qwen_url, image_host):
    oc = client(qwen_url)
    chunks = list(oc.chat.completions.create(model="qwen2-vl", messages=ask(f"{image_host}/img/red.png"), max_tokens=4,
                                             stream=True,
                                             stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens > 0 and chunks[0].model == "qwen2-vl"
    r = post(qwen_url, {"messages": ask(f"{image_host}/img/missing.png")})
    assert r.status_code == 400 and "HTTP 404" in r.json()["error"]["message"]


@pytest.mark.slow
def test_concurrent_image_requests_take_turns_and_all_answer(idefics_url):
    import concurrent.futures

    def one(i: int) -> httpx.Response:
        return post(idefics_url, {"messages": ask(data_url(png(color=(i * 60, 0, 0)))), "max_tokens": 3,
                                  "stream": i % 2 == 1})

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(one, range(4)))
    assert [r.status_code for r in replies] == [200] * 4
    assert all(r.text.rstrip().endswith("data: [DONE]") for r in replies[1::2])


@pytest.mark.slow
def test_client_gone_stops_the_generation(idefics_url):
    body = {"messages": ask(data_url(png())), "stream": True, "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", f"{idefics_url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if '"content"' in line:
                break  # hang up after the first piece of the reply
    # The VLM takes one generation at a time: this one only runs once the abandoned one has stopped.
    r = post(idefics_url, {"messages": ask(data_url(png())), "max_tokens": 2})
    assert r.status_code == 200
    server = httpx.get(f"{idefics_url}/metrics", params={"format": "json"}, timeout=10).json()["server"]
    assert server["inflight"] == 0 and server["disconnects"] >= 1 and server["finished"].get("abort", 0) >= 1


@pytest.mark.slow
def test_a_reply_past_its_timeout_is_a_504_and_its_generation_stops(idefics_url):
    body = {"messages": ask(data_url(png())), "max_tokens": 1500, "ignore_eos": True, "timeout": 0.5}
    r = post(idefics_url, body)
    assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
    # The VLM takes one generation at a time: this one only runs once the timed-out one has stopped.
    assert post(idefics_url, {"messages": ask(data_url(png())), "max_tokens": 2}).status_code == 200
    server = httpx.get(f"{idefics_url}/metrics", params={"format": "json"}, timeout=10).json()["server"]
    assert server["inflight"] == 0


# --- the agent fronts: Messages, Responses, ollama --------------------------------------------------------
# Each translates onto the chat request, so an image the engine's model cannot take goes to the VLM beside it, as
# in chat completions: the same greedy reply, in each API's own shapes.

QUESTION = "What is in the picture?"


def chat_reply(url: str, image: bytes) -> tuple[str, int, str]:
    """Chat completions' greedy answer to QUESTION about `image`: (text, prompt tokens, finish reason)."""
    r = client(url).chat.completions.create(model="idefics3", messages=ask(data_url(image), QUESTION), max_tokens=6)
    assert r.choices[0].message.content  # a reply to compare with
    return r.choices[0].message.content, r.usage.prompt_tokens, r.choices[0].finish_reason


@pytest.mark.slow
def test_messages_with_an_image_block_answer_as_chat_completions_does(idefics_url):
    anthropic = pytest.importorskip("anthropic")
    text, prompt_tokens, finish = chat_reply(idefics_url, png())
    c = anthropic.Anthropic(base_url=idefics_url, api_key="none", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png()).decode()}}
    messages = [{"role": "user", "content": [{"type": "text", "text": QUESTION}, image]}]
    r = c.messages.create(model="default", max_tokens=6, messages=messages)
    assert r.model == "idefics3" and r.role == "assistant" and [b.type for b in r.content] == ["text"]
    assert r.content[0].text == text
    assert r.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[finish]
    assert r.usage.input_tokens == prompt_tokens and r.usage.cache_read_input_tokens == 0
    assert c.messages.count_tokens(model="idefics3", messages=messages).input_tokens == prompt_tokens

    events = list(c.messages.create(model="idefics3", max_tokens=6, messages=messages, stream=True))
    kinds = [e.type for e in events]  # (the SDK passes no ping on)
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"} and events[0].message.model == "idefics3"
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == text
    assert events[-2].delta.stop_reason == r.stop_reason and events[-2].usage.output_tokens == r.usage.output_tokens
    # What the VLM cannot do is refused by name, as in chat.
    with pytest.raises(anthropic.BadRequestError, match="tools: not supported with images"):
        c.messages.create(model="default", max_tokens=6, messages=messages, tools=[
            {"name": "f", "input_schema": {"type": "object"}}])


@pytest.mark.slow
def test_responses_with_an_input_image_answer_as_chat_completions_does(idefics_url):
    text, prompt_tokens, finish = chat_reply(idefics_url, png())
    oc = client(idefics_url)
    items = [{"role": "user", "content": [{"type": "input_text", "text": QUESTION},
                                          {"type": "input_image", "image_url": data_url(png())}]}]
    r = oc.responses.create(model="default", input=items, max_output_tokens=6)
    assert r.model == "idefics3" and [i.type for i in r.output] == ["message"] and r.output_text == text
    assert r.status == ("incomplete" if finish == "length" else "completed")
    assert r.usage.input_tokens == prompt_tokens and r.usage.input_tokens_details.cached_tokens == 0

    events = list(oc.responses.create(model="idefics3", input=items, max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if finish == "length" else "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text and events[-1].response.model == "idefics3"
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    # A stored reply carries the image turn on: the next turn asks the VLM again, about the same picture.
    follow = oc.responses.create(model="default", input="And its colour?", previous_response_id=r.id,
                                 max_output_tokens=2)
    assert follow.model == "idefics3" and follow.usage.input_tokens > prompt_tokens


@pytest.mark.slow
def test_ollama_images_answer_as_chat_completions_does(idefics_url):
    ollama = pytest.importorskip("ollama")
    text, prompt_tokens, finish = chat_reply(idefics_url, png())
    c = ollama.Client(host=idefics_url, timeout=60)
    messages = [{"role": "user", "content": QUESTION, "images": [png()]}]  # the client sends them base64
    r = c.chat(model="default", messages=messages, options={"num_predict": 6})
    assert r.model == "idefics3" and r.message.role == "assistant" and r.message.content == text
    assert r.done and r.done_reason == finish and r.prompt_eval_count == prompt_tokens and r.eval_count > 0

    parts = list(c.chat(model="idefics3", messages=messages, options={"num_predict": 6}, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True] and len(parts) > 1
    assert "".join(p.message.content for p in parts) == text and parts[-1].done_reason == finish
    generated = c.generate(model="idefics3", prompt=QUESTION, images=[png()], options={"num_predict": 6})
    assert generated.response == text and generated.prompt_eval_count == prompt_tokens
    assert "vision" in c.show("default").capabilities


@pytest.mark.slow
def test_without_a_vlm_every_front_refuses_images_with_a_400(server_url):
    import openai

    anthropic = pytest.importorskip("anthropic")
    ollama = pytest.importorskip("ollama")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png()).decode()}}
    with pytest.raises(anthropic.BadRequestError, match="--vlm-model") as messages:
        anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0).messages.create(
            model="default", max_tokens=4, messages=[{"role": "user", "content": [image]}])
    assert "takes text only" in messages.value.body["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="--vlm-model") as responses:
        client(server_url).responses.create(model="default", max_output_tokens=4, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": data_url(png())}]}])
    assert responses.value.code == "vlm_not_loaded"
    with pytest.raises(ollama.ResponseError, match="--vlm-model") as local:
        ollama.Client(host=server_url, timeout=60).chat(model="default", messages=[
            {"role": "user", "content": "What?", "images": [png()]}])
    assert local.value.status_code == 400


# --- the commands -------------------------------------------------------------------------------------


def test_chat_and_serve_with_a_missing_vlm_fail_in_one_line(tmp_path):
    for args in (["chat"], ["serve", "--port", "0"]):
        res = subprocess.run([sys.executable, "-m", "minisgl_cli.app", *args, "--vlm-model", str(tmp_path / "nope")],
                             input="", capture_output=True, text=True, timeout=120, cwd=REPO,
                             env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "MINISGL_HOME": str(tmp_path),
                                  "PYTHONPATH": str(REPO)})
        lines = [ln for ln in res.stderr.strip().splitlines() if "torchvision" not in ln]
        assert res.returncode == 1 and lines and lines[-1].startswith("error:") and "nope" in lines[-1], res.stderr
        assert "Traceback" not in res.stderr
