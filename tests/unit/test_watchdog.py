"""The soft watchdog fires only when requests are in flight and outputs stop."""

from __future__ import annotations

import logging
import shutil

import pytest

from sluice.config import PortArgs, ServerArgs
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.req_state import ReqState
from sluice.tokenizer.watchdog import SoftWatchdog


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_never_fires_while_idle():
    clock = FakeClock()
    dog = SoftWatchdog(5.0, in_flight=lambda: 0, describe=lambda: "", clock=clock)
    clock.now += 3600
    assert not dog.check()
    assert dog.num_fired == 0


def test_fires_once_per_stall_and_rearms_after_a_message():
    clock = FakeClock()
    in_flight = [1]
    dog = SoftWatchdog(5.0, in_flight=lambda: in_flight[0], describe=lambda: "rid-1", clock=clock)
    clock.now += 4
    assert not dog.check()
    clock.now += 2
    assert dog.check()
    clock.now += 10
    assert not dog.check()  # the same stall is reported once
    dog.feed()
    clock.now += 6
    assert dog.check()
    assert dog.num_fired == 2


@pytest.mark.asyncio
async def test_tokenizer_manager_reports_a_stalled_detokenizer(caplog):
    """Inject a stall: a request is in flight and the detokenizer sends nothing."""
    clock = FakeClock()
    args = ServerArgs(soft_watchdog_timeout=2.0)
    port_args = PortArgs.create()
    tm = TokenizerManager(args, port_args, tokenizer=None)
    try:
        _check_stall_is_reported(tm, clock, caplog)
    finally:
        tm.close()  # open ZMQ sockets would keep the interpreter from exiting
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def _check_stall_is_reported(tm, clock, caplog) -> None:
    tm.soft_watchdog.clock = clock
    tm.soft_watchdog.feed()
    clock.now += 100
    with caplog.at_level(logging.ERROR):
        assert not tm.soft_watchdog.check()  # idle for 100 s: not a stall
        tm.rid_to_state["stuck-rid"] = ReqState(rid="stuck-rid", stream=False)
        tm.soft_watchdog.feed()  # what add_req_state does when a busy period starts
        clock.now += 1
        assert not tm.soft_watchdog.check()
        clock.now += 2
        assert tm.soft_watchdog.check()
    assert "stuck-rid" in caplog.text and "no output for" in caplog.text and "thread" in caplog.text
