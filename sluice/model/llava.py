"""LLaVA: a vision tower and projector whose outputs stand in for image placeholder tokens
of a Llama-family language model."""

from __future__ import annotations

import torch
from torch import nn

from sluice.model.backend import Backend
from sluice.model.forward_batch import ForwardBatch
from sluice.model.llama import LlamaForCausalLM
from sluice.model.model_config import ModelConfig
from sluice.model.vision import MultiModalProjector, VisionTower
from sluice.model.weights import Weights


class LlavaForConditionalGeneration(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        backend: Backend | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if config.vision is None:
            raise ValueError("LlavaForConditionalGeneration needs a config with a vision tower (config.vision)")
        self.config = config
        self.dtype = dtype
        self.vision_tower = VisionTower(config.vision, dtype)
        self.multi_modal_projector = MultiModalProjector(config.vision, config.hidden_size, dtype)
        self.language_model = LlamaForCausalLM(config, dtype, backend, kv_dtype)

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] pixels -> [N, num_image_tokens, text hidden] embeddings in the model dtype."""
        return self.multi_modal_projector(self.vision_tower(pixel_values))

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits of shape [len(fb.logits_indices), vocab_size]; image rows come in fb.mm_embeds."""
        return self.language_model(fb)

    @torch.no_grad()
    def load_weights(self, weights: Weights) -> None:
        """Copy weights named as `weights.load_weights` returns them for LLaVA: the language
        model's under `model.`/`lm_head.`, then `vision_tower.` and `multi_modal_projector.`."""
        self.language_model.load_weights(weights)
        # Nothing of a LLaVA model loads as blocks (quantization_plan keeps it dense).
        dense = {name: weight for name, weight in weights.items() if isinstance(weight, torch.Tensor)}
        self.vision_tower.load_weights(dense, "vision_tower.")
        self.multi_modal_projector.load_weights(dense, "multi_modal_projector.")
