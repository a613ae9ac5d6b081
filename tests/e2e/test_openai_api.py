"""The OpenAI-compatible API, through the official client and raw HTTP, on the real server."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from tests.helpers import finished_count, sse_events, wait_for_states, wait_until_drained, wait_until_running

MAX_TOKENS = 16
PROMPT = "The quick brown fox"
PROMPTS = ["The quick brown fox", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


# ------------------------------------------------------------------ models


def test_models_lists_the_served_model(client):
    models = client.models.list().data
    assert len(models) == 1
    assert models[0].id and models[0].owned_by == "sluice"
    assert abs(models[0].created - time.time()) < 600  # a Unix time, as SGLang and vLLM give (was 0)


# ------------------------------------------------------------------ completions


def test_completion_greedy_is_deterministic_and_reports_usage(client, model):
    first = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    second = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    assert first.object == "text_completion" and first.id.startswith("cmpl-")
    assert first.choices[0].text and first.choices[0].text == second.choices[0].text
    usage = first.usage
    assert usage.completion_tokens <= MAX_TOKENS and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The same prompt again: all of it but its last token comes from the radix cache.
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1


def test_completion_max_tokens_ends_with_length(client, model):
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    assert result.usage.completion_tokens == 3
    assert result.choices[0].finish_reason == "length"


def test_completion_default_max_tokens_is_16(client, model):
    result = client.completions.create(model=model, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert result.usage.completion_tokens == 16


def test_completion_token_prompt_matches_text_prompt(client, model, http):
    native = http.post(
        "/generate",
        json={
            "text": PROMPT,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert native.status_code == 200, native.text
    prompt_ids = [token_id for _, token_id, _ in native.json()["meta_info"]["input_token_logprobs"]]
    by_text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    by_ids = client.completions.create(model=model, prompt=prompt_ids, max_tokens=8, temperature=0, echo=True)
    assert by_ids.usage.prompt_tokens == by_text.usage.prompt_tokens == len(prompt_ids)
    assert by_ids.choices[0].text == PROMPT + by_text.choices[0].text


def test_completion_stop_string_ends_the_text(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
    stop = full.strip().split()[1] if len(full.strip().split()) > 1 else full.strip()[:2]
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stop=[stop])
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    assert stop not in choice.text
    assert full.startswith(choice.text)


def test_nulls_in_nullable_parameters_are_their_defaults(http):
    """OpenAI's parameters are nullable: clients send `null` for "not set"."""
    nulls = {"stream": None, "logprobs": None, "stream_options": None, "max_tokens": 4, "temperature": None}
    chat = http.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi", "name": None}], **nulls}
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["logprobs"] is None
    completion = http.post("/v1/completions", json={"prompt": "Hi", "echo": None, **nulls})
    assert completion.status_code == 200, completion.text
    assert not completion.json()["choices"][0]["text"].startswith("Hi")


def test_completion_seed_reproduces_sampling(client, model):
    def sample(seed: int) -> str:
        return (
            client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
            .choices[0]
            .text
        )

    assert sample(1234) == sample(1234)
    assert len({sample(seed) for seed in (1, 2, 3)}) > 1


def test_completion_logprobs(client, model):
    result = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True}
    )
    choice = result.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert "".join(logprobs.tokens) == choice.text
    assert all(
        choice.text[offset:].startswith(token)
        for offset, token in zip(logprobs.text_offset, logprobs.tokens, strict=True)
    )
    for token, logprob, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert logprob <= 0
        assert token in top and 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob, abs=1e-4)


@pytest.mark.parametrize("prompt", [PROMPT, "Hi"], ids=["prompt", "one-token-prompt"])
def test_completion_echo_with_logprobs(client, model, prompt):
    """Every prompt token is scored and placed, the first (unscored) one too, also when it
    is the only one."""
    result = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, echo=True, logprobs=1)
    choice = result.choices[0]
    assert choice.text.startswith(prompt) and len(choice.text) > len(prompt)
    logprobs = choice.logprobs
    prompt_tokens = result.usage.prompt_tokens
    assert prompt != "Hi" or prompt_tokens == 1
    assert len(logprobs.tokens) == prompt_tokens + result.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert "".join(logprobs.tokens[:prompt_tokens]) == prompt
    assert logprobs.text_offset == [len("".join(logprobs.tokens[:i])) for i in range(len(logprobs.tokens))]


def test_completion_text_offsets_place_tokens_that_split_characters(client, model):
    """CJK characters are two or three of this tokenizer's byte tokens: each token's offset
    still points into the text where it is (a piece of a character, "�" alone, at that
    character), not one character further per piece."""
    prompt = "日本語の文章を書いてください。東京"
    result = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    choice = result.choices[0]
    assert choice.text == prompt
    logprobs = choice.logprobs
    assert any("\ufffd" in token for token in logprobs.tokens)  # some characters are split
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[-1] < len(prompt)
    for offset, token in zip(logprobs.text_offset, logprobs.tokens, strict=True):
        if "\ufffd" not in token:
            assert prompt[offset:].startswith(token), (offset, token)


CHAT_TURN = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize(
    "settings",
    [{}, {"skip_special_tokens": False}, {"skip_special_tokens": False, "spaces_between_special_tokens": False}],
    ids=["skipped", "spaced", "joined"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_text_offsets_count_special_tokens_as_the_text_shows_them(client, model, settings, stream):
    """The answer ends its turn (<|im_end|>) and goes on (ignore_eos): a skipped special token
    takes no characters of the text, a kept one stands a space from its neighbours unless
    spaces_between_special_tokens is off. Counted by its bytes, each token after the first
    <|im_end|> pointed 10 or more characters past where it is."""
    args = dict(model=model, prompt=CHAT_TURN, max_tokens=12, temperature=0, logprobs=0)
    extra_body = {"ignore_eos": True, **settings}
    if stream:
        chunks = list(client.completions.create(**args, stream=True, extra_body=extra_body))
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
        offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    else:
        choice = client.completions.create(**args, extra_body=extra_body).choices[0]
        text, tokens, offsets = choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    assert "<|im_end|>" in tokens[:-1], tokens  # an end of turn with tokens after it
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for offset, token in zip(offsets, tokens, strict=True):
        special = token.startswith("<|") and token.endswith("|>")  # SmolLM2's are all spelt so
        shown = "" if special and not settings else token
        assert text[offset : offset + len(shown)] == shown, (offset, token, text)


def test_completion_echo_scores_the_prompt_with_max_tokens_0(client, model):
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = result.choices[0]
    assert choice.text == PROMPT and result.usage.completion_tokens == 0
    assert len(choice.logprobs.token_logprobs) == result.usage.prompt_tokens
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs[1:])


def test_completion_echo_without_logprobs(client, model):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text


def test_completion_stream_joins_to_the_full_text_with_usage(client, model):
    full = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


@pytest.mark.parametrize("prompt", [PROMPT, "東京の天気は"], ids=["ascii", "split-characters"])
def test_completion_stream_with_logprobs_and_echo(client, model, prompt):
    full = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2)
    chunks = list(
        client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=2, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert tokens == full.choices[0].logprobs.tokens
    assert offsets == full.choices[0].logprobs.text_offset


# ------------------------------------------------------------------ lists of prompts and n


def greedy_text(client, model, prompt, max_tokens: int = 8) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0).choices[0].text


def prompt_ids(http, text: str) -> list[int]:
    native = http.post(
        "/generate",
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        },
    )
    assert native.status_code == 200, native.text
    return [token_id for _, token_id, _ in native.json()["meta_info"]["input_token_logprobs"]]


def test_completion_list_of_prompts_matches_each_single_prompt(client, model):
    result = client.completions.create(model=model, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in result.choices] == [0, 1, 2]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS]
    assert [c.text for c in result.choices] == [s.choices[0].text for s in singles]
    assert result.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert result.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_completion_list_of_token_prompts_matches_text_prompts(client, model, http):
    ids = [prompt_ids(http, p) for p in PROMPTS[:2]]
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=8, temperature=0)
    by_text = client.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.text for c in by_ids.choices] == [c.text for c in by_text.choices]
    assert by_ids.usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_completion_list_with_echo_and_logprobs_is_per_choice(client, model):
    result = client.completions.create(
        model=model, prompt=PROMPTS[:2], max_tokens=3, temperature=0, echo=True, logprobs=1
    )
    for prompt, choice in zip(PROMPTS[:2], result.choices, strict=True):
        assert choice.text.startswith(prompt) and choice.text == "".join(choice.logprobs.tokens)
        assert choice.logprobs.token_logprobs[0] is None


def test_completion_n_greedy_samples_agree_and_count_the_prompt_once(client, model):
    single = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert {c.text for c in result.choices} == {single.choices[0].text}
    assert result.usage.prompt_tokens == single.usage.prompt_tokens
    assert result.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_completion_seeded_samples_differ(client, model):
    result = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7, n=3)
    assert len({c.text for c in result.choices}) > 1


def test_completion_list_times_n_indexes_prompt_then_sample(client, model):
    prompts = PROMPTS[:2]
    result = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    texts = [c.text for c in result.choices]
    assert texts == [greedy_text(client, model, p, 6) for p in prompts for _ in range(2)]
    singles = [client.completions.create(model=model, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    assert result.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)


def test_completion_stream_list_times_n(http, client, model):
    body = {
        "model": model,
        "prompt": PROMPTS[:2],
        "n": 2,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = sse_events(response)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    usage_event, choice_events = events[-2], events[:-2]
    assert usage_event["choices"] == [] and all(e["usage"] is None and len(e["choices"]) == 1 for e in choice_events)
    texts: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for event in choice_events:
        choice = event["choices"][0]
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = finishes.get(choice["index"], 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}
    full = client.completions.create(model=model, prompt=PROMPTS[:2], n=2, max_tokens=5, temperature=0)
    assert [texts[i] for i in range(4)] == [c.text for c in full.choices]
    assert usage_event["usage"]["completion_tokens"] == full.usage.completion_tokens
    assert usage_event["usage"]["prompt_tokens"] == full.usage.prompt_tokens


# ------------------------------------------------------------------ chat


def chat(client, model, content: str, **kwargs):
    return client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": content}], temperature=0, **kwargs
    )


def test_chat_answers_the_capital_of_france(client, model):
    result = chat(client, model, "Name the capital of France.", max_tokens=32)
    assert result.object == "chat.completion" and result.id.startswith("chatcmpl-")
    message = result.choices[0].message
    assert message.role == "assistant" and "Paris" in message.content
    assert result.usage.total_tokens == result.usage.prompt_tokens + result.usage.completion_tokens


def test_chat_content_parts_equal_a_string_of_their_lines(client, model):
    """Joined a line each, as vLLM joins them (they were joined with nothing: "Say" and
    "hello." made "Sayhello.")."""
    as_string = chat(client, model, "Say\nhello.", max_tokens=8)
    parts = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]}],
    )
    assert parts.choices[0].message.content == as_string.choices[0].message.content
    assert parts.usage.prompt_tokens == as_string.usage.prompt_tokens


def test_chat_stream_deltas_join_to_the_full_text(client, model):
    full = chat(client, model, "What is the capital of France?", max_tokens=24)
    chunks = list(
        chat(
            client,
            model,
            "What is the capital of France?",
            max_tokens=24,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    choice_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in choice_chunks) == full.choices[0].message.content
    assert choice_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_logprobs_with_top_logprobs(client, model):
    result = chat(client, model, "Name a color.", max_tokens=6, logprobs=True, top_logprobs=3)
    content = result.choices[0].logprobs.content
    assert len(content) == result.usage.completion_tokens
    assert "".join(entry.token for entry in content) == result.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and bytes(entry.bytes).decode("utf-8", "replace") == entry.token
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)  # greedy


def test_chat_top_logprobs_without_logprobs_is_refused(client, model):
    """Not an answer without the logprobs asked for, as OpenAI and vLLM do."""
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs set to true"):
        chat(client, model, "Name a color.", max_tokens=2, top_logprobs=3)


def test_chat_stream_logprobs_match(client, model):
    full = chat(client, model, "Name a color.", max_tokens=6, logprobs=True, top_logprobs=2)
    chunks = list(chat(client, model, "Name a color.", max_tokens=6, logprobs=True, top_logprobs=2, stream=True))
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == [e.token for e in full.choices[0].logprobs.content]


def test_chat_n_greedy_choices_agree(client, model):
    single = chat(client, model, "Name a fruit.", max_tokens=8)
    result = chat(client, model, "Name a fruit.", max_tokens=8, n=2)
    assert [c.index for c in result.choices] == [0, 1]
    assert all(
        c.message.role == "assistant" and c.message.content == single.choices[0].message.content for c in result.choices
    )
    assert result.usage.prompt_tokens == single.usage.prompt_tokens
    assert result.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_chat_stream_n_has_deltas_per_index(client, model):
    full = chat(client, model, "Name a fruit.", max_tokens=8, n=2)
    chunks = list(
        chat(client, model, "Name a fruit.", max_tokens=8, n=2, stream=True, stream_options={"include_usage": True})
    )
    contents: dict[int, str] = {}
    first_delta: dict[int, object] = {}
    finishes: dict[int, int] = {}
    for chunk in chunks[:-1]:
        choice = chunk.choices[0]
        first_delta.setdefault(choice.index, choice.delta)
        contents[choice.index] = contents.get(choice.index, "") + (choice.delta.content or "")
        finishes[choice.index] = finishes.get(choice.index, 0) + (choice.finish_reason is not None)
    assert all(first_delta[i].role == "assistant" for i in (0, 1))
    assert finishes == {0: 1, 1: 1}
    assert [contents[0], contents[1]] == [c.message.content for c in full.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_max_completion_tokens(client, model):
    result = chat(client, model, "Write a long story about a dragon.", max_completion_tokens=5)
    assert result.usage.completion_tokens == 5 and result.choices[0].finish_reason == "length"


def test_chat_system_message_reaches_the_model(client, model):
    def ask(system: str):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Who are you?"}]
        return client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=12)

    brief = ask("Be brief.")
    pirate = ask("You are a pirate named Blackbeard. Always speak like a pirate, with many arrrs.")
    assert pirate.usage.prompt_tokens > brief.usage.prompt_tokens + 5
    assert pirate.choices[0].message.content != brief.choices[0].message.content


def test_chat_multi_turn_with_assistant_message(client, model):
    result = client.chat.completions.create(
        model=model,
        temperature=0,
        max_tokens=8,
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "What is 2+2?"},
        ],
    )
    assert result.choices[0].message.content


def test_missing_model_is_accepted(http):
    result = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert result.status_code == 200, result.text
    result = http.post("/v1/completions", json={"model": "", "prompt": "Hi", "max_tokens": 2})
    assert result.status_code == 200, result.text


def test_logit_bias_bans_and_forces_tokens(http):
    def complete(**fields) -> str:
        body = {"prompt": "Name the capital of France.", "max_tokens": 3, "temperature": 0, **fields}
        result = http.post("/v1/completions", json=body)
        assert result.status_code == 200, result.text
        return result.json()["choices"][0]["text"]

    def native(logit_bias: dict) -> dict:
        params = {"max_new_tokens": 3, "temperature": 0, "logit_bias": logit_bias}
        return http.post("/generate", json={"text": "Name the capital of France.", "sampling_params": params}).json()

    free = native({})["output_ids"]
    assert native({str(free[0]): -100})["output_ids"][0] != free[0]  # banned: never picked
    assert complete(logit_bias={str(free[0]): -100}) != complete()
    forced = 28  # a token the model would not pick here: +100 makes it win every step
    result = native({str(forced): 100})
    assert free[0] != forced and result["output_ids"] == [forced] * 3
    assert complete(logit_bias={str(forced): 100}) == result["text"]
    assert_error(http.post("/v1/completions", json={"prompt": "Hi", "logit_bias": {"1": 200}}), 400, "logit_bias")


def test_fields_without_effect_are_accepted_and_unknown_ones_refused(http):
    body = {"prompt": "Hi", "max_tokens": 2, "user": "me", "logit_bias": {}, "store": False}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert_error(http.post("/v1/completions", json={**body, "some_future_field": [1]}), 400, "some_future_field")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ],
)
def test_fields_not_honoured_yet_are_400_not_ignored(client, model, fields, param):
    """A client asking for what sluice does not do must never get free text with a 200."""
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}], **fields
        )
    assert info.value.body["param"] == param and param in info.value.body["message"]


# ------------------------------------------------------------------ errors


def assert_error(response: httpx.Response, status_code: int, param: str | None = None) -> dict:
    assert response.status_code == status_code, response.text
    error = response.json()["error"]
    assert error["message"] and error["code"] == status_code
    if param is not None:
        assert error["param"] == param, error
        assert param.split(".")[0].split("[")[0] in error["message"], error
    return error


def test_unknown_model_is_404_with_the_envelope(http, client):
    result = http.post("/v1/completions", json={"model": "gpt-17", "prompt": "Hi", "max_tokens": 2})
    error = assert_error(result, 404, "model")
    assert "gpt-17" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"prompt": 5}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "stop": [1, 2]}, "stop[0]"),
        ("/v1/completions", {"prompt": "Hi", "echo": "yes"}, "echo"),
        ("/v1/chat/completions", {"messages": "Hi"}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "logprobs": 3}, "logprobs"),
    ],
)
def test_wrong_types_are_400_naming_the_field(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)


HI = {"messages": [{"role": "user", "content": "Hi"}]}
BAD_REF_SCHEMA = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
BAD_REF_FUNCTION = {"name": "f", "parameters": BAD_REF_SCHEMA}
BAD_REF_TOOL = {"type": "function", "function": BAD_REF_FUNCTION}
BAD_REF_STRICT = {**BAD_REF_FUNCTION, "strict": True}
BAD_REF_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": BAD_REF_SCHEMA}}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "Hi", "temperature": -0.5}, "temperature"),
        ("/v1/completions", {"prompt": "Hi", "top_p": 1.5}, "top_p"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": -1}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens"),
        ("/v1/completions", {"prompt": "Hi", "logprobs": 6}, "logprobs"),
        ("/v1/completions", {"prompt": "Hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 0}, "n"),
        # Refused before anything grows with it (it was a 500 past 2**62, GBs below).
        ("/v1/completions", {"prompt": "Hi", "n": 2**63}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 10**30}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2**63}, "n"),
        ("/v1/completions", {"prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/completions", {"prompt": ["Hi"] * 20, "n": 16}, "n"),
        ("/v1/completions", {"prompt": ["Hi"] * 257}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", [1, 2]]}, "prompt"),
        ("/v1/completions", {"prompt": ["Hi", ""]}, "prompt"),
        ("/v1/completions", {"prompt": [[1, 2], [99999999999]]}, "prompt"),
        ("/v1/completions", {"prompt": "Hi", "frequency_penalty": 3}, "frequency_penalty"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": ""}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": -3},
            "max_completion_tokens",
        ),
        # Past the context length: named by the field the client set (it was max_tokens).
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 10**9},
            "max_completion_tokens",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 10**9}, "max_tokens"),
        # A schema that cannot be compiled: named by the field that held it (it was json_schema).
        ("/v1/chat/completions", {**HI, "tools": [BAD_REF_TOOL], "tool_choice": "required"}, "tools"),
        ("/v1/chat/completions", {**HI, "tools": [{**BAD_REF_TOOL, "function": BAD_REF_STRICT}]}, "tools"),
        ("/v1/chat/completions", {**HI, "response_format": BAD_REF_FORMAT}, "response_format"),
        ("/v1/completions", {"prompt": "Hi", "response_format": BAD_REF_FORMAT}, "response_format"),
        ("/v1/chat/completions", {"messages": []}, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 17}, "n"),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, "messages[0].role"),
    ],
)
def test_out_of_range_values_are_400_naming_the_field(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)


def test_images_are_refused_with_a_reason(http):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}
    error = assert_error(http.post("/v1/chat/completions", json=body), 400)
    assert "does not accept images" in error["message"] and "SmolLM2" in error["message"]


def test_stream_errors_before_the_first_chunk_are_plain_400(http):
    result = http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "temperature": -1, "stream": True},
    )
    assert_error(result, 400, "temperature")


FUZZ_BODIES = [
    b"",
    b"null",
    b"[]",
    b"[1, 2]",
    b"42",
    b'"text"',
    b"{",
    b"{}",
    b'{"prompt": null}',
    b'{"messages": null}',
    b'{"prompt": "Hi", "max_tokens": 1e400}',
    b'{"prompt": "Hi", "max_tokens": 123456789012345678901234567890}',
    b'{"prompt": "Hi", "temperature": 1e400}',
    b'{"prompt": "Hi", "seed": -1}',
    b'{"prompt": "Hi", "seed": 1e30}',
    b'{"prompt": "Hi", "seed": 99999999999999999999}',
    b'{"prompt": "Hi", "top_k": 2624908444810720388203937792}',
    b'{"prompt": [99999999999]}',
    b'{"prompt": [-1]}',
    b'{"prompt": [[1, 2], "a"]}',
    b'{"prompt": [true]}',
    b'{"prompt": [[]]}',
    b'{"prompt": [{"a": 1}]}',
    b'{"prompt": {"nested": {"junk": [1, {"x": null}]}}}',
    b'{"prompt": "Hi", "stop": ""}',
    b'{"prompt": "Hi", "stop": {"a": 1}}',
    b'{"prompt": "Hi", "stream_options": "yes"}',
    b'{"prompt": "Hi", "stop_token_ids": [-5]}',
    b'{"prompt": "Hi", "top_k": -7}',
    b'{"prompt": "Hi", "logprobs": -1}',
    b'{"prompt": "Hi", "model": 7}',
    b'{"prompt": "\\ud800"}',
    b'{"messages": [{}]}',
    b'{"messages": [null]}',
    b'{"messages": [{"role": "user"}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
    b'{"messages": [{"role": "user", "content": [{"type": "audio", "x": 1}]}]}',
    b'{"messages": [{"role": "user", "content": [null]}]}',
    b'{"messages": [{"role": 1, "content": "x"}]}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 99999999}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "top_logprobs": -1}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "n": 0}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "stream": "true"}',
    b'{"messages": [{"role": "user", "content": "Hi"}], "top_p": 0}',
]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_no_input_gives_a_500(http, path):
    for body in FUZZ_BODIES:
        result = http.post(path, content=body, headers={"content-type": "application/json"})
        assert result.status_code < 500, (body, result.status_code, result.text)
        if result.status_code != 200:
            assert result.json()["error"]["message"], body


@pytest.mark.parametrize("shape, choices", [({"prompt": PROMPT}, 1), ({"prompt": PROMPTS, "n": 2}, 6)])
def test_stream_disconnect_aborts_the_request(base_url, http, model, shape, choices):
    """Every choice is aborted within seconds of the client leaving; none could have run its
    2,000 tokens by then."""
    before = wait_until_drained(base_url)
    body = {"model": model, **shape, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        next(response.iter_lines())
    aborted = finished_count(before, "abort") + choices
    states = wait_for_states(base_url, lambda s: finished_count(s, "abort") == aborted, "every choice aborted", 5)
    # n > 1 prefills each prompt once first (max_new_tokens 0): those end with "length".
    warmups = len(PROMPTS) if "n" in shape else 0
    assert finished_count(states, "length") == finished_count(before, "length") + warmups
    assert wait_until_drained(base_url, timeout_s=5)["kv_tokens_in_use"] == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_aborted_on_the_server_ends_as_an_error(base_url, http, model, stream):
    """OpenAI names no finish_reason for it (stop, length, tool_calls, content_filter):
    a request aborted with /abort_request ends with the error envelope, 503."""
    body = {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    result = {}

    def complete():
        with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=120) as response:
            result["status"] = response.status_code
            result["events"] = sse_events(response) if stream else [json.loads(response.read())]

    thread = threading.Thread(target=complete)
    thread.start()
    wait_until_running(base_url)
    http.post("/abort_request", json={"abort_all": True})
    thread.join(60)
    *events, last = result["events"]
    if stream:
        assert result["status"] == 200 and last == "[DONE]"
        last = events[-1]
        assert all(choice["finish_reason"] is None for event in events[:-1] for choice in event["choices"])
    else:
        assert result["status"] == 503
    assert last["error"]["code"] == 503 and "aborted" in last["error"]["message"]


# ------------------------------------------------------------------ tokenize / detokenize


def test_tokenize_and_detokenize_round_trip_non_ascii_text(http):
    text = "Grüße aus Zürich: 東京タワー, ½ € — naïve café 🚀"
    result = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
    assert result.status_code == 200, result.text
    body = result.json()
    assert body["count"] == len(body["tokens"]) > 10
    assert body["max_model_len"] == http.get("/get_model_info").json()["context_len"]
    assert http.post("/detokenize", json={"tokens": body["tokens"]}).json() == {"text": text}


def test_tokenize_refuses_a_text_far_past_the_context_without_tokenizing_all_of_it(http):
    """A 14 MB text took the HTTP process 1.7 GB and 10 s (four at once: 7 GB); one whose first
    part already holds more tokens than the context is now a 400, as /generate refuses it."""
    context = http.get("/get_model_info").json()["context_len"]
    text = "alpha beta gamma " * (100 * context // 17 + 1000)  # past the longest token (81 chars) x the context
    for body, param in (({"prompt": text}, "prompt"), ({"messages": [{"role": "user", "content": text}]}, "messages")):
        result = http.post("/tokenize", json=body)
        assert result.status_code == 400 and result.json()["error"]["param"] == param, result.text
        assert f"max_model_len={context}" in result.json()["error"]["message"]
    near = ("alpha beta gamma " * (context // 4)).rstrip()  # 3/4 of the context: counted whole
    assert http.post("/tokenize", json={"prompt": near}).json()["count"] == 3 * (context // 4)


def test_tokenize_chat_messages_counts_what_the_chat_route_prompts(http):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    counted = http.post("/tokenize", json={"messages": messages}).json()["count"]
    chat = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
    assert counted == chat["usage"]["prompt_tokens"]


def test_tokenize_chat_takes_the_chat_routes_prompt_fields(http):
    """vLLM's tokenize-chat request: how the prompt ends, template variables and tools change
    the tokens as they change the chat route's prompt; add_special_tokens false is what a
    chat gets anyway."""
    user = [{"role": "user", "content": "Hi there"}]

    def count(**fields) -> int:
        response = http.post("/tokenize", json={"messages": user, **fields})
        assert response.status_code == 200, response.text
        return response.json()["count"]

    with_prompt = count()
    assert count(add_special_tokens=False) == with_prompt
    assert count(add_generation_prompt=False) < with_prompt
    continued = [*user, {"role": "assistant", "content": "Hello! How"}]
    ends = http.post(
        "/tokenize", json={"messages": continued, "add_generation_prompt": False, "continue_final_message": True}
    ).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ends}).json()["text"].endswith("Hello! How")
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    tools = http.post("/tokenize", json={"messages": user, "tools": [tool]}).json()["tokens"]
    assert "get_weather" in http.post("/detokenize", json={"tokens": tools}).json()["text"]
    chat = http.post("/v1/chat/completions", json={"messages": user, "tools": [tool], "max_tokens": 1}).json()
    assert len(tools) == chat["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": "Hi", "add_generation_prompt": False}, "add_generation_prompt"),
        ("/tokenize", {"prompt": "Hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
        ("/tokenize", {"prompt": "Hi", "tools": []}, "tools"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "Hi"}], "continue_final_message": True},
            "continue_final_message",
        ),
        ("/detokenize", {"tokens": [1, -5]}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenize_bodies_are_400_naming_the_field(http, path, body, param):
    assert_error(http.post(path, json=body), 400, param)
