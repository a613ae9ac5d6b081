"""Process hygiene on a server of its own: a dead child fails requests and turns /health
to 503; SIGTERM stops every process."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import psutil

from tests.helpers import RunningServer, wait_until_running


def test_dead_scheduler_fails_requests_then_sigterm_stops_everything():
    server = RunningServer("--max-total-tokens", "4000")
    try:
        main = psutil.Process(server.process.pid)
        children = main.children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert len(children) >= 2, names

        result = {}
        body = {"text": "Tell me a story.", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
        thread = threading.Thread(target=lambda: result.update(r=httpx.post(server.base_url + "/generate", json=body, timeout=60)))
        thread.start()
        wait_until_running(server.base_url)
        scheduler = next(c for c in children if c.name().startswith("sluice-schedul"))
        scheduler.kill()
        thread.join(60)
        assert result["r"].status_code == 503, result["r"].text
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
