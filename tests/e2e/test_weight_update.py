"""Live weight updates (issue 16, seed 003 §5.5) through the real server: streams that run
during an update all finish, requests after it carry the new weight_version, and weights that
cannot replace the served ones are refused with the old ones still serving."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import (
    RunningServer,
    generate,
    greedy,
    internal_states,
    sse_events,
    wait_for_states,
    wait_until_drained,
    wait_until_running,
)
from tests.tiny_lms import build_tiny_model, hf_greedy

PROMPT_IDS = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]


def update(base_url: str, timeout_s: float = 300, **body) -> httpx.Response:
    return httpx.post(base_url + "/update_weights_from_disk", json=body, timeout=timeout_s)


def model_info(base_url: str) -> dict:
    return httpx.get(base_url + "/get_model_info", timeout=30).json()


def eventually_version(base_url: str, version: str) -> None:
    """Every HTTP worker hears of an update; a worker other than the one that answered may
    take a moment (its inbox is read by its own event loop)."""
    deadline = time.monotonic() + 10
    while model_info(base_url)["weight_version"] != version:
        assert time.monotonic() < deadline, f"weight_version did not become {version}"
        time.sleep(0.05)


STREAM_TOKENS = 256


def stream(base_url: str, text: str, tokens: int) -> list[dict]:
    body = {"text": text, "stream": True, "sampling_params": greedy(tokens, ignore_eos=True)}
    with httpx.stream("POST", base_url + "/generate", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        return sse_events(response)


def test_an_update_while_8_streams_run_fails_none_and_later_requests_carry_the_new_version(server):
    base_url = server.base_url
    info = model_info(base_url)
    old = info["weight_version"]
    new = str(int(old) + 1)
    reference = generate(base_url, text="Name a colour.", sampling_params=greedy(8)).json()
    assert reference["meta_info"]["weight_version"] == old
    with ThreadPoolExecutor(10) as pool:
        # Long enough that all 8 are seen running together however fast a step is (at 128
        # tokens the streams could finish between two polls on a fast machine).
        streams = [
            pool.submit(stream, base_url, f"Tell a story about the number {i}.", STREAM_TOKENS) for i in range(8)
        ]
        wait_for_states(base_url, lambda states: states["num_running_reqs"] == 8, "8 streams running")
        updated = pool.submit(update, base_url, model_path=info["model_path"])
        time.sleep(0.2)
        # Waits, does not fail. Through the worker that runs the update it waits for the new
        # weights; another worker's request runs on the old ones until the Scheduler has the
        # update (that is, once the first worker's in-flight requests are done).
        during = pool.submit(generate, base_url, text="Name a colour.", sampling_params=greedy(8))
        for finished in streams:
            events = finished.result()
            assert events[-1] == "[DONE]"
            last = events[-2]["meta_info"]
            assert last["finish_reason"]["type"] == "length" and last["completion_tokens"] == STREAM_TOKENS
            assert {event["meta_info"]["weight_version"] for event in events[:-1]} == {old}
        response = updated.result()
        assert response.status_code == 200, response.text
        assert response.json()["success"] and response.json()["weight_version"] == new
        waited = during.result()
    assert waited.status_code == 200, waited.text
    assert waited.json()["meta_info"]["weight_version"] in ({new} if server.tokenizer_worker_num == 1 else {old, new})
    later = generate(base_url, text="Name a colour.", sampling_params=greedy(8))
    assert later.json()["meta_info"]["weight_version"] == new
    assert later.json()["text"] == waited.json()["text"] == reference["text"]  # the same file: the same weights
    eventually_version(base_url, new)
    assert httpx.get(base_url + "/get_weight_version", timeout=30).json() == {"weight_version": new}
    embedding = httpx.post(base_url + "/encode", json={"text": "hello"}, timeout=60).json()
    assert embedding["meta_info"]["weight_version"] == new
    wait_until_drained(base_url)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "model_path"),
        ({"model_path": ""}, "model_path"),
        ({"model_path": "/no/such/model.gguf"}, "model_path"),
        ({"model_path": "/tmp"}, "model_path"),
        ({"model_path": "/no/such/model.gguf", "weight_version": ""}, "weight_version"),
        ({"model_path": "/no/such/model.gguf", "load_format": "auto"}, "load_format"),
        ({"model_path": "/no/such/model.gguf", "abort_all_requests": "yes"}, "abort_all_requests"),
    ],
)
def test_a_bad_update_is_refused_naming_the_field_and_the_old_weights_serve(base_url, body, param):
    before = model_info(base_url)
    reference = generate(base_url, text="Say hi.", sampling_params=greedy(6)).json()
    response = update(base_url, **body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert model_info(base_url)["weight_version"] == before["weight_version"]
    again = generate(base_url, text="Say hi.", sampling_params=greedy(6)).json()
    assert again["text"] == reference["text"] and again["meta_info"]["weight_version"] == before["weight_version"]
    wait_until_drained(base_url)


def test_weights_of_another_architecture_are_refused(base_url, tmp_path):
    build_tiny_model(tmp_path, "qwen3")
    response = update(base_url, model_path=str(tmp_path))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert "architecture is 'Qwen3ForCausalLM'" in message and "LlamaForCausalLM" in message


def test_the_update_route_is_an_admin_route():
    server = RunningServer("--api-key", "user", "--admin-api-key", "admin", "--skip-warmup")
    try:
        path = httpx.get(
            server.base_url + "/get_model_info", headers={"Authorization": "Bearer user"}, timeout=30
        ).json()["model_path"]
        as_user = httpx.post(
            server.base_url + "/update_weights_from_disk",
            json={"model_path": path},
            headers={"Authorization": "Bearer user"},
            timeout=60,
        )
        assert as_user.status_code == 401
        as_admin = httpx.post(
            server.base_url + "/update_weights_from_disk",
            json={"model_path": path, "weight_version": "v2"},
            headers={"Authorization": "Bearer admin"},
            timeout=300,
        )
        assert as_admin.status_code == 200, as_admin.text
        assert as_admin.json()["weight_version"] == "v2"
    finally:
        server.stop()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Two tiny Qwen3 models of one shape with different weights, served from the first."""
    old, new = tmp_path_factory.mktemp("old"), tmp_path_factory.mktemp("new")
    models = {"old": build_tiny_model(old, "qwen3", seed=0), "new": build_tiny_model(new, "qwen3", seed=1)}
    server = RunningServer("--model-path", str(old), "--kv-cache-dtype", "float32", "--max-total-tokens", "2000")
    yield server, models, new
    server.stop()


def test_the_new_weights_answer_after_an_update(tiny_models):
    server, models, new_folder = tiny_models
    params = greedy(12, ignore_eos=True)
    before = generate(server.base_url, input_ids=PROMPT_IDS, sampling_params=params).json()
    assert before["output_ids"] == hf_greedy(models["old"], PROMPT_IDS, 12)
    response = update(server.base_url, model_path=str(new_folder), weight_version="seed-1")
    assert response.status_code == 200, response.text
    after = generate(server.base_url, input_ids=PROMPT_IDS, sampling_params=params).json()
    # The prompt's KV from before is flushed: the new weights compute all of it.
    assert after["output_ids"] == hf_greedy(models["new"], PROMPT_IDS, 12)
    assert after["meta_info"]["cached_tokens"] == 0 and after["meta_info"]["weight_version"] == "seed-1"
    assert model_info(server.base_url)["model_path"] == str(new_folder)


def test_abort_all_requests_ends_the_running_ones_instead_of_waiting(base_url):
    path = model_info(base_url)["model_path"]
    body = {"text": "Write a long story.", "sampling_params": greedy(2000, ignore_eos=True)}
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(httpx.post, base_url + "/generate", json=body, timeout=300)
        wait_until_running(base_url)
        response = update(base_url, model_path=path, abort_all_requests=True)
        assert response.status_code == 200, response.text
        assert long.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    wait_until_drained(base_url)


def test_a_second_update_while_one_waits_is_refused_and_server_info_shows_the_new_version(server):
    """The first update waits for a running request; a second one sent to the same worker is
    refused at once (it used to wait behind the first, then replace it). Afterwards
    /get_server_info reports the version served, as /get_weight_version does."""
    if server.tokenizer_worker_num > 1:
        # The kernel picks each connection's worker: one that holds the long request waits for
        # it (its writer lock) before the Scheduler can refuse (see the README).
        pytest.skip("which worker takes each call is the kernel's choice")
    base_url = server.base_url
    info = model_info(base_url)
    path, new = info["model_path"], str(int(info["weight_version"]) + 1)  # others count on numbers
    stamp = time.time_ns()
    long = {"text": "Write a long story.", "rid": f"long-{stamp}", "sampling_params": greedy(4000, ignore_eos=True)}
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(httpx.post, base_url + "/generate", json=long, timeout=300)
        wait_until_running(base_url)
        first = pool.submit(update, base_url, model_path=path, weight_version=new)
        deadline = time.monotonic() + 30
        while httpx.get(base_url + "/health_generate", timeout=60).text != '{"status":"updating_weights"}':
            assert time.monotonic() < deadline, "the update did not close the gate"
        second = update(base_url, timeout_s=30, model_path=path, weight_version=new + "0")
        assert second.status_code == 400 and "in progress" in second.json()["error"]["message"]
        assert httpx.post(base_url + "/abort_request", json={"rid": long["rid"]}).status_code == 200
        assert running.result(timeout=60).json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert first.result(timeout=300).status_code == 200
    eventually_version(base_url, new)
    deadline = time.monotonic() + 10  # each worker hears of the update (see eventually_version)
    while httpx.get(base_url + "/get_server_info", timeout=30).json()["weight_version"] != new:
        assert time.monotonic() < deadline, "/get_server_info kept the old weight_version"
        time.sleep(0.05)


def test_an_abort_ends_a_request_held_by_a_weight_update(server):
    """A request that arrives while an update waits for the running ones is held at the
    gate: /abort_request ends it there, and it never runs."""
    if server.tokenizer_worker_num > 1:
        pytest.skip("the kernel picks the worker of each connection; only the updating one holds at its gate")
    base_url = server.base_url
    path = model_info(base_url)["model_path"]
    stamp = time.time_ns()
    long = {"text": "Write a long story.", "rid": f"long-{stamp}", "sampling_params": greedy(4000, ignore_eos=True)}
    with ThreadPoolExecutor(3) as pool:
        running = pool.submit(httpx.post, base_url + "/generate", json=long, timeout=300)
        wait_until_running(base_url)
        updated = pool.submit(update, base_url, model_path=path)
        deadline = time.monotonic() + 30
        while httpx.get(base_url + "/health_generate", timeout=60).text != '{"status":"updating_weights"}':
            assert time.monotonic() < deadline, "the update did not close the gate"  # it waits for the long request
        held = pool.submit(generate, base_url, text="Hi", rid=f"held-{stamp}", sampling_params=greedy(2))
        wait_for_states(
            base_url, lambda s: s["num_paused_reqs"] == 1 and s["num_running_reqs"] == 1, "the new request held"
        )
        assert httpx.post(base_url + "/abort_request", json={"rid": f"held-{stamp}"}).status_code == 200
        meta = held.result(timeout=60).json()["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0
        assert not updated.done() and internal_states(base_url)["num_running_reqs"] == 1
        assert httpx.post(base_url + "/abort_request", json={"rid": long["rid"]}).status_code == 200
        assert running.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
        assert updated.result().status_code == 200
    wait_until_drained(base_url)
