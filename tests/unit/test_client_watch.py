"""ClientWatch: a departed client is seen at the first poll after it left, on a receive
channel that always waits before it answers (as Granian's does)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from sluice.server.client_watch import ClientWatch


def waiting_channel() -> tuple[Request, asyncio.Event]:
    """A request whose receive channel, like Granian's, yields to the loop on every call and
    answers http.disconnect once `left` is set."""
    left = asyncio.Event()

    async def receive() -> dict:
        await asyncio.sleep(0)
        await left.wait()
        return {"type": "http.disconnect"}

    return Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive), left


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_a_departure_is_seen_at_the_next_poll():
    request, left = waiting_channel()
    watch = ClientWatch(request)
    await settle()
    assert not await watch.is_disconnected()
    left.set()
    await settle()
    assert await watch.is_disconnected()


async def test_starlette_alone_misses_it_on_such_a_channel():
    """Why the watch exists: Request.is_disconnected takes only a message ready at once."""
    request, left = waiting_channel()
    left.set()
    await settle()
    assert not await request.is_disconnected()


async def test_a_channel_that_fails_counts_as_gone():
    async def receive() -> dict:
        raise OSError("connection reset")

    watch = ClientWatch(Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive))
    await settle()
    assert await watch.is_disconnected()


async def test_body_messages_before_the_end_are_passed_over():
    messages = [{"type": "http.request", "body": b"", "more_body": False}, {"type": "http.disconnect"}]

    async def receive() -> dict:
        await asyncio.sleep(0)
        return messages.pop(0)

    watch = ClientWatch(Request({"type": "http", "method": "POST", "path": "/", "headers": []}, receive))
    await settle()
    assert await watch.is_disconnected()
    assert not messages
