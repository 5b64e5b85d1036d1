"""The OpenAI Responses API as the official `openai` client calls it (`client.responses`), through a real server on
the default model: create, the streamed events in order, previous_response_id over the store, retrieve / delete,
function tools forced and auto with a tool-output round trip, text.format through the grammar, and refusals."""

from __future__ import annotations

import json

import jsonschema
import pytest

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

ASK = "What is the capital of France?"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
          "parameters": WEATHER}]


def oai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def test_create_answers_as_chat_completions_does(server_url):
    c = oai(server_url)
    r = c.responses.create(model="default", input=ASK, max_output_tokens=20, temperature=0)
    chat = c.chat.completions.create(model="default", messages=[{"role": "user", "content": ASK}], max_tokens=20,
                                     temperature=0)
    assert r.id.startswith("resp_") and r.status == "completed" and r.object == "response"
    assert r.output_text == chat.choices[0].message.content and "Paris" in r.output_text
    assert [i.type for i in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    again = c.responses.create(model="default", input=ASK, max_output_tokens=20, temperature=0)
    assert again.usage.input_tokens_details.cached_tokens > 0
    cut = c.responses.create(model="default", input=ASK, max_output_tokens=3, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_stream_events_in_order(server_url):
    c = oai(server_url)
    events = list(c.responses.create(model="default", input=ASK, max_output_tokens=20, temperature=0, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * deltas,
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(1, len(events) + 1))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert done.output_text == text and done.usage.output_tokens > 0 and done.id == events[0].response.id
    with c.responses.stream(model="default", input=ASK, max_output_tokens=20, temperature=0) as s:
        final = s.get_final_response()
    assert final.output_text == text


def test_previous_response_id_continues_the_conversation(server_url):
    c = oai(server_url)
    first = c.responses.create(model="default", input="My name is Ada.", max_output_tokens=12, temperature=0)
    second = c.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=12, temperature=0)
    # The same conversation sent whole gives the same prompt (all of it from the cache, but for the new turn).
    whole = c.responses.create(model="default", max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}])
    assert whole.usage.input_tokens == second.usage.input_tokens and whole.output_text == second.output_text
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 2
    assert c.responses.retrieve(second.id).output_text == second.output_text
    c.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="default", input="hi", previous_response_id=second.id, max_output_tokens=4)
    unstored = c.responses.create(model="default", input="hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)


@pytest.mark.parametrize("choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_forced_function_call_follows_the_schema(server_url, choice):
    c = oai(server_url)
    r = c.responses.create(model="default", input="What's the weather like in Paris today?", tools=TOOLS,
                           tool_choice=choice, parallel_tool_calls=False, max_output_tokens=80, temperature=0)
    calls = [i for i in r.output if i.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
    events = list(c.responses.create(model="default", input="What's the weather like in Paris today?", tools=TOOLS,
                                     tool_choice=choice, parallel_tool_calls=False, max_output_tokens=80,
                                     temperature=0, stream=True))
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == calls[0].arguments
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == done.arguments


def test_function_output_round_trip(server_url):
    c = oai(server_url)
    first = c.responses.create(model="default", input="What's the weather like in Paris today?", tools=TOOLS,
                               tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                               temperature=0)
    call = next(i for i in first.output if i.type == "function_call")
    r = c.responses.create(model="default", previous_response_id=first.id, tools=TOOLS, max_output_tokens=30,
                           temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                                                  "output": "Sunny, 24 degrees celsius"}])
    assert r.status in ("completed", "incomplete") and r.output
    # The call and its output reach the prompt: sent whole, the same prompt.
    whole = c.responses.create(model="default", tools=TOOLS, max_output_tokens=30, temperature=0, input=[
        {"role": "user", "content": "What's the weather like in Paris today?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 degrees celsius"}])
    assert whole.usage.input_tokens == r.usage.input_tokens and whole.output_text == r.output_text


def test_text_format_json_schema(server_url):
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 20}},
              "required": ["capital"], "additionalProperties": False}
    r = oai(server_url).responses.create(model="default", input=ASK, max_output_tokens=40, temperature=0,
                                         text={"format": {"type": "json_schema", "name": "answer",
                                                          "schema": schema}})
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_refusals(server_url):
    c = oai(server_url)
    with pytest.raises(openai.BadRequestError, match="web_search"):
        c.responses.create(model="default", input=ASK, tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="background"):
        c.responses.create(model="default", input=ASK, background=True)
    with pytest.raises(openai.BadRequestError, match="reasoning"):
        c.responses.create(model="default", input=ASK, reasoning={"effort": "high"})
    with pytest.raises(openai.NotFoundError):
        c.responses.create(model="gpt-nonexistent", input=ASK)


def test_reasoning_effort_is_the_templates_thinking_switch():
    """With a parser, `reasoning.effort` turns thinking off ("none", "minimal") or on (the rest) through the chat
    template's enable_thinking; an effort OpenAI does not name is a 400."""
    from minisgl_cli.api import responses as r
    from minisgl_cli.server.errors import InputError
    from minisgl_cli.server.responses_route import to_chat

    def kwargs(effort: str | None) -> dict | None:
        body = r.ResponsesRequest.model_validate({"model": "default", "input": ASK,
                                                  **({"reasoning": {"effort": effort}} if effort else {})})
        return to_chat(body, [{"role": "user", "content": ASK}], "qwen3").chat_template_kwargs

    # the effort itself goes along too: harmony's templates (gpt-oss) take it as it is
    assert kwargs("minimal") == {"reasoning_effort": "minimal", "enable_thinking": False}
    assert kwargs("none") == {"reasoning_effort": "none", "enable_thinking": False}
    assert kwargs("low") == {"reasoning_effort": "low", "enable_thinking": True}
    assert kwargs("high") == {"reasoning_effort": "high", "enable_thinking": True}
    assert kwargs(None) is None  # the template's default
    with pytest.raises(InputError, match="reasoning.effort"):
        kwargs("extreme")


def test_chat_completions_reasoning_effort_is_the_same_switch(server_url):
    """Chat completions' `reasoning_effort` maps as Responses' does (one place: the chat request); a server without a
    parser refuses it, an effort OpenAI does not name is a 400 too."""
    from minisgl_cli.api.protocol import ChatCompletionRequest

    def kwargs(effort: str, extra: dict | None = None) -> dict | None:
        return ChatCompletionRequest.model_validate({"model": "default", "messages": [{"role": "user", "content": ASK}],
                                                     "reasoning_effort": effort,
                                                     "chat_template_kwargs": extra}).chat_template_kwargs

    assert kwargs("minimal", {"x": 1}) == {"x": 1, "reasoning_effort": "minimal", "enable_thinking": False}
    assert kwargs("high") == {"reasoning_effort": "high", "enable_thinking": True}
    c = oai(server_url)
    with pytest.raises(openai.BadRequestError, match="reasoning-parser"):
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": ASK}], max_tokens=2,
                                  reasoning_effort="low")
    with pytest.raises(openai.BadRequestError, match="reasoning.effort"):
        c.chat.completions.create(model="default", messages=[{"role": "user", "content": ASK}], max_tokens=2,
                                  extra_body={"reasoning_effort": "extreme"})
