"""Shared fixtures. The real server with the real default model starts once per session."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

SERVER_START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, *flags: str):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/sluice-test-server-{self.port}.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "sluice", "serve", "--port", str(self.port), *flags]
        self.process = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()

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
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"server not ready in {SERVER_START_TIMEOUT_S} s:\n{self.read_log()}")

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                pass
        # Whatever is left of its process group goes too: no test leaves a process behind.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.log.close()


@pytest.fixture(scope="session")
def server():
    running = RunningServer("--max-total-tokens", "20000")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url
