"""Run the app under the chosen HTTP server: uvicorn (default) or Granian."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import socket
import sys
import time

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess

from sluice.config import ServerArgs

logger = logging.getLogger(__name__)


def serve_http(server_args: ServerArgs, app, workers: int = 1) -> None:
    """`app` is the app itself (one worker) or an import string of an app factory."""
    if server_args.http_server == "granian":
        _serve_granian(server_args, app, workers)
        return
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level="warning",
        timeout_keep_alive=30,
        workers=workers,
        factory=isinstance(app, str),
        # uvloop's event loop and httptools' parser instead of asyncio's and h11's (both
        # dependencies, named so that a missing one fails at start-up instead of falling back
        # quietly). On the 2 vCPU AMX Xeon, SmolLM2 at 32 streams: the HTTP process used about
        # 1.05 s of CPU against 1.24 s for 16,384 streamed tokens, and each cycle it takes
        # stalls the Scheduler's kernel threads.
        loop="uvloop",
        http="httptools",
        # Streams still open then are closed: without a limit, one streaming near the context
        # length held a SIGTERM off for minutes (the multi-worker supervisor kills at the same time).
        timeout_graceful_shutdown=server_args.shutdown_timeout,
    )
    # What uvicorn.run does, with a bounded wait for the workers to stop.
    if workers > 1:
        with contextlib.suppress(KeyboardInterrupt):
            _BoundedWorkers(config, [config.bind_socket()], server_args.shutdown_timeout).run()
        return
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


def _serve_granian(server_args: ServerArgs, app_factory: str, workers: int) -> None:
    from granian import Granian
    from granian.constants import Interfaces
    from granian.log import LogLevels

    # Granian starts its workers by the default method, which on Linux forks this process:
    # each worker would inherit what the launcher imported before the workers' settings were
    # in its environment (prometheus-client chose its in-memory values, so /metrics showed no
    # request counters), and a fork of a process with threads. Spawned, as uvicorn's are, a
    # worker imports the app factory afresh.
    multiprocessing.set_start_method("spawn", force=True)
    Granian(
        app_factory,
        address=server_args.host,
        port=server_args.port,
        interface=Interfaces.ASGI,
        workers=workers,
        factory=True,
        log_level=LogLevels.warning,
        workers_kill_timeout=server_args.shutdown_timeout,
        # As uvicorn's supervisor: a worker that dies is replaced (it registers with the router;
        # /health says one died), not the end of the whole server. One worker is the server.
        respawn_failed_workers=workers > 1,
    ).serve()


class _BoundedWorkers(Multiprocess):
    """uvicorn's supervisor of worker processes, which on SIGTERM waits for each worker
    without a limit: one whose event loop a bug keeps busy would hold the server up for
    ever. A worker still running `stop_timeout_s` (--shutdown-timeout) after the SIGTERM is killed."""

    def __init__(self, config: uvicorn.Config, sockets: list[socket.socket], stop_timeout_s: int) -> None:
        super().__init__(config, sockets)
        self.stop_timeout_s = stop_timeout_s

    def join_all(self) -> None:
        deadline = time.monotonic() + self.stop_timeout_s
        for worker in self.processes:
            worker.process.join(max(deadline - time.monotonic(), 0.0))
            if worker.process.is_alive():
                logger.error("HTTP worker %d did not stop within %d s: killed", worker.pid, self.stop_timeout_s)
                worker.kill()
                worker.process.join()
