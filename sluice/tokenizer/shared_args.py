"""The shared-memory block through which HTTP worker processes get their arguments:
server arguments, IPC names and the Scheduler's start-up info, as msgspec JSON."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any

import msgspec

from sluice.config import PortArgs, ServerArgs
from sluice.messages import SchedulerReady

SHM_PREFIX = "sluice_multi_tokenizer_args_"


class MultiTokenizerArgs(msgspec.Struct):
    server_args: dict[str, Any]
    port_args: dict[str, Any]
    scheduler_info: SchedulerReady


def shared_args_path(main_pid: int) -> str:
    # A file in /dev/shm is a POSIX shared-memory object; plain file calls suffice and,
    # unlike multiprocessing.shared_memory, no resource tracker unlinks it behind our back.
    return f"/dev/shm/{SHM_PREFIX}{main_pid}"


def write_shared_args(server_args: ServerArgs, port_args: PortArgs, scheduler_info: SchedulerReady) -> str:
    """Publish the arguments for the workers; returns the block's path. The main process
    removes it on exit, the router when the main process is killed."""
    payload = msgspec.json.encode(
        MultiTokenizerArgs(
            server_args=dataclasses.asdict(server_args),
            port_args=dataclasses.asdict(port_args),
            scheduler_info=scheduler_info,
        )
    )
    path = shared_args_path(os.getpid())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it names the IPC paths: owner only
    with os.fdopen(fd, "wb") as f:
        f.write(payload)
    return path


def read_shared_args(main_pid: int) -> tuple[ServerArgs, PortArgs, SchedulerReady]:
    with open(shared_args_path(main_pid), "rb") as f:
        args = msgspec.json.decode(f.read(), type=MultiTokenizerArgs)
    return ServerArgs(**args.server_args), PortArgs(**args.port_args), args.scheduler_info


def remove_shared_args(main_pid: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(shared_args_path(main_pid))
