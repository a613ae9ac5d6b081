"""A soft watchdog: log the stuck state when requests are in flight and outputs stop coming.

Waiting for a message while nothing is in flight is normal and never counts: the clock
runs from the last message, or from the moment the first request of a busy period was
dispatched, whichever is later.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable

logger = logging.getLogger(__name__)


class SoftWatchdog:
    def __init__(
        self,
        timeout_s: float,
        in_flight: Callable[[], int],
        describe: Callable[[], str],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.in_flight = in_flight
        self.describe = describe
        self.clock = clock
        self.last_feed = clock()
        self.fired_for: float | None = None  # the feed time of the stall already reported
        self.num_fired = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def feed(self) -> None:
        self.last_feed = self.clock()

    def check(self) -> bool:
        """Report a stall once per stall; returns whether it fired now."""
        if not self.in_flight():
            return False
        silent_s = self.clock() - self.last_feed
        if silent_s < self.timeout_s or self.fired_for == self.last_feed:
            return False
        self.fired_for = self.last_feed
        self.num_fired += 1
        logger.error(
            "soft watchdog: %d request(s) in flight and no output for %.1f s (limit %.1f s)\n%s\n%s",
            self.in_flight(),
            silent_s,
            self.timeout_s,
            self.describe(),
            thread_stacks(),
        )
        return True

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soft-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        period_s = min(max(self.timeout_s / 4, 0.05), 5.0)
        while not self._stop.wait(period_s):
            self.check()


def thread_stacks() -> str:
    parts = []
    for thread_id, frame in sys._current_frames().items():
        parts.append(f"--- thread {thread_id}\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)
