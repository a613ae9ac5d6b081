"""What an HTTP worker refuses before it tokenizes a request."""

from __future__ import annotations

import pytest

from sluice.config import ServerArgs
from sluice.tokenizer.admission import ServerBusy, check_queue_room
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
