"""What the TokenizerManager yields for a request (GenerateChunk), and its native JSON.

A chunk is typed from `_handle_batch_output` to the views. It carries what is new since
the request's previous chunk: a streaming view sends just that, and a non-streaming
request gets a single chunk with everything. /generate's JSON (`native_json`,
`NativeStream`) and the OpenAI views are built from chunks only at the edge.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from sluice.messages import FinishReason, TokenLogprob

# A token's text, for logprobs that name it (return_text_in_logprobs).
TokenText = Callable[[int], str]


class GenerateChunk(msgspec.Struct, kw_only=True):
    """One response chunk of one request: its text, tokens and logprobs since its previous
    chunk (its first chunk: since the start), and its counts so far."""

    rid: str
    path: str  # "single" | "batch" | "batch_sequential" | "parallel_sample" | "prefix_warmup"
    index: int | None = None  # the item's index on every path but "single"
    text: str
    output_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    # Output tokens so far. A stop string can end the text before tokens that earlier
    # chunks already carried: then this is fewer than they add up to, and it is what holds.
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0
    e2e_latency: float = 0.0
    ttft: float | None = None  # seconds to the first output token, once there is one
    weight_version: str = ""  # the weights that computed it; "" for a request refused before it ran
    # With return_timings: each stage of the request in seconds since it was received.
    timings: dict[str, float | None] | None = None
    # An embedding request's answer: float32 little-endian (EmbeddingOutput.embedding).
    embedding: bytes | None = None
    # With return_logprob: one logprob per output id, the top alternatives of each (empty
    # unless asked for), and, in the first chunk that has them, the prompt's from
    # logprob_start_len on.
    return_logprob: bool = False
    output_logprobs: list[float] = []
    output_top_logprobs: list[list[TokenLogprob]] = []
    input_token_ids: list[int] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[TokenLogprob]] = []
    # The text goes on from the prompt's last word (StrOutput.continues_prompt).
    continues_prompt: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def native_json(chunk: GenerateChunk, token_text: TokenText | None = None) -> dict[str, Any]:
    """/generate's JSON for a request's only chunk (a non-streaming result): text,
    output_ids and meta_info, plus index on the batch paths. With `token_text`, logprobs
    name each token's text (return_text_in_logprobs)."""
    logprobs: dict[str, Any] = {}
    if chunk.return_logprob:
        logprobs = {
            "output_token_logprobs": _token_logprobs(chunk.output_logprobs, chunk.output_ids, token_text),
            "output_top_logprobs": _top_logprobs(chunk.output_top_logprobs, token_text),
            "input_token_logprobs": _token_logprobs(chunk.input_logprobs, chunk.input_token_ids, token_text),
            "input_top_logprobs": _top_logprobs(chunk.input_top_logprobs, token_text),
        }
    return _result(chunk, chunk.text, chunk.output_ids, logprobs)


class NativeStream:
    """The events of a streamed /generate: each repeats its item's text, ids and logprobs
    so far. They are kept per rid already encoded, so a chunk encodes only what it brings
    and an event only copies bytes. Its dicts hold msgspec.Raw values: encode them with
    msgspec. With `token_text`, logprobs name each token's text (return_text_in_logprobs)."""

    def __init__(self, token_text: TokenText | None = None) -> None:
        self._so_far: dict[str, _EncodedSoFar] = {}
        self._token_text = token_text

    def add(self, chunk: GenerateChunk) -> dict[str, Any]:
        so_far = self._so_far.setdefault(chunk.rid, _EncodedSoFar())
        so_far.add(chunk, self._token_text)
        if chunk.finished:
            del self._so_far[chunk.rid]
        logprobs: dict[str, Any] = {}
        if chunk.return_logprob:
            logprobs = {
                "output_token_logprobs": so_far.output_token_logprobs.raw(),
                "output_top_logprobs": so_far.output_top_logprobs.raw(),
                "input_token_logprobs": so_far.input_token_logprobs,
                "input_top_logprobs": so_far.input_top_logprobs,
            }
        return _result(chunk, msgspec.Raw(b'"' + so_far.text + b'"'), so_far.output_ids.raw(), logprobs)


def _result(chunk: GenerateChunk, text: Any, output_ids: Any, logprobs: dict[str, Any]) -> dict[str, Any]:
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
    if chunk.weight_version:
        meta["weight_version"] = chunk.weight_version
    if chunk.timings is not None:
        meta["timings"] = chunk.timings
    meta.update(logprobs)
    result: dict[str, Any] = {"text": text, "output_ids": output_ids, "meta_info": meta}
    if chunk.index is not None:
        result["index"] = chunk.index
    return result


class _EncodedList:
    """A JSON array that grows at its end: its elements' encoding and where each ends."""

    def __init__(self) -> None:
        self.body = bytearray()
        self.ends: list[int] = []

    def extend(self, items: list[Any]) -> None:
        for item in items:
            if self.ends:
                self.body += b","
            self.body += _encode(item)
            self.ends.append(len(self.body))

    def truncate(self, count: int) -> None:
        if count < len(self.ends):
            del self.body[self.ends[count - 1] if count else 0 :]
            del self.ends[count:]

    def raw(self) -> msgspec.Raw:
        return msgspec.Raw(b"[" + self.body + b"]")


class _EncodedSoFar:
    """One streamed item's text, ids and logprobs so far, encoded as /generate's JSON."""

    def __init__(self) -> None:
        self.text = bytearray()  # the JSON string's body, without its quotes
        self.output_ids = _EncodedList()
        self.output_token_logprobs = _EncodedList()
        self.output_top_logprobs = _EncodedList()
        self.input_token_logprobs = msgspec.Raw(b"[]")
        self.input_top_logprobs = msgspec.Raw(b"[]")

    def add(self, chunk: GenerateChunk, token_text: TokenText | None) -> None:
        # JSON escapes character by character: the pieces' escapes add up to the whole's.
        self.text += _encode(chunk.text)[1:-1]
        self.output_ids.extend(chunk.output_ids)
        if chunk.return_logprob:
            self.output_token_logprobs.extend(_token_logprobs(chunk.output_logprobs, chunk.output_ids, token_text))
            self.output_top_logprobs.extend(_top_logprobs(chunk.output_top_logprobs, token_text))
            if chunk.input_logprobs:
                self.input_token_logprobs = msgspec.Raw(
                    _encode(_token_logprobs(chunk.input_logprobs, chunk.input_token_ids, token_text))
                )
                self.input_top_logprobs = msgspec.Raw(_encode(_top_logprobs(chunk.input_top_logprobs, token_text)))
        # A stop string ended the text before tokens already streamed: they do not count.
        for encoded in (self.output_ids, self.output_token_logprobs, self.output_top_logprobs):
            encoded.truncate(chunk.completion_tokens)


_encode = msgspec.json.Encoder().encode


def _token_logprobs(
    logprobs: Sequence[float | None], token_ids: list[int], token_text: TokenText | None
) -> list[list[Any]]:
    # SGLang's [logprob, token_id, token_text]; the text only with return_text_in_logprobs.
    return [
        [logprob, token_id, token_text(token_id) if token_text else None]
        for logprob, token_id in zip(logprobs, token_ids, strict=False)
    ]


def _top_logprobs(tops: list[list[TokenLogprob]], token_text: TokenText | None) -> list[list[list[Any]]]:
    return [
        [[t.logprob, t.token_id, token_text(t.token_id) if token_text else None] for t in alternatives]
        for alternatives in tops
    ]
