"""The DataParallelController (`--dp-size N`): N Scheduler replicas behind one address.

It owns `scheduler_input`, so the TokenizerManager (or the MultiTokenizerRouter) talks to
it exactly as to one Scheduler. Each replica has its own inbox; its outputs go straight
to the DetokenizerManager, and its control replies and ReplicaLoad reports come back here.

- A request goes to one replica, chosen by `--load-balance-method`. Items of a batch are
  placed one by one. Parallel sampling's prompt warm-up (`rid::prefix`) and its children
  (`rid::i`) follow their parent rid to one replica, so the children find the prompt in
  that replica's radix cache.
- Aborts go to every replica. FlushCacheReq, GetInternalStateReq and UpdateWeightsFromDiskReq
  go to every replica too, and their replies are merged into one.
- A replica that dies fails its in-flight requests at once (503 through the detokenizer, as
  any output), gets no more requests, and every HTTP worker hears ReplicaDied; with none
  left, ProcessFailed ends the server's requests as a lone Scheduler's death does.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count

import msgspec
import zmq

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import Receiver, Sender, dispatch_forever
from sluice.messages import (
    RID_SEPARATOR,
    UPDATE_IN_PROGRESS,
    AbortReq,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    InternalState,
    Message,
    ProcessFailed,
    ReplicaDied,
    ReplicaLoad,
    ReqOutput,
    SchedulerReady,
    TokenIDOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenizedRequest,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from sluice.procutil import become_child_process, is_alive, keep_torch_out
from sluice.scheduler.prefix_index import PrefixIndex

logger = logging.getLogger(__name__)

LIVENESS_CHECK_S = 1.0
# cache_aware follows the cache only while the replicas' loads (requests in flight) differ
# by at most this much; past it the request goes to the least loaded.
BALANCE_THRESHOLD = 8
MAX_STICKY_PARENTS = 4096

BROADCAST_CONTROL = (FlushCacheReq, GetInternalStateReq, UpdateWeightsFromDiskReq)
ControlReply = InternalState | FlushCacheReqOutput | UpdateWeightsFromDiskReqOutput


def replica_port_args(port_args: PortArgs, dp_rank: int) -> PortArgs:
    """A replica's addresses: its own inbox; its outputs to the detokenizer; its replies to
    the controller (which owns `scheduler_input`)."""
    return dataclasses.replace(
        port_args,
        scheduler_input=f"ipc://{port_args.ipc_dir}/scheduler-{dp_rank}",
        tokenizer_input=port_args.scheduler_input,
    )


@dataclass
class PendingReplies:
    """A control request sent to every live replica, waiting for their replies."""

    request: Message
    waiting_for: set[int]
    replies: dict[int, ControlReply] = field(default_factory=dict)


class DataParallelController:
    def __init__(self, args: ServerArgs, port_args: PortArgs, replica_pids: list[int]):
        self.args = args
        self.size = args.dp_size
        self.replica_pids = replica_pids
        self.context = zmq.Context(1)
        self.inbox = Receiver(self.context, port_args.scheduler_input)
        self.replicas = [
            Sender(self.context, replica_port_args(port_args, r).scheduler_input) for r in range(self.size)
        ]
        self.to_tokenizer = Sender(self.context, port_args.tokenizer_input)
        self.to_detokenizer = Sender(self.context, port_args.detokenizer_input)
        self.alive = [True] * self.size
        # Per replica: the rids sent there and not reported ended, with their HTTP worker.
        self.in_flight: list[dict[str, str | None]] = [{} for _ in range(self.size)]
        self.parents: OrderedDict[str, int] = OrderedDict()  # parent rid -> replica of its samples
        self.prefixes = PrefixIndex(self.size)
        self.turns = count()
        # Control requests waiting for their replicas, by (reply type, HTTP worker, control_id).
        self.pending: dict[tuple[type, str | None, int], PendingReplies] = {}

    # ------------------------------------------------------------ start-up

    def wait_for_replicas(self) -> None:
        """Forward one SchedulerReady once every replica is ready (its KV: theirs summed)."""
        ready: dict[int, SchedulerReady] = {}
        while len(ready) < self.size:
            message = self.inbox.recv()
            if isinstance(message, SchedulerReady):
                ready[message.dp_rank] = message
            elif isinstance(message, ProcessFailed):
                self.to_tokenizer.send(message)
            else:
                logger.warning("before every replica was ready: dropped a %s", type(message).__name__)
        total = sum(info.max_total_tokens for info in ready.values())
        self.to_tokenizer.send(msgspec.structs.replace(ready[0], max_total_tokens=total))
        logger.info("%d Scheduler replicas ready (%s)", self.size, self.args.load_balance_method)

    def run_forever(self) -> None:
        self.wait_for_replicas()
        dispatch_forever(self.inbox, self.dispatch, LIVENESS_CHECK_S, self.check_replicas_alive)

    # ------------------------------------------------------------ messages

    def dispatch(self, message: Message) -> None:
        match message:
            case TokenizedGenerateReqInput() | TokenizedEmbeddingReqInput():
                self.place([message], lambda reqs: reqs[0])
            case BatchTokenizedGenerateReqInput() | BatchTokenizedEmbeddingReqInput():
                self.place(list(message.reqs), lambda reqs: msgspec.structs.replace(message, reqs=reqs))
            case AbortReq():
                self.send_to_live(message)
            case UpdateWeightsFromDiskReq() if self.update_pending():
                # One update at a time over all replicas: two at once could leave them on
                # different weights (each replica takes the first that reaches it).
                self.to_tokenizer.send(merge_replies(message, {}, UPDATE_IN_PROGRESS))
            case FlushCacheReq() | GetInternalStateReq() | UpdateWeightsFromDiskReq():
                key = (_reply_type(message), message.http_worker_ipc, message.control_id)
                self.pending[key] = PendingReplies(message, self.send_to_live(message))
                self.answer_complete()
            case ReplicaLoad():
                for rid in message.finished_rids:
                    self.in_flight[message.dp_rank].pop(rid, None)
            case InternalState() | FlushCacheReqOutput() | UpdateWeightsFromDiskReqOutput():
                self.collect(message)
            case ProcessFailed():
                logger.error("replica failed: %s", message.error)
            case _:
                logger.warning("controller ignored an unexpected %s", type(message).__name__)

    def place(self, reqs: list[TokenizedRequest], wrap: Callable[[list[TokenizedRequest]], Message]) -> None:
        """Send each request to its replica (a batch: one batch per replica)."""
        by_replica: dict[int, list[TokenizedRequest]] = {}
        for req in reqs:
            replica = self.choose(req)
            if replica is None:
                self.fail([(req.rid, req.http_worker_ipc)], "no Scheduler replica is alive")
                continue
            by_replica.setdefault(replica, []).append(req)
            self.in_flight[replica][req.rid] = req.http_worker_ipc
        for replica, placed in by_replica.items():
            self.replicas[replica].send(wrap(placed))

    def choose(self, req: TokenizedRequest) -> int | None:
        live = [r for r in range(self.size) if self.alive[r]]
        if not live:
            return None
        parent = req.rid.partition(RID_SEPARATOR)[0] if RID_SEPARATOR in req.rid else None
        if parent is not None and parent in self.parents and self.alive[self.parents[parent]]:
            self.parents.move_to_end(parent)
            return self.parents[parent]
        method = self.args.load_balance_method
        if method == "round_robin":
            replica = live[next(self.turns) % len(live)]
        elif method == "shortest_queue":
            replica = self.least_loaded(live)
        else:
            replica = self.cache_aware(req, live)
        if parent is not None:
            self.parents[parent] = replica
            if len(self.parents) > MAX_STICKY_PARENTS:
                self.parents.popitem(last=False)
        return replica

    def least_loaded(self, live: list[int]) -> int:
        return min(live, key=lambda r: len(self.in_flight[r]))

    def cache_aware(self, req: TokenizedRequest, live: list[int]) -> int:
        """The replica holding the longest prefix of the prompt, while the loads are balanced;
        the least loaded one otherwise or when none holds any of it."""
        names = PrefixIndex.block_names(req.input_ids)
        loads = [len(self.in_flight[r]) for r in live]
        replica = self.least_loaded(live)
        if max(loads) - min(loads) <= BALANCE_THRESHOLD:
            matched = {r: self.prefixes.matched_tokens(names, r) for r in live}
            best = max(live, key=lambda r: (matched[r], -len(self.in_flight[r])))
            if matched[best] > 0:
                replica = best
        self.prefixes.insert(names, replica)
        return replica

    def send_to_live(self, message: Message) -> set[int]:
        live = {r for r in range(self.size) if self.alive[r]}
        for replica in live:
            self.replicas[replica].send(message)
        return live

    # ------------------------------------------------------------ control replies

    def update_pending(self) -> bool:
        return any(reply_type is UpdateWeightsFromDiskReqOutput for reply_type, _, _ in self.pending)

    def collect(self, reply: ControlReply) -> None:
        pending = self.pending.get((type(reply), reply.http_worker_ipc, reply.control_id))
        if pending is None or reply.dp_rank not in pending.waiting_for:
            logger.warning("no request waits for a %s of replica %d", type(reply).__name__, reply.dp_rank)
            return
        if isinstance(reply, FlushCacheReqOutput | UpdateWeightsFromDiskReqOutput) and reply.success:
            # Its radix cache is empty now (new weights flush it too): cache_aware must not
            # send a prompt there for a prefix it no longer holds.
            self.prefixes.forget(reply.dp_rank)
        pending.replies[reply.dp_rank] = reply
        self.answer_complete()

    def answer_complete(self) -> None:
        """Answer every control request whose live replicas have all replied."""
        for key, pending in list(self.pending.items()):
            if pending.waiting_for <= pending.replies.keys():
                del self.pending[key]
                self.to_tokenizer.send(merge_replies(pending.request, pending.replies))

    # ------------------------------------------------------------ failures

    def check_replicas_alive(self) -> None:
        for replica, pid in enumerate(self.replica_pids):
            if self.alive[replica] and not is_alive(pid):
                self.replica_died(replica)

    def replica_died(self, replica: int) -> None:
        self.alive[replica] = False
        lost = list(self.in_flight[replica].items())
        self.in_flight[replica].clear()
        self.prefixes.forget(replica)
        alive = sum(self.alive)
        logger.error(
            "Scheduler replica %d died with %d requests in flight; %d replicas left", replica, len(lost), alive
        )
        self.fail(lost, f"Scheduler replica {replica} died")
        if alive:
            self.to_tokenizer.send(ReplicaDied(dp_rank=replica, replicas_alive=alive))
        else:
            self.to_tokenizer.send(ProcessFailed(process="scheduler", error="every Scheduler replica died"))
        for pending in self.pending.values():
            pending.waiting_for.discard(replica)
        self.answer_complete()

    def fail(self, reqs: list[tuple[str, str | None]], why: str) -> None:
        """End requests with a 503, through the detokenizer as any last output."""
        if not reqs:
            return
        reason = FinishReason(type="abort", message=why, status_code=503)
        outputs = [
            TokenIDOutput(output=ReqOutput(rid=rid, new_token_ids=[], finish_reason=reason, http_worker_ipc=ipc))
            for rid, ipc in reqs
        ]
        self.to_detokenizer.send(BatchTokenIDOutput(outputs=outputs))


def _reply_type(request: Message) -> type:
    if isinstance(request, FlushCacheReq):
        return FlushCacheReqOutput
    if isinstance(request, GetInternalStateReq):
        return InternalState
    return UpdateWeightsFromDiskReqOutput


def merge_replies(request: Message, replies: dict[int, ControlReply], refusal: str = "") -> Message:
    """One reply for the whole server, addressed to the HTTP worker (and the call) that asked.
    With no replies (no replica lives, or `refusal`), a failure."""
    ipc = getattr(request, "http_worker_ipc", None)
    control_id = getattr(request, "control_id", 0)
    ordered = [replies[r] for r in sorted(replies)]
    if isinstance(request, GetInternalStateReq):
        return merge_states([r for r in ordered if isinstance(r, InternalState)], ipc, control_id)
    if not ordered:
        why = refusal or "no Scheduler replica is alive"
        if isinstance(request, FlushCacheReq):
            return FlushCacheReqOutput(success=False, message=why, control_id=control_id, http_worker_ipc=ipc)
        return UpdateWeightsFromDiskReqOutput(success=False, message=why, control_id=control_id, http_worker_ipc=ipc)
    if isinstance(request, FlushCacheReq):
        failed = [r for r in ordered if isinstance(r, FlushCacheReqOutput) and not r.success]
        message = "; ".join(f"replica {r.dp_rank}: {r.message}" for r in failed)
        if failed and (flushed := [r.dp_rank for r in ordered if r not in failed]):
            message += f"; replicas {flushed} did flush theirs"  # each replica flushes on its own, as in SGLang
        return FlushCacheReqOutput(success=not failed, message=message, control_id=control_id, http_worker_ipc=ipc)
    updates = [r for r in ordered if isinstance(r, UpdateWeightsFromDiskReqOutput)]
    if all(r.success for r in updates):
        return msgspec.structs.replace(updates[0], http_worker_ipc=ipc, control_id=control_id)
    first = next(r for r in updates if not r.success)
    done = [r.dp_rank for r in updates if r.success]
    message = "; ".join(f"replica {r.dp_rank}: {r.message}" for r in updates if not r.success)
    if done:
        message += f"; replicas {done} did load the new weights (each output's weight_version says which served it)"
    return msgspec.structs.replace(first, message=message, http_worker_ipc=ipc, control_id=control_id)


def merge_states(states: list[InternalState], ipc: str | None, control_id: int = 0) -> InternalState:
    def total(name: str) -> int:
        return sum(getattr(state, name) for state in states)

    def summed(name: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for state in states:
            for key, value in getattr(state, name).items():
                out[key] = out.get(key, 0) + value
        return out

    return InternalState(
        num_running_reqs=total("num_running_reqs"),
        num_waiting_reqs=total("num_waiting_reqs"),
        kv_tokens_total=total("kv_tokens_total"),
        kv_tokens_free=total("kv_tokens_free"),
        kv_tokens_cached=total("kv_tokens_cached"),
        kv_tokens_in_use=total("kv_tokens_in_use"),
        kv_window_tokens_held=total("kv_window_tokens_held"),
        last_step_ms=max((state.last_step_ms for state in states), default=0.0),
        forward_threads=total("forward_threads"),
        num_retractions=total("num_retractions"),
        num_failed_steps=total("num_failed_steps"),
        prefill_steps=total("prefill_steps"),
        messages_received=summed("messages_received"),
        finished_reqs=summed("finished_reqs"),
        replicas=states,
        control_id=control_id,
        http_worker_ipc=ipc,
    )


def run_dp_controller_process(server_args_data: bytes, port_args_data: bytes, replica_pids_data: bytes) -> None:
    args = ServerArgs.decode(server_args_data)
    port_args = PortArgs.decode(port_args_data)
    become_child_process("dp-controller", args.log_level)
    keep_torch_out()
    try:
        DataParallelController(args, port_args, msgspec.json.decode(replica_pids_data, type=list[int])).run_forever()
    except Exception:
        logger.error("DataParallelController failed:\n%s", traceback.format_exc())
        raise
