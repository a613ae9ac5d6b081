"""Owns the loaded model inside the Scheduler process: runs forwards, sizes the KV pool."""

from __future__ import annotations

import logging

import torch

from sluice.model.execution import choose_execution, describe
from sluice.model.forward_batch import ForwardBatch
from sluice.model.llama import LlamaForCausalLM
from sluice.model.llava import LlavaForConditionalGeneration
from sluice.model.model_config import ModelConfig
from sluice.model.quantization import quantization_plan
from sluice.model.weights import load_weights
from sluice.procutil import release_freed_memory

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        dtype: str | torch.dtype = "auto",
        quantization: str = "none",
        kv_cache_dtype: str = "auto",
        context_length: int = 0,
    ) -> None:
        """dtype / kv_cache_dtype: as --dtype / --kv-cache-dtype ("auto" picks for this CPU,
        see execution.py); a torch dtype is taken as the explicit choice. context_length: as
        --context-length (0: the model's own)."""
        self.config = ModelConfig.from_path(model_path).with_context_length(context_length)
        if self.config.text_of is not None:
            logger.warning(
                "serving the language model of this %s checkpoint: its vision tower is not loaded, "
                "so requests with images are refused",
                self.config.text_of,
            )
        # As asked: weights loaded in place of these later run the same way.
        self.load_options = (dtype, quantization, kv_cache_dtype, context_length)
        self.execution = choose_execution(dtype, kv_cache_dtype)
        self.dtype = self.execution.dtype
        self.kv_dtype = self.execution.kv_dtype
        self.model: LlamaForCausalLM | LlavaForConditionalGeneration
        if self.config.vision is None:
            self.model = LlamaForCausalLM(self.config, self.dtype, self.execution.backend, self.kv_dtype)
        else:
            self.model = LlavaForConditionalGeneration(self.config, self.dtype, self.execution.backend, self.kv_dtype)
        # Planned before the weights load: the load drops the GGUF reader.
        plan = quantization_plan(model_path, self.config, quantization, self.execution.backend)
        self.model.load_weights(load_weights(model_path, self.config, self.dtype, plan))
        self.quantized = plan is not None
        if plan is not None:
            self.language_model.quantize(plan)
        self.model.eval()
        release_freed_memory()
        self.execution_info = describe(self.execution, self._weight_formats())
        logger.info("execution: %s", "; ".join(f"{key}: {value}" for key, value in self.execution_info.items()))

    @property
    def language_model(self) -> LlamaForCausalLM:
        model = self.model
        return model.language_model if isinstance(model, LlavaForConditionalGeneration) else model

    def _weight_formats(self) -> list[str]:
        formats = {weight.format.name.lower() for weight in self.language_model.quantized_weights()}
        return sorted(formats)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits of shape [len(fb.logits_indices), vocab_size]."""
        return self.model(fb)

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[N, C, H, W] preprocessed pixels -> [N, config.num_image_tokens, hidden] in the model dtype,
        ready to be a ForwardBatch's `mm_embeds` (flattened over images)."""
        if not isinstance(self.model, LlavaForConditionalGeneration):
            raise ValueError("this model has no vision tower: it takes no images")
        return self.model.encode_images(pixel_values)

    def kv_bytes_per_token(self, sliding_layers_only: bool = False) -> int:
        """Bytes of K and V that one cached token takes, over all layers (or the sliding-window
        layers only)."""
        config = self.config
        layers = config.num_layers
        if sliding_layers_only:
            layers = sum(config.sliding_window(layer) is not None for layer in range(config.num_layers))
        return 2 * layers * config.num_kv_heads * config.head_dim * self.kv_dtype.itemsize

    def new_kv_buffers(
        self, num_slots: int, num_window_slots: int | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V pools of shape [num_slots, num_kv_heads, head_dim] (the sliding-window
        layers' [num_window_slots, ...] where given: they are indexed by window slots); slot 0 is
        padding.

        Only slot 0 is zeroed (padded attention reads it, masked): the rest is written before
        it is read, and untouched pages take no memory until the cache grows into them.
        """
        config = self.config
        rows = [
            num_slots if num_window_slots is None or config.sliding_window(layer) is None else num_window_slots
            for layer in range(config.num_layers)
        ]
        buffers = [torch.empty((n, config.num_kv_heads, config.head_dim), dtype=self.kv_dtype) for n in rows + rows]
        for buffer in buffers:
            buffer[0].zero_()
        return buffers[: config.num_layers], buffers[config.num_layers :]
