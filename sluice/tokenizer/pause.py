"""/pause_generation's gate: while paused, a worker holds each new request before it
takes any room, and lets them all go on /continue_generation."""

from __future__ import annotations

import asyncio

from sluice.messages import SetPause
from sluice.sampling import ClientError
from sluice.tokenizer.control import ControlChannel
from sluice.tokenizer.req_state import DISCONNECT_POLL_S, ClientConnection


class PauseGate:
    """`control`: the channel to the MultiTokenizerRouter where this is one of several HTTP
    workers, None where it is the only one."""

    def __init__(self, control: ControlChannel | None) -> None:
        self.paused = False
        self.num_held = 0  # requests waiting for generation to continue
        self._changed = asyncio.Condition()
        self._control = control

    async def set_everywhere(self, paused: bool) -> None:
        """Here, then through the router; returns once the router sent it to every other
        worker (it sends this worker's copy last), so a request that any worker takes after
        the route answered sees the change."""
        await self.set(paused)
        if self._control is not None:
            await self._control.call(SetPause(paused=paused), SetPause)

    async def set(self, paused: bool) -> None:
        async with self._changed:
            self.paused = paused
            self._changed.notify_all()

    async def wait_while_paused(self, request: ClientConnection | None) -> None:
        """Hold a new request while paused; one whose client leaves meanwhile ends here (a
        ClientError no one reads). The lock is held only while waiting on the gate, never
        while asking the connection."""
        if not self.paused:
            return
        self.num_held += 1
        try:
            while True:
                async with self._changed:
                    try:
                        await asyncio.wait_for(self._changed.wait_for(lambda: not self.paused), DISCONNECT_POLL_S)
                        return
                    except TimeoutError:
                        pass
                if request is not None and await request.is_disconnected():
                    raise ClientError("the client left while the server was paused")
        finally:
            self.num_held -= 1
