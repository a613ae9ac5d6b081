"""HTTP worker processes: `--tokenizer-worker-num N > 1` (seed 002, `init_multi_tokenizer`),
or Granian's worker.

The main process writes the server arguments, the port arguments and the Scheduler's
start-up info to a shared-memory block named after its pid (`tokenizer/shared_args.py`).
Each worker process reads the block, makes its own inbox (`tokenizer_ipc_name`), builds
its TokenizerWorker and chat template, and registers with the MultiTokenizerRouter
(which answers with the pause state: a replacement for a dead worker holds requests as the
others do).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager

from sluice.procutil import die_with_parent
from sluice.server.app import ServerState, create_app
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.shared_args import read_shared_args, remove_shared_args
from sluice.tokenizer.startup import WARMUP_TIMEOUT_S, load_multimodal_processor, load_tokenizer_side, warm_up
from sluice.tokenizer_files import keep_torch_out_where_the_tokenizer_allows

logger = logging.getLogger(__name__)


def init_multi_tokenizer():
    """Build this worker's TokenizerWorker from the shared block; returns (tm, args)."""
    server_args, port_args, scheduler_info = read_shared_args(os.getppid())
    if scheduler_info.image_token_id is None:  # a text-only model: this worker tokenizes and serves HTTP
        keep_torch_out_where_the_tokenizer_allows(server_args.resolved_model_path())
    tokenizer, chat_template = load_tokenizer_side(server_args)
    if server_args.tokenizer_worker_num == 1:  # one worker (Granian): no router in between
        remove_shared_args(os.getppid())  # read by its only reader, and no router to clean up
        tm = TokenizerManager(server_args, port_args, tokenizer, chat_template)
    else:
        tokenizer_ipc_name = port_args.http_worker_inbox(os.getpid(), uuid.uuid4().hex[:6])
        tm = TokenizerManager(server_args, port_args, tokenizer, chat_template, http_worker_ipc=tokenizer_ipc_name)
    tm.scheduler_info = scheduler_info
    tm.mm_processor = load_multimodal_processor(server_args, scheduler_info, tokenizer)
    return tm, server_args


def create_worker_app():
    """The app factory each HTTP worker process calls (uvicorn `factory=True`)."""
    die_with_parent("http-worker")
    tm, server_args = init_multi_tokenizer()
    logging.basicConfig(
        level=server_args.log_level.upper(), format=f"%(asctime)s [worker {os.getpid()}] %(levelname)s %(message)s"
    )
    state = ServerState(server_args)

    @asynccontextmanager
    async def lifespan(app):
        started = time.perf_counter()
        tm.start_handle_loop()
        try:
            if tm.http_worker_ipc is not None:
                await tm.register_with_router()
            if tm.dead_workers:
                # The router told it of a dead worker: it replaces one (or a sibling died while
                # it started), after the first workers' warm-ups ran the model. Its warm-up would
                # queue behind every request waiting in the Scheduler (a busy server, a long
                # weight update) and, past WARMUP_TIMEOUT_S, fail its start, which stops the
                # whole server.
                logger.info("replaces a dead worker: no warm-up")
            elif not server_args.skip_warmup:
                await asyncio.wait_for(warm_up(tm, rid=f"WARMUP-{os.getpid()}"), WARMUP_TIMEOUT_S)
        except BackendError:
            if tm.backend_error is None:
                raise
            # A back-end process died (the router says so to a late comer): serve the 503s
            # the others serve; failing to start would make uvicorn stop the whole server.
            logger.error("the back end is gone (%s): this worker answers 503", tm.backend_error)
        state.serve_with(tm)
        logger.info("worker ready in %.1f s", time.perf_counter() - started)
        yield

    return create_app(state, lifespan=lifespan)
