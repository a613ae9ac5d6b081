"""The DataParallelController's placement and merging, without replicas: its sockets only
bind and connect, so what it sends is read back from the replicas' inboxes."""

from __future__ import annotations

import shutil

import pytest
import zmq

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import Receiver
from sluice.messages import (
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    InternalState,
    ProcessFailed,
    ReplicaDied,
    ReplicaLoad,
    SamplingParams,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from sluice.scheduler.dp_controller import DataParallelController, merge_replies, replica_port_args
from sluice.scheduler.prefix_index import BLOCK_TOKENS, PrefixIndex

PREFIX = list(range(100, 164))  # four blocks


def request(rid: str, ids: list[int]) -> TokenizedGenerateReqInput:
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=SamplingParams())


@pytest.fixture
def wired():
    """A controller of two replicas, the replicas' inboxes, and the tokenizer's."""

    def make(method: str):
        port_args = PortArgs.create()
        controller = DataParallelController(ServerArgs(dp_size=2, load_balance_method=method), port_args, [0, 0])
        context = zmq.Context(1)
        inboxes = [Receiver(context, replica_port_args(port_args, r).scheduler_input) for r in range(2)]
        tokenizer = Receiver(context, port_args.tokenizer_input)
        made.append((port_args, context, [*inboxes, tokenizer], controller))
        return controller, inboxes, tokenizer

    made: list = []
    yield make
    for port_args, context, receivers, controller in made:
        for receiver in receivers:
            receiver.close()
        controller.inbox.close()
        for sender in [*controller.replicas, controller.to_tokenizer, controller.to_detokenizer]:
            sender.close()
        context.term()
        controller.context.term()
        shutil.rmtree(port_args.ipc_dir, ignore_errors=True)


def received_rids(inbox: Receiver) -> list[str]:
    rids = []
    while (message := inbox.recv(timeout_ms=200)) is not None:
        if isinstance(message, BatchTokenizedGenerateReqInput):
            rids += [req.rid for req in message.reqs]
        elif isinstance(message, TokenizedGenerateReqInput):
            rids.append(message.rid)
    return rids


def test_the_prefix_index_matches_whole_blocks_of_a_prefix():
    index = PrefixIndex(2)
    names = PrefixIndex.block_names([*PREFIX, 1, 2, 3])
    assert len(names) == 4
    index.insert(names, 1)
    assert index.matched_tokens(PrefixIndex.block_names(PREFIX[:40] + [9] * 40), 1) == 2 * BLOCK_TOKENS
    assert index.matched_tokens(names, 0) == 0
    small = PrefixIndex(1, max_blocks=4)
    small.insert(names, 0)
    small.insert(PrefixIndex.block_names([7] * 32), 0)  # the longest blocks of the first go first
    assert small.matched_tokens(names, 0) == 2 * BLOCK_TOKENS


def test_cache_aware_follows_the_prefix_until_the_loads_part(wired):
    controller, inboxes, _ = wired("cache_aware")
    for i in range(12):
        controller.dispatch(request(f"r{i}", [*PREFIX, i]))
    first, second = (received_rids(inbox) for inbox in inboxes)
    # One replica takes the shared prefix until it has 9 more in flight than the other; then
    # the other holds the prefix too, and the less loaded of the two takes the rest.
    assert first == [f"r{i}" for i in range(9)] and second == ["r9", "r10", "r11"]
    controller.dispatch(ReplicaLoad(dp_rank=0, finished_rids=[f"r{i}" for i in range(9)]))
    controller.dispatch(request("again", [*PREFIX, 99]))
    assert received_rids(inboxes[0]) == ["again"]


def test_cache_aware_forgets_the_prefixes_of_a_flushed_replica(wired):
    """After /flush_cache the replica holding the prefix has lost it: the next prompt with
    that prefix goes to the least loaded replica, not back to the flushed one."""
    controller, inboxes, tokenizer = wired("cache_aware")
    controller.dispatch(request("x", [7] * 64))
    controller.dispatch(request("a", [*PREFIX, 1]))  # the least loaded: replica 1
    assert received_rids(inboxes[0]) == ["x"] and received_rids(inboxes[1]) == ["a"]
    controller.dispatch(FlushCacheReq(control_id=1, http_worker_ipc="w"))
    for rank in (0, 1):  # replica 0 refuses (say, a request was running there)
        controller.dispatch(FlushCacheReqOutput(success=rank == 1, dp_rank=rank, control_id=1, http_worker_ipc="w"))
    assert isinstance(tokenizer.recv(timeout_ms=1000), FlushCacheReqOutput)
    controller.dispatch(ReplicaLoad(dp_rank=0, finished_rids=["x"]))
    controller.dispatch(ReplicaLoad(dp_rank=1, finished_rids=["a"]))
    controller.dispatch(request("b", [*PREFIX, 2]))
    controller.dispatch(request("c", [7] * 64))  # replica 0 kept its prompt: c follows it
    assert received_rids(inboxes[0]) == ["b", "c"] and received_rids(inboxes[1]) == []


def test_round_robin_alternates_and_samples_follow_their_parent(wired):
    controller, inboxes, _ = wired("round_robin")
    controller.dispatch(request("a", PREFIX))
    controller.dispatch(request("p::prefix", PREFIX))
    children = [request(f"p::{i}", PREFIX) for i in range(4)]
    controller.dispatch(BatchTokenizedGenerateReqInput(reqs=children))
    assert received_rids(inboxes[0]) == ["a"]
    assert received_rids(inboxes[1]) == ["p::prefix", "p::0", "p::1", "p::2", "p::3"]


def test_internal_states_of_every_replica_merge_into_one(wired):
    controller, _, tokenizer = wired("round_robin")
    controller.dispatch(GetInternalStateReq(control_id=7, http_worker_ipc="w"))
    for rank, running in ((1, 3), (0, 2)):
        state = InternalState(
            num_running_reqs=running,
            num_waiting_reqs=1,
            kv_tokens_total=100,
            kv_tokens_free=50,
            kv_tokens_cached=10,
            kv_tokens_in_use=40,
            messages_received={"GetInternalStateReq": 1},
            dp_rank=rank,
            control_id=7,
            http_worker_ipc="w",
        )
        controller.dispatch(state)
    merged = tokenizer.recv(timeout_ms=1000)
    assert isinstance(merged, InternalState) and (merged.http_worker_ipc, merged.control_id) == ("w", 7)
    assert (merged.num_running_reqs, merged.kv_tokens_total, merged.messages_received) == (
        5,
        200,
        {"GetInternalStateReq": 2},
    )
    assert [r.dp_rank for r in merged.replicas] == [0, 1]


def test_replies_find_their_call_across_workers_and_one_update_runs_at_a_time(wired):
    controller, _, tokenizer = wired("round_robin")
    for worker in ("a", "b"):
        controller.dispatch(FlushCacheReq(control_id=1, http_worker_ipc=worker))
    controller.dispatch(UpdateWeightsFromDiskReq(model_path="/m.gguf", control_id=2, http_worker_ipc="a"))
    controller.dispatch(UpdateWeightsFromDiskReq(model_path="/n.gguf", control_id=2, http_worker_ipc="b"))
    refused = tokenizer.recv(timeout_ms=1000)
    assert isinstance(refused, UpdateWeightsFromDiskReqOutput) and not refused.success
    assert (refused.http_worker_ipc, refused.control_id, refused.message) == (
        "b",
        2,
        "another weight update is in progress",
    )
    # Worker b's flush is answered by both replicas first: it goes to b, a still waits.
    for rank in (1, 0):
        controller.dispatch(FlushCacheReqOutput(success=True, dp_rank=rank, control_id=1, http_worker_ipc="b"))
    answer = tokenizer.recv(timeout_ms=1000)
    assert isinstance(answer, FlushCacheReqOutput) and answer.http_worker_ipc == "b" and answer.success
    assert tokenizer.recv(timeout_ms=100) is None


def test_when_the_last_replica_dies_pending_calls_fail_after_process_failed(wired):
    controller, _, tokenizer = wired("round_robin")
    controller.dispatch(UpdateWeightsFromDiskReq(model_path="/m.gguf", control_id=3, http_worker_ipc="a"))
    controller.replica_died(0)
    died = tokenizer.recv(timeout_ms=1000)
    assert isinstance(died, ReplicaDied) and died.replicas_alive == 1
    controller.replica_died(1)
    assert isinstance(tokenizer.recv(timeout_ms=1000), ProcessFailed)
    failed = tokenizer.recv(timeout_ms=1000)
    assert isinstance(failed, UpdateWeightsFromDiskReqOutput) and not failed.success and failed.control_id == 3


def test_a_flush_refused_by_one_replica_says_which_replicas_did_flush():
    """Each replica flushes on its own (as in SGLang): the 400 says so, not only who refused."""
    replies = {
        0: FlushCacheReqOutput(success=False, message="requests are running", dp_rank=0),
        1: FlushCacheReqOutput(success=True, dp_rank=1),
    }
    merged = merge_replies(FlushCacheReq(control_id=3, http_worker_ipc="a"), replies)
    assert isinstance(merged, FlushCacheReqOutput) and not merged.success
    assert merged.message == "replica 0: requests are running; replicas [1] did flush theirs"
