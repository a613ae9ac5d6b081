"""Tiny random-weight causal LMs of other architectures, saved as HF folders with SmolLM2's
tokenizer, for serving them for real."""

from __future__ import annotations

from pathlib import Path

import torch

SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def qwen3_config(vocab_size: int, eos_token_id: int):
    from transformers import Qwen3Config

    # YaRN switched on as Qwen3's model card says (4 x the trained length), trained on 128.
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    return Qwen3Config(
        **SHAPE,
        vocab_size=vocab_size,
        head_dim=32,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        rope_parameters=rope,
    )


def phi3_config(vocab_size: int, eos_token_id: int):
    from transformers import Phi3Config

    half = 64 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }
    return Phi3Config(
        **SHAPE,
        vocab_size=vocab_size,
        original_max_position_embeddings=64,
        rope_parameters=rope,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


def gemma2_config(vocab_size: int, eos_token_id: int):
    from transformers import Gemma2Config

    # Every other layer sees a window of 8 keys; scores and logits soft-capped where they bend.
    return Gemma2Config(
        **SHAPE,
        vocab_size=vocab_size,
        head_dim=16,
        sliding_window=8,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=5.0,
        eos_token_id=eos_token_id,
        pad_token_id=0,
        attn_implementation="eager",
    )


def gemma3_config(vocab_size: int, eos_token_id: int):
    from transformers import Gemma3TextConfig

    # A window of 8 keys in the first layer (RoPE base 10,000), the second global (1,000,000).
    return Gemma3TextConfig(
        **SHAPE,
        vocab_size=vocab_size,
        head_dim=32,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
        eos_token_id=eos_token_id,
        pad_token_id=0,
    )


CONFIGS = {"qwen3": qwen3_config, "phi3": phi3_config, "gemma2": gemma2_config, "gemma3": gemma3_config}


def build_tiny_model(folder: Path, family: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    from sluice.model_files import default_model_path
    from sluice.tokenizer_files import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](len(tokenizer), tokenizer.eos_token_id)).eval()
    randomize(model)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def randomize(model: torch.nn.Module) -> None:
    """Every weight random: HF zeroes biases and sets norms to one, which would hide a bias
    or norm that sluice dropped."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)


def hf_greedy(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy continuation of exactly `num_tokens` tokens."""
    with torch.inference_mode():
        return model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=num_tokens,
            min_new_tokens=num_tokens,
            pad_token_id=0,
        )[0, len(prompt_ids) :].tolist()
