"""The Scheduler process: load the model, then loop: drain messages, run one step, send."""

from __future__ import annotations

import logging
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import LAST_WORDS_MS, Receiver, Sender
from sluice.messages import (
    AbortReq,
    BatchEmbeddingOutput,
    BatchTokenIDOutput,
    BatchTokenizedEmbeddingReqInput,
    BatchTokenizedGenerateReqInput,
    EmbeddingOutput,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    InternalState,
    Message,
    ProcessFailed,
    ReplicaLoad,
    SchedulerReady,
    TokenIDOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from sluice.procutil import become_child_process, freeze_live_objects, keep_freed_memory_for_reuse, usable_memory_bytes
from sluice.scheduler.forward_threads import PROC_STAT, ForwardThreads

if TYPE_CHECKING:
    from sluice.scheduler.output import SchedulerOutput
    from sluice.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
IDLE_GATHER_GAPS = 10  # an idle scheduler gathers arrivals for at most this many --idle-gather-ms
# While requests run, something goes to the detokenizer at least this often, so the
# TokenizerManager's watchdog sees messages flow even when no output is due (a long
# non-streaming request).
HEARTBEAT_S = 2.0


def default_max_total_tokens(
    args: ServerArgs, kv_bytes_per_token: int, context_len: int, window: int | None = None, window_bytes: int = 0
) -> int:
    """Token slots for --kv-cache-memory-gb. With sliding-window layers (window, window_bytes:
    their share of kv_bytes_per_token) those layers' slots are counted apart, as many as can be
    held at once (ServerArgs.window_slots_needed), and the rest of the budget goes to the
    other layers, where that gives more tokens than counting every layer for every token."""
    if args.max_total_tokens:
        return args.max_total_tokens
    budget = args.kv_cache_memory_gb * 1024**3
    # More than every running request at full context is never needed.
    most = context_len * args.max_running_requests
    by_memory = int(budget // kv_bytes_per_token)
    if window is not None:
        rest, other_bytes = budget - args.window_slots_needed(window) * window_bytes, kv_bytes_per_token - window_bytes
        by_memory = max(by_memory, most if other_bytes == 0 else int(rest // other_bytes))
    return max(min(by_memory, most), 256)


def build_scheduler(args: ServerArgs) -> Scheduler:
    # Imported in the scheduler process only: the main process imports this module for
    # its entry point and must not load the model code.
    from sluice.model.model_runner import ModelRunner
    from sluice.scheduler.scheduler import Scheduler

    runner = ModelRunner(
        args.resolved_model_path(), args.dtype, args.quantization, args.kv_cache_dtype, args.context_length
    )
    keep_freed_memory_for_reuse()
    max_total_tokens = default_max_total_tokens(
        args,
        runner.kv_bytes_per_token(),
        runner.config.context_len,
        runner.config.widest_window,
        runner.kv_bytes_per_token(sliding_layers_only=True),
    )
    check_fits_in_memory(
        args,
        max_total_tokens,
        runner.kv_bytes_per_token(),
        runner.config.context_len,
        runner.config.widest_window,
        runner.kv_bytes_per_token(sliding_layers_only=True),
    )
    scheduler = Scheduler(args, runner, max_total_tokens)
    freeze_live_objects()
    return scheduler


def check_fits_in_memory(
    args: ServerArgs,
    max_total_tokens: int,
    kv_bytes_per_token: int,
    context_len: int,
    window: int | None = None,
    window_bytes: int = 0,
) -> None:
    """ValueError naming the flag whose tables could never be allocated in this machine's
    memory, or its container's (the allocation would fail with a traceback, or the kernel
    would kill the process). The KV cache is counted as it is allocated: sliding-window
    layers' slots apart (see default_max_total_tokens)."""
    memory = usable_memory_bytes()
    window_slots = args.window_slots_needed(window, max_total_tokens) if window is not None else 0
    kv_bytes = max_total_tokens * (kv_bytes_per_token - window_bytes) + window_slots * window_bytes
    # Every replica of --dp-size allocates its own, in the same memory.
    if kv_bytes * args.dp_size > memory:
        flag = (
            f"--max-total-tokens {args.max_total_tokens}"
            if args.max_total_tokens
            else f"--kv-cache-memory-gb {args.kv_cache_memory_gb}"
        )
        raise ValueError(
            f"{flag} makes a KV cache of {max_total_tokens} tokens, {kv_bytes / 2**30:.1f} GiB{_each_replica(args)}: "
            f"more than the {memory / 2**30:.1f} GiB of memory this process may use"
        )
    positions = min(context_len, max_total_tokens)
    table_bytes = args.max_running_requests * positions * 8  # req_to_token, int64
    if table_bytes * args.dp_size > memory // 4:
        raise ValueError(
            f"--max-running-requests {args.max_running_requests} needs a token table of {table_bytes / 2**30:.1f} GiB "
            f"({positions} positions each){_each_replica(args)}, more than a quarter of the "
            f"{memory / 2**30:.1f} GiB of memory this process may use"
        )


def _each_replica(args: ServerArgs) -> str:
    return f" in each of --dp-size {args.dp_size} replicas" if args.dp_size > 1 else ""


def watch_forward_threads() -> ForwardThreads | None:
    """The forward pass's threads (torch's, which the kernels' OpenMP team follows), fewer
    while other processes keep its cores busy; None where /proc/stat does not say how busy
    the cores are (not Linux)."""
    import torch

    if not os.path.exists(PROC_STAT):
        return None
    return ForwardThreads(torch.get_num_threads(), torch.set_num_threads)


class SchedulerLoop:
    """Owns the sockets; feeds messages to the Scheduler and sends what it produces.

    As replica `dp_rank` of --dp-size > 1, its `tokenizer_input` is the DataParallelController,
    which also hears which requests ended after each turn that ended any."""

    def __init__(self, scheduler: Scheduler, port_args: PortArgs, dp_rank: int | None = None):
        self.scheduler = scheduler
        self.dp_rank = dp_rank
        self.context = zmq.Context(1)
        self.inbox = Receiver(self.context, port_args.scheduler_input)
        self.to_detokenizer = Sender(self.context, port_args.detokenizer_input)
        self.to_tokenizer = Sender(self.context, port_args.tokenizer_input)
        self.forward_threads = None if scheduler.args.fixed_num_threads else watch_forward_threads()

    def run_forever(self) -> None:
        last_send = time.monotonic()
        while True:
            if self.scheduler.is_idle:
                if self.scheduler.args.debug_checks:
                    self.scheduler.check_integrity()
                # Requests sent together reach an idle scheduler a few ms apart (tokenized one by
                # one); the first alone would take a whole prefill step, the weights' pass that a
                # step of many shares.
                gap_ms = self.scheduler.args.idle_gather_ms
                messages = self.inbox.recv_burst(IDLE_POLL_MS, gap_ms, IDLE_GATHER_GAPS * gap_ms)
            else:
                messages = self.inbox.drain()
            outputs: list[SchedulerOutput] = []
            for message in messages:
                outputs.extend(self.handle_safely(message))
            if (update_done := self.scheduler.apply_pending_update()) is not None:
                self.send_reply(update_done)
            outputs.extend(self.step())
            now = time.monotonic()
            embeddings = [out for out in outputs if isinstance(out, EmbeddingOutput)]
            if embeddings:
                self.to_detokenizer.send(BatchEmbeddingOutput(outputs=embeddings))
                last_send = now
            token_outputs = [out for out in outputs if isinstance(out, TokenIDOutput)]
            if token_outputs or (not self.scheduler.is_idle and now - last_send > HEARTBEAT_S):
                self.to_detokenizer.send(BatchTokenIDOutput(outputs=token_outputs))
                last_send = now
            if self.dp_rank is not None:
                self.report_finished(outputs)
            if self.forward_threads is not None:
                self.forward_threads.after_turn()

    def step(self) -> list[SchedulerOutput]:
        """One step; one that raises (a bug no request should be able to reach) ends the
        requests in flight with a 500 instead of the process and every later request."""
        return self._contained(self.scheduler.step, "a step")

    def report_finished(self, outputs: list[SchedulerOutput]) -> None:
        finished = [out.output.rid for out in outputs if out.output.finish_reason is not None]
        if finished:
            self.to_tokenizer.send(ReplicaLoad(dp_rank=self.dp_rank or 0, finished_rids=finished))

    def handle(self, message: Message) -> list[SchedulerOutput]:
        s = self.scheduler
        s.received_by_type[type(message).__name__] += 1
        match message:
            case TokenizedGenerateReqInput() | TokenizedEmbeddingReqInput():
                out = self.add(message)
                return [out] if out else []
            case BatchTokenizedGenerateReqInput() | BatchTokenizedEmbeddingReqInput():
                return [out for req in message.reqs if (out := self.add(req))]
            case AbortReq():
                return s.abort(message)
            case FlushCacheReq():
                ok = s.flush_cache()
                message_text = "" if ok else "requests are running"
                self.send_reply(
                    FlushCacheReqOutput(
                        success=ok,
                        message=message_text,
                        control_id=message.control_id,
                        http_worker_ipc=message.http_worker_ipc,
                    )
                )
            case UpdateWeightsFromDiskReq():
                if (refused := s.request_weight_update(message)) is not None:
                    self.send_reply(refused)
            case GetInternalStateReq():
                state = s.internal_state()
                state.http_worker_ipc = message.http_worker_ipc
                state.control_id = message.control_id
                self.send_reply(state)
            case _:
                logger.warning("scheduler ignored an unexpected %s", type(message).__name__)
        return []

    def handle_safely(self, message: Message) -> list[SchedulerOutput]:
        """`handle`; a message whose handling raises (a bug: an abort that cannot release a
        request's slots, say) fails the requests in flight as a failed step does."""
        return self._contained(lambda: self.handle(message), f"a {type(message).__name__}")

    def _contained(self, run: Callable[[], list[SchedulerOutput]], what: str) -> list[SchedulerOutput]:
        try:
            return run()
        except Exception as e:
            logger.exception("the scheduler failed on %s: ending every request in flight", what)
            return self.scheduler.fail_everything(f"{type(e).__name__}: {e}")

    def add(self, req: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput) -> SchedulerOutput | None:
        """Queue a request; one the Scheduler fails to take (a bug) ends with a 500, alone."""
        try:
            if isinstance(req, TokenizedEmbeddingReqInput):
                return self.scheduler.add_embedding_request(req)
            return self.scheduler.add_request(req)
        except Exception as e:
            logger.exception("the scheduler failed to take %s", req.rid)
            return self.scheduler.refuse(req, f"internal error: {type(e).__name__}: {e}", status_code=500)

    def send_reply(self, reply: FlushCacheReqOutput | InternalState | UpdateWeightsFromDiskReqOutput) -> None:
        reply.dp_rank = self.dp_rank or 0
        self.to_tokenizer.send(reply)


def pin_to_cores(threads: int, dp_rank: int) -> None:
    """--cpu-affinity: replica r runs on cores r*t .. r*t+t-1 (t: its threads), before any
    compute thread starts (they inherit the set)."""
    cores = sorted(os.sched_getaffinity(0))
    mine = cores[dp_rank * threads : (dp_rank + 1) * threads]
    if len(mine) < threads:
        logger.warning("--cpu-affinity: %d cores for replica %d, which has %d threads", len(mine), dp_rank, threads)
    if mine:
        os.sched_setaffinity(0, mine)


def run_scheduler_process(server_args_data: bytes, port_args_data: bytes, dp_rank: int | None = None) -> None:
    """`dp_rank`: this process is that replica of --dp-size > 1 (port_args are its own)."""
    args = ServerArgs.decode(server_args_data)
    port_args = PortArgs.decode(port_args_data)
    # Counted before pinning: the default splits the cores this process may run on over the
    # replicas, and once pinned it may run on its own share only.
    threads = args.threads_per_scheduler()
    if args.cpu_affinity:
        pin_to_cores(threads, dp_rank or 0)
    name = "scheduler" if dp_rank is None else f"scheduler-{dp_rank}"
    become_child_process(name, args.log_level)
    import torch

    torch.set_num_threads(max(threads, 1))
    context = zmq.Context(1)
    to_tokenizer = Sender(context, port_args.tokenizer_input)
    try:
        scheduler = build_scheduler(args)
        loop = SchedulerLoop(scheduler, port_args, dp_rank)
        to_tokenizer.send(
            SchedulerReady(
                max_req_input_len=scheduler.max_req_input_len,
                context_len=scheduler.context_len,
                max_total_tokens=scheduler.kv.total,
                eos_token_ids=sorted(scheduler.eos_token_ids),
                vocab_size=scheduler.config.vocab_size,
                image_token_id=scheduler.config.image_token_id if scheduler.config.vision else None,
                num_image_tokens=scheduler.config.num_image_tokens if scheduler.config.vision else 0,
                execution=scheduler.runner.execution_info,
                embedding_dim=scheduler.config.hidden_size,
                dp_rank=dp_rank or 0,
            )
        )
        loop.run_forever()
    except ValueError as e:
        # A model it cannot load (a weight the config does not fit, ...): one line says why.
        logger.error("scheduler failed: %s", e)
        to_tokenizer.send(ProcessFailed(process="scheduler", error=str(e)))
        to_tokenizer.close(linger_ms=LAST_WORDS_MS)
        sys.exit(1)
    except Exception:
        error = traceback.format_exc()
        logger.error("scheduler failed:\n%s", error)
        to_tokenizer.send(ProcessFailed(process="scheduler", error=error))
        to_tokenizer.close(linger_ms=LAST_WORDS_MS)
        raise
