"""/pause_generation's gate: while paused, a worker holds each new request before it
takes any room, and lets them all go on /continue_generation. /abort_request reaches held
requests here (they are not at the Scheduler yet): each one it names ends at the gate."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
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
        self._held: list[_Held] = []  # requests waiting for generation to continue
        self._changed = asyncio.Condition()
        self._control = control

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

    async def wait_while_paused(self, request: ClientConnection | None, rids: Iterable[str] = ()) -> bool:
        """Hold a new request (client rids `rids`) while paused; True if an abort named it
        meanwhile. One whose client leaves meanwhile ends here (a ClientError no one reads).
        The lock is held only while waiting on the gate, never while asking the connection."""
        if not self.paused:
            return False
        held = _Held(frozenset(rids))
        self._held.append(held)
        try:
            while True:
                async with self._changed:
                    try:
                        await asyncio.wait_for(
                            self._changed.wait_for(lambda: not self.paused or held.aborted), DISCONNECT_POLL_S
                        )
                        return held.aborted
                    except TimeoutError:
                        pass
                if request is not None and await request.is_disconnected():
                    raise ClientError("the client left while the server was paused")
        finally:
            self._held.remove(held)


def client_rids(obj: GenerateReqInput | EmbeddingReqInput) -> list[str]:
    """The rids a client gave (or normalize() filled in): what /abort_request can name."""
    if obj.rid is None:
        return []
    return [obj.rid] if isinstance(obj.rid, str) else list(obj.rid)


def aborted_while_held(obj: GenerateReqInput | EmbeddingReqInput, n: int, path: str) -> list[GenerateChunk]:
    """The final chunk of each item (each sample, n > 1) of a request an abort ended at the
    gate, as the Scheduler ends a request aborted before it ran."""
    size = 1 if obj.is_single else len(obj.text if obj.text is not None else obj.input_ids or [])
    rids = client_rids(obj) or [""] * size
    reason = FinishReason(type="abort", message="aborted while the server was paused")
    return_logprob = isinstance(obj, GenerateReqInput) and obj.return_logprob
    return [
        GenerateChunk(
            rid=rids[i] if n == 1 else f"{rids[i]}{RID_SEPARATOR}{j}",
            path=path,
            index=None if path in ("single", "embedding") and obj.is_single else i * n + j,
            text="",
            output_ids=[],
            finish_reason=reason,
            return_logprob=return_logprob,
        )
        for i in range(size)
        for j in range(n)
    ]
