"""ForwardBatch construction shared by the model tests."""

from __future__ import annotations

import torch

from sluice.model.forward_batch import ForwardBatch


def make_batch(
    requests: list[tuple],
    kv_buffers: tuple[list[torch.Tensor], list[torch.Tensor]],
    all_logits: bool = False,
    prompt: bool = False,
) -> ForwardBatch:
    """One step for requests given as (new token ids, KV slots of the whole sequence after the
    step) or, for a vision model, (..., rows of the new tokens that are image positions, their
    embeddings or None). Logits of every new token with `all_logits`, else of each last one.
    `prompt`: every new token is flagged a prompt token, as the Scheduler flags them."""
    input_ids, positions, out_cache_loc, logits_indices, mm_rows, mm_embeds = [], [], [], [], [], []
    for new_ids, slots, *images in requests:
        image_rows, image_embeds = images or ([], None)
        prefix_len = len(slots) - len(new_ids)
        mm_rows.extend(len(input_ids) + row for row in image_rows)
        if image_embeds is not None:
            mm_embeds.append(image_embeds)
        logits_indices.extend(
            range(len(input_ids), len(input_ids) + len(new_ids)) if all_logits else [len(input_ids) + len(new_ids) - 1]
        )
        input_ids.extend(new_ids)
        positions.extend(range(prefix_len, len(slots)))
        out_cache_loc.append(slots[prefix_len:])
    return ForwardBatch(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        out_cache_loc=torch.cat(out_cache_loc),
        extend_lens=[len(new_ids) for new_ids, *_ in requests],
        seq_lens=[len(slots) for _, slots, *_ in requests],
        kv_indices=[slots for _, slots, *_ in requests],
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
        k_buffers=kv_buffers[0],
        v_buffers=kv_buffers[1],
        mm_rows=torch.tensor(mm_rows, dtype=torch.int64) if mm_rows else None,
        mm_embeds=torch.cat(mm_embeds) if mm_embeds else None,
        prompt_rows=torch.ones(len(input_ids), dtype=torch.bool) if prompt else None,
    )
