"""Llama-family causal LM (Llama, SmolLM2, Mistral without sliding window, Qwen2)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sluice.model.attention import AttentionMetadata, attention
from sluice.model.forward_batch import ForwardBatch
from sluice.model.layers import Linear, QKVProjection, RMSNorm, RotaryEmbedding, SwiGLUMLP
from sluice.model.model_config import ModelConfig


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.qkv_proj = QKVProjection(
            config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
            bias=config.attention_bias, dtype=dtype,
        )
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size, dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out_cache_loc: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(self.input_layernorm(hidden)).view(-1, num_qk_heads + self.num_kv_heads, self.head_dim)
        # q and k are rotated together: one set of ops instead of two.
        qk = rotary.apply(qkv[:, :num_qk_heads], cos, signed_sin)
        attn = attention(
            qk[:, : self.num_heads], qk[:, self.num_heads :], qkv[:, num_qk_heads:],
            k_buffer, v_buffer, out_cache_loc, metadata,
        )
        hidden = hidden + self.o_proj(attn)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, config.context_len, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.lm_head = self.embed_tokens  # replaced by load_weights when the model is untied

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits of shape [len(fb.logits_indices), vocab_size]."""
        metadata = AttentionMetadata.build(fb)
        cos, signed_sin = self.rotary.lookup(fb.positions)
        hidden = self._embed(fb)
        for layer, k_buffer, v_buffer in zip(self.layers, fb.k_buffers, fb.v_buffers):
            hidden = layer(hidden, self.rotary, cos, signed_sin, k_buffer, v_buffer, fb.out_cache_loc, metadata)
        # Norm and LM head only for the rows whose logits are wanted: the rest are never read.
        last_hidden = self.norm(hidden[fb.logits_indices])
        return F.linear(last_hidden, self.lm_head).float()

    def _embed(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.mm_rows is None:
            return F.embedding(fb.input_ids, self.embed_tokens)
        # Image rows hold placeholder ids that may lie outside the vocabulary: look up id 0
        # there, then overwrite those rows. Other rows keep the out-of-range check.
        input_ids = fb.input_ids.index_fill(0, fb.mm_rows, 0)
        hidden = F.embedding(input_ids, self.embed_tokens)
        return hidden.index_copy_(0, fb.mm_rows, fb.mm_embeds.to(hidden))

    @torch.no_grad()
    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. Raises on a missing weight."""
        self.embed_tokens.copy_(weights["model.embed_tokens.weight"])
        self.norm.weight.copy_(weights["model.norm.weight"])
        if self.config.tie_word_embeddings or "lm_head.weight" not in weights:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Parameter(weights["lm_head.weight"].to(self.dtype), requires_grad=False)
        for index, layer in enumerate(self.layers):
            _load_layer(layer, weights, f"model.layers.{index}.")


def _load_layer(layer: DecoderLayer, weights: dict[str, torch.Tensor], prefix: str) -> None:
    attn = prefix + "self_attn."
    layer.input_layernorm.weight.copy_(weights[prefix + "input_layernorm.weight"])
    layer.post_attention_layernorm.weight.copy_(weights[prefix + "post_attention_layernorm.weight"])
    layer.qkv_proj.weight.copy_(torch.cat([weights[f"{attn}{name}_proj.weight"] for name in "qkv"]))
    if layer.qkv_proj.bias is not None:
        layer.qkv_proj.bias.copy_(torch.cat([weights[f"{attn}{name}_proj.bias"] for name in "qkv"]))
    layer.o_proj.weight.copy_(weights[attn + "o_proj.weight"])
    mlp = prefix + "mlp."
    layer.mlp.gate_up_weight.copy_(torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]))
    layer.mlp.down_weight.copy_(weights[mlp + "down_proj.weight"])
