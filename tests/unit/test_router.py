"""The MultiTokenizerRouter on real ZMQ sockets, without processes: requests go on to the
Scheduler, each result (each item of a batch result) goes back to the worker that owns it,
a rid live on any worker is refused, control messages reach every worker."""

from __future__ import annotations

import os
import subprocess

import pytest
import zmq

from sluice.config import PortArgs
from sluice.ipc import Receiver
from sluice.messages import (
    AbortReq,
    BatchStrOutput,
    BatchTokenizedGenerateReqInput,
    FinishReason,
    InternalState,
    Message,
    ProcessFailed,
    RegisterWorker,
    ReplicaDied,
    ReqOutput,
    SamplingParams,
    SetPause,
    StrOutput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReqOutput,
    WorkerDied,
)
from sluice.tokenizer.router import WORKER_HEARTBEAT_S, MultiTokenizerRouter

WAIT_MS = 5000


class Hub:
    """A router with a fake Scheduler inbox and two registered worker inboxes."""

    def __init__(self, folder: str):
        self.context = zmq.Context(1)
        ports = PortArgs(
            ipc_dir=folder,
            scheduler_input=f"ipc://{folder}/scheduler",
            detokenizer_input=f"ipc://{folder}/detokenizer",
            tokenizer_input=f"ipc://{folder}/router",
        )
        self.scheduler = Receiver(self.context, ports.scheduler_input)
        self.router = MultiTokenizerRouter(ports)
        self.router.worker_heartbeat_s = float("inf")  # no empty batches but where a test asks
        self.addresses = {name: f"ipc://{folder}/{name}" for name in ("a", "b")}
        self.workers = {name: Receiver(self.context, address) for name, address in self.addresses.items()}
        for pid, (name, address) in enumerate(self.addresses.items(), start=1):
            self.router.dispatch(RegisterWorker(http_worker_ipc=address, pid=pid))
            # The router answers a registration with the pause state.
            assert self.received(self.workers[name]) == SetPause(paused=False, http_worker_ipc=address)

    def received(self, inbox: Receiver) -> Message:
        message = inbox.recv(timeout_ms=WAIT_MS)
        assert message is not None, "nothing arrived"
        return message

    def nothing_for(self, *inboxes: Receiver) -> bool:
        # Sends are done before dispatch returns, so a message would already be queued.
        return all(not inbox.sock.poll(50) for inbox in inboxes)

    def close(self) -> None:
        for sender in self.router.workers.values():
            sender.close()
        self.router.to_scheduler.close()
        self.router.inbox.close()
        self.router.context.term()
        for inbox in [self.scheduler, *self.workers.values()]:
            inbox.close()
        self.context.term()


@pytest.fixture
def hub(tmp_path):
    hub = Hub(str(tmp_path))
    yield hub
    hub.close()


def request(rid: str, worker: str) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(
        rid=rid, input_ids=[1, 2], sampling_params=SamplingParams(), http_worker_ipc=worker
    )


def result(rid: str, worker: str, text: str, finished: bool = False) -> StrOutput:
    reason = FinishReason(type="length") if finished else None
    return StrOutput(
        output=ReqOutput(rid=rid, new_token_ids=[3], finish_reason=reason, http_worker_ipc=worker), text=text
    )


def test_requests_and_control_messages_go_on_to_the_scheduler(hub):
    a = hub.addresses["a"]
    batch = BatchTokenizedGenerateReqInput(reqs=[request("x", a), request("y", a)])
    for message in (request("w", a), batch, AbortReq(rid="w", http_worker_ipc=a)):
        hub.router.dispatch(message)
        assert hub.received(hub.scheduler) == message
    hub.received(hub.workers["b"])  # the abort, for requests a pause holds there
    assert hub.router.live_rids == {"w", "x", "y"}


def test_an_abort_also_reaches_every_other_worker_for_the_requests_a_pause_holds(hub):
    abort = AbortReq(rid="held", http_worker_ipc=hub.addresses["a"])
    hub.router.dispatch(abort)
    assert hub.received(hub.scheduler) == abort
    assert hub.received(hub.workers["b"]) == abort
    assert hub.nothing_for(hub.workers["a"])


def test_a_workers_abort_of_its_own_request_goes_to_the_scheduler_alone(hub):
    """Its client left: no other worker holds that request, and one may hold a new request
    of the same rid that must not end with it."""
    abort = AbortReq(rid="mine", own_request=True, http_worker_ipc=hub.addresses["a"])
    hub.router.dispatch(abort)
    assert hub.received(hub.scheduler) == abort
    assert hub.nothing_for(*hub.workers.values())


def test_a_batch_result_is_split_by_worker_in_order(hub):
    a, b = hub.addresses["a"], hub.addresses["b"]
    outputs = [result("a1", a, "one"), result("b1", b, "two"), result("a2", a, "three", finished=True)]
    hub.router.dispatch(BatchStrOutput(outputs=outputs))
    to_a, to_b = hub.received(hub.workers["a"]), hub.received(hub.workers["b"])
    assert to_a == BatchStrOutput(outputs=[outputs[0], outputs[2]])
    assert to_b == BatchStrOutput(outputs=[outputs[1]])
    assert hub.nothing_for(*hub.workers.values())


def test_the_heartbeat_reaches_every_worker(hub):
    hub.router.dispatch(BatchStrOutput(outputs=[]))
    for inbox in hub.workers.values():
        assert hub.received(inbox) == BatchStrOutput(outputs=[])


def test_a_rid_live_on_one_worker_is_refused_on_another_until_it_finishes(hub):
    a, b = hub.addresses["a"], hub.addresses["b"]
    hub.router.dispatch(request("same", a))
    assert hub.received(hub.scheduler).rid == "same"

    # Another worker's batch that reuses the rid: every item ends at once with a 400.
    hub.router.dispatch(BatchTokenizedGenerateReqInput(reqs=[request("fresh", b), request("same", b)]))
    refused = hub.received(hub.workers["b"])
    assert [out.output.rid for out in refused.outputs] == ["fresh", "same"]
    for out in refused.outputs:
        reason = out.output.finish_reason
        assert reason.type == "abort" and reason.status_code == 400 and reason.param == "rid"
        assert reason.message == "a request with rid 'same' is already running"
    assert hub.nothing_for(hub.scheduler, hub.workers["a"])
    assert "fresh" not in hub.router.live_rids
    # The refusal did not free the running request's rid: a second try is refused too.
    hub.router.dispatch(request("same", b))
    assert hub.received(hub.workers["b"]).outputs[0].output.finish_reason.status_code == 400
    assert hub.nothing_for(hub.scheduler) and "same" in hub.router.live_rids

    # Once its final result went back, the rid is free again.
    hub.router.dispatch(BatchStrOutput(outputs=[result("same", a, "done", finished=True)]))
    assert hub.received(hub.workers["a"]).outputs[0].output.rid == "same"
    hub.router.dispatch(request("same", b))
    assert hub.received(hub.scheduler).http_worker_ipc == b


def test_a_rid_whose_samples_run_on_one_worker_is_refused_on_another(hub):
    """n > 1 samples are `rid::i` (and `rid::prefix`): the Scheduler aborts them with `rid`,
    so neither `rid` nor another sampling of it may start on another worker meanwhile."""
    a, b = hub.addresses["a"], hub.addresses["b"]
    hub.router.dispatch(BatchTokenizedGenerateReqInput(reqs=[request("fam::0", a), request("fam::1", a)]))
    assert [req.rid for req in hub.received(hub.scheduler).reqs] == ["fam::0", "fam::1"]
    for rid in ["fam", "fam::prefix"]:
        hub.router.dispatch(request(rid, b))
        reason = hub.received(hub.workers["b"]).outputs[0].output.finish_reason
        assert reason.status_code == 400 and reason.message == "a request with rid 'fam' is already running"
    assert hub.nothing_for(hub.scheduler)
    hub.router.dispatch(BatchStrOutput(outputs=[result("fam::0", a, "x", finished=True)]))
    hub.received(hub.workers["a"])
    hub.router.dispatch(request("fam", b))  # fam::1 still runs
    assert hub.received(hub.workers["b"]).outputs[0].output.finish_reason.status_code == 400
    hub.router.dispatch(BatchStrOutput(outputs=[result("fam::1", a, "y", finished=True)]))
    hub.received(hub.workers["a"])
    hub.router.dispatch(request("fam", b))
    assert hub.received(hub.scheduler).rid == "fam" and hub.router.live_families == {"fam": (b, 1)}


def internal_state(worker: str) -> InternalState:
    return InternalState(
        num_running_reqs=0,
        num_waiting_reqs=0,
        kv_tokens_total=1,
        kv_tokens_free=1,
        kv_tokens_cached=0,
        kv_tokens_in_use=0,
        http_worker_ipc=worker,
    )


def test_control_replies_go_to_the_worker_that_asked(hub):
    state = internal_state(hub.addresses["b"])
    hub.router.dispatch(state)
    assert hub.received(hub.workers["b"]) == state
    assert hub.nothing_for(hub.workers["a"])


def test_what_belongs_to_no_known_worker_is_dropped(hub):
    workers = dict(hub.router.workers)
    hub.router.dispatch(BatchStrOutput(outputs=[result("q", "ipc:///nowhere", "lost")]))
    hub.router.dispatch(internal_state("ipc:///nowhere"))
    assert hub.router.workers == workers  # no socket opened to an address a message named
    assert hub.nothing_for(*hub.workers.values())


def test_a_worker_whose_requests_have_no_output_hears_that_the_scheduler_lives(hub):
    """While the others' requests keep the Scheduler busy (no heartbeat of its own), an idle
    worker's /health_generate probe and soft watchdog must still hear from it."""
    a = hub.addresses["a"]
    hub.router.worker_heartbeat_s = 0.0  # b has heard nothing for that long
    hub.router.dispatch(BatchStrOutput(outputs=[result("a1", a, "one")]))
    assert hub.received(hub.workers["a"]).outputs[0].output.rid == "a1"
    assert hub.received(hub.workers["b"]) == BatchStrOutput(outputs=[])
    # At most one such batch a WORKER_HEARTBEAT_S: not one with every output.
    hub.router.worker_heartbeat_s = WORKER_HEARTBEAT_S
    hub.router.dispatch(BatchStrOutput(outputs=[result("a1", a, "two")]))
    assert hub.received(hub.workers["a"]).outputs[0].output.rid == "a1"
    assert hub.nothing_for(hub.workers["b"])


def test_broadcasts_reach_every_worker(hub):
    pause = SetPause(paused=True, http_worker_ipc=hub.addresses["a"])
    hub.router.dispatch(pause)
    for inbox in hub.workers.values():
        assert hub.received(inbox) == pause


def test_a_dead_worker_is_reported_to_the_others_and_to_late_comers(hub, tmp_path):
    exited = subprocess.Popen(["true"])
    exited.wait()  # reaped: its pid names no process now
    c = f"ipc://{tmp_path}/c"
    hub.router.dispatch(RegisterWorker(http_worker_ipc=c, pid=exited.pid))
    # Its requests (a single one and n > 1 samples) are aborted: no one would read them.
    hub.router.dispatch(BatchTokenizedGenerateReqInput(reqs=[request("lone", c), request("fam::0", c)]))
    hub.router.dispatch(request("kept", hub.addresses["a"]))
    assert hub.received(hub.scheduler).reqs and hub.received(hub.scheduler).rid == "kept"
    hub.router.check_workers_alive()
    for inbox in hub.workers.values():
        assert hub.received(inbox) == WorkerDied(pid=exited.pid)
    assert c not in hub.router.workers
    assert {hub.received(hub.scheduler).rid for _ in range(2)} == {"lone", "fam"}
    assert hub.nothing_for(hub.scheduler)
    # A worker that registers later hears of the loss too.
    late = Receiver(hub.context, f"ipc://{tmp_path}/d")
    try:
        hub.router.dispatch(RegisterWorker(http_worker_ipc=f"ipc://{tmp_path}/d", pid=os.getpid()))
        assert hub.received(late) == WorkerDied(pid=exited.pid)
    finally:
        late.close()


def test_a_worker_registering_before_the_liveness_check_hears_of_a_death(hub, tmp_path):
    """uvicorn starts a replacement once its predecessor is gone, maybe before the router's
    next liveness check: it must hear of the death (it skips its warm-up then)."""
    exited = subprocess.Popen(["true"])
    exited.wait()
    c = f"ipc://{tmp_path}/c"
    hub.router.dispatch(RegisterWorker(http_worker_ipc=c, pid=exited.pid))
    late = Receiver(hub.context, f"ipc://{tmp_path}/d")
    try:
        hub.router.dispatch(RegisterWorker(http_worker_ipc=f"ipc://{tmp_path}/d", pid=os.getpid()))
        assert hub.received(late) == WorkerDied(pid=exited.pid)
        assert hub.received(late) == SetPause(paused=False, http_worker_ipc=f"ipc://{tmp_path}/d")
    finally:
        late.close()


def test_the_worker_that_sent_a_broadcast_hears_it_last(hub):
    """Its copy coming back tells it that every other worker's copy is on its way: a
    worker's /pause_generation answers only then."""
    a, b = hub.addresses["a"], hub.addresses["b"]
    order: list[str] = []

    class Recorder:
        def __init__(self, address: str) -> None:
            self.address = address

        def send(self, message: Message) -> None:
            order.append(self.address)

    senders = hub.router.workers
    hub.router.workers = {address: Recorder(address) for address in senders}  # registered a, then b
    try:
        hub.router.dispatch(SetPause(paused=True, http_worker_ipc=a))
        hub.router.dispatch(SetPause(paused=False, http_worker_ipc=b))
    finally:
        hub.router.workers = senders
    assert order == [b, a, a, b]


def test_a_late_worker_hears_the_weights_served_and_the_replicas_that_died(hub, tmp_path):
    update = UpdateWeightsFromDiskReqOutput(
        success=True, weight_version="3", model_path="/m.gguf", control_id=5, http_worker_ipc=hub.addresses["a"]
    )
    hub.router.dispatch(update)
    hub.router.dispatch(ReplicaDied(dp_rank=1, replicas_alive=1))
    late = Receiver(hub.context, f"ipc://{tmp_path}/late")
    try:
        hub.router.dispatch(RegisterWorker(http_worker_ipc=f"ipc://{tmp_path}/late", pid=77))
        replayed = hub.received(late)
        assert isinstance(replayed, UpdateWeightsFromDiskReqOutput)
        assert (replayed.weight_version, replayed.http_worker_ipc, replayed.control_id) == ("3", None, 0)
        assert hub.received(late) == ReplicaDied(dp_rank=1, replicas_alive=1)
        assert hub.received(late) == SetPause(paused=False, http_worker_ipc=f"ipc://{tmp_path}/late")
    finally:
        late.close()


def test_a_late_worker_hears_that_a_back_end_process_died(hub, tmp_path):
    """Else its /health says 200 and its requests wait for a Scheduler that is gone."""
    failure = ProcessFailed(process="scheduler", error="scheduler died")
    hub.router.dispatch(failure)
    for inbox in hub.workers.values():
        assert hub.received(inbox) == failure
    late = Receiver(hub.context, f"ipc://{tmp_path}/late")
    try:
        hub.router.dispatch(RegisterWorker(http_worker_ipc=f"ipc://{tmp_path}/late", pid=os.getpid()))
        # After the answer to its registration: before, the failure would fail that call too.
        assert hub.received(late) == SetPause(paused=False, http_worker_ipc=f"ipc://{tmp_path}/late")
        assert hub.received(late) == failure
    finally:
        late.close()


def test_a_worker_that_registers_during_a_pause_is_told_to_hold_requests(hub, tmp_path):
    """A replacement for a dead worker must not serve while the others hold requests."""
    hub.router.dispatch(SetPause(paused=True, http_worker_ipc=hub.addresses["a"]))
    late = Receiver(hub.context, f"ipc://{tmp_path}/late")
    address = f"ipc://{tmp_path}/late"
    try:
        hub.router.dispatch(RegisterWorker(http_worker_ipc=address, pid=os.getpid()))  # a live pid
        assert hub.received(late) == SetPause(paused=True, http_worker_ipc=address)
        hub.router.dispatch(SetPause(paused=False, http_worker_ipc=hub.addresses["a"]))
        assert hub.received(late) == SetPause(paused=False, http_worker_ipc=hub.addresses["a"])
        hub.router.dispatch(RegisterWorker(http_worker_ipc=address, pid=os.getpid()))  # registers again
        assert hub.received(late) == SetPause(paused=False, http_worker_ipc=address)
    finally:
        late.close()
