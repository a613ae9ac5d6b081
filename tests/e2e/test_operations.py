"""Operating the server (issue 16): /metrics, request timings, a bounded queue, priorities."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import (
    RunningServer,
    generate,
    greedy,
    internal_states,
    moved,
    scrape,
    wait_for_states,
    wait_until_drained,
    wait_until_running,
)


def test_metrics_count_exactly_what_was_served(base_url):
    before = scrape(base_url)
    prompts = [f"Count to {i}." for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        results = list(
            pool.map(lambda p: generate(base_url, text=p, sampling_params=greedy(8, ignore_eos=True)), prompts)
        )
    assert all(r.status_code == 200 for r in results)
    # Neither a health probe nor a request a gateway sends with log_metrics: false is traffic.
    assert httpx.get(base_url + "/health_generate", timeout=60).status_code == 200
    unlogged = generate(base_url, text="Hi", sampling_params=greedy(8, ignore_eos=True), log_metrics=False)
    assert unlogged.status_code == 200
    prompt_tokens = sum(r.json()["meta_info"]["prompt_tokens"] for r in results)
    cached_tokens = sum(r.json()["meta_info"]["cached_tokens"] for r in results)
    wait_until_drained(base_url)
    after = scrape(base_url)
    assert moved(before, after, "sluice:generation_tokens_total") == 48
    assert after["sluice:scheduler_up"] == 1
    assert moved(before, after, "sluice:prompt_tokens_total") == prompt_tokens
    assert moved(before, after, "sluice:cached_tokens_total") == cached_tokens
    assert moved(before, after, "sluice:requests_total{finish_reason=length}") == 6
    for histogram in ("time_to_first_token", "e2e_request_latency", "queue_time", "inter_token_latency"):
        assert moved(before, after, f"sluice:{histogram}_seconds_count") == 6, histogram
    assert moved(before, after, "sluice:time_to_first_token_seconds_bucket{le=+Inf}") == 6
    assert after["sluice:num_requests_running"] == 0 and after["sluice:num_requests_waiting"] == 0
    assert after["sluice:kv_cache_usage_ratio"] == 0
    assert "sluice:num_retractions" in after
    assert after["sluice:num_failed_steps"] == 0


def test_requests_whose_client_left_while_a_pause_held_them_count_as_aborted(base_url):
    """Dropped at the gate, never run: counted in requests_total as aborts, as the README says
    of every request a pause held and something ended."""
    before = scrape(base_url)
    assert httpx.post(base_url + "/pause_generation").status_code == 200
    try:
        for body in ({"text": "Hi", "sampling_params": greedy(2)}, {"text": "Hi", "sampling_params": greedy(2, n=2)}):
            with pytest.raises(httpx.TimeoutException):
                httpx.post(base_url + "/generate", json=body, timeout=0.3)
        wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 0, "the held requests dropped", timeout_s=10)
    finally:
        assert httpx.post(base_url + "/continue_generation").status_code == 200
    assert moved(before, scrape(base_url), "sluice:requests_total{finish_reason=abort}") == 3


def test_the_gauges_show_a_running_request(base_url):
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(generate, base_url, text="Tell a story.", sampling_params=greedy(64, ignore_eos=True))
        wait_until_running(base_url)
        samples = scrape(base_url)
        assert samples["sluice:num_requests_running"] >= 1
        assert 0 < samples["sluice:kv_cache_usage_ratio"] <= 1
        assert running.result().status_code == 200


def test_timings_say_when_each_stage_happened(base_url):
    response = generate(base_url, text="Hi", sampling_params=greedy(4), return_timings=True)
    meta = response.json()["meta_info"]
    timings = meta["timings"]
    stages = ["received", "tokenized", "first_scheduled", "first_token", "finished"]
    assert list(timings) == stages
    values = [timings[stage] for stage in stages]
    assert values == sorted(values) and values[0] == 0
    assert timings["finished"] == pytest.approx(meta["e2e_latency"], abs=0.05)
    assert "timings" not in generate(base_url, text="Hi", sampling_params=greedy(4)).json()["meta_info"]


@pytest.mark.parametrize("priority", [-1, 1.5, "high", True])
def test_a_bad_priority_is_refused(base_url, priority):
    response = generate(base_url, text="Hi", sampling_params=greedy(2), priority=priority)
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "priority"


def test_priority_without_the_priority_policy_is_refused(base_url):
    response = generate(base_url, text="Hi", sampling_params=greedy(2), priority=3)
    assert response.status_code == 400
    assert "--schedule-policy priority" in response.json()["error"]["message"]
    assert generate(base_url, text="Hi", sampling_params=greedy(2), priority=0).status_code == 200


def test_metrics_need_the_api_key_and_leave_out_the_warm_up():
    server = RunningServer("--api-key", "k3y")
    try:
        assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 401
        samples = scrape(server.base_url, headers={"Authorization": "Bearer k3y"})
        # The server's own warm-up generation is not a client's request.
        assert samples["sluice:generation_tokens_total"] == 0
        assert not [name for name, value in samples.items() if name.startswith("sluice:requests_total") and value]
    finally:
        server.stop()


@pytest.fixture(scope="module")
def small_queue_server():
    server = RunningServer("--max-running-requests", "2", "--max-queued-requests", "4", "--skip-warmup")
    yield server
    server.stop()


def test_a_full_queue_answers_503_and_serves_the_rest(small_queue_server):
    base_url = small_queue_server.base_url
    before = scrape(base_url)
    body = {"text": "Write a long story about a ship.", "sampling_params": greedy(48, ignore_eos=True)}
    with ThreadPoolExecutor(30) as pool:
        responses = list(pool.map(lambda _: httpx.post(base_url + "/generate", json=body, timeout=300), range(30)))
    busy = [r for r in responses if r.status_code == 503]
    served = [r for r in responses if r.status_code == 200]
    assert len(busy) + len(served) == 30
    # 2 run and 4 wait (more are served as earlier ones end).
    assert len(busy) >= 30 - 6 - 6 and len(served) >= 6
    for response in busy:
        error = response.json()["error"]
        assert error["code"] == 503 and "max-queued-requests" in error["message"]
        assert response.headers["retry-after"] == "1"
    assert all(r.json()["meta_info"]["completion_tokens"] == 48 for r in served)
    wait_until_drained(base_url)
    after = scrape(base_url)
    assert moved(before, after, "sluice:requests_rejected_total{reason=queue_full}") == len(busy)
    assert moved(before, after, "sluice:requests_total{finish_reason=length}") == len(served)


def test_a_request_of_more_items_than_the_server_holds_is_a_400_not_a_503(small_queue_server):
    """2 running + 4 queued: 7 items arriving together could never all be taken, so a client
    told to retry (503) would retry for ever. 6 are served."""
    base_url = small_queue_server.base_url
    cases = [
        ("/generate", {"text": "Hi", "sampling_params": greedy(2, n=7)}, "n"),
        ("/generate", {"text": ["Hi"] * 7, "sampling_params": greedy(2)}, "text"),
        ("/v1/completions", {"prompt": "Hi", "n": 7, "max_tokens": 2}, "n"),
        ("/v1/completions", {"prompt": ["Hi"] * 7, "max_tokens": 2}, "prompt"),
        ("/v1/embeddings", {"input": ["Hi"] * 7}, "input"),
        ("/encode", {"text": ["Hi"] * 7}, "text"),
    ]
    for route, body, param in cases:
        response = httpx.post(base_url + route, json=body, timeout=60)
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "holds at once: 6" in error["message"], error
    served = httpx.post(base_url + "/generate", json={"text": ["Hi"] * 6, "sampling_params": greedy(2)}, timeout=60)
    assert served.status_code == 200 and len(served.json()) == 6
    wait_until_drained(base_url)


@pytest.fixture(scope="module")
def small_token_queue_server():
    server = RunningServer("--max-running-requests", "2", "--max-total-queued-tokens", "64", "--skip-warmup")
    yield server
    server.stop()


def test_a_request_whose_queued_prompts_pass_the_token_limit_is_a_400_not_a_503(small_token_queue_server):
    """2 run at once, 64 prompt tokens queue: of 4 prompts of 40 tokens arriving together, the
    last 2 would queue 80 tokens, which an idle server refuses too (the first queued prompt
    is taken whatever its length, the second not), so a client told to retry (503) would
    retry for ever."""
    base_url = small_token_queue_server.base_url
    long, short = [100] * 40, [100] * 30
    cases = [
        ("/generate", {"input_ids": [long] * 4, "sampling_params": greedy(2)}, "input_ids"),
        ("/generate", {"input_ids": long, "sampling_params": greedy(2, n=4)}, "n"),
        ("/v1/completions", {"prompt": [long] * 4, "max_tokens": 2}, "prompt"),
        ("/v1/completions", {"prompt": long, "n": 4, "max_tokens": 2}, "n"),
        ("/v1/embeddings", {"input": [long] * 4}, "input"),
    ]
    for route, body, param in cases:
        response = httpx.post(base_url + route, json=body, timeout=60)
        assert response.status_code == 400, (route, response.text)
        error = response.json()["error"]
        assert error["param"] == param and "--max-total-queued-tokens 64" in error["message"], error
        assert "past the 2 that run at once" in error["message"] and "hold 80" in error["message"], error
    # What an idle server takes is served: 2 x 30 queued tokens, or one long prompt queued alone.
    for prompts in ([short] * 4, [[100] * 200] * 3):
        served = httpx.post(
            base_url + "/generate", json={"input_ids": prompts, "sampling_params": greedy(2)}, timeout=60
        )
        assert served.status_code == 200, served.text
        assert [item["meta_info"]["completion_tokens"] for item in served.json()] == [2] * len(prompts)
    wait_until_drained(base_url)


def test_a_paused_server_whose_held_requests_fill_the_queue_is_still_healthy(small_queue_server):
    """The health probe, refused by a queue full of requests held by a pause, says paused."""
    base_url = small_queue_server.base_url
    assert httpx.post(base_url + "/pause_generation").status_code == 200
    body = {"text": "Hi", "sampling_params": greedy(2)}
    with ThreadPoolExecutor(6) as pool:
        try:
            held = [pool.submit(httpx.post, base_url + "/generate", json=body, timeout=120) for _ in range(6)]
            wait_for_states(base_url, lambda s: s["num_paused_reqs"] == 6, "6 requests held (2 running + 4 queued)")
            probe = httpx.get(base_url + "/health_generate", timeout=60)
            assert probe.status_code == 200 and probe.json() == {"status": "paused"}
        finally:
            assert httpx.post(base_url + "/continue_generation").status_code == 200
        assert all(f.result().status_code == 200 for f in held)


def test_a_streamed_request_to_a_full_queue_gets_503_before_the_stream(small_queue_server):
    base_url = small_queue_server.base_url
    body = {"text": "Write a long story.", "sampling_params": greedy(2000, ignore_eos=True)}
    with ThreadPoolExecutor(6) as pool:
        held = [pool.submit(httpx.post, base_url + "/generate", json=body, timeout=300) for _ in range(6)]
        wait_for_states(base_url, lambda s: s["num_running_reqs"] == 2 and s["num_waiting_reqs"] == 4, "queue full")
        response = httpx.post(
            base_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4},
            timeout=60,
        )
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        # Busy, not dead: the probe finds the queue full, and outputs flowing.
        assert httpx.get(base_url + "/health_generate", timeout=60).status_code == 200
        assert httpx.post(base_url + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
        finish_reasons = [f.result().json()["meta_info"]["finish_reason"]["type"] for f in held]
        assert finish_reasons == ["abort"] * 6
    wait_until_drained(base_url)


def test_an_urgent_request_overtakes_earlier_low_priority_ones():
    server = RunningServer(
        "--schedule-policy", "priority", "--priority-preemption", "--max-running-requests", "1", "--skip-warmup"
    )
    try:
        base_url = server.base_url
        finished: list[str] = []
        lock = threading.Lock()

        def run(name: str, body: dict, route: str = "/generate") -> None:
            response = httpx.post(base_url + route, json=body, timeout=300)
            assert response.status_code == 200, response.text
            with lock:
                finished.append(name)

        # Long enough (seconds) that the urgent request surely arrives while low0 still runs,
        # even on a loaded machine: with 64 tokens it sometimes came after low0 had ended.
        story = {"text": "Write a story.", "sampling_params": greedy(256, ignore_eos=True)}
        with ThreadPoolExecutor(4) as pool:
            low = [pool.submit(run, f"low{i}", story) for i in range(3)]
            wait_until_running(base_url)
            time.sleep(0.3)
            # Through the OpenAI route, where priority is an extra field as in SGLang and vLLM.
            urgent_body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "priority": 10}
            urgent = pool.submit(run, "urgent", urgent_body, "/v1/completions")
            for future in [*low, urgent]:
                future.result()
        assert finished[0] == "urgent", finished  # it even preempted the running low0
        samples = scrape(base_url)
        assert samples["sluice:num_retractions"] >= 1
        # Past what the messages carry: a 400, not a 500 with the request's state left behind.
        for route, body in [("/generate", {"text": "Hi"}), ("/v1/embeddings", {"input": "Hi"})]:
            response = httpx.post(base_url + route, json={**body, "priority": 2**64}, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == "priority", response.text
        wait_until_drained(base_url)
    finally:
        server.stop()


def test_requests_sent_together_to_an_idle_server_prefill_in_one_step():
    """They reach the Scheduler some ms apart (each is tokenized on its own, here by two HTTP
    workers); an idle one waits until none has followed for --idle-gather-ms before its first
    step, so all four prompts go into that step instead of the first alone and the rest after
    it. The gap is 500 ms here (5 by default), beyond any a cold server's workers take."""
    server = RunningServer("--idle-gather-ms", "500", "--tokenizer-worker-num", "2", "--skip-warmup")
    try:
        base_url = server.base_url
        before = internal_states(base_url)["prefill_steps"]
        prompts = [f"Name a colour, number {i}." for i in range(4)]
        together = threading.Barrier(len(prompts))

        def send(prompt: str) -> httpx.Response:
            together.wait()
            return generate(base_url, text=prompt, sampling_params=greedy(1, ignore_eos=True))

        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(pool.map(send, prompts))
        assert all(r.status_code == 200 for r in results), [r.text for r in results]
        assert internal_states(base_url)["prefill_steps"] - before == 1
    finally:
        server.stop()
