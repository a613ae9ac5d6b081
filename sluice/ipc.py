"""ZMQ sockets between sluice's processes and the one wire format (msgpack via msgspec)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from sluice.messages import AnyMessage, Message

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)


LAST_WORDS_MS = 5000  # how long a dying process lets its failure report take to leave


def _connect(sock: zmq.Socket[Any], kind: int, address: str, bind: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.PUSH:
        sock.setsockopt(zmq.SNDHWM, 0)
    else:
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)


class Receiver:
    """The PULL end a process binds as its inbox."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.PULL)
        _connect(self.sock, zmq.PULL, address, bind=True)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        return decode(self.sock.recv())

    def recv_nowait(self) -> Message | None:
        try:
            return decode(self.sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return None

    def drain(self) -> list[Message]:
        messages: list[Message] = []
        while (message := self.recv_nowait()) is not None:
            messages.append(message)
        return messages

    def recv_burst(self, timeout_ms: int, gap_ms: float, limit_ms: float) -> list[Message]:
        """Waits up to timeout_ms for a message, then also takes the ones that follow it less
        than gap_ms apart, for at most limit_ms after the first ([] if none came)."""
        first = self.recv(timeout_ms=timeout_ms)
        if first is None:
            return []
        messages = [first, *self.drain()]
        deadline = time.monotonic() + limit_ms / 1000
        while (left_ms := (deadline - time.monotonic()) * 1000) > 0 and self.sock.poll(math.ceil(min(gap_ms, left_ms))):
            messages += self.drain()
        return messages

    def close(self) -> None:
        self.sock.close()


class Sender:
    """A PUSH socket connected to another process's inbox."""

    def __init__(self, context: zmq.Context[Any], address: str) -> None:
        self.sock: zmq.Socket[bytes] = context.socket(zmq.PUSH)
        _connect(self.sock, zmq.PUSH, address, bind=False)

    def send(self, message: Message) -> None:
        self.sock.send(encode(message))

    def close(self, linger_ms: int = 0) -> None:
        """linger_ms: how long what is still queued may take to leave (a process's last words)."""
        self.sock.close(linger=linger_ms)


class AsyncReceiver:
    def __init__(self, context: zmq.asyncio.Context, address: str) -> None:
        self.sock: zmq.asyncio.Socket = context.socket(zmq.PULL)
        _connect(self.sock, zmq.PULL, address, bind=True)

    async def recv(self) -> Message:
        return decode(await self.sock.recv())

    async def recv_within(self, timeout_s: float) -> Message | None:
        """The next message, or None when none comes in `timeout_s` (no message is lost: it
        polls, then receives, rather than cancel a receive)."""
        if not await self.sock.poll(int(timeout_s * 1000)):  # POLLIN
            return None
        return decode(await self.sock.recv())

    def close(self) -> None:
        self.sock.close()


def dispatch_forever(
    inbox: Receiver, dispatch: Callable[[Message], None], every_s: float, periodic: Callable[[], None]
) -> None:
    """Hand each message of `inbox` to `dispatch`; call `periodic` every `every_s` seconds,
    whether messages come or not (a hub's loop: the router's, the DataParallelController's)."""
    last_check = time.monotonic()
    while True:
        message = inbox.recv(timeout_ms=int(every_s * 1000))
        if message is not None:
            dispatch(message)
        if time.monotonic() - last_check > every_s:
            periodic()
            last_check = time.monotonic()
