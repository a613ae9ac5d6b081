"""/pause_generation's gate without a server: requests wait while paused, go on when
generation continues, and end at the gate when /abort_request names them."""

from __future__ import annotations

import asyncio
import time

from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.pause import PauseGate, aborted_while_held


async def held(gate: PauseGate, rids: list[str]) -> asyncio.Task[bool]:
    task = asyncio.ensure_future(gate.wait_while_closed(None, rids))
    await asyncio.sleep(0.01)
    assert not task.done()
    return task


async def test_an_abort_ends_the_held_requests_it_names_and_continue_lets_the_rest_go():
    gate = PauseGate(None)
    assert await gate.wait_while_closed(None, ["free"]) is False  # not paused: at once
    await gate.set(True)
    named, batch, other = await held(gate, ["x"]), await held(gate, ["b0", "b1"]), await held(gate, ["y"])
    assert gate.num_held == 3
    gate.abort("x")
    gate.abort("b1")  # one item of a batch names the whole request
    assert await asyncio.wait_for(named, 1) is True and await asyncio.wait_for(batch, 1) is True
    assert not other.done() and gate.num_held == 1
    await gate.set(False)
    assert await asyncio.wait_for(other, 1) is False and gate.num_held == 0


async def test_abort_all_ends_every_held_request():
    gate = PauseGate(None)
    await gate.set(True)
    tasks = [await held(gate, [rid]) for rid in ("a", "b")]
    gate.abort("", abort_all=True)
    assert [await asyncio.wait_for(t, 1) for t in tasks] == [True, True]


def test_each_item_and_sample_of_a_request_ended_at_the_gate_has_its_final_chunk():
    obj = GenerateReqInput(text=["one", "two"], rid=["p", "q"], return_logprob=True)
    chunks = aborted_while_held(obj, 2)
    assert [(c.rid, c.index) for c in chunks] == [("p::0", 0), ("p::1", 1), ("q::0", 2), ("q::1", 3)]
    assert all(c.finish_reason.type == "abort" and c.return_logprob and c.output_ids == [] for c in chunks)
    [single] = aborted_while_held(GenerateReqInput(text="one", rid="r"), received_at=time.time() - 2)
    assert (single.rid, single.index, single.path) == ("r", None, "single")
    assert 2 <= single.e2e_latency < 60  # the time it waited (was 0)


async def test_a_weight_update_closes_the_gate_until_it_and_any_pause_are_over():
    gate = PauseGate(None)
    async with gate.closed_for_update():
        waiting = await held(gate, ["w"])
        await gate.set(True)
        await gate.set(False)  # a pause that ends during the update does not open the gate
        await asyncio.sleep(0.01)
        assert not waiting.done()
        await gate.set(True)
    await asyncio.sleep(0.01)
    assert not waiting.done()  # the update is over, the pause is not
    await gate.set(False)
    assert await asyncio.wait_for(waiting, 1) is False and gate.num_held == 0
