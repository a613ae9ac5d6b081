"""Reading tool calls out of answers (sluice/server/tool_calls.py)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from sluice.server.tool_calls import (
    DEFAULT_TOOLS_PROMPT,
    forced_calls,
    forced_schema,
    may_start_call,
    parse_tool_calls,
    with_tools_in_text,
)

KNOWN = {"get_weather", "get_time"}


def test_hermes_blocks_become_calls_and_the_rest_stays_content():
    text = 'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call> Done.'
    content, calls = parse_tool_calls(text, "hermes", KNOWN)
    assert content == "Let me check.  Done."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("get_weather", {"city": "Oslo"})]
    two = (
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    )
    assert [call.name for call in parse_tool_calls(two, "hermes", KNOWN)[1]] == ["get_time", "get_weather"]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',  # not offered
        '<tool_call>{"name": "get_time", "arguments": </tool_call>',  # not JSON
        "<tool_call> unfinished",
        "plain text",
        "<tool_call>" + "[" * 5000 + "</tool_call>",  # nested past Python's stack (was a 500)
        # Arguments that are not an object (the call's arguments must be JSON of one).
        '<tool_call>{"name": "get_time", "arguments": "notjson"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": null}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "[1]"}</tool_call>',
        # Arguments under another key: they would be lost.
        '<tool_call>{"name": "get_weather", "parameters": {"city": "X"}}</tool_call>',
    ],
)
def test_what_is_not_a_call_of_an_offered_function_stays_text(text):
    assert parse_tool_calls(text, "hermes", KNOWN) == (text, [])


def test_arguments_given_as_a_string_of_json_or_not_at_all_make_a_call():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert json.loads(parse_tool_calls(text, "hermes", KNOWN)[1][0].arguments) == {"city": "Oslo"}
    assert parse_tool_calls('<tool_call>{"name": "get_time"}</tool_call>', "hermes", KNOWN)[1][0].arguments == "{}"
    for body in ('{"name": "get_time", "params": {"zone": "UTC"}}', '{"name": "get_time", "parameters": "x"}'):
        assert parse_tool_calls(body, "llama3", KNOWN) == (body, [])


@pytest.mark.parametrize(
    "text, content",
    [
        ('Sure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>', "Sure."),
        ('\n\nSure. <tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nBye.', "\n\nSure. \nBye."),
        ('\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\nBye.\n', "Bye."),
        ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n', ""),
    ],
)
def test_the_content_around_calls_is_what_a_stream_sends(text, content):
    """Text before the first call as written (a stream sends it before the call comes), unless
    it is only whitespace; no whitespace at the end."""
    assert parse_tool_calls(text, "hermes", KNOWN)[0] == content


def test_llama3_answers_are_json_objects_with_semicolons_between():
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}', "llama3", KNOWN
    )
    assert content == "" and json.loads(calls[0].arguments) == {"zone": "UTC"}
    assert parse_tool_calls("The time is noon.", "llama3", KNOWN) == ("The time is noon.", [])
    # Several calls as Llama 3.x writes them (and vLLM reads them): they stayed text.
    two = '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls = parse_tool_calls(two, "llama3", KNOWN)
    assert content == "" and [call.name for call in calls] == ["get_time", "get_weather"]
    assert json.loads(calls[1].arguments) == {"city": "Oslo"}
    # Any part that is not a call leaves the whole answer text.
    for text in (two + "; and more", two.replace(";", ""), '{"name": "nope", "parameters": {}}; ' + two):
        assert parse_tool_calls(text, "llama3", KNOWN) == (text, [])
    assert len(parse_tool_calls(two + "; ", "llama3", KNOWN)[1]) == 2  # a ";" after the last, as vLLM takes it


def test_streamed_text_waits_only_where_a_call_may_begin():
    assert may_start_call("Hello there") == len("Hello there")
    assert may_start_call("Hello <tool") == len("Hello ")
    assert may_start_call("Hi <tool_call>{") == 3
    assert may_start_call("a < b") == len("a < b")


def test_arguments_are_an_object_where_the_schema_leaves_the_type_out():
    """{"properties": ...} alone also matches a string or a list: a call's arguments must be
    an object all the same."""
    schema = json.loads(forced_schema({"f": {"properties": {"x": {"type": "integer"}}}}, ["f"], parallel=False))
    assert schema["items"]["properties"]["arguments"] == {"properties": {"x": {"type": "integer"}}, "type": "object"}


def test_the_forced_schema_takes_only_calls_of_the_named_functions():
    parameters = {"get_time": {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}}
    schema = json.loads(forced_schema(parameters, ["get_time"], parallel=False))
    good = [{"name": "get_time", "arguments": {"zone": "UTC"}}]
    jsonschema.validate(good, schema)
    for bad in ([], good * 2, [{"name": "get_weather", "arguments": {}}], [{"name": "get_time", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert [call.name for call in forced_calls(json.dumps(good))] == ["get_time"]


def test_templates_without_tools_get_a_system_block_and_written_calls():
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": {"zone": "UTC"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    rendered = with_tools_in_text(messages, tools)
    assert rendered[0]["content"].startswith("Be brief.\n\n" + DEFAULT_TOOLS_PROMPT.split("{")[0])
    assert '"get_time"' in rendered[0]["content"]
    assert rendered[1]["content"] == '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    assert "tool_calls" not in rendered[1] and "tool_calls" in messages[1]  # the caller's messages are untouched
    assert with_tools_in_text([{"role": "user", "content": "Hi"}], tools)[0]["role"] == "system"
