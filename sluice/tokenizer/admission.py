"""What a worker checks before it tokenizes a request: its size (batch items x n) and the
room left in the queue. Both refuse early, before any per-item work."""

from __future__ import annotations

from sluice.config import ServerArgs
from sluice.sampling import ClientError
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.metrics import RequestMetrics


class ServerBusy(RuntimeError):
    """The server refuses a request for its load (503 with Retry-After)."""


def check_request_size(obj: GenerateReqInput, args: ServerArgs) -> int:
    """Refuse an oversized batch or n; returns n."""
    if not obj.is_single:
        obj.normalize_batch(args.max_batch_items)
    n = obj.sample_count()
    if n > args.max_n:
        raise ClientError(f"n is {n}, more than max_n={args.max_n}", "n")
    if obj.batch_size * n > args.max_batch_items:
        raise ClientError(
            f"{obj.batch_size} prompts x n={n} is {obj.batch_size * n} items, "
            f"more than max_batch_items={args.max_batch_items}",
            "n",
        )
    return n


def check_queue_room(args: ServerArgs, in_flight: int, metrics: RequestMetrics, log_metrics: bool = True) -> None:
    """Refuse a request when this process alone already has more requests in flight (live
    states and requests held by a pause) than can run plus --max-queued-requests, each per
    Scheduler replica. The Scheduler checks the exact queue (over every HTTP worker) when
    the request arrives."""
    limit = args.max_queued_requests
    if not limit:
        return
    queued = in_flight - args.max_running_requests * args.dp_size
    if queued >= limit * args.dp_size:
        if log_metrics:
            metrics.on_rejected("queue_full")
        raise ServerBusy(
            f"the server is busy: at least {queued} requests are queued (--max-queued-requests {limit}); retry later"
        )
