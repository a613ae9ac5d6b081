"""Tool calls in chat through the real server and model: forced calls (required, named) that
hold even for a 135 M model, streamed deltas, tool-result turns, and every refusal."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from tests.helpers import RunningServer, wait_until_drained

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


def assert_valid_call(call) -> None:
    assert call.type == "function" and call.id
    assert call.function.name in PARAMETERS
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_forces_a_valid_call(client, model_name, temperature):
    result = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=120,
        temperature=temperature,
        seed=4,
    )
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        assert_valid_call(call)


def test_a_named_function_is_the_one_called(client, model_name):
    result = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=True,
        max_tokens=60,
        temperature=0.8,
        seed=1,
    )
    calls = result.choices[0].message.tool_calls
    assert [call.function.name for call in calls] == ["get_time"]
    assert result.choices[0].finish_reason == "stop"  # as OpenAI ends a named call ("tool_calls" for required)
    assert_valid_call(calls[0])


def test_streamed_call_deltas_reassemble(client, model_name):
    stream = client.chat.completions.create(
        model=model_name,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=0,
        stream=True,
    )
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    assert call["id"] is None and not call["arguments"]  # id and name come first
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] in PARAMETERS
    jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMETERS[calls[0]["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_a_stop_string_is_text(client, model_name, stream):
    """A stop string that ends the answer inside the call leaves no call to give: the text
    so far comes back as content with finish_reason "stop", as a call cut by max_tokens does."""
    common = {"model": model_name, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": 60}
    if not stream:
        choice = client.chat.completions.create(**common, stop=["}"], temperature=0).choices[0]
        assert choice.finish_reason == "stop" and not choice.message.tool_calls
        assert choice.message.content.startswith("[") and "}" not in choice.message.content
        return
    content, finish, calls = "", None, []
    for chunk in client.chat.completions.create(**common, stop=["}"], temperature=0, stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
    assert finish == "stop" and not calls
    assert content.startswith("[") and "}" not in content


@pytest.mark.parametrize(
    "answer, call",
    [
        ('Sure. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', True),
        ('Sure. <tool_call>{"name": "get_time", "arguments": "notjson"}</tool_call>', False),
        ('Sure. <tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>', False),
    ],
)
def test_only_a_call_with_an_object_of_arguments_is_a_call_and_streams_as_it_answers(http, model_name, answer, call):
    """The answer forced by a regex: a call whose arguments are not an object, or sit under
    another key, stays text; stream and whole answer have the same content."""
    body = {"model": model_name, "messages": ASK, "tools": TOOLS, "regex": re.escape(answer), "max_tokens": 60}
    whole = http.post("/v1/chat/completions", json={**body, "temperature": 0}).json()["choices"][0]
    assert whole["finish_reason"] == ("tool_calls" if call else "stop"), whole
    if call:
        assert whole["message"]["content"] == "Sure."
        assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"zone": "UTC"}
    else:
        assert whole["message"]["content"] == answer and "tool_calls" not in whole["message"]
    content, calls = "", []
    with http.stream("POST", "/v1/chat/completions", json={**body, "temperature": 0, "stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    content += choice["delta"].get("content") or ""
                    calls += choice["delta"].get("tool_calls") or []
    assert content == (whole["message"]["content"] or "") and bool(calls) == call


STRICT_TOOLS = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
# SmolLM2's tokens of "<tool_call>": biased so, the model begins call after call.
SAYS_TOOL_CALL = {str(token): 100 for token in (44, 19324, 79, 4350, 46)}


def test_strict_tools_hold_every_call_the_model_begins_in_auto(client, model_name):
    """Without the structural tag the biased model says "<tool_call><tool_call>..." and no
    call parses; with it, each call it begins goes on as a valid call."""
    result = client.chat.completions.create(
        model=model_name, messages=ASK, tools=STRICT_TOOLS, max_tokens=60, temperature=0, logit_bias=SAYS_TOOL_CALL
    )
    calls = result.choices[0].message.tool_calls
    assert calls, result
    for call in calls:
        assert_valid_call(call)


def test_a_tool_result_turn_is_accepted(client, model_name):
    messages = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
    ]
    result = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS, max_tokens=16)
    assert result.choices[0].message.content is not None or result.choices[0].message.tool_calls
    # tool_choice "none": nothing is read as a call (SmolLM2's template has no tools section: no tools block).
    result = client.chat.completions.create(
        model=model_name, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert result.choices[0].message.tool_calls is None


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "retrieval", "function": {"name": "x"}}]}, "tools[0].type"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1]"),
        ({"tools": {"get_weather": WEATHER}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
        ({"tools": STRICT_TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        # Forced, such a function was called with arguments '""' or '[1, 2]' (a 200).
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tool_requests_are_400_naming_the_field(http, base_url, fields, param):
    body = {"messages": ASK, "max_tokens": 4, **fields}
    result = http.post("/v1/chat/completions", json=body)
    assert result.status_code == 400, result.text
    error = result.json()["error"]
    assert error["param"] == param, error
    wait_until_drained(base_url)


@pytest.fixture(scope="module")
def llama3_http():
    server = RunningServer("--max-total-tokens", "4000", "--tool-call-parser", "llama3")
    try:
        with httpx.Client(base_url=server.base_url, timeout=120) as c:
            yield c
    finally:
        server.stop()


def test_llama3_calls_with_semicolons_between_are_each_a_call(llama3_http):
    """--tool-call-parser llama3: an answer of JSON calls with "; " between them (as Llama 3.x
    writes several) is that many calls, whole and streamed; one that is not a call leaves
    the answer text. The answers are forced with a regex."""
    first, second = '{"name": "get_time", "parameters": {"zone": "UTC"}}', '{"name": "get_time", "parameters": {}}'
    model_name = llama3_http.get("/v1/models").json()["data"][0]["id"]
    for answer, names in ((f"{first}; {second}", ["get_time"] * 2), (f'{first}; {{"name": "nope"}}', [])):
        body = {"model": model_name, "messages": ASK, "tools": TOOLS, "regex": re.escape(answer), "max_tokens": 60}
        whole = llama3_http.post("/v1/chat/completions", json={**body, "temperature": 0}).json()["choices"][0]
        assert [call["function"]["name"] for call in whole["message"].get("tool_calls") or []] == names, whole
        assert whole["message"]["content"] == (None if names else answer)
        streamed = []
        with llama3_http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        streamed += [call["function"].get("name") for call in choice["delta"].get("tool_calls") or []]
        assert [name for name in streamed if name] == names
