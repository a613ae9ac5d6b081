"""--dp-size 2 (one thread per replica) through the real server (issue 17): the same greedy
answers as one Scheduler, placement by the load-balance method, control routes over every
replica, and a replica that dies failing only its own requests."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.test_operations import scrape
from tests.helpers import RunningServer, generate, greedy, internal_states, wait_for_states, wait_until_drained

# About 600 tokens that every request of the placement tests starts with.
SHARED_PREFIX = "Here is a long list of facts about rivers. " + " ".join(
    f"River number {i} flows through valley {i * 7 % 13} into lake {i * 3 % 11}." for i in range(48)
)


def start(method: str) -> RunningServer:
    return RunningServer(
        "--dp-size", "2", "--num-threads", "1", "--load-balance-method", method, "--max-total-tokens", "8000"
    )


@pytest.fixture(scope="session")
def cache_aware():
    """For the session, not the module: the greedy test below runs once for each topology of
    the session's servers, in pytest's order far apart, and a module's server started again
    for each (three starts of ~11 s)."""
    server = start("cache_aware")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def round_robin():
    server = start("round_robin")
    yield server
    server.stop()


def generated_by_replica(base_url: str) -> list[int]:
    return [r["messages_received"].get("TokenizedGenerateReqInput", 0) for r in internal_states(base_url)["replicas"]]


def requests_received(replica: dict) -> int:
    received = replica["messages_received"]
    return received.get("TokenizedGenerateReqInput", 0) + received.get("BatchTokenizedGenerateReqInput", 0)


def mixed_requests() -> list[dict]:
    return [
        {"text": f"Question {i}: name {i % 5 + 1} animals that live in {['rivers', 'forests', 'deserts'][i % 3]}.",
         "sampling_params": greedy(8 + i % 9, ignore_eos=True)}
        for i in range(32)
    ]  # fmt: skip


def test_greedy_answers_equal_one_schedulers(cache_aware, base_url):
    with ThreadPoolExecutor(8) as pool:
        two = list(pool.map(lambda body: generate(cache_aware.base_url, **body), mixed_requests()))
        one = list(pool.map(lambda body: generate(base_url, **body), mixed_requests()))
    assert all(r.status_code == 200 for r in two + one)
    assert [r.json()["output_ids"] for r in two] == [r.json()["output_ids"] for r in one]
    assert all(n > 0 for n in generated_by_replica(cache_aware.base_url))  # both replicas served
    wait_until_drained(cache_aware.base_url)


def shared_prefix_round(base_url: str) -> list[httpx.Response]:
    """16 requests sharing the prefix, 4 at a time."""
    bodies = [
        {"text": f"{SHARED_PREFIX} Question {i}: which river is longest?", "sampling_params": greedy(4)}
        for i in range(16)
    ]
    first = generate(base_url, **bodies[0])
    with ThreadPoolExecutor(4) as pool:
        return [first, *pool.map(lambda body: generate(base_url, **body), bodies[1:])]


def test_cache_aware_sends_a_shared_prefix_to_one_replica(cache_aware):
    before = generated_by_replica(cache_aware.base_url)
    responses = shared_prefix_round(cache_aware.base_url)
    after = generated_by_replica(cache_aware.base_url)
    moved = sorted(b - a for a, b in zip(before, after, strict=True))
    assert moved == [0, 16], (before, after)
    prompt_tokens = responses[0].json()["meta_info"]["prompt_tokens"]
    assert prompt_tokens > 500
    assert all(r.json()["meta_info"]["cached_tokens"] >= prompt_tokens - 24 for r in responses[1:])


def test_round_robin_splits_a_shared_prefix(round_robin):
    before = generated_by_replica(round_robin.base_url)
    shared_prefix_round(round_robin.base_url)
    after = generated_by_replica(round_robin.base_url)
    assert [b - a for a, b in zip(before, after, strict=True)] == [8, 8]


def test_parallel_samples_land_on_their_prompts_replica(round_robin):
    before = internal_states(round_robin.base_url)["replicas"]
    body = {"text": SHARED_PREFIX, "sampling_params": {**greedy(4), "n": 4, "temperature": 0.8}}
    response = generate(round_robin.base_url, **body)
    assert response.status_code == 200, response.text
    results = response.json()
    prompt_tokens = results[0]["meta_info"]["prompt_tokens"]
    assert all(result["meta_info"]["cached_tokens"] >= prompt_tokens - 24 for result in results)
    after = internal_states(round_robin.base_url)["replicas"]
    moved = [requests_received(b) - requests_received(a) for a, b in zip(before, after, strict=True)]
    assert sorted(moved) == [0, 2], moved  # the warm-up, then the four samples in one batch: one replica


def test_control_routes_cover_every_replica(round_robin):
    base_url = round_robin.base_url
    info = httpx.get(base_url + "/get_server_info", timeout=30).json()
    states = info["internal_states"][0]
    assert [r["dp_rank"] for r in states["replicas"]] == [0, 1]
    assert states["kv_tokens_total"] == sum(r["kv_tokens_total"] for r in states["replicas"]) == 16000
    long = {"text": "Write a long story.", "sampling_params": greedy(3000, ignore_eos=True)}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(httpx.post, base_url + "/generate", json=long, timeout=300) for _ in range(2)]
        running = wait_for_states(base_url, lambda s: s["num_running_reqs"] == 2, "one request on each replica")
        assert [r["num_running_reqs"] for r in running["replicas"]] == [1, 1]
        assert scrape(base_url)["sluice:num_requests_running"] == 2
        loads = httpx.get(base_url + "/v1/loads", params={"include": "core,disagg,queues,memory"}, timeout=30).json()
        assert loads["dp_rank_count"] == 2
        assert [(load["dp_rank"], load["num_running_reqs"]) for load in loads["loads"]] == [(0, 1), (1, 1)]
        assert all(0 < load["token_usage"] < 1 for load in loads["loads"])
        one = httpx.get(base_url + "/v1/loads", params={"dp_rank": 1}, timeout=30).json()
        assert [load["dp_rank"] for load in one["loads"]] == [1] and one["dp_rank_count"] == 2
        assert httpx.get(base_url + "/v1/loads", params={"dp_rank": 2}, timeout=30).status_code == 400
        assert httpx.post(base_url + "/abort_request", json={"abort_all": True}, timeout=30).status_code == 200
        assert [f.result().json()["meta_info"]["finish_reason"]["type"] for f in held] == ["abort", "abort"]
    wait_until_drained(base_url)
    assert httpx.post(base_url + "/flush_cache", timeout=30).status_code == 200
    assert all(r["kv_tokens_cached"] == 0 for r in internal_states(base_url)["replicas"])


def test_a_replica_that_dies_fails_only_its_requests(round_robin):
    base_url = round_robin.base_url
    pids = [r["pid"] for r in internal_states(base_url)["replicas"]]
    story = {"text": "Write a story about a lighthouse.", "sampling_params": greedy(200, ignore_eos=True)}
    with ThreadPoolExecutor(4) as pool:
        held = [pool.submit(httpx.post, base_url + "/generate", json=story, timeout=300) for _ in range(4)]
        wait_for_states(base_url, lambda s: s["num_running_reqs"] == 4, "two requests on each replica")
        os.kill(pids[1], signal.SIGKILL)
        started = time.monotonic()
        codes = sorted(f.result().status_code for f in held)
    assert codes == [200, 200, 503, 503]
    health = httpx.get(base_url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "degraded", "replicas_alive": 1, "dp_size": 2}
    after = [generate(base_url, text=f"Say {i}.", sampling_params=greedy(4)) for i in range(4)]
    assert [r.status_code for r in after] == [200] * 4
    assert time.monotonic() - started < 120
    wait_until_drained(base_url)
