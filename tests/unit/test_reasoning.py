"""Thinking moved into reasoning_content (server/reasoning.py and the chat view)."""

from __future__ import annotations

import pytest

from sluice.messages import FinishReason
from sluice.server.chat_messages import ChatMessage
from sluice.server.logprobs import TokenTexts
from sluice.server.openai_protocol import ChatCompletionRequest
from sluice.server.openai_views import ChatView
from sluice.server.reasoning import split_reasoning
from sluice.tokenizer.result import GenerateChunk


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("qwen3", "<think>add them</think>\n\n4", ("add them", "\n\n4", True)),
        ("qwen3", "4, no thinking", ("", "4, no thinking", True)),
        ("qwen3", "<think>still going", ("still going", "", False)),
        ("deepseek-r1", "add them</think>4", ("add them", "4", True)),
        ("deepseek-r1", "<think>add them</think>4", ("add them", "4", True)),
        ("deepseek-r1", "thinking without end", ("thinking without end", "", False)),
        ("none", "<think>x</think>y", ("", "<think>x</think>y", True)),
    ],
)
def test_answers_split_into_reasoning_and_content(parser, text, expected):
    assert split_reasoning(text, parser) == expected


def test_a_partial_end_tag_is_held_back_while_streaming():
    assert split_reasoning("<think>add them</thi", "qwen3", final=False) == ("add them", "", False)
    assert split_reasoning("<thi", "qwen3", final=False) == ("", "", False)


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
@pytest.mark.parametrize(
    "answer", [" <think>a</think>b", "<think>hmm</think>", "\n<think>x y</think>\nz", "a</think>b"]
)
def test_any_split_of_the_stream_reassembles_to_the_whole_answer(parser, answer):
    """deepseek-r1 sent a `<think>` that came over several chunks ("<", "think", ">") as
    reasoning, then cut as many characters off the real reasoning."""
    body = ChatCompletionRequest(messages=[ChatMessage(role="user", content="2+2?")], stream=True)
    whole = ChatView("m", "id", TokenTexts(), body, reasoning_parser=parser).final_choice(0, piece(answer, "stop"))
    for size in (1, 2, 3):
        view = ChatView("m", "id", TokenTexts(), body, reasoning_parser=parser)
        pieces = [answer[i : i + size] for i in range(0, len(answer), size)]
        last = len(pieces) - 1
        events = [e for i, p in enumerate(pieces) for e in view.stream_chunk(piece(p, "stop" if i == last else None))]
        deltas = [event["choices"][0]["delta"] for event in events]
        streamed = (
            "".join(d.get("reasoning_content") or "" for d in deltas),
            "".join(d.get("content") or "" for d in deltas),
        )
        assert streamed == (whole["message"].get("reasoning_content") or "", whole["message"]["content"] or ""), size


def piece(text: str, reason: str | None = None) -> GenerateChunk:
    return GenerateChunk(
        rid="r",
        path="single",
        index=None,
        text=text,
        output_ids=[1],
        finish_reason=FinishReason(type=reason) if reason else None,
    )


@pytest.mark.parametrize("parser", ["qwen3", "deepseek-r1"])
def test_streamed_reasoning_and_content_reassemble_to_the_whole_answer(parser):
    body = ChatCompletionRequest(messages=[ChatMessage(role="user", content="2+2?")], stream=True)
    pieces = ["<think>" if parser == "qwen3" else "", "I should", " add.</thi", "nk>The answer", " is 4."]
    view = ChatView("m", "id", TokenTexts(), body, reasoning_parser=parser)
    events = [e for i, p in enumerate(pieces) for e in view.stream_chunk(piece(p, "stop" if i == 4 else None))]
    deltas = [event["choices"][0]["delta"] for event in events]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "I should add."
    assert "".join(d.get("content", "") for d in deltas) == "The answer is 4."
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    whole = view.final_choice(0, piece("".join(pieces), "stop"))["message"]
    assert (whole["reasoning_content"], whole["content"]) == ("I should add.", "The answer is 4.")
