"""The TokenizerManager's state of one live request, and the response chunks built from it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sluice.messages import FinishReason, StrOutput, TokenLogprob
from sluice.tokenizer.result import GenerateChunk


@dataclass(slots=True, eq=False)
class ReqState:
    rid: str
    stream: bool
    path: str = "single"
    index: int | None = None
    return_logprob: bool = False
    created_s: float = field(default_factory=time.perf_counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[GenerateChunk] = field(default_factory=list)
    finished: bool = False

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    first_token_s: float | None = None

    def absorb(self, out: StrOutput) -> GenerateChunk:
        """Add one output of the detokenizer and return the response chunk it makes."""
        now = time.perf_counter()
        output = out.output
        if output.new_token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.text += out.text
        self.output_ids.extend(output.new_token_ids)
        if self.return_logprob:
            self.output_logprobs.extend(output.output_logprobs)
            self.output_top_logprobs.extend(output.output_top_logprobs)
            if output.input_logprobs:
                self.input_token_ids = output.input_token_ids
                self.input_logprobs = output.input_logprobs
                self.input_top_logprobs = output.input_top_logprobs
        if output.finish_reason is not None:
            self.finished = True
            # A stop string ends the text early: report only the tokens it covers.
            del self.output_ids[output.completion_tokens :]
            del self.output_logprobs[output.completion_tokens :]
            del self.output_top_logprobs[output.completion_tokens :]
        return self._chunk(output.finish_reason, now, prompt_tokens=output.prompt_tokens,
                           cached_tokens=output.cached_tokens, image_tokens=output.image_tokens)

    def abort_chunk(self, message: str, status_code: int = 400) -> GenerateChunk:
        """The final chunk of a request that ended with an error."""
        reason = FinishReason(type="abort", message=message, status_code=status_code)
        return self._chunk(reason, time.perf_counter())

    def _chunk(self, finish_reason: FinishReason | None, now: float, prompt_tokens: int = 0, cached_tokens: int = 0,
               image_tokens: int = 0) -> GenerateChunk:
        chunk = GenerateChunk(
            rid=self.rid,
            path=self.path,
            index=self.index,
            text=self.text,
            output_ids=list(self.output_ids),
            finish_reason=finish_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=len(self.output_ids),
            cached_tokens=cached_tokens,
            image_tokens=image_tokens,
            e2e_latency=now - self.created_s,
            ttft=None if self.first_token_s is None else self.first_token_s - self.created_s,
            return_logprob=self.return_logprob,
        )
        if self.return_logprob:
            chunk.output_logprobs = list(self.output_logprobs)
            chunk.output_top_logprobs = list(self.output_top_logprobs)
            chunk.input_token_ids = self.input_token_ids
            chunk.input_logprobs = self.input_logprobs
            chunk.input_top_logprobs = self.input_top_logprobs
        return chunk
