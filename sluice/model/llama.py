"""Llama-family causal LM (Llama, SmolLM2, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3).

Gemma differs in configuration only (model_config.py): GeGLU, sandwich norms (attention and
MLP outputs normed before the residual add), scaled embeddings, sliding-window layers with
their own RoPE base, soft-capped scores and logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from sluice.kernels.contract import Activation
from sluice.kernels.decode_layers import DecodeLayers, LayerTensors
from sluice.model.attention import AttentionMetadata, AttentionOptions
from sluice.model.backend import Backend, KernelBackend, TorchBackend
from sluice.model.block_rows import BlockFormat
from sluice.model.forward_batch import ForwardBatch
from sluice.model.layers import GatedMLP, Linear, QKVProjection, RMSNorm, RotaryEmbedding
from sluice.model.llama_weights import load_llama_weights, quantize_llama
from sluice.model.model_config import ModelConfig
from sluice.model.quantized_linear import QuantizedLinearWeight, QuantizedProjection
from sluice.model.weights import Weights

# A layer's rotation: the RotaryEmbedding and the cos / signed sin of this step's positions.
RopeTables = tuple[RotaryEmbedding, torch.Tensor, torch.Tensor]


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, dtype: torch.dtype, backend: Backend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.backend = backend
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, backend)
        self.qkv_proj = QKVProjection(
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            bias=config.attention_bias,
            dtype=dtype,
            backend=backend,
        )
        # Qwen3: every q and k head is RMS-normalized (one weight per head_dim) before rotation.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, backend) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype, backend) if config.qk_norm else None
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, dtype, backend)
        # Without sandwich norms this is the norm before the MLP; with them (Gemma), the norm
        # of the attention output, and the two feed-forward norms surround the MLP.
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, backend)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, backend)
            self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, backend)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_activation, dtype, backend)
        self.attention_options = AttentionOptions(
            config.attention_scale, config.sliding_window(index), config.attn_logit_softcap
        )
        # Which of the model's rotations this layer takes: Gemma 3's sliding-window layers
        # have their own RoPE base (LlamaForCausalLM.rotaries[1]).
        self.rope_index = int(config.local_rope_theta is not None and config.sliding_window(index) is not None)

    def forward(
        self,
        hidden: torch.Tensor,
        pending: torch.Tensor | None,
        rope: RopeTables,
        k_buffer: torch.Tensor,
        v_buffer: torch.Tensor,
        out_cache_loc: torch.Tensor,
        metadata: AttentionMetadata,
        prompt_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (residual stream, this layer's MLP output): the caller adds the second to the
        first, fused with the next norm, so `pending` is the previous layer's (None for the first).
        prompt_rows: see ForwardBatch."""
        if pending is None:
            normed = self.input_layernorm(hidden)
        else:
            hidden, normed = self.input_layernorm.add_and_norm(hidden, pending)
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(normed, prompt_rows).view(-1, num_qk_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            self.q_norm.norm_heads(qkv[:, : self.num_heads])
            self.k_norm.norm_heads(qkv[:, self.num_heads : num_qk_heads])
        rotary, cos, signed_sin = rope
        q, k = self.backend.rotate_and_store(
            qkv, self.num_heads, self.num_kv_heads, rotary, cos, signed_sin, k_buffer, v_buffer, out_cache_loc
        )
        attn = self.backend.attention(q, k, qkv[:, num_qk_heads:], k_buffer, v_buffer, metadata, self.attention_options)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden, normed = self.post_attention_layernorm.add_and_norm(hidden, self.o_proj(attn, prompt_rows))
            return hidden, self.mlp(normed, prompt_rows)
        attended = self.post_attention_layernorm(self.o_proj(attn, prompt_rows))
        hidden, normed = self.pre_feedforward_layernorm.add_and_norm(hidden, attended)
        return hidden, self.post_feedforward_layernorm(self.mlp(normed, prompt_rows))


class LlamaForCausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype = torch.float32,
        backend: Backend | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.backend = TorchBackend() if backend is None else backend
        if isinstance(self.backend, KernelBackend) and dtype != torch.float32:
            raise ValueError(f"the C kernels take float32 activations, not {dtype}")
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), requires_grad=False
        )
        rotary = RotaryEmbedding(
            config.head_dim, config.rope_theta, config.rope_scaling, config.context_len, dtype, config.rotary_dim
        )
        if config.local_rope_theta is None:
            self.rotaries = nn.ModuleList([rotary])
        else:  # Gemma 3's sliding-window layers: their own base, unscaled
            local = RotaryEmbedding(config.head_dim, config.local_rope_theta, None, config.context_len, dtype)
            self.rotaries = nn.ModuleList([rotary, local])
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, dtype, self.backend) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, self.backend)
        self.lm_head = self.embed_tokens  # replaced by load_weights when the model is untied
        self.lm_head_quantized: QuantizedLinearWeight | None = None
        # Set by quantize() for a tied table whose blocks give back its values exactly: token
        # lookup then reads them, and the float32 copy of the table is freed.
        self.embedding_blocks: QuantizedLinearWeight | None = None
        # Set by quantize() when every projection is quantized: all layers run in one C call.
        self.decode_layers: DecodeLayers | None = None
        # Set by quantize(): prompt tokens attend as prompt rows (on an AMX-BF16 build, on bf16
        # tiles, as their quantized matmuls run). Dense weights keep float32 attention too.
        self.prompt_attention = False

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        return cast(list[DecoderLayer], list(self.layers))  # nn.ModuleList holds them untyped

    def forward(self, fb: ForwardBatch) -> torch.Tensor:
        """float32 logits of shape [len(fb.logits_indices), vocab_size]."""
        metadata = AttentionMetadata.build(
            fb, every_token_decodes=self.backend.every_token_decodes, flag_prompts=self.prompt_attention
        )
        rotaries = cast(list[RotaryEmbedding], list(self.rotaries))  # nn.ModuleList holds them untyped
        ropes: list[RopeTables] = [(rotary, *rotary.lookup(fb.positions)) for rotary in rotaries]
        hidden = self._embed(fb)
        # The sliding-window layers' K/V slots, where they have their own (see ForwardBatch).
        window_cache_loc, window_metadata = fb.out_cache_loc, metadata
        if fb.window_slot_of is not None:
            window_cache_loc, window_metadata = fb.window_slot_of[fb.out_cache_loc], metadata.through(fb.window_slot_of)
        # Decode steps in one call; a prompt's last token alone (its prefix cached) takes the
        # per-op path, whose matmuls multiply prompt rows as every other prompt row.
        if self.decode_layers is not None and metadata.decode_only and fb.prompt_rows is None:
            _, cos, signed_sin = ropes[0]
            local_rope = (ropes[1][1], ropes[1][2]) if len(ropes) > 1 else None
            hidden = self.decode_layers.run(
                hidden,
                cos,
                signed_sin,
                fb.out_cache_loc,
                metadata.decode_slots,
                metadata.decode_slot_rows,
                metadata.decode_lens,
                metadata.decode_max_seq_len,
                fb.k_buffers,
                fb.v_buffers,
                local_rope,
                window_slots=(window_cache_loc, window_metadata.decode_slots)
                if fb.window_slot_of is not None
                else None,
            )
        else:
            pending = None
            for layer, k_buffer, v_buffer in zip(self.decoder_layers, fb.k_buffers, fb.v_buffers, strict=True):
                windowed = layer.attention_options.sliding_window is not None
                hidden, pending = layer(
                    hidden,
                    pending,
                    ropes[layer.rope_index],
                    k_buffer,
                    v_buffer,
                    window_cache_loc if windowed else fb.out_cache_loc,
                    window_metadata if windowed else metadata,
                    fb.prompt_rows,
                )
            assert pending is not None, "a model has at least one layer"
            hidden = hidden + pending
        if fb.hidden_indices is not None:
            fb.hidden_states = self.norm(hidden[fb.hidden_indices]).float()
        # Norm and LM head only for the rows whose logits are wanted: the rest are never read.
        # The LM head keeps the int8 path for every row: a step's few logits rows (one a
        # request) would each cost the bf16 tiles a dequantization of the whole table.
        last_hidden = self.norm(hidden[fb.logits_indices])
        logits = self.backend.linear(last_hidden, self.lm_head, self.lm_head_quantized).float()
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _embed(self, fb: ForwardBatch) -> torch.Tensor:
        if fb.mm_rows is None:
            return self.lookup(fb.input_ids)
        # Image rows hold placeholder ids that may lie outside the vocabulary: look up id 0
        # there, then overwrite those rows. Other rows keep the out-of-range check.
        assert fb.mm_embeds is not None, "image rows come with their embeddings"
        input_ids = fb.input_ids.index_fill(0, fb.mm_rows, 0)
        hidden = self.lookup(input_ids)
        return hidden.index_copy_(0, fb.mm_rows, fb.mm_embeds.to(hidden))

    def lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embeddings of `input_ids` [tokens] -> [tokens, hidden] (scaled, for Gemma)."""
        if self.embedding_blocks is None:
            embeddings = F.embedding(input_ids, self.embed_tokens)
        else:
            if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size):
                raise IndexError(f"token ids must lie in [0, {self.config.vocab_size})")
            embeddings = self.embedding_blocks.rows(input_ids).to(self.dtype)
        multiplier = self.config.embedding_multiplier
        # As transformers does, the multiplier rounded to the model dtype first.
        return embeddings if multiplier is None else embeddings * torch.tensor(multiplier, dtype=self.dtype)

    def load_weights(self, weights: Weights) -> None:
        """Move HF-named weights in (each leaves `weights`); see llama_weights.py."""
        load_llama_weights(self, weights)

    def quantize(self, format_of: Callable[[str], BlockFormat | None]) -> None:
        """Replace the projection weights still dense by block-quantized ones; see llama_weights.py."""
        quantize_llama(self, format_of)

    def quantized_weights(self) -> list[QuantizedLinearWeight]:
        """Every block-quantized matrix the model multiplies (a stacked projection's parts apart)."""
        weights: list[QuantizedProjection | None] = [self.lm_head_quantized]
        for layer in self.decoder_layers:
            weights += [
                layer.qkv_proj.quantized,
                layer.o_proj.quantized,
                layer.mlp.gate_up_quantized,
                layer.mlp.down_quantized,
            ]
        return [part for weight in weights if weight is not None for part in weight.parts]

    def fused_decode_layers(self, backend: KernelBackend) -> DecodeLayers | None:
        """The one-call path, when every layer's four projections are quantized."""
        config = self.config
        tensors: list[LayerTensors] = []
        for layer in self.decoder_layers:
            qkv, o, gate_up, down = (
                layer.qkv_proj.quantized,
                layer.o_proj.quantized,
                layer.mlp.gate_up_quantized,
                layer.mlp.down_quantized,
            )
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            tensors.append(
                LayerTensors(
                    layer.input_layernorm.weight,
                    layer.post_attention_layernorm.weight,
                    qkv,
                    o,
                    gate_up,
                    down,
                    qkv_bias=layer.qkv_proj.bias,
                    q_norm=_norm_weight(layer.q_norm),
                    k_norm=_norm_weight(layer.k_norm),
                    sliding_window=layer.attention_options.sliding_window,
                    pre_feedforward_norm=_norm_weight(layer.pre_feedforward_layernorm),
                    post_feedforward_norm=_norm_weight(layer.post_feedforward_layernorm),
                    local_rope=layer.rope_index == 1,
                )
            )
        return DecodeLayers(
            backend.ops,
            tensors,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.intermediate_size,
            config.rms_norm_eps,
            self.kv_dtype,
            config.attention_scale,
            Activation.GELU_TANH if config.mlp_activation == "gelu_tanh" else Activation.SILU,
            config.attn_logit_softcap,
        )


def _norm_weight(norm: RMSNorm | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight
