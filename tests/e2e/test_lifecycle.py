"""Process hygiene on a server of its own: a dead child fails requests (streams by the one
rule for errors on streams) and turns /health to 503; SIGTERM stops every process."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import psutil

from tests.helpers import RunningServer, scrape, wait_until_running

LONG = {"max_new_tokens": 3000, "ignore_eos": True}
STREAMS = {
    "/generate": {"text": "Tell me a story.", "sampling_params": LONG, "stream": True},
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    },
    "/v1/completions": {"prompt": "Once upon a time", "max_tokens": 3000, "ignore_eos": True, "stream": True},
}


class StreamReader(threading.Thread):
    """Reads one streaming request: its status, its events, and when the first one came."""

    def __init__(self, url: str, body: dict):
        super().__init__()
        self.url, self.body = url, body
        self.first_event = threading.Event()
        self.status_code = None
        self.events: list = []
        self.error_body = None

    def run(self):
        with httpx.stream("POST", self.url, json=self.body, timeout=60) as response:
            self.status_code = response.status_code
            if response.status_code != 200:
                self.error_body = json.loads(response.read())
                return
            for line in response.iter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    self.events.append(payload if payload == "[DONE]" else json.loads(payload))
                    self.first_event.set()


def assert_503_envelope(body: dict) -> None:
    error = body["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503 and "died" in error["message"], body
    assert set(error) == {"message", "type", "param", "code"}


def test_dead_scheduler_fails_requests_then_sigterm_stops_everything():
    server = RunningServer("--max-total-tokens", "4000")
    try:
        main = psutil.Process(server.process.pid)
        children = main.children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert len(children) >= 2, names
        scheduler = next(c for c in children if c.name().startswith("sluice-schedul"))

        result = {}
        body = {"text": "Tell me a story.", "sampling_params": LONG}
        thread = threading.Thread(
            target=lambda: result.update(r=httpx.post(server.base_url + "/generate", json=body, timeout=60))
        )
        thread.start()
        # Two streams past their first token...
        streaming = [
            StreamReader(server.base_url + path, STREAMS[path]) for path in ("/generate", "/v1/chat/completions")
        ]
        for reader in streaming:
            reader.start()
        for reader in streaming:
            assert reader.first_event.wait(60), reader.url
        wait_until_running(server.base_url)
        # ...and one that cannot get a first token: the Scheduler is stopped, then killed.
        scheduler.suspend()
        waiting = StreamReader(server.base_url + "/v1/completions", STREAMS["/v1/completions"])
        waiting.start()
        # A scrape of the stuck Scheduler's server keeps the request metrics and comes back
        # well within Prometheus' 10 s scrape timeout (it was a 503 after 30 s).
        started = time.monotonic()
        samples = scrape(server.base_url)
        assert time.monotonic() - started < 9
        assert samples["sluice:scheduler_up"] == 0 and "sluice:num_requests_running" not in samples
        assert any(name.startswith("sluice:prompt_tokens_total") for name in samples), samples
        scheduler.kill()

        thread.join(60)
        assert result["r"].status_code == 503, result["r"].text
        waiting.join(60)
        assert waiting.status_code == 503, waiting.events  # a real status, not 200 and an event
        assert_503_envelope(waiting.error_body)
        for reader in streaming:
            reader.join(60)
            assert reader.status_code == 200
            *tokens, error_event, done = reader.events
            assert tokens and all("error" not in event for event in tokens), reader.url
            assert_503_envelope(error_event)
            assert done == "[DONE]"

        deadline = time.monotonic() + 10
        while httpx.get(server.base_url + "/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert httpx.get(server.base_url + "/health").status_code == 503
        assert httpx.get(server.base_url + "/health_generate").status_code == 503

        server.process.send_signal(signal.SIGTERM)
        server.process.wait(30)
        _, alive = psutil.wait_procs([c for c in children if c.is_running()], timeout=10)
        assert not alive, [c.cmdline() for c in alive]
    finally:
        server.stop()


def loads_torch(process: psutil.Process) -> bool:
    with open(f"/proc/{process.pid}/maps") as maps:
        return "libtorch" in maps.read()


def test_only_the_scheduler_loads_torch(server):
    """The HTTP, tokenizer, router and detokenizer processes of a text-only model run no
    tensors: they load the tokenizer without torch (~190 MB less resident each)."""
    main = psutil.Process(server.process.pid)
    tree = [main, *main.children(recursive=True)]
    with_torch = sorted(process.name() for process in tree if loads_torch(process))
    assert with_torch == ["sluice-schedule"], [(p.name(), " ".join(p.cmdline())[-60:]) for p in tree]
    assert len(tree) >= 3 + server.tokenizer_worker_num - 1  # main, scheduler, detokenizer (+ workers, router)


def test_sigterm_stops_the_server_while_a_long_stream_runs():
    """One HTTP process (the default): uvicorn waited for every open stream before it
    stopped, so a client streaming thousands of tokens held a SIGTERM off for minutes. Now
    the streams still open --shutdown-timeout seconds after it are closed, as with HTTP workers."""
    server = RunningServer("--max-total-tokens", "8000", "--shutdown-timeout", "2")
    try:
        children = psutil.Process(server.process.pid).children(recursive=True)
        body = {"max_new_tokens": 7000, "ignore_eos": True}
        stream = {"text": "Tell me a story.", "sampling_params": body, "stream": True}
        reader = StreamReader(server.base_url + "/generate", stream)
        reader.start()
        assert reader.first_event.wait(60)
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(12)  # less than the default 15 s; TimeoutExpired fails the test
        _, alive = psutil.wait_procs([c for c in children if c.is_running()], timeout=10)
        assert not alive, [c.cmdline() for c in alive]
        reader.join(30)
    finally:
        server.stop()
