"""Answers of the embedding routes: native /encode and OpenAI /v1/embeddings. Both send an
EmbeddingReqInput through the TokenizerManager and read one final chunk per prompt."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sluice.server.client_watch import ClientWatch
from sluice.server.errors import error_response, failure_message, failure_response, finals_until_failure
from sluice.tokenizer.io_struct import EmbeddingReqInput
from sluice.tokenizer.manager import TokenizerManager
from sluice.tokenizer.result import GenerateChunk


async def embedding_chunks(
    tm: TokenizerManager, obj: EmbeddingReqInput, request: Request
) -> list[GenerateChunk] | Response:
    """Every prompt's final chunk in input order, or the error answer of the first that failed."""
    chunks, failed = await finals_until_failure(tm.generate_request(obj, ClientWatch(request)))
    if failed is not None:
        return failure_response(failed, _item(failed) + failure_message(failed))
    chunks.sort(key=lambda c: c.index or 0)
    if not chunks:
        return error_response(400, "the client disconnected")  # no one reads this
    for chunk in chunks:
        if not chunk.embedding:
            return error_response(503, f"{_item(chunk)}the request was aborted before its embedding was computed")
    return chunks


def _item(chunk: GenerateChunk) -> str:
    """Which prompt of a list an error is about ("" for a single one)."""
    return "" if chunk.index is None else f"item {chunk.index}: "


def native_json(chunk: GenerateChunk) -> dict[str, Any]:
    """/encode's JSON of one prompt."""
    meta = {
        "id": chunk.rid,
        "prompt_tokens": chunk.prompt_tokens,
        "cached_tokens": chunk.cached_tokens,
        "e2e_latency": chunk.e2e_latency,
        "weight_version": chunk.weight_version,
    }
    result: dict[str, Any] = {"embedding": _floats(chunk), "meta_info": meta}
    if chunk.index is not None:
        result["index"] = chunk.index
    return result


def openai_response(chunks: list[GenerateChunk], model: str, encoding_format: str) -> JSONResponse:
    """/v1/embeddings' answer: one `data` entry per input, in input order."""

    def vector(chunk: GenerateChunk) -> list[float] | str:
        if encoding_format == "base64":  # the float32 little-endian bytes, as OpenAI sends them
            return base64.b64encode(chunk.embedding or b"").decode()
        return _floats(chunk)

    data = [{"object": "embedding", "index": i, "embedding": vector(chunk)} for i, chunk in enumerate(chunks)]
    tokens = sum(chunk.prompt_tokens for chunk in chunks)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "data": data, "model": model, "usage": usage})


def _floats(chunk: GenerateChunk) -> list[float]:
    return np.frombuffer(chunk.embedding or b"", dtype="<f4").tolist()
