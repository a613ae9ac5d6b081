"""The TokenizerManager's control calls: each reply to the oldest waiter of its type, a
timeout or a dead back end as BackendError, and replies gathered from several workers."""

from __future__ import annotations

import asyncio

import pytest

from sluice.messages import FlushCacheReq, FlushCacheReqOutput, Message, WorkerStats, WorkerStatsReq
from sluice.tokenizer.control import BackendError, ControlChannel


def channel() -> tuple[ControlChannel, list[Message]]:
    sent: list[Message] = []
    return ControlChannel(sent.append), sent


async def test_each_reply_finds_its_call_by_control_id():
    control, sent = channel()
    first = asyncio.create_task(control.call(FlushCacheReq(), FlushCacheReqOutput))
    second = asyncio.create_task(control.call(FlushCacheReq(), FlushCacheReqOutput))
    await asyncio.sleep(0)
    ids = [request.control_id for request in sent]
    assert len(set(ids)) == 2 and 0 not in ids
    control.deliver(FlushCacheReqOutput(success=False, message="two", control_id=ids[1]))
    control.deliver(FlushCacheReqOutput(success=True, message="one", control_id=ids[0]))
    assert [(await first).message, (await second).message] == ["one", "two"]


async def test_a_reply_after_its_call_timed_out_goes_to_no_one_else():
    control, sent = channel()
    with pytest.raises(BackendError):
        await control.call(FlushCacheReq(), FlushCacheReqOutput, timeout_s=0.01)
    later = asyncio.create_task(control.call(FlushCacheReq(), FlushCacheReqOutput))
    await asyncio.sleep(0)
    control.deliver(FlushCacheReqOutput(success=True, message="late", control_id=sent[0].control_id))
    control.deliver(FlushCacheReqOutput(success=True, message="mine", control_id=sent[1].control_id))
    assert (await later).message == "mine"


async def test_no_reply_in_time_and_a_dead_back_end_are_backend_errors():
    control, _ = channel()
    with pytest.raises(BackendError, match="did not answer a FlushCacheReq"):
        await control.call(FlushCacheReq(), FlushCacheReqOutput, timeout_s=0.01)
    waiting = asyncio.create_task(control.call(FlushCacheReq(), FlushCacheReqOutput))
    await asyncio.sleep(0)
    control.fail_all("the scheduler process failed")
    with pytest.raises(BackendError, match="scheduler process failed"):
        await waiting
    # A call after that fails at once, not after its 30 s (it used to wait them out).
    with pytest.raises(BackendError, match="scheduler process failed"):
        await asyncio.wait_for(control.call(FlushCacheReq(), FlushCacheReqOutput), 1.0)
    with pytest.raises(BackendError, match="scheduler process failed"):
        await asyncio.wait_for(control.gather(WorkerStatsReq(http_worker_ipc="w"), WorkerStats, 2, 5.0), 1.0)


async def test_gather_keeps_the_replies_that_came_in_time():
    control, sent = channel()
    gathering = asyncio.create_task(control.gather(WorkerStatsReq(http_worker_ipc="w"), WorkerStats, 3, 0.05))
    await asyncio.sleep(0)
    for size in (1, 2):
        control.deliver(WorkerStats(rid_to_state_size=size, http_worker_ipc="w", control_id=sent[0].control_id))
    assert sorted(stats.rid_to_state_size for stats in await gathering) == [1, 2]


async def test_overlapping_gathers_each_get_their_own_replies():
    """Two /get_server_info calls at once, and a reply late for a gather that timed out: each
    gather sums the replies to its own request, none of another's."""
    control, sent = channel()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(control.gather(WorkerStatsReq(http_worker_ipc="w"), WorkerStats, 2, 5.0), 0.01)
    first = asyncio.create_task(control.gather(WorkerStatsReq(http_worker_ipc="w"), WorkerStats, 2, 1.0))
    second = asyncio.create_task(control.gather(WorkerStatsReq(http_worker_ipc="w"), WorkerStats, 2, 1.0))
    await asyncio.sleep(0)
    late, one, two = (request.control_id for request in sent)
    for control_id, size in ((late, 100), (two, 20), (one, 10), (two, 21), (one, 11)):
        control.deliver(WorkerStats(rid_to_state_size=size, http_worker_ipc="w", control_id=control_id))
    assert sorted(s.rid_to_state_size for s in await first) == [10, 11]
    assert sorted(s.rid_to_state_size for s in await second) == [20, 21]
