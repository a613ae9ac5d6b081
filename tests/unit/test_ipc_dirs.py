"""The IPC folder of a server killed with SIGKILL (which cannot remove it) is removed by the
next server to start, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sluice.ipc_dirs import IPC_DIR_PREFIX, hold_ipc_dir, make_ipc_dir, remove_abandoned_ipc_dirs

_HOLDER = """
import time
from sluice.ipc_dirs import hold_ipc_dir, make_ipc_dir
ipc_dir = make_ipc_dir()
hold_ipc_dir(ipc_dir)
print(ipc_dir, flush=True)
time.sleep(120)
"""


def test_a_killed_server_s_folder_is_removed_by_the_next_one_and_a_live_one_s_is_not(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # folders of its own: other servers may start meanwhile
    starting = tmp_path / f"{IPC_DIR_PREFIX}starting"  # made, not locked yet
    starting.mkdir()
    with subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True, env=env) as holder:
        try:
            held = Path(holder.stdout.readline().strip())  # type: ignore[union-attr]
            assert held.parent == tmp_path
            remove_abandoned_ipc_dirs(str(tmp_path))
            assert held.is_dir()  # its server runs
        finally:
            holder.kill()
    remove_abandoned_ipc_dirs(str(tmp_path))
    assert not held.exists()
    assert starting.is_dir()


def test_this_process_s_own_folder_stays_while_it_holds_it():
    ipc_dir = make_ipc_dir()
    fd = hold_ipc_dir(ipc_dir)
    assert fd is not None
    try:
        remove_abandoned_ipc_dirs(str(Path(ipc_dir).parent))
        assert Path(ipc_dir).is_dir()  # a second lock from this process is refused too (flock is per open file)
    finally:
        os.close(fd)
    remove_abandoned_ipc_dirs(str(Path(ipc_dir).parent))
    assert not Path(ipc_dir).exists()
