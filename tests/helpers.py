"""What the tests share: a real server in a subprocess, and small HTTP helpers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import cache
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sluice.procutil import is_alive
from sluice.tokenizer.shared_args import remove_shared_args

SERVER_START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@cache
def session_log_dir() -> Path:
    """This test session's folder for the logs of the processes its tests start; the folders
    of sessions that have ended are removed when it is made."""
    root = Path(tempfile.gettempdir()) / "sluice-test-logs"
    root.mkdir(exist_ok=True)
    for folder in root.iterdir():
        if folder.name.isdigit() and not is_alive(int(folder.name)):
            shutil.rmtree(folder, ignore_errors=True)
    mine = root / str(os.getpid())
    mine.mkdir(exist_ok=True)
    return mine


class RunningServer:
    def __init__(self, *flags: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = str(session_log_dir() / f"server-{self.port}.log")
        self.log = open(self.log_path, "w")  # noqa: SIM115 (the server writes to it until stop() closes it)
        cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(self.port), *flags]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready()
            if "--skip-warmup" not in flags:
                self._wait_for_warm_ups(
                    int(_flag_value(flags, "--tokenizer-worker-num", "1")), _flag_value(flags, "--api-key", "")
                )
        except BaseException:
            self.stop()  # a server that failed to start must not outlive the test
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.read_log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready in {SERVER_START_TIMEOUT_S} s:\n{self.read_log()}")

    def _wait_for_warm_ups(self, workers: int, api_key: str) -> None:
        """/health answers once one HTTP worker is up; every worker sends its own warm-up
        request. Wait until all of them reached the scheduler and finished, so that tests
        counting messages or requests see none of them."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while True:
            info = httpx.get(self.base_url + "/get_server_info", headers=headers, timeout=30).json()
            states = info["internal_states"][0]
            warmed = states["messages_received"].get("TokenizedGenerateReqInput", 0) >= workers
            if warmed and states["num_running_reqs"] == 0 and states["num_waiting_reqs"] == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {workers} workers' warm-ups did not finish:\n{self.read_log()}")
            time.sleep(0.2)

    def read_log(self) -> str:
        return read_log(self.log, self.log_path)

    def stop(self) -> None:
        stop_process_group(self.process, grace_s=20)
        # A server that had to be killed (and its router with it) could not remove its
        # shared-args block; a normal stop already has.
        remove_shared_args(self.process.pid)
        self.log.close()


def stop_process_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM, up to `grace_s` to exit, then SIGKILL to whatever is left of its process group:
    no test leaves a process behind."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)


def read_log(log, path: str) -> str:
    """What a process wrote so far to the log file `log` (open for writing at `path`)."""
    if not log.closed:
        log.flush()
    with open(path) as f:
        return f.read()


def _flag_value(flags: tuple[str, ...], name: str, default: str) -> str:
    return flags[flags.index(name) + 1] if name in flags else default


def generate(base_url: str, timeout_s: float = 120, **body) -> httpx.Response:
    return httpx.post(base_url + "/generate", json=body, timeout=timeout_s)


def greedy(max_new_tokens: int = 16, **extra) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": 0, **extra}


def sse_events(response: httpx.Response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: ") :]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def internal_states(base_url: str, headers: dict | None = None) -> dict:
    return httpx.get(base_url + "/get_server_info", headers=headers, timeout=30).json()["internal_states"][0]


def wait_for_states(
    base_url: str,
    condition: Callable[[dict], bool],
    what: str,
    timeout_s: float = 30,
    headers: dict | None = None,
    poll_s: float = 0.05,
) -> dict:
    """Poll the server's internal states every `poll_s` until `condition` holds; fail naming
    `what` if it does not within `timeout_s`. Returns the states that satisfied it."""
    deadline = time.monotonic() + timeout_s
    while not condition(states := internal_states(base_url, headers)):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s; last states {states}"
        time.sleep(poll_s)
    return states


def wait_until_running(base_url: str, timeout_s: float = 60) -> None:
    """Until the scheduler reports a running request (one launched from another thread)."""
    wait_for_states(base_url, lambda states: states["num_running_reqs"] > 0, "a request running", timeout_s)


def is_drained(states: dict) -> bool:
    return states["num_running_reqs"] == 0 and states["num_waiting_reqs"] == 0 and states["rid_to_state_size"] == 0


def wait_until_drained(base_url: str, timeout_s: float = 30) -> dict:
    """Until no request is running, waiting or live in any HTTP worker; fails otherwise."""
    return wait_for_states(base_url, is_drained, "every request drained", timeout_s)


def finished_count(states: dict, reason: str) -> int:
    """Requests the Scheduler has ended with this finish reason ("abort", "length", "stop")."""
    return states["finished_reqs"].get(reason, 0)


def scrape(base_url: str, headers: dict | None = None) -> dict[str, float]:
    """Every sample of /metrics by name and labels, e.g. 'sluice:requests_total{finish_reason=length}'."""
    response = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                labels = f"{labels},le={sample.labels['le']}".lstrip(",")
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def moved(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
