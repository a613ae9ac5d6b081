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
    items = obj.batch_size * n
    what = f"{obj.batch_size} prompts x n={n} is {items} items"
    if items > args.max_batch_items:
        raise ClientError(f"{what}, more than max_batch_items={args.max_batch_items}", "n")
    check_fits_in_queue(items, args, "n" if n > 1 else obj.prompt_field, what)
    return n


def check_fits_in_queue(items: int, args: ServerArgs, param: str, what: str) -> None:
    """Refuse (400) a request of more items than the server can ever hold at once with
    --max-queued-requests: its items arrive together, and those past the queue's room would
    get a 503 on an idle server too, so a client retrying it would retry for ever. The room
    is one replica's with --dp-size: a request's items may all go to one (its n samples
    always do, and prompts sharing a prefix do under cache-aware placement)."""
    if not args.max_queued_requests:
        return
    room = args.max_running_requests + args.max_queued_requests
    if items > room:
        each = " on each replica" if args.dp_size > 1 else ""
        raise ClientError(
            f"{what}, more than the server holds at once{each}: {room} (--max-running-requests "
            f"{args.max_running_requests} + --max-queued-requests {args.max_queued_requests})",
            param,
        )


def check_fits_in_token_queue(prompt_lens: list[int], args: ServerArgs, param: str, one_replica: bool) -> None:
    """Refuse (400) a request whose prompts the Scheduler would refuse with a 503 on an idle
    server for --max-total-queued-tokens: its items arrive together, the first
    --max-running-requests of them take free slots, and the others queue, the first of them
    whatever its length (see scheduler/policy.py queue_refusal). A client retrying the 503
    would retry for ever. With --dp-size only when the items all go to one replica
    (`one_replica`: the n samples of one prompt); other batches are spread over them."""
    limit = args.max_total_queued_tokens
    queued = prompt_lens[args.max_running_requests :]
    if not limit or len(queued) < 2 or sum(queued) <= limit or (args.dp_size > 1 and not one_replica):
        return
    each = " on each replica" if args.dp_size > 1 else ""
    raise ClientError(
        f"the request's {len(prompt_lens)} prompts hold {sum(prompt_lens)} tokens, and the "
        f"{len(queued)} of them past the {args.max_running_requests} that run at once{each} "
        f"(--max-running-requests) hold {sum(queued)}: more than the server queues (--max-total-queued-tokens "
        f"{limit}); send fewer or shorter prompts",
        param,
    )


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
