"""The forward pass's thread count follows the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys

from sluice.config import ServerArgs
from sluice.scheduler.forward_threads import STALE_S, WINDOW_S, ForwardThreads, busy_core_seconds

STAT = """cpu  300 0 100 900 5 0 0 0 0 0
cpu0 100 5 50 400 2 3 2 7 0 0
cpu1 200 0 50 500 3 0 0 0 0 0
intr 12345
"""


def test_busy_seconds_count_the_named_cores_and_leave_out_idle_iowait_and_steal():
    assert busy_core_seconds(STAT, {0}, 100) == (100 + 5 + 50 + 3 + 2) / 100
    assert busy_core_seconds(STAT, {0, 1}, 100) == (160 + 250) / 100
    assert busy_core_seconds(STAT, {7}, 100) == 0


def test_the_real_proc_stat_reads():
    from sluice.scheduler.forward_threads import read_busy_core_seconds

    assert read_busy_core_seconds(os.sched_getaffinity(0)) > 0


def test_the_default_thread_count_is_the_cores_this_process_may_run_on():
    """A container's cpuset or `taskset` leaves fewer cores than the machine has: more
    threads than cores would make each parallel region wait for a thread without one."""
    first_core = min(os.sched_getaffinity(0))
    code = "from sluice.config import ServerArgs; print(ServerArgs().threads_per_scheduler())"
    pinned = subprocess.run(
        [sys.executable, "-c", code],
        preexec_fn=lambda: os.sched_setaffinity(0, {first_core}),
        capture_output=True,
        text=True,
        check=True,
    )
    assert pinned.stdout.strip() == "1"
    assert ServerArgs().threads_per_scheduler() == len(os.sched_getaffinity(0))
    assert ServerArgs(dp_size=2).threads_per_scheduler() == max(len(os.sched_getaffinity(0)) // 2, 1)


class Cores:
    """A fake machine: each `run` advances the clock by one window in which the other
    processes use `others` cores and the scheduler `own`."""

    def __init__(self, cores: int, threads: int):
        self.now = self.busy = self.own = 0.0
        self.set_to: list[int] = []
        self.threads = ForwardThreads(
            threads,
            self.set_to.append,
            range(cores),
            read_busy=lambda: self.busy,
            read_own=lambda: self.own,
            clock=lambda: self.now,
        )

    def run(self, others: float, own: float = 1.0, seconds: float = WINDOW_S) -> int:
        self.now += seconds
        self.busy += (others + own) * seconds
        self.own += own * seconds
        self.threads.after_turn()
        return self.threads.current


def test_a_busy_core_takes_a_thread_away_after_a_second_and_it_comes_back_a_second_after_it_is_free():
    cores = Cores(2, 2)
    assert cores.run(others=0.2, own=2.0) == 2  # the server's own front end: no change
    assert cores.run(others=0.67, own=1.33) == 2  # a busy loop shares the cores with both threads
    assert cores.run(others=0.67, own=1.33) == 1  # for a second
    assert cores.run(others=1.0) == 1  # now it has a core of its own
    assert cores.run(others=0.1) == 1  # free for half a second: not yet
    assert cores.run(others=0.1) == 2
    assert cores.set_to == [1, 2]


def test_bursts_shorter_than_two_readings_change_nothing():
    cores = Cores(2, 2)
    assert [cores.run(others) for others in (0.9, 0.1, 0.9, 0.1, 0.9)] == [2, 2, 2, 2, 2]
    assert [cores.run(others) for others in (0.9, 0.1, 0.9, 0.1, 0.1)] == [1, 1, 1, 1, 2]
    assert cores.set_to == [1, 2]


def test_never_fewer_than_one_thread_and_never_more_than_given():
    cores = Cores(2, 2)
    assert [cores.run(others=2.0, own=0.0) for _ in range(2)] == [2, 1]
    assert [cores.run(others=0.0) for _ in range(3)] == [1, 2, 2]
    assert Cores(1, 1).run(others=1.0) == 1


def test_cores_the_team_does_not_need_take_the_others_first():
    # 8 cores, 4 threads: the others may take 4 cores before a thread goes.
    cores = Cores(8, 4)
    assert [cores.run(others=4.3, own=4.0) for _ in range(2)] == [4, 4]
    assert [cores.run(others=5.0, own=3.0) for _ in range(2)] == [4, 3]
    assert [cores.run(others=6.9, own=1.0) for _ in range(2)] == [3, 1]


def test_more_threads_than_cores_is_the_users_choice():
    cores = Cores(2, 4)
    assert [cores.run(others=0.0, own=2.0) for _ in range(3)] == [4, 4, 4]


def test_a_window_spanning_a_long_sleep_decides_nothing_and_short_turns_wait_for_a_window():
    cores = Cores(2, 2)
    assert cores.run(others=1.5) == 2
    assert cores.run(others=1.5, seconds=STALE_S + 1) == 2
    assert cores.run(others=1.5, seconds=WINDOW_S / 4) == 2  # not a window yet
    assert cores.run(others=1.5) == 1
