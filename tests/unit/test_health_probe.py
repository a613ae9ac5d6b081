"""/health_generate's probe (server/app.py) against a fake TokenizerManager: what the probe's
own answer, the back end's state and other requests' outputs each make of it."""

from __future__ import annotations

import time

from sluice.messages import FinishReason
from sluice.server.app import _probe_generation
from sluice.tokenizer.admission import ServerBusy
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.pause import PauseGate
from sluice.tokenizer.result import GenerateChunk


class FakeManager:
    def __init__(self, answer: GenerateChunk | Exception, outputs_flow: bool = False) -> None:
        self.answer = answer
        self.backend_error: str | None = None
        self.pause = PauseGate(None)
        self.last_receive_tstamp = time.time() + (3600 if outputs_flow else -3600)

    async def generate_request(self, obj):
        if isinstance(self.answer, Exception):
            raise self.answer
        yield self.answer


def probe_chunk(reason: FinishReason | None) -> GenerateChunk:
    return GenerateChunk(rid="probe", path="single", text="x", output_ids=[1], finish_reason=reason)


async def status_of(tm: FakeManager) -> int:
    return (await _probe_generation(tm, GenerateReqInput(input_ids=[0], rid="probe"))).status_code


async def test_the_probe_answers_for_the_back_end():
    assert await status_of(FakeManager(probe_chunk(FinishReason(type="length", length=1)))) == 200
    # The back end died while the probe waited: its final chunk is a 503, not a token.
    lost = FinishReason(type="abort", message="scheduler died", status_code=503)
    assert await status_of(FakeManager(probe_chunk(lost))) == 503


async def test_a_probe_refused_for_the_servers_load_looks_for_outputs_instead():
    busy = ServerBusy("the server is busy")
    assert await status_of(FakeManager(busy, outputs_flow=True)) == 200
    queue_full = FinishReason(type="abort", message="queue full", status_code=503, rejected="queue_full")
    assert await status_of(FakeManager(probe_chunk(queue_full), outputs_flow=True)) == 200


async def test_a_paused_server_refusing_the_probe_as_busy_says_paused():
    """Requests held by a pause count against the queue, which then refuses the probe."""
    tm = FakeManager(ServerBusy("the server is busy"))
    await tm.pause.set(True)
    answer = await _probe_generation(tm, GenerateReqInput(input_ids=[0], rid="probe"))
    assert answer.status_code == 200 and answer.body == b'{"status":"paused"}'


async def test_a_probe_held_by_a_weight_update_says_so():
    tm = FakeManager(ServerBusy("the server is busy"))
    async with tm.pause.closed_for_update():
        answer = await _probe_generation(tm, GenerateReqInput(input_ids=[0], rid="probe"))
    assert answer.status_code == 200 and answer.body == b'{"status":"updating_weights"}'
