"""The MultiTokenizerRouter (seed 002): one hub between N TokenizerWorkers and one back end.

It owns the `tokenizer_input` address, so the Scheduler and the DetokenizerManager talk to
it exactly as they talk to a single TokenizerManager. Requests from workers go on to the
Scheduler (`router_worker_obj`); every result goes back to the worker named by its
`http_worker_ipc` (`_distribute_result_to_workers`). A batch output is a list of
per-request outputs, so splitting it is a group-by on that one field: a field added to an
output message needs no change here.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections import defaultdict
from typing import Any

import msgspec
import zmq

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import Receiver, Sender, dispatch_forever
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchStrOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FinishReason,
    FlushCacheReq,
    GetInternalStateReq,
    Message,
    ProcessFailed,
    RegisterWorker,
    ReplicaDied,
    ReqOutput,
    SetPause,
    StrOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenizedRequest,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
    WorkerDied,
    WorkerStatsReq,
    rid_family,
)
from sluice.procutil import become_child_process, is_alive, keep_torch_out
from sluice.tokenizer.shared_args import remove_shared_args

logger = logging.getLogger(__name__)

TO_SCHEDULER = (
    TokenizedGenerateReqInput,
    BatchTokenizedGenerateReqInput,
    TokenizedEmbeddingReqInput,
    BatchTokenizedEmbeddingReqInput,
    AbortReq,
    FlushCacheReq,
    GetInternalStateReq,
    UpdateWeightsFromDiskReq,
)
# Results that hold one output per request, each routed to the worker that owns it.
PER_REQUEST_OUTPUTS = (BatchStrOutput, BatchEmbeddingOutput)
# Every worker hears these; a weight update's end, so each reports the new weight_version.
BROADCAST = (SetPause, WorkerStatsReq, WorkerDied, ProcessFailed, UpdateWeightsFromDiskReqOutput, ReplicaDied)
LIVENESS_CHECK_S = 1.0
# A worker none of whose requests had output for this long is sent an empty batch with the
# next outputs of the others: the Scheduler is alive (its /health_generate probe and soft
# watchdog count on hearing it; the Scheduler's own heartbeat comes only when no request
# has output for 2 s).
WORKER_HEARTBEAT_S = 1.0


class MultiTokenizerRouter:
    def __init__(self, port_args: PortArgs):
        self.context = zmq.Context(1)
        self.inbox = Receiver(self.context, port_args.tokenizer_input)
        self.to_scheduler = Sender(self.context, port_args.scheduler_input)
        self.workers: dict[str, Sender] = {}  # http_worker_ipc -> socket
        self.worker_pids: dict[str, int] = {}
        self.dead_pids: set[int] = set()
        # What a worker that registers late (a replacement) must hear to report the server as
        # the others do: the weights served now, the Scheduler replicas that died, and a
        # back-end process that died.
        self.last_weight_update: UpdateWeightsFromDiskReqOutput | None = None
        self.replica_deaths: list[ReplicaDied] = []
        self.backend_failure: ProcessFailed | None = None  # a back-end process died: nothing will answer
        self.paused = False  # the last /pause_generation or /continue_generation: a new worker's answer
        # Live rids over all workers: a worker only knows its own, so a rid that is live
        # on another worker is refused here. So is a rid whose family (the rid before `::`:
        # a request and its n > 1 samples `rid::i`, which the Scheduler aborts together)
        # lives on another worker: family -> (its worker, how many of its rids are live).
        self.live_rids: set[str] = set()
        self.live_families: dict[str, tuple[str | None, int]] = {}
        self.last_output_at: dict[str, float] = {}  # per worker: when it was last sent outputs
        self.worker_heartbeat_s = WORKER_HEARTBEAT_S

    def handle_loop(self) -> None:
        dispatch_forever(self.inbox, self.dispatch, LIVENESS_CHECK_S, self.check_workers_alive)

    def dispatch(self, message: Message) -> None:
        if isinstance(message, RegisterWorker):
            self.register(message)
        elif isinstance(message, TO_SCHEDULER):
            self.router_worker_obj(message)
        elif isinstance(message, BROADCAST):
            self.broadcast(message)
        else:
            self._distribute_result_to_workers(message)

    def register(self, message: RegisterWorker) -> None:
        # A replacement comes once its predecessor is gone, maybe before the next liveness
        # check: look now, so that the answer below tells it of the death (it skips its warm-up).
        self.check_workers_alive()
        if message.http_worker_ipc not in self.workers:
            self.workers[message.http_worker_ipc] = Sender(self.context, message.http_worker_ipc)
        self.worker_pids[message.http_worker_ipc] = message.pid
        self.last_output_at[message.http_worker_ipc] = time.monotonic()
        logger.info("worker %d registered (%d workers)", message.pid, len(self.workers))
        sender = self.workers[message.http_worker_ipc]
        for pid in self.dead_pids:  # a replacement worker reports the loss too
            sender.send(WorkerDied(pid=pid))
        if self.last_weight_update is not None:
            sender.send(msgspec.structs.replace(self.last_weight_update, http_worker_ipc=None, control_id=0))
        for death in self.replica_deaths:
            sender.send(death)
        sender.send(SetPause(paused=self.paused, http_worker_ipc=message.http_worker_ipc))  # the answer
        # After the answer, which a back-end failure would otherwise fail as it fails every
        # call: the worker then answers 503 at once instead of waiting on a dead Scheduler.
        if self.backend_failure is not None:
            sender.send(self.backend_failure)

    def router_worker_obj(self, message: Message) -> None:
        """A worker's request or control message: on to the Scheduler."""
        reqs: list[TokenizedRequest] = []
        if isinstance(message, BatchTokenizedGenerateReqInput | BatchTokenizedEmbeddingReqInput):
            reqs = list(message.reqs)
        elif isinstance(message, TokenizedGenerateReqInput | TokenizedEmbeddingReqInput):
            reqs = [message]
        duplicates = {rid_family(req.rid) for req in reqs if req.rid in self.live_rids or self._family_elsewhere(req)}
        if duplicates:
            self._refuse_duplicates(reqs, duplicates)
            return
        for req in reqs:
            self.live_rids.add(req.rid)
            family = rid_family(req.rid)
            self.live_families[family] = (req.http_worker_ipc, self.live_families.get(family, (None, 0))[1] + 1)
        self.to_scheduler.send(message)
        if isinstance(message, AbortReq) and not message.own_request:
            # Requests a pause holds are in no worker's rid_to_state and not at the Scheduler:
            # every other worker checks its own held ones.
            for ipc, sender in self.workers.items():
                if ipc != message.http_worker_ipc:
                    sender.send(message)

    def _family_elsewhere(self, req: TokenizedRequest) -> bool:
        owner = self.live_families.get(rid_family(req.rid))
        return owner is not None and owner[0] != req.http_worker_ipc

    def _forget(self, rid: str) -> None:
        if rid not in self.live_rids:
            return
        self.live_rids.discard(rid)
        family = rid_family(rid)
        worker, live = self.live_families[family]
        if live > 1:
            self.live_families[family] = (worker, live - 1)
        else:
            del self.live_families[family]

    def _refuse_duplicates(self, reqs: list[TokenizedRequest], duplicates: set[str]) -> None:
        """End every item of the refused message at once, with a 400 naming the rid."""
        message = f"a request with rid '{sorted(duplicates)[0]}' is already running"
        reason = FinishReason(type="abort", message=message, status_code=400, param="rid")
        outputs = [
            StrOutput(
                text="",
                output=ReqOutput(
                    rid=req.rid, new_token_ids=[], finish_reason=reason, http_worker_ipc=req.http_worker_ipc
                ),
            )
            for req in reqs
        ]
        # Sent as results, but the rid stays live: it is the running request's.
        self._send_by_worker(BatchStrOutput(outputs=outputs))

    def broadcast(self, message: Message) -> None:
        # The worker that sent it hears last: its copy coming back means that every other
        # worker's copy is already queued before it.
        if isinstance(message, UpdateWeightsFromDiskReqOutput) and message.success:
            self.last_weight_update = message
        elif isinstance(message, ReplicaDied):
            self.replica_deaths.append(message)
        elif isinstance(message, SetPause):
            self.paused = message.paused
        elif isinstance(message, ProcessFailed):
            self.backend_failure = message
        origin = getattr(message, "http_worker_ipc", None)
        for ipc, sender in self.workers.items():
            if ipc != origin:
                sender.send(message)
        if origin in self.workers:
            self.workers[origin].send(message)

    def _distribute_result_to_workers(self, message: Message) -> None:
        if isinstance(message, PER_REQUEST_OUTPUTS):
            for out in message.outputs:
                if out.output.finish_reason is not None:
                    self._forget(out.output.rid)
        self._send_by_worker(message, from_backend=True)

    def _send_by_worker(self, message: Message, from_backend: bool = False) -> None:
        if isinstance(message, PER_REQUEST_OUTPUTS):
            by_worker: dict[str | None, list[Any]] = defaultdict(list)
            for out in message.outputs:
                by_worker[out.output.http_worker_ipc].append(out)
            now = time.monotonic()
            for worker in self.workers if from_backend else ():
                # The Scheduler's heartbeat goes to every worker, and so does an empty batch,
                # beside the others' outputs, to a worker that heard nothing for a while.
                if not message.outputs or now - self.last_output_at.get(worker, 0.0) >= self.worker_heartbeat_s:
                    by_worker.setdefault(worker, [])
            for ipc, outputs in by_worker.items():
                if ipc in self.workers:
                    self.last_output_at[ipc] = now
                self._send_to(ipc, msgspec.structs.replace(message, outputs=outputs))
        else:
            self._send_to(getattr(message, "http_worker_ipc", None), message)

    def _send_to(self, ipc: str | None, message: Message) -> None:
        sender = self.workers.get(ipc) if ipc else None
        if sender is None:
            logger.warning("dropped a %s for unknown worker %r", type(message).__name__, ipc)
            return
        sender.send(message)

    def check_workers_alive(self) -> None:
        for ipc, pid in list(self.worker_pids.items()):
            if pid in self.dead_pids or is_alive(pid):
                continue
            self.dead_pids.add(pid)
            logger.error("HTTP worker %d died; the server reports unhealthy", pid)
            self.workers.pop(ipc).close()
            self.last_output_at.pop(ipc, None)
            self.broadcast(WorkerDied(pid=pid))
            # Its requests have no one to answer: they would run to their end for nothing.
            for family in [family for family, (worker, _) in self.live_families.items() if worker == ipc]:
                self.to_scheduler.send(AbortReq(rid=family))


def run_router_process(server_args_data: bytes, port_args_data: bytes) -> None:
    args = ServerArgs.decode(server_args_data)
    port_args = PortArgs.decode(port_args_data)
    main_pid = os.getppid()

    # The main process removes the block on a normal exit; killed, it cannot.
    become_child_process("router", args.log_level, on_exit=lambda: remove_shared_args(main_pid))
    keep_torch_out()
    try:
        MultiTokenizerRouter(port_args).handle_loop()
    except Exception:
        logger.error("router failed:\n%s", traceback.format_exc())
        raise
