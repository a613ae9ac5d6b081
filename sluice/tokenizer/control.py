"""The back end as a TokenizerManager talks to it: wait for it to start, and control calls
(send a request to the Scheduler, through the router if any, and wait for its reply). A
request with a `control_id` field gets a fresh id that its reply repeats, so a reply finds
its own call even after an earlier call timed out (a gather's several replies too, each worker's
stats); other replies (a pause echoed back) go to the oldest waiter of their type."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TypeVar

from sluice.ipc import AsyncReceiver
from sluice.messages import DetokenizerReady, Message, ProcessFailed, SchedulerReady

logger = logging.getLogger(__name__)

Reply = TypeVar("Reply", bound=Message)


class BackendError(RuntimeError):
    """The Scheduler or DetokenizerManager is gone or not answering."""


BACKEND_POLL_S = 1.0  # how often a start-up wait looks whether a back-end process died


async def wait_for_backend(
    inbox: AsyncReceiver, timeout_s: float = 600.0, dead_process: Callable[[], str | None] = lambda: None
) -> SchedulerReady:
    """Wait on the tokenizer inbox until the Scheduler and DetokenizerManager report ready;
    BackendError when one reports it failed, `dead_process()` says how one died without a
    word (killed for memory while loading, say), or the time runs out."""
    info: SchedulerReady | None = None
    detokenizer_ready = False
    deadline = time.monotonic() + timeout_s
    while info is None or not detokenizer_ready:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BackendError(f"the back end did not become ready in {timeout_s:.0f} s")
        message = await inbox.recv_within(min(remaining, BACKEND_POLL_S))
        if message is None:
            if (dead := dead_process()) is not None:
                raise BackendError(f"while starting, the {dead}")
            continue
        if isinstance(message, SchedulerReady):
            info = message
        elif isinstance(message, DetokenizerReady):
            detokenizer_ready = True
        elif isinstance(message, ProcessFailed):
            separator = "\n" if "\n" in message.error else " "  # a traceback, or one line saying why
            raise BackendError(f"the {message.process} failed to start:{separator}{message.error}")
    return info


class ControlChannel:
    def __init__(self, send: Callable[[Message], None]) -> None:
        self._send = send
        self._waiters: dict[type[Message], deque[asyncio.Future[Message]]] = {}
        self._by_id: dict[int, asyncio.Future[Message]] = {}
        self._gathering: dict[int, list[asyncio.Future[Message]]] = {}  # a gather's unanswered futures
        self._ids = itertools.count(1)
        self._failed: str | None = None  # why the back end is gone, once it is

    async def call(self, request: Message, reply_type: type[Reply], timeout_s: float = 30.0) -> Reply:
        """Send `request`; its reply, or a BackendError when none comes within `timeout_s`
        (at once when the back end is gone: no reply would come)."""
        if self._failed is not None:
            raise BackendError(self._failed)
        if hasattr(request, "control_id"):
            request.control_id = control_id = next(self._ids)
            future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
            self._by_id[control_id] = future
        else:
            future = self._expect(reply_type, 1)[0]
        self._send(request)
        try:
            reply = await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise BackendError(f"the scheduler did not answer a {type(request).__name__} in {timeout_s} s") from None
        finally:
            self._by_id.pop(getattr(request, "control_id", 0), None)
        if not isinstance(reply, reply_type):  # deliver() hands each waiter its own type
            raise BackendError(f"the scheduler answered a {type(request).__name__} with a {type(reply).__name__}")
        return reply

    async def gather(self, request: Message, reply_type: type[Reply], count: int, timeout_s: float) -> list[Reply]:
        """Send `request` (with a fresh control_id), which `count` processes answer with it;
        the replies that came in time (a late one goes to no later gather)."""
        if self._failed is not None:
            raise BackendError(self._failed)
        request.control_id = control_id = next(self._ids)  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Message]] = [loop.create_future() for _ in range(count)]
        self._gathering[control_id] = list(futures)
        self._send(request)
        try:
            done, pending = await asyncio.wait(futures, timeout=timeout_s)
        finally:
            self._gathering.pop(control_id, None)
        for future in pending:
            future.cancel()
        return [reply for future in done if isinstance(reply := future.result(), reply_type)]

    def deliver(self, reply: Message) -> None:
        """A reply came: to the call with its control_id, else to the oldest waiter for its type."""
        control_id = getattr(reply, "control_id", 0)
        if control_id and (gathering := self._gathering.get(control_id)):
            gathering.pop().set_result(reply)
            if not gathering:
                del self._gathering[control_id]
            return
        if control_id:
            future = self._by_id.pop(control_id, None)
            if future is not None and not future.done():
                future.set_result(reply)
            else:
                logger.warning("a %s came after its call ended", type(reply).__name__)
            return
        waiters = self._waiters.get(type(reply))
        while waiters:
            future = waiters.popleft()
            if not future.done():
                future.set_result(reply)
                return
        logger.warning("no one waits for a %s", type(reply).__name__)

    def fail_all(self, reason: str) -> None:
        """The back end is gone: every waiting call, and every later one, raises
        BackendError(reason)."""
        self._failed = reason
        for future in self._by_id.values():
            if not future.done():
                future.set_exception(BackendError(reason))
        self._by_id.clear()
        for futures in self._gathering.values():
            for future in futures:
                if not future.done():
                    future.set_exception(BackendError(reason))
        self._gathering.clear()
        for waiters in self._waiters.values():
            for future in waiters:
                if not future.done():
                    future.set_exception(BackendError(reason))
            waiters.clear()

    def _expect(self, reply_type: type[Message], count: int) -> list[asyncio.Future[Message]]:
        loop = asyncio.get_running_loop()
        futures: list[asyncio.Future[Message]] = [loop.create_future() for _ in range(count)]
        self._waiters.setdefault(reply_type, deque()).extend(futures)
        return futures
