"""The Anthropic Messages API as Anthropic's own SDK calls it, through a real server on the default model: create,
the streamed event order, stop sequences, max_tokens, tools forced and auto with a tool-result round trip,
count_tokens, the prefix cache in usage, and errors as the SDK raises them."""

from __future__ import annotations

import json

import httpx
import pytest
from server_fixtures import API_KEY

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}  # the SDK takes sampling fields through extra_body
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": WEATHER}]
WEATHER_Q = [{"role": "user", "content": "What's the weather like in Paris today?"}]


def claude(url: str, key: str = "none") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def events(url: str, body: dict) -> list[tuple[str, dict]]:
    """A streamed /v1/messages as (event name, data) pairs, read off the wire."""
    out, name = [], None
    with httpx.stream("POST", f"{url}/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name
                out.append((name, data))
    return out


def test_create_answers_as_chat_completions_does(server_url):
    r = claude(server_url).messages.create(model="default", max_tokens=20, messages=ASK, extra_body=GREEDY)
    chat = openai.OpenAI(base_url=f"{server_url}/v1", api_key="none").chat.completions.create(
        model="default", messages=ASK, max_tokens=20, temperature=0)
    assert r.id.startswith("msg_") and r.role == "assistant" and r.type == "message"
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == chat.choices[0].message.content and "Paris" in r.content[0].text
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    u = r.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens


def test_stream_events_in_anthropic_order(server_url):
    body = {"model": "default", "max_tokens": 20, "messages": ASK, **GREEDY}
    seen = events(server_url, body)
    names = [n for n, _ in seen]
    deltas = names.count("content_block_delta")
    assert deltas >= 2
    assert names == ["message_start", "ping", "content_block_start", *["content_block_delta"] * deltas,
                     "content_block_stop", "message_delta", "message_stop"]
    start = seen[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["input_tokens"] > 0
    assert seen[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(d["delta"]["text"] for n, d in seen if n == "content_block_delta")
    assert all(d["delta"]["type"] == "text_delta" for n, d in seen if n == "content_block_delta")
    end = seen[-2][1]
    assert end["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    whole = claude(server_url).messages.create(model="default", max_tokens=20, messages=ASK, extra_body=GREEDY)
    assert text == whole.content[0].text
    assert end["usage"]["output_tokens"] == whole.usage.output_tokens
    # The SDK's own accumulator builds the same message from the stream.
    with claude(server_url).messages.stream(model="default", max_tokens=20, messages=ASK, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == text and final.stop_reason == "end_turn"


def test_stop_sequence_names_the_one_that_matched(server_url):
    c = claude(server_url)
    r = c.messages.create(model="default", max_tokens=20, messages=ASK, stop_sequences=["Lyon", "Paris"],
                          extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == "Paris"
    assert "Paris" not in r.content[0].text and r.content[0].text.startswith("The capital")
    end = events(server_url, {"model": "default", "max_tokens": 20, "messages": ASK, "stop_sequences": ["Paris"],
                              **GREEDY})[-2][1]
    assert end["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "Paris"}


def test_max_tokens_ends_with_max_tokens(server_url):
    r = claude(server_url).messages.create(model="default", max_tokens=3, messages=ASK, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_system_string_and_blocks_and_turns(server_url):
    c = claude(server_url)
    turns = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": "Hello Ada!"},
             {"role": "user", "content": [{"type": "text", "text": "What is my name?"}]}]
    as_text = c.messages.create(model="default", max_tokens=12, system="You are terse.", messages=turns,
                                extra_body=GREEDY)
    as_blocks = c.messages.create(model="default", max_tokens=12, messages=turns, extra_body=GREEDY,
                                  system=[{"type": "text", "text": "You are terse.",
                                           "cache_control": {"type": "ephemeral"}}])
    assert as_text.content == as_blocks.content and as_text.content[0].text
    short = c.messages.count_tokens(model="default", messages=turns, system="You are terse.")
    longer = c.messages.count_tokens(model="default", messages=turns, system="You are terse. Answer in one word.")
    assert longer.input_tokens > short.input_tokens


def test_count_tokens_is_the_prompt_create_runs(server_url):
    c = claude(server_url)
    n = c.messages.count_tokens(model="default", messages=WEATHER_Q, tools=TOOLS).input_tokens
    r = c.messages.create(model="default", max_tokens=2, messages=WEATHER_Q, tools=TOOLS, extra_body=GREEDY)
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens
    again = c.messages.create(model="default", max_tokens=2, messages=WEATHER_Q, tools=TOOLS, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens > 0  # the radix cache's hit
    assert c.messages.count_tokens(model="default", messages=WEATHER_Q).input_tokens < n  # the tools are in it


ANY = {"type": "any", "disable_parallel_tool_use": True}  # one call: greedy output would go on calling


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, ANY])
def test_forced_tool_use_follows_the_schema(server_url, choice):
    import jsonschema

    c = claude(server_url)
    r = c.messages.create(model="default", max_tokens=60, messages=WEATHER_Q, tools=TOOLS, tool_choice=choice,
                          extra_body=GREEDY)
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER)
    with c.messages.stream(model="default", max_tokens=60, messages=WEATHER_Q, tools=TOOLS, tool_choice=choice,
                           extra_body=GREEDY) as s:
        final = s.get_final_message()
    streamed = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and [b.input for b in streamed] == [b.input for b in uses]


def test_forced_tool_streams_input_json_deltas(server_url):
    seen = events(server_url, {"model": "default", "max_tokens": 60, "messages": WEATHER_Q, "tools": TOOLS,
                               "tool_choice": {"type": "tool", "name": "get_weather"}, **GREEDY})
    block = seen[2][1]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather" and block["input"] == {}
    parts = [d["delta"]["partial_json"] for n, d in seen if n == "content_block_delta"]
    assert len(parts) > 1 and all(d["delta"]["type"] == "input_json_delta" for n, d in seen
                                  if n == "content_block_delta")
    assert json.loads("".join(parts))["city"]
    assert seen[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_tool_result_round_trip(server_url):
    c = claude(server_url)
    first = c.messages.create(model="default", max_tokens=60, messages=WEATHER_Q, tools=TOOLS,
                              tool_choice=ANY, extra_body=GREEDY)
    use = next(b for b in first.content if b.type == "tool_use")
    turns = [*WEATHER_Q, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                           "content": "Sunny, 24 degrees celsius"}]}]
    # The result reaches the prompt (and the earlier call with it), and the model answers in text under auto.
    without = c.messages.count_tokens(model="default", messages=WEATHER_Q, tools=TOOLS).input_tokens
    assert c.messages.count_tokens(model="default", messages=turns, tools=TOOLS).input_tokens > without + 8
    r = c.messages.create(model="default", max_tokens=30, messages=turns, tools=TOOLS,
                          tool_choice={"type": "auto"}, extra_body=GREEDY)
    assert r.content and r.stop_reason in ("end_turn", "tool_use", "max_tokens")
    none = c.messages.create(model="default", max_tokens=30, messages=turns, tools=TOOLS,
                             tool_choice={"type": "none"}, extra_body=GREEDY)
    assert [b.type for b in none.content] == ["text"] and none.stop_reason in ("end_turn", "max_tokens")


def test_errors_as_the_sdk_raises_them(server_url):
    c = claude(server_url)
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model="default", max_tokens=10, messages=ASK, extra_body={"temperature": 1.5})
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        c.messages.create(model="claude-nonexistent", max_tokens=10, messages=ASK)
    assert missing.value.body["error"]["type"] == "not_found_error"
    r = httpx.post(f"{server_url}/v1/messages", json={"model": "default", "messages": ASK}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError, match="takes text only"):
        c.messages.create(model="default", max_tokens=10, messages=[{"role": "user", "content": [
            image, {"type": "text", "text": "What is this?"}]}])
    with pytest.raises(anthropic.BadRequestError, match="mcp_servers"):
        c.messages.create(model="default", max_tokens=10, messages=ASK,
                          extra_body={"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]})
    with pytest.raises(anthropic.BadRequestError, match="tool_choice"):
        c.messages.create(model="default", max_tokens=10, messages=ASK, tool_choice={"type": "any"})


def test_api_key_as_x_api_key_or_bearer(auth_url):
    body = {"model": "default", "max_tokens": 4, "messages": ASK}
    assert httpx.post(f"{auth_url}/v1/messages", json=body, headers={"x-api-key": API_KEY},
                      timeout=60).status_code == 200
    wrong = httpx.post(f"{auth_url}/v1/messages", json=body, headers={"x-api-key": "nope"}, timeout=60)
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert claude(auth_url, API_KEY).messages.create(**body).content  # the SDK sends its key as a Bearer token
    with pytest.raises(anthropic.AuthenticationError):
        claude(auth_url, "wrong").messages.create(**body)
