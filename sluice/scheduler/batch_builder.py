"""Turn the requests chosen for a step into the model's ForwardBatch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sluice.messages import TokenLogprob
from sluice.model.forward_batch import ForwardBatch
from sluice.model.sampler import SampleOutput, SamplingBatch, sample
from sluice.scheduler.grammar import Grammars
from sluice.scheduler.kv_manager import KVManager
from sluice.scheduler.multimodal import image_rows
from sluice.scheduler.req import Req

if TYPE_CHECKING:
    from sluice.model.model_runner import ModelRunner


@dataclass(slots=True)
class StepBatch:
    reqs: list[Req]
    extend_lens: list[int]
    starts: list[int]  # kv_len of each request before this step
    out_cache_loc: torch.Tensor
    samples: list[bool]  # whether the step completes the request's sequence (a new token is sampled)
    was_prefill: list[bool]
    logits_indices: torch.Tensor
    sample_logit_rows: torch.Tensor  # rows of the logits used for sampling, in request order
    # (request index, prompt position of the token whose logprob a logits row gives)
    input_logprob_rows: list[tuple[int, int, int]]
    # Embedding requests: rows whose final hidden state is pooled, and per request (its
    # index, its first row in those, how many).
    hidden_indices: torch.Tensor | None
    pool_spans: list[tuple[int, int, int]]

    @classmethod
    def allocate(cls, reqs: list[Req], extend_lens: list[int], kv: KVManager) -> StepBatch:
        out_cache_loc = kv.alloc_step(reqs, extend_lens)
        assert out_cache_loc is not None, "the scheduler admitted more tokens than the cache holds"
        starts = [r.kv_len for r in reqs]
        samples = [
            r.kv_len + n == r.seq_len and r.sampling_params.max_new_tokens > 0
            for r, n in zip(reqs, extend_lens, strict=True)
        ]
        logits_indices: list[int] = []
        sample_rows: list[int] = []
        input_rows: list[tuple[int, int, int]] = []
        hidden_rows: list[int] = []
        pool_spans: list[tuple[int, int, int]] = []
        offset = 0
        for i, (req, n) in enumerate(zip(reqs, extend_lens, strict=True)):
            if req.pooling is not None:
                rows = req.pooling_rows(req.kv_len, n)
                pool_spans.append((i, len(hidden_rows), len(rows)))
                hidden_rows.extend(offset + row for row in rows)
            if req.wants_input_logprobs:
                first = max(req.logprob_start_len - 1, req.kv_len)
                for pos in range(first, min(req.kv_len + n, len(req.prompt_ids) - 1)):
                    input_rows.append((i, pos + 1, len(logits_indices)))
                    logits_indices.append(offset + pos - req.kv_len)
            if samples[i]:
                sample_rows.append(len(logits_indices))
                logits_indices.append(offset + n - 1)
            offset += n
        return cls(
            reqs=reqs,
            extend_lens=extend_lens,
            starts=starts,
            out_cache_loc=out_cache_loc,
            samples=samples,
            was_prefill=[not r.is_decoding for r in reqs],
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            sample_logit_rows=torch.tensor(sample_rows, dtype=torch.int64),
            input_logprob_rows=input_rows,
            hidden_indices=torch.tensor(hidden_rows, dtype=torch.int64) if pool_spans else None,
            pool_spans=pool_spans,
        )

    @property
    def sampling_rows(self) -> list[int]:
        """The requests that draw a token this step, by their index in `reqs`."""
        return [i for i, samples in enumerate(self.samples) if samples]

    def sample(
        self,
        logits: torch.Tensor,
        grammars: Grammars,
        eos_token_ids: frozenset[int],
        vocab_size: int,
        argmax_rows: Callable[[torch.Tensor], torch.Tensor],
    ) -> SampleOutput | None:
        """The next token of each of `sampling_rows` (in that order) under its request's
        sampling parameters and grammar; None where no request samples."""
        reqs = [self.reqs[i] for i in self.sampling_rows]
        if not reqs:
            return None
        sampling_batch = SamplingBatch.build(
            [r.sampling_params for r in reqs],
            [r.output_ids for r in reqs],
            [r.prompt_ids for r in reqs],
            list(eos_token_ids),
            vocab_size,
        )
        constrained = [k for k, r in enumerate(reqs) if r.grammar is not None]
        if constrained:
            allowed = grammars.allowed([reqs[k].grammar for k in constrained])
            sampling_batch.allowed = (torch.tensor(constrained, dtype=torch.long), allowed)
        # Rows are gathered only when some logits rows are not sampled (prompt logprobs): a
        # decode step samples every row, and a copy of its [batch, vocab] logits costs ~1 ms.
        rows = self.sample_logit_rows
        return sample(
            logits if len(rows) == len(logits) else logits[rows],
            sampling_batch,
            [r.top_logprobs_num if r.return_logprob else 0 for r in reqs],
            with_logprobs=any(r.return_logprob for r in reqs),
            argmax_rows=argmax_rows,
        )

    def pool_hidden_states(self, hidden_states: torch.Tensor | None) -> None:
        """Add this step's final hidden states to each embedding request's pool."""
        for i, first, count in self.pool_spans:
            assert hidden_states is not None, "the model returns the rows it was asked for"
            self.reqs[i].pool(hidden_states[first : first + count])

    def record_input_logprobs(self, logits: torch.Tensor) -> None:
        """Store prompt-token logprobs for requests that asked for them."""
        if not self.input_logprob_rows:
            return
        rows = torch.tensor([row for _, _, row in self.input_logprob_rows])
        logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
        vocab_size = logprobs.shape[-1]
        for k, (i, pos, _) in enumerate(self.input_logprob_rows):
            req = self.reqs[i]
            token = req.prompt_ids[pos]
            # An image position holds a pad value above the vocabulary, no token to score.
            req.input_logprobs.append(float(logprobs[k, token]) if token < vocab_size else None)
            if req.top_logprobs_num and token >= vocab_size:
                req.input_top_logprobs.append([])
            elif req.top_logprobs_num:
                values, ids = logprobs[k].topk(req.top_logprobs_num)
                req.input_top_logprobs.append(
                    [TokenLogprob(int(t), float(v)) for t, v in zip(ids, values, strict=True)]
                )


def build_forward_batch(
    batch: StepBatch,
    kv: KVManager,
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    runner: ModelRunner | None = None,
) -> ForwardBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    kv_indices: list[torch.Tensor] = []
    seq_lens: list[int] = []
    mm_rows: list[int] = []
    mm_embeds: list[torch.Tensor] = []
    prompt_rows: list[bool] = []
    req_to_token = kv.req_to_token
    offset = 0
    for req, n, start in zip(batch.reqs, batch.extend_lens, batch.starts, strict=True):
        if req.image_offsets and start < len(req.prompt_ids):
            if runner is None:
                raise ValueError("a request with images needs the model runner to embed them")
            rows, embeds = image_rows(req, start, n, runner.encode_images)
            mm_rows.extend(offset + row for row in rows)
            mm_embeds.extend(embeds)
        input_ids.extend(req.fill_slice(start, start + n))
        positions.extend(range(start, start + n))
        prompt_count = min(n, max(0, len(req.prompt_ids) - start))
        prompt_rows.extend([True] * prompt_count + [False] * (n - prompt_count))
        new_slots = batch.out_cache_loc[offset : offset + n]
        req_to_token[req.req_pool_idx, start : start + n] = new_slots
        kv_indices.append(req_to_token[req.req_pool_idx, : start + n])
        seq_lens.append(start + n)
        offset += n
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=batch.out_cache_loc,
        extend_lens=list(batch.extend_lens),
        seq_lens=seq_lens,
        kv_indices=kv_indices,
        logits_indices=batch.logits_indices,
        k_buffers=k_buffers,
        v_buffers=v_buffers,
        mm_rows=torch.tensor(mm_rows, dtype=torch.int64) if mm_rows else None,
        mm_embeds=torch.cat(mm_embeds) if mm_embeds else None,
        hidden_indices=batch.hidden_indices,
        window_slot_of=kv.window_slot_of,
        prompt_rows=torch.tensor(prompt_rows) if any(prompt_rows) else None,
    )
