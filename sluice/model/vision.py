"""The vision tower of a LLaVA-style model: a CLIP or SigLIP ViT, without its pooling head.

Images are encoded once, before their prompt's prefill, so this runs whole images through
plain bidirectional attention; nothing here touches the KV pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.model.model_config import VisionConfig

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # Filled by load_weights; `empty` avoids a useless random init.
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class BiasedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> None:
        super().__init__()
        self.weight = _frozen(out_features, in_features, dtype=dtype)
        self.bias = _frozen(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.weight.copy_(weights[prefix + "weight"])
        if self.bias is not None:
            self.bias.copy_(weights[prefix + "bias"])


class LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = _frozen(hidden_size, dtype=dtype)
        self.bias = _frozen(hidden_size, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def load(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.weight.copy_(weights[prefix + "weight"])
        self.bias.copy_(weights[prefix + "bias"])


class EncoderLayer(nn.Module):
    """Pre-norm ViT block: x + attn(ln1(x)), then x + mlp(ln2(x)); q/k/v fused into one matmul."""

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.layer_norm1 = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.qkv_proj = BiasedLinear(config.hidden_size, 3 * config.hidden_size, dtype)
        self.out_proj = BiasedLinear(config.hidden_size, config.hidden_size, dtype)
        self.layer_norm2 = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.fc1 = BiasedLinear(config.hidden_size, config.intermediate_size, dtype)
        self.act = activation(config.hidden_act)
        self.fc2 = BiasedLinear(config.intermediate_size, config.hidden_size, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = hidden.shape
        # [3, batch, heads, tokens, head_dim]
        qkv = (
            self.qkv_proj(self.layer_norm1(hidden))
            .view(batch, tokens, 3, self.num_heads, self.head_dim)
            .permute(2, 0, 3, 1, 4)
        )
        attn = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], scale=1.0 / math.sqrt(self.head_dim))
        hidden = hidden + self.out_proj(attn.transpose(1, 2).reshape(batch, tokens, width))
        return hidden + self.fc2(self.act(self.fc1(self.layer_norm2(hidden))))

    def load(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        attn = prefix + "self_attn."
        self.layer_norm1.load(weights, prefix + "layer_norm1.")
        self.qkv_proj.weight.copy_(torch.cat([weights[f"{attn}{name}_proj.weight"] for name in "qkv"]))
        bias = self.qkv_proj.bias
        assert bias is not None, "the vision tower's qkv projection has a bias"
        bias.copy_(torch.cat([weights[f"{attn}{name}_proj.bias"] for name in "qkv"]))
        self.out_proj.load(weights, attn + "out_proj.")
        self.layer_norm2.load(weights, prefix + "layer_norm2.")
        self.fc1.load(weights, prefix + "mlp.fc1.")
        self.fc2.load(weights, prefix + "mlp.fc2.")


class VisionTower(nn.Module):
    """pixel_values [N, C, H, W] -> the selected hidden states [N, num_image_tokens, hidden * len(feature_layers)].

    Only the layers up to the deepest selected hidden state run; the post-layernorm and
    pooling head are never used by LLaVA and are not loaded.
    """

    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        width = config.hidden_size
        self.patch_embedding = _frozen(width, config.num_channels, config.patch_size, config.patch_size, dtype=dtype)
        self.patch_bias = None if config.has_class_token else _frozen(width, dtype=dtype)  # SigLIP's conv has one
        self.class_embedding = _frozen(width, dtype=dtype) if config.has_class_token else None
        num_positions = config.num_patches + int(config.has_class_token)
        self.position_embedding = _frozen(num_positions, width, dtype=dtype)
        self.pre_layernorm = LayerNorm(width, config.layer_norm_eps, dtype) if config.has_class_token else None
        self.feature_layers = config.feature_layers
        self.layers = nn.ModuleList(EncoderLayer(config, dtype) for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = self.config.image_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != (self.config.num_channels, size, size):
            raise ValueError(
                f"pixel_values must be [N, {self.config.num_channels}, {size}, {size}], got {list(pixel_values.shape)}"
            )
        pixels = pixel_values.to(self.patch_embedding.device, self.dtype)
        patches = F.conv2d(pixels, self.patch_embedding, self.patch_bias, stride=self.config.patch_size)
        hidden = patches.flatten(2).transpose(1, 2)  # [N, num_patches, width], patches in row-major order
        if self.class_embedding is not None:
            hidden = torch.cat([self.class_embedding.expand(len(hidden), 1, -1), hidden], dim=1)
        hidden = hidden + self.position_embedding
        if self.pre_layernorm is not None:
            hidden = self.pre_layernorm(hidden)

        hidden_states = [hidden]  # index i: after i layers, as HF's `hidden_states`
        for layer in self.layers:
            hidden_states.append(layer(hidden_states[-1]))
        features = torch.cat([hidden_states[index] for index in self.feature_layers], dim=-1)
        return features[:, 1:] if self.config.select_strategy == "default" else features

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy HF-named CLIP/SigLIP vision weights under `prefix` (e.g. "vision_tower.")."""
        embeddings = prefix + "embeddings."
        self.patch_embedding.copy_(weights[embeddings + "patch_embedding.weight"])
        if self.patch_bias is not None:
            self.patch_bias.copy_(weights[embeddings + "patch_embedding.bias"])
        if self.class_embedding is not None:
            self.class_embedding.copy_(weights[embeddings + "class_embedding"])
        self.position_embedding.copy_(weights[embeddings + "position_embedding.weight"])
        if self.pre_layernorm is not None:
            self.pre_layernorm.load(weights, prefix + "pre_layrnorm.")  # sic: HF's spelling
        for index, layer in enumerate(cast(list[EncoderLayer], list(self.layers))):  # nn.ModuleList is untyped
            layer.load(weights, f"{prefix}encoder.layers.{index}.")


class MultiModalProjector(nn.Module):
    """linear_2(act(linear_1(x))): vision features into the language model's embedding space."""

    def __init__(self, config: VisionConfig, text_hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        in_features = config.hidden_size * len(config.feature_layers)
        self.linear_1 = BiasedLinear(in_features, text_hidden_size, dtype, bias=config.projector_bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = BiasedLinear(text_hidden_size, text_hidden_size, dtype, bias=config.projector_bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor], prefix: str) -> None:
        self.linear_1.load(weights, prefix + "linear_1.")
        self.linear_2.load(weights, prefix + "linear_2.")
