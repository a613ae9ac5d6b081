"""The private folders of the internal sockets (`sluice-ipc-*` in the temporary directory).

PortArgs.create makes one; the process that serves from it (launch.Backend) locks it with
an flock while it lives and removes it on stop. A server killed first (SIGKILL) cannot
remove it, but its lock dies with it: the next server to start removes such folders."""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Final

IPC_DIR_PREFIX: Final = "sluice-ipc-"
_OWNER_LOCK: Final = "owner.lock"


def make_ipc_dir() -> str:
    ipc_dir = tempfile.mkdtemp(prefix=IPC_DIR_PREFIX)
    os.chmod(ipc_dir, 0o700)
    return ipc_dir


def hold_ipc_dir(ipc_dir: str) -> int | None:
    """Locks `ipc_dir` for this process until the returned descriptor is closed or the
    process ends, however it ends. None where the file system has no flock (some network
    mounts): the server runs, and its folder is not swept if it is killed."""
    staging = os.path.join(ipc_dir, _OWNER_LOCK + ".new")
    try:
        fd = os.open(staging, os.O_CREAT | os.O_RDWR, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Named for remove_abandoned_ipc_dirs only once locked.
        os.rename(staging, os.path.join(ipc_dir, _OWNER_LOCK))
    except OSError:
        os.close(fd)
        return None
    return fd


def remove_abandoned_ipc_dirs(root: str | None = None) -> None:
    """Removes this user's IPC folders under `root` (the temporary directory) whose server
    died without removing them: their owner lock is free. A running server's folder, a
    folder not locked yet (a server starting) and another user's (root could open them) are
    left alone."""
    uid = os.geteuid()
    for lock_path in Path(root or tempfile.gettempdir()).glob(f"{IPC_DIR_PREFIX}*/{_OWNER_LOCK}"):
        try:
            if lock_path.parent.lstat().st_uid != uid:
                continue
            fd = os.open(lock_path, os.O_RDWR)
        except OSError:  # removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its server runs
            os.close(fd)
            continue
        shutil.rmtree(lock_path.parent, ignore_errors=True)
        os.close(fd)
