"""The TokenizerManager's state of one live request, and the response chunks built from it."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from sluice.messages import FinishReason, StrOutput, TokenLogprob


@dataclass(slots=True, eq=False)
class ReqState:
    rid: str
    stream: bool
    return_logprob: bool = False
    # Extra meta_info keys (e.g. the batch path and the item index).
    extra_meta: dict[str, Any] = field(default_factory=dict)
    created_s: float = field(default_factory=time.perf_counter)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    pending: list[dict[str, Any]] = field(default_factory=list)
    finished: bool = False

    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    input_token_ids: list[int] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    first_token_s: float | None = None

    def absorb(self, out: StrOutput) -> dict[str, Any]:
        """Add one output of the detokenizer and return the response chunk it makes."""
        now = time.perf_counter()
        if out.new_token_ids and self.first_token_s is None:
            self.first_token_s = now
        self.text += out.text
        self.output_ids.extend(out.new_token_ids)
        if self.return_logprob:
            self.output_logprobs.extend(out.output_logprobs)
            self.output_top_logprobs.extend(out.output_top_logprobs)
            if out.input_logprobs:
                self.input_token_ids = out.input_token_ids
                self.input_logprobs = out.input_logprobs
                self.input_top_logprobs = out.input_top_logprobs
        if out.finish_reason is not None:
            self.finished = True
            # A stop string ends the text early: report only the tokens it covers.
            del self.output_ids[out.completion_tokens :]
            del self.output_logprobs[out.completion_tokens :]
            del self.output_top_logprobs[out.completion_tokens :]
        return {
            "text": self.text,
            "output_ids": list(self.output_ids),
            "meta_info": self.meta_info(out, now),
        }

    def meta_info(self, out: StrOutput, now: float) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": out.finish_reason.to_json() if out.finish_reason else None,
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": len(self.output_ids),
            "cached_tokens": out.cached_tokens,
            "image_tokens": out.image_tokens,
            "e2e_latency": now - self.created_s,
            **self.extra_meta,
        }
        if self.first_token_s is not None:
            meta["ttft"] = self.first_token_s - self.created_s
        if self.return_logprob:
            meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(self.output_logprobs, self.output_ids)]
            meta["output_top_logprobs"] = [[[t.logprob, t.token_id, None] for t in tops] for tops in self.output_top_logprobs]
            meta["input_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(self.input_logprobs, self.input_token_ids)]
            meta["input_top_logprobs"] = [[[t.logprob, t.token_id, None] for t in tops] for tops in self.input_top_logprobs]
        return meta


def abort_chunk(state: ReqState, message: str, status_code: int = 400) -> dict[str, Any]:
    """The final chunk of a request that ended with an error."""
    reason = FinishReason(type="abort", message=message, status_code=status_code)
    return {
        "text": state.text,
        "output_ids": list(state.output_ids),
        "meta_info": {"id": state.rid, "finish_reason": reason.to_json(), "prompt_tokens": 0,
                      "completion_tokens": len(state.output_ids), "cached_tokens": 0,
                      "e2e_latency": time.perf_counter() - state.created_s, **state.extra_meta},
    }
