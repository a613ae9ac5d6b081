"""The TokenizerManager's state of one live request, and the response chunks built from it.

A chunk carries what is new since the request's previous chunk, so a step costs what it
adds however long the output grows. A non-streaming request gets one chunk, at the end,
with everything: it is built once.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

from sluice.messages import (
    RID_SEPARATOR,
    EmbeddingOutput,
    FinishReason,
    ReqOutput,
    StrOutput,
    TokenLogprob,
    rid_family,
)
from sluice.tokenizer.result import GenerateChunk

# How often a request waiting for its results (or for a pause to end) checks whether its
# client is still there.
DISCONNECT_POLL_S = 1.0


class ClientConnection(Protocol):
    """What the request path asks of the client's HTTP request: whether it went away."""

    async def is_disconnected(self) -> bool: ...


class LiveRids:
    """The rids a new request may not take: each rid with a state, and the client's rid of
    each n > 1 request in flight, whose states are named `rid::prefix` and `rid::i` (a
    request reusing that rid would be aborted with its samples, which the Scheduler aborts
    by prefix, and would share their streams). States come and go through add and remove,
    which count each family's server-named states; `sampled` holds a family's rid between
    them (its warm-up ended, its samples not yet added)."""

    def __init__(self, rid_to_state: dict[str, ReqState]) -> None:
        self.rid_to_state = rid_to_state
        self.sampled: set[str] = set()
        self._families: Counter[str] = Counter()

    def add(self, state: ReqState) -> None:
        self.rid_to_state[state.rid] = state
        if RID_SEPARATOR in state.rid:
            self._families[rid_family(state.rid)] += 1

    def remove(self, rid: str) -> None:
        del self.rid_to_state[rid]
        if RID_SEPARATOR in rid:
            family = rid_family(rid)
            self._families[family] -= 1
            if not self._families[family]:
                del self._families[family]

    def __contains__(self, rid: object) -> bool:
        return rid in self.rid_to_state or rid in self.sampled or rid in self._families


class ArrivingRids:
    """The client rids of the requests a worker is taking in (tokenizing, waiting out a weight
    update, between an n > 1 warm-up and its samples) and those an abort named meanwhile:
    such an abort can reach the Scheduler before the request, which would then run, so the
    worker ends the request unsent instead (TokenizerManager.send_new)."""

    def __init__(self) -> None:
        self._arriving: Counter[str] = Counter()
        self._aborted: set[str] = set()  # client rids, or the rid of one sample (rid::i)

    def enter(self, rids: list[str]) -> None:
        self._arriving.update(rids)

    def leave(self, rids: list[str]) -> None:
        """The requests of `rids` are no longer coming in: forget them and their aborts."""
        self._arriving.subtract(rids)
        for rid in rids:
            if self._arriving[rid] <= 0:
                del self._arriving[rid]
                if self._aborted:
                    self._aborted = {r for r in self._aborted if rid_family(r) != rid}

    def abort(self, rid: str, abort_all: bool) -> None:
        """Remember an abort of a request still coming in (or of its samples, not yet sent)."""
        if abort_all:
            self._aborted.update(self._arriving)
        elif rid_family(rid) in self._arriving:
            self._aborted.add(rid)

    def aborted(self, rid: str) -> bool:
        return bool(self._aborted) and (rid in self._aborted or rid_family(rid) in self._aborted)


@dataclass(slots=True, eq=False)
class ReqState:
    rid: str
    stream: bool
    path: str = "single"
    index: int | None = None
    return_logprob: bool = False
    return_timings: bool = False
    log_metrics: bool = True  # false: left out of /metrics (health probes, a gateway's choice)
    # Wall-clock times (time.time(), comparable with the Scheduler's): the request came in,
    # was tokenized (and sent), was first put in a batch, had its first token.
    received_at: float = field(default_factory=time.time)
    tokenized_at: float = field(default_factory=time.time)
    scheduled_at: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0  # when this process last received tokens
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[GenerateChunk] = field(default_factory=list)
    finished: bool = False
    num_output_ids: int = 0  # output tokens so far, sent or not

    # Not yet in a chunk.
    new_text: list[str] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_output: ReqOutput | None = None  # the output that brought the prompt's logprobs
    continues_prompt: bool = False

    def absorb(self, out: StrOutput) -> GenerateChunk | None:
        """Add one output of the detokenizer; returns the chunk it makes, if one is due."""
        now = time.time()
        output = out.output
        self.scheduled_at = self.scheduled_at or output.scheduled_at
        if output.new_token_ids and not self.first_token_at:
            # Streamed: when the client could see it; else when the Scheduler sampled it.
            self.first_token_at = now if self.stream else output.first_token_at or now
        if output.new_token_ids:
            self.last_token_at = now
        if out.text:
            self.new_text.append(out.text)
        self.continues_prompt = self.continues_prompt or out.continues_prompt
        self.new_ids.extend(output.new_token_ids)
        self.num_output_ids += len(output.new_token_ids)
        if self.return_logprob:
            self.new_logprobs.extend(output.output_logprobs)
            self.new_top_logprobs.extend(output.output_top_logprobs)
            if output.input_logprobs:
                self.input_output = output
        if output.finish_reason is not None:
            self.finished = True
            self._keep_output_ids(output.completion_tokens)
        if not (self.stream or self.finished):
            return None
        return self._take_chunk(output.finish_reason, now, output)

    def absorb_embedding(self, out: EmbeddingOutput) -> GenerateChunk:
        """The one output of an embedding request: its final chunk."""
        self.finished = True
        self.scheduled_at = out.output.scheduled_at
        chunk = self._take_chunk(out.output.finish_reason, time.time(), out.output)
        chunk.embedding = out.embedding
        return chunk

    def abort_chunk(self, message: str, status_code: int | None = 400) -> GenerateChunk:
        """The final chunk of a request that ended with an error (None: a client's abort)."""
        reason = FinishReason(type="abort", message=message, status_code=status_code)
        return self._take_chunk(reason, time.time())

    def timings(self, finished_at: float) -> dict[str, float | None]:
        """Each stage's time, in seconds since the request was received (None: not reached)."""

        def since(t: float) -> float | None:
            return t - self.received_at if t else None

        return {
            "received": 0.0,
            "tokenized": since(self.tokenized_at),
            "first_scheduled": since(self.scheduled_at),
            "first_token": since(self.first_token_at),
            "finished": since(finished_at),
        }

    def _keep_output_ids(self, count: int) -> None:
        """A stop string ended the text early: only its first `count` tokens count. Tokens
        already streamed past it stay sent; the chunk's completion_tokens says how many hold."""
        if count >= self.num_output_ids:
            return
        keep = max(len(self.new_ids) - (self.num_output_ids - count), 0)
        del self.new_ids[keep:]
        del self.new_logprobs[keep:]
        del self.new_top_logprobs[keep:]
        self.num_output_ids = count

    def _take_chunk(
        self, finish_reason: FinishReason | None, now: float, output: ReqOutput | None = None
    ) -> GenerateChunk:
        chunk = GenerateChunk(
            rid=self.rid,
            path=self.path,
            index=self.index,
            text="".join(self.new_text),
            output_ids=self.new_ids,
            finish_reason=finish_reason,
            completion_tokens=self.num_output_ids,
            e2e_latency=now - self.received_at,
            ttft=self.first_token_at - self.received_at if self.first_token_at else None,
            return_logprob=self.return_logprob,
            continues_prompt=self.continues_prompt,
        )
        if self.return_timings:
            chunk.timings = self.timings(now if finish_reason is not None else 0.0)
        if output is not None:
            chunk.prompt_tokens = output.prompt_tokens
            chunk.cached_tokens = output.cached_tokens
            chunk.image_tokens = output.image_tokens
            chunk.weight_version = output.weight_version
        if self.return_logprob:
            chunk.output_logprobs, chunk.output_top_logprobs = self.new_logprobs, self.new_top_logprobs
            if self.input_output is not None:
                chunk.input_token_ids = self.input_output.input_token_ids
                chunk.input_logprobs = self.input_output.input_logprobs
                chunk.input_top_logprobs = self.input_output.input_top_logprobs
                self.input_output = None
        self.new_text, self.new_ids, self.new_logprobs, self.new_top_logprobs = [], [], [], []
        return chunk
