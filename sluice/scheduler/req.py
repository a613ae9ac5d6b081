"""The Scheduler's copy of a request. The TokenizerManager keeps its own; the rid links them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from sluice.grammar import grammar_field
from sluice.messages import (
    FinishReason,
    ImageInput,
    SamplingParams,
    TokenizedEmbeddingReqInput,
    TokenizedGenerateReqInput,
    TokenLogprob,
)
from sluice.scheduler.grammar import take_token

# An embedding request runs its prompt and samples nothing.
_NO_SAMPLING = SamplingParams(max_new_tokens=0)


@dataclass(slots=True, eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    http_worker_ipc: str | None = None
    images: list[ImageInput] = field(default_factory=list)  # in prompt order
    priority: int = 0
    received_at: float = 0.0
    arrival: int = 0  # the Scheduler's order of arrival: ties between priorities go by it
    queued_at: float = field(default_factory=time.monotonic)  # when the Scheduler took it in

    # An embedding request: how its final hidden states pool into one vector ("last",
    # "mean", "cls"), and the pool so far (mean: the sum of the rows computed so far).
    pooling: str | None = None
    normalize: bool = True
    pooled: torch.Tensor | None = None

    # Where each image's positions start in prompt_ids once expanded, and its embedding
    # once computed (kept until the request ends, so a retraction does not recompute it).
    image_offsets: list[int] = field(default_factory=list)
    num_image_tokens: int = 0
    image_token_id: int = -1  # the token each image stood for in the prompt as sent
    image_embeds: dict[int, torch.Tensor] = field(default_factory=dict)

    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    # The llguidance matcher of a request with a grammar (scheduler/grammar.py): it has
    # taken every token of output_ids. Until then, its grammar compiling (a Future).
    grammar: Any = None
    compiling_grammar: Any = None

    # KV state. The first `kv_len` tokens of the sequence (prompt then output) have KV in slots
    # req_to_token[req_pool_idx, :kv_len]; the first `locked_prefix_len` of them belong to the radix
    # cache (locked through `last_node`), the rest to this request.
    req_pool_idx: int | None = None
    kv_len: int = 0
    locked_prefix_len: int = 0
    # Slots this request holds for its next tokens, in order (KVManager.alloc_step).
    reserved_slots: list[int] = field(default_factory=list)
    last_node: Any = None
    cached_tokens: int = 0
    times_retracted: int = 0
    scheduled_at: float = 0.0  # time.time() when first put in a batch
    first_token_at: float = 0.0

    # Output bookkeeping.
    num_sent_tokens: int = 0
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_logprobs_sent: bool = False

    @classmethod
    def from_message(cls, msg: TokenizedGenerateReqInput) -> Req:
        return cls(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            sampling_params=msg.sampling_params,
            stream=msg.stream,
            return_logprob=msg.return_logprob,
            top_logprobs_num=msg.top_logprobs_num,
            logprob_start_len=msg.logprob_start_len,
            http_worker_ipc=msg.http_worker_ipc,
            images=list(msg.images),
            priority=msg.priority,
            received_at=msg.received_at,
        )

    @classmethod
    def for_embedding(cls, msg: TokenizedEmbeddingReqInput, pooling: str, normalize: bool) -> Req:
        return cls(
            rid=msg.rid,
            prompt_ids=list(msg.input_ids),
            sampling_params=_NO_SAMPLING,
            http_worker_ipc=msg.http_worker_ipc,
            priority=msg.priority,
            received_at=msg.received_at,
            pooling=pooling,
            normalize=normalize,
        )

    @property
    def needs_every_position(self) -> bool:
        """Mean and CLS pooling read rows a cached prefix would skip: they compute them all."""
        return self.pooling in ("mean", "cls")

    def pooling_rows(self, start: int, count: int) -> range:
        """Rows of a chunk of `count` tokens from position `start` that the pool reads."""
        if self.pooling == "mean":
            return range(count)
        if self.pooling == "cls":
            return range(1 if start == 0 else 0)
        return range(count - 1, count) if start + count == self.seq_len else range(0)

    def pool(self, rows: torch.Tensor) -> None:
        if self.pooling == "mean":
            total = rows.sum(dim=0)
            self.pooled = total if self.pooled is None else self.pooled + total
        elif len(rows):
            self.pooled = rows[0].clone()

    def embedding(self) -> torch.Tensor:
        assert self.pooled is not None, "the whole prompt ran"
        vector = self.pooled / self.seq_len if self.pooling == "mean" else self.pooled
        return torch.nn.functional.normalize(vector, dim=0) if self.normalize else vector

    @property
    def image_tokens(self) -> int:
        return len(self.image_offsets) * self.num_image_tokens

    def prompt_ids_as_sent(self, start: int) -> list[int]:
        """prompt_ids from `start` with each image position shown as the image token, not
        the pad value above the vocabulary the Scheduler keys the cache on."""
        ids = self.prompt_ids[start:]
        for offset in self.image_offsets:
            for position in range(max(offset, start), offset + self.num_image_tokens):
                ids[position - start] = self.image_token_id
        return ids

    def fill_slice(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of the sequence, prompt then output, without building the
        whole sequence: a decode step reads one token of it."""
        prompt_len = len(self.prompt_ids)
        if end <= prompt_len:
            return self.prompt_ids[start:end]
        if start >= prompt_len:
            return self.output_ids[start - prompt_len : end - prompt_len]
        return self.prompt_ids[start:] + self.output_ids[: end - prompt_len]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def is_decoding(self) -> bool:
        """KV exists for every token but the last sampled one: the next step is a decode."""
        return bool(self.output_ids) and self.kv_len == self.seq_len - 1

    @property
    def remaining_prefill(self) -> int:
        return self.seq_len - self.kv_len

    @property
    def max_new_tokens_left(self) -> int:
        return max(self.sampling_params.max_new_tokens - len(self.output_ids), 0)

    @property
    def wants_input_logprobs(self) -> bool:
        return (
            self.return_logprob and 0 <= self.logprob_start_len < len(self.prompt_ids) and not self.input_logprobs_sent
        )

    def kv_slots(self, req_to_token: torch.Tensor) -> torch.Tensor:
        return req_to_token[self.req_pool_idx, : self.kv_len]

    def append_token(
        self,
        token: int,
        logprob: float,
        top_logprobs: list[tuple[int, float]],
        eos_token_ids: frozenset[int],
        context_len: int,
    ) -> None:
        """Take a sampled token (its logprobs are kept if the request asked for them), advance
        the grammar, and set finish_reason if the request ends with it."""
        self.output_ids.append(token)
        self.first_token_at = self.first_token_at or time.time()
        if self.grammar is not None and (dead_end := take_token(self.grammar, token)) is not None:
            param = grammar_field(self.sampling_params)
            self.finish_reason = FinishReason(type="abort", message=dead_end, status_code=400, param=param)
        if self.return_logprob:
            self.output_logprobs.append(logprob)
            if self.top_logprobs_num:
                self.output_top_logprobs.append([TokenLogprob(*top) for top in top_logprobs])
        if not self.finished:  # a grammar's dead end stays the answer's end
            self.check_finished(eos_token_ids)
        if not self.finished and self.grammar is not None and self.grammar.is_stopped():
            # The grammar is complete and allows nothing more (not even more whitespace).
            self.finish_reason = self._grammar_end()
        if not self.finished and self.seq_len >= context_len:
            self.finish_reason = FinishReason(type="length", length=len(self.output_ids))

    def _grammar_end(self) -> FinishReason:
        """A stop, or an error where the grammar ended the answer short of min_new_tokens: the
        two cannot both hold, and a shorter answer would not be the one asked for."""
        made, least = len(self.output_ids), self.sampling_params.min_new_tokens
        if made >= least:
            return FinishReason(type="stop", matched=None)
        message = f"the grammar's answer ended after {made} token{'s' * (made != 1)}, before min_new_tokens {least}"
        return FinishReason(type="abort", message=message, status_code=400, param="min_new_tokens")

    def check_finished(self, eos_token_ids: frozenset[int]) -> None:
        """Set finish_reason after a new token was appended."""
        params = self.sampling_params
        last = self.output_ids[-1]
        if len(self.output_ids) >= params.min_new_tokens:
            if last in params.stop_token_ids:
                self.finish_reason = FinishReason(type="stop", matched=last)
                return
            if not params.ignore_eos and last in eos_token_ids:
                self.finish_reason = FinishReason(type="stop", matched=last)
                return
        if len(self.output_ids) >= params.max_new_tokens:
            self.finish_reason = FinishReason(type="length", length=params.max_new_tokens)
