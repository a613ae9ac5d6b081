"""Batch requests and parallel sampling (seed 000) through the real server."""

from __future__ import annotations

import threading

import httpx

from tests.helpers import (
    finished_count,
    generate,
    greedy,
    internal_states,
    sse_events,
    wait_until_drained,
    wait_until_running,
)


def requests_received(base_url: str) -> dict[str, int]:
    counts = internal_states(base_url)["messages_received"]
    return {k: v for k, v in counts.items() if "GenerateReqInput" in k}


TEXTS = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(16)]


def test_batch_of_texts_is_one_message_and_matches_singles(base_url):
    before = internal_states(base_url)["messages_received"]
    r = generate(base_url, text=TEXTS, sampling_params=greedy(6))
    assert r.status_code == 200, r.text
    results = r.json()
    after = internal_states(base_url)["messages_received"]
    assert after.get("BatchTokenizedGenerateReqInput", 0) == before.get("BatchTokenizedGenerateReqInput", 0) + 1
    assert after.get("TokenizedGenerateReqInput", 0) == before.get("TokenizedGenerateReqInput", 0)
    assert [res["index"] for res in results] == list(range(16))
    assert len({res["meta_info"]["id"] for res in results}) == 16
    assert all(res["meta_info"]["path"] == "batch" for res in results)
    for i in (0, 7, 15):
        single = generate(base_url, text=TEXTS[i], sampling_params=greedy(6)).json()
        assert single["meta_info"]["path"] == "single"
        assert results[i]["output_ids"] == single["output_ids"]


def test_batch_of_input_ids_with_per_item_params_and_rids(base_url):
    ids = [[1, 9690, 198, 2683], [504, 3575, 282, 4649, 314]]
    r = generate(
        base_url,
        input_ids=ids,
        rid=["a-1", "a-2"],
        sampling_params=[greedy(3, ignore_eos=True), greedy(5, ignore_eos=True)],
    )
    results = r.json()
    assert [res["meta_info"]["id"] for res in results] == ["a-1", "a-2"]
    assert [res["meta_info"]["completion_tokens"] for res in results] == [3, 5]


def test_batch_with_per_item_logprob_fields(base_url):
    """As SGLang takes them: return_logprob, top_logprobs_num and logprob_start_len may be
    one value per prompt."""
    ids = [[1, 9690, 198, 2683], [504, 3575, 282, 4649, 314], [504, 3575]]
    r = generate(
        base_url,
        input_ids=ids,
        sampling_params=greedy(3, ignore_eos=True),
        return_logprob=[True, False, True],
        top_logprobs_num=[2, 0, 0],
        logprob_start_len=[0, -1, 1],
    )
    assert r.status_code == 200, r.text
    first, second, third = (res["meta_info"] for res in r.json())
    assert len(first["output_token_logprobs"]) == 3 and [len(tops) for tops in first["output_top_logprobs"]] == [2] * 3
    assert len(first["input_token_logprobs"]) == 4
    assert "output_token_logprobs" not in second
    assert len(third["output_token_logprobs"]) == 3 and third["output_top_logprobs"] == []
    assert len(third["input_token_logprobs"]) == 1  # from position 1 of 2
    # One value for every item is taken where some item has logprobs, and holds for those.
    body = dict(input_ids=ids[:2], sampling_params=greedy(2), return_logprob=[False, True], top_logprobs_num=3)
    r = generate(base_url, **body)
    assert r.status_code == 200, r.text
    first, second = (res["meta_info"] for res in r.json())
    assert "output_top_logprobs" not in first and [len(tops) for tops in second["output_top_logprobs"]] == [3, 3]


def test_per_item_logprob_fields_are_checked(base_url):
    ids = [[1, 9690, 198], [504, 3575]]
    cases = [
        (dict(input_ids=ids[0], return_logprob=[True]), "return_logprob", "one value for a single prompt"),
        (dict(input_ids=ids, return_logprob=[True, False, True]), "return_logprob", "3 entries for 2 prompts"),
        (dict(input_ids=ids, return_logprob=[True, False], top_logprobs_num=[0, 2]), "top_logprobs_num", "item 1:"),
        (dict(input_ids=ids, return_logprob=False, top_logprobs_num=2), "top_logprobs_num", "needs return_logprob"),
        (dict(input_ids=ids, return_logprob=True, top_logprobs_num=[1, 50]), "top_logprobs_num", "<= 20"),
        (dict(input_ids=ids, return_logprob=True, logprob_start_len=[0, 9]), "logprob_start_len", "past the prompt"),
    ]
    for body, param, message in cases:
        r = generate(base_url, sampling_params=greedy(2), **body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and message in r.json()["error"]["message"], r.text


def test_parallel_sampling_reuses_the_prefix(base_url):
    prompt = "Write a short poem about the sea, the sky and the wind." * 3
    r = generate(base_url, text=prompt, sampling_params={"n": 4, "max_new_tokens": 8, "temperature": 1.0})
    assert r.status_code == 200, r.text
    results = r.json()
    assert [res["index"] for res in results] == [0, 1, 2, 3]
    prompt_tokens = results[0]["meta_info"]["prompt_tokens"]
    for res in results:
        assert res["meta_info"]["path"] == "parallel_sample"
        assert res["meta_info"]["cached_tokens"] >= prompt_tokens - 1
    assert len({res["meta_info"]["id"] for res in results}) == 4
    wait_until_drained(base_url)


def test_batch_times_n_indexes(base_url):
    r = generate(
        base_url, text=["1, 2, 3,", "a, b, c,"], sampling_params={"n": 3, "max_new_tokens": 3, "temperature": 0}
    )
    results = r.json()
    assert [res["index"] for res in results] == list(range(6))
    # Greedy samples of the same prompt agree; index // n names the prompt.
    assert results[0]["text"] == results[1]["text"] == results[2]["text"]
    assert results[3]["text"] == results[4]["text"] == results[5]["text"] != results[0]["text"]


def test_seeded_samples_differ_and_repeat(base_url):
    params = {"n": 3, "max_new_tokens": 8, "temperature": 1.0, "seed": 42}
    first = [res["text"] for res in generate(base_url, text="Once upon a time", sampling_params=params).json()]
    again = [res["text"] for res in generate(base_url, text="Once upon a time", sampling_params=params).json()]
    assert first == again
    assert len(set(first)) > 1


def test_streaming_batch_interleaves_and_ends_each_index_once(base_url):
    body = {
        "text": ["Hello", "Goodbye"],
        "sampling_params": {"n": 2, "max_new_tokens": 5, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=120) as r:
        events = sse_events(r)
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]"
    chunks = events[:-1]
    finals = [c["index"] for c in chunks if c["meta_info"]["finish_reason"] is not None]
    assert sorted(finals) == [0, 1, 2, 3]
    assert {c["index"] for c in chunks} == {0, 1, 2, 3}


def test_invalid_item_fails_the_whole_request(base_url):
    before = requests_received(base_url)
    r = generate(base_url, text=["fine", "also fine"], sampling_params=[greedy(2), {"temperature": -1}])
    assert r.status_code == 400 and "item 1" in r.json()["error"]["message"]
    r = generate(base_url, input_ids=[[1, 2], [10**9]])
    assert r.status_code == 400 and "item 1" in r.json()["error"]["message"]
    assert requests_received(base_url) == before  # nothing was sent
    wait_until_drained(base_url)


def test_size_limits_are_checked_first(base_url):
    r = generate(base_url, text=["x"] * 100_000)
    assert r.status_code == 400 and "max_batch_items" in r.text
    r = generate(base_url, text="x", sampling_params={"n": 1_000_000})
    assert r.status_code == 400 and "max_n" in r.text
    r = generate(base_url, text=["x"] * 20, sampling_params={"n": 16})
    assert r.status_code == 400 and "max_batch_items" in r.text
    r = generate(base_url, text=["x", "y"], sampling_params=[{"n": 2}, {"n": 3}])
    assert r.status_code == 400 and "same n" in r.text
    r = generate(base_url, text=["x", "y"], rid=["same", "same"])
    assert r.status_code == 400


def test_aborting_the_parent_rid_aborts_every_child(base_url):
    before = wait_until_drained(base_url)
    body = {
        "text": "Tell me a long story.",
        "rid": "parent-1",
        "sampling_params": {"n": 3, "max_new_tokens": 4000, "ignore_eos": True},
    }
    result = {}
    thread = threading.Thread(target=lambda: result.update(r=generate(base_url, **body)))
    thread.start()
    wait_until_running(base_url)
    httpx.post(base_url + "/abort_request", json={"rid": "parent-1"})
    thread.join(60)
    results = result["r"].json()
    assert len(results) == 3
    assert all(res["meta_info"]["finish_reason"]["type"] == "abort" for res in results)
    states = wait_until_drained(base_url)
    assert finished_count(states, "abort") == finished_count(before, "abort") + 3
    assert states["kv_tokens_in_use"] == 0
