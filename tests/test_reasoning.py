"""The reasoning parsers on scripted model output: thoughts never leak into the content, whole or streamed, with the
markers cut at every place across deltas; and the choice stream / Anthropic blocks that carry them."""

from __future__ import annotations

import json

import pytest

from minisgl_cli.server.choices import ChoiceStream
from minisgl_cli.server.messages_route import BlockStream
from minisgl_cli.server.reasoning import ReasoningSplit, resolve_parser
from minisgl_cli.types import Delta

QWEN3 = "<think>\nThe user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4."
R1 = "The user asks for 2+2. That is 4.\n</think>\n\nThe answer is 4."  # R1's template opened <think> in the prompt
THOUGHT, ANSWER = "The user asks for 2+2. That is 4.", "The answer is 4."


def streamed(parser: str, pieces: list[str]) -> tuple[str, str]:
    """(thoughts, content) of a reply fed in `pieces`: each part only ever grows, so what went out stays true."""
    split = ReasoningSplit(parser)
    thoughts = content = ""
    for piece in pieces:
        r, c = split.feed(piece)
        thoughts, content = thoughts + r, content + c
        # No end marker reaches the content; a half one would stay in it (each part only grows), which the callers'
        # comparison of the final parts catches.
        assert "</think" not in content
    r, c = split.finish()
    return thoughts + r, content + c


def cuts(text: str) -> list[list[str]]:
    """The text in two pieces at every place, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize("parser,text", [("qwen3", QWEN3), ("deepseek-r1", R1), ("deepseek-r1", QWEN3)])
def test_thoughts_split_from_content_wherever_the_deltas_cut(parser, text):
    assert ReasoningSplit(parser).split(text) == (f"\n{THOUGHT}\n" if text.startswith("<") else f"{THOUGHT}\n",
                                                  ANSWER)
    whole = ReasoningSplit(parser).split(text)
    for pieces in cuts(text):
        thoughts, content = streamed(parser, pieces)
        assert (thoughts, content) == whole, pieces
        assert "think>" not in content and "think>" not in thoughts


def test_qwen3_without_thoughts_is_all_content():
    # enable_thinking false: the template closed the thoughts in the prompt; the reply has no markers.
    assert ReasoningSplit("qwen3").split("The answer is 4.") == (None, "The answer is 4.")
    for pieces in cuts("<b>bold</b> is not a thought"):
        assert streamed("qwen3", pieces) == ("", "<b>bold</b> is not a thought")


def test_thoughts_cut_short_stay_thoughts():
    text = "<think>Let me think about </th"
    assert ReasoningSplit("qwen3").split(text) == ("Let me think about </th", "")
    for pieces in cuts(text):
        assert streamed("qwen3", pieces) == ("Let me think about </th", "")


def test_auto_reads_the_family(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert resolve_parser("auto", str(tmp_path)) == "qwen3"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert resolve_parser("auto", str(tmp_path)) is None
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert resolve_parser("auto", str(tmp_path)) == "harmony"
    assert resolve_parser("deepseek-r1", None) == "deepseek-r1" and resolve_parser("none", str(tmp_path)) is None
    with pytest.raises(ValueError, match="reasoning-parser"):
        resolve_parser("mistral", None)


def test_chat_stream_sends_thoughts_as_reasoning_content():
    for pieces in cuts(QWEN3)[::7]:
        stream = ChoiceStream(None, set(), None, split=ReasoningSplit("qwen3"))
        out = [kw for i, p in enumerate(pieces)
               for kw in stream.feed(Delta("r", p, finish_reason="stop" if i == len(pieces) - 1 else None))]
        assert "".join(kw.get("reasoning_content", "") for kw in out).strip() == THOUGHT
        assert "".join(kw.get("content", "") for kw in out) == ANSWER
        assert out[-1] == {"finish_reason": "stop"}


def test_messages_stream_sends_a_thinking_block_then_text():
    stream = ChoiceStream(None, set(), None, split=ReasoningSplit("qwen3"))
    blocks = BlockStream()
    frames = [f for i, p in enumerate(QWEN3.split(" ")) for kw in stream.feed(
        Delta("r", p if i == 0 else " " + p, finish_reason="stop" if i == len(QWEN3.split(" ")) - 1 else None))
        for f in blocks.feed(kw)] + blocks.stop()
    events = [json.loads(f.split("data: ", 1)[1]) for f in frames]
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    thinking = "".join(e["delta"].get("thinking", "") for e in events if e["type"] == "content_block_delta")
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert thinking.strip() == THOUGHT and text == ANSWER
    assert [e["index"] for e in events if e["type"] == "content_block_stop"] == [0, 1]


def test_template_kwargs_reach_the_template(default_model_dir):
    from minisgl_cli.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir)
    # Qwen3's switch, in a template of its shape: without thinking, the thoughts are closed in the prompt.
    tok.hf.chat_template = ("{% for m in messages %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}"
                            "A:{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
                            "{% endif %}{% endif %}")
    chat = [{"role": "user", "content": "2+2?"}]
    on = tok.hf.decode(tok.apply_chat_template(chat, template_kwargs={"enable_thinking": True}))
    off = tok.hf.decode(tok.apply_chat_template(chat, template_kwargs={"enable_thinking": False}))
    assert on.endswith("A:") and off.endswith("A:<think>\n\n</think>\n\n")


# Through a real server: the default model's output is forced by a regex to hold thoughts (its tokens spell the
# markers in pieces, so they come across several deltas), and --reasoning-parser qwen3 takes them apart.
THINKING = r"<think>[a-z ]{3,20}</think>\n\n[A-Z][a-z]{2,10}\."


@pytest.fixture(scope="module")
def reasoning_url():
    from server_fixtures import _serve

    from minisgl_cli.server.app import ServerSettings

    yield from _serve(ServerSettings(reasoning_parser="qwen3"))


@pytest.mark.slow
def test_server_splits_thoughts_in_chat_and_messages(reasoning_url):
    import re

    import openai

    ask = [{"role": "user", "content": "Say hello."}]
    oai = openai.OpenAI(base_url=f"{reasoning_url}/v1", api_key="none", max_retries=0)
    r = oai.chat.completions.create(model="default", messages=ask, max_tokens=40, extra_body={"regex": THINKING})
    m = r.choices[0].message
    thoughts, content = m.reasoning_content, m.content
    assert thoughts and re.fullmatch(r"[a-z ]{3,20}", thoughts) and re.fullmatch(r"[A-Z][a-z]{2,10}\.", content)
    chunks = list(oai.chat.completions.create(model="default", messages=ask, max_tokens=40, stream=True,
                                              extra_body={"regex": THINKING}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed_thoughts = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    assert len([t for t in streamed_thoughts if t]) > 1  # thoughts came in several deltas
    assert "".join(streamed_thoughts) == thoughts and "".join(d.content or "" for d in deltas) == content


@pytest.fixture(scope="module")
def r1_url():
    from server_fixtures import _serve

    from minisgl_cli.server.app import ServerSettings

    yield from _serve(ServerSettings(reasoning_parser="deepseek-r1"))


@pytest.mark.slow
def test_messages_thinking_blocks(r1_url, server_url):
    """deepseek-r1's replies start inside the thoughts: the default model never closes them, so its whole greedy
    reply is a thinking block (thoughts never closed stay thoughts), streamed as thinking_delta."""
    import anthropic
    import httpx

    ask = [{"role": "user", "content": "What is the capital of France?"}]
    claude = anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0)
    plain = claude.messages.create(model="default", max_tokens=12, messages=ask, extra_body={"temperature": 0})
    r1 = anthropic.Anthropic(base_url=r1_url, api_key="none", max_retries=0)
    r = r1.messages.create(model="default", max_tokens=12, messages=ask, thinking={"type": "enabled",
                                                                                   "budget_tokens": 8})
    assert [b.type for b in r.content] == ["thinking"] and r.content[0].thinking == plain.content[0].text
    with r1.messages.stream(model="default", max_tokens=12, messages=ask,
                            thinking={"type": "enabled", "budget_tokens": 8}) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert set(kinds) == {"thinking_delta"} and len(kinds) > 1
    assert final.content[0].thinking == plain.content[0].text and final.stop_reason == plain.stop_reason
    # Without a parser, thinking cannot be turned on.
    body = {"model": "default", "max_tokens": 4, "messages": ask, "thinking": {"type": "enabled", "budget_tokens": 2}}
    bad = httpx.post(f"{server_url}/v1/messages", json=body, timeout=60)
    assert bad.status_code == 400 and "reasoning-parser" in bad.json()["error"]["message"]


@pytest.mark.slow
def test_responses_and_ollama_carry_the_thoughts(r1_url, server_url):
    """The same split through the other fronts: a `reasoning` output item (streamed as reasoning_text deltas) in
    Responses, `message.thinking` in ollama's chat."""
    import ollama
    import openai

    ask = "What is the capital of France?"
    plain = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0).responses.create(
        model="default", input=ask, max_output_tokens=12, temperature=0).output_text
    oai = openai.OpenAI(base_url=f"{r1_url}/v1", api_key="none", max_retries=0)
    r = oai.responses.create(model="default", input=ask, max_output_tokens=12, temperature=0,
                             reasoning={"effort": "low"})
    assert [i.type for i in r.output] == ["reasoning"] and r.output[0].content[0].text == plain
    events = list(oai.responses.create(model="default", input=ask, max_output_tokens=12, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds and "response.output_text.delta" not in kinds
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == plain
    local = ollama.Client(host=r1_url).chat(model="default", messages=[{"role": "user", "content": ask}],
                                            think=True, options={"num_predict": 12, "temperature": 0})
    assert local.message.thinking == plain and local.message.content == ""
