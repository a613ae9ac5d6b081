"""What the Scheduler hands the model for one forward step."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ForwardBatch:
    """One step over a mix of prefilling and decoding requests, in request order.

    KV lives in a token-granular pool owned by the Scheduler: per layer, `k_buffers[layer]`
    and `v_buffers[layer]` are [num_slots, num_kv_heads, head_dim] in the KV cache's dtype.
    Slot 0 is reserved for padding and never holds a token.
    """

    input_ids: torch.Tensor  # int64 [num_tokens]: the new tokens of every request, concatenated
    positions: torch.Tensor  # int64 [num_tokens]: each new token's position in its sequence
    out_cache_loc: torch.Tensor  # int64 [num_tokens]: KV slot that receives each new token's K and V
    extend_lens: list[int]  # new tokens per request (1 for a decoding request)
    seq_lens: list[int]  # tokens per request after this step (cached prefix + new)
    kv_indices: list[torch.Tensor]  # per request, int64 [seq_len]: slots of the whole sequence in order
    logits_indices: torch.Tensor  # int64: rows of the num_tokens axis whose logits to return
    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    # Image positions of a vision-language model: their input ids are placeholders (any
    # value) and their embeddings come from the vision tower instead of the vocabulary.
    mm_rows: torch.Tensor | None = None  # int64 [num_image_rows]: rows of the num_tokens axis
    mm_embeds: torch.Tensor | None = None  # [num_image_rows, hidden] in the model dtype
    # Rows of the num_tokens axis whose final (normed) hidden state an embedding request
    # pools; the model fills `hidden_states` ([len(hidden_indices), hidden], float32).
    hidden_indices: torch.Tensor | None = None
    hidden_states: torch.Tensor | None = None
    # A model with sliding-window layers: their K/V buffers are indexed by window slots,
    # `window_slot_of[slot]` (0 = padding for a token no query of this step sees through a
    # window). None: every layer is indexed by the slots above.
    window_slot_of: torch.Tensor | None = None
    # bool [num_tokens]: True for the tokens of a request's prompt (positions before its
    # first generated token), which an AMX-BF16 build multiplies on bf16 tiles, False for
    # generated ones (decode steps, and a retracted request's recomputed output). None: all
    # rows on the int8 path.
    prompt_rows: torch.Tensor | None = None
