"""The native API through the real server and the real default model."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.helpers import (
    RunningServer,
    finished_count,
    generate,
    greedy,
    internal_states,
    moved,
    scrape,
    sse_events,
    wait_for_states,
    wait_until_drained,
    wait_until_running,
)

# "What is the capital of France?" is a near-tie for this model ("The" vs "L", 0.1 apart):
# quantized arithmetic answers "L'Étoile, ...", as llama.cpp does on the same GGUF. This
# wording has a clear margin (1.4+) in both the quantized and the float paths.
CHAT_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nName the capital of France.<|im_end|>\n<|im_start|>assistant\n"
)


def test_greedy_answer(base_url):
    r = generate(base_url, text=CHAT_PROMPT, sampling_params=greedy(20))
    assert r.status_code == 200, r.text
    body = r.json()
    assert "Paris" in body["text"]
    meta = body["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["prompt_tokens"] > 10 and meta["completion_tokens"] == len(body["output_ids"])
    assert meta["e2e_latency"] > 0 and meta["id"]


def test_stream_matches_non_stream(base_url):
    params = greedy(12, ignore_eos=True)
    whole = generate(base_url, text="Once upon a time", sampling_params=params).json()
    with httpx.stream(
        "POST",
        base_url + "/generate",
        json={"text": "Once upon a time", "sampling_params": params, "stream": True},
        timeout=120,
    ) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "matched": None, "length": 12}  # SGLang's
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_input_ids_and_cached_tokens(base_url):
    ids = [
        1,
        9690,
        198,
        2683,
        359,
        253,
        5356,
        5646,
        11173,
        3365,
        3511,
        308,
        34519,
        28,
        7018,
        411,
        407,
        19712,
        8182,
        2,
        198,
    ]
    first = generate(base_url, input_ids=ids, sampling_params=greedy(4)).json()
    second = generate(base_url, input_ids=ids, sampling_params=greedy(4)).json()
    assert second["output_ids"] == first["output_ids"]
    assert second["meta_info"]["cached_tokens"] >= len(ids) - 1


def test_logprobs(base_url):
    body = generate(
        base_url,
        text="The capital of France is",
        sampling_params=greedy(4),
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    ).json()
    meta = body["meta_info"]
    assert len(meta["output_token_logprobs"]) == 4
    for (logprob, token_id, _), tops in zip(meta["output_token_logprobs"], meta["output_top_logprobs"], strict=True):
        assert logprob <= 0 and len(tops) == 3
        assert tops[0][1] == token_id  # greedy picks the most likely token
    assert meta["input_token_logprobs"][0][0] is None
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"] == len(meta["input_top_logprobs"])


@pytest.mark.parametrize("stream", [False, True])
def test_return_text_in_logprobs_names_each_token(base_url, stream):
    """SGLang's [logprob, token_id, text]: the token's text, the same as the OpenAI routes'
    logprobs name it; the output's add up to its text."""
    body = dict(
        text="The capital of France is",
        sampling_params=greedy(6),
        return_logprob=True,
        top_logprobs_num=2,
        logprob_start_len=0,
        return_text_in_logprobs=True,
        stream=stream,
    )
    r = generate(base_url, **body)
    assert r.status_code == 200, r.text
    answer = sse_events(r)[-2] if stream else r.json()  # a stream's last event is [DONE]
    meta = answer["meta_info"]
    assert "".join(text for _, _, text in meta["output_token_logprobs"]) == answer["text"]
    assert "".join(text for _, _, text in meta["input_token_logprobs"]) == "The capital of France is"
    tops = [top for alternatives in meta["output_top_logprobs"] + meta["input_top_logprobs"] for top in alternatives]
    assert tops and all(isinstance(text, str) and text for _, _, text in tops)
    r = generate(base_url, **{**body, "return_text_in_logprobs": False})
    plain = sse_events(r)[-2] if stream else r.json()
    assert [text for _, _, text in plain["meta_info"]["output_token_logprobs"]] == [None] * 6


def test_return_text_in_logprobs_needs_return_logprob(base_url):
    r = generate(base_url, text="Hi", sampling_params=greedy(2), return_text_in_logprobs=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_text_in_logprobs"


def test_prompt_logprobs_without_top_logprobs_have_no_top_lists(base_url):
    body = generate(
        base_url, text="The capital of France is", sampling_params=greedy(2), return_logprob=True, logprob_start_len=0
    ).json()
    meta = body["meta_info"]
    assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert meta["input_top_logprobs"] == [] and meta["output_top_logprobs"] == []


def test_stop_string_trimmed_and_kept(base_url):
    params = greedy(40, stop=[" 7"])
    trimmed = generate(base_url, text="Count: 1, 2, 3,", sampling_params=params).json()
    assert trimmed["text"].endswith(" 6,") and "7" not in trimmed["text"]
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": " 7"}
    kept = generate(base_url, text="Count: 1, 2, 3,", sampling_params={**params, "no_stop_trim": True}).json()
    assert kept["text"].endswith(" 7")


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_waits_for_min_new_tokens(base_url, stream):
    """Like EOS, a stop string cannot end the output within its first min_new_tokens tokens."""
    body = {"text": "Count: 1, 2, 3,", "sampling_params": greedy(40, stop=[","], min_new_tokens=5), "stream": stream}
    if stream:
        with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as r:
            final = sse_events(r)[-2]
    else:
        final = generate(base_url, **body).json()
    assert final["text"].startswith(" 4, 5") and not final["text"].endswith(",")
    assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": ","}
    assert final["meta_info"]["completion_tokens"] > 5


def test_stream_never_shows_partial_stop_string(base_url):
    body = {"text": "Count: 1, 2, 3,", "sampling_params": greedy(40, stop=[" 7, 8"]), "stream": True}
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as r:
        chunks = sse_events(r)[:-1]
    texts = [c["text"] for c in chunks]
    assert texts[-1].endswith(" 6,")
    assert all(" 7" not in t for t in texts)


def test_skip_special_tokens_and_the_stop_token_trimmed(base_url):
    # A chat turn the model closes with <|im_end|> (id 2) by a wide margin (2.8 nats over the
    # runner-up at its last step), so the test does not hang on one greedy near-tie.
    text = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    shown = generate(base_url, text=text, sampling_params=greedy(60, skip_special_tokens=False, no_stop_trim=True))
    hidden = generate(base_url, text=text, sampling_params=greedy(60, no_stop_trim=True)).json()
    shown = shown.json()
    assert shown["output_ids"][-1] == 2 and shown["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    assert shown["text"].endswith("<|im_end|>") and "<|im_end|>" not in hidden["text"]
    # The stop token that ended the answer is not its text (as SGLang and vLLM trim it), but
    # stays in output_ids; the same for a stop token that is not special.
    trimmed = generate(base_url, text=text, sampling_params=greedy(60, skip_special_tokens=False)).json()
    assert trimmed["output_ids"] == shown["output_ids"] and trimmed["text"] == hidden["text"]
    period = generate(base_url, text="Count: 1, 2, 3,", sampling_params=greedy(40, stop_token_ids=[28])).json()
    assert period["output_ids"][-1] == 28 and not period["text"].endswith(",")
    assert period["meta_info"]["completion_tokens"] == len(period["output_ids"])


@pytest.mark.parametrize(
    "body, field",
    [
        ({"text": "hi", "sampling_params": {"temperature": -1}}, "temperature"),
        ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": "many"}}, "max_new_tokens"),
        ({"text": "hi", "sampling_params": {"top_k": 2**100}}, "top_k"),  # once a 500 and a leaked state
        ({"text": "hi", "sampling_params": {"repetition_penalty": 1e-45}}, "repetition_penalty"),  # once garbage
        ({"text": "hi", "input_ids": [1, 2]}, "text"),
        ({}, "text"),
        ({"input_ids": [99999999]}, "input_ids"),
        ({"text": ""}, "prompt"),
        ({"text": 5}, "text"),
        # Never silently ignored: unknown fields.
        ({"text": "hi", "sampling_params": {"random_seed": 3}}, "sampling_params.random_seed"),
        ({"text": "hi", "sampling_params": {"structural_tag": "{}"}}, "structural_tag must be"),
        ({"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 4}, "logprob_start_len"),
        # Without return_logprob there are no logprobs for them to shape: refused, not ignored.
        ({"text": "hi", "top_logprobs_num": 5}, "top_logprobs_num needs return_logprob: true"),
        ({"text": "hi", "logprob_start_len": 0}, "logprob_start_len needs return_logprob: true"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"x": 5}}}, "logit_bias"),
        # Other spellings of token 10: refused, or two keys could name one token.
        ({"text": "hi", "sampling_params": {"logit_bias": {"010": 1}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {" 10": 1}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"+10": 1}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"1_0": 1}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"\u0661\u0660": 1}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"9" * 5000: 1}}}, "logit_bias"),  # int() refuses it
        ({"text": "hi", "sampling_params": {"logit_bias": {"1": 101}}}, "logit_bias"),
        ({"text": "hi", "sampling_params": {"logit_bias": {"99999999": 1}}}, "logit_bias"),
        ({"text": "hi", "lora_path": "adapter"}, "lora_path"),
        # The server's own names for a request's samples (rid::i) are not a client's to take.
        ({"text": "hi", "rid": "job::0"}, "rid"),
        ({"text": ["hi", "ho"], "rid": ["a", "b::prefix"]}, "rid"),
        ({"text": "hi", "sampling_params": {"n": [2]}}, "n"),
        ({"text": "hi", "sampling_params": {"json_schema": "[" * 5000}}, "json_schema"),
    ],
)
def test_bad_input_is_400(base_url, body, field):
    r = generate(base_url, **body)
    assert r.status_code == 400, r.text
    assert field in r.json()["error"]["message"]


@pytest.mark.parametrize("prompts", [[], [[1]] * 257])  # empty, more than max_batch_items
def test_a_bad_list_of_input_ids_names_input_ids(base_url, prompts):
    r = generate(base_url, input_ids=prompts)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids", r.text


def test_too_long_input_names_both_numbers(base_url):
    info = httpx.get(base_url + "/get_model_info").json()
    limit, context = info["max_req_input_len"], info["context_len"]
    r = generate(base_url, input_ids=[100] * (limit + 1))
    assert r.status_code == 400 and str(limit + 1) in r.text and str(limit) in r.text
    r = generate(base_url, input_ids=[100] * 100, sampling_params={"max_new_tokens": context})
    assert r.status_code == 400 and "100" in r.text and str(context) in r.text


@pytest.mark.parametrize("prompt_field", ["text", "input_ids"])
def test_too_long_input_names_the_field_it_came_in(base_url, prompt_field):
    limit = httpx.get(base_url + "/get_model_info").json()["max_req_input_len"]
    prompt = " hello" * (limit + 1) if prompt_field == "text" else [100] * (limit + 1)
    for path, body in (("/generate", {prompt_field: prompt}), ("/encode", {prompt_field: prompt})):
        r = httpx.post(base_url + path, json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == prompt_field, (path, r.text)


@pytest.fixture(scope="module")
def capped():
    """A server whose requests may hold 64 tokens (the model's own: 8192)."""
    server = RunningServer("--context-length", "64", "--skip-warmup")
    yield server
    server.stop()


def test_context_length_caps_what_a_request_may_hold(capped):
    info = httpx.get(capped.base_url + "/get_model_info").json()
    assert info["context_len"] == 64 and info["max_req_input_len"] == 63
    r = generate(capped.base_url, input_ids=[100] * 40, sampling_params={"max_new_tokens": 30})
    assert r.status_code == 400 and "64" in r.json()["error"]["message"], r.text
    r = generate(capped.base_url, input_ids=[100] * 40, sampling_params=greedy(24, ignore_eos=True))
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 24, r.text


def test_stream_interval_sends_the_first_token_at_once_then_every_n():
    server = RunningServer("--stream-interval", "3", "--skip-warmup")
    try:
        body = {"text": "Once upon a time", "sampling_params": greedy(8, ignore_eos=True), "stream": True}
        with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 4, 7, 8]
    finally:
        server.stop()


def test_a_request_sets_its_own_stream_interval(base_url):
    params = {**greedy(8, ignore_eos=True), "stream_interval": 3}
    body = {"text": "Once upon a time", "sampling_params": params, "stream": True}
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=60) as r:
        events = sse_events(r)
    assert [e["meta_info"]["completion_tokens"] for e in events[:-1]] == [1, 4, 7, 8]
    r = generate(base_url, text="Hi", sampling_params={"stream_interval": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_interval", r.text


def test_malformed_bodies(base_url):
    for raw in (b"{", b"[1, 2]", b"null", b'"text"'):
        r = httpx.post(base_url + "/generate", content=raw, timeout=30)
        assert r.status_code == 400, (raw, r.text)
    big = b'{"text": "' + b"a" * (17 * 1024 * 1024) + b'"}'
    assert httpx.post(base_url + "/generate", content=big, timeout=60).status_code == 413


@pytest.mark.parametrize("first_n", [1, 2])
def test_duplicate_live_rid_is_400(base_url, first_n):
    """Also while the rid's n > 1 samples (`dup-rid::i`) run: a request reusing it would be
    aborted with them and share their streams."""
    body = {"text": "Tell me a long story.", "rid": "dup-rid", "sampling_params": greedy(4000, ignore_eos=True)}
    first = {}
    first_body = {**body, "sampling_params": {**body["sampling_params"], "n": first_n}}
    thread = threading.Thread(target=lambda: first.update(r=generate(base_url, **first_body)))
    thread.start()
    wait_until_running(base_url)
    seconds = [generate(base_url, **body), generate(base_url, **first_body)]
    httpx.post(base_url + "/abort_request", json={"rid": "dup-rid"})
    thread.join(60)
    assert first["r"].status_code == 200
    for second in seconds:
        error = second.json()["error"]
        # The same whichever worker refused it (the router, when another worker has the rid).
        assert second.status_code == 400 and "dup-rid" in error["message"] and error["param"] == "rid"
    wait_until_drained(base_url)


def test_health_and_info_routes(base_url):
    assert httpx.get(base_url + "/health").status_code == 200
    assert httpx.get(base_url + "/health_generate", timeout=60).status_code == 200
    info = httpx.get(base_url + "/get_model_info").json()
    assert info["context_len"] == 8192 and info["is_generation"]
    server_info = httpx.get(base_url + "/get_server_info").json()
    assert "api_key" not in server_info and server_info["max_total_tokens"] == 20000
    states = wait_until_drained(base_url)
    # Idle: nothing in use, every slot free or holding evictable cached prefixes.
    assert states["kv_tokens_total"] == 20000 and states["kv_tokens_in_use"] == 0
    assert states["kv_tokens_free"] + states["kv_tokens_cached"] == states["kv_tokens_total"]
    assert states["num_paused_reqs"] == 0
    # At least every worker's warm-up and the generation /health_generate just ran have ended.
    assert sum(states["finished_reqs"].values()) >= 1 + server_info["tokenizer_worker_num"]


@pytest.mark.parametrize("path", ["/flush_cache", "/continue_generation"])
def test_routes_without_a_body_take_none_or_an_empty_object(base_url, path):
    for body in (b"", b"{}"):
        r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"}, timeout=60)
        assert r.status_code == 200, r.text
    r = httpx.post(base_url + path, json={"timeout": 5}, timeout=60)  # would change nothing: refused
    assert r.status_code == 400 and "timeout" in r.json()["error"]["message"], r.text
    r = httpx.post(base_url + path, content=b"\x00\xff", headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text


def test_flush_cache(base_url):
    generate(base_url, text="Remember this prefix please", sampling_params=greedy(2))
    assert httpx.post(base_url + "/flush_cache", timeout=60).json() == {"success": True}
    assert internal_states(base_url)["kv_tokens_cached"] == 0
    # While a request runs the flush is refused at once: it does not wait for the stream,
    # which would hold every new request back meanwhile.
    body = {"text": "Tell me a long story.", "rid": "flush-me", "sampling_params": greedy(4000, ignore_eos=True)}
    thread = threading.Thread(target=generate, args=(base_url,), kwargs=body)
    thread.start()
    wait_until_running(base_url)
    refused = httpx.post(base_url + "/flush_cache", timeout=10)
    assert generate(base_url, text="Hi", sampling_params=greedy(2)).status_code == 200
    httpx.post(base_url + "/abort_request", json={"rid": "flush-me"})
    thread.join(60)
    assert refused.status_code == 400 and "requests are running" in refused.json()["error"]["message"]
    wait_until_drained(base_url)


def test_abort_request_by_rid(base_url):
    body = {"text": "Write a very long essay.", "rid": "to-abort", "sampling_params": greedy(4000, ignore_eos=True)}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=generate(base_url, **body)))
    thread.start()
    wait_until_running(base_url)
    assert httpx.post(base_url + "/abort_request", json={"rid": "to-abort"}).status_code == 200
    thread.join(60)
    meta = result["r"].json()["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    assert httpx.post(base_url + "/abort_request", json={}).status_code == 400
    # A misspelled field is refused, not read as an empty body (or, with abort_all, as all).
    r = httpx.post(base_url + "/abort_request", json={"rids": ["to-abort"], "abort_all": True})
    assert r.status_code == 400 and "rids" in r.json()["error"]["message"], r.text


def test_pause_holds_new_requests(base_url):
    assert httpx.post(base_url + "/pause_generation").status_code == 200
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=generate(base_url, text="Hi", sampling_params=greedy(2))))
    try:
        thread.start()
        states = wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 1, "the request held by the pause")
        assert "r" not in result and states["rid_to_state_size"] == 0 and states["num_running_reqs"] == 0
        # The health probe would wait behind the pause as the request does: the server says so.
        probe = httpx.get(base_url + "/health_generate", timeout=60)
        assert probe.status_code == 200 and probe.json() == {"status": "paused"}
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200
    thread.join(60)
    assert result["r"].status_code == 200 and result["r"].json()["meta_info"]["completion_tokens"] == 2
    assert internal_states(base_url)["num_paused_reqs"] == 0
    assert httpx.get(base_url + "/health_generate", timeout=60).status_code == 200


def test_an_abort_ends_a_request_held_by_a_pause(base_url):
    """The held request is at no Scheduler yet: /abort_request ends it at the pause, by rid or
    all of them, and it never runs."""
    sent = internal_states(base_url)["messages_received"].get("TokenizedGenerateReqInput", 0)
    metrics = scrape(base_url)
    rids = {"by_rid": f"held-{time.time_ns()}", "all": f"held-all-{time.time_ns()}"}
    result = {}

    def send(key: str) -> None:
        result[key] = generate(base_url, text="Hi", rid=rids[key], sampling_params=greedy(2))

    assert httpx.post(base_url + "/pause_generation").status_code == 200
    threads = [threading.Thread(target=send, args=(key,)) for key in rids]
    try:
        for thread in threads:
            thread.start()
        wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 2, "both requests held")
        assert httpx.post(base_url + "/abort_request", json={"rid": rids["by_rid"]}).status_code == 200
        wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 1, "the named request ended")
        assert list(result) == ["by_rid"]
        assert httpx.post(base_url + "/abort_request", json={"abort_all": True}).status_code == 200
        for thread in threads:
            thread.join(60)
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200
    for response in result.values():
        meta = response.json()["meta_info"]
        assert response.status_code == 200 and meta["finish_reason"]["type"] == "abort"
        assert meta["completion_tokens"] == 0
    received = internal_states(base_url)["messages_received"].get("TokenizedGenerateReqInput", 0)
    assert received == sent  # neither reached the Scheduler
    assert moved(metrics, scrape(base_url), "sluice:requests_total{finish_reason=abort}") == 2


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ("/generate", {"text": ["Hi", "Yo"], "sampling_params": [{}, {"regex": "(unclosed"}]}, "regex"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}, "temperature"),
    ],
)
def test_a_bad_request_is_refused_at_once_during_a_pause(base_url, path, body, param):
    """Not held until generation continues (or ended as aborted by an abort meanwhile)."""
    assert httpx.post(base_url + "/pause_generation").status_code == 200
    try:
        response = httpx.post(base_url + path, json=body, timeout=10)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200


def test_a_request_whose_client_leaves_during_a_pause_is_dropped(base_url):
    """It neither waits for the pause to end nor runs after it."""
    before = internal_states(base_url)

    def give_up_early():
        with pytest.raises(httpx.TimeoutException):
            generate(base_url, timeout_s=2, text="Hi", sampling_params=greedy(2))

    assert httpx.post(base_url + "/pause_generation").status_code == 200
    try:
        thread = threading.Thread(target=give_up_early)
        thread.start()
        wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 1, "the request held by the pause")
        thread.join(30)
        wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 0, "the held request dropped")
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200
    states = wait_until_drained(base_url)
    assert sum(states["finished_reqs"].values()) == sum(before["finished_reqs"].values())  # it never ran


def test_pause_in_abort_mode_aborts_the_running_requests(base_url):
    """SGLang's {"mode": "abort"}: the running requests end as aborted, new ones wait; a
    mode sluice does not have is a 400 naming it, not a pause of another kind."""
    refused = httpx.post(base_url + "/pause_generation", json={"mode": "in_place"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "mode"
    body = {"text": "Write a very long essay.", "sampling_params": greedy(4000, ignore_eos=True)}
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=generate(base_url, **body)))
    thread.start()
    wait_until_running(base_url)
    try:
        assert httpx.post(base_url + "/pause_generation", json={"mode": "abort"}).status_code == 200
        thread.join(60)
        meta = result["r"].json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 4000
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200
    wait_until_drained(base_url)


@pytest.mark.parametrize("delay_s", [0.01, 0.02, 0.04, 0.08])
@pytest.mark.parametrize(
    "text, n",
    [("Hi", 3), ("hello world " * 3500, 1)],  # ~7 K tokens: tokenized on a thread for tens of ms
    ids=["samples", "long-prompt"],
)
def test_an_abort_while_the_request_comes_in_is_not_lost(base_url, text, n, delay_s):
    """The abort may reach the server while the request is tokenized, or between an n > 1
    warm-up and its samples: both times the Scheduler does not have the request yet, and
    the abort it got first was lost while /abort_request answered success."""
    rid = f"early-{n}-{delay_s}"
    results: list[httpx.Response] = []
    body = {"text": text, "rid": rid, "sampling_params": greedy(48, ignore_eos=True, n=n)}
    sent = threading.Event()

    def body_then_mark_sent():
        yield json.dumps(body).encode()
        sent.set()  # the body is on the socket: the delay counts from here, not from a thread's start

    def send():
        headers = {"content-type": "application/json"}
        results.append(httpx.post(base_url + "/generate", content=body_then_mark_sent(), headers=headers, timeout=120))

    sender = threading.Thread(target=send)
    sender.start()
    assert sent.wait(30)
    time.sleep(delay_s)
    assert httpx.post(base_url + "/abort_request", json={"rid": rid}, timeout=30).json() == {"success": True}
    sender.join(120)
    [response] = results
    outputs = response.json() if n > 1 else [response.json()]
    assert [out["meta_info"]["finish_reason"]["type"] for out in outputs] == ["abort"] * n, response.text[:300]
    wait_until_drained(base_url)


def test_disconnected_clients_are_aborted(base_url):
    """20 clients leave mid-generation: every request is aborted, long before it could have
    finished (2,000 tokens each), and its KV freed."""
    before = wait_until_drained(base_url)

    def leave_early(i: int, stream: bool):
        body = {"text": f"Story number {i}:", "sampling_params": greedy(2000, ignore_eos=True), "stream": stream}
        try:
            with httpx.stream("POST", base_url + "/generate", json=body, timeout=3) as r:
                for _ in r.iter_lines():
                    break
        except httpx.TimeoutException:
            pass  # a non-streaming client that gave up waiting

    threads = [threading.Thread(target=leave_early, args=(i, i % 2 == 0)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    aborted = finished_count(before, "abort") + 20
    states = wait_for_states(base_url, lambda s: finished_count(s, "abort") == aborted, "20 aborts", timeout_s=5)
    assert finished_count(states, "length") == finished_count(before, "length")  # none ran to its end
    states = wait_until_drained(base_url, timeout_s=5)
    assert states["kv_tokens_in_use"] == 0


def test_rid_to_state_is_empty_after_every_ending(base_url):
    generate(base_url, text="Hi", sampling_params=greedy(2))  # final chunk
    generate(base_url, text="Hi", sampling_params={"top_k": -5})  # error before dispatch
    generate(base_url, input_ids=[100] * 9000)  # refused by validation
    wait_until_drained(base_url)


def test_a_batch_item_that_fails_ends_the_others_at_once(base_url):
    """Without streaming the answer is the first failure, so the batch's other items are
    aborted rather than run on for nothing (a stream's error event ends them too)."""
    before = scrape(base_url)
    failing = {"regex": "a", "min_new_tokens": 3, "max_new_tokens": 8}
    body = {"text": ["Once upon a time", "Answer:"], "sampling_params": [greedy(1500, ignore_eos=True), failing]}
    response = httpx.post(base_url + "/generate", json=body, timeout=300)
    assert response.status_code == 400 and response.json()["error"]["message"].startswith("item 1: "), response.text
    wait_until_drained(base_url)
    after = scrape(base_url)
    assert moved(before, after, "sluice:requests_total{finish_reason=length}") == 0
    assert moved(before, after, "sluice:requests_total{finish_reason=abort}") == 2


def test_max_new_tokens_left_out_or_null_takes_the_room_the_context_leaves(capped):
    """As SGLang: null ran 128 tokens (the default) where the client asked for no limit; left
    out, the default of 128 was a 400 against a 64-token context. Every other null is the
    parameter's default (temperature, top_p and n were 400s)."""
    nulls = {"temperature": None, "top_p": None, "n": None, "ignore_eos": True}
    for params in ({"max_new_tokens": None, **nulls}, {"ignore_eos": True}):
        r = generate(capped.base_url, input_ids=[100] * 40, sampling_params=params)
        assert r.status_code == 200, (params, r.text)
        meta = r.json()["meta_info"]
        assert meta["completion_tokens"] == 24 and meta["finish_reason"]["type"] == "length", (params, meta)


def test_sglang_s_sampling_seed_is_the_seed(base_url):
    """SGLang's name of the field was refused as unsupported ("leave it out")."""
    params = {"max_new_tokens": 8, "temperature": 1.0}
    texts = [
        generate(base_url, text="Tell me a story:", sampling_params={**params, key: 7}).json()["text"]
        for key in ("seed", "sampling_seed")
    ]
    assert texts[0] == texts[1]
    r = generate(base_url, text="Hi", sampling_params={**params, "seed": 1, "sampling_seed": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.sampling_seed", r.text
