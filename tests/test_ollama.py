"""The ollama API as the `ollama` client library calls it, through a real server on the default model: chat,
generate, NDJSON streams, options, format through the grammar, the model routes, refusals; and the same greedy
answer through every front (chat completions, Messages, Responses, /api/chat)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

ollama = pytest.importorskip("ollama")
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


def client(url: str) -> ollama.Client:
    return ollama.Client(host=url, timeout=120)


def test_same_greedy_answer_through_every_front(server_url):
    import anthropic
    import openai

    oai = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none", max_retries=0)
    chat = oai.chat.completions.create(model="default", messages=ASK, max_tokens=24, temperature=0)
    responses = oai.responses.create(model="default", input=ASK[0]["content"], max_output_tokens=24, temperature=0)
    messages = anthropic.Anthropic(base_url=server_url, api_key="none", max_retries=0).messages.create(
        model="default", max_tokens=24, messages=ASK, extra_body=GREEDY)
    local = client(server_url).chat(model="default", messages=ASK, options={"num_predict": 24, **GREEDY})
    answer = chat.choices[0].message.content
    assert "Paris" in answer
    assert responses.output_text == messages.content[0].text == local.message.content == answer


def test_chat_and_its_stream(server_url):
    c = client(server_url)
    r = c.chat(model="default", messages=ASK, options={"num_predict": 24, **GREEDY}, keep_alive="5m")
    assert r.done and r.done_reason == "stop" and r.message.role == "assistant" and "Paris" in r.message.content
    assert r.prompt_eval_count > 0 and r.eval_count > 0 and r.total_duration > 0
    parts = list(c.chat(model="default:latest", messages=ASK, options={"num_predict": 24, **GREEDY}, stream=True))
    assert len(parts) > 2 and all(not x.done for x in parts[:-1]) and parts[-1].done
    assert "".join(x.message.content for x in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count and parts[-1].done_reason == "stop"


def test_generate_and_its_stream(server_url):
    c = client(server_url)
    r = c.generate(model="default", prompt="What is the capital of France?", system="Answer in one sentence.",
                   options={"num_predict": 24, **GREEDY})
    assert r.done and r.response and r.eval_count > 0
    parts = list(c.generate(model="default", prompt="What is the capital of France?",
                            system="Answer in one sentence.", options={"num_predict": 24, **GREEDY}, stream=True))
    assert "".join(x.response for x in parts) == r.response and parts[-1].done
    # The NDJSON itself: one JSON object per line.
    with httpx.stream("POST", f"{server_url}/api/generate", json={"model": "default", "prompt": "Hi",
                                                                  "options": {"num_predict": 4}}, timeout=60) as s:
        assert s.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in s.iter_lines() if line]
    assert lines[-1]["done"] is True and lines[-1]["eval_count"] == 4


def test_options_map_onto_sampling(server_url):
    c = client(server_url)
    cut = c.chat(model="default", messages=ASK, options={"num_predict": 3, **GREEDY})
    assert cut.done_reason == "length" and cut.eval_count == 3
    stopped = c.chat(model="default", messages=ASK, options={"num_predict": 24, "stop": ["Paris"], **GREEDY})
    assert "Paris" not in stopped.message.content and stopped.message.content.startswith("The capital")
    a = c.chat(model="default", messages=ASK, options={"num_predict": 12, "temperature": 0.9, "seed": 7,
                                                       "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1,
                                                       "num_ctx": 4096})
    b = c.chat(model="default", messages=ASK, options={"num_predict": 12, "temperature": 0.9, "seed": 7,
                                                       "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1})
    assert a.message.content == b.message.content  # seeded: the same draw


def test_format_json_and_schema(server_url):
    c = client(server_url)
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    r = c.chat(model="default", messages=ASK, format=schema, options={"num_predict": 40, **GREEDY})
    jsonschema.validate(json.loads(r.message.content), schema)
    r = c.generate(model="default", prompt="A JSON object about Paris:", format="json",
                   options={"num_predict": 40, **GREEDY})
    assert r.done_reason == "length" or isinstance(json.loads(r.response), dict)


def test_tool_result_round_trip(server_url):
    c = client(server_url)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    turns = [{"role": "user", "content": "What's the weather like in Paris today?"},
             {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                               "arguments": {"city": "Paris"}}}]},
             {"role": "tool", "tool_name": "get_weather", "content": "Sunny, 24 degrees celsius"}]
    r = c.chat(model="default", messages=turns, tools=tools, options={"num_predict": 30, **GREEDY})
    assert r.done and (r.message.content or r.message.tool_calls)
    shorter = c.chat(model="default", messages=turns[:1], tools=tools, options={"num_predict": 1, **GREEDY})
    assert r.prompt_eval_count > shorter.prompt_eval_count + 10  # the call and its result are in the prompt


def test_model_routes(server_url):
    c = client(server_url)
    [m] = c.list().models
    assert m.model and m.details.family == "llama"
    shown = c.show(m.model)
    assert "completion" in shown.capabilities and shown.details.family == "llama"
    [running] = c.ps().models
    assert running.model == m.model and running.context_length > 0
    assert httpx.get(f"{server_url}/api/version", timeout=10).json()["version"]


def test_refusals_as_the_client_raises_them(server_url):
    c = client(server_url)
    with pytest.raises(ollama.ResponseError) as embed:
        c.embed(model="default", input="hello")
    assert embed.value.status_code == 400 and "generative" in embed.value.error
    with pytest.raises(ollama.ResponseError) as missing:
        c.chat(model="llama3:8b", messages=ASK)
    assert missing.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as bad:
        c.chat(model="default", messages=ASK, options={"mirostat": 2})
    assert bad.value.status_code == 400 and "mirostat" in bad.value.error
    with pytest.raises(ollama.ResponseError) as think:
        c.chat(model="default", messages=ASK, think=True)
    assert think.value.status_code == 400 and "reasoning-parser" in think.value.error
    with pytest.raises(ollama.ResponseError) as pull:
        c.pull("llama3")
    assert pull.value.status_code in (404, 405)
