"""The TokenizerManager: the request channel between the HTTP layer and the Scheduler.

`generate_request` is an async generator: tokenize, send, then yield one chunk per output
that `handle_loop` receives. `rid_to_state` holds one ReqState per live rid, created when
the request enters and deleted exactly once: when its final chunk or abort comes back, or
when it fails before it was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import AsyncReceiver, Sender
from sluice.messages import (
    UPDATE_IN_PROGRESS,
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    InternalState,
    Message,
    ProcessFailed,
    RegisterWorker,
    ReplicaDied,
    ReqOutput,
    SchedulerReady,
    SetPause,
    StrOutput,
    TokenizedGenerateReqInput,
    TokenizedRequest,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
    WorkerDied,
    WorkerStats,
    WorkerStatsReq,
    rid_family,
)
from sluice.sampling import ClientError
from sluice.tokenizer.admission import check_queue_room, check_request_size
from sluice.tokenizer.batch_request import handle_batch_request
from sluice.tokenizer.control import BackendError, ControlChannel, wait_for_backend
from sluice.tokenizer.embedding_request import handle_embedding_request
from sluice.tokenizer.io_struct import EmbeddingReqInput, GenerateReqInput
from sluice.tokenizer.metrics import RequestMetrics
from sluice.tokenizer.multimodal.request_images import RequestImages
from sluice.tokenizer.pause import PauseGate, aborted_while_held, client_rids, held_items
from sluice.tokenizer.req_state import DISCONNECT_POLL_S, ArrivingRids, ClientConnection, LiveRids, ReqState
from sluice.tokenizer.request_tokenizer import RequestTokenizer
from sluice.tokenizer.result import GenerateChunk
from sluice.tokenizer.rwlock import RWLock
from sluice.tokenizer.watchdog import SoftWatchdog

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from sluice.tokenizer_files import ChatTemplate

logger = logging.getLogger(__name__)

# A weight update waits for the running requests to finish, then loads: it may take long.
WEIGHT_UPDATE_TIMEOUT_S = 3600.0
# How long a /metrics scrape waits for the Scheduler's gauges: a step (one prefill chunk) is
# well under it, Prometheus' default scrape timeout (10 s) is above it.
METRICS_SCHEDULER_WAIT_S = 5.0


class TokenizerManager:
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs,
        tokenizer: PreTrainedTokenizerBase,
        chat_template: ChatTemplate | None = None,
        http_worker_ipc: str | None = None,
    ) -> None:
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.inputs = RequestTokenizer(server_args, tokenizer)
        self.context = zmq.asyncio.Context(1)
        self.sync_context = zmq.Context(1)
        # With several HTTP workers this one is a TokenizerWorker: it has its own inbox and
        # talks to the Scheduler through the MultiTokenizerRouter, which owns the
        # tokenizer_input address and routes results back by http_worker_ipc.
        self.http_worker_ipc = http_worker_ipc
        if http_worker_ipc is None:
            self.recv_from_detokenizer = AsyncReceiver(self.context, port_args.tokenizer_input)
            self.send_to_scheduler = Sender(self.sync_context, port_args.scheduler_input)
        else:
            self.recv_from_detokenizer = AsyncReceiver(self.context, http_worker_ipc)
            self.send_to_scheduler = Sender(self.sync_context, port_args.tokenizer_input)

        self.rid_to_state: dict[str, ReqState] = {}
        self.live_rids = LiveRids(self.rid_to_state)
        self.arriving = ArrivingRids()
        # The weights served: set when the back end reports ready, changed by weight updates.
        self.weight_version = server_args.weight_version
        self.weights_path = server_args.resolved_model_path()
        self.metrics = RequestMetrics()
        self.model_update_lock = RWLock()
        self.updating_weights = False  # this worker has an update under way
        self.backend_error: str | None = None  # the back end is gone: requests fail
        self.dead_replicas: set[int] = set()  # --dp-size: Scheduler replicas that died
        self.dead_workers: set[int] = set()  # --tokenizer-worker-num: pids of HTTP workers that died
        self.last_receive_tstamp = time.time()
        self.control = ControlChannel(self.send)
        self.pause = PauseGate(None if http_worker_ipc is None else self.control)
        self._handle_loop_task: asyncio.Task[None] | None = None
        self._poll_clients_task: asyncio.Task[None] | None = None
        self.soft_watchdog = SoftWatchdog(
            server_args.soft_watchdog_timeout, lambda: len(self.rid_to_state), self._describe_state
        )

    # ------------------------------------------------------------ start-up

    async def wait_for_backend(
        self, timeout_s: float = 600.0, dead_process: Callable[[], str | None] = lambda: None
    ) -> SchedulerReady:
        """Wait until the Scheduler and DetokenizerManager report ready; keep the model's limits."""
        self.scheduler_info = info = await wait_for_backend(self.recv_from_detokenizer, timeout_s, dead_process)
        return info

    async def register_with_router(self) -> None:
        """As one of several HTTP workers, announce this worker's inbox to the router, which
        answers with the pause state: a worker that replaces a dead one holds new requests
        while the others do."""
        assert self.http_worker_ipc is not None
        # _dispatch sets the gate from the reply, as from every SetPause, in arrival order.
        await self.control.call(RegisterWorker(http_worker_ipc=self.http_worker_ipc, pid=os.getpid()), SetPause)

    def close(self) -> None:
        self.soft_watchdog.stop()
        self.recv_from_detokenizer.close()
        self.send_to_scheduler.close()
        self.context.term()
        self.sync_context.term()

    def start_handle_loop(self) -> None:
        if self._handle_loop_task is None:
            loop = asyncio.get_running_loop()
            self._handle_loop_task = loop.create_task(self.handle_loop())
            self._poll_clients_task = loop.create_task(self.poll_clients())
            self.soft_watchdog.start()

    # The tokenizer side owns the model's limits and the image pipeline; both are set once
    # the back end has started.
    @property
    def scheduler_info(self) -> SchedulerReady | None:
        return self.inputs.scheduler_info

    @scheduler_info.setter
    def scheduler_info(self, info: SchedulerReady) -> None:
        self.inputs.scheduler_info = info

    @property
    def mm_processor(self) -> RequestImages | None:
        return self.inputs.mm_processor

    @mm_processor.setter
    def mm_processor(self, processor: RequestImages | None) -> None:
        self.inputs.mm_processor = processor

    @property
    def limits(self) -> SchedulerReady:
        """The model's limits; a BackendError before the back end reported them."""
        if self.scheduler_info is None:
            raise BackendError("the back end is not ready")
        return self.scheduler_info

    @property
    def max_req_input_len(self) -> int:
        return self.limits.max_req_input_len

    @property
    def context_len(self) -> int:
        return self.limits.context_len

    # ------------------------------------------------------------ the request path

    async def generate_request(
        self,
        obj: GenerateReqInput | EmbeddingReqInput,
        request: ClientConnection | None = None,
        hold_at_gate: bool = True,
    ) -> AsyncGenerator[GenerateChunk, None]:
        """Check the request, hold it at the gate while the server is paused or this worker
        updates weights (not the server's own warm-up), then run it under the reader lock (a
        weight update waits for it)."""
        received_at = time.time()
        if self.backend_error:
            raise BackendError(self.backend_error)
        n, log_metrics = 1, True
        if isinstance(obj, GenerateReqInput):
            obj.normalize()
            n, log_metrics = check_request_size(obj, self.server_args), obj.log_metrics
        self._check_queue_room(log_metrics)
        if hold_at_gate and self.pause.closed and isinstance(obj, GenerateReqInput):
            await self.inputs.check_sampling_params(obj)  # a bad request is refused now, not after the hold
        try:
            aborted = hold_at_gate and await self.pause.wait_while_closed(request, client_rids(obj))
        except ClientError:  # the client left while the gate held it: counted as aborted, as in the Scheduler
            if log_metrics:
                self.metrics.on_ended_unrun(held_items(obj, n))
            raise
        if aborted:
            ended = aborted_while_held(obj, n, received_at)
            if log_metrics:
                self.metrics.on_ended_unrun(len(ended))
            for chunk in ended:
                yield chunk
            return
        rids = client_rids(obj)
        self.arriving.enter(rids)
        try:
            async with self.model_update_lock.reader_lock():
                responses: AsyncIterator[GenerateChunk]
                if isinstance(obj, EmbeddingReqInput):
                    responses = handle_embedding_request(self, obj, request, received_at)
                elif obj.is_single and n == 1:
                    responses = self._single_request(obj, request, received_at)
                else:
                    responses = handle_batch_request(self, obj, request, received_at)
                async for response in responses:
                    yield response
        finally:
            self.arriving.leave(rids)

    async def _single_request(
        self, obj: GenerateReqInput, request: ClientConnection | None, received_at: float
    ) -> AsyncIterator[GenerateChunk]:
        [tokenized] = await self.inputs.tokenize([obj], self.live_rids, received_at=received_at)
        if request is not None and await request.is_disconnected():  # gone while its images were read
            if obj.log_metrics:
                self.metrics.on_ended_unrun(1)
            return
        state = self.add_req_state(tokenized, "single", log_metrics=obj.log_metrics)
        self.send_new([tokenized], [state])
        async for response in self.wait_response(state, request):
            yield response

    def _check_queue_room(self, log_metrics: bool = True) -> None:
        in_flight = len(self.rid_to_state) + self.pause.num_held
        check_queue_room(self.server_args, in_flight, self.metrics, log_metrics)

    # ------------------------------------------------------------ what every path uses

    def add_req_state(
        self, req: TokenizedRequest, path: str, index: int | None = None, log_metrics: bool = True
    ) -> ReqState:
        """Register a request about to be sent; its results go to the returned state."""
        if not self.rid_to_state:
            self.soft_watchdog.feed()  # a busy period starts: idle time never counts
        state = ReqState(
            rid=req.rid,
            stream=False,
            path=path,
            index=index,
            received_at=req.received_at or time.time(),
            log_metrics=log_metrics,
        )
        if isinstance(req, TokenizedGenerateReqInput):
            state.stream = req.stream
            state.return_logprob = req.return_logprob
            state.return_timings = req.return_timings
        if req.rid in self.rid_to_state:  # the rid checks in front of here make this a bug
            raise RuntimeError(f"a state for {req.rid} exists already")
        self.live_rids.add(state)
        return state

    def send_new(self, messages: list[Message], states: list[ReqState]) -> None:
        """Send new requests, whose states add_req_state just made: `messages` is one message
        for all of them or one each. Those an abort named while they came in end here,
        unsent, as aborted. Those never sent (the back end died while they were tokenized,
        or a send raised: a bug, a request that passed every check and cannot be sent) end
        here and free their rids; any already sent is aborted, and its abort output ends it
        as any other's, so no state waits forever."""
        if early := {state.rid for state in states if self.arriving.aborted(state.rid)}:
            for state in states:
                if state.rid in early:
                    self._end_unsent(state, state.abort_chunk("aborted", status_code=None))
            states = [state for state in states if state.rid not in early]
            messages = [kept for message in messages if (kept := _without(message, early)) is not None]
        sent = 0
        try:
            if self.backend_error:
                raise BackendError(self.backend_error)
            for message in messages:
                self.send(message)
                sent += 1
        except Exception:
            sent_states = states[:sent] if len(messages) == len(states) else []
            for state in states[len(sent_states) :]:
                if self.rid_to_state.get(state.rid) is state:
                    self.live_rids.remove(state.rid)
            for state in sent_states:
                with contextlib.suppress(Exception):
                    self._abort_own(state)
            raise

    def send(self, message: Message) -> None:
        """Send a request or control message to the Scheduler (through the router, if any)."""
        self._attach_multi_http_worker_info(message)
        self.send_to_scheduler.send(message)

    def _attach_multi_http_worker_info(self, message: Message) -> None:
        """Tag a message with the worker that must get its results (a batch: every item)."""
        if self.http_worker_ipc is None:
            return
        if isinstance(message, BatchTokenizedGenerateReqInput | BatchTokenizedEmbeddingReqInput):
            for req in message.reqs:
                req.http_worker_ipc = self.http_worker_ipc
        elif hasattr(message, "http_worker_ipc"):
            message.http_worker_ipc = self.http_worker_ipc

    async def wait_response(
        self, state: ReqState, request: ClientConnection | None = None
    ) -> AsyncIterator[GenerateChunk]:
        """The chunks of one request (streaming: each with what is new; else one with
        everything). Leaving early (the client went away, the consumer stopped) aborts it."""
        finished = False
        try:
            while True:
                await state.event.wait()
                state.event.clear()
                chunks, state.pending = state.pending, []
                if not chunks:  # woken by poll_clients: is the client still there?
                    if request is not None and await request.is_disconnected():
                        logger.info("client of %s disconnected: aborting", state.rid)
                        return
                    if self.backend_error:
                        raise BackendError(self.backend_error)
                    continue
                for chunk in chunks:
                    finished = chunk.finished
                    yield chunk
                    if finished:
                        return
        finally:
            if not finished:
                self._abort_own(state)

    def _abort_own(self, state: ReqState) -> None:
        """End a request of this worker's that no one waits for any more. Once its state is
        gone its end has come (the abort would find nothing of its own), and the rid may
        already name a new request, here or on another worker: neither is aborted."""
        if self.rid_to_state.get(state.rid) is state:
            self.send(AbortReq(rid=state.rid, own_request=True))

    # ------------------------------------------------------------ results

    async def handle_loop(self) -> None:
        """Receive every output and control reply; feed the watchdog after each message."""
        while True:
            recv_obj = await self.recv_from_detokenizer.recv()
            try:
                self._dispatch(recv_obj)
            except Exception:
                logger.exception("handle_loop failed on a %s", type(recv_obj).__name__)
            self.last_receive_tstamp = time.time()
            self.soft_watchdog.feed()

    async def poll_clients(self) -> None:
        """Wake every waiting request once a DISCONNECT_POLL_S, so that each checks whether its
        client went away (one timer for all, not one a token: a stream waits once a token)."""
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            for state in list(self.rid_to_state.values()):
                state.event.set()

    def _dispatch(self, recv_obj: Message) -> None:
        match recv_obj:
            case BatchStrOutput() | BatchEmbeddingOutput():
                self._handle_batch_output(recv_obj)
            case ProcessFailed():
                self.fail_all(f"the {recv_obj.process} process failed")
            case ReplicaDied():
                self.dead_replicas.add(recv_obj.dp_rank)
            case WorkerDied():
                # Requests of the other workers are unharmed; the server reports unhealthy.
                self.dead_workers.add(recv_obj.pid)
            case SetPause():
                self.pause.set_now(recv_obj.paused)
                if recv_obj.http_worker_ipc == self.http_worker_ipc:
                    self.control.deliver(recv_obj)  # this worker's own, back from the router
            case UpdateWeightsFromDiskReqOutput():
                if recv_obj.success:
                    self.weight_version, self.weights_path = recv_obj.weight_version, recv_obj.model_path
                if recv_obj.http_worker_ipc == self.http_worker_ipc:
                    self.control.deliver(recv_obj)  # the worker that asked (every worker hears it)
            case AbortReq():  # another worker's /abort_request: this worker's held and arriving requests
                self.pause.abort(recv_obj.rid, recv_obj.abort_all)
                self.arriving.abort(recv_obj.rid, recv_obj.abort_all)
                self._abort_again_behind_sent(recv_obj)
            case WorkerStatsReq():
                stats = self._worker_stats(recv_obj.http_worker_ipc)
                stats.control_id = recv_obj.control_id
                self.send_to_scheduler.send(stats)
            case _:
                self.control.deliver(recv_obj)

    def _abort_again_behind_sent(self, abort: AbortReq) -> None:
        """A request this worker sent before it heard of another worker's abort may reach the
        Scheduler after that abort, which then found nothing: abort what it names again,
        behind the requests on this worker's own channel (only this worker's). One sent after
        the abort reached the Scheduler, before this worker heard of it, ends too: the abort
        named its rid while it came in, as for a request still being tokenized."""
        if any(abort.abort_all or abort.rid in (rid, rid_family(rid)) for rid in self.rid_to_state):
            self.send(AbortReq(rid=abort.rid, abort_all=abort.abort_all, own_request=True))

    def _handle_batch_output(self, batch: BatchStrOutput | BatchEmbeddingOutput) -> None:
        now = time.time()
        for out in batch.outputs:
            state = self.rid_to_state.get(out.output.rid)
            if state is None:
                continue  # aborted earlier and already cleaned up
            previous_token_at = state.last_token_at
            chunk = state.absorb(out) if isinstance(out, StrOutput) else state.absorb_embedding(out)
            self.metrics.on_output(state, out.output, previous_token_at, now)
            if state.finished:
                self.metrics.on_finish(state, out.output, now)
            if chunk is None:
                continue  # a non-streaming request: its one chunk comes at the end
            state.pending.append(chunk)
            if state.finished:
                self.live_rids.remove(out.output.rid)
            state.event.set()

    def _end_unsent(self, state: ReqState, chunk: GenerateChunk) -> None:
        """End a request that was never sent with `chunk`, which its waiter then reads."""
        lost = ReqOutput(rid=state.rid, new_token_ids=[], finish_reason=chunk.finish_reason)
        self.metrics.on_finish(state, lost, time.time())
        state.pending.append(chunk)
        state.finished = True
        self.live_rids.remove(state.rid)
        state.event.set()

    def fail_all(self, reason: str) -> None:
        """The back end died: end every live request and control call with an error, report
        unhealthy."""
        self.backend_error = reason
        self.control.fail_all(reason)
        for state in list(self.rid_to_state.values()):
            self._end_unsent(state, state.abort_chunk(reason, status_code=503))

    # ------------------------------------------------------------ control

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        # Sent even for a rid this process does not know: it may be a parent of n > 1
        # children, or (with several workers) belong to another worker, which the router
        # passes it on to for the requests a pause holds there.
        self.pause.abort(rid, abort_all)
        self.arriving.abort(rid, abort_all)
        self.send(AbortReq(rid=rid, abort_all=abort_all))

    async def get_internal_state(self, timeout_s: float = 30.0) -> InternalState:
        return await self.control.call(GetInternalStateReq(), InternalState, timeout_s)

    async def render_metrics(self) -> bytes:
        """The request metrics always; the Scheduler's gauges when it answers within
        METRICS_SCHEDULER_WAIT_S: a scrape neither fails nor outwaits Prometheus' 10 s scrape
        timeout (it waited 30 s, then lost every counter in a 503) because the Scheduler is
        stuck; `scheduler_up` says whether they are there."""
        try:
            state = await self.get_internal_state(METRICS_SCHEDULER_WAIT_S)
        except BackendError:
            state = None
        return self.metrics.render(state)

    async def flush_cache(self) -> FlushCacheReqOutput:
        # No writer lock, as in SGLang: the Scheduler refuses the flush while requests run,
        # and waiting for this worker's streams would hold every new request back meanwhile.
        return await self.control.call(FlushCacheReq(), FlushCacheReqOutput)

    async def update_weights_from_disk(
        self, model_path: str, weight_version: str | None = None, abort_all_requests: bool = False
    ) -> UpdateWeightsFromDiskReqOutput:
        """Serve new weights (seed 003 §5.5). The gate holds new requests of this worker back
        (they wait, they do not fail; an abort reaches them) and the writer lock waits until
        this worker's in-flight ones are done; the Scheduler holds every worker's new
        requests in its queue until nothing runs, loads the weights and flushes the prefix
        cache. A second update while one is under way is refused: here when this worker
        has the first (it would wait for the writer lock, then replace the first), else by
        the Scheduler."""
        if self.updating_weights:
            return UpdateWeightsFromDiskReqOutput(
                success=False, message=UPDATE_IN_PROGRESS, weight_version=self.weight_version
            )
        self.updating_weights = True
        try:
            if abort_all_requests:
                self.abort_request(abort_all=True)
            async with self.pause.closed_for_update(), self.model_update_lock.writer_lock():
                request = UpdateWeightsFromDiskReq(model_path=model_path, weight_version=weight_version)
                return await self.control.call(request, UpdateWeightsFromDiskReqOutput, WEIGHT_UPDATE_TIMEOUT_S)
        finally:
            self.updating_weights = False

    async def pause_generation(self) -> None:
        await self.pause.set_everywhere(True)

    async def continue_generation(self) -> None:
        await self.pause.set_everywhere(False)

    @property
    def health_error(self) -> str | None:
        """What /health reports besides a dead back end: HTTP workers that died."""
        if not self.dead_workers:
            return None
        return f"HTTP worker {', '.join(map(str, sorted(self.dead_workers)))} died"

    def degraded(self) -> dict[str, object] | None:
        """What /health says while some Scheduler replicas died and others serve."""
        if not self.dead_replicas:
            return None
        size = self.server_args.dp_size
        return {"status": "degraded", "replicas_alive": size - len(self.dead_replicas), "dp_size": size}

    def _worker_stats(self, asked_by: str) -> WorkerStats:
        return WorkerStats(
            rid_to_state_size=len(self.rid_to_state), num_paused_reqs=self.pause.num_held, http_worker_ipc=asked_by
        )

    async def worker_stats_total(self) -> WorkerStats:
        """Live request states and requests held by a pause in this process, or summed over
        every HTTP worker (those that answer within 5 s)."""
        if self.http_worker_ipc is None:
            return self._worker_stats("")
        request = WorkerStatsReq(http_worker_ipc=self.http_worker_ipc)
        answers = await self.control.gather(request, WorkerStats, self.server_args.tokenizer_worker_num, 5.0)
        return WorkerStats(
            rid_to_state_size=sum(stats.rid_to_state_size for stats in answers),
            num_paused_reqs=sum(stats.num_paused_reqs for stats in answers),
            http_worker_ipc=self.http_worker_ipc,
        )

    def _describe_state(self) -> str:
        # Runs on the watchdog's thread: copy before reading, the loop may change the dict.
        rids = list(self.rid_to_state.copy())
        return (
            f"in-flight rids (first 20 of {len(rids)}): {rids[:20]}\n"
            f"last message received at {time.strftime('%H:%M:%S', time.localtime(self.last_receive_tstamp))} "
            f"({time.time() - self.last_receive_tstamp:.1f} s ago)"
        )


def _without(message: Message, rids: set[str]) -> Message | None:
    """`message` without the requests of `rids` (None: nothing left to send)."""
    if isinstance(message, BatchTokenizedGenerateReqInput | BatchTokenizedEmbeddingReqInput):
        kept = [req for req in message.reqs if req.rid not in rids]
        return msgspec.structs.replace(message, reqs=kept) if kept else None
    return None if getattr(message, "rid", None) in rids else message
