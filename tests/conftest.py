"""Shared fixtures. The real server with the real default model starts once per session,
once with one HTTP worker and once with two behind the MultiTokenizerRouter: every
end-to-end test runs against both topologies."""

from __future__ import annotations

import pytest

from tests.helpers import RunningServer


@pytest.fixture(scope="session", params=[1, 2], ids=["workers1", "workers2"])
def server(request):
    running = RunningServer("--max-total-tokens", "20000", "--tokenizer-worker-num", str(request.param))
    running.tokenizer_worker_num = request.param
    yield running
    running.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url
