"""Whether an HTTP request's client went away, for the request path's polls (a request held
by a pause, a request waiting for its output: ClientConnection).

A task waits on the request's ASGI receive channel from the moment the route has read the
body, and ends with the `http.disconnect` message, which the server sends when the client
leaves or when the response is complete (uvicorn and Granian both), so the task never
outlives its request. Starlette's `Request.is_disconnected` only takes a message the server
has ready without waiting, and Granian's channel always waits: there a client that left was
seen several polls late or not at all, and its request ran.
"""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request


class ClientWatch:
    def __init__(self, request: Request) -> None:
        self._left = asyncio.get_running_loop().create_task(self._wait_for_disconnect(request))

    @staticmethod
    async def _wait_for_disconnect(request: Request) -> None:
        # A channel that fails is a connection gone too.
        with contextlib.suppress(Exception):
            while (await request.receive())["type"] != "http.disconnect":
                pass

    async def is_disconnected(self) -> bool:
        return self._left.done()
