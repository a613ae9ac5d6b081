"""Attention over the token-granular KV pool: the metadata of a step, and the torch path.

On the torch path decoding requests are attended as one padded batch, prefilling requests
one by one (SDPA). A model on the C kernels instead attends every token like a decode step
at its position (`AttentionMetadata.build(fb, every_token_decodes=True)`), which makes a
token's result independent of chunking, prefix caching and batching (see backend.py).
Everything that depends only on the batch layout (gather slots, masks, token ranges) is
built once per forward in `AttentionMetadata` and reused by every layer. The pool may hold
a narrower dtype than the activations (a 16-bit or fp8 KV cache): gathered K/V are widened,
and a prompt's own K/V rounded to the pool's dtype first (what later steps will read).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from sluice.model.forward_batch import ForwardBatch

PADDING_SLOT = 0  # reserved by the KV pool, never holds a real token


@dataclass(frozen=True, slots=True)
class AttentionOptions:
    """How one layer's queries attend, beyond causally over their own sequence."""

    scale: float  # scores are q.k * scale
    sliding_window: int | None = None  # a query sees this many keys, its own included; None: all
    softcap: float | None = None  # scores s become softcap * tanh(s / softcap) (Gemma 2)


@dataclass(slots=True)
class PrefillSegment:
    """One request with more than one new token."""

    token_start: int  # its new tokens are rows [token_start, token_end) of the batch
    token_end: int
    kv_slots: torch.Tensor | None  # slots of its whole sequence; None when there is no prefix
    mask: torch.Tensor | None  # bool [extend_len, seq_len], True = may attend; None = plain causal


@dataclass(slots=True)
class AttentionMetadata:
    num_tokens: int
    decode_rows: torch.Tensor | None  # batch rows of the decoding tokens; None when there are none
    decode_kv_slots: torch.Tensor | None  # int64 [num_decode * max_seq_len], padded with PADDING_SLOT
    decode_max_seq_len: int
    decode_seq_lens: torch.Tensor | None  # int64 [num_decode]
    decode_mask: torch.Tensor | None  # bool [num_decode, 1, 1, max_seq_len]; None when no padding
    prefills: list[PrefillSegment]
    # Row of decode_kv_slots each decoding token reads; None: token i reads row i.
    decode_slot_rows: torch.Tensor | None = None
    # bool [num_tokens], True for prompt tokens (ForwardBatch.prompt_rows; C kernel only).
    prompt_rows: torch.Tensor | None = None

    @classmethod
    def build(
        cls, fb: ForwardBatch, every_token_decodes: bool = False, flag_prompts: bool = False
    ) -> AttentionMetadata:
        """flag_prompts: pass ForwardBatch.prompt_rows on as `prompt_rows` (C kernel only)."""
        if every_token_decodes:
            return cls._every_token_decodes(fb, flag_prompts)
        decode_rows: list[int] = []
        decode_kv_indices: list[torch.Tensor] = []
        decode_seq_lens: list[int] = []
        prefills: list[PrefillSegment] = []
        token_start = 0
        for extend_len, seq_len, kv_indices in zip(fb.extend_lens, fb.seq_lens, fb.kv_indices, strict=True):
            if extend_len == 1:
                decode_rows.append(token_start)
                decode_kv_indices.append(kv_indices)
                decode_seq_lens.append(seq_len)
            else:
                prefills.append(_prefill_segment(token_start, extend_len, seq_len, kv_indices))
            token_start += extend_len

        metadata = cls(
            num_tokens=token_start,
            decode_rows=None,
            decode_kv_slots=None,
            decode_max_seq_len=0,
            decode_seq_lens=None,
            decode_mask=None,
            prefills=prefills,
        )
        if decode_rows:
            max_seq_len = max(decode_seq_lens)
            metadata.decode_rows = torch.tensor(decode_rows, dtype=torch.int64)
            metadata.decode_kv_slots = pad_sequence(
                decode_kv_indices, batch_first=True, padding_value=PADDING_SLOT
            ).view(-1)
            metadata.decode_max_seq_len = max_seq_len
            metadata.decode_seq_lens = torch.tensor(decode_seq_lens, dtype=torch.int64)
            if min(decode_seq_lens) != max_seq_len:
                lengths = torch.tensor(decode_seq_lens, dtype=torch.int64)
                mask = torch.arange(max_seq_len).unsqueeze(0) < lengths.unsqueeze(1)
                metadata.decode_mask = mask.view(len(decode_rows), 1, 1, max_seq_len)
        return metadata

    @classmethod
    def _every_token_decodes(cls, fb: ForwardBatch, flag_prompts: bool) -> AttentionMetadata:
        """Token i of request r reads the first positions[i] + 1 slots of r's row (C kernel only)."""
        num_tokens = int(fb.input_ids.shape[0])
        one_per_request = num_tokens == len(fb.extend_lens)
        return cls(
            num_tokens=num_tokens,
            decode_rows=torch.arange(num_tokens),
            decode_kv_slots=pad_sequence(fb.kv_indices, batch_first=True, padding_value=PADDING_SLOT).view(-1),
            decode_max_seq_len=max(fb.seq_lens),
            decode_seq_lens=fb.positions + 1,
            decode_mask=None,
            prefills=[],
            decode_slot_rows=None
            if one_per_request
            else torch.repeat_interleave(torch.arange(len(fb.extend_lens)), torch.tensor(fb.extend_lens)),
            prompt_rows=fb.prompt_rows if flag_prompts else None,
        )

    def through(self, slot_of: torch.Tensor) -> AttentionMetadata:
        """The same attention over other KV slots, `slot_of[slot]` for each: the sliding-window
        layers' own (ForwardBatch.window_slot_of)."""
        return dataclasses.replace(
            self,
            decode_kv_slots=None if self.decode_kv_slots is None else slot_of[self.decode_kv_slots],
            prefills=[
                segment
                if segment.kv_slots is None
                else dataclasses.replace(segment, kv_slots=slot_of[segment.kv_slots])
                for segment in self.prefills
            ],
        )

    @property
    def decode_slots(self) -> torch.Tensor:
        """decode_kv_slots of a batch that has decoding tokens."""
        if self.decode_kv_slots is None:
            raise ValueError("no token of this batch decodes")
        return self.decode_kv_slots

    @property
    def decode_lens(self) -> torch.Tensor:
        """decode_seq_lens of a batch that has decoding tokens."""
        if self.decode_seq_lens is None:
            raise ValueError("no token of this batch decodes")
        return self.decode_seq_lens

    @property
    def decode_only(self) -> bool:
        """Every token decodes, so decode rows are exactly 0..num_tokens-1 in order."""
        return not self.prefills


def _prefill_segment(token_start: int, extend_len: int, seq_len: int, kv_indices: torch.Tensor) -> PrefillSegment:
    prefix_len = seq_len - extend_len
    if prefix_len == 0:
        # K and V come straight from this step's projections: no gather, built-in causal mask.
        return PrefillSegment(token_start, token_start + extend_len, kv_slots=None, mask=None)
    query_positions = torch.arange(prefix_len, seq_len).unsqueeze(1)
    key_positions = torch.arange(seq_len).unsqueeze(0)
    return PrefillSegment(
        token_start, token_start + extend_len, kv_slots=kv_indices, mask=key_positions <= query_positions
    )


def torch_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    metadata: AttentionMetadata,
    options: AttentionOptions,
) -> torch.Tensor:
    """Attend over the pool, which already holds this step's k/v; returns [num_tokens, num_heads * head_dim].

    q is [num_tokens, num_heads, head_dim]; k and v are [num_tokens, num_kv_heads, head_dim].
    """
    num_tokens, num_heads, head_dim = q.shape

    if metadata.decode_only:
        return _decode_attention(q, k_buffer, v_buffer, metadata, options).view(num_tokens, num_heads * head_dim)

    out = q.new_empty(num_tokens, num_heads, head_dim)
    if metadata.decode_rows is not None:
        out[metadata.decode_rows] = _decode_attention(q[metadata.decode_rows], k_buffer, v_buffer, metadata, options)
    for segment in metadata.prefills:
        rows = slice(segment.token_start, segment.token_end)
        out[rows] = _prefill_attention(q[rows], k[rows], v[rows], k_buffer, v_buffer, segment, options)
    return out.view(num_tokens, num_heads * head_dim)


def _decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    metadata: AttentionMetadata,
    options: AttentionOptions,
) -> torch.Tensor:
    num_requests, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    gathered_shape = (num_requests, metadata.decode_max_seq_len, num_kv_heads, head_dim)
    keys = k_buffer.index_select(0, metadata.decode_slots).to(q.dtype).view(gathered_shape).transpose(1, 2)
    values = v_buffer.index_select(0, metadata.decode_slots).to(q.dtype).view(gathered_shape).transpose(1, 2)
    mask = metadata.decode_mask
    if options.sliding_window is not None:
        lengths = metadata.decode_lens.unsqueeze(1)
        positions = torch.arange(metadata.decode_max_seq_len).unsqueeze(0)
        seen = (positions < lengths) & (positions >= lengths - options.sliding_window)
        mask = seen.view(num_requests, 1, 1, -1)
    # The query heads sharing a KV head become that head's "query positions": all sit at the
    # same position, so one mask row serves them, and no KV repeat is needed (SDPA's own
    # GQA path is several times slower in bf16 on CPU).
    grouped_q = q.view(num_requests, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = _attend(grouped_q, keys, values, mask, False, options)
    return out.view(num_requests, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    segment: PrefillSegment,
    options: AttentionOptions,
) -> torch.Tensor:
    if segment.kv_slots is not None:
        k = k_buffer.index_select(0, segment.kv_slots).to(q.dtype)
        v = v_buffer.index_select(0, segment.kv_slots).to(q.dtype)
    elif k_buffer.dtype != q.dtype:
        # The pool's rounding of this step's rows, which later steps read back: the same
        # values whether a prompt comes whole, in chunks or after a cache hit.
        k, v = k.to(k_buffer.dtype).to(q.dtype), v.to(v_buffer.dtype).to(q.dtype)
    mask = segment.mask
    if options.sliding_window is not None:
        # This segment's queries are the last len(q) positions of a sequence of len(k).
        query_positions = torch.arange(len(k) - len(q), len(k)).unsqueeze(1)
        key_positions = torch.arange(len(k)).unsqueeze(0)
        mask = (key_positions <= query_positions) & (key_positions > query_positions - options.sliding_window)
    # [tokens, heads, dim] -> [1, heads, tokens, dim]: with a batch axis SDPA takes its CPU
    # flash kernel; 3-D inputs fall back to a path ~5x slower on long prompts.
    out = _attend(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        mask,
        mask is None,
        options,
    )
    return out[0].transpose(0, 1)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    options: AttentionOptions,
) -> torch.Tensor:
    """SDPA over q [..., Hq, L, D] and k/v [..., Hkv, S, D] (Hq a multiple of Hkv) with a bool
    mask (True = may attend) or none. Soft-capped scores, which SDPA cannot take, go through
    plain ops."""
    if options.softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=options.scale, enable_gqa=True
        )
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)).float() * options.scale
    scores = torch.tanh(scores / options.softcap) * options.softcap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(dim=-1).to(v.dtype) @ v
