"""The gate in front of the request path. A worker holds each new request here, before it
takes any room, while /pause_generation pauses the server or while one of this worker's
weight updates runs, and lets them go when both are over. /abort_request reaches held
requests here (they are not at the Scheduler yet): each one it names ends at the gate."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from sluice.messages import RID_SEPARATOR, FinishReason, SetPause
from sluice.sampling import ClientError
from sluice.tokenizer.control import ControlChannel
from sluice.tokenizer.io_struct import EmbeddingReqInput, GenerateReqInput
from sluice.tokenizer.req_state import DISCONNECT_POLL_S, ClientConnection
from sluice.tokenizer.result import GenerateChunk


@dataclass(eq=False)
class _Held:
    rids: frozenset[str]  # the client's rids of the request (an item's, for a batch)
    aborted: bool = False


class PauseGate:
    """`control`: the channel to the MultiTokenizerRouter where this is one of several HTTP
    workers, None where it is the only one."""

    def __init__(self, control: ControlChannel | None) -> None:
        self.paused = False
        self._updates = 0  # this worker's weight updates under way
        self._held: list[_Held] = []  # requests waiting at the gate
        self._changed = asyncio.Condition()
        self._control = control

    @property
    def closed_for(self) -> str | None:
        """Why new requests wait here: "paused", "updating_weights", or None (open)."""
        return "paused" if self.paused else "updating_weights" if self._updates else None

    @property
    def closed(self) -> bool:
        return self.closed_for is not None

    async def set_everywhere(self, paused: bool) -> None:
        """Here, then through the router; returns once the router sent it to every other
        worker (it sends this worker's copy last), so a request that any worker takes after
        the route answered sees the change."""
        await self.set(paused)
        if self._control is not None:
            await self._control.call(SetPause(paused=paused), SetPause)

    @property
    def num_held(self) -> int:
        return len(self._held)

    def abort(self, rid: str, abort_all: bool = False) -> None:
        """/abort_request (here, or on another worker: the router passes it on) ends each
        held request it names, or every held one."""
        hit = [held for held in self._held if abort_all or rid in held.rids]
        for held in hit:
            held.aborted = True
        if hit:
            asyncio.get_running_loop().create_task(self._wake_all())

    async def _wake_all(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def set(self, paused: bool) -> None:
        async with self._changed:
            self.paused = paused
            self._changed.notify_all()

    def set_now(self, paused: bool) -> None:
        """`set` for a message handler: the state changes at once, in the order the messages
        came (a pause and a continue queued back to back end continued); waiters wake soon."""
        self.paused = paused
        asyncio.get_running_loop().create_task(self._wake_all())

    @asynccontextmanager
    async def closed_for_update(self) -> AsyncIterator[None]:
        """Hold this worker's new requests while a weight update waits for the running ones
        and loads: held here they can be aborted, count against the queue, and end if their
        client leaves."""
        self._updates += 1
        try:
            yield
        finally:
            self._updates -= 1  # before any wait: a cancelled update must not leave the gate shut
            await self._wake_all()

    async def wait_while_closed(self, request: ClientConnection | None, rids: Iterable[str] = ()) -> bool:
        """Hold a new request (client rids `rids`) while the gate is closed; True if an abort
        named it meanwhile. One whose client leaves meanwhile ends here (a ClientError no one
        reads). The lock is held only while waiting on the gate, never while asking the
        connection."""
        if not self.closed:
            return False
        held = _Held(frozenset(rids))
        self._held.append(held)
        try:
            while True:
                async with self._changed:
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: not self.closed or held.aborted), DISCONNECT_POLL_S
                        )
                        return held.aborted
                    except TimeoutError:
                        pass
                if request is not None and await request.is_disconnected():
                    raise ClientError("the client left while the server held its request")
        finally:
            self._held.remove(held)


def client_rids(obj: GenerateReqInput | EmbeddingReqInput) -> list[str]:
    """The rids a client gave (or normalize() filled in): what /abort_request can name."""
    if obj.rid is None:
        return []
    return [obj.rid] if isinstance(obj.rid, str) else list(obj.rid)


def held_items(obj: GenerateReqInput | EmbeddingReqInput, n: int = 1) -> int:
    """How many requests the gate held for `obj`: each prompt's `n` samples."""
    return n * _prompt_count(obj)


def _prompt_count(obj: GenerateReqInput | EmbeddingReqInput) -> int:
    return 1 if obj.is_single else len(obj.text if obj.text is not None else obj.input_ids or [])


def aborted_while_held(
    obj: GenerateReqInput | EmbeddingReqInput, n: int = 1, received_at: float | None = None
) -> list[GenerateChunk]:
    """The final chunk of each item (each of its `n` samples) of a request an abort ended
    at the gate, as the Scheduler ends a request aborted before it ran; its e2e_latency is
    the time it waited since `received_at` (time.time())."""
    waited = 0.0 if received_at is None else max(time.time() - received_at, 0.0)
    size = _prompt_count(obj)
    rids = client_rids(obj) or [""] * size
    reason = FinishReason(type="abort", message="aborted while the server held it (paused or updating weights)")
    if isinstance(obj, EmbeddingReqInput):
        path = "embedding"
    else:
        path = "parallel_sample" if n > 1 else "single" if obj.is_single else "batch"
    return [
        GenerateChunk(
            rid=rids[i] if n == 1 else f"{rids[i]}{RID_SEPARATOR}{j}",
            path=path,
            index=None if path in ("single", "embedding") and obj.is_single else i * n + j,
            text="",
            output_ids=[],
            finish_reason=reason,
            return_logprob=isinstance(obj, GenerateReqInput) and obj.logprob_params(None if obj.is_single else i)[0],
            e2e_latency=waited,
        )
        for i in range(size)
        for j in range(n)
    ]
