"""What an HTTP worker refuses before it tokenizes a request."""

from __future__ import annotations

import pytest

from sluice.config import ServerArgs
from sluice.sampling import ClientError
from sluice.tokenizer.admission import ServerBusy, check_fits_in_token_queue, check_queue_room, check_request_size
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.metrics import RequestMetrics


@pytest.mark.parametrize("dp_size", [1, 3])
def test_the_queue_limit_holds_per_scheduler_replica(dp_size):
    args = ServerArgs(max_running_requests=2, max_queued_requests=4, dp_size=dp_size)
    room = (2 + 4) * dp_size  # what every replica can run and queue
    check_queue_room(args, room - 1, RequestMetrics())
    with pytest.raises(ServerBusy, match="--max-queued-requests 4"):
        check_queue_room(args, room, RequestMetrics())


def test_no_limit_refuses_nothing():
    check_queue_room(ServerArgs(max_queued_requests=0), 10_000, RequestMetrics())


@pytest.mark.parametrize("dp_size", [1, 2])
def test_a_request_of_more_items_than_one_replica_holds_is_a_client_error(dp_size):
    """A request's items may all go to one replica (its n samples always do): one past a
    replica's running + queued slots could never be taken whole, however many replicas."""
    args = ServerArgs(max_running_requests=4, max_queued_requests=2, dp_size=dp_size)
    check_request_size(GenerateReqInput(text="Hi", sampling_params={"n": 6}), args)
    with pytest.raises(ClientError, match=r"holds at once.*: 6 ") as refused:
        check_request_size(GenerateReqInput(text="Hi", sampling_params={"n": 7}), args)
    assert refused.value.param == "n"
    with pytest.raises(ClientError) as refused:
        check_request_size(GenerateReqInput(input_ids=[[1, 2]] * 7), args)
    assert refused.value.param == "input_ids"
    check_request_size(GenerateReqInput(input_ids=[[1, 2]] * 7), ServerArgs(max_running_requests=4))


def test_prompts_past_the_running_slots_must_fit_the_token_queue():
    """As the Scheduler's queue_refusal on an idle server: the first max_running_requests
    prompts run, the first queued one is taken whatever its length, the others only within
    --max-total-queued-tokens."""
    args = ServerArgs(max_running_requests=2, max_total_queued_tokens=64)
    check_fits_in_token_queue([40, 40, 30, 30], args, "text", one_replica=False)
    check_fits_in_token_queue([500, 500, 500], args, "text", one_replica=False)
    with pytest.raises(ClientError, match="hold 80: more than the server queues") as refused:
        check_fits_in_token_queue([1, 1, 40, 40], args, "n", one_replica=True)
    assert refused.value.param == "n"
    check_fits_in_token_queue([1, 1, 40, 40], ServerArgs(max_running_requests=2), "n", one_replica=True)


def test_with_replicas_only_the_samples_of_one_prompt_are_checked():
    """A batch's prompts are spread over the replicas (an idle pair runs 4 of them at once);
    one prompt's n samples all go to one."""
    args = ServerArgs(max_running_requests=2, max_total_queued_tokens=64, dp_size=2)
    check_fits_in_token_queue([40, 40, 40, 40], args, "text", one_replica=False)
    with pytest.raises(ClientError, match="run at once on each replica"):
        check_fits_in_token_queue([40, 40, 40, 40], args, "n", one_replica=True)
