"""Image tokens in the Scheduler (seed 000): expand, record offsets, embed lazily.

A request arrives with one image token per image. Each becomes `num_image_tokens`
positions holding a pad value derived from the image's content hash: the radix cache keys
on token ids, so the same image reuses its cached prefix and different images never share
one. Pad values lie above the vocabulary; the model embeds those rows from the vision
tower's output instead of the embedding table. The vision tower runs at most once per
image per request, and only if a prefill chunk actually computes that image's positions.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from sluice.messages import ImageInput
from sluice.scheduler.req import Req

PAD_VALUE_RANGE = 1 << 30


def pad_value(image_hash: int, vocab_size: int) -> int:
    return vocab_size + image_hash % PAD_VALUE_RANGE


def expand_image_tokens(req: Req, image_token_id: int, num_image_tokens: int, vocab_size: int) -> str | None:
    """Rewrite req.prompt_ids in place; returns an error message or None."""
    positions = [i for i, token in enumerate(req.prompt_ids) if token == image_token_id]
    if len(positions) != len(req.images):
        return f"the prompt has {len(positions)} image tokens for {len(req.images)} images"
    expanded: list[int] = []
    offsets: list[int] = []
    last = 0
    for position, image in zip(positions, req.images, strict=True):
        expanded.extend(req.prompt_ids[last:position])
        offsets.append(len(expanded))
        expanded.extend([pad_value(image.hash, vocab_size)] * num_image_tokens)
        last = position + 1
    expanded.extend(req.prompt_ids[last:])
    req.prompt_ids = expanded
    req.image_offsets = offsets
    req.num_image_tokens = num_image_tokens
    req.image_token_id = image_token_id
    return None


def image_rows(
    req: Req, start: int, length: int, encode_images: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[list[int], list[torch.Tensor]]:
    """For the chunk of positions [start, start + length): the chunk-relative rows that are
    image positions, and their embeddings (computing an image's embedding on first use)."""
    rows: list[int] = []
    embeds: list[torch.Tensor] = []
    end = start + length
    for index, offset in enumerate(req.image_offsets):
        lo, hi = max(start, offset), min(end, offset + req.num_image_tokens)
        if lo >= hi:
            continue
        if index not in req.image_embeds:
            req.image_embeds[index] = encode_images(pixels(req.images[index]).unsqueeze(0))[0]
        rows.extend(range(lo - start, hi - start))
        embeds.append(req.image_embeds[index][lo - offset : hi - offset])
    return rows, embeds


def pixels(image: ImageInput) -> torch.Tensor:
    array = np.frombuffer(image.pixel_values, dtype=np.dtype(image.dtype)).reshape(image.shape)
    return torch.from_numpy(array.copy())
