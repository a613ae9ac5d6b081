"""The shapes of what the routes take and return that have no struct elsewhere: the
admin abort body, the error envelope, and every response.

The request bodies of /generate and the OpenAI routes are their own structs
(GenerateReqInput, CompletionRequest, ChatCompletionRequest). The responses are built as
dicts by the TokenizerManager and the views; these structs describe them for the OpenAPI
document (`openapi.py`), and the schema test checks every response against them.
A field that a response may leave out has the default UNSET.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from msgspec import UNSET, UnsetType

from sluice.messages import FinishReason, InternalState


class AbortRequestInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Abort one request (and its n > 1 children) by rid, or every request."""

    rid: str = ""
    abort_all: bool = False


class PauseGenerationReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """SGLang's body of /pause_generation. No mode (or no body): new requests wait while the
    running ones go on; "abort": the running ones are aborted too (SGLang's default)."""

    mode: str | None = None


class NoFields(msgspec.Struct, forbid_unknown_fields=True):
    """The body of a route that takes none: nothing, or `{}`; any field is a 400 naming it."""


class UpdateWeightsFromDiskReqInput(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Serve the weights at `model_path` (a GGUF file or a HF folder of the same model:
    architecture, sizes and vocabulary) once the running requests finish; new requests wait
    meanwhile. `abort_all_requests` aborts the running ones instead of waiting for them."""

    model_path: Annotated[str, msgspec.Meta(min_length=1)]
    abort_all_requests: bool = False
    # The new weights' name in meta_info; default: the served one plus one (if a number).
    weight_version: Annotated[str, msgspec.Meta(min_length=1)] | None = None


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error, a response body or the payload of a stream's error event."""

    error: ErrorDetail


class Success(msgspec.Struct, kw_only=True):
    success: bool


class WeightUpdateResult(msgspec.Struct, kw_only=True):
    success: bool
    message: str
    weight_version: str  # served from now on


class WeightVersion(msgspec.Struct, kw_only=True):
    weight_version: str


class SchedulerLoad(msgspec.Struct, kw_only=True):
    """One Scheduler replica's load, in the shape of SGLang's /v1/loads (what the SGLang
    Model Gateway polls): the fields sluice measures."""

    dp_rank: int
    num_running_reqs: int
    num_waiting_reqs: int
    num_total_reqs: int
    num_used_tokens: int  # KV slots held by running requests
    max_total_num_tokens: int
    token_usage: float  # num_used_tokens / max_total_num_tokens
    max_running_requests: int


class Loads(msgspec.Struct, kw_only=True):
    timestamp: str  # ISO 8601, UTC
    dp_rank_count: int
    loads: list[SchedulerLoad]


# ---------------------------------------------------------------- native


# [logprob, token_id, null]; the first prompt token has no logprob.
LogprobTriple = tuple[float | None, int, None]


class Timings(msgspec.Struct, kw_only=True):
    """Seconds since the request was received; null for a stage it did not reach."""

    received: float
    tokenized: float | None
    first_scheduled: float | None
    first_token: float | None
    finished: float | None


class MetaInfo(msgspec.Struct, kw_only=True):
    id: str
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    e2e_latency: float
    path: Literal["single", "batch", "batch_sequential", "parallel_sample"]
    image_tokens: int | UnsetType = UNSET
    index: int | UnsetType = UNSET
    ttft: float | UnsetType = UNSET
    weight_version: str | UnsetType = UNSET  # the weights that computed it (unset: refused before)
    timings: Timings | UnsetType = UNSET
    output_token_logprobs: list[LogprobTriple] | UnsetType = UNSET
    output_top_logprobs: list[list[LogprobTriple]] | UnsetType = UNSET
    input_token_logprobs: list[LogprobTriple] | UnsetType = UNSET
    input_top_logprobs: list[list[LogprobTriple]] | UnsetType = UNSET


class GenerateResult(msgspec.Struct, kw_only=True):
    """One prompt's (or one sample's) result; a stream sends it cumulatively, chunk by chunk."""

    text: str
    output_ids: list[int]
    meta_info: MetaInfo
    index: int | UnsetType = UNSET  # a list of prompts or n > 1: prompt_index * n + sample_index


class ModelInfo(msgspec.Struct, kw_only=True):
    model_path: str
    served_model_name: str
    is_generation: bool
    context_len: int
    max_req_input_len: int
    eos_token_ids: list[int]
    weight_version: str
    has_image_understanding: bool  # the model takes images (image_data, image_url parts)


class ReplicaStates(InternalState, tag=False, kw_only=True):
    """One Scheduler replica's InternalState (--dp-size > 1), less its routing fields."""


class SchedulerStates(InternalState, tag=False, kw_only=True):
    """The Scheduler's InternalState (less its routing fields; with --dp-size > 1 the sums over
    the replicas, each replica's own in `replicas`), and the live request states of every
    HTTP worker and the requests a pause holds there."""

    rid_to_state_size: int
    num_paused_reqs: int
    replicas: list[ReplicaStates]  # type: ignore[assignment]  # the response form of each; empty with one Scheduler


class ServerInfo(msgspec.Struct, kw_only=True):
    """Every server argument but the API keys (`sluice serve --help`), how the model runs,
    and the states below."""

    # cpu, cpu_flags, backend (kernels | torch), kernels_isa, activations, gemv, gemm,
    # attention, kv_cache_dtype, why: chosen once when the model loaded.
    execution: dict[str, str]
    internal_states: list[SchedulerStates]


class TokenizeResult(msgspec.Struct, kw_only=True):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResult(msgspec.Struct, kw_only=True):
    text: str


# ---------------------------------------------------------------- OpenAI


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int  # the context length, as vLLM names it (gateways read it)


class ModelList(msgspec.Struct, kw_only=True):
    object: str
    data: list[ModelCard]


class PromptTokensDetails(msgspec.Struct, kw_only=True):
    cached_tokens: int


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(msgspec.Struct, kw_only=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class OpenAIEnvelope(msgspec.Struct, kw_only=True):
    id: str
    object: str
    created: int
    model: str


class CompletionResponse(OpenAIEnvelope, kw_only=True):
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(OpenAIEnvelope, kw_only=True):
    """One event of a streaming completion; with include_usage, every event has `usage`,
    null but in the last one."""

    choices: list[CompletionChoice]
    usage: Usage | UnsetType | None = UNSET


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct, kw_only=True):
    content: list[ChatTokenLogprob]


class ResponseFunction(msgspec.Struct, kw_only=True):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str
    function: ResponseFunction


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None  # null when the answer is tool calls only
    reasoning_content: str | UnsetType | None = UNSET  # with --reasoning-parser
    tool_calls: list[ResponseToolCall] | UnsetType = UNSET


class ChatChoice(msgspec.Struct, kw_only=True):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(OpenAIEnvelope, kw_only=True):
    choices: list[ChatChoice]
    usage: Usage


class DeltaFunction(msgspec.Struct, kw_only=True):
    name: str | UnsetType = UNSET  # with the call's first delta
    arguments: str  # a fragment; the fragments of one call concatenate to its JSON


class DeltaToolCall(msgspec.Struct, kw_only=True):
    index: int
    id: str | UnsetType = UNSET  # id and type with the call's first delta
    type: str | UnsetType = UNSET
    function: DeltaFunction


class ChatDelta(msgspec.Struct, kw_only=True):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(msgspec.Struct, kw_only=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(OpenAIEnvelope, kw_only=True):
    """One event of a streaming chat completion; usage as in CompletionChunk."""

    choices: list[ChatChunkChoice]
    usage: Usage | UnsetType | None = UNSET


# ---------------------------------------------------------------- embeddings


class EmbeddingMetaInfo(msgspec.Struct, kw_only=True):
    id: str
    prompt_tokens: int
    cached_tokens: int
    e2e_latency: float
    weight_version: str


class EmbeddingResult(msgspec.Struct, kw_only=True):
    """/encode's answer for one prompt (a list of prompts: a list of these, each with index)."""

    embedding: list[float]
    meta_info: EmbeddingMetaInfo
    index: int | UnsetType = UNSET


class EmbeddingData(msgspec.Struct, kw_only=True):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string with encoding_format "base64"


class EmbeddingUsage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(msgspec.Struct, kw_only=True):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
