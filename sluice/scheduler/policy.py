"""Which waiting requests prefill next, under the step's token and memory budgets, and
which new requests their prompt or the queue limits refuse."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from sluice.config import ServerArgs
from sluice.messages import FinishReason
from sluice.model.model_config import ModelConfig
from sluice.scheduler.kv_manager import KVManager
from sluice.scheduler.multimodal import expand_image_tokens
from sluice.scheduler.req import Req

# Above this many waiting requests, fcfs and lpm take them in arrival order: matching every
# one against the radix tree each step would cost more than it saves.
LPM_MAX_QUEUE = 128
# Under fcfs, a waiting request with at most this many tokens to prefill (a short prompt, or
# one the radix cache holds but for these) goes before the others: it costs a step almost
# nothing, and behind the chunks of long prompts queued ahead of it its first token waited
# for all of them (32 streams of a Qwen3-0.6B body, half of them asked before: 11 repeated
# prompts answered after 1.2 s, in the last of four prefill steps instead of the first).
CHEAP_PREFILL_TOKENS = 32
# ... but it passes only requests queued for less than this, and none that resumes after a
# retraction: past it, arrival order again, so that cheap requests arriving all the time
# (taking the step's budget or the cache's room first) cannot keep a long prompt out.
CHEAP_OVERTAKES_S = 1.0
# Share of its remaining max_new_tokens a running request is expected to still need when
# deciding whether a new request fits. Too low and requests get retracted, too high and
# the cache sits idle; retraction keeps an underestimate safe.
DECODE_RESERVE_RATIO = 0.3
# A waiting request whose next this-many uncached tokens another request is prefilling right
# now waits for that prefill to reach the radix cache instead of computing them again (many
# requests arriving at once with one system prompt would otherwise each prefill all of it).
IN_BATCH_PREFIX_TOKENS = 32


def order_waiting(waiting: list[Req], policy: str, kv: KVManager, now: float) -> list[Req]:
    """The order in which waiting requests are considered this step (`now`: time.monotonic())."""
    if policy == "priority":
        return sorted(waiting, key=priority_order)
    if len(waiting) > LPM_MAX_QUEUE:
        return waiting
    if policy == "lpm":
        return sorted(waiting, key=lambda r: -kv.cached_prefix_len(r))

    def may_be_passed(req: Req) -> bool:
        recent = not req.output_ids and now - req.queued_at < CHEAP_OVERTAKES_S
        return recent and req.seq_len - kv.cached_prefix_len(req) > CHEAP_PREFILL_TOKENS

    # fcfs: the rest before those, each part in the queue's order (sorted is stable).
    return sorted(waiting, key=may_be_passed)


def priority_order(req: Req) -> tuple[int, int]:
    """Sorts the request to run first first: higher priority, then earlier arrival."""
    return -req.priority, req.arrival


def duplicates_a_prefill(req: Req, cached_len: int, prefilling: list[Req]) -> bool:
    """Whether `req`'s tokens after its cached prefix start like another request's that is
    being prefilled (and so will be in the radix cache shortly)."""
    end = cached_len + IN_BATCH_PREFIX_TOKENS
    if req.seq_len < end:
        return False
    head = req.fill_slice(cached_len, end)
    return any(other.seq_len >= end and other.fill_slice(cached_len, end) == head for other in prefilling)


def decode_reserve(running: list[Req]) -> int:
    return int(sum(r.max_new_tokens_left for r in running) * DECODE_RESERVE_RATIO)


@dataclass
class PrefillPlan:
    """Requests that prefill this step, with how many tokens each computes."""

    reqs: list[Req] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    tokens: int = 0

    def add(self, req: Req, extend_len: int) -> None:
        self.reqs.append(req)
        self.extend_lens.append(extend_len)
        self.tokens += extend_len


def prompt_refusal(req: Req, config: ModelConfig, max_req_input_len: int) -> str | None:
    """Why `req`'s prompt cannot run (a 400), or None; expands its image tokens."""
    if not req.prompt_ids:
        return "the prompt is empty"
    if len(req.prompt_ids) > max_req_input_len:
        return f"the input has {len(req.prompt_ids)} tokens, more than max_req_input_len={max_req_input_len}"
    if any(not 0 <= t < config.vocab_size for t in req.prompt_ids):
        return f"input_ids must be in [0, {config.vocab_size})"
    if not req.images:
        return None
    if config.vision is None or config.image_token_id is None:
        return "this model does not accept images"
    error = expand_image_tokens(req, config.image_token_id, config.num_image_tokens, config.vocab_size)
    if error is None and len(req.prompt_ids) >= max_req_input_len:
        error = (
            f"Multimodal prompt is too long after expanding image tokens: {len(req.prompt_ids)} >= {max_req_input_len}"
        )
    return error


def queue_refusal(req: Req, queue: list[Req], num_running: int, args: ServerArgs) -> FinishReason | None:
    """A 503 when the waiting `queue` is at --max-queued-requests, or `req`'s prompt would take
    the queued prompt tokens past --max-total-queued-tokens (an empty queue takes any).
    Requests that free running slots will take at the next step are not queued: several
    arriving at once at an idle server all run."""
    free_slots = max(args.max_running_requests - num_running, 0)
    queued = max(len(queue) - free_slots, 0)
    limit = args.max_queued_requests
    if limit and queued >= limit:
        message = f"the server is busy: {queued} requests are queued (--max-queued-requests {limit}); retry later"
        return FinishReason(type="abort", message=message, status_code=503, rejected="queue_full")
    limit = args.max_total_queued_tokens
    if limit and queued:
        tokens = sum(r.remaining_prefill for r in sorted(queue, key=lambda r: r.arrival)[free_slots:])
        if tokens + req.seq_len > limit:
            message = (
                f"the server is busy: {tokens} prompt tokens are queued and this request adds {req.seq_len} "
                f"(--max-total-queued-tokens {limit}); retry later"
            )
            return FinishReason(type="abort", message=message, status_code=503, rejected="queued_tokens")
    return None


def plan_prefill(
    running: list[Req],
    waiting: list[Req],
    kv: KVManager,
    args: ServerArgs,
    new_decode_slots: int,
    admit_new: bool,
    update_pending: bool = False,
) -> PrefillPlan:
    """This step's prompt chunks: first those of the admitted requests still prefilling,
    then new ones, moved from `waiting` to `running` while the budgets and the KV cache allow.
    `new_decode_slots`: the slots the step's decodes take; `admit_new` False: admitted
    requests only; `update_pending`: a weight update waits, so no request starts."""
    # `committed` counts the slots the step already needs.
    plan = PrefillPlan()
    budget = args.max_prefill_tokens
    committed = new_decode_slots
    # A request already admitted and prefilling in chunks goes first.
    for req in running:
        if not req.is_decoding and budget > 0:
            extend = min(req.remaining_prefill, args.chunked_prefill_size, budget)
            if kv.available() - committed < extend:
                continue
            plan.add(req, extend)
            budget -= extend
            committed += extend
    if not admit_new:
        return plan
    reserve = decode_reserve(running)
    prefilling = [req for req in running if not req.is_decoding]
    # Prompt tokens the admitted requests still have to prefill after this step. A new
    # request needs room for its whole prompt beside them, not only for its first chunk:
    # prompts admitted on a chunk's room would fill the cache between them and take turns
    # retracting each other for ever (SGLang admits on the whole input too).
    owed = sum(req.remaining_prefill for req in prefilling) - plan.tokens
    if budget <= 0 or len(running) >= args.max_running_requests or len(waiting) == 0:
        return plan  # nothing can start: no radix lookups to order the queue (a decode step)
    for req in list(order_waiting(waiting, args.schedule_policy, kv, time.monotonic())):
        if budget <= 0 or len(running) >= args.max_running_requests:
            break
        if update_pending and not req.output_ids:
            continue  # it starts on the new weights
        prefix = kv.cached_prefix_len(req)
        if not args.disable_radix_cache and duplicates_a_prefill(req, prefix, prefilling):
            continue
        # An idle server admits the first request whatever its estimate: retraction
        # covers an underestimate, and refusing would stall it forever.
        alone = not (running or plan.reqs)
        later = decode_reserve([req]) + reserve + owed
        if kv.available() - committed < req.seq_len - prefix + later and not alone:
            break
        if not kv.admit(req):
            break
        extend = min(req.remaining_prefill, args.chunked_prefill_size, budget)
        # Admission locked the matched prefix, which may have been counted as evictable.
        if kv.available() - committed < (extend if alone else req.remaining_prefill + later):
            kv.release(req, keep_in_cache=False)
            break
        waiting.remove(req)
        running.append(req)
        req.scheduled_at = req.scheduled_at or time.time()
        plan.add(req, extend)
        prefilling.append(req)
        budget -= extend
        committed += extend
        owed += req.remaining_prefill - extend
        reserve += decode_reserve([req])
    return plan
