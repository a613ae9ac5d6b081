"""Every error a client sees, in one shape (the OpenAI envelope) and mapped in one place."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from sluice.sampling import ClientError
from sluice.server.api_types import ErrorDetail, ErrorResponse
from sluice.tokenizer.admission import ServerBusy
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.result import GenerateChunk

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    413: "RequestTooLarge",
    415: "UnsupportedMediaType",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}


def error_body(status_code: int, message: str, param: str | None = None) -> dict:
    """The envelope of every error: a response body, or the payload of a stream's error event."""
    error_type = _TYPES.get(status_code, "BadRequestError" if status_code < 500 else "InternalServerError")
    return msgspec.to_builtins(
        ErrorResponse(error=ErrorDetail(message=message, type=error_type, param=param, code=status_code))
    )


# What a 503 for the server's load (a full queue) tells a client to wait before retrying.
RETRY_AFTER_S = 1


def error_response(
    status_code: int, message: str, param: str | None = None, retry_after: int | None = None
) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(error_body(status_code, message, param), status_code=status_code, headers=headers)


# The two readers of a failed result: keep them the only places that know its shape.


def failure_status(chunk: GenerateChunk) -> int | None:
    """The HTTP status of a request the back end refused or lost (not a client's abort)."""
    reason = chunk.finish_reason
    return reason.status_code if reason is not None and reason.type == "abort" else None


async def finals_until_failure(
    chunks: AsyncGenerator[GenerateChunk, None],
) -> tuple[list[GenerateChunk], GenerateChunk | None]:
    """The final chunks of a request's items as they come, or, at the first whose item
    failed, those so far and it: the generator is closed then, which aborts the other items
    rather than running them on for an answer that will be the failure's."""
    finals: list[GenerateChunk] = []
    async for chunk in chunks:
        if failure_status(chunk):
            await chunks.aclose()
            return finals, chunk
        finals.append(chunk)
    return finals, None


def failure_message(chunk: GenerateChunk) -> str:
    """Why a chunk that `failure_status` flags failed."""
    reason = chunk.finish_reason
    return reason.message if reason is not None and reason.message is not None else "the request failed"


def failure_response(chunk: GenerateChunk, message: str, names: dict[str, str] | None = None) -> JSONResponse:
    """The answer to a request whose chunk `failure_status` flags, worded by `message`; a
    refusal for the server's load says when to retry."""
    reason = chunk.finish_reason
    retry_after = RETRY_AFTER_S if reason is not None and reason.rejected is not None else None
    return error_response(failure_status(chunk) or 500, message, failure_param(chunk, names), retry_after)


def failure_param(chunk: GenerateChunk, names: dict[str, str] | None = None) -> str | None:
    """The field a failed chunk's refusal is about, in the route's own names (`names`: native
    name to the route's, as the OpenAI routes call them)."""
    reason = chunk.finish_reason
    param = reason.param if reason is not None else None
    return (names or {}).get(param, param) if param is not None else None


class BodyTooLarge(Exception):
    """Raised while the body is read: a chunked body has no content-length to check up front."""


class NotFoundError(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError):
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(NotFoundError)
    async def _not_found(request: Request, exc: NotFoundError):
        return error_response(404, exc.message, exc.param)

    @app.exception_handler(ServerBusy)
    async def _busy(request: Request, exc: ServerBusy):
        return error_response(503, str(exc), retry_after=RETRY_AFTER_S)

    @app.exception_handler(BackendError)
    async def _backend_error(request: Request, exc: BackendError):
        return error_response(503, str(exc))

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge):
        return error_response(413, str(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return error_response(400, message, loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect):
        # The client closed the connection before its whole body came: not the server's error.
        logger.info("a client of %s left while sending its request", request.url.path)
        return error_response(400, "the client disconnected while sending its request")  # no one reads this

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        logger.error("unexpected error on %s", request.url.path, exc_info=exc)
        return error_response(500, "internal server error")
