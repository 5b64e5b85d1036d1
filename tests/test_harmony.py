"""gpt-oss's harmony format: the prompt rendered from messages and tools, the reply's channels parsed back (analysis
-> reasoning_content, final -> content, commentary to=functions.NAME -> tool calls), whole and streamed, wherever the
deltas cut a marker; then through a real server with the official openai client.

No gpt-oss tokenizer is on these machines (nor the network to fetch one, which openai-harmony would need too): the
tokenizer here is the default model's with harmony's markers added as special tokens, and the served model a tiny
gpt-oss whose weights are set, not trained, so that its greedy reply is a given harmony text (`scripted_oss`)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import save_checkpoint

from minisgl_cli import harmony
from minisgl_cli.harmony import HarmonyParser, Parsed

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "The city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
        "days": {"type": "array", "items": {"type": "integer"}}}}}}]
ANSWER = ("<|channel|>analysis<|message|>Thinking hard<|end|><|start|>assistant<|channel|>final<|message|>Hello there"
          "<|return|>")
CALL = ("<|channel|>analysis<|message|>Thinking hard<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def _streamed(text: str, pieces: list[str]) -> Parsed:
    parser, out = HarmonyParser(), Parsed()
    for piece in pieces:
        got = parser.feed(piece)
        assert "<|" not in got.reasoning + got.content, "a marker leaked"
        out = out.add(got)
    return out.add(parser.finish())


@pytest.mark.parametrize("text,want", [
    (ANSWER, Parsed("Thinking hard", "Hello there")),
    (CALL, Parsed("Thinking hard", "", [("get_weather", '{"city": "Paris"}')])),
    # the recipient in the role (gpt-oss's template writes earlier calls so), a preamble to the user before the call
    ('<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.f<|channel|>commentary json'
     '<|message|>{}<|call|>', Parsed("", "Let me look.", [("f", "{}")])),
    ('{"city": "Paris"}', Parsed("", '{"city": "Paris"}')),  # no marker first: a grammar forced it, all content
    ("<|channel|>analysis<|message|>a<|start|>assistant<|channel|>final<|message|>b", Parsed("a", "b")),  # left open
    ("<|channel|>analysis<|message|>cut sh", Parsed("cut sh", "")),  # max_tokens: thoughts cut short stay thoughts
    ('<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": ', Parsed()),  # a call cut short: none
])
def test_reply_channels_parse_wherever_the_deltas_cut(text, want):
    assert HarmonyParser().parse(text) == want
    for i in range(len(text) + 1):
        assert _streamed(text, [text[:i], text[i:]]) == want
    assert _streamed(text, list(text)) == want


@pytest.mark.parametrize("choice,reply,want", [
    # a named call's header is the prompt's end: the reply is its arguments (a grammar forced them: no marker first)
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}',
     Parsed("", "", [("get_weather", '{"city": "Paris"}')])),
    ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}<|call|>',
     Parsed("", "", [("get_weather", '{"city": "Paris"}')])),
    # `required`: the commentary channel to some function, whose name the model writes on
    ("required", '.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
     Parsed("", "", [("get_weather", '{"city": "Paris"}')])),
])
def test_a_forced_call_is_the_prompts_end_and_the_replys_start(choice, reply, want):
    prompt = harmony.render([{"role": "user", "content": "Weather?"}], TOOLS, {"tool_choice": choice})
    prefill = harmony.forced_call(choice)
    assert prompt.endswith("<|start|>assistant" + prefill) and prefill.startswith("<|channel|>commentary to=functions")
    # what the model still writes of the header (the grammar holds it to that), the prefill's rest
    assert prefill + harmony.forced_header(choice, "get_weather") == \
        "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    # the header as a call is rendered in history, so the model continues the format it was trained on
    if isinstance(choice, dict):
        history = harmony.render([{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "get_weather", "arguments": "{}"}}]}], TOOLS, add_generation_prompt=False)
        assert history.endswith(f"<|start|>assistant{prefill}{{}}<|call|>")
    assert HarmonyParser(prefill).parse(reply) == want
    for i in range(len(reply) + 1):
        parser = HarmonyParser(prefill)
        assert parser.feed(reply[:i]).add(parser.feed(reply[i:])).add(parser.finish()) == want


def test_calls_are_kept_whatever_their_tool():
    """A call to a function the request did not offer is the model's reply all the same: it goes back as a call (the
    client decides, as with vLLM's gpt-oss parser), never dropped; arguments that are no JSON go back as written."""
    from minisgl_cli.server.tools import Call, harmony_calls

    found = [("get_weather", '{"city":"Paris"}'), ("browser.search", "not json")]
    assert harmony_calls(found, None) == [Call("get_weather", '{"city": "Paris"}'), Call("browser.search", "not json")]
    assert harmony_calls(found, False) == [Call("get_weather", '{"city": "Paris"}')]


def test_a_call_where_none_is_asked_for_stays_in_the_content():
    """tool_choice none (or no tools): a call the model makes anyway cannot be a tool call; its text is the content."""
    from minisgl_cli.server.choices import ChoiceStream
    from minisgl_cli.server.reasoning import HarmonySplit
    from minisgl_cli.types import Delta

    chunks = ChoiceStream(None, set(), None, split=HarmonySplit()).feed(Delta("r", CALL, finish_reason="stop"))
    assert chunks == [{"reasoning_content": "Thinking hard"}, {"content": CALL.split("<|start|>assistant")[1]},
                      {"finish_reason": "stop"}]


def test_prompt_renders_system_developer_tools_and_turns():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "thinking": "Need the tool.",
                 "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": '{"temp": 21}'}]
    text = harmony.render(messages, TOOLS, {"reasoning_effort": "xhigh"})
    head, rest = text.split("# Valid channels", 1)
    assert re.fullmatch(r"<\|start\|>system<\|message\|>You are ChatGPT, a large language model trained by OpenAI\.\n"
                        r"Knowledge cutoff: 2024-06\nCurrent date: \d{4}-\d\d-\d\d\n\nReasoning: high\n\n", head)
    assert rest == (
        ": analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n"
        "# Tools\n\n## functions\n\nnamespace functions {\n\n"
        "// Get the weather for a city\ntype get_weather = (_: {\n// The city's name\ncity: string,\n"
        'unit?: "celsius" | "fahrenheit", // default: celsius\ndays?: number[],\n}) => any;\n\n'
        "} // namespace functions<|end|>"
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
        "<|call|>"
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 21}<|end|>'
        "<|start|>assistant")
    # an answered turn drops its thoughts; no tools, no instructions: no developer message; thinking off is low
    text = harmony.render([{"role": "user", "content": "Hi"},
                           {"role": "assistant", "content": "Hello", "thinking": "greet"},
                           {"role": "user", "content": "Bye"}], None, {"enable_thinking": False})
    assert "Reasoning: low" in text and "developer" not in text and "greet" not in text
    assert text.endswith("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello<|end|>"
                         "<|start|>user<|message|>Bye<|end|><|start|>assistant")
    with pytest.raises(ValueError, match="no assistant tool call"):
        harmony.render([{"role": "tool", "content": "x"}])


# --- a real server -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory, tokenizer_dir):
    return scripted_oss(tmp_path_factory.mktemp("harmony"), tokenizer_dir)


def scripted_oss(out, tokenizer_dir):
    """A one-layer gpt-oss (its tokenizer the default model's plus harmony's markers) whose greedy reply to a harmony
    prompt is ANSWER, or CALL where the prompt offers tools.

    Its hidden state holds the current token (one-hot, the first half) and the mean of every token so far (the
    second half: the attention's queries are zero, so it averages its values, a copy of the first half; the sinks are
    off; the experts give zero). The LM head scores a token by the current one (ALPHA) and, where the text so far
    repeats a token with another successor, by what the context holds: `final` follows the second `<|channel|>` once
    `analysis` has been said, `commentary` where the prompt also says `functions` (the tools' line)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": list(harmony.MARKERS)})
    ids = {t: tok.encode(t, add_special_tokens=False) for t in ("analysis", "final", "functions", "json")}
    assert all(len(v) == 1 for v in ids.values())
    chains = [tok.encode("<|start|>assistant" + reply, add_special_tokens=False) for reply in (ANSWER, CALL)]
    known = sorted({t for c in chains for t in c} | {v[0] for v in ids.values()})
    slot = {t: i for i, t in enumerate(known)}
    k, hidden = len(known), 128
    assert 2 * k <= hidden
    vocab = (len(tok) + 63) // 64 * 64
    cfg = transformers.GptOssConfig(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, layer_types=["full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=32, num_local_experts=2,
        num_experts_per_tok=1, max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=[tok.convert_tokens_to_ids(harmony.RETURN), tok.convert_tokens_to_ids(harmony.CALL)],
        bos_token_id=None, pad_token_id=0)
    model = transformers.GptOssForCausalLM(cfg).eval()
    sd = {name: torch.zeros_like(t) for name, t in model.state_dict().items()}
    for t, i in slot.items():
        sd["model.embed_tokens.weight"][t, i] = 1.0
    for name in ("model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
                 "model.norm.weight"):
        sd[name].fill_(1.0)
    sd["model.layers.0.self_attn.sinks"].fill_(-1e4)
    sd["model.layers.0.self_attn.v_proj.weight"][:64, :64] = torch.eye(64)
    o = sd["model.layers.0.self_attn.o_proj.weight"]  # heads 0 and 2 read KV heads 0 and 1: the first 64 dims
    o[64:96, 0:32] = torch.eye(32)
    o[96:128, 64:96] = torch.eye(32)
    head = sd["lm_head.weight"]
    ALPHA, PREFER, CONTEXT = 10.0, 0.5, 50.0

    def cur(t):
        return slot[t]

    def seen(t):
        return 64 + slot[ids[t][0]]

    for chain in chains:
        for c, n in zip(chain[:-1], chain[1:]):
            head[n, cur(c)] = ALPHA
    channel, message = (tok.convert_tokens_to_ids(m) for m in (harmony.CHANNEL, harmony.MESSAGE))
    after = {name: ids[name][0] for name in ("analysis", "final")}
    comment = tok.encode("commentary", add_special_tokens=False)[0]
    head[after["analysis"], cur(channel)] += PREFER  # the first <|channel|>: analysis ...
    head[after["analysis"], seen("functions")] = CONTEXT  # (... with tools too)
    head[after["final"], cur(channel)] += PREFER / 2  # the second: final once analysis was said ...
    head[after["final"], seen("analysis")] = CONTEXT
    head[comment, seen("analysis")] = head[comment, seen("functions")] = CONTEXT  # ... commentary with tools
    thinking, hello, brace = (tok.encode(s, add_special_tokens=False)[0] for s in ("Thinking", "Hello", '{"city'))
    head[thinking, cur(message)] += PREFER  # after <|message|>: the thoughts first, the answer after `final`,
    head[hello, seen("final")] = CONTEXT  # the arguments after `json`
    head[brace, seen("json")] = CONTEXT
    model.load_state_dict(sd)
    save_checkpoint(model, out, tokenizer_dir)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server_url(oss_dir):
    """A real uvicorn server on the scripted gpt-oss (its engine in this process: no child start-up to pay for),
    `--reasoning-parser auto`, which picks harmony for it."""
    from commands.common import EngineOptions
    from minisgl_cli.api.http_server import BackgroundServer
    from minisgl_cli.server.app import ServerSettings, create_app

    client = EngineOptions.from_params(dict(model=str(oss_dir), dtype="float32", quantization="none",
                                            max_total_tokens=2048), processes=False).client()
    try:
        with BackgroundServer(create_app(client, ServerSettings(reasoning_parser="auto"))) as url:
            yield url
    finally:
        client.close()


def test_chat_completions_split_harmony_channels_whole_and_streamed(server_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="x")
    chat = [{"role": "user", "content": "Hi"}]
    r = client.chat.completions.create(model="default", messages=chat, max_tokens=40, reasoning_effort="low")
    m = r.choices[0].message
    assert (m.reasoning_content, m.content, m.tool_calls, r.choices[0].finish_reason) == \
        ("Thinking hard", "Hello there", None, "stop")
    thoughts = content = ""
    for chunk in client.chat.completions.create(model="default", messages=chat, max_tokens=40, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        thoughts += getattr(delta, "reasoning_content", None) or ""
        content += (delta.content or "") if delta else ""
    assert (thoughts, content) == ("Thinking hard", "Hello there")


def test_tool_calls_come_from_the_commentary_channel_whole_and_streamed(server_url):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="x")
    chat = [{"role": "user", "content": "Weather in Paris?"}]
    r = client.chat.completions.create(model="default", messages=chat, tools=TOOLS, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Thinking hard"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    assert not choice.message.content
    calls, reasons = [], []
    for chunk in client.chat.completions.create(model="default", messages=chat, tools=TOOLS, max_tokens=60,
                                                stream=True):
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            reasons.append(chunk.choices[0].finish_reason)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert reasons[-1] == "tool_calls"
    # the Responses front reads the same parser: a reasoning item, then the function call
    out = client.responses.create(model="default", input="Weather in Paris?", max_output_tokens=60,
                                  tools=[{"type": "function", **TOOLS[0]["function"]}]).output
    assert [item.type for item in out] == ["reasoning", "function_call"]
    assert out[1].name == "get_weather" and json.loads(out[1].arguments) == {"city": "Paris"}
    # and Anthropic's Messages: a thinking block, then the tool_use
    import anthropic

    msg = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0).messages.create(
        model="default", max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "input", None)) for b in msg.content] == \
        [("thinking", "Thinking hard"), ("tool_use", {"city": "Paris"})]
    assert msg.stop_reason == "tool_use"


def _calls(client, stream: bool, **kw) -> tuple[list[tuple[str, dict]], str | None, str | None]:
    """(calls as (name, arguments), content, finish_reason) of one chat, streamed or not."""
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       max_tokens=60, stream=stream, **kw)
    if not stream:
        m = r.choices[0].message
        return ([(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []], m.content,
                r.choices[0].finish_reason)
    calls, content, reason = [], "", None
    for chunk in r:
        if chunk.choices:
            calls += chunk.choices[0].delta.tool_calls or []
            content += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls], content or None, reason


@pytest.mark.parametrize("stream", [False, True])
def test_calls_to_tools_not_offered_and_forced_calls(server_url, stream):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server_url}/v1", api_key="x")
    paris = [("get_weather", {"city": "Paris"})]
    # the model calls get_weather, which this request does not offer: the call comes back all the same
    other = [{"type": "function", "function": {**TOOLS[0]["function"], "name": "get_forecast"}}]
    assert _calls(client, stream, tools=other) == (paris, None, "tool_calls")
    # tool_choice named / required: the prompt ends in the call's header, the reply (no thoughts) is its arguments
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert _calls(client, stream, tools=TOOLS, tool_choice=named) == (paris, None, "tool_calls")
    assert _calls(client, stream, tools=TOOLS + other, tool_choice="required") == (paris, None, "tool_calls")


# Two tools the scripted model never calls (it writes get_weather's call whatever it is offered), of other schemas
UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "required": ["unit"], "additionalProperties": False,
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}}}}}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": {
    "type": "object", "required": ["on"], "additionalProperties": False,
    "properties": {"on": {"type": "boolean"}, "label": {"enum": ["wake", "nap"]}}}}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_alarm"}}])
def test_forced_calls_hold_to_the_offered_tools_and_their_schemas(server_url, stream, choice):
    """A forced choice is enforced, not only prompted: left to itself after the prompt's end the model calls
    get_weather with {"city": "Paris"}; the grammar holds the name to one of the offered tools (`required`), the
    arguments to that tool's schema, and the end to `<|call|>` (this tokenizer's <|im_end|> is a stop token too,
    which ends no harmony message: the call would be lost)."""
    import jsonschema
    from openai import OpenAI

    tools = [UNIT, ALARM]
    calls, content, reason = _calls(OpenAI(base_url=f"{server_url}/v1", api_key="x"), stream, tools=tools,
                                    tool_choice=choice)
    assert (len(calls), content, reason) == (1, None, "tool_calls"), calls
    name, args = calls[0]
    assert name == (choice["function"]["name"] if isinstance(choice, dict) else name) and name in ("set_unit",
                                                                                                  "set_alarm")
    jsonschema.validate(args, next(t for t in tools if t["function"]["name"] == name)["function"]["parameters"])


def test_forced_calls_through_responses_and_messages(server_url):
    """The Responses API's named function and Anthropic's `any` map onto the same forced calls."""
    import anthropic
    from openai import OpenAI

    out = OpenAI(base_url=f"{server_url}/v1", api_key="x").responses.create(
        model="default", input="Weather in Paris?", max_output_tokens=60,
        tools=[{"type": "function", **TOOLS[0]["function"]}], tool_choice={"type": "function", "name": "get_weather"})
    assert [(i.type, i.name, json.loads(i.arguments)) for i in out.output] == \
        [("function_call", "get_weather", {"city": "Paris"})]
    msg = anthropic.Anthropic(base_url=server_url, api_key="x", max_retries=0).messages.create(
        model="default", max_tokens=60, messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}],
        tool_choice={"type": "any"})
    assert [(b.type, b.name, b.input) for b in msg.content] == [("tool_use", "get_weather", {"city": "Paris"})]
    assert msg.stop_reason == "tool_use"
