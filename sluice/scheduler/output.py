"""Build the BatchTokenIDOutput entry of one request: what is new since its last output."""

from __future__ import annotations

from sluice.messages import (
    EmbeddingOutput,
    FinishReason,
    ReqOutput,
    TokenIDOutput,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
)
from sluice.scheduler.req import Req

SchedulerOutput = TokenIDOutput | EmbeddingOutput

# How many of the prompt's last tokens the output's text is decoded after (SGLang's and
# vLLM's 5).
PROMPT_TAIL_TOKENS = 5


def make_output(req: Req, weight_version: str) -> SchedulerOutput:
    """`weight_version`: the weights that computed the request (they change only while no
    request runs)."""
    if req.pooling is not None:
        return make_embedding_output(req, weight_version)
    start = req.num_sent_tokens
    req.num_sent_tokens = len(req.output_ids)
    output = ReqOutput(
        rid=req.rid,
        new_token_ids=req.output_ids[start:],
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids),
        completion_tokens=len(req.output_ids),
        cached_tokens=req.cached_tokens,
        image_tokens=req.image_tokens,
        scheduled_at=req.scheduled_at,
        first_token_at=req.first_token_at,
        weight_version=weight_version,
        http_worker_ipc=req.http_worker_ipc,
    )
    if req.return_logprob:
        output.output_logprobs = req.output_logprobs[start:]
        output.output_top_logprobs = req.output_top_logprobs[start:]
        # Prompt logprobs go out once, with the first output after the prompt's prefill.
        if req.wants_input_logprobs and (req.output_ids or req.finished):
            output.input_token_ids = req.prompt_ids_as_sent(req.logprob_start_len)
            output.input_logprobs = req.input_logprobs
            output.input_top_logprobs = req.input_top_logprobs
            if req.logprob_start_len == 0:  # the first token has nothing to condition on (and may be the only one)
                output.input_logprobs = [None, *req.input_logprobs]
                output.input_top_logprobs = [[], *req.input_top_logprobs] if req.top_logprobs_num else []
            req.input_logprobs_sent = True
    params = req.sampling_params
    return TokenIDOutput(
        output=output,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        stop=params.stop,
        min_new_tokens=params.min_new_tokens,
        no_stop_trim=params.no_stop_trim,
        stream=req.stream,
        prompt_tail=req.prompt_ids_as_sent(max(len(req.prompt_ids) - PROMPT_TAIL_TOKENS, 0)) if start == 0 else [],
    )


def make_embedding_output(req: Req, weight_version: str) -> EmbeddingOutput:
    """An embedding request ends in one output: its vector, or why it has none."""
    output = ReqOutput(
        rid=req.rid,
        new_token_ids=[],
        finish_reason=req.finish_reason,
        prompt_tokens=len(req.prompt_ids),
        cached_tokens=req.cached_tokens,
        scheduled_at=req.scheduled_at,
        weight_version=weight_version,
        http_worker_ipc=req.http_worker_ipc,
    )
    if req.finish_reason is None or req.finish_reason.type == "abort" or req.pooled is None:
        return EmbeddingOutput(output=output)
    vector = req.embedding().float().numpy().astype("<f4", copy=False)
    return EmbeddingOutput(output=output, embedding=vector.tobytes())


def refused_output(
    msg: TokenizedGenerateReqInput | TokenizedEmbeddingReqInput, reason: FinishReason, weight_version: str
) -> SchedulerOutput:
    """The one output of a request that never became a Req."""
    output = ReqOutput(
        rid=msg.rid,
        new_token_ids=[],
        finish_reason=reason,
        prompt_tokens=len(msg.input_ids),
        weight_version=weight_version,
        http_worker_ipc=msg.http_worker_ipc,
    )
    if isinstance(msg, TokenizedEmbeddingReqInput):
        return EmbeddingOutput(output=output)
    return TokenIDOutput(output=output, stream=msg.stream)
