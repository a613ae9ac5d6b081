"""Streaming responses, and the one rule for errors on them, which both the native and
the OpenAI routes follow.

The status line waits for the first chunk. A request that fails before it (a client
error, a refusal by the Scheduler such as a multimodal prompt too long after expanding its
image tokens, a back end that is gone) is answered with its real status and the error
envelope, like a non-streaming request. Once the first chunk is out, the status is 200: a
failure after it ends the stream with one event carrying the same envelope (with the type
of its status), then `data: [DONE]`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import msgspec
from fastapi.responses import Response, StreamingResponse

from sluice.server.errors import error_body, error_response, failure_param, failure_response, failure_status
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.result import GenerateChunk

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: Any) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


class StreamFormat(Protocol):
    """How one API writes a request's chunks as events."""

    def stream_start(self) -> list[Any]:
        """Events sent before the first chunk's own."""

    def stream_chunk(self, chunk: GenerateChunk) -> list[Any]:
        """The events of one chunk (none when it brings nothing new)."""

    def error_message(self, chunk: GenerateChunk) -> str:
        """The message of a chunk that failed."""


async def stream_response(
    chunks: AsyncGenerator[GenerateChunk, None], stream_format: StreamFormat, names: dict[str, str] | None = None
) -> Response:
    """Errors raised before the first chunk (ClientError, BackendError) propagate to the
    caller and the app's handlers; a first chunk that failed is answered with its status.
    `names`: the route's names of native fields, for an error's param."""
    first = await anext(chunks, None)
    if first is None:
        return error_response(400, "the client disconnected")  # no one reads this
    if failure_status(first):
        await chunks.aclose()  # frees the other items of a batch, and the request's lock
        return failure_response(first, stream_format.error_message(first), names)
    return StreamingResponse(_events(first, chunks, stream_format, names), media_type="text/event-stream")


async def _events(
    first: GenerateChunk,
    rest: AsyncGenerator[GenerateChunk, None],
    stream_format: StreamFormat,
    names: dict[str, str] | None,
) -> AsyncIterator[bytes]:
    try:
        for payload in stream_format.stream_start():
            yield sse_event(payload)
        chunk: GenerateChunk | None = first
        while chunk is not None:
            if status_code := failure_status(chunk):
                message = stream_format.error_message(chunk)
                yield sse_event(error_body(status_code, message, failure_param(chunk, names)))
                break
            for payload in stream_format.stream_chunk(chunk):
                yield sse_event(payload)
            chunk = await anext(rest, None)
    except BackendError as e:
        yield sse_event(error_body(503, str(e)))
    except Exception:
        logger.exception("a stream failed")
        yield sse_event(error_body(500, "internal server error"))
    finally:
        await rest.aclose()  # aborts the request when the client went away mid-stream
    yield SSE_DONE
