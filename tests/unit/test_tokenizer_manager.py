"""The TokenizerManager's own request bookkeeping: what happens when a new request cannot be
sent, and how a waiting request notices that its client left."""

from __future__ import annotations

import asyncio
import shutil
from concurrent.futures import Future

import msgspec
import pytest

from sluice.config import PortArgs, ServerArgs
from sluice.messages import (
    AbortReq,
    BatchStrOutput,
    FinishReason,
    Message,
    ReqOutput,
    SamplingParams,
    StrOutput,
    TokenizedGenerateReqInput,
)
from sluice.sampling import ClientError
from sluice.tokenizer import manager as manager_module
from sluice.tokenizer import request_tokenizer
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.request_tokenizer import RequestTokenizer
from sluice.tokenizer.result import GenerateChunk
from sluice.tokenizer.startup import warm_up


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
    port_args = PortArgs.create()
    tm = TokenizerManager(ServerArgs(), port_args, tokenizer=None)
    yield tm
    tm.close()  # open ZMQ sockets would keep the interpreter from exiting
    shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def request(rid: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=[1, 2, 3], sampling_params=SamplingParams())


def test_a_send_that_fails_frees_what_was_not_sent_and_aborts_what_was(tm):
    """Items sent one by one, the second cannot be sent: it keeps no state or rid; the first,
    already at the Scheduler, is aborted and keeps its state until its abort output ends it."""
    tm.send_to_scheduler = sender = RecordingSender(fails="b")
    reqs = [request("a"), request("b")]
    states = [tm.add_req_state(req, "batch_sequential", index) for index, req in enumerate(reqs)]
    with pytest.raises(OverflowError):
        tm.send_new(list(reqs), states)
    assert list(tm.rid_to_state) == ["a"] and "b" not in tm.live_rids
    assert [m.rid for m in sender.sent if isinstance(m, TokenizedGenerateReqInput)] == ["a"]
    assert [m.rid for m in sender.sent if isinstance(m, AbortReq)] == ["a"]
    aborted = FinishReason(type="abort", message="aborted")
    tm._dispatch(
        BatchStrOutput(outputs=[StrOutput(output=ReqOutput(rid="a", new_token_ids=[], finish_reason=aborted), text="")])
    )
    assert tm.rid_to_state == {} and "a" not in tm.live_rids


def test_requests_tokenized_while_the_back_end_died_are_not_sent(tm):
    tm.send_to_scheduler = sender = RecordingSender()
    tm.fail_all("the scheduler process failed")
    state = tm.add_req_state(request("late"), "single")
    with pytest.raises(BackendError):
        tm.send_new([request("late")], [state])
    assert tm.rid_to_state == {} and sender.sent == []


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


async def test_a_request_whose_end_came_is_not_aborted_when_its_reader_leaves(tm):
    """The final output arrived but its reader was gone before it read it (its client left):
    there is nothing of its own left to abort, and an abort by rid could end a new request of
    the same rid, sent again by the client through another worker."""
    tm.send_to_scheduler = sender = RecordingSender()
    state = tm.add_req_state(request("done"), "single")
    reader = tm.wait_response(state)
    waiting = asyncio.get_running_loop().create_task(anext(reader))
    await asyncio.sleep(0)
    ended = ReqOutput(rid="done", new_token_ids=[5], finish_reason=FinishReason(type="length"))
    tm._dispatch(BatchStrOutput(outputs=[StrOutput(output=ended, text="x")]))
    waiting.cancel()  # the client left before the reader woke
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert "done" not in tm.rid_to_state
    assert not [m for m in sender.sent if isinstance(m, AbortReq)]


async def test_a_request_that_loses_its_reader_is_aborted_as_this_workers_own(tm):
    tm.send_to_scheduler = sender = RecordingSender()
    state = tm.add_req_state(request("live"), "single")
    reader = tm.wait_response(state)
    waiting = asyncio.get_running_loop().create_task(anext(reader))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    [abort] = [m for m in sender.sent if isinstance(m, AbortReq)]
    assert abort.rid == "live" and abort.own_request


@pytest.mark.parametrize(
    ("abort", "live"),
    [(AbortReq(rid="r"), "r"), (AbortReq(rid="p"), "p::1"), (AbortReq(abort_all=True), "any")],
)
def test_another_workers_abort_is_sent_again_behind_the_requests_it_names(tm, abort, live):
    """This worker sent the request before it heard of another worker's abort, which may
    have reached the Scheduler first and found nothing: the abort goes again, on this
    worker's channel, behind the request, for this worker's requests alone."""
    tm.send_to_scheduler = sender = RecordingSender()
    tm.add_req_state(request(live), "single")
    tm.add_req_state(request("unrelated"), "single")
    tm._dispatch(msgspec.structs.replace(abort, http_worker_ipc="ipc://other"))
    [again] = sender.sent
    assert isinstance(again, AbortReq) and again.own_request
    assert (again.rid, again.abort_all) == (abort.rid, abort.abort_all)


def test_another_workers_abort_of_nothing_here_sends_nothing(tm):
    tm.send_to_scheduler = sender = RecordingSender()
    tm.add_req_state(request("mine"), "single")
    tm._dispatch(AbortReq(rid="theirs", http_worker_ipc="ipc://other"))
    tm._dispatch(AbortReq(rid="min", http_worker_ipc="ipc://other"))
    assert sender.sent == []


async def _collect(stream) -> list:
    return [chunk async for chunk in stream]


async def test_each_grammar_text_is_compiled_once_and_its_verdict_kept(monkeypatch):
    """The items of a batch, a request checked at the pause gate and again after, clients
    sending one schema: the check thread compiles each text once."""
    compiled: list[str] = []

    def fake_check(params, tokenizer, reasoning_parser):
        compiled.append(params.regex)
        if params.regex == "[":
            raise ClientError("regex does not compile: unclosed [", "regex")

    monkeypatch.setattr(request_tokenizer, "check_grammar", fake_check)
    inputs = RequestTokenizer(ServerArgs(), None)
    inputs._grammar_tokenizer = Future()
    inputs._grammar_tokenizer.set_result(None)
    for _ in range(3):
        await inputs._check_grammar(SamplingParams(regex="[0-9]+"))
        with pytest.raises(ClientError, match="unclosed"):
            await inputs._check_grammar(SamplingParams(regex="["))
    assert compiled == ["[0-9]+", "["]


async def test_a_request_whose_client_left_while_it_was_tokenized_is_not_sent(tm, monkeypatch):
    """Reading its images can take a second or more: a client gone by then gets nothing run."""
    tm.send_to_scheduler = sender = RecordingSender()

    async def tokenize(objs, live_rids, **kwargs):
        return [request("slow")]

    monkeypatch.setattr(tm.inputs, "tokenize", tokenize)
    aborted = {"finish_reason": "abort"}
    before = tm.metrics.registry.get_sample_value("sluice:requests_total", aborted) or 0.0
    single = tm._single_request(GenerateReqInput(text="Hi"), GoneClient(), 0.0)
    chunks = await asyncio.wait_for(_collect(single), 5)  # the old code waited for outputs
    assert chunks == [] and sender.sent == [] and tm.rid_to_state == {}
    assert tm.metrics.registry.get_sample_value("sluice:requests_total", aborted) == before + 1


class FailingWarmUp:
    """A TokenizerManager whose one request ends as the Scheduler ends a step that raised."""

    async def generate_request(self, obj, hold_at_gate=True):
        reason = FinishReason(type="abort", message="q heads 4 x 16 do not fit pools of 3 x 16", status_code=500)
        yield GenerateChunk(rid=obj.rid, path="single", text="", output_ids=[], finish_reason=reason)


async def test_a_warm_up_that_fails_stops_the_start():
    with pytest.raises(BackendError, match="the warm-up request failed: q heads 4 x 16 do not fit"):
        await warm_up(FailingWarmUp())
