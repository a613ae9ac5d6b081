"""What the TokenizerManager yields for a request (GenerateChunk), and its native JSON.

A chunk is typed from `_handle_batch_output` to the views; the HTTP layer and the Engine
turn it into /generate's JSON (`native_json`) only at the edge, and the OpenAI views read
its fields directly.
"""

from __future__ import annotations

from typing import Any

import msgspec

from sluice.messages import FinishReason, TokenLogprob


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One response chunk of one request: its text, tokens and logprobs so far."""

    rid: str
    path: str  # "single" | "batch" | "batch_sequential" | "parallel_sample" | "prefix_warmup"
    index: int | None = None  # the item's index on every path but "single"
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0
    e2e_latency: float = 0.0
    ttft: float | None = None  # seconds to the first output token, once there is one
    # With return_logprob: one logprob per output id, the top alternatives of each (empty
    # unless asked for), and the prompt's from logprob_start_len on.
    return_logprob: bool = False
    output_logprobs: list[float] = []
    output_top_logprobs: list[list[TokenLogprob]] = []
    input_token_ids: list[int] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[TokenLogprob]] = []

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def native_json(chunk: GenerateChunk) -> dict[str, Any]:
    """/generate's JSON for a chunk: text, output_ids and meta_info (plus index on the batch paths)."""
    meta: dict[str, Any] = {
        "id": chunk.rid,
        "finish_reason": chunk.finish_reason.to_json() if chunk.finish_reason else None,
        "prompt_tokens": chunk.prompt_tokens,
        "completion_tokens": chunk.completion_tokens,
        "cached_tokens": chunk.cached_tokens,
        "image_tokens": chunk.image_tokens,
        "e2e_latency": chunk.e2e_latency,
        "path": chunk.path,
    }
    if chunk.index is not None:
        meta["index"] = chunk.index
    if chunk.ttft is not None:
        meta["ttft"] = chunk.ttft
    if chunk.return_logprob:
        meta["output_token_logprobs"] = _token_logprobs(chunk.output_logprobs, chunk.output_ids)
        meta["output_top_logprobs"] = _top_logprobs(chunk.output_top_logprobs)
        meta["input_token_logprobs"] = _token_logprobs(chunk.input_logprobs, chunk.input_token_ids)
        meta["input_top_logprobs"] = _top_logprobs(chunk.input_top_logprobs)
    result: dict[str, Any] = {"text": chunk.text, "output_ids": chunk.output_ids, "meta_info": meta}
    if chunk.index is not None:
        result["index"] = chunk.index
    return result


def _token_logprobs(logprobs: list[float | None], token_ids: list[int]) -> list[list[Any]]:
    # SGLang's [logprob, token_id, token_text]; the text is never filled in.
    return [[logprob, token_id, None] for logprob, token_id in zip(logprobs, token_ids)]


def _top_logprobs(tops: list[list[TokenLogprob]]) -> list[list[list[Any]]]:
    return [[[t.logprob, t.token_id, None] for t in alternatives] for alternatives in tops]
