"""The FastAPI app: native routes, health, admin routes; the OpenAI routes are in openai_api."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles

from sluice.messages import InternalState, SamplingParams
from sluice.sampling import ClientError
from sluice.server.api_types import (
    AbortRequestInput,
    EmbeddingResult,
    GenerateResult,
    Loads,
    ModelInfo,
    NoFields,
    PauseGenerationReqInput,
    ServerInfo,
    Success,
    UpdateWeightsFromDiskReqInput,
    WeightUpdateResult,
    WeightVersion,
)
from sluice.server.client_watch import ClientWatch
from sluice.server.embeddings import embedding_chunks
from sluice.server.embeddings import native_json as embedding_json
from sluice.server.errors import (
    NotFoundError,
    error_response,
    failure_message,
    failure_response,
    failure_status,
    finals_until_failure,
    install_error_handlers,
)
from sluice.server.guard import RequestGuard
from sluice.server.json_body import decode_json
from sluice.server.openai_api import install_openai_routes
from sluice.server.openapi import ApiDocs
from sluice.server.sse import stream_response
from sluice.server.state import ServerState
from sluice.tokenizer.admission import ServerBusy
from sluice.tokenizer.io_struct import EmbeddingReqInput, GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from sluice.tokenizer.result import GenerateChunk, NativeStream, TokenText, native_json

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
HEALTH_POLL_S = 0.5
# The model the SGLang Model Gateway names in a /generate whose client named none.
GATEWAY_UNNAMED_MODEL = "unknown"


# The errors a route can answer with, besides its own: 401 with --api-key, 503 when the
# back end is gone.
_ANY_ROUTE = (401, 503)
_ANY_POST = (401, 403, 415, 503)  # RequestGuard: a post from another site's page, or not JSON
_BODY_ROUTE = (400, 413, *_ANY_POST)


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="sluice", lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    args = state.server_args
    docs = ApiDocs()

    app.add_middleware(
        RequestGuard, max_body_bytes=args.max_request_body_bytes, api_key=args.api_key, admin_api_key=args.admin_api_key
    )

    @app.get("/health", response_class=Response, openapi_extra=docs.operation(errors=(503,)))
    async def health():
        """200 when ready (with --dp-size, while any Scheduler replica lives: then a body says
        how many do), 503 while starting or when the back end is gone."""
        if reason := state.unavailable():
            return error_response(503, reason)
        if degraded := state.tm.degraded():
            return JSONResponse(degraded)
        return Response(status_code=200)

    @app.get("/health_generate", response_class=Response, openapi_extra=docs.operation(errors=_ANY_ROUTE))
    async def health_generate():
        if reason := state.unavailable():
            return error_response(503, reason)
        # Its own rid, so the probe's state never mixes with a client's request; left out of
        # /metrics, where it would count as traffic.
        obj = GenerateReqInput(
            input_ids=[0],
            sampling_params={"max_new_tokens": 1, "temperature": 0},
            rid=f"HEALTH_CHECK_{uuid.uuid4().hex}",
            log_metrics=False,
        )
        return await _probe_generation(state.tm, obj)

    @app.post(
        "/generate",
        openapi_extra=docs.operation(
            body=GenerateReqInput,
            body_fields={"sampling_params": SamplingParams | list[SamplingParams] | None},
            response=GenerateResult | list[GenerateResult],
            stream_event=GenerateResult,
            errors=(*_BODY_ROUTE, 404),
        ),
    )
    async def generate(request: Request):
        obj = decode_json(await request.body(), GenerateReqInput)
        if obj.model not in (None, "", GATEWAY_UNNAMED_MODEL, state.model_name):
            raise NotFoundError(f"The model `{obj.model}` does not exist.", "model")
        return await serve_generate(state.tm, obj, request, state.token_texts if obj.return_text_in_logprobs else None)

    @app.post(
        "/encode",
        openapi_extra=docs.operation(
            body=EmbeddingReqInput, response=EmbeddingResult | list[EmbeddingResult], errors=_BODY_ROUTE
        ),
    )
    async def encode(request: Request):
        obj = decode_json(await request.body(), EmbeddingReqInput)
        chunks = await embedding_chunks(state.tm, obj, request)
        if isinstance(chunks, Response):
            return chunks
        results = [embedding_json(chunk) for chunk in chunks]
        return JSONResponse(results[0] if obj.is_single else results)

    @app.get("/get_model_info", openapi_extra=docs.operation(response=ModelInfo, errors=_ANY_ROUTE))
    async def get_model_info():
        tm = state.tm
        return {
            "model_path": tm.weights_path,
            "served_model_name": state.model_name,
            "is_generation": True,
            "context_len": tm.context_len,
            "max_req_input_len": tm.max_req_input_len,
            "eos_token_ids": tm.scheduler_info.eos_token_ids,
            "weight_version": tm.weight_version,
            "has_image_understanding": tm.scheduler_info.image_token_id is not None,
        }

    @app.get("/get_weight_version", openapi_extra=docs.operation(response=WeightVersion, errors=_ANY_ROUTE))
    async def get_weight_version():
        return {"weight_version": state.tm.weight_version}

    @app.get("/get_server_info", openapi_extra=docs.operation(response=ServerInfo, errors=_ANY_ROUTE))
    async def get_server_info():
        internal = await state.tm.get_internal_state()
        states = _public_states(internal)
        states["replicas"] = [_public_states(replica) for replica in internal.replicas]
        workers = await state.tm.worker_stats_total()
        states["rid_to_state_size"] = workers.rid_to_state_size
        states["num_paused_reqs"] = workers.num_paused_reqs
        # What is in effect where a flag left it to the server (the default model, a context
        # length from the model) or an update changed it (weight_version: the flag gave the first).
        return {
            **args.public_dict(),
            "model_path": state.tm.weights_path,
            "served_model_name": state.model_name,
            "context_length": state.tm.context_len,
            "weight_version": state.tm.weight_version,
            "execution": state.tm.scheduler_info.execution,
            "internal_states": [states],
        }

    @app.get("/v1/loads", openapi_extra=docs.operation(response=Loads, errors=(400, *_ANY_ROUTE)))
    async def loads(include: str = "core", dp_rank: int | None = None):
        """Each Scheduler replica's load, as SGLang's /v1/loads answers it (`include`: a comma
        list; sluice has the `core` section only, the others are answered as absent;
        `dp_rank`: that replica's alone)."""
        sections = set(include.split(","))
        if unknown := sections - {"core", "disagg", "queues", "memory", "all"}:
            raise ClientError(f"include: unknown section(s) {sorted(unknown)}", "include")
        internal = await state.tm.get_internal_state()
        replicas = internal.replicas or [internal]
        shown = replicas if dp_rank is None else [replica for replica in replicas if replica.dp_rank == dp_rank]
        if not shown:
            ranks = [replica.dp_rank for replica in replicas]
            raise ClientError(f"dp_rank: no replica {dp_rank} (the replicas are {ranks})", "dp_rank")
        return {
            "timestamp": datetime.now(UTC).isoformat(),
            "dp_rank_count": len(replicas),
            "loads": [_replica_load(replica, args.max_running_requests) for replica in shown],
        }

    metrics_docs = docs.operation(text_response="Prometheus text exposition format 0.0.4", errors=_ANY_ROUTE)

    @app.get("/metrics", response_class=Response, openapi_extra=metrics_docs)
    async def metrics():
        """Prometheus text format: request counters and latencies (summed over HTTP workers)
        and the Scheduler's gauges."""
        return Response(await state.tm.render_metrics(), media_type=METRICS_CONTENT_TYPE)

    @app.get("/flush_cache", openapi_extra=docs.operation(response=Success, errors=(400, *_ANY_ROUTE)))
    @app.post("/flush_cache", openapi_extra=docs.operation(response=Success, errors=(400, *_ANY_POST)))
    async def flush_cache(request: Request):
        check_no_fields(await request.body())
        result = await state.tm.flush_cache()
        if not result.success:
            return error_response(400, f"cache not flushed: {result.message}")
        return {"success": True}

    @app.post(
        "/abort_request", openapi_extra=docs.operation(body=AbortRequestInput, response=Success, errors=_BODY_ROUTE)
    )
    async def abort_request(request: Request):
        body = decode_json(await request.body(), AbortRequestInput)
        if not (body.rid or body.abort_all):
            raise ClientError("give 'rid' (a string) or 'abort_all': true", "rid")
        state.tm.abort_request(body.rid, abort_all=body.abort_all)
        return {"success": True}

    @app.post(
        "/pause_generation",
        openapi_extra=docs.operation(body=PauseGenerationReqInput, response=Success, errors=_BODY_ROUTE),
    )
    async def pause_generation(request: Request):
        raw = await request.body()
        body = decode_json(raw, PauseGenerationReqInput) if raw.strip() else PauseGenerationReqInput()
        if body.mode not in (None, "abort"):
            raise ClientError(
                f"mode {body.mode!r} is not supported: leave it out (running requests go on) or give 'abort'", "mode"
            )
        await state.tm.pause_generation()  # first, so that nothing starts between the abort and the pause
        if body.mode == "abort":
            state.tm.abort_request(abort_all=True)
        return {"success": True}

    @app.post("/continue_generation", openapi_extra=docs.operation(response=Success, errors=(400, *_ANY_POST)))
    async def continue_generation(request: Request):
        check_no_fields(await request.body())
        await state.tm.continue_generation()
        return {"success": True}

    @app.post(
        "/update_weights_from_disk",
        openapi_extra=docs.operation(
            body=UpdateWeightsFromDiskReqInput, response=WeightUpdateResult, errors=_BODY_ROUTE
        ),
    )
    async def update_weights_from_disk(request: Request):
        """Serve new weights of the same model; the old ones serve until they load, and keep
        serving if they fail to (400)."""
        body = decode_json(await request.body(), UpdateWeightsFromDiskReqInput)
        result = await state.tm.update_weights_from_disk(body.model_path, body.weight_version, body.abort_all_requests)
        if not result.success:
            return error_response(400, result.message, param=result.param)
        return {"success": True, "message": result.message, "weight_version": result.weight_version}

    install_openai_routes(app, state, docs)
    if not args.disable_web_ui:
        install_web_ui(app)
    docs.install(app)
    return app


WEB_DIR = Path(__file__).parent / "web"


def install_web_ui(app: FastAPI) -> None:
    """The playground: / is its page, /web/ its script and style (package files; nothing is
    fetched from elsewhere)."""

    @app.get("/", include_in_schema=False)
    async def playground():
        return FileResponse(WEB_DIR / "index.html")

    app.mount("/web", StaticFiles(directory=WEB_DIR), name="web")


def _replica_load(replica: InternalState, max_running_requests: int) -> dict[str, Any]:
    total = max(replica.kv_tokens_total, 1)
    return {
        "dp_rank": replica.dp_rank,
        "num_running_reqs": replica.num_running_reqs,
        "num_waiting_reqs": replica.num_waiting_reqs,
        "num_total_reqs": replica.num_running_reqs + replica.num_waiting_reqs,
        "num_used_tokens": replica.kv_tokens_in_use,
        "max_total_num_tokens": replica.kv_tokens_total,
        "token_usage": replica.kv_tokens_in_use / total,
        "max_running_requests": max_running_requests,
    }


def _public_states(internal: InternalState) -> dict[str, Any]:
    states = msgspec.to_builtins(internal)
    for routing in ("type", "http_worker_ipc", "replicas"):
        states.pop(routing, None)
    return states


async def serve_generate(
    tm: TokenizerManager, obj: GenerateReqInput, request: Request, token_text: TokenText | None = None
):
    generator = tm.generate_request(obj, ClientWatch(request))
    if obj.stream:
        return await stream_response(generator, NativeStreamFormat(token_text))
    if obj.is_single and obj.sample_count() == 1:
        return finished_response(await _last(generator), token_text)
    results, failed = await finals_until_failure(generator)
    if failed is not None:
        return failure_response(failed, native_error_message(failed))
    results.sort(key=lambda chunk: chunk.index or 0)
    return JSONResponse([native_json(result, token_text) for result in results])


def finished_response(result: GenerateChunk | None, token_text: TokenText | None = None) -> Response:
    if result is None:  # the client went away first: the request is aborted, no one reads this
        return error_response(400, "the client disconnected")
    if failure_status(result):
        return failure_response(result, native_error_message(result))
    return JSONResponse(native_json(result, token_text))


def native_error_message(chunk: GenerateChunk) -> str:
    """A batch's or n > 1's chunks carry `index`: the message says which item failed."""
    message = failure_message(chunk)
    return message if chunk.index is None else f"item {chunk.index}: {message}"


class NativeStreamFormat:
    """/generate streams each chunk as its item's result so far."""

    def __init__(self, token_text: TokenText | None = None) -> None:
        self._events = NativeStream(token_text)

    def stream_start(self) -> list[dict[str, Any]]:
        return []

    def stream_chunk(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        return [self._events.add(chunk)]

    def error_message(self, chunk: GenerateChunk) -> str:
        return native_error_message(chunk)


async def _probe_generation(tm: TokenizerManager, obj: GenerateReqInput) -> Response:
    """200 once the probe's token comes, or, as SGLang has it, once any output reaches this
    process after the probe began (a busy server queues the probe behind real work, and a
    full queue refuses it: both are alive); 503 when the back end fails or nothing comes.
    A paused server, or a worker updating weights, holds the probe as any new request: 200
    with status "paused" or "updating_weights" (the hold is on purpose; a probe timing out
    behind it would report a healthy server dead)."""
    started = time.time()
    probe = asyncio.ensure_future(_last(tm.generate_request(obj)))
    try:
        while time.time() - started < HEALTH_GENERATE_TIMEOUT_S:
            if probe.done():  # refused for the server's load: watch for outputs instead
                await asyncio.sleep(HEALTH_POLL_S)
            else:
                await asyncio.wait({probe}, timeout=HEALTH_POLL_S)
            if tm.backend_error:
                return error_response(503, f"generation failed: {tm.backend_error}")
            if probe.done() and (answer := _probe_answer(probe)) is not None:
                return answer
            if closed_for := tm.pause.closed_for:  # the probe waits at the gate, or a queue of held ones refused it
                return JSONResponse({"status": closed_for})
            if tm.last_receive_tstamp > started:
                return Response(status_code=200)
        return error_response(503, "generation failed: timed out")
    finally:
        probe.cancel()  # aborts it, if it still runs


def _probe_answer(probe: asyncio.Future[GenerateChunk]) -> Response | None:
    """What the finished probe says: 200, 503, or None when it was refused for the server's
    load (which says nothing about whether the back end lives)."""
    error = probe.exception()
    if isinstance(error, ServerBusy):
        return None
    if error is not None:
        return error_response(503, f"generation failed: {error}")
    chunk = probe.result()
    if chunk.finish_reason is not None and chunk.finish_reason.rejected is not None:
        return None
    if failure_status(chunk) is not None:
        return error_response(503, f"generation failed: {failure_message(chunk)}")
    return Response(status_code=200)


async def _last(generator):
    last = None
    async for chunk in generator:
        last = chunk
    return last


def check_no_fields(raw: bytes) -> None:
    """A route that takes no body: none, or `{}`; a 400 naming any field (it would change nothing)."""
    if raw.strip():
        decode_json(raw, NoFields)
