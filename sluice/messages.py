"""Every message that crosses a process boundary.

Each message is a msgspec Struct tagged with its class name, so one decoder turns bytes
back into the right type and nothing is ever pickled. A batch message is only a list of
per-request messages: splitting a result by request needs no hand-written code.
"""

from __future__ import annotations

from typing import Any

import msgspec

# A request's parallel samples and their prompt warm-up are requests of their own, named
# rid::0, rid::1, ... and rid::prefix; an abort of rid ends them all.
RID_SEPARATOR = "::"


def rid_family(rid: str) -> str:
    """The client's rid of a request the server named `rid::...`; a client's rid is its own."""
    return rid.partition(RID_SEPARATOR)[0]


class Message(msgspec.Struct, tag=True, kw_only=True):
    """Base of every message; the tag is the class name."""


# ---------------------------------------------------------------- requests to the scheduler


class SamplingParams(msgspec.Struct, kw_only=True):
    """How to pick tokens and when to stop. Validated by `sluice.sampling.validate_sampling_params`."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # token id -> added to its logit before sampling (OpenAI's: -100 bans, +100 forces)
    logit_bias: dict[int, float] = {}
    # Structured output, at most one (sluice/grammar.py): a JSON Schema as a string, a
    # regular expression, a GBNF grammar, or a structural tag (SGLang's JSON text
    # {"structures": [{"begin", "schema", "end"}], "triggers": [...]}).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # A stream's tokens N at a time after its first (SGLang's; None: --stream-interval).
    stream_interval: int | None = None


class ImageInput(msgspec.Struct, kw_only=True):
    """One preprocessed image: raw pixel bytes with their dtype and shape (never pickled)."""

    pixel_values: bytes
    dtype: str  # numpy dtype name, e.g. "float32"
    shape: list[int]  # [channels, height, width]
    hash: int  # of the image content: equal images share radix-cache prefixes


class TokenizedGenerateReqInput(Message):
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    # First prompt position whose logprob is returned; -1 means none of the prompt.
    logprob_start_len: int = -1
    input_text: str = ""
    # One image token id in input_ids per image, in order; the Scheduler expands each.
    images: list[ImageInput] = []
    # Higher runs sooner under --schedule-policy priority.
    priority: int = 0
    # When the TokenizerManager received the request (time.time()): the queue limits and
    # the timings count from here.
    received_at: float = 0.0
    return_timings: bool = False  # read by the TokenizerManager only
    http_worker_ipc: str | None = None


class BatchTokenizedGenerateReqInput(Message):
    reqs: list[TokenizedGenerateReqInput]


class TokenizedEmbeddingReqInput(Message):
    """Run a prompt and return its pooled last hidden state (no sampling)."""

    rid: str
    input_ids: list[int]
    priority: int = 0
    received_at: float = 0.0
    http_worker_ipc: str | None = None


class BatchTokenizedEmbeddingReqInput(Message):
    reqs: list[TokenizedEmbeddingReqInput]


# A request on its way to the Scheduler, either kind.
TokenizedRequest = TokenizedGenerateReqInput | TokenizedEmbeddingReqInput


class AbortReq(Message):
    """Abort `rid` and its parallel-sampling children (rids `rid::...`), or everything."""

    rid: str = ""
    abort_all: bool = False
    # Sent by the detokenizer when a stop string ended the request: the text is final,
    # the scheduler only has to release the request's slots.
    finished_by_stop_string: bool = False
    # A worker ending its own request (its client left): only the request of that rid that
    # this worker sent. A client may send the rid again, through another worker, as soon as
    # the first request's end has passed the router, before this abort is sent.
    own_request: bool = False
    http_worker_ipc: str | None = None


# A control request carries a `control_id` that its reply repeats, so a reply always finds
# the call that asked for it (with several HTTP workers and Scheduler replicas, or after a
# call that timed out); 0 when the sender does not match replies.


class FlushCacheReq(Message):
    control_id: int = 0
    http_worker_ipc: str | None = None


class GetInternalStateReq(Message):
    control_id: int = 0
    http_worker_ipc: str | None = None


class UpdateWeightsFromDiskReq(Message):
    """Load the weights at `model_path` once the running requests have finished (new ones
    wait in the queue), flush the prefix cache, and serve them as `weight_version` (None:
    the current version plus one)."""

    model_path: str
    weight_version: str | None = None
    control_id: int = 0
    http_worker_ipc: str | None = None


# ---------------------------------------------------------------- outputs


class FinishReason(msgspec.Struct, kw_only=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None  # "length": the output's length limit it reached (SGLang's key)
    message: str | None = None
    status_code: int | None = None
    # The request field a refusal is about (its native name), as the error envelope's param.
    param: str | None = None
    # Set when the server refused the request for its load (a 503 with Retry-After): why,
    # as the `reason` label of requests_rejected_total.
    rejected: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type, "matched": self.matched}
        if self.length is not None:
            out["length"] = self.length
        if self.message is not None:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out


class TokenLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float


class ReqOutput(msgspec.Struct, kw_only=True):
    """What one output says about its request since its last output. The Scheduler fills it
    in, the DetokenizerManager passes it on with the text beside it, and the TokenizerManager
    reads it: a field added here reaches the TokenizerManager with no other edit."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    image_tokens: int = 0
    # Logprobs of the new tokens (and, in the first output, of the prompt from
    # logprob_start_len on; the first prompt token has none).
    output_logprobs: list[float] = []
    output_top_logprobs: list[list[TokenLogprob]] = []
    input_token_ids: list[int] = []
    input_logprobs: list[float | None] = []
    input_top_logprobs: list[list[TokenLogprob]] = []
    # Wall-clock times (time.time()) the Scheduler first put the request in a batch and
    # sampled its first token; 0 until then.
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    weight_version: str = ""  # the weights that computed it
    http_worker_ipc: str | None = None


class TokenIDOutput(msgspec.Struct, kw_only=True):
    """New tokens of one request since its last output."""

    output: ReqOutput
    # Detokenization options, repeated so the detokenizer keeps no copy of the request.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stop: list[str] = []
    min_new_tokens: int = 0  # a stop string matches only in text of the tokens after these
    no_stop_trim: bool = False
    stream: bool = False
    # In the outputs before the first token is sent: the prompt's last few tokens. The text
    # is decoded after them, as SGLang and vLLM decode it, so that a SentencePiece model's
    # completion of "The" starts " cat", not "cat".
    prompt_tail: list[int] = []


class BatchTokenIDOutput(Message):
    outputs: list[TokenIDOutput]


class StrOutput(msgspec.Struct, kw_only=True):
    """New text of one request since its last output."""

    output: ReqOutput
    text: str
    # The text goes on from the prompt's last word (TokenIDOutput.prompt_tail): decoding did
    # not start it afresh, so it keeps the space a first token spells (text_offset counts so).
    continues_prompt: bool = False


class BatchStrOutput(Message):
    outputs: list[StrOutput]


class EmbeddingOutput(msgspec.Struct, kw_only=True):
    """The end of one embedding request: its vector, or (empty) the reason it failed."""

    output: ReqOutput
    embedding: bytes = b""  # float32 little-endian, pooled (and normalised, unless disabled)


class BatchEmbeddingOutput(Message):
    """Passed on unchanged by the DetokenizerManager."""

    outputs: list[EmbeddingOutput]


# ---------------------------------------------------------------- control


class SchedulerReady(Message):
    max_req_input_len: int
    context_len: int
    max_total_tokens: int
    eos_token_ids: list[int]
    vocab_size: int  # the model's logits: a token id a request names must be below it
    # Set for a vision-language model: the token that stands for one image, and how many
    # positions one image takes once the Scheduler expands it.
    image_token_id: int | None = None
    num_image_tokens: int = 0
    # How the model runs here (backend, instruction set, dtypes, kernel paths).
    execution: dict[str, str] = {}
    embedding_dim: int = 0  # length of an embedding: the model's hidden size
    dp_rank: int = 0  # which Scheduler replica (--dp-size) says so


class DetokenizerReady(Message):
    pass


class ProcessFailed(Message):
    process: str
    error: str


class FlushCacheReqOutput(Message):
    success: bool
    message: str = ""
    dp_rank: int = 0
    control_id: int = 0
    http_worker_ipc: str | None = None


# The refusal of a weight update while another is under way.
UPDATE_IN_PROGRESS = "another weight update is in progress"


class UpdateWeightsFromDiskReqOutput(Message):
    """The end of a weight update; with several HTTP workers the router tells every worker,
    so each reports the new version."""

    success: bool
    message: str = ""
    weight_version: str = ""  # the version served now (the old one, if the update failed)
    model_path: str = ""  # the weights served now
    param: str | None = None  # the request field a refusal is about
    dp_rank: int = 0
    control_id: int = 0
    http_worker_ipc: str | None = None


class InternalState(Message):
    num_running_reqs: int
    num_waiting_reqs: int
    kv_tokens_total: int
    kv_tokens_free: int
    kv_tokens_cached: int
    kv_tokens_in_use: int
    # Tokens whose sliding-window layers' K/V are held (a model with such layers; else 0).
    kv_window_tokens_held: int = 0
    last_step_ms: float = 0.0
    # Threads the forward pass runs on now: fewer than --num-threads while other processes
    # keep some of the Scheduler's cores busy (scheduler/forward_threads.py).
    forward_threads: int = 0
    num_retractions: int = 0  # requests sent back to the waiting queue for KV, since start
    num_failed_steps: int = 0  # steps that raised (a bug): their requests ended with a 500
    prefill_steps: int = 0  # steps that prefilled prompt tokens, since start
    # Messages the scheduler received, by type name (a batch counts once).
    messages_received: dict[str, int] = {}
    # Requests the scheduler ended, by finish_reason type ("stop", "length", "abort"); a
    # request a stop string ended in the detokenizer counts as "stop".
    finished_reqs: dict[str, int] = {}
    # With --dp-size N > 1: each replica's own state; the fields above are their sums.
    replicas: list[InternalState] = []
    dp_rank: int = 0
    pid: int = 0  # the Scheduler process (a sum over replicas: 0)
    control_id: int = 0
    http_worker_ipc: str | None = None


# ---------------------------------------------------------------- multi-worker (router) control


class RegisterWorker(Message):
    """A TokenizerWorker announces its inbox to the MultiTokenizerRouter."""

    http_worker_ipc: str
    pid: int


class SetPause(Message):
    """Pause or continue generation; the router broadcasts it to every worker."""

    paused: bool
    http_worker_ipc: str | None = None


class WorkerStatsReq(Message):
    """Asks every worker for its state; the answers go back to `http_worker_ipc`, each with
    the request's `control_id`."""

    http_worker_ipc: str
    control_id: int = 0


class WorkerStats(Message):
    rid_to_state_size: int
    http_worker_ipc: str  # the worker that asked
    num_paused_reqs: int = 0  # requests held until generation continues
    control_id: int = 0  # the WorkerStatsReq's


class ReplicaLoad(Message):
    """A data-parallel Scheduler replica tells the DataParallelController which requests
    ended there (sent after every loop turn that ended any)."""

    dp_rank: int
    finished_rids: list[str]


class ReplicaDied(Message):
    """The DataParallelController saw a Scheduler replica die: its requests failed, the
    others serve on; every HTTP worker reports the server degraded."""

    dp_rank: int
    replicas_alive: int


class WorkerDied(Message):
    """The router saw a worker process die: every worker reports unhealthy."""

    pid: int


AnyMessage = (
    TokenizedGenerateReqInput
    | BatchTokenizedGenerateReqInput
    | TokenizedEmbeddingReqInput
    | BatchTokenizedEmbeddingReqInput
    | BatchEmbeddingOutput
    | AbortReq
    | FlushCacheReq
    | GetInternalStateReq
    | UpdateWeightsFromDiskReq
    | UpdateWeightsFromDiskReqOutput
    | BatchTokenIDOutput
    | BatchStrOutput
    | SchedulerReady
    | DetokenizerReady
    | ProcessFailed
    | FlushCacheReqOutput
    | InternalState
    | RegisterWorker
    | SetPause
    | WorkerStatsReq
    | WorkerStats
    | WorkerDied
    | ReplicaLoad
    | ReplicaDied
)
