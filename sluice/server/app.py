"""The FastAPI app: native routes, health, admin routes; the OpenAI routes are in openai_api."""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluice.sampling import ClientError
from sluice.server.guard import RequestGuard
from sluice.server.errors import error_response, failure_status, install_error_handlers
from sluice.server.sse import sse_stream
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import BackendError, TokenizerManager
from sluice.tokenizer.result import GenerateChunk, native_json

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0


class ServerState:
    """What the routes share: the TokenizerManager (once started) and whether warm-up finished."""

    def __init__(self, server_args, tokenizer_manager: TokenizerManager | None = None):
        self.server_args = server_args
        self.model_name = server_args.model_name()
        self.tm = tokenizer_manager
        self.ready = tokenizer_manager is not None

    def unavailable(self) -> str | None:
        if not self.ready:
            return "the server is starting"
        return self.tm.backend_error or self.tm.health_error


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="sluice", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    args = state.server_args

    app.add_middleware(RequestGuard, max_body_bytes=args.max_request_body_bytes, api_key=args.api_key,
                       admin_api_key=args.admin_api_key)

    @app.get("/health")
    async def health():
        if reason := state.unavailable():
            return error_response(503, reason)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if reason := state.unavailable():
            return error_response(503, reason)
        # Its own rid, so the probe's state never mixes with a client's request.
        obj = GenerateReqInput(input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0},
                               rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
        try:
            await asyncio.wait_for(_last(state.tm.generate_request(obj)), HEALTH_GENERATE_TIMEOUT_S)
        except (asyncio.TimeoutError, BackendError) as e:
            return error_response(503, f"generation failed: {e or 'timed out'}")
        return Response(status_code=200)

    @app.post("/generate")
    async def generate(request: Request):
        obj = await decode_body(request, GenerateReqInput)
        return await serve_generate(state.tm, obj, request)

    @app.get("/get_model_info")
    async def get_model_info():
        tm = state.tm
        return {"model_path": args.resolved_model_path(), "served_model_name": state.model_name,
                "is_generation": True, "context_len": tm.context_len, "max_req_input_len": tm.max_req_input_len,
                "eos_token_ids": tm.scheduler_info.eos_token_ids}

    @app.get("/get_server_info")
    async def get_server_info():
        internal = await state.tm.get_internal_state()
        states = msgspec.to_builtins(internal)
        states.pop("type", None)
        states.pop("http_worker_ipc", None)
        states["rid_to_state_size"] = await state.tm.rid_to_state_size_total()
        return {**args.public_dict(), "internal_states": [states]}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        result = await state.tm.flush_cache()
        if not result.success:
            return error_response(400, f"cache not flushed: {result.message}")
        return {"success": True}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await request_json(request)
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool) or not (rid or abort_all):
            raise ClientError("give 'rid' (a string) or 'abort_all': true", "rid")
        state.tm.abort_request(rid, abort_all=abort_all)
        return {"success": True}

    @app.post("/pause_generation")
    async def pause_generation():
        await state.tm.pause_generation()
        return {"success": True}

    @app.post("/continue_generation")
    async def continue_generation():
        await state.tm.continue_generation()
        return {"success": True}

    from sluice.server.openai_api import install_openai_routes

    install_openai_routes(app, state)
    return app


async def request_json(request: Request) -> Any:
    try:
        return msgspec.json.decode(await request.body())
    except msgspec.DecodeError as e:
        raise ClientError(f"the body is not valid JSON: {e}") from None


async def decode_body(request: Request, kind: type):
    try:
        return msgspec.json.decode(await request.body(), type=kind)
    except msgspec.ValidationError as e:
        raise ClientError(f"invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise ClientError(f"the body is not valid JSON: {e}") from None


async def serve_generate(tm: TokenizerManager, obj: GenerateReqInput, request: Request):
    generator = tm.generate_request(obj, request)
    if obj.stream:
        first = await anext(generator)  # errors before the first chunk become a plain 4xx
        return StreamingResponse(sse_stream(first, generator), media_type="text/event-stream")
    if obj.is_single and obj.sample_count() == 1:
        return finished_response(await _last(generator))
    results = sorted([chunk async for chunk in generator], key=lambda chunk: chunk.index)
    for result in results:
        if status_code := failure_status(result):
            return error_response(status_code, f"item {result.index}: {result.finish_reason.message}")
    return JSONResponse([native_json(result) for result in results])


def finished_response(result: GenerateChunk) -> Response:
    status_code = failure_status(result)
    if status_code:
        return error_response(status_code, result.finish_reason.message)
    return JSONResponse(native_json(result))


async def _last(generator):
    last = None
    async for chunk in generator:
        last = chunk
    return last
