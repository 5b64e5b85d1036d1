"""The OpenAI API as clients call it, through a real server and the official `openai` client: logprobs,
structured outputs (`parse` with a pydantic model), tool calls, logit_bias; and what /generate adds."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"timezone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["timezone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "Current time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
WEATHER_Q = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_logprobs_shapes_greedy_top_and_stream(server_url):
    r = oai(server_url).chat.completions.create(model="default", messages=ASK, max_tokens=8, logprobs=True,
                                                top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    # The tokens spell the reply (then the end-of-turn token, which the text leaves out).
    assert "".join(t.token for t in content).startswith(r.choices[0].message.content)
    for t in content:  # greedy: the chosen token is the top entry, candidates in order
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == t.logprob <= 0
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
        assert bytes(t.bytes) == t.token.encode()
    chunks = list(oai(server_url).chat.completions.create(model="default", messages=ASK, max_tokens=8,
                                                          logprobs=True, top_logprobs=3, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Equal up to float noise: the second request reuses the first one's cached prefix, a different prefill.
    assert all(abs(a.logprob - b.logprob) < 1e-3 for a, b in zip(streamed, content))
    plain = oai(server_url).chat.completions.create(model="default", messages=ASK, max_tokens=8)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_logprob_is_what_the_sampler_drew_from(server_url, default_model_dir):
    """Through /generate (token ids come back): each logprob equals HF transformers' log-softmax on the same
    weights at that position, tempered by the request's temperature."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = [1, 504, 3575, 282, 4649, 314]  # "<|im_start|>The capital of France is"
    body = {"input_ids": ids, "max_new_tokens": 5, "stream": False, "ignore_eos": True, "return_logprob": True,
            "top_logprobs_num": 2, "temperature": 0.8, "seed": 5}
    lps = httpx.post(f"{server_url}/generate", json=body, timeout=60).json()["logprobs"]
    out = [t["token_id"] for t in lps]
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids + out])).logits[0, len(ids) - 1 : -1]
    want = (logits / 0.8).log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]
    assert torch.allclose(torch.tensor([t["logprob"] for t in lps]), want, atol=1e-3)
    assert all(len(t["top"]) == 2 for t in lps)


def test_completions_logprobs(server_url):
    r = oai(server_url).completions.create(model="default", prompt="1, 2, 3,", max_tokens=4, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(max(top.values()) == v and len(top) == 2 for top, v in zip(lp.top_logprobs, lp.token_logprobs))


class Person(BaseModel):
    name: str = Field(max_length=30)
    age: int = Field(ge=0, le=150)
    mood: Literal["happy", "sad"]


def test_parse_returns_a_valid_pydantic_object(server_url):
    r = oai(server_url).chat.completions.parse(
        model="default", messages=[{"role": "user", "content": "Invent a person."}], response_format=Person,
        max_tokens=64)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and r.choices[0].finish_reason == "stop"


def test_json_object_and_regex(server_url):
    r = oai(server_url).chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Describe Paris as JSON."}], max_tokens=80,
        response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the small model may not close its object within 80 tokens: what it wrote is still JSON's start
        assert r.choices[0].message.content.startswith("{")
    r = oai(server_url).chat.completions.create(model="default", messages=ASK, max_tokens=12,
                                                extra_body={"regex": "(Paris|London|Rome)\\."})
    assert r.choices[0].message.content in ("Paris.", "London.", "Rome.")


def test_named_tool_choice_arguments_follow_the_schema(server_url):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = oai(server_url).chat.completions.create(model="default", messages=WEATHER_Q, tools=TOOLS,
                                                tool_choice=choice, max_tokens=48)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # Streamed: the first delta names the call, the rest carry its arguments.
    chunks = list(oai(server_url).chat.completions.create(model="default", messages=WEATHER_Q, tools=TOOLS,
                                                          tool_choice=choice, max_tokens=48, stream=True))
    deltas = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert all(d.index == 0 for d in deltas) and len({d.id for d in deltas if d.id}) == 1
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == \
        ["tool_calls"]
    jsonschema.validate(json.loads("".join(d.function.arguments for d in deltas)), WEATHER)


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_calls_a_tool(server_url, stream):
    kw = dict(model="default", messages=WEATHER_Q, tools=TOOLS, tool_choice="required", max_tokens=64,
              parallel_tool_calls=False)
    if stream:
        chunks = list(oai(server_url).chat.completions.create(stream=True, **kw))
        calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or []]
        reason = next(ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason)
    else:
        c = oai(server_url).chat.completions.create(**kw).choices[0]
        calls, reason = c.message.tool_calls, c.finish_reason
    assert reason == "tool_calls" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMAS[calls[0].function.name])


def test_auto_tools_and_tool_results_round_trip(server_url):
    first = oai(server_url).chat.completions.create(model="default", messages=WEATHER_Q, tools=TOOLS,
                                                    max_tokens=12)
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The conversation goes on with an assistant tool call (as the SDK echoes it) and the tool's result.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    messages = [*WEATHER_Q, {"role": "assistant", "content": None, "tool_calls": [call], "refusal": None},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'}]
    r = oai(server_url).chat.completions.create(model="default", messages=messages, tools=TOOLS, max_tokens=12)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls


def test_logit_bias_steers_the_choice(server_url, default_model_dir):
    from minisgl_cli.tokenizer import Tokenizer

    r = oai(server_url).completions.create(model="default", prompt="Hello", max_tokens=3,
                                           logit_bias={"72": 100}, logprobs=0)
    assert r.choices[0].logprobs.tokens == [Tokenizer(default_model_dir).token_text(72)] * 3


def test_min_p_and_repetition_penalty_as_extra_fields(server_url):
    """sglang / vLLM's extra fields: min_p 1 keeps only the most likely token (a draw equals greedy); a strong
    repetition penalty steers a repetitive greedy continuation elsewhere (and /generate takes both)."""
    client = oai(server_url)
    kw = dict(model="default", prompt="one one one one one", max_tokens=12)
    greedy = client.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    top_only = client.completions.create(**kw, temperature=1.0, seed=3, extra_body={"min_p": 1.0, "ignore_eos": True})
    assert top_only.choices[0].text == greedy
    rep = client.completions.create(**kw, extra_body={"repetition_penalty": 2.0, "ignore_eos": True}).choices[0].text
    assert rep != greedy
    body = {"prompt": kw["prompt"], "max_new_tokens": 12, "ignore_eos": True, "stream": False,
            "temperature": 1.0, "min_p": 1.0, "repetition_penalty": 2.0}
    r = httpx.post(f"{server_url}/generate", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["text"] == rep


def test_generate_structured_and_logprobs_stream(server_url):
    body = {"messages": ASK, "max_new_tokens": 24, "json_schema": {"type": "object", "properties": {
        "city": {"type": "string", "enum": ["Paris", "Lyon"]}}, "required": ["city"], "additionalProperties": False},
        "return_logprob": True}
    lines = [json.loads(x) for x in httpx.post(f"{server_url}/generate", json=body, timeout=60).text.splitlines()]
    text = "".join(x.get("text_delta", "") for x in lines)
    assert json.loads(text) == {"city": "Paris"} or json.loads(text) == {"city": "Lyon"}
    assert sum(len(x.get("logprobs", [])) for x in lines) == lines[-1]["completion_tokens"]


def test_embeddings_say_what_to_use_instead(server_url):
    with pytest.raises(openai.BadRequestError) as exc:
        oai(server_url).embeddings.create(model="default", input="hello")
    assert "/v1/chat/completions" in str(exc.value) and exc.value.status_code == 400
