"""sluice workers behind the SGLang Model Gateway (`smg`, a test dependency), on loopback
ports (issue 17): the OpenAI API and /generate through it, cache-aware placement of
requests that share a prefix, and routing around a worker killed mid-run."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.helpers import (
    RunningServer,
    free_port,
    generate,
    greedy,
    internal_states,
    read_log,
    session_log_dir,
    stop_process_group,
)

GATEWAY_START_TIMEOUT_S = 120
# About 700 tokens that the placement test's requests share.
SHARED_PREFIX = "A report on the harbour. " + " ".join(
    f"Ship {i} unloaded {i * 13 % 97} crates of {['tea', 'salt', 'wool', 'iron'][i % 4]} at dock {i % 9}."
    for i in range(50)
)


class Gateway:
    def __init__(self, worker_urls: list[str]):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(session_log_dir() / f"gateway-{self.port}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 (closed by stop())
        command = [sys.executable, "-m", "smg", "launch", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--policy", "cache_aware", "--health-check-interval-secs", "1", "--worker-urls", *worker_urls]
        command += ["--prometheus-port", str(free_port())]
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_for_workers(len(worker_urls))
        except BaseException:
            self.stop()
            raise

    def _wait_for_workers(self, count: int) -> None:
        deadline = time.monotonic() + GATEWAY_START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.read_log()
            with contextlib.suppress(httpx.HTTPError):
                workers = httpx.get(self.base_url + "/workers", timeout=5).json()
                listed = workers.get("workers", workers) if isinstance(workers, dict) else workers
                if len(listed) >= count and httpx.get(self.base_url + "/v1/models", timeout=5).status_code == 200:
                    return
            time.sleep(0.5)
        raise RuntimeError(f"the gateway did not list {count} workers:\n{self.read_log()}")

    def read_log(self) -> str:
        return read_log(self.log, self.log_path)

    def stop(self) -> None:
        stop_process_group(self.process, grace_s=10)
        self.log.close()


@pytest.fixture(scope="module")
def cluster():
    # One kernel thread each: three servers share the two cores, and OpenMP threads that
    # outnumber the cores spin at every barrier while the thread they wait for has no core
    # (two 2-thread servers on 2 vCPUs took over 40 s for what one does in 2 s).
    workers = [RunningServer("--max-total-tokens", "8000", "--num-threads", "1") for _ in range(3)]
    try:
        gateway = Gateway([worker.base_url for worker in workers])
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    yield gateway, workers
    gateway.stop()
    for worker in workers:
        worker.stop()


def generations(worker: RunningServer) -> int:
    return internal_states(worker.base_url)["messages_received"].get("TokenizedGenerateReqInput", 0)


def test_the_openai_api_streams_through_the_gateway(cluster):
    gateway, _ = cluster
    client = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="none")
    [model] = [m.id for m in client.models.list().data]
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, stream=True
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text and chunks[-1].choices[0].finish_reason in ("stop", "length")
    completion = client.completions.create(model=model, prompt="The sea is", max_tokens=4, temperature=0)
    assert completion.usage.completion_tokens == 4


def test_generate_through_the_gateway_answers_as_a_worker(cluster):
    gateway, workers = cluster
    body = {"text": "The capital of France is", "sampling_params": greedy(6)}
    through = generate(gateway.base_url, **body)
    assert through.status_code == 200, through.text
    assert through.json()["output_ids"] == generate(workers[0].base_url, **body).json()["output_ids"]


def test_requests_sharing_a_prefix_land_on_one_worker(cluster):
    gateway, workers = cluster
    before = [generations(worker) for worker in workers]
    results = []
    for i in range(6):
        response = generate(
            gateway.base_url, text=f"{SHARED_PREFIX} Question {i}: which dock?", sampling_params=greedy(4)
        )
        assert response.status_code == 200, response.text
        results.append(response.json()["meta_info"])
    moved = sorted(generations(worker) - b for worker, b in zip(workers, before, strict=True))
    assert moved == [0, 0, 6]
    assert results[0]["prompt_tokens"] > 600
    assert all(meta["cached_tokens"] > 600 for meta in results[1:])


def test_the_gateway_reads_each_workers_model_and_load(cluster):
    gateway, workers = cluster
    listed = httpx.get(gateway.base_url + "/workers", timeout=30).json()["workers"]
    info = httpx.get(workers[0].base_url + "/get_model_info", timeout=30).json()
    assert {worker["labels"]["model_path"] for worker in listed} == {info["model_path"]}
    # The gateway polls every worker's /v1/loads (every 10 s by default).
    deadline = time.monotonic() + 30
    while True:
        loads = httpx.get(gateway.base_url + "/get_loads", timeout=30).json()["loads"]
        if {load["worker"] for load in loads} == {worker.base_url for worker in workers}:
            break
        assert time.monotonic() < deadline, loads
        time.sleep(0.5)
    assert all(load["max_total_num_tokens"] == 8000 for load in loads), loads


def held_status(future) -> int | None:
    """A held request's status; None when it did not come back within the client's 60 s
    (a request of the killed worker may be retried, or held, by the gateway)."""
    try:
        return future.result().status_code
    except httpx.TimeoutException:
        return None


def test_a_killed_worker_loses_only_its_own_requests(cluster):
    gateway, workers = cluster
    story = {"sampling_params": greedy(150, ignore_eos=True)}
    # Openings that share no prefix, so the cache-aware policy spreads them over the workers.
    topics = ["Foxes", "Rivers", "Castles", "Robots", "Oceans", "Winter"]
    with ThreadPoolExecutor(len(topics)) as pool:
        held = [
            pool.submit(generate, gateway.base_url, timeout_s=60, text=f"{topic}: tell a story.", **story)
            for topic in topics
        ]
        deadline = time.monotonic() + 60
        while sum(running := [internal_states(w.base_url)["num_running_reqs"] for w in workers]) < len(topics):
            assert time.monotonic() < deadline, running
            time.sleep(0.1)
        # The busy worker with the fewest requests: where several are busy, some requests outlive it.
        victim = min((i for i, count in enumerate(running) if count), key=lambda i: running[i])
        os.killpg(workers[victim].process.pid, signal.SIGKILL)  # the whole worker, at once
        codes = [held_status(future) for future in held]
    assert codes.count(200) >= len(topics) - running[victim], (codes, running)
    after = [
        generate(gateway.base_url, text=f"Count to {i}.", sampling_params=greedy(4)).status_code for i in range(10)
    ]
    assert after == [200] * 10


@pytest.mark.parametrize(
    ("field", "value", "status"),
    [
        ("model", "another-model", 404),
        ("return_text_in_logprobs", True, 400),
        ("return_bytes", True, 400),
        ("return_entropy", True, 400),
        ("background", True, 400),
    ],
)
def test_gateway_fields_that_would_change_the_answer_are_refused(base_url, field, value, status):
    response = generate(base_url, text="Hi", sampling_params=greedy(2), **{field: value})
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == field


def test_the_fields_the_gateway_adds_are_taken(base_url):
    gateway_fields = {"model": "unknown", "log_metrics": True, "no_logs": False, "return_bytes": False}
    response = generate(base_url, text="Hi", sampling_params=greedy(2), **gateway_fields)
    assert response.status_code == 200, response.text
