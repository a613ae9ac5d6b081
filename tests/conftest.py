"""Shared fixtures. The real server with the real default model starts once per session."""

from __future__ import annotations

import pytest

from tests.helpers import RunningServer


@pytest.fixture(scope="session")
def server():
    running = RunningServer("--max-total-tokens", "20000")
    yield running
    running.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url
