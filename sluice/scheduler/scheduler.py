"""The scheduling loop's logic: admit, batch, run the model, sample, emit. No sockets here.

One step = one forward pass over a batch that holds every decoding request (one token
each) plus the prefill chunks that fit the step's budgets. New requests join running ones
between steps (continuous batching). When the KV cache runs out, the most recently admitted
request is retracted to the waiting queue and later resumes where it stopped.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, wait

import torch

from sluice.config import ServerArgs
from sluice.messages import (
    RID_SEPARATOR,
    UPDATE_IN_PROGRESS,
    AbortReq,
    FinishReason,
    InternalState,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDiskReqOutput,
)
from sluice.model.model_runner import ModelRunner
from sluice.procutil import freeze_live_objects, release_freed_memory
from sluice.scheduler.batch_builder import StepBatch, build_forward_batch
from sluice.scheduler.grammar import Grammars
from sluice.scheduler.kv_manager import KVManager
from sluice.scheduler.output import SchedulerOutput, make_output, refused_output
from sluice.scheduler.policy import (
    PrefillPlan,
    plan_prefill,
    priority_order,
    prompt_refusal,
    queue_refusal,
)
from sluice.scheduler.req import Req
from sluice.scheduler.weight_update import PendingUpdate, Refusal, load_weights_of, plan_update, update_reply

logger = logging.getLogger(__name__)

# An idle Scheduler with only grammars compiling waits for one this long at most per step.
GRAMMAR_WAIT_S = 0.005


class Scheduler:
    def __init__(self, args: ServerArgs, runner: ModelRunner, max_total_tokens: int):
        self.args = args
        self.runner = runner
        self.config = runner.config
        # A request can hold no more tokens than the cache has slots, or, grown past them, it
        # would wait for room forever: the context served is the smaller of the two (SGLang
        # caps a request's length the same way).
        self.context_len = min(self.config.context_len, max_total_tokens)
        if self.context_len < self.config.context_len:
            logger.warning(
                "the KV cache holds %d tokens, fewer than the model's context length %d: a request may "
                "hold %d (more with --kv-cache-memory-gb or --max-total-tokens)",
                max_total_tokens,
                self.config.context_len,
                self.context_len,
            )
        self.max_req_input_len = self.context_len - 1
        self.max_total_tokens = max_total_tokens
        self.kv = self._new_kv_manager()
        window_slots = self._window_slots()
        self.k_buffers, self.v_buffers = runner.new_kv_buffers(
            max_total_tokens + 1, None if window_slots is None else window_slots + 1
        )
        self.eos_token_ids = frozenset(self.config.eos_token_ids)

        self.waiting: list[Req] = []
        self.running: list[Req] = []  # admitted: decoding, or prefilling in chunks
        self.compiling: list[Req] = []  # waiting for their grammar to compile
        # Every request queued and not yet ended, wherever it is (a step moves requests
        # between the lists above): a step that fails ends each of them once.
        self.live: dict[str, Req] = {}
        # What the step under way has to send; kept here so that a step that fails loses none.
        self.step_outputs: list[SchedulerOutput] = []
        self.received_by_type: Counter[str] = Counter()
        self.finished_by_reason: Counter[str] = Counter()
        self.last_step_ms = 0.0
        self.num_retractions = 0
        self.num_failed_steps = 0
        self.prefill_steps = 0  # steps that prefilled prompt tokens
        self.num_arrived = 0
        self.grammars = Grammars(args.resolved_model_path(), self.config.vocab_size, args.reasoning_parser)
        self.weight_version = args.weight_version
        self.weights_path = args.resolved_model_path()
        self.pending_update: PendingUpdate | None = None

    def _new_kv_manager(self) -> KVManager:
        """Slot bookkeeping for the KV buffers: which slots each request and the prefix cache
        hold (the buffers' contents are only ever read through it)."""
        args = self.args
        return KVManager(
            self.max_total_tokens,
            args.max_running_requests,
            self.context_len,
            args.disable_radix_cache,
            window=self.config.widest_window,
            window_cache_tokens=args.swa_cache_tokens,
            window_slots=self._window_slots(),
        )

    def _window_slots(self) -> int | None:
        window = self.config.widest_window
        return None if window is None else self.args.window_slots_needed(window, self.max_total_tokens)

    # ------------------------------------------------------------ inputs

    def add_request(self, msg: TokenizedGenerateReqInput) -> SchedulerOutput | None:
        """Queue a request; returns an immediate final output if it cannot run."""
        return self._add(Req.from_message(msg))

    def add_embedding_request(self, msg: TokenizedEmbeddingReqInput) -> SchedulerOutput | None:
        """Queue a prompt whose pooled final hidden state is the answer; it shares batches
        with generations and ends when its prefill does."""
        args = self.args
        return self._add(Req.for_embedding(msg, args.pooling, not args.disable_embedding_normalization))

    def _add(self, req: Req) -> SchedulerOutput | None:
        req.arrival = self.num_arrived
        self.num_arrived += 1
        error = prompt_refusal(req, self.config, self.max_req_input_len)
        if error is not None:
            req.finish_reason = FinishReason(type="abort", message=error, status_code=400)
            return self._final_output(req)
        req.finish_reason = queue_refusal(req, self.waiting + self.compiling, len(self.running), self.args)
        if req.finish_reason is None and (error := self._compile_grammar(req)) is not None:
            req.finish_reason = FinishReason(type="abort", message=error, status_code=400)
        if req.finish_reason is not None:
            return self._final_output(req)
        (self.waiting if req.compiling_grammar is None else self.compiling).append(req)
        self.live[req.rid] = req
        return None

    def _compile_grammar(self, req: Req) -> str | None:
        try:
            req.compiling_grammar = self.grammars.compile(req.sampling_params)
        except ValueError as e:  # the main process checked it: a grammar failing here is a 400 still
            return str(e)
        return None

    def _compiled_grammars(self) -> None:
        """Requests whose grammar compiled join the waiting ones; those whose grammar failed
        end (a compiler that failed, not the grammar, ends only them: a 500)."""
        for req in [r for r in self.compiling if r.compiling_grammar.done()]:
            self.compiling.remove(req)
            try:
                req.grammar = self.grammars.matcher(req.compiling_grammar)
            except ValueError as e:
                req.finish_reason = FinishReason(type="abort", message=str(e), status_code=400)
            except Exception as e:
                logger.exception("the grammar of %s failed to compile", req.rid)
                message = f"internal error: {type(e).__name__}: {e}"
                req.finish_reason = FinishReason(type="abort", message=message, status_code=500)
            if req.finished:
                self.step_outputs.append(self._final_output(req))
                continue
            req.compiling_grammar = None
            self.waiting.append(req)

    def abort(self, msg: AbortReq) -> list[SchedulerOutput]:
        """Remove a waiting request or free a running one's slots, before the next step."""

        def targeted(req: Req) -> bool:
            if msg.own_request and req.http_worker_ipc != msg.http_worker_ipc:
                return False  # the rid again, from another worker
            return msg.abort_all or req.rid == msg.rid or req.rid.startswith(msg.rid + RID_SEPARATOR)

        # A request a stop string ended is finished, not aborted: the detokenizer drops this
        # last output and has sent the client the final one already.
        reason = (
            FinishReason(type="stop") if msg.finished_by_stop_string else FinishReason(type="abort", message="aborted")
        )
        outputs = []
        abandoned = [r.compiling_grammar for r in self.compiling if targeted(r) and r.compiling_grammar is not None]
        for queue in (self.waiting, self.compiling):
            for req in [r for r in queue if targeted(r)]:
                queue.remove(req)
                req.finish_reason = reason
                outputs.append(self._final_output(req))
        for compiled in abandoned:  # a compilation no request waits for any more need not run
            if not any(r.compiling_grammar is compiled for r in self.compiling):
                self.grammars.cancel(compiled)
        for req in [r for r in self.running if targeted(r)]:
            self.running.remove(req)
            self.kv.release(req, keep_in_cache=True)
            req.finish_reason = reason
            outputs.append(self._final_output(req))
        return outputs

    def fail_everything(self, error: str) -> list[SchedulerOutput]:
        """After a step failed halfway (a bug): send what the step had made, end every other
        request with a 500, and start the KV bookkeeping and the prefix cache afresh, so that
        nothing the failed step may have left half-done reaches a later request. The model's
        weights are never written by a step; they keep serving."""
        self.num_failed_steps += 1
        reason = FinishReason(type="abort", message=f"internal error: {error}", status_code=500)
        for req in self.compiling:
            if req.compiling_grammar is not None:
                self.grammars.cancel(req.compiling_grammar)
        outputs = self._take_step_outputs()
        for req in list(self.live.values()):
            req.finish_reason = reason
            outputs.append(self._final_output(req))
        self.running, self.waiting, self.compiling = [], [], []
        self.kv = self._new_kv_manager()
        return outputs

    def refuse(
        self, msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput, message: str, status_code: int
    ) -> SchedulerOutput:
        """The final output of a request the Scheduler could not take."""
        reason = FinishReason(type="abort", message=message, status_code=status_code)
        self.finished_by_reason[reason.type] += 1
        return refused_output(msg, reason, self.weight_version)

    def _final_output(self, req: Req) -> SchedulerOutput:
        """The last output of a request that has ended, counted by how it ended."""
        self.live.pop(req.rid, None)
        if req.finish_reason is not None:
            self.finished_by_reason[req.finish_reason.type] += 1
        return make_output(req, self.weight_version)

    def request_weight_update(self, msg: UpdateWeightsFromDiskReq) -> UpdateWeightsFromDiskReqOutput | None:
        """Check a weight update and keep it until no request runs; returns the reply of
        one refused at once (a bad path, another model, an update already pending)."""
        plan = (
            Refusal(None, UPDATE_IN_PROGRESS)
            if self.pending_update is not None
            else plan_update(msg, self.config, self.weight_version, self.args.context_length)
        )
        if isinstance(plan, Refusal):
            return update_reply(msg, plan, self.weight_version, self.weights_path)
        logger.info(
            "weight update to %s (%s) waits for %d running requests",
            plan.model_path,
            plan.weight_version,
            len(self.running),
        )
        self.pending_update = plan
        return None

    def apply_pending_update(self) -> UpdateWeightsFromDiskReqOutput | None:
        """Once no request runs, load the pending update's weights and serve them; returns
        its reply. Weights that fail to load leave the old ones serving."""
        update = self.pending_update
        if update is None or self.running or any(req.output_ids for req in self.waiting):
            return None  # a request retracted midway finishes on the weights it started on
        self.pending_update = None
        loaded = load_weights_of(update, self.runner)
        if isinstance(loaded, Refusal):
            return update_reply(update.request, loaded, self.weight_version, self.weights_path)
        self.runner = loaded
        self.kv.flush()  # no request holds KV now: all of it was computed by the old weights
        freeze_live_objects()  # the new model's objects; the old one's cycles are collected
        release_freed_memory()  # the old weights
        self.weight_version, self.weights_path = update.weight_version, update.model_path
        message = f"serving {update.model_path} as weight_version {update.weight_version}"
        return update_reply(update.request, message, self.weight_version, self.weights_path)

    def flush_cache(self) -> bool:
        if self.waiting or self.running:
            return False
        return self.kv.flush()

    def internal_state(self) -> InternalState:
        return InternalState(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.compiling),
            kv_tokens_total=self.kv.total,
            kv_tokens_free=self.kv.free(),
            kv_tokens_cached=self.kv.cached(),
            kv_tokens_in_use=self.kv.in_use(),
            kv_window_tokens_held=self.kv.window_slots_held(),
            last_step_ms=self.last_step_ms,
            forward_threads=torch.get_num_threads(),
            num_retractions=self.num_retractions,
            num_failed_steps=self.num_failed_steps,
            prefill_steps=self.prefill_steps,
            messages_received=dict(self.received_by_type),
            finished_reqs=dict(self.finished_by_reason),
            pid=os.getpid(),
        )

    @property
    def is_idle(self) -> bool:
        return not self.waiting and not self.running and not self.compiling

    def check_integrity(self) -> None:
        queued = {id(req) for req in self.running + self.waiting + self.compiling}
        assert queued == {id(req) for req in self.live.values()}, "the live requests are not the queued ones"
        owned = sum(r.kv_len - r.locked_prefix_len + len(r.reserved_slots) for r in self.running)
        self.kv.check_integrity(owned)
        self.kv.check_windows(self.running)

    # ------------------------------------------------------------ one step

    def step(self) -> list[SchedulerOutput]:
        start = time.perf_counter()
        if self.compiling:
            self._compiled_grammars()
        batch = self._schedule()
        if batch is None:
            if self.compiling and not self.waiting and not self.running:
                wait([r.compiling_grammar for r in self.compiling], GRAMMAR_WAIT_S, FIRST_COMPLETED)
            return self._take_step_outputs()
        self.prefill_steps += any(batch.was_prefill)
        fb = build_forward_batch(batch, self.kv, self.k_buffers, self.v_buffers, self.runner)
        logits = self.runner.forward(fb)
        batch.pool_hidden_states(fb.hidden_states)
        self._process_results(batch, logits)
        self.kv.trim_window_slots(self.running)
        self.last_step_ms = (time.perf_counter() - start) * 1000
        return self._take_step_outputs()

    def _take_step_outputs(self) -> list[SchedulerOutput]:
        outputs, self.step_outputs = self.step_outputs, []
        return outputs

    def _schedule(self) -> StepBatch | None:
        retractions = self.num_retractions
        if self.args.priority_preemption and self.waiting and self.pending_update is None:
            self._preempt_for_priority()
        decoding = [r for r in self.running if r.is_decoding]
        if self.args.schedule_policy == "priority":
            decoding.sort(key=priority_order)  # the KV cache full: the lowest goes back first
        decoding = self._reserve_decode_slots(decoding)
        # Right after a retraction the cache is full: admitting now would only thrash.
        new_decode_slots = self.kv.decode_slots_needed(decoding)
        plan = self._plan_prefill(new_decode_slots, admit_new=self.num_retractions == retractions)
        while not decoding and not plan.reqs and self._retract_a_stuck_prefill():
            plan = self._plan_prefill(new_decode_slots, admit_new=False)
        reqs = decoding + plan.reqs
        if not reqs:
            return None
        extend_lens = [1] * len(decoding) + plan.extend_lens
        return StepBatch.allocate(reqs, extend_lens, self.kv)

    def _plan_prefill(self, new_decode_slots: int, admit_new: bool) -> PrefillPlan:
        return plan_prefill(
            self.running, self.waiting, self.kv, self.args, new_decode_slots, admit_new, self.pending_update is not None
        )

    def _reserve_decode_slots(self, decoding: list[Req]) -> list[Req]:
        """Make room for one new token per decoding request, retracting if the cache is full."""
        while decoding and self.kv.available() < self.kv.decode_slots_needed(decoding):
            victim = decoding.pop()
            self._retract(victim)
        return decoding

    def _retract_a_stuck_prefill(self) -> bool:
        """Prompts prefilled in chunks side by side (--chunked-prefill-size below
        --max-prefill-tokens) may fill the cache between them, none with room for its next
        chunk and none decoding to retract: the latest goes back to the waiting queue, the
        chunks it computed into the cache, where the others may evict them. A lone prompt
        always fits (the context is capped at the cache's size)."""
        prefilling = [req for req in self.running if not req.is_decoding]
        if len(prefilling) < 2:
            return False
        self._retract(prefilling[-1], "KV cache full between chunked prefills")
        return True

    def _preempt_for_priority(self) -> None:
        """With every running slot taken, a waiting request of higher priority sends the
        lowest-priority decoding request (the latest of equals) back to the waiting queue."""
        best = min(self.waiting, key=priority_order)
        while len(self.running) >= self.args.max_running_requests:
            decoding = [r for r in self.running if r.is_decoding]
            if not decoding:
                return
            victim = max(decoding, key=priority_order)
            if victim.priority >= best.priority:
                return
            self._retract(victim, f"preempted by {best.rid} (priority {best.priority} > {victim.priority})")

    def _retract(self, req: Req, why: str = "KV cache full") -> None:
        logger.info("%s: retracting %s (%d tokens) to the waiting queue", why, req.rid, req.seq_len)
        self.running.remove(req)
        self.kv.release(req, keep_in_cache=True)
        if not req.input_logprobs_sent:  # its prefill computes them again
            req.input_logprobs.clear()
            req.input_top_logprobs.clear()
        req.times_retracted += 1
        self.num_retractions += 1
        self.waiting.insert(0, req)

    # ------------------------------------------------------------ results

    def _process_results(self, batch: StepBatch, logits: torch.Tensor) -> None:
        batch.record_input_logprobs(logits)
        argmax_rows = self.runner.execution.backend.argmax_rows
        next_tokens = batch.sample(logits, self.grammars, self.eos_token_ids, self.config.vocab_size, argmax_rows)
        sample_pos = {row: k for k, row in enumerate(batch.sampling_rows)}
        for i, req in enumerate(batch.reqs):
            req.kv_len += batch.extend_lens[i]
            if next_tokens is not None and (k := sample_pos.get(i)) is not None:
                logprob = next_tokens.logprobs[k] if next_tokens.logprobs else 0.0
                top = next_tokens.top_logprobs[k] if next_tokens.top_logprobs else []
                req.append_token(next_tokens.next_token_ids[k], logprob, top, self.eos_token_ids, self.context_len)
            elif req.kv_len == req.seq_len and req.sampling_params.max_new_tokens == 0:
                # A prefill-only request (parallel sampling's prefix warm-up).
                req.finish_reason = FinishReason(type="length", length=0)
            if req.finished:
                self.running.remove(req)
                self.kv.release(req, keep_in_cache=True)
                self.step_outputs.append(self._final_output(req))
                continue
            if batch.was_prefill[i] and req.is_decoding:
                # The prompt (or a resumed sequence) is fully prefilled: share it.
                self.kv.cache_prefix(req)
            if self._should_stream(req):
                self.step_outputs.append(make_output(req, self.weight_version))

    def _should_stream(self, req: Req) -> bool:
        """A stream's first token at once, then every N tokens (the request's stream_interval,
        or --stream-interval), as SGLang sends them: 1, N + 1, 2N + 1, ... The interval spares
        the front end work, not TTFT. A request that is not streamed but has stop strings
        sends every token: the detokenizer matches them, and the request runs until it does."""
        if not (req.stream or req.sampling_params.stop):
            return False
        interval = (req.sampling_params.stream_interval or self.args.stream_interval) if req.stream else 1
        unsent = len(req.output_ids) - req.num_sent_tokens
        return unsent >= interval or (unsent > 0 and req.num_sent_tokens == 0)
