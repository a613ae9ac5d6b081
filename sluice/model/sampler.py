"""Pick the next token of every running request from the model's logits.

Order of work on each row: penalties, logit_bias, min_new_tokens masking, a grammar's
allowed tokens (structured output), then either argmax
(greedy) or temperature, top_k, top_p, min_p and a random draw. Reported logprobs are
those of the model's own distribution, before any of this, as SGLang reports them.

Random rows draw by inverse CDF from uniform numbers. A row with a seed takes them
from a hash of (seed, tokens generated so far), so its tokens do not depend on which
other requests share the batch or where the row sits in it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Final, NamedTuple

import torch
from torch import Tensor

from sluice.messages import SamplingParams

# Below this temperature a row is greedy: dividing by it would only approximate argmax.
GREEDY_TEMPERATURE: Final = 1e-5
# From this share of the vocabulary on, one full sort is cheaper than topk.
FULL_SORT_SHARE: Final = 0.25
# top_p stored for rows that do not use it: above any cumulative probability.
TOP_P_OFF: Final = 2.0
# The least top_p stored: a smaller one (valid, > 0) would round to 0 in float32, and then
# not even the most likely token, with no mass above it, would be in the nucleus.
TOP_P_MIN: Final = torch.finfo(torch.float32).tiny
# The largest temperature stored: a larger one (valid, finite) would be inf in float32, and
# a masked logit (-inf) divided by it NaN.
TEMPERATURE_MAX: Final = torch.finfo(torch.float32).max


class SampleOutput(NamedTuple):
    next_token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


class SampledRows(NamedTuple):
    """Rows that draw their token at random, and the settings of each."""

    rows: Tensor  # [S] positions in the batch
    temperatures: Tensor  # [S, 1]
    seed_keys: list[int | None]  # hash of (seed, step); None draws from torch's RNG
    min_ps: Tensor | None  # [S]; None when no row uses min_p
    top_ks: Tensor | None  # [S]; set only in the group whose rows all use top_k
    top_ps: Tensor | None  # [S], TOP_P_OFF where off; None when no row uses top_p

    def uniforms(self, attempt: int, subset: Tensor | None = None) -> Tensor:
        """[S] (or [len(subset)]) float64 in [0, 1): each row's random number for this attempt."""
        keys = self.seed_keys if subset is None else [self.seed_keys[j] for j in subset.tolist()]
        values = torch.rand(len(keys), dtype=torch.float64)
        for j, key in enumerate(keys):
            if key is not None:
                values[j] = _hash_uniform(key, attempt)
        return values


class TokenPenalties(NamedTuple):
    """(row, token) pairs, each once, with the penalty that applies to each. Sparse: a
    request has seen few of the vocabulary's tokens."""

    rows: Tensor  # [N]
    token_ids: Tensor  # [N]
    amounts: Tensor  # [N] float32


@dataclass(slots=True)
class SamplingBatch:
    """Per-step sampling settings of the requests that need a new token, as tensors."""

    batch_size: int
    vocab_size: int
    greedy_rows: Tensor  # [G]
    top_k_rows: SampledRows | None  # sample among their top_k best tokens
    whole_vocab_rows: SampledRows | None  # sample over the whole vocabulary
    # repetition_penalty of tokens in prompt or output
    repetition: TokenPenalties | None
    # frequency_penalty * count + presence_penalty of tokens in the output
    subtracted: TokenPenalties | None
    banned: tuple[Tensor, Tensor] | None  # (rows, token ids) held at -inf
    biased: TokenPenalties | None  # logit_bias: amounts added to the logits
    # Rows with a grammar and the tokens it allows each ([R], bool [R, vocab]); set by the Scheduler.
    allowed: tuple[Tensor, Tensor] | None = None

    @property
    def all_greedy(self) -> bool:
        return self.top_k_rows is None and self.whole_vocab_rows is None

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]],
        eos_token_ids: list[int],
        vocab_size: int,
    ) -> SamplingBatch:
        greedy, top_k, whole_vocab = [], [], []
        for row, p in enumerate(params):
            k = _effective_top_k(p.top_k, vocab_size)
            if p.temperature < GREEDY_TEMPERATURE or k == 1:
                greedy.append(row)
            elif k < vocab_size:
                top_k.append(row)
            else:
                whole_vocab.append(row)
        return cls(
            batch_size=len(params),
            vocab_size=vocab_size,
            greedy_rows=torch.tensor(greedy, dtype=torch.long),
            top_k_rows=_sampled_rows(top_k, params, output_ids, vocab_size),
            whole_vocab_rows=_sampled_rows(whole_vocab, params, output_ids, vocab_size),
            repetition=_build_repetition(params, output_ids, prompt_ids, vocab_size),
            subtracted=_build_subtracted(params, output_ids, vocab_size),
            banned=_build_banned(params, output_ids, eos_token_ids, vocab_size),
            biased=_build_biased(params),
        )


TORCH_ARGMAX_ROWS: Final = partial(torch.argmax, dim=-1)


def sample(
    logits: Tensor,
    batch: SamplingBatch,
    top_logprobs_nums: list[int],
    with_logprobs: bool = True,
    argmax_rows: Callable[[Tensor], Tensor] = TORCH_ARGMAX_ROWS,
) -> SampleOutput:
    """logits: float32 [batch_size, vocab_size]; it is left unchanged. Without `with_logprobs`
    (no row asked for them) the output's logprobs and top_logprobs are empty lists.
    argmax_rows: each row's argmax, for the greedy rows (the backend's, where it is faster)."""
    scores = _penalised(logits, batch)
    if batch.all_greedy:
        next_ids = argmax_rows(scores)
    else:
        next_ids = torch.empty(batch.batch_size, dtype=torch.long)
        if len(batch.greedy_rows):
            next_ids[batch.greedy_rows] = argmax_rows(scores[batch.greedy_rows])
        if (group := batch.top_k_rows) is not None:
            next_ids[group.rows] = _sample_top_k(_scaled(scores, group), group)
        if (group := batch.whole_vocab_rows) is not None:
            next_ids[group.rows] = _sample_whole_vocab(_scaled(scores, group), group)
    if not with_logprobs:
        return SampleOutput(next_ids.tolist(), [], [])
    logprobs_all = torch.log_softmax(logits, -1)
    logprobs = logprobs_all.gather(1, next_ids[:, None]).squeeze(1)
    return SampleOutput(next_ids.tolist(), logprobs.tolist(), _top_logprobs(logprobs_all, top_logprobs_nums))


# ---------------------------------------------------------------- building a batch


def _effective_top_k(top_k: int, vocab_size: int) -> int:
    return vocab_size if top_k <= 0 else min(top_k, vocab_size)


def _sampled_rows(
    rows: list[int], params: list[SamplingParams], output_ids: list[list[int]], vocab_size: int
) -> SampledRows | None:
    if not rows:
        return None
    group = [params[r] for r in rows]
    top_ks = [_effective_top_k(p.top_k, vocab_size) for p in group]
    return SampledRows(
        rows=torch.tensor(rows, dtype=torch.long),
        temperatures=torch.tensor([[min(p.temperature, TEMPERATURE_MAX)] for p in group], dtype=torch.float32),
        seed_keys=[
            None if p.seed is None else _seed_key(p.seed, len(output_ids[r])) for r, p in zip(rows, group, strict=True)
        ],
        min_ps=torch.tensor([p.min_p for p in group]) if any(p.min_p > 0 for p in group) else None,
        top_ks=torch.tensor(top_ks) if all(k < vocab_size for k in top_ks) else None,
        top_ps=torch.tensor([max(p.top_p, TOP_P_MIN) if p.top_p < 1 else TOP_P_OFF for p in group])
        if any(p.top_p < 1 for p in group)
        else None,
    )


_MASK64: Final = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seed_key(seed: int, step: int) -> int:
    return _splitmix64(_splitmix64(seed) ^ step)


def _hash_uniform(key: int, attempt: int) -> float:
    """A number in [0, 1) that depends only on (key, attempt), on any machine."""
    return (_splitmix64(key ^ attempt) >> 11) * 2.0**-53


def _build_repetition(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    prompt_ids: list[list[int]],
    vocab_size: int,
) -> TokenPenalties | None:
    rows = [row for row, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return None
    pair_rows, token_ids, _ = _distinct_tokens(rows, [prompt_ids[r] + output_ids[r] for r in rows], vocab_size)
    penalty_of_row = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32)
    return TokenPenalties(pair_rows, token_ids, penalty_of_row[pair_rows])


def _build_subtracted(
    params: list[SamplingParams], output_ids: list[list[int]], vocab_size: int
) -> TokenPenalties | None:
    rows = [row for row, p in enumerate(params) if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0]
    if not rows:
        return None
    pair_rows, token_ids, counts = _distinct_tokens(rows, [output_ids[r] for r in rows], vocab_size)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=torch.float32)[pair_rows]
    presence = torch.tensor([p.presence_penalty for p in params], dtype=torch.float32)[pair_rows]
    return TokenPenalties(pair_rows, token_ids, frequency * counts + presence)


def _distinct_tokens(rows: list[int], id_lists: list[list[int]], vocab_size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Each distinct (row, token) pair of the lists, and how often it occurs."""
    lengths = torch.tensor([len(ids) for ids in id_lists], dtype=torch.long)
    token_ids = torch.tensor(list(itertools.chain.from_iterable(id_lists)), dtype=torch.long)
    row_of_token = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long), lengths)
    # Image positions hold pad values above the vocabulary: they are no tokens to penalise.
    in_vocab = token_ids < vocab_size
    token_ids, row_of_token = token_ids[in_vocab], row_of_token[in_vocab]
    keys, counts = torch.unique(row_of_token * vocab_size + token_ids, return_counts=True)
    return keys // vocab_size, keys % vocab_size, counts.to(torch.float32)


def _build_biased(params: list[SamplingParams]) -> TokenPenalties | None:
    pairs = [(row, token_id, bias) for row, p in enumerate(params) for token_id, bias in p.logit_bias.items()]
    if not pairs:
        return None
    rows, token_ids, amounts = zip(*pairs, strict=True)
    return TokenPenalties(
        torch.tensor(rows, dtype=torch.long),
        torch.tensor(token_ids, dtype=torch.long),
        torch.tensor(amounts, dtype=torch.float32),
    )


def _build_banned(
    params: list[SamplingParams],
    output_ids: list[list[int]],
    eos_token_ids: list[int],
    vocab_size: int,
) -> tuple[Tensor, Tensor] | None:
    """The tokens that would end a request still short of its min_new_tokens."""
    rows: list[int] = []
    token_ids: list[int] = []
    for row, p in enumerate(params):
        if len(output_ids[row]) < p.min_new_tokens:
            ending = {t for t in (*eos_token_ids, *p.stop_token_ids) if 0 <= t < vocab_size}
            rows += [row] * len(ending)
            token_ids += ending
    if not rows:
        return None
    return torch.tensor(rows, dtype=torch.long), torch.tensor(token_ids, dtype=torch.long)


# ---------------------------------------------------------------- sampling


def _penalised(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """The logits after penalties, logit_bias, bans and grammars; the input itself when
    there are none."""
    if (
        batch.repetition is None
        and batch.subtracted is None
        and batch.banned is None
        and batch.biased is None
        and batch.allowed is None
    ):
        return logits
    scores = logits.clone()
    if (rep := batch.repetition) is not None:
        seen = scores[rep.rows, rep.token_ids]
        scores[rep.rows, rep.token_ids] = torch.where(seen > 0, seen / rep.amounts, seen * rep.amounts)
    if (sub := batch.subtracted) is not None:
        scores.index_put_((sub.rows, sub.token_ids), -sub.amounts, accumulate=True)
    if (bias := batch.biased) is not None:
        scores.index_put_((bias.rows, bias.token_ids), bias.amounts, accumulate=True)
    if batch.banned is not None:
        scores.index_put_(batch.banned, torch.tensor(-math.inf))
    if batch.allowed is not None:
        rows, allowed = batch.allowed
        # 0 where allowed, -inf elsewhere, as 1 - 1/x: four times faster than masked_fill
        # over a vocabulary per row.
        barrier = allowed.to(torch.float32).reciprocal_().neg_().add_(1.0)
        if len(rows) == len(scores):  # rows are in batch order
            scores.add_(barrier)
        else:
            scores.index_put_((rows,), barrier, accumulate=True)
        # Where min_new_tokens banned all the grammar allows (its end), the grammar wins.
        stuck = torch.isneginf(scores.amax(-1)[rows])
        if bool(stuck.any()):
            scores[rows[stuck]] = logits[rows[stuck]] + barrier[stuck]
    return scores


def _scaled(scores: Tensor, group: SampledRows) -> Tensor:
    if len(group.rows) == len(scores):  # rows are always in batch order
        return scores / group.temperatures
    return scores.index_select(0, group.rows).div_(group.temperatures)


def _sample_top_k(scaled: Tensor, group: SampledRows) -> Tensor:
    """Rows with top_k: keep the k best, renormalise, then apply top_p and min_p."""
    assert group.top_ks is not None
    vocab_size = scaled.shape[1]
    most = int(group.top_ks.max())
    if most >= vocab_size * FULL_SORT_SHARE:
        values, token_ids = scaled.sort(-1, descending=True)
    else:
        values, token_ids = scaled.topk(most, -1)
    values = values.masked_fill(torch.arange(values.shape[1]) >= group.top_ks[:, None], -math.inf)
    probs = torch.softmax(values, -1)
    if group.top_ps is not None:
        mass_before = probs.cumsum(-1) - probs
        probs = probs.masked_fill(mass_before >= group.top_ps[:, None], 0.0)
    if group.min_ps is not None:
        probs = probs.masked_fill(probs < probs[:, :1] * group.min_ps[:, None], 0.0)
    # Walk the candidates in token order, so the draw does not depend on how sort/topk
    # ordered tied scores.
    order = token_ids.argsort(-1)
    token_ids, probs = token_ids.gather(1, order), probs.gather(1, order)
    return token_ids.gather(1, _inverse_cdf(probs, group.uniforms(0))[:, None]).squeeze(1)


def _sample_whole_vocab(scaled: Tensor, group: SampledRows) -> Tensor:
    """Rows without top_k. For top_p, draw from the whole distribution and keep the token
    only when less than top_p of probability lies on more likely tokens (that is the
    nucleus); else draw again among the more likely tokens alone. Exact, needs no sort,
    and takes little more than one draw on average: each draw lands in the nucleus with
    probability at least top_p."""
    probs = torch.softmax(scaled, -1)
    if group.min_ps is not None:
        probs.masked_fill_(probs < probs.amax(-1, keepdim=True) * group.min_ps[:, None], 0.0)
    if group.top_ps is None:
        return _inverse_cdf(probs, group.uniforms(0))
    next_ids = torch.empty(len(probs), dtype=torch.long)
    pending = torch.arange(len(probs))
    top_ps = group.top_ps
    for attempt in itertools.count():
        drawn = _inverse_cdf(probs, group.uniforms(attempt, pending))
        more_likely = probs * (probs > probs.gather(1, drawn[:, None]))
        # Rejected only when the mass above is known to reach top_p: a NaN row ends the loop.
        accepted = ~(more_likely.sum(-1) >= top_ps)
        next_ids[pending[accepted]] = drawn[accepted]
        if bool(accepted.all()):
            break
        # Ends: the most likely remaining token has no mass above it, so it is accepted.
        rejected = ~accepted
        pending, top_ps, probs = pending[rejected], top_ps[rejected], more_likely[rejected]
    return next_ids


def _inverse_cdf(weights: Tensor, uniforms: Tensor) -> Tensor:
    """Per row, the first position whose cumulative weight exceeds uniform * total:
    position i is chosen with probability weights[i] / total, and a zero weight never."""
    cdf = weights.cumsum(-1)  # accumulates in float64 on CPU
    totals = cdf[:, -1:]
    targets = (uniforms[:, None] * totals).to(cdf.dtype)
    targets = torch.minimum(targets, torch.nextafter(totals, torch.zeros_like(totals)))
    positions = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    return positions.clamp_(max=weights.shape[1] - 1)


def _top_logprobs(logprobs_all: Tensor, nums: list[int]) -> list[list[tuple[int, float]]]:
    most = min(max(nums, default=0), logprobs_all.shape[1])
    if most == 0:
        return [[] for _ in nums]
    values, token_ids = logprobs_all.topk(most, -1)
    values_list, token_ids_list = values.tolist(), token_ids.tolist()
    return [list(zip(token_ids_list[row][:n], values_list[row][:n], strict=True)) for row, n in enumerate(nums)]
