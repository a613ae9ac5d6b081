"""Start sluice's processes: the HTTP server (`launch_server`) or in-process (`Engine`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sluice.config import PortArgs, ServerArgs
from sluice.ipc import AsyncReceiver, Sender
from sluice.ipc_dirs import hold_ipc_dir, remove_abandoned_ipc_dirs
from sluice.messages import ProcessFailed, SchedulerReady
from sluice.sampling import ClientError
from sluice.server.app import ServerState, create_app
from sluice.server.errors import failure_status
from sluice.server.http import serve_http
from sluice.server.logprobs import TokenTexts
from sluice.tokenizer.control import BackendError, wait_for_backend
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.metrics import MULTIPROC_DIR_ENV
from sluice.tokenizer.multimodal.processor import has_image_processor
from sluice.tokenizer.result import native_json
from sluice.tokenizer.router import run_router_process
from sluice.tokenizer.shared_args import remove_shared_args, write_shared_args
from sluice.tokenizer.startup import WARMUP_TIMEOUT_S, load_multimodal_processor, load_tokenizer_side, warm_up
from sluice.tokenizer_files import (
    TokenizerUnreadable,
    cache_gguf_tokenizer,
    keep_torch_out_where_the_tokenizer_allows,
)

logger = logging.getLogger(__name__)
ENGINE_STOP_TIMEOUT_S = 5.0
ROUTER_PROCESS = "sluice-router"


class Backend:
    """The child processes of one server: Scheduler, DetokenizerManager (and the router)."""

    def __init__(self, server_args: ServerArgs, port_args: PortArgs):
        # Imported here, not at the top: the scheduler's module loads torch, and importing
        # sluice.launch (or sluice.Engine) stays cheap until a back end starts.
        from sluice.detokenizer.manager import run_detokenizer_process
        from sluice.scheduler.dp_controller import replica_port_args, run_dp_controller_process
        from sluice.scheduler.process import run_scheduler_process

        self.server_args = server_args
        self.port_args = port_args
        remove_abandoned_ipc_dirs()
        self.ipc_dir_lock = hold_ipc_dir(port_args.ipc_dir)
        self.processes: list = []
        # With --dp-size > 1 the DataParallelController watches the replicas: one that dies
        # fails only its own requests.
        self.replicas: list = []
        self.stopping = False
        self.router_died = False  # the workers' only way to the Scheduler: the server stops
        try:
            if server_args.dp_size == 1:
                self.start(run_scheduler_process, "sluice-scheduler")
            else:
                for rank in range(server_args.dp_size):
                    replica = self.start(
                        run_scheduler_process, f"sluice-scheduler-{rank}", replica_port_args(port_args, rank), rank
                    )
                    self.replicas.append(replica)
                pids = msgspec.json.encode([replica.pid for replica in self.replicas])
                self.start(run_dp_controller_process, "sluice-dp-controller", port_args, pids)
            self.start(run_detokenizer_process, "sluice-detokenizer")
        except BaseException:
            self.shutdown()  # the processes started so far, the folder and its lock
            raise

    def start(self, target, name: str, port_args: PortArgs | None = None, *extra: Any) -> Any:
        # Arguments cross as msgspec JSON bytes (and plain ints): no object of ours is pickled.
        encoded = (self.server_args.encode(), (port_args or self.port_args).encode(), *extra)
        process = mp.get_context("spawn").Process(target=target, args=encoded, name=name, daemon=True)
        process.start()
        self.processes.append(process)
        return process

    def dead_process(self) -> str | None:
        """A process whose death ends the server (a replica's ends only its own requests)."""
        for process in self.processes:
            if process not in self.replicas and not process.is_alive():
                return process.name
        return None

    def exit_code(self, name: str) -> int | None:
        """The exit status of the process `name` (None while it runs; -N: killed by signal N)."""
        return next((process.exitcode for process in self.processes if process.name == name), None)

    def dead_while_starting(self) -> str | None:
        """Any process that died before the back end reported ready (a replica too, which
        the start-up would otherwise wait for until its time runs out), and how it ended."""
        dead = next((process for process in self.processes if not process.is_alive()), None)
        if dead is None:
            return None
        code = dead.exitcode
        if code == -signal.SIGKILL:
            return f"{dead.name} process was killed (SIGKILL: out of memory?)"
        if code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {-code}"
            return f"{dead.name} process was killed by {name}"
        # A script that starts a server without `if __name__ == "__main__":` dies here: the
        # spawned child imports the script again and may not start processes while it does.
        return f"{dead.name} process exited with status {code} (its error is above)"

    def log_death(self, name: str) -> None:
        """A child that died: by a crash or kill (an error), or stopped by a SIGTERM (status 0,
        procutil): the one sent to the whole process group when the server stops reaches the
        children before this process has begun to stop them."""
        if self.exit_code(name) == 0:
            logger.warning("%s exited with status 0, as on SIGTERM", name)
        else:
            logger.error("%s died", name)

    def shutdown(self) -> None:
        self.stopping = True
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + 5
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                process.kill()
                process.join(1)
        shutil.rmtree(self.port_args.ipc_dir, ignore_errors=True)
        if self.ipc_dir_lock is not None:  # shutdown may run twice (the app's lifespan, then serving's end)
            os.close(self.ipc_dir_lock)
            self.ipc_dir_lock = None


async def start_tokenizer_manager(server_args: ServerArgs, backend: Backend):
    """Build the TokenizerManager, wait for the back end, start handle_loop, warm up."""
    tokenizer, chat_template = await asyncio.to_thread(load_tokenizer_side, server_args)
    tm = TokenizerManager(server_args, backend.port_args, tokenizer, chat_template)
    scheduler_info = await tm.wait_for_backend(dead_process=backend.dead_while_starting)
    tm.mm_processor = await asyncio.to_thread(load_multimodal_processor, server_args, scheduler_info, tokenizer)
    tm.start_handle_loop()
    asyncio.get_running_loop().create_task(_watch_backend(tm, backend))
    if not server_args.skip_warmup:
        await asyncio.wait_for(warm_up(tm), WARMUP_TIMEOUT_S)
    return tm


async def _watch_backend(tm, backend: Backend) -> None:
    """A child that dies fails in-flight requests and turns the server unhealthy."""
    while tm.backend_error is None:
        name = backend.dead_process()
        if name is not None:
            backend.log_death(name)
            tm.fail_all(f"{name} died")
            return
        await asyncio.sleep(1.0)


def launch_server(server_args: ServerArgs) -> None:
    logging.basicConfig(level=server_args.log_level.upper(), format="%(asctime)s [main] %(levelname)s %(message)s")
    try:
        _keep_torch_out_of_the_front_end(server_args.resolved_model_path())
    except ValueError as e:  # a GGUF tokenizer that cannot be converted: one line, before anything starts
        sys.exit(f"sluice: {e}")
    if server_args.tokenizer_worker_num > 1 or server_args.http_server == "granian":
        _launch_worker_processes_server(server_args)
    else:
        _launch_single_worker_server(server_args)


def _keep_torch_out_of_the_front_end(model_path: str) -> None:
    """A text-only model's HTTP / tokenizer process runs no tensors: keep torch out of it,
    once a GGUF file's tokenizer is in the cache (converting it needs torch), before the
    DetokenizerManager starts and looks for the same copy."""
    if has_image_processor(model_path):
        return  # the image processor runs torch ops here
    cache_gguf_tokenizer(model_path)
    keep_torch_out_where_the_tokenizer_allows(model_path)  # not where the cache cannot be written


def _launch_single_worker_server(server_args: ServerArgs) -> None:
    started = time.perf_counter()
    backend = Backend(server_args, PortArgs.create())
    state = ServerState(server_args)

    @asynccontextmanager
    async def lifespan(app):
        try:
            tm = await start_tokenizer_manager(server_args, backend)
        except (BackendError, TokenizerUnreadable) as e:
            # The back end said why it could not start, or the model's tokenizer files are
            # broken: that line, not a traceback, and exit 1.
            backend.shutdown()
            logger.error("%s", e)
            os._exit(1)
        except BaseException:
            backend.shutdown()
            raise
        state.serve_with(tm)
        logger.info(
            "ready in %.1f s on http://%s:%d", time.perf_counter() - started, server_args.host, server_args.port
        )
        yield
        backend.shutdown()

    app = create_app(state, lifespan=lifespan)
    try:
        serve_http(server_args, app)
    finally:
        backend.shutdown()


def _launch_worker_processes_server(server_args: ServerArgs) -> None:
    """HTTP in worker processes: N on one port with a MultiTokenizerRouter (seed 002), or
    one under Granian, which always serves from worker processes."""
    started = time.perf_counter()
    port_args = PortArgs.create()
    backend = Backend(server_args, port_args)
    try:
        try:
            scheduler_info = asyncio.run(_wait_for_backend_and_check_tokenizer_side(server_args, backend))
        except (BackendError, TokenizerUnreadable) as e:
            logger.error("%s", e)
            sys.exit(1)
        if server_args.tokenizer_worker_num > 1:
            # The router takes over the tokenizer inbox the back end reported to.
            backend.start(run_router_process, ROUTER_PROCESS)
        write_shared_args(server_args, port_args, scheduler_info)
        # Each worker records its requests' metrics in files here; a scrape sums them
        # (tokenizer/metrics.py). Set before the workers start: they read it at import.
        metrics_dir = os.path.join(port_args.ipc_dir, "metrics")
        os.makedirs(metrics_dir)
        os.environ[MULTIPROC_DIR_ENV] = metrics_dir
        threading.Thread(target=_report_dead_backend, args=(backend,), name="backend-watch", daemon=True).start()
        logger.info(
            "back end ready in %.1f s; starting %d HTTP workers",
            time.perf_counter() - started,
            server_args.tokenizer_worker_num,
        )
        serve_http(server_args, "sluice.server.worker:create_worker_app", workers=server_args.tokenizer_worker_num)
    finally:
        backend.shutdown()
        remove_shared_args(os.getpid())
    if backend.router_died:
        sys.exit(1)


# How long the failure sent to the HTTP workers when the router dies has to reach them.
ROUTER_DEATH_NOTICE_S = 1.0


def _report_dead_backend(backend: Backend) -> None:
    """With HTTP in worker processes, the main process watches the back end: a child that
    dies is reported to the tokenizer inbox (the router passes it to every worker), which
    fails in-flight requests and turns /health to 503. A dead router stops the server."""
    while (name := backend.dead_process()) is None:
        time.sleep(1.0)
    if backend.stopping:
        return
    if name == ROUTER_PROCESS and backend.exit_code(name) == 0:
        return  # it stopped for a SIGTERM to the whole process group, which this process gets too
    backend.log_death(name)
    failure = ProcessFailed(process=name, error=f"{name} died")
    if name == ROUTER_PROCESS:
        # It owned the inbox a failure would be reported to, and every request and reply
        # passed through it: no worker can serve. Each is told in its own inbox, so that its
        # requests fail now (they waited out the workers' --shutdown-timeout, then were cut without an
        # error), and the server stops, for a supervisor to restart.
        logger.error("the HTTP workers cannot reach the Scheduler without the router: stopping the server")
        backend.router_died = True
        context = zmq.Context(1)
        senders = [Sender(context, inbox) for inbox in backend.port_args.http_worker_inboxes()]
        for sender in senders:
            sender.send(failure)
        time.sleep(ROUTER_DEATH_NOTICE_S)
        os.kill(os.getpid(), signal.SIGTERM)
    else:
        senders = [Sender(zmq.Context(1), backend.port_args.tokenizer_input)]
        senders[0].send(failure)
    # The sockets do not linger: keep them open until the messages are surely delivered.
    while not backend.stopping:
        time.sleep(1.0)


async def _wait_for_backend_and_check_tokenizer_side(server_args: ServerArgs, backend: Backend) -> SchedulerReady:
    """The back end's ready report, once what each HTTP worker builds (tokenizer, chat
    template, image processor) was built here too, and dropped: a file that fails would fail
    every worker, and the process manager would start them again and again. The tokenizer
    loads while the model does (after it, it held the workers' start up by 2-3 s)."""
    tokenizer_side = asyncio.create_task(asyncio.to_thread(load_tokenizer_side, server_args))
    try:
        scheduler_info = await _wait_for_backend_ready(backend.port_args, backend)
    except BaseException:
        if tokenizer_side.done() and not tokenizer_side.cancelled():
            tokenizer_side.exception()  # the back end's failure is the one reported
        raise
    tokenizer, _ = await tokenizer_side
    await asyncio.to_thread(load_multimodal_processor, server_args, scheduler_info, tokenizer)
    return scheduler_info


async def _wait_for_backend_ready(port_args: PortArgs, backend: Backend) -> SchedulerReady:
    """Receive the back end's ready messages on the tokenizer inbox, then give it up."""
    context = zmq.asyncio.Context(1)
    inbox = AsyncReceiver(context, port_args.tokenizer_input)
    try:
        return await wait_for_backend(inbox, dead_process=backend.dead_while_starting)
    finally:
        inbox.close()
        context.term()


class Engine:
    """sluice without HTTP: the same TokenizerManager → Scheduler → Detokenizer path.

    `Engine(model_path=...).generate(prompts, sampling_params)` blocks; `async_generate`
    is its coroutine twin. The event loop runs on a private thread.
    """

    def __init__(self, **kwargs: Any):
        self.server_args = ServerArgs(**kwargs)
        self.backend = Backend(self.server_args, PortArgs.create())
        self._token_texts = TokenTexts()  # logprobs' token texts (return_text_in_logprobs)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sluice-engine", daemon=True)
        self._thread.start()
        try:
            self.tokenizer_manager = self._run(start_tokenizer_manager(self.server_args, self.backend))
        except BaseException:
            self.shutdown()
            raise

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def generate(self, prompts, sampling_params: dict | list[dict] | None = None, **fields: Any):
        """What POST /generate answers, without HTTP.

        `prompts` is a text or a list of token ids, or a list of either: a batch, sent like
        /generate's (one BatchTokenizedGenerateReqInput where it can be). `sampling_params`
        is one dict or one per prompt; `n` in it samples each prompt n times. `fields` are
        /generate's other fields (`rid`, `return_logprob`, `top_logprobs_num`,
        `logprob_start_len`, `return_text_in_logprobs`, `image_data`). Returns /generate's
        JSON: one result for one prompt with n = 1, else a list in input order, each with
        `index` (prompt_index * n + sample_index). A request the server refuses raises
        ClientError (what /generate answers with 400) or BackendError (503).
        """
        return self._run(self._generate(prompts, sampling_params, fields))

    async def async_generate(self, prompts, sampling_params: dict | list[dict] | None = None, **fields: Any):
        future = asyncio.run_coroutine_threadsafe(self._generate(prompts, sampling_params, fields), self._loop)
        return await asyncio.wrap_future(future)

    async def _generate(
        self, prompts, sampling_params, fields: dict[str, Any]
    ) -> dict[str, Any] | list[dict[str, Any]]:
        obj = _generate_req_input(prompts, sampling_params, fields)
        chunks = [chunk async for chunk in self.tokenizer_manager.generate_request(obj)]
        one = obj.is_single and obj.sample_count() == 1
        chunks.sort(key=lambda chunk: chunk.index or 0)
        for chunk in chunks:
            if status_code := failure_status(chunk):
                message = chunk.finish_reason.message if one else f"item {chunk.index}: {chunk.finish_reason.message}"
                raise ClientError(message) if status_code < 500 else BackendError(message)
        token_text = None
        if obj.return_text_in_logprobs:
            token_text = self._token_texts
            token_text.bind(self.tokenizer_manager.tokenizer)
        results = [native_json(chunk, token_text) for chunk in chunks]
        return results[0] if one else results

    def shutdown(self) -> None:
        self.backend.shutdown()
        if self._loop.is_running():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._stop_tasks(), self._loop).result(ENGINE_STOP_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(ENGINE_STOP_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    async def _stop_tasks(self) -> None:
        """Cancel the loop's tasks (handle_loop, the back-end watch) and wait for them, so none
        is destroyed pending; then close the sockets, which would keep the interpreter alive."""
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        tm = getattr(self, "tokenizer_manager", None)
        if tm is not None:
            tm.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _generate_req_input(prompts, sampling_params, fields: dict[str, Any]) -> GenerateReqInput:
    """The /generate body for Engine.generate's arguments, type-checked as /generate checks it."""
    if "stream" in fields:
        raise TypeError("Engine.generate returns whole results: it takes no 'stream'")
    texts = isinstance(prompts, str) or (
        isinstance(prompts, list | tuple) and bool(prompts) and isinstance(prompts[0], str)
    )
    body = {"text" if texts else "input_ids": prompts, "sampling_params": sampling_params, **fields}
    try:
        return msgspec.convert(body, GenerateReqInput)
    except msgspec.ValidationError as e:
        raise ClientError(f"invalid request: {e}") from None
