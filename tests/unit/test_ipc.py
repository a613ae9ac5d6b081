"""The one wire format between processes: every message type survives encode/decode with
every field, a frame that is not a message is refused, and the sockets carry messages."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys
import threading
import time
import typing

import msgspec
import pytest
import zmq

from sluice.ipc import Receiver, Sender, decode, encode
from sluice.messages import (
    AbortReq,
    AnyMessage,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    DetokenizerReady,
    EmbeddingOutput,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    ImageInput,
    InternalState,
    ProcessFailed,
    RegisterWorker,
    ReplicaDied,
    ReplicaLoad,
    ReqOutput,
    SamplingParams,
    SchedulerReady,
    SetPause,
    StrOutput,
    TokenIDOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenLogprob,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
    WorkerDied,
    WorkerStats,
    WorkerStatsReq,
)

WORKER = "ipc:///tmp/sluice-test/worker-1"

REQUEST = TokenizedGenerateReqInput(
    rid="r-1",
    input_ids=[1, 2, 3],
    sampling_params=SamplingParams(max_new_tokens=7, temperature=0.5, stop=["\n"], seed=3, top_k=4),
    stream=True,
    return_logprob=True,
    top_logprobs_num=2,
    logprob_start_len=1,
    input_text="a b c",
    images=[ImageInput(pixel_values=b"\x00\x01\x02\x03", dtype="uint8", shape=[1, 2, 2], hash=-12345)],
    http_worker_ipc=WORKER,
)
OUTPUT = ReqOutput(
    rid="r-1",
    new_token_ids=[5, 6],
    finish_reason=FinishReason(type="stop", matched="\n"),
    prompt_tokens=3,
    completion_tokens=2,
    cached_tokens=2,
    image_tokens=1,
    output_logprobs=[-0.5, -1.25],
    output_top_logprobs=[[TokenLogprob(5, -0.5)], [TokenLogprob(6, -1.25), TokenLogprob(7, -2.0)]],
    input_token_ids=[2, 3],
    input_logprobs=[None, -3.0],
    input_top_logprobs=[[], [TokenLogprob(3, -3.0)]],
    http_worker_ipc=WORKER,
)

# One of each message, every field away from its default.
EXAMPLES = [
    REQUEST,
    BatchTokenizedGenerateReqInput(reqs=[REQUEST, msgspec.structs.replace(REQUEST, rid="r-2", images=[])]),
    TokenizedEmbeddingReqInput(rid="e-1", input_ids=[1, 2], priority=3, received_at=1.5),
    BatchTokenizedEmbeddingReqInput(reqs=[TokenizedEmbeddingReqInput(rid="e-2", input_ids=[3])]),
    BatchEmbeddingOutput(
        outputs=[EmbeddingOutput(output=ReqOutput(rid="e-1", new_token_ids=[]), embedding=b"\x00\x00\x80?")]
    ),
    AbortReq(rid="r-1", abort_all=True, finished_by_stop_string=True, http_worker_ipc=WORKER),
    FlushCacheReq(http_worker_ipc=WORKER),
    UpdateWeightsFromDiskReq(model_path="/models/tuned.gguf", weight_version="v2", http_worker_ipc=WORKER),
    ReplicaLoad(dp_rank=1, finished_rids=["r-1", "r-2::0"]),
    ReplicaDied(dp_rank=1, replicas_alive=3),
    GetInternalStateReq(http_worker_ipc=WORKER),
    BatchTokenIDOutput(
        outputs=[
            TokenIDOutput(
                output=OUTPUT,
                skip_special_tokens=False,
                spaces_between_special_tokens=False,
                stop=["\n", "###"],
                no_stop_trim=True,
                stream=True,
            )
        ]
    ),
    BatchStrOutput(outputs=[StrOutput(output=OUTPUT, text="héllo 🎉")]),
    SchedulerReady(
        max_req_input_len=100,
        context_len=128,
        max_total_tokens=4000,
        eos_token_ids=[2, 7],
        vocab_size=49152,
        image_token_id=99,
        num_image_tokens=16,
        execution={"backend": "kernels"},
    ),
    DetokenizerReady(),
    ProcessFailed(process="scheduler", error="Traceback ..."),
    FlushCacheReqOutput(success=False, message="requests are running", http_worker_ipc=WORKER),
    UpdateWeightsFromDiskReqOutput(
        success=False, message="no such file", weight_version="1", model_path="/m.gguf", param="model_path"
    ),
    InternalState(
        num_running_reqs=1,
        num_waiting_reqs=2,
        kv_tokens_total=100,
        kv_tokens_free=50,
        kv_tokens_cached=20,
        kv_tokens_in_use=30,
        last_step_ms=1.5,
        messages_received={"AbortReq": 3},
        finished_reqs={"abort": 1, "length": 2},
        http_worker_ipc=WORKER,
    ),
    RegisterWorker(http_worker_ipc=WORKER, pid=4242),
    SetPause(paused=True, http_worker_ipc=WORKER),
    WorkerStatsReq(http_worker_ipc=WORKER),
    WorkerStats(rid_to_state_size=3, http_worker_ipc=WORKER, num_paused_reqs=1),
    WorkerDied(pid=4242),
]


def test_the_examples_cover_every_message_type():
    assert {type(message) for message in EXAMPLES} == set(typing.get_args(AnyMessage))


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda message: type(message).__name__)
def test_every_message_survives_the_wire(message):
    decoded = decode(encode(message))
    assert type(decoded) is type(message)
    assert decoded == message


def test_a_frame_that_is_not_a_message_is_refused():
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1 not msgpack")
    with pytest.raises(msgspec.ValidationError):  # valid msgpack, unknown tag
        decode(msgspec.msgpack.encode({"type": "LaunchMissiles", "target": "moon"}))
    with pytest.raises(msgspec.ValidationError):  # a known tag with a field of the wrong type
        decode(msgspec.msgpack.encode({"type": "AbortReq", "rid": 5}))
    with pytest.raises(msgspec.DecodeError):  # cut short
        decode(encode(REQUEST)[:-3])


def test_messages_cross_the_sockets_in_order(tmp_path):
    context = zmq.Context(1)
    address = f"ipc://{tmp_path}/inbox"
    inbox = Receiver(context, address)
    sender = Sender(context, address)
    try:
        assert inbox.recv(timeout_ms=10) is None  # nothing yet: no wait past the timeout
        for message in EXAMPLES[:3]:
            sender.send(message)
        assert inbox.recv(timeout_ms=5000) == EXAMPLES[0]
        drained = []
        while len(drained) < 2:
            assert inbox.sock.poll(5000), "the rest never arrived"
            drained.extend(inbox.drain())
        assert drained == EXAMPLES[1:3]
        assert inbox.recv_nowait() is None
    finally:
        sender.close()
        inbox.close()
        context.term()


def test_a_burst_is_taken_whole_and_ends_at_its_gap_or_its_limit(tmp_path):
    """recv_burst takes what follows the first message less than gap_ms apart (margins of
    seconds here, so a slow machine does not change the answer), and returns at limit_ms
    even while messages keep coming."""
    context = zmq.Context(1)
    address = f"ipc://{tmp_path}/inbox"
    inbox = Receiver(context, address)
    sender = Sender(context, address)
    stop = threading.Event()

    def send_two() -> None:
        sender.send(EXAMPLES[0])
        time.sleep(0.05)
        sender.send(EXAMPLES[1])

    def send_until_stopped() -> None:
        while not stop.wait(0.02):
            sender.send(EXAMPLES[2])

    try:
        assert inbox.recv_burst(10, gap_ms=5, limit_ms=50) == []  # nothing came
        thread = threading.Thread(target=send_two)
        thread.start()
        assert inbox.recv_burst(5000, gap_ms=2000, limit_ms=20000) == EXAMPLES[:2]
        thread.join()
        endless = threading.Thread(target=send_until_stopped)
        endless.start()
        burst = inbox.recv_burst(5000, gap_ms=2000, limit_ms=300)
        still_sending = endless.is_alive()
        stop.set()
        endless.join()
        assert still_sending and burst and all(message == EXAMPLES[2] for message in burst)
        while inbox.recv(timeout_ms=100) is not None:  # the endless sender's last ones
            pass
        thread = threading.Thread(target=send_two)
        thread.start()
        assert inbox.recv_burst(5000, gap_ms=0, limit_ms=0) == EXAMPLES[:1]  # gap 0: no wait for the second
        assert inbox.recv(timeout_ms=5000) == EXAMPLES[1]
        thread.join()
    finally:
        stop.set()
        sender.close()
        inbox.close()
        context.term()


async def test_a_back_end_process_that_dies_while_starting_ends_the_wait_at_once(tmp_path):
    """Killed while loading (for memory, say), a process says nothing: the start-up wait looks
    at the processes between polls instead of waiting out its 10 minutes."""
    import zmq.asyncio

    from sluice.ipc import AsyncReceiver
    from sluice.tokenizer.control import BackendError, wait_for_backend

    context = zmq.asyncio.Context(1)
    inbox = AsyncReceiver(context, f"ipc://{tmp_path}/inbox")
    try:
        with pytest.raises(BackendError, match="while starting, the scheduler process was killed"):
            await wait_for_backend(inbox, timeout_s=600, dead_process=lambda: "scheduler process was killed")
    finally:
        inbox.close()
        context.term()


def _exit_with(code: int) -> None:
    if code < 0:
        os.kill(os.getpid(), -code)
    sys.exit(code)


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (-signal.SIGKILL, "sluice-scheduler process was killed (SIGKILL: out of memory?)"),
        (-signal.SIGSEGV, "sluice-scheduler process was killed by SIGSEGV"),
        (1, "sluice-scheduler process exited with status 1 (its error is above)"),
        (-40, "sluice-scheduler process was killed by signal 40"),
    ],
)
def test_a_process_dead_while_starting_is_named_with_how_it_ended(code, said):
    """Not "out of memory?" for every death: a script without a main guard makes its spawned
    children exit with status 1, and the start-up error should not send its author to look
    at memory."""
    from sluice.launch import Backend

    process = multiprocessing.get_context("fork").Process(target=_exit_with, args=(code,), name="sluice-scheduler")
    process.start()
    process.join(30)
    backend = Backend.__new__(Backend)  # its processes alone, none started
    backend.processes = [process]
    assert backend.dead_while_starting() == said


@pytest.mark.parametrize(
    ("code", "level", "said"),
    [
        (0, "WARNING", "sluice-scheduler exited with status 0, as on SIGTERM"),
        (-signal.SIGKILL, "ERROR", "sluice-scheduler died"),
    ],
)
def test_a_child_stopped_by_the_process_groups_sigterm_is_not_logged_as_a_crash(code, level, said, caplog):
    """A SIGTERM to the server's process group reaches the children too, which exit 0 on it
    (procutil) before the launcher stops them: no "died" error at every ordinary stop."""
    from sluice.launch import Backend

    process = multiprocessing.get_context("fork").Process(target=_exit_with, args=(code,), name="sluice-scheduler")
    process.start()
    process.join(30)
    backend = Backend.__new__(Backend)
    backend.processes = [process]
    with caplog.at_level("INFO", logger="sluice.launch"):
        backend.log_death("sluice-scheduler")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [(level, said)]
