"""The TokenizerManager's own request bookkeeping: what happens when a new request cannot be
sent, and how a waiting request notices that its client left."""

from __future__ import annotations

import asyncio

import pytest

from sluice.config import PortArgs, ServerArgs
from sluice.messages import AbortReq, Message, SamplingParams, TokenizedGenerateReqInput
from sluice.tokenizer import manager as manager_module
from sluice.tokenizer.manager import TokenizerManager


class RecordingSender:
    """The socket to the Scheduler: records what is sent; the request named `fails` raises,
    as a message that cannot be encoded does."""

    def __init__(self, fails: str = "") -> None:
        self.fails = fails
        self.sent: list[Message] = []

    def send(self, message: Message) -> None:
        if isinstance(message, TokenizedGenerateReqInput) and message.rid == self.fails:
            raise OverflowError("int too big to convert")
        self.sent.append(message)

    def close(self) -> None:
        pass


@pytest.fixture
def tm():
    tm = TokenizerManager(ServerArgs(), PortArgs.create(), tokenizer=None)
    yield tm
    tm.close()  # open ZMQ sockets would keep the interpreter from exiting


def request(rid: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams())


def test_a_send_that_fails_leaves_no_state_and_aborts_what_went_out(tm):
    """Items sent one by one, the second cannot be sent: neither keeps a state or its rid,
    and the first, already at the Scheduler, is aborted."""
    tm.send_to_scheduler = sender = RecordingSender(fails="b")
    reqs = [request("a"), request("b")]
    states = [tm.add_req_state(req, "batch_sequential", index) for index, req in enumerate(reqs)]
    with pytest.raises(OverflowError):
        tm.send_new(list(reqs), states)
    assert tm.rid_to_state == {}
    assert "a" not in tm.live_rids and "b" not in tm.live_rids
    assert [m.rid for m in sender.sent if isinstance(m, TokenizedGenerateReqInput)] == ["a"]
    assert {m.rid for m in sender.sent if isinstance(m, AbortReq)} == {"a", "b"}


class GoneClient:
    async def is_disconnected(self) -> bool:
        return True


async def test_a_request_without_outputs_notices_its_client_left(tm, monkeypatch):
    """No output ever comes; the once-a-poll wake-up finds the client gone and aborts."""
    monkeypatch.setattr(manager_module, "DISCONNECT_POLL_S", 0.01)
    tm.send_to_scheduler = sender = RecordingSender()
    state = tm.add_req_state(request("quiet"), "single")
    poller = asyncio.get_running_loop().create_task(tm.poll_clients())
    try:
        chunks = await asyncio.wait_for(_collect(tm.wait_response(state, GoneClient())), 5)
    finally:
        poller.cancel()
    assert chunks == []
    assert [m.rid for m in sender.sent if isinstance(m, AbortReq)] == ["quiet"]


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]
