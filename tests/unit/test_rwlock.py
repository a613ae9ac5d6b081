"""RWLock, the lock between requests (readers) and weight updates or cache flushes (a
writer): the writer waits for the readers to drain, and no reader enters while a writer
holds the lock or waits for it. Ordering is driven by events; no test sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from sluice.tokenizer.rwlock import RWLock


async def settle(done: Callable[[], bool]) -> None:
    """Let the other tasks run until `done()`; they only wait on each other, so a bounded
    number of passes through the event loop is enough."""
    for _ in range(100):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError("the tasks never got there")


async def stay_blocked(task: asyncio.Task) -> None:
    """Give `task` every chance to run; it must still be waiting."""
    for _ in range(100):
        await asyncio.sleep(0)
    assert not task.done()


class Holder:
    """A task that takes the lock, records that it is inside, and leaves when told."""

    def __init__(self, lock_context) -> None:
        self.inside = asyncio.Event()
        self.leave = asyncio.Event()
        self.task = asyncio.create_task(self._run(lock_context))

    async def _run(self, lock_context) -> None:
        async with lock_context:
            self.inside.set()
            await self.leave.wait()


async def test_readers_share_the_lock():
    lock = RWLock()
    readers = [Holder(lock.reader_lock()) for _ in range(3)]
    await settle(lambda: all(r.inside.is_set() for r in readers))
    for reader in readers:
        reader.leave.set()
    await asyncio.gather(*(r.task for r in readers))


async def test_a_writer_waits_for_every_reader_to_leave():
    lock = RWLock()
    first, second = Holder(lock.reader_lock()), Holder(lock.reader_lock())
    await settle(lambda: first.inside.is_set() and second.inside.is_set())
    writer = Holder(lock.writer_lock())
    await stay_blocked(writer.task)
    first.leave.set()
    await first.task
    await stay_blocked(writer.task)
    assert not writer.inside.is_set()
    second.leave.set()
    await settle(writer.inside.is_set)
    writer.leave.set()
    await asyncio.gather(second.task, writer.task)


async def test_readers_wait_for_a_writer_inside():
    lock = RWLock()
    writer = Holder(lock.writer_lock())
    await settle(writer.inside.is_set)
    reader = Holder(lock.reader_lock())
    await stay_blocked(reader.task)
    assert not reader.inside.is_set()
    writer.leave.set()
    await settle(reader.inside.is_set)
    reader.leave.set()
    await asyncio.gather(writer.task, reader.task)


async def test_a_waiting_writer_holds_back_new_readers():
    """Otherwise a steady stream of requests would starve a weight update forever."""
    lock = RWLock()
    early = Holder(lock.reader_lock())
    await settle(early.inside.is_set)
    writer = Holder(lock.writer_lock())
    await stay_blocked(writer.task)
    late = Holder(lock.reader_lock())
    await stay_blocked(late.task)
    assert not late.inside.is_set()
    early.leave.set()
    await settle(writer.inside.is_set)
    assert not late.inside.is_set()
    writer.leave.set()
    await settle(late.inside.is_set)
    late.leave.set()
    await asyncio.gather(early.task, writer.task, late.task)


async def test_writers_take_turns():
    lock = RWLock()
    first = Holder(lock.writer_lock())
    await settle(first.inside.is_set)
    second = Holder(lock.writer_lock())
    await stay_blocked(second.task)
    first.leave.set()
    await settle(second.inside.is_set)
    second.leave.set()
    await asyncio.gather(first.task, second.task)


@pytest.mark.parametrize("side", ["reader", "writer"])
async def test_an_error_inside_releases_the_lock(side):
    lock = RWLock()
    with pytest.raises(RuntimeError):
        async with lock.reader_lock() if side == "reader" else lock.writer_lock():
            raise RuntimeError("the request failed")
    # The other side gets in at once.
    other = Holder(lock.writer_lock() if side == "reader" else lock.reader_lock())
    await settle(other.inside.is_set)
    other.leave.set()
    await other.task


async def test_a_cancelled_reader_releases_the_lock():
    """A client that disconnects cancels its request mid-read."""
    lock = RWLock()
    reader = Holder(lock.reader_lock())
    await settle(reader.inside.is_set)
    reader.task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await reader.task
    writer = Holder(lock.writer_lock())
    await settle(writer.inside.is_set)
    writer.leave.set()
    await writer.task
