"""How many threads the forward pass runs on: all it was given while their cores are free,
fewer while other processes keep some of those cores busy.

The kernels' OpenMP barriers spin. A team with more threads than free cores waits at every
barrier for a thread that has no core, and a step takes 10-100x as long (README, "Split
the cores"). Twice a second the Scheduler reads how busy its cores were (/proc/stat) less what
it used itself: that is the other processes' share. When it leaves fewer free cores than
threads for a second (two readings in a row: a shorter burst passes), the team shrinks; it
grows back once the cores have been free for a second.
The thread count does not change any answer: the kernels split rows and requests among
threads, never one sum.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Collection

logger = logging.getLogger(__name__)

WINDOW_S = 0.5  # how often the cores' use is read
STALE_S = 5.0  # a longer window (a scheduler asleep while idle) decides nothing
SPARE = 0.5  # a core the others use less than this much counts as free
CHANGE_AFTER = 2  # windows in a row that ask for another team size before it changes
PROC_STAT = "/proc/stat"
# Its columns after the cpu name: user nice system idle iowait irq softirq steal.
BUSY_COLUMNS = (0, 1, 2, 5, 6)


def busy_core_seconds(stat_text: str, cores: Collection[int], ticks_per_s: int) -> float:
    """Seconds that `cores` have spent running anything since boot, from /proc/stat's text."""
    ticks = 0
    for line in stat_text.splitlines():
        name, _, columns = line.partition(" ")
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            counts = columns.split()
            ticks += sum(int(counts[i]) for i in BUSY_COLUMNS)
    return ticks / ticks_per_s


def read_busy_core_seconds(cores: Collection[int]) -> float:
    with open(PROC_STAT) as f:
        return busy_core_seconds(f.read(), cores, os.sysconf("SC_CLK_TCK"))


class ForwardThreads:
    """Call `after_turn` once per scheduler turn; it calls `set_threads` when the count should
    change. The readers and the clock are arguments for tests."""

    def __init__(
        self,
        threads: int,
        set_threads: Callable[[int], None],
        cores: Collection[int] | None = None,
        *,
        read_busy: Callable[[], float] | None = None,
        read_own: Callable[[], float] = time.process_time,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.threads = self.current = threads
        self.set_threads = set_threads
        self.cores = frozenset(os.sched_getaffinity(0) if cores is None else cores)
        self.read_busy = read_busy or (lambda: read_busy_core_seconds(self.cores))
        self.read_own = read_own
        self.clock = clock
        self.last_asked, self.windows_asking = threads, 0
        self.shrunk_before = False
        self.start = self.sample()

    def sample(self) -> tuple[float, float, float]:
        return self.clock(), self.read_busy(), self.read_own()

    def after_turn(self) -> None:
        if self.threads == 1 or self.clock() - self.start[0] < WINDOW_S:
            return
        (t0, busy0, own0), (t1, busy1, own1) = self.start, self.sample()
        self.start = (t1, busy1, own1)
        if t1 - t0 > STALE_S:
            return
        others = max((busy1 - busy0) - (own1 - own0), 0.0) / (t1 - t0)
        self.decide(others)

    def decide(self, others: float) -> None:
        """`others`: the cores the other processes kept busy over the last window."""
        # What the others take beyond the cores the team leaves them.
        taken = others - max(len(self.cores) - self.threads, 0)
        fitting = min(max(self.threads - math.ceil(taken - SPARE), 1), self.threads)
        if fitting == self.current:
            self.windows_asking = 0
            return
        same_way = (fitting < self.current) == (self.last_asked < self.current)
        self.windows_asking = self.windows_asking + 1 if same_way else 1
        self.last_asked = fitting
        if self.windows_asking < CHANGE_AFTER:
            return
        if fitting < self.current:
            logger.log(
                logging.INFO if self.shrunk_before else logging.WARNING,
                "other processes keep %.1f of this scheduler's %d cores busy: the forward pass runs on %d threads "
                "instead of %d until they are free",
                others,
                len(self.cores),
                fitting,
                self.current,
            )
            self.shrunk_before = True
        else:
            logger.info("the cores are free again: the forward pass runs on %d threads", fitting)
        self.current, self.windows_asking = fitting, 0
        self.set_threads(fitting)
