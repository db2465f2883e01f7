"""Tool calls in the chat server (chapter 26, "Tool calls"), with the official openai
client on the tiny model: tool_choice "required" and a named function are enforced by
chapter 24's structured output, so every call parses and its arguments validate
against the function's parameters schema; the OpenAI shape (ids, type, arguments as
JSON text, finish_reason as vLLM sets it); "auto" and bad tools are 400s naming the
field, and the server serves on."""

import json

import jsonschema
import openai
import pytest
import torch
from helpers import MODEL, openai_client, live_server

from minillm.protocol import ChatCompletionRequest


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["C", "F"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": WEATHER,
        },
    },
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
    {"type": "function", "function": {"name": "now"}},  # no arguments
]
PARAMETERS = {"get_weather": WEATHER, "add": ADD, "now": {"type": "object"}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALLS = {"get_weather": {"city": "Paris", "unit": "C"}, "add": {"a": 1, "b": 2.5},
         "now": {}}  # fmt: skip


@pytest.fixture(scope="module")
def client(live):
    return openai_client(live, timeout=60)


def chat(client, **kwargs):
    kwargs = {"model": MODEL, "messages": MESSAGES, "max_tokens": 60, **kwargs}
    return client.chat.completions.create(**kwargs)


def check_calls(message, names=None):
    """Each call has the OpenAI shape and arguments its function's schema accepts."""
    assert message.role == "assistant" and not message.content
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        assert names is None or call.function.name in names
        assert isinstance(call.function.arguments, str)
        jsonschema.validate(
            json.loads(call.function.arguments), PARAMETERS[call.function.name]
        )
    ids = [c.id for c in message.tool_calls]
    assert len(set(ids)) == len(ids)


def test_named_function(client):
    reply = chat(client, tools=TOOLS, tool_choice=NAMED, n=3, temperature=1.0, seed=0)
    assert len(reply.choices) == 3
    for c in reply.choices:
        check_calls(c.message, {"get_weather"})
        assert len(c.message.tool_calls) == 1
        # the tiny model pads JSON with whitespace until chapter 24's budget closes
        # it at max_tokens: "length"; "stop" when it ends the call itself (below)
        assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("parallel", [True, False])
def test_required(client, parallel):
    reply = chat(
        client,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        n=4,
        temperature=1.0,
        seed=1,
        max_tokens=90,
    )
    for c in reply.choices:
        check_calls(c.message, set(PARAMETERS))
        assert parallel or len(c.message.tool_calls) == 1
        assert c.finish_reason in ("tool_calls", "length")
    # which tool the tiny model samples is its own business; what the constraint
    # guarantees is that every tool may be called, and nothing else
    request = ChatCompletionRequest(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=parallel,
    )  # fmt: skip
    schema = request.tool_call_schema()
    for name, arguments in CALLS.items():
        jsonschema.validate([{"name": name, "parameters": arguments}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "other", "parameters": {}}], schema)


@pytest.mark.parametrize(
    "choice, stop, reason",
    [(NAMED, "}", "stop"), ("required", "}]", "tool_calls")],
)
def test_finish_reason_as_vllm_sets_it(client, choice, stop, reason):
    """A call that ends before max_tokens (here at a stop string kept in the output):
    "tool_calls" for "required", "stop" for a named function (vLLM's
    vllm/entrypoints/openai/chat_completion/serving.py, as OpenAI); one cut at
    max_tokens: "length"."""
    kwargs = dict(tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=90)
    ended = chat(client, stop=[stop], extra_body={"include_stop_str_in_output": True},
                 **kwargs).choices[0]  # fmt: skip
    check_calls(ended.message)
    assert ended.finish_reason == reason
    assert chat(client, **kwargs).choices[0].finish_reason == "length"


def test_answer_maps_the_engine_finish_reason():
    from minillm.serving_chat import ForcedToolCall, answer

    required = ForcedToolCall(None, None)
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2.5}}]'
    assert answer(text, "stop", required)["finish_reason"] == "tool_calls"
    assert answer(text, "length", required)["finish_reason"] == "length"
    message = answer(text, "stop", required)["message"]
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls] == [("add", {"a": 1, "b": 2.5})]  # fmt: skip
    named = ForcedToolCall(None, "add")
    assert answer('{"a": 1}', "stop", named)["finish_reason"] == "stop"
    # not a whole call (cut short): the text comes back as content
    cut = answer('[{"name": "add", "param', "length", required)
    assert cut["message"].content == '[{"name": "add", "param'
    assert cut["message"].tool_calls == [] and cut["finish_reason"] == "length"
    assert answer("hi", "stop", None)["message"].content == "hi"


def test_greedy_named_call_matches_the_plain_schema_constraint(client):
    """The reference: the same schema as a response_format gives the same text."""
    kwargs = dict(temperature=0, max_tokens=40)
    call = chat(client, tools=TOOLS, tool_choice=NAMED, **kwargs).choices[0]
    plain = chat(
        client,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER},
        },
        **kwargs,
    ).choices[0]
    # the tools are passed to the chat template; the tiny model's ignores them
    assert call.message.tool_calls[0].function.arguments == plain.message.content


@pytest.mark.parametrize("choice", [NAMED, "required"])
def test_stream_sends_the_calls_of_the_non_streamed_reply(client, choice):
    kwargs = dict(tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60)
    full = chat(client, **kwargs).choices[0]
    calls, reasons, content, pieces = {}, [], "", 0
    for chunk in chat(client, stream=True, **kwargs):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:  # joined by index, as clients do
                pieces += 1
                call = calls.setdefault(tc.index, {"arguments": ""})
                assert (tc.id is None) == ("id" in call)  # id, type, name: once
                if tc.id is not None:
                    call.update(id=tc.id, type=tc.type, name=tc.function.name)
                call["arguments"] += tc.function.arguments or ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    assert reasons == [full.finish_reason] and not content
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.message.tool_calls
    ]
    assert all(
        c["id"].startswith("chatcmpl-tool-") and c["type"] == "function"
        for c in calls.values()
    )
    # a named call's arguments stream as they are generated; "required"'s go whole
    assert pieces > 1 if choice is NAMED else pieces == len(calls)


def test_none_and_no_tools_answer_as_text(client):
    plain = chat(client, temperature=0, max_tokens=12)
    none = chat(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=12)
    for reply in (plain, none):
        c = reply.choices[0]
        assert c.message.tool_calls in (None, [])
        assert c.finish_reason in ("stop", "length")
    assert none.choices[0].message.content == plain.choices[0].message.content


def bad_request(client, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, **kwargs)
    assert e.value.status_code == 400
    return e.value.response.json()["error"]


def test_auto_is_a_400_that_explains(client):
    for kwargs in [dict(tool_choice="auto"), {}]:  # no tool_choice: "auto"
        err = bad_request(client, tools=TOOLS, **kwargs)
        assert err["param"] == "tool_choice" and err["type"] == "BadRequestError"
        for words in ['"auto"', MODEL, '"required"', "named function"]:
            assert words in err["message"], err["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {"parameters": ADD}}]},
         "tools.0.function.name"),
        ({"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "array"}}}]},
         "tools.0.function.parameters"),
        ({"tools": TOOLS + [TOOLS[1]]}, "tools.3"),
        ({"tools": []}, "tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice.function"),
        ({"tools": None}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"x": {"type": "integer",
                                                  "multipleOf": 3}}}}}]},
         "tools"),
        ({"response_format": {"type": "json_object"}}, "tool_choice"),
        ({"stream": True, "logprobs": True}, "logprobs"),
    ],
)  # fmt: skip
def test_bad_tools_are_400s_naming_the_field(client, live, body, param):
    body = {"tools": TOOLS, "tool_choice": "required", **body}
    if body["tools"] is None:
        del body["tools"]
    kwargs = {k: body.pop(k) for k in ("tools", "tool_choice", "stream") if k in body}
    err = bad_request(client, extra_body=body, **kwargs)
    assert err["param"] == param, err
    assert not live.engine.output_processor.request_states  # nothing reached the engine
    ok = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=40)
    check_calls(ok.choices[0].message)  # and the server serves on


def test_tools_reach_the_chat_template(live, tiny):
    """The template sees the tools and a conversation's earlier calls and results."""
    from minillm.protocol import ChatMessage
    from minillm.serving import OpenAIServing

    template = (
        "{% for t in tools or [] %}[{{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<{{ c.function.name }}>{% endfor %}"
        "{% if m.tool_call_id %}#{{ m.tool_call_id }}{% endif %}|{% endfor %}"
    )
    serving = OpenAIServing(live.engine, MODEL, chat_template=template)
    call = {"id": "c1", "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
    messages = [
        ChatMessage(role="user", content="1+2?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="3", tool_call_id="c1"),
    ]
    ids = serving.render_chat(messages, tools=TOOLS)
    text = tiny[1].decode(ids)
    assert text == "[get_weather][add][now]user:1+2?|assistant:<add>|tool:3#c1|"


@pytest.fixture(scope="module")
def live_process():
    """The engine in a process of its own: the constraint travels pickled."""
    from test_engine_core import FLAGS, start

    from minillm.server import build_engine, parse_args

    engine = start(build_engine, parse_args(FLAGS))
    with live_server(engine) as server:
        yield server


def test_tool_calls_with_the_engine_in_its_own_process(live_process, client):
    other = openai_client(live_process, timeout=60)
    for choice in (NAMED, "required"):
        kwargs = dict(tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=60)
        there, here = (
            chat(other, **kwargs).choices[0],
            chat(client, **kwargs).choices[0],
        )
        check_calls(there.message)
        assert [t.function.arguments for t in there.message.tool_calls] == [
            t.function.arguments for t in here.message.tool_calls
        ]
    assert torch.get_num_threads() >= 1
