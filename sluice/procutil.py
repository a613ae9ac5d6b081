"""What every child process does first: die with its parent, keep to its threads, log."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

PR_SET_NAME = 15
PR_SET_PDEATHSIG = 1


def become_child_process(name: str, num_threads: int, log_level: str) -> None:
    """Tie this process's life to its parent's and limit its compute threads."""
    logging.basicConfig(level=log_level.upper(), format=f"%(asctime)s [{name}] %(levelname)s %(message)s")
    parent_pid = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        # The name `ps` and psutil show (at most 15 bytes), e.g. "sluice-schedule".
        libc.prctl(PR_SET_NAME, f"sluice-{name}".encode()[:15])
    except OSError:
        pass
    # prctl misses a parent that died before the call; the watcher also covers non-Linux.
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid,), daemon=True).start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when children stop
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    import torch

    torch.set_num_threads(max(num_threads, 1))


def _exit_when_orphaned(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(0.5)
