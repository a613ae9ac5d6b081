"""How native chunks become OpenAI's JSON (openai_views): whole responses, stream deltas,
logprobs with their text offsets, echo, usage, and the finish reasons OpenAI names."""

from __future__ import annotations

from typing import ClassVar

import pytest

from sluice.messages import FinishReason, TokenLogprob
from sluice.server.chat_messages import ChatMessage
from sluice.server.logprobs import TextOffsets, TokenTexts
from sluice.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    FunctionDefinition,
    StreamOptions,
    ToolDefinition,
)
from sluice.server.openai_views import ChatView, CompletionView, finish_reason
from sluice.special_tokens import SpecialTokenRoles
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.result import GenerateChunk

WORDS = {1: "The", 2: " cat", 3: " sat", 4: " on", 5: " é", 6: " mat"}


class Words:
    """A tokenizer whose tokens are whole words."""

    added_tokens_decoder: ClassVar[dict] = {}  # none

    def decode(self, ids: list[int]) -> str:
        return "".join(WORDS[i] for i in ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [i for i, word in WORDS.items() if word == text]


def texts() -> TokenTexts:
    token_texts = TokenTexts()
    token_texts.bind(Words())
    return token_texts


def chunk(index: int | None, ids: list[int], reason: str | None = None, **fields) -> GenerateChunk:
    return GenerateChunk(
        rid=f"r{index}",
        path="batch",
        index=index,
        text=Words().decode(ids),
        output_ids=ids,
        finish_reason=FinishReason(type=reason) if reason else None,
        **fields,
    )


def completion_view(prompts: list, **body) -> CompletionView:
    request = CompletionRequest(prompt=prompts if len(prompts) > 1 else prompts[0], **body)
    return CompletionView("model-x", "abc", texts(), request, prompts)


def test_openai_names_the_finish_reasons_and_an_abort_is_an_error():
    assert finish_reason(chunk(0, [2])) is None
    assert finish_reason(chunk(0, [2], "stop")) == "stop"
    assert finish_reason(chunk(0, [2], "length")) == "length"
    with pytest.raises(BackendError, match="aborted on the server"):
        finish_reason(chunk(0, [2], "abort"))


def test_a_completion_response_has_every_choice_in_order_and_counts_each_prompt_once():
    view = completion_view(["The", "The cat"], n=2)
    finals = [
        chunk(index, ids, "length", prompt_tokens=1 + index // 2, completion_tokens=len(ids), cached_tokens=index // 2)
        for index, ids in enumerate([[2], [3, 4], [6], [2, 3, 4]])
    ]
    response = view.response(finals)
    assert response["id"] == "cmpl-abc" and response["object"] == "text_completion"
    assert response["model"] == "model-x" and isinstance(response["created"], int)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in response["choices"]] == [
        (0, " cat", "length"),
        (1, " sat on", "length"),
        (2, " mat", "length"),
        (3, " cat sat on", "length"),
    ]
    assert all(c["logprobs"] is None for c in response["choices"])  # not asked for
    # Prompt tokens once per prompt (1 + 2), completion tokens of every choice (1+2+1+3).
    assert response["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 7,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
    assert view.error_message(chunk(3, [], "abort")) == "choice 3: the request failed"


def test_completion_logprobs_name_each_token_offset_and_alternatives():
    view = completion_view(["The"], logprobs=2)
    final = chunk(
        None,
        [2, 5],
        "stop",
        return_logprob=True,
        output_logprobs=[-0.5, -1.5],
        output_top_logprobs=[[TokenLogprob(2, -0.5), TokenLogprob(3, -1.0)], [TokenLogprob(6, -1.0)]],
    )
    [choice] = view.response([final])["choices"]
    assert choice["index"] == 0 and choice["text"] == " cat é"
    assert choice["logprobs"] == {
        "tokens": [" cat", " é"],
        "token_logprobs": [-0.5, -1.5],
        # The chosen token is among its alternatives, as with OpenAI.
        "top_logprobs": [{" cat": -0.5, " sat": -1.0}, {" mat": -1.0, " é": -1.5}],
        "text_offset": [0, 4],
    }


def test_echo_puts_the_prompt_and_its_logprobs_first():
    view = completion_view(["The cat"], echo=True, logprobs=0)
    final = chunk(
        None,
        [3],
        "length",
        return_logprob=True,
        output_logprobs=[-2.0],
        output_top_logprobs=[[]],
        input_token_ids=[1, 2],
        input_logprobs=[None, -3.0],
        input_top_logprobs=[[], []],
    )
    [choice] = view.response([final])["choices"]
    assert choice["text"] == "The cat sat"
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["The", " cat", " sat"]
    assert logprobs["token_logprobs"] == [None, -3.0, -2.0]
    assert logprobs["top_logprobs"] == [None, {" cat": -3.0}, {" sat": -2.0}]
    assert logprobs["text_offset"] == [0, 3, 7]


def test_a_completion_stream_sends_what_is_new_and_the_usage_last():
    view = completion_view(["The"], logprobs=0, stream=True, stream_options=StreamOptions(include_usage=True))
    steps = [
        chunk(None, [2], return_logprob=True, output_logprobs=[-1.0], output_top_logprobs=[[]]),
        chunk(None, [], return_logprob=True),  # nothing new: no event
        chunk(
            None,
            [3, 4],
            "length",
            return_logprob=True,
            output_logprobs=[-2.0, -3.0],
            output_top_logprobs=[[], []],
            prompt_tokens=1,
            completion_tokens=3,
        ),
    ]
    events = [view.stream_chunk(step) for step in steps]
    assert [len(e) for e in events] == [1, 0, 2]
    first, (last, usage) = events[0][0], events[2]
    assert first["object"] == "text_completion" and first["usage"] is None
    assert first["choices"][0]["text"] == " cat" and first["choices"][0]["finish_reason"] is None
    assert last["choices"][0]["text"] == " sat on" and last["choices"][0]["finish_reason"] == "length"
    # Offsets go on from the text already streamed.
    assert last["choices"][0]["logprobs"]["text_offset"] == [4, 8]
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4


def test_a_stream_with_several_choices_sends_the_usage_after_the_last_one_ends():
    view = completion_view(["The"], n=2, stream=True, stream_options=StreamOptions(include_usage=True))
    assert len(view.stream_chunk(chunk(1, [2], "stop", completion_tokens=1))) == 1  # choice 1 ends first
    assert len(view.stream_chunk(chunk(0, [3], completion_tokens=1))) == 1
    events = view.stream_chunk(chunk(0, [4], "length", completion_tokens=2))
    assert [e["choices"][0]["index"] for e in events[:1]] == [0]
    assert events[1]["usage"]["completion_tokens"] == 3


def chat_view(**body) -> ChatView:
    request = ChatCompletionRequest(messages=[ChatMessage(role="user", content="Hi")], **body)
    return ChatView("model-x", "xyz", texts(), request)


def test_a_chat_response_is_one_assistant_message_with_logprobs():
    view = chat_view(logprobs=True, top_logprobs=1)
    final = chunk(
        None,
        [1, 5],
        "stop",
        return_logprob=True,
        output_logprobs=[-0.25, -0.75],
        output_top_logprobs=[[TokenLogprob(1, -0.25), TokenLogprob(2, -2.0)], [TokenLogprob(5, -0.75)]],
        prompt_tokens=4,
        completion_tokens=2,
    )
    response = view.response([final])
    assert response["id"] == "chatcmpl-xyz" and response["object"] == "chat.completion"
    [choice] = response["choices"]
    assert choice["message"] == {"role": "assistant", "content": "The é"}
    assert choice["finish_reason"] == "stop"
    assert choice["logprobs"]["content"] == [
        {
            "token": "The",
            "logprob": -0.25,
            "bytes": list(b"The"),
            "top_logprobs": [{"token": "The", "logprob": -0.25, "bytes": list(b"The")}],  # top_logprobs=1
        },
        {
            "token": " é",
            "logprob": -0.75,
            "bytes": list(" é".encode()),
            "top_logprobs": [{"token": " é", "logprob": -0.75, "bytes": list(" é".encode())}],
        },
    ]
    assert response["usage"]["total_tokens"] == 6


def test_a_chat_stream_opens_each_choice_with_its_role_then_sends_deltas():
    view = chat_view(n=2, stream=True)
    start = view.stream_start()
    assert [e["choices"][0]["index"] for e in start] == [0, 1]
    assert all(e["choices"][0]["delta"] == {"role": "assistant", "content": ""} for e in start)
    assert all(e["object"] == "chat.completion.chunk" and "usage" not in e for e in start)
    [delta] = view.stream_chunk(chunk(1, [1, 2]))
    assert delta["choices"] == [{"index": 1, "delta": {"content": "The cat"}, "logprobs": None, "finish_reason": None}]
    assert view.stream_chunk(chunk(1, [])) == []
    [end] = view.stream_chunk(chunk(1, [], "length"))
    assert end["choices"] == [{"index": 1, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert view.error_message(chunk(0, [], "abort")) == "choice 0: the request failed"
    assert chat_view().error_message(chunk(None, [], "abort")) == "the request failed"


def test_parallel_tool_calls_false_keeps_the_first_call_of_a_free_answer():
    tool = ToolDefinition("function", FunctionDefinition("f", parameters={"type": "object"}))
    text = "".join(f'<tool_call>{{"name": "f", "arguments": {{"a": {a}}}}}</tool_call>' for a in (1, 2))
    for parallel, arguments in (
        (None, ['{"a": 1}', '{"a": 2}']),
        (True, ['{"a": 1}', '{"a": 2}']),
        (False, ['{"a": 1}']),
    ):
        view = chat_view(tools=[tool], tool_choice="auto", parallel_tool_calls=parallel)
        _, content, calls, reason = view.answer(text, chunk(None, [], "stop"))
        assert [call.arguments for call in calls] == arguments and content is None and reason == "tool_calls"


def test_streamed_text_offsets_are_those_of_the_whole_response():
    """Text the stream holds back (a possible stop string) still counts in the offsets of the
    tokens after it, as in the response that is not streamed."""
    request = CompletionRequest(prompt="Hi", logprobs=0, stream=True)
    entries = {"return_logprob": True, "output_logprobs": [-0.5] * 4, "output_top_logprobs": [[]] * 4}
    view = CompletionView("model-x", "abc", texts(), request, ["Hi"])
    held = chunk(0, [1, 2], **{**entries, "output_logprobs": [-0.5] * 2, "output_top_logprobs": [[]] * 2})
    held.text = "The"  # " cat" waits: it may start a stop string
    rest = chunk(0, [3, 4], "length", **{**entries, "output_logprobs": [-0.5] * 2, "output_top_logprobs": [[]] * 2})
    rest.text = " cat sat on"
    streamed = [view.stream_choice(0, c)["logprobs"]["text_offset"] for c in (held, rest)]
    whole_view = CompletionView("model-x", "abc", texts(), request, ["Hi"])
    whole = whole_view.final_choice(0, chunk(0, [1, 2, 3, 4], **entries))
    assert streamed[0] + streamed[1] == whole["logprobs"]["text_offset"] == [0, 3, 7, 11]


def test_a_stream_sends_the_content_after_a_call_when_the_content_began_with_whitespace():
    """The whole answer's content around calls is stripped; what the stream sent before the
    call began with whitespace. The text after the call still goes out."""
    tool = ToolDefinition("function", FunctionDefinition("f", parameters={"type": "object"}))
    view = chat_view(tools=[tool], tool_choice="auto", stream=True)
    first = chunk(0, [])
    first.text = "\n\nSure. "
    last = chunk(0, [], "stop")
    last.text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nBye.'
    content, calls = "", []
    for c in (first, last):
        for choice in view.stream_choices(0, c):
            content += choice["delta"].get("content") or ""
            calls += choice["delta"].get("tool_calls") or []
    assert content == "\n\nSure. \nBye." and len(calls) == 2  # the call's head, then its arguments


@pytest.mark.parametrize(
    "pieces",
    [
        ["Sure. ", '<tool_call>{"name": "f", "arguments": {}}</tool_call>'],
        ["Sure.", " ", "<tool", '_call>{"name": "f", "arguments": {}}</tool_call>', "\n"],
        ["\n", "\n", '<tool_call>{"name": "f", "arguments": {}}</tool_call>', "\nBye."],
        ["Hi", " there ", "friend. "],
    ],
)
def test_a_streamed_answer_with_tools_has_the_content_of_the_whole_answer(pieces):
    """Whitespace before a call waits with it, so a stream never sends what the whole
    answer's content drops."""
    tool = ToolDefinition("function", FunctionDefinition("f", parameters={"type": "object"}))
    view = chat_view(tools=[tool], tool_choice="auto", stream=True)
    streamed = ""
    for position, piece in enumerate(pieces):
        c = chunk(0, [], "stop" if position == len(pieces) - 1 else None)
        c.text = piece
        streamed += "".join(choice["delta"].get("content") or "" for choice in view.stream_choices(0, c))
    whole = chunk(0, [], "stop")
    whole.text = "".join(pieces)
    content = chat_view(tools=[tool], tool_choice="auto").final_choice(0, whole)["message"]["content"]
    assert streamed == (content or "")


def test_text_offsets_count_a_character_split_over_tokens_once():
    """ "a🦙 b" as byte tokens "a", two pieces of the llama, " b": the pieces share the
    llama's offset and " b" starts right after it (each piece alone would be "�")."""
    offsets = TextOffsets()
    assert [offsets.next(0, piece) for piece in (b"a", b"\xf0\x9f", b"\xa6\x99", b" b")] == [0, 1, 1, 2]


def test_text_offsets_place_special_tokens_as_the_detokenizer_writes_them():
    """ "Hi", a kept added token (2), a newline, a skipped special token (4), the kept one
    again: with spaces between special tokens the text is "Hi <|e|> \n <|e|>" (the skipped
    one takes nothing, where the next character would be); without, "Hi<|e|>\n<|e|>"."""
    tokens = [(1, b"Hi"), (2, b"<|e|>"), (3, b"\n"), (4, b"<|s|>"), (2, b"<|e|>")]
    spaced = TextOffsets(SpecialTokenRoles(skipped=frozenset({4}), standalone={2: "<|e|>"}))
    assert [spaced.next(*token) for token in tokens] == [0, 3, 9, 10, 11]
    joined = TextOffsets(SpecialTokenRoles(skipped=frozenset({4})))
    assert [joined.next(*token) for token in tokens] == [0, 2, 7, 8, 8]
    # The prompt's tokens (echo) count as written, before the output's.
    echoed = TextOffsets(SpecialTokenRoles(skipped=frozenset({4}), standalone={2: "<|e|>"}))
    assert [*echoed.prompt([4], "<|s|>", Spelled()), echoed.next(2, b"<|e|>"), echoed.next(1, b"Hi")] == [0, 5, 11]


class Spelled:
    """Token bytes from a table; `<s>` (0) and `<|s|>` (4) are added tokens."""

    SPELLING: ClassVar[dict[int, bytes]] = {0: b"<s>", 1: b"Hi", 4: b"<|s|>", 7: b" I", 8: b" like", 9: b"\xef\xac\x81"}

    def bytes_of(self, token_id: int) -> bytes:
        return self.SPELLING[token_id]

    def is_added(self, token_id: int) -> bool:
        return token_id in (0, 4)


def test_echoed_prompt_tokens_start_where_the_prompt_s_text_has_them():
    """The BOS a tokenizer puts in is not in the text (Llama 3's pointed every offset 17
    characters on), nor the space SentencePiece puts before the first word; a token the
    tokenizer normalised ("ﬁ" for "fi") counts as spelt. The output counts on from the text's end."""
    offsets = TextOffsets()
    assert offsets.prompt([0, 7, 8], "I like", Spelled()) == [0, 0, 1]
    assert offsets.next(1, b"Hi") == 6
    assert TextOffsets().prompt([4, 9, 1], "<|s|>fiHi", Spelled()) == [0, 5, 6]
