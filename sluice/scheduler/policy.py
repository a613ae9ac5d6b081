"""Which waiting requests prefill next, under the step's token and memory budgets, and
which new requests their prompt or the queue limits refuse."""

from __future__ import annotations

from dataclasses import dataclass, field

from sluice.config import ServerArgs
from sluice.messages import FinishReason
from sluice.model.model_config import ModelConfig
from sluice.scheduler.kv_manager import KVManager
from sluice.scheduler.multimodal import expand_image_tokens
from sluice.scheduler.req import Req

# Above this many waiting requests, lpm falls back to fcfs: matching every one against
# the radix tree each step would cost more than it saves.
LPM_MAX_QUEUE = 128
# Share of its remaining max_new_tokens a running request is expected to still need when
# deciding whether a new request fits. Too low and requests get retracted, too high and
# the cache sits idle; retraction keeps an underestimate safe.
DECODE_RESERVE_RATIO = 0.3
# A waiting request whose next this-many uncached tokens another request is prefilling right
# now waits for that prefill to reach the radix cache instead of computing them again (many
# requests arriving at once with one system prompt would otherwise each prefill all of it).
IN_BATCH_PREFIX_TOKENS = 32


def order_waiting(waiting: list[Req], policy: str, kv: KVManager) -> list[Req]:
    if policy == "lpm" and len(waiting) <= LPM_MAX_QUEUE:
        return sorted(waiting, key=lambda r: -kv.cached_prefix_len(r))
    if policy == "priority":
        return sorted(waiting, key=priority_order)
    return waiting


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
