"""Server-sent events: one `data: {json}` event per chunk, then `data: [DONE]`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec

from sluice.server.errors import failure_status
from sluice.tokenizer.result import GenerateChunk, NativeStream


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def sse_stream(first: GenerateChunk, rest: AsyncIterator[GenerateChunk]) -> AsyncIterator[bytes]:
    """The native /generate stream. A back-end failure mid-stream is sent as an error event."""
    async def chunks():
        yield first
        async for chunk in rest:
            yield chunk

    native = NativeStream()
    async for chunk in chunks():
        status_code = failure_status(chunk)
        if status_code:
            message = chunk.finish_reason.message
            yield sse_event({"error": {"message": message, "code": status_code}})
        else:
            yield sse_event(native.add(chunk))
    yield SSE_DONE
