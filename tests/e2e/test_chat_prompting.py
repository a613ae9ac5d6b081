"""How a chat prompt is built and an answer read: chat_template_kwargs,
continue_final_message / add_generation_prompt (vLLM's), and --reasoning-parser."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.helpers import RunningServer

COUNT = [{"role": "user", "content": "Count on: 1, 2, 3,"}, {"role": "assistant", "content": "4, 5,"}]


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def chat(http: httpx.Client, **body) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"max_tokens": 6, "temperature": 0, **body})


def test_continue_final_message_goes_on_with_the_last_assistant_message(http):
    closed = chat(http, messages=COUNT, add_generation_prompt=False).json()
    continued = chat(http, messages=COUNT, add_generation_prompt=False, continue_final_message=True).json()
    # The continued prompt ends right after "4, 5,": no end-of-turn marker and newline.
    assert continued["usage"]["prompt_tokens"] == closed["usage"]["prompt_tokens"] - 2
    new_turn = chat(http, messages=COUNT).json()
    assert new_turn["usage"]["prompt_tokens"] > closed["usage"]["prompt_tokens"]


def test_chat_template_kwargs_reach_the_template(http):
    assert chat(http, messages=COUNT[:1], chat_template_kwargs={"enable_thinking": False}).status_code == 200
    # Names of the renderer's own parameters are template variables like any other (was a 500).
    assert chat(http, messages=COUNT[:1], chat_template_kwargs={"self": 1}).status_code == 200


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": COUNT, "continue_final_message": True}, "continue_final_message"),
        (
            {"messages": COUNT[:1], "continue_final_message": True, "add_generation_prompt": False},
            "continue_final_message",
        ),
        ({"messages": COUNT[:1], "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        # The request's own field, which the template would not act on.
        ({"messages": COUNT, "chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
        ({"messages": COUNT[:1], "chat_template_kwargs": [1]}, "chat_template_kwargs"),
    ],
)
def test_bad_prompt_options_are_400(http, fields, param):
    result = chat(http, **fields)
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == param


@pytest.fixture(scope="module")
def thinking_server():
    running = RunningServer("--reasoning-parser", "qwen3", "--max-total-tokens", "4000")
    yield running
    running.stop()


def test_the_reasoning_parser_leaves_an_answer_without_thinking_whole(thinking_server):
    """SmolLM2 does not think: with the qwen3 parser its answer stays content, streamed or not
    (the split of answers that do think: tests/unit/test_reasoning.py; a grammar after the
    thinking: tests/unit/test_grammars.py)."""
    body = {"messages": COUNT[:1], "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=thinking_server.base_url, timeout=120) as http:
        whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert whole["reasoning_content"] is None and whole["content"], whole
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
            lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: {")]
    deltas = [json.loads(line)["choices"][0]["delta"] for line in lines]
    assert not any(d.get("reasoning_content") for d in deltas)
    assert "".join(d.get("content", "") for d in deltas) == whole["content"]


def test_a_schema_still_holds_with_a_reasoning_parser(thinking_server):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    body = {
        "messages": COUNT[:1],
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        "max_tokens": 30,
        "temperature": 0,
    }
    with httpx.Client(base_url=thinking_server.base_url, timeout=120) as http:
        message = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
    assert isinstance(json.loads(message["content"])["n"], int)


@pytest.mark.parametrize("content", ["4, 5,", "end", "m", "\n", "trailing space "])
def test_continue_final_message_cuts_the_prompt_right_after_the_message(http, content):
    """The cut was made where the message's text last appeared: "end" and "m" are in the
    <|im_end|> the template writes after it, so the prompt kept half the marker."""
    messages = [COUNT[0], {"role": "assistant", "content": content}]
    tokens = http.post(
        "/tokenize", json={"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    ).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": tokens}).json()["text"]
    assert text.endswith("<|im_start|>assistant\n" + content), text
