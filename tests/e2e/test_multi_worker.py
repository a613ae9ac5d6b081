"""Several HTTP workers behind the MultiTokenizerRouter (seed 002), on servers of their own."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.helpers import RunningServer, generate, greedy, internal_states, scrape, wait_for_states

API_KEY, ADMIN_KEY = "test-key-123", "admin-key-456"


@pytest.fixture(scope="module")
def four_workers():
    server = RunningServer(
        "--max-total-tokens", "20000", "--tokenizer-worker-num", "4", "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY
    )
    yield server
    server.stop()


def authed(key: str = API_KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def test_no_cross_talk_over_four_workers(four_workers):
    url = four_workers.base_url
    prompts = [f"Repeat after me: {i * 37 % 1000} apples and {i} pears." for i in range(32)]

    def run(prompt: str) -> str:
        with httpx.Client(headers=authed()) as client:  # a new connection: any worker may take it
            r = client.post(url + "/generate", json={"text": prompt, "sampling_params": greedy(8)}, timeout=300)
            r.raise_for_status()
            return r.json()["text"]

    expected = [run(p) for p in prompts]  # one at a time: what a lone request gets
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, prompts))
    assert got == expected


def test_api_keys_on_every_worker(four_workers):
    url = four_workers.base_url
    for _ in range(8):  # fresh connections land on different workers
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.post(url + "/generate", json={"text": "hi"}).status_code == 401
        assert httpx.post(url + "/generate", json={"text": "hi"}, headers=authed("wrong")).status_code == 401
        # A bare key without the Bearer scheme is refused, as by OpenAI.
        assert httpx.get(url + "/v1/models", headers={"Authorization": API_KEY}).status_code == 401
        assert httpx.get(url + "/v1/models", headers=authed()).status_code == 200
    assert httpx.post(url + "/flush_cache", headers=authed()).status_code == 401  # admin route
    assert httpx.post(url + "/flush_cache", headers={"Authorization": ADMIN_KEY}).status_code == 401
    assert httpx.post(url + "/flush_cache", headers=authed(ADMIN_KEY)).status_code == 200
    info = httpx.get(url + "/get_server_info", headers=authed()).json()
    assert API_KEY not in str(info) and ADMIN_KEY not in str(info)
    assert API_KEY not in four_workers.read_log()


def test_state_summed_over_workers_and_pause_broadcast(four_workers):
    url = four_workers.base_url
    states = internal_states(url, authed())
    assert states["rid_to_state_size"] == 0 and states["num_paused_reqs"] == 0
    # Once the route answers, every worker holds new requests (fresh connections spread them).
    assert httpx.post(url + "/pause_generation", headers=authed(ADMIN_KEY)).status_code == 200
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [
                pool.submit(
                    lambda: httpx.post(
                        url + "/generate",
                        json={"text": "Hi", "sampling_params": greedy(2)},
                        headers=authed(),
                        timeout=120,
                    )
                )
                for _ in range(8)
            ]
            held = wait_for_states(url, lambda s: s["num_paused_reqs"] == 8, "8 requests held", headers=authed())
            assert held["num_running_reqs"] == 0 and held["rid_to_state_size"] == 0
            assert not any(f.done() for f in futures)
            assert httpx.post(url + "/continue_generation", headers=authed(ADMIN_KEY)).status_code == 200
            assert all(f.result().status_code == 200 for f in futures)
    finally:
        httpx.post(url + "/continue_generation", headers=authed(ADMIN_KEY))
    assert internal_states(url, authed())["num_paused_reqs"] == 0


def test_kill_9_main_process_leaves_nothing_behind():
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2")
    main = psutil.Process(server.process.pid)
    children = main.children(recursive=True)
    assert len(children) >= 5  # scheduler, detokenizer, router, 2 workers
    shm = f"/dev/shm/sluice_multi_tokenizer_args_{main.pid}"
    assert os.path.exists(shm)
    os.kill(main.pid, signal.SIGKILL)
    try:
        # Each child notices its parent is gone and exits; reaped or a zombie, it is gone.
        _, alive = psutil.wait_procs(children, timeout=10)
        alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert not alive, [c.name() for c in alive]
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(("127.0.0.1", server.port))  # the port is free again
        assert not os.path.exists(shm)
    finally:
        server.stop()
        for child in children:
            if child.is_running():
                child.kill()


def wait_for_log(server: RunningServer, text: str, count: int = 1, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while server.read_log().count(text) < count:
        assert time.monotonic() < deadline, f"{text!r} not logged {count} times in {timeout_s} s"
        time.sleep(0.2)


def test_dead_worker_turns_health_503_and_its_replacement_keeps_the_pause():
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2")
    url = server.base_url
    try:
        workers = [c for c in psutil.Process(server.process.pid).children() if c.name().startswith("sluice-http")]
        assert len(workers) == 2
        # /health answers once one worker is up; the router only watches workers that registered.
        wait_for_log(server, "registered (2 workers)")
        assert httpx.post(url + "/pause_generation").status_code == 200
        workers[0].kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and httpx.get(url + "/health").status_code != 503:
            time.sleep(0.5)
        assert httpx.get(url + "/health").status_code == 503
        assert "died" in server.read_log()
        # uvicorn starts a replacement; once it serves, it holds new requests as the paused
        # worker does (8 requests on fresh connections reach both).
        wait_for_log(server, "worker ready in", count=3, timeout_s=120)
        with ThreadPoolExecutor(8) as pool:
            body = {"text": "Hi", "sampling_params": greedy(2)}
            futures = [pool.submit(httpx.post, url + "/generate", json=body, timeout=120) for _ in range(8)]
            held = wait_for_states(url, lambda s: s["num_paused_reqs"] == 8, "8 requests held")
            assert held["num_running_reqs"] == 0 and held["rid_to_state_size"] == 0
            assert httpx.post(url + "/continue_generation").status_code == 200
            assert [f.result().status_code for f in futures] == [200] * 8
        # /health says a worker died; the workers serving on answer every route, not a 503.
        completion = {"prompt": "Hi", "max_tokens": 2, "temperature": 0}
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "temperature": 0}
        for route, body in [("/v1/completions", completion), ("/v1/chat/completions", chat)] * 3:
            response = httpx.post(url + route, json=body, timeout=60)
            assert response.status_code == 200, (route, response.text)
    finally:
        server.stop()


def test_a_dead_granian_worker_is_replaced_not_the_end_of_the_server():
    """Granian stopped the whole server (exit 1) when one of its workers died; as under
    uvicorn, /health now says one died and a replacement serves."""
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2", "--http-server", "granian")
    url = server.base_url
    try:
        wait_for_log(server, "registered (2 workers)")
        workers = [
            c for c in psutil.Process(server.process.pid).children(recursive=True) if c.name().startswith("sluice-http")
        ]
        assert len(workers) == 2
        workers[0].kill()
        wait_for_log(server, "worker ready in", count=3, timeout_s=120)
        assert server.process.poll() is None
        assert httpx.get(url + "/health").status_code == 503 and "died" in server.read_log()
        for _ in range(4):  # fresh connections reach both workers
            assert generate(url, text="The capital of France is", sampling_params=greedy(4)).status_code == 200
    finally:
        server.stop()


def test_a_replacement_serves_at_once_behind_a_busy_scheduler():
    """A replacement's warm-up would queue behind every request waiting in the Scheduler and,
    past WARMUP_TIMEOUT_S, make uvicorn stop the whole server: a replacement skips it."""
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2", "--max-running-requests", "1")
    url = server.base_url
    try:
        wait_for_log(server, "registered (2 workers)")
        workers = [c for c in psutil.Process(server.process.pid).children() if c.name().startswith("sluice-http")]
        workers[0].kill()
        # Until its replacement serves, the other worker takes every connection: one request
        # runs, two queue behind it.
        body = {"text": "Tell me a story", "sampling_params": {**greedy(400), "ignore_eos": True}}
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(httpx.post, url + "/generate", json=body, timeout=300) for _ in range(3)]
            wait_for_log(server, "worker ready in", count=3, timeout_s=120)
            assert [f.result().status_code for f in futures] == [200] * 3
        assert "replaces a dead worker: no warm-up" in server.read_log()
        # The two first workers' warm-ups and the three requests: no third warm-up queued.
        assert internal_states(url)["messages_received"]["TokenizedGenerateReqInput"] == 5
        assert server.process.poll() is None
        assert generate(url, text="The capital of France is", sampling_params=greedy(4)).status_code == 200
    finally:
        server.stop()


def test_a_dead_router_stops_the_server():
    """Every request and reply passes through the router, and the failure report would go
    to its inbox: without it the workers said 200 on /health while their requests hung."""
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2", "--skip-warmup")
    try:
        wait_for_log(server, "registered (2 workers)")
        main = psutil.Process(server.process.pid)
        children = main.children(recursive=True)
        [router] = [c for c in children if c.name().startswith("sluice-router")]
        # A stream in flight ends with an error event at once: it waited out the workers'
        # stop (--shutdown-timeout, 15 s) and was then cut without one.
        events: list[str] = []
        body = {"text": "Tell me a story.", "stream": True, "sampling_params": {**greedy(3000), "ignore_eos": True}}

        def read_stream() -> None:
            with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as response:
                events.extend(line for line in response.iter_lines() if line.startswith("data: "))

        reader = threading.Thread(target=read_stream)
        reader.start()
        deadline = time.monotonic() + 60
        while not events and time.monotonic() < deadline:
            time.sleep(0.1)
        router.kill()
        reader.join(10)
        assert not reader.is_alive(), (events[-3:], server.read_log()[-3000:])
        assert '"error"' in events[-2] and "sluice-router" in events[-2], events[-3:]
        assert server.process.wait(60) == 1
        assert "stopping the server" in server.read_log()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        server.stop()


@pytest.mark.parametrize("http_server", ["uvicorn", "granian"])
def test_sigterm_stops_the_server_though_a_worker_does_not_stop(http_server):
    """A worker that cannot stop (its event loop stuck in a bug; here stopped with SIGSTOP)
    is killed --shutdown-timeout seconds after the SIGTERM instead of holding the server up."""
    flags = "--max-total-tokens 4000 --tokenizer-worker-num 2 --shutdown-timeout 2".split()
    server = RunningServer(*flags, "--http-server", http_server)
    try:
        main = psutil.Process(server.process.pid)
        wait_for_log(server, "registered (2 workers)")
        workers = [c for c in main.children(recursive=True) if c.name().startswith("sluice-http")]
        assert len(workers) == 2
        children = main.children(recursive=True)
        workers[0].suspend()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(12)  # less than the default 15 s; TimeoutExpired fails the test
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        if http_server == "uvicorn":  # Granian kills it without a word
            assert "did not stop within 2 s: killed" in server.read_log()
    finally:
        server.stop()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_granian_serves_the_same_app(workers):
    server = RunningServer("--max-total-tokens", "4000", "--http-server", "granian", "--tokenizer-worker-num", workers)
    try:
        r = generate(server.base_url, text="The capital of France is", sampling_params=greedy(4))
        assert r.status_code == 200 and "Paris" in r.json()["text"]
        stream = httpx.post(
            server.base_url + "/generate", timeout=60, json={"text": "Hi", "sampling_params": greedy(3), "stream": True}
        )
        assert stream.text.rstrip().endswith("data: [DONE]")
        assert (
            httpx.post(server.base_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
        )
        # Each worker records its requests for /metrics (its own values in files, not in a
        # forked copy of the launcher's memory that no scrape reads).
        samples = scrape(server.base_url)
        assert samples["sluice:requests_total{finish_reason=length}"] == 3
        assert samples["sluice:prompt_tokens_total"] > 0
    finally:
        server.stop()


def test_granian_drops_requests_whose_client_left():
    """Under Granian too (whose receive channel always waits, so Starlette's is_disconnected
    saw a departure several polls late or not at all): a request held by a pause whose
    client leaves is dropped, never sent, and a non-streaming request whose client leaves
    mid-generation is aborted."""
    server = RunningServer("--max-total-tokens", "4000", "--http-server", "granian")
    url = server.base_url
    try:
        before = internal_states(url)
        assert httpx.post(url + "/pause_generation").status_code == 200
        for route, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 8}),
            ("/generate", {"text": "left", "sampling_params": greedy(8)}),
            ("/generate", {"text": "left", "sampling_params": greedy(8), "stream": True}),
        ]:
            with pytest.raises(httpx.TimeoutException):
                httpx.post(url + route, json=body, timeout=0.3)
        wait_for_states(url, lambda s: s["num_paused_reqs"] == 0, "the held requests dropped", timeout_s=5)
        assert httpx.post(url + "/continue_generation").status_code == 200
        time.sleep(1)
        states = internal_states(url)
        assert states["messages_received"].get("TokenizedGenerateReqInput", 0) == before["messages_received"].get(
            "TokenizedGenerateReqInput", 0
        ), "a request whose client left was sent"

        body = {"text": "A long story:", "sampling_params": greedy(2000, ignore_eos=True)}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/generate", json=body, timeout=2)
        states = wait_for_states(url, lambda s: s["num_running_reqs"] == 0, "the request aborted", timeout_s=5)
        assert states["finished_reqs"].get("abort", 0) == before["finished_reqs"].get("abort", 0) + 1
        assert states["kv_tokens_in_use"] == 0
    finally:
        server.stop()


def test_dead_scheduler_with_two_workers_fails_requests_and_health():
    server = RunningServer("--max-total-tokens", "4000", "--tokenizer-worker-num", "2")
    try:
        children = psutil.Process(server.process.pid).children()
        scheduler = next(c for c in children if c.name().startswith("sluice-schedul"))
        scheduler.kill()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and httpx.get(server.base_url + "/health").status_code != 503:
            time.sleep(0.5)
        for _ in range(4):  # every worker knows
            assert httpx.get(server.base_url + "/health").status_code == 503
            assert generate(server.base_url, text="Hi", sampling_params=greedy(2)).status_code == 503
        # A worker started after that (a replacement) hears of it too, and serves the same 503s
        # instead of failing to start, which would make uvicorn stop the whole server.
        children = psutil.Process(server.process.pid).children()
        workers = [c for c in children if c.name().startswith("sluice-http")]
        workers[0].kill()
        wait_for_log(server, "worker ready in", count=3, timeout_s=60)
        time.sleep(1)
        assert server.process.poll() is None
        for _ in range(4):
            assert httpx.get(server.base_url + "/health").status_code == 503
            assert generate(server.base_url, text="Hi", sampling_params=greedy(2)).status_code == 503
    finally:
        server.stop()
