"""The OpenAI request bodies (openai_protocol): prompt shapes, ranges, the native
sampling_params they become, and chat messages as the chat template takes them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec
import pytest

from sluice.sampling import ClientError
from sluice.server.chat_messages import ChatMessage, ContentPart, FunctionCall, ImageURL, MessageToolCall
from sluice.server.json_body import decode_json
from sluice.server.openai_protocol import DEFAULT_COMPLETION_MAX_TOKENS, ChatCompletionRequest, CompletionRequest

IMAGE = "<image>"


def completion(**fields) -> CompletionRequest:
    return decode_json(msgspec.json.encode({"prompt": "Hi", **fields}), CompletionRequest)


def chat(*messages: ChatMessage, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=list(messages), **fields)


@contextmanager
def refused(param: str, message: str) -> Iterator[None]:
    """A ClientError naming `param`, whose message contains `message`, must be raised inside."""
    with pytest.raises(ClientError) as info:
        yield
    assert info.value.param == param
    assert message in info.value.message, info.value.message


# ------------------------------------------------------------------ completions


@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("Hi", ["Hi"]),
        ([1, 2, 3], [[1, 2, 3]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
    ],
)
def test_every_prompt_shape_becomes_a_list_of_prompts(prompt, prompts):
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt", [["a", [1]], [[1], "a"], [1, "a"], [True, 2], [1.5], [[1, 2.5]]])
def test_mixed_or_odd_prompts_are_refused(prompt):
    with refused("prompt", "prompt must be a string, a list of token ids, or a list of strings or of token-id"):
        completion(prompt=prompt).prompts()


def test_an_empty_prompt_list_is_refused():
    with refused("prompt", "prompt must not be empty"):
        completion(prompt=[]).prompts()


@pytest.mark.parametrize(
    "fields, param, message",
    [
        ({"max_tokens": -1}, "max_tokens", "max_tokens must be >= 0, got -1"),
        ({"logprobs": 6}, "logprobs", "logprobs must be in [0, 5], got 6"),
        ({"logprobs": -1}, "logprobs", "logprobs must be in [0, 5], got -1"),
        ({"n": 0}, "n", "n must be >= 1, got 0"),
    ],
)
def test_out_of_range_completion_fields_name_the_field_and_range(fields, param, message):
    with refused(param, message):
        completion(**fields).check()


def test_a_wrong_type_names_the_field_and_an_unknown_field_is_refused():
    with refused("temperature", "Expected `float | null`"):
        completion(temperature="hot")
    with refused("some_future_field", "some_future_field is not a field this route takes"):
        completion(some_future_field=1)
    with refused("stream_options.include_obfuscation", "include_obfuscation is not a field"):
        completion(stream_options={"include_obfuscation": True})


def chat_body(**fields) -> ChatCompletionRequest:
    return decode_json(
        msgspec.json.encode({"messages": [{"role": "user", "content": "Hi"}], **fields}), ChatCompletionRequest
    )


NO_EFFECT_FIELDS = {
    "user": "me",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}


def test_fields_that_change_nothing_are_accepted():
    completion(**NO_EFFECT_FIELDS).check()
    chat_body(**NO_EFFECT_FIELDS, parallel_tool_calls=True, prediction={"type": "content", "content": "x"}).check()


def test_neutral_values_of_refused_fields_are_accepted():
    completion(logit_bias={}, best_of=1, suffix="").check()
    completion(n=3, best_of=3).check()
    neutral = {
        "response_format": {"type": "text"},
        "tools": [],
        "tool_choice": "none",
        "functions": None,
        "function_call": "none",
        "modalities": ["text"],
        "logit_bias": None,
    }
    chat_body(**neutral).check()


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"best_of": 2}, "best_of"),
        ({"suffix": " end"}, "suffix"),
    ],
)
def test_completion_fields_that_would_change_the_answer_are_refused(fields, param):
    with refused(param, "is not supported by this server"):
        completion(**fields).check()


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"functions": [TOOL["function"]]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"reasoning_effort": "high"}, "reasoning_effort"),
        ({"verbosity": "low"}, "verbosity"),
        ({"web_search_options": {}}, "web_search_options"),
    ],
)
def test_chat_fields_that_would_change_the_answer_are_refused(fields, param):
    with refused(param, "is not supported by this server"):
        chat_body(**fields).check()


def test_an_unknown_message_field_is_refused_naming_where():
    body = {"messages": [{"role": "assistant", "content": None, "refusal": "no"}]}
    with refused("messages[0].refusal", "messages[0].refusal is not a field"):
        decode_json(msgspec.json.encode(body), ChatCompletionRequest)


def test_an_earlier_call_of_another_type_than_function_is_refused():
    call = {"id": "c", "type": "web_search", "function": {"name": "f", "arguments": "{}"}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}]}
    with refused("messages[0].tool_calls[0].type", "Invalid enum value 'web_search'"):
        decode_json(msgspec.json.encode(body), ChatCompletionRequest)


def test_a_named_tool_choice_of_another_type_says_so():
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = chat_body(tools=tools, tool_choice={"type": "x", "function": {"name": "f"}})
    with refused("tool_choice", "tool_choice.type must be 'function', got 'x'"):
        body.check()


def test_completion_defaults_are_openais():
    body = completion()
    body.check()
    assert body.max_new_tokens == DEFAULT_COMPLETION_MAX_TOKENS == 16
    assert completion(max_tokens=0).max_new_tokens == 0
    assert body.sample_count == 1 and not body.include_usage
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage


def test_only_the_fields_the_client_gave_become_sampling_params():
    assert completion().sampling_params(16) == {"max_new_tokens": 16}
    assert completion(logit_bias={}).sampling_params(16) == {"max_new_tokens": 16}
    assert completion(logit_bias={"15": -100}).sampling_params(1)["logit_bias"] == {"15": -100.0}
    body = completion(
        n=2,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        stop="\n",
        min_tokens=2,
        repetition_penalty=1.1,
        frequency_penalty=0.2,
        presence_penalty=0.3,
        ignore_eos=True,
        stop_token_ids=[7],
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        no_stop_trim=True,
    )
    assert body.sampling_params(4) == {
        "n": 2,
        "max_new_tokens": 4,
        "min_new_tokens": 2,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 5,
        "min_p": 0.1,
        "repetition_penalty": 1.1,
        "frequency_penalty": 0.2,
        "presence_penalty": 0.3,
        "seed": 3,
        "stop": ["\n"],
        "stop_token_ids": [7],
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "no_stop_trim": True,
    }
    assert completion(stop=["a", "b"]).sampling_params(1)["stop"] == ["a", "b"]


def test_response_format_becomes_one_grammar_field():
    tag = {"type": "structural_tag", "structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a>"]}
    assert json.loads(completion(response_format=tag).sampling_params(1)["structural_tag"]) == tag
    assert completion(response_format={"type": "json_object"}).sampling_params(1)["json_schema"] == '{"type": "object"}'
    assert completion(json_schema="{}").sampling_params(1)["json_schema"] == "{}"
    for refused in [{"type": "grammar"}, {"type": "json_schema", "json_schema": {"schema": []}}]:
        with pytest.raises(ClientError, match="response_format"):
            completion(response_format=refused).sampling_params(1)
    with pytest.raises(ClientError, match="not both"):
        completion(response_format=tag, regex="a").sampling_params(1)


# ------------------------------------------------------------------ chat


def test_chat_ranges_and_max_tokens():
    with refused("messages", "messages must not be empty"):
        chat().check()
    with refused("top_logprobs", "top_logprobs must be in [0, 20], got 21"):
        chat(ChatMessage(role="user", content="Hi"), top_logprobs=21).check()
    with refused("top_logprobs", "top_logprobs needs logprobs set to true"):
        chat(ChatMessage(role="user", content="Hi"), top_logprobs=2).check()
    chat(ChatMessage(role="user", content="Hi"), top_logprobs=0).check()  # asks for nothing
    with refused("max_completion_tokens", "max_completion_tokens must be >= 0, got -2"):
        chat(ChatMessage(role="user", content="Hi"), max_completion_tokens=-2).check()
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens == 7  # the newer name wins
    assert chat().requested_max_tokens is None


def test_messages_become_template_messages_with_openais_roles():
    body = chat(
        ChatMessage(role="developer", content="Be brief."),
        ChatMessage(role="system", content="You are kind."),
        ChatMessage(role="user", content="Hi", name="alice"),
        ChatMessage(role="assistant", content=None),
    )
    messages, images = body.template_messages(None, "m")
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "You are kind."},
        {"role": "user", "content": "Hi", "name": "alice"},
        {"role": "assistant", "content": ""},
    ]
    assert images == []


def test_earlier_call_arguments_go_to_the_template_as_objects_or_else_as_text():
    def arguments_of(text: str):
        call = MessageToolCall(id="c", function=FunctionCall(name="f", arguments=text))
        messages, _ = chat(ChatMessage(role="assistant", tool_calls=[call])).template_messages(None, "m")
        return messages[0]["tool_calls"][0]["function"]["arguments"]

    assert arguments_of('{"city": "Oslo"}') == {"city": "Oslo"}
    for text in ["{not json", "[" * 5000]:  # the second nested past Python's stack (was a 500)
        assert arguments_of(text) == text


def test_content_parts_join_a_line_each_with_one_image_token_per_image_in_order():
    parts = [
        ContentPart(type="text", text="Compare "),
        ContentPart(type="image_url", image_url=ImageURL(url="data:image/png;base64,AAA", detail="high")),
        ContentPart(type="text", text=" and "),
        ContentPart(type="input_image", image_url="https://example.com/b.png"),
    ]
    messages, images = chat(ChatMessage(role="user", content=parts)).template_messages(IMAGE, "m")
    assert messages == [{"role": "user", "content": f"Compare \n{IMAGE}\n and \n{IMAGE}"}]
    assert images == ["data:image/png;base64,AAA", "https://example.com/b.png"]


@pytest.mark.parametrize(
    "message, image_token, param, text",
    [
        (ChatMessage(role="function", content="x"), IMAGE, "messages[0].role", "'function' is not supported"),
        (ChatMessage(role="tool", content="x"), IMAGE, "messages[0].tool_call_id", "tool_call_id is required"),
        # The template would drop it without a word.
        (
            ChatMessage(role="user", content="x", tool_call_id="c1"),
            IMAGE,
            "messages[0].tool_call_id",
            "is for tool messages",
        ),
        (ChatMessage(role="user"), IMAGE, "messages[0].content", "is required for role 'user'"),
        (ChatMessage(role="user", content=[ContentPart(type="text")]), IMAGE, "messages[0].content[0].text", "text"),
        (
            ChatMessage(role="user", content=[ContentPart(type="image_url", image_url=ImageURL(url="x"))]),
            None,
            "messages[0].content[0]",
            "the model m does not accept images",
        ),
        (
            ChatMessage(role="user", content=[ContentPart(type="image_url")]),
            IMAGE,
            "messages[0].content[0].image_url",
            "is required for an image part",
        ),
        (
            ChatMessage(role="user", content=[ContentPart(type="audio", text="x")]),
            IMAGE,
            "messages[0].content[0].type",
            "'audio' is not supported",
        ),
        (
            ChatMessage(
                role="user", content=[ContentPart(type="image_url", image_url=ImageURL(url="x", detail="low"))]
            ),
            IMAGE,
            "messages[0].content[0].image_url.detail",
            "'low' is not supported",
        ),
        # A part's other kind's field would be dropped without a word.
        (
            ChatMessage(role="user", content=[ContentPart(type="text", text="x", image_url="https://a/b.png")]),
            IMAGE,
            "messages[0].content[0].image_url",
            "not a field of a text part",
        ),
        (
            ChatMessage(role="user", content=[ContentPart(type="image_url", text="x", image_url="https://a/b.png")]),
            IMAGE,
            "messages[0].content[0].text",
            "not a field of an image part",
        ),
    ],
)
def test_bad_messages_name_where_they_are_wrong(message, image_token, param, text):
    with refused(param, text):
        chat(message).template_messages(image_token, "m")


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_a_template_with_a_tools_section_gets_the_tools_whatever_the_choice(tool_choice):
    """tool_choice "none" left them out of the prompt; vLLM (by default) and OpenAI keep them
    before the model, which is told nothing: only what is read from the answer differs.
    sluice's own tools block (for templates without a tools section) is left out with it."""
    from types import SimpleNamespace

    from sluice.server.openai_api import chat_prompt
    from sluice.server.openai_protocol import ToolDefinition
    from sluice.tokenizer_files import ChatTemplate

    tool = msgspec.convert(
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}, ToolDefinition
    )
    body = chat(ChatMessage(role="user", content="Hi"), tools=[tool], tool_choice=tool_choice)
    knows = ChatTemplate("{% if tools %}[{{ tools[0].function.name }}]{% endif %}{{ messages[0].content }}")
    prompt, _ = chat_prompt(SimpleNamespace(chat_template=knows, mm_processor=None), body, "m")
    assert prompt == "[f]Hi"
    plain = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    prompt, _ = chat_prompt(SimpleNamespace(chat_template=plain, mm_processor=None), body, "m")
    assert ('"name": "f"' in prompt) == (tool_choice == "auto"), prompt


def test_continue_final_message_cuts_after_the_text_a_trimming_template_wrote():
    """A template that trims (Llama 3's, Qwen's) drops the tag's space and the message's own
    trailing whitespace; the cut follows the text as written. A final message with calls is
    a 400: the template writes them after the text, where the prompt ends."""
    from types import SimpleNamespace

    from sluice.server.openai_api import chat_prompt
    from sluice.tokenizer_files import ChatTemplate

    trims = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>{% endfor %}")
    tm = SimpleNamespace(chat_template=trims, mm_processor=None)
    for content in ("4, 5,", "4, 5, "):
        body = chat(
            ChatMessage(role="user", content="Hi"),
            ChatMessage(role="assistant", content=content),
            add_generation_prompt=False,
            continue_final_message=True,
        )
        assert chat_prompt(tm, body, "m")[0] == "<user>Hi</user><assistant>4, 5,"
    call = MessageToolCall(id="c", function=FunctionCall(name="f", arguments="{}"))
    with refused("messages[1].tool_calls", "may not carry tool_calls"):
        chat(
            ChatMessage(role="user", content="Hi"),
            ChatMessage(role="assistant", content="a", tool_calls=[call]),
            add_generation_prompt=False,
            continue_final_message=True,
        ).check()
