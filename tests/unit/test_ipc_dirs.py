"""The IPC folder of a server killed with SIGKILL (which cannot remove it) is removed by the
next server to start, and nothing else is."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from sluice.config import PortArgs

_HOLDER = """
import time
from sluice.config import PortArgs
port_args = PortArgs.create()
port_args.hold_ipc_dir()
print(port_args.ipc_dir, flush=True)
time.sleep(120)
"""


def test_a_killed_server_s_folder_is_removed_by_the_next_one_and_a_live_one_s_is_not():
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
    made: list[PortArgs] = []
    try:
        held = Path(holder.stdout.readline().strip())  # type: ignore[union-attr]
        made.append(PortArgs.create())
        assert held.is_dir()  # its server runs
        holder.kill()
        holder.wait()
        assert held.is_dir()  # nobody has started since
        made.append(PortArgs.create())
        assert not held.exists()
        # A folder made but not locked yet (a server starting) is left alone.
        assert Path(made[0].ipc_dir).is_dir()
    finally:
        holder.kill()
        holder.wait()
        for port_args in made:
            shutil.rmtree(port_args.ipc_dir, ignore_errors=True)
