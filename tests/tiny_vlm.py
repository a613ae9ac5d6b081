"""A tiny random-weight LLaVA folder that sluice's ModelRunner and a server can both load.

It has the SmolLM2 tokenizer plus an `<image>` token, a ChatML chat template that turns
OpenAI-style image content parts into `<image>`, and a CLIP image processor for 32x32 images.
"""

from __future__ import annotations

from pathlib import Path

import torch

IMAGE_TOKEN = "<image>"
IM_END_ID = 2  # SmolLM2's <|im_end|>: the eos of its chat format
IM_START_ID = 1

# One `<image>` per image part; the server expands it to `num_image_tokens` placeholders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}"
    "{%- elif part['type'] in ['image', 'image_url'] %}{{- '<image>' }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_llava(
    folder: Path,
    seed: int = 0,
    *,
    vision_model_type: str = "clip_vision_model",
    select_strategy: str = "default",
    feature_layer: int | list[int] = -2,
) -> Path:
    """Write the model to `folder` (created if missing) and return it.

    Every weight is random, biases and norms included (HF would zero biases and set norms
    to one, which would hide a bias or norm that sluice dropped). The keyword arguments make
    the variants the unit tests cover; servers use the defaults.
    """
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        SiglipVisionConfig,
    )
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from sluice.model_files import default_model_path
    from sluice.tokenizer_files import load_tokenizer

    folder = Path(folder)
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    tokenizer.chat_template = CHAT_TEMPLATE
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)

    vision_shape = dict(
        image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64
    )
    vision_config_class = {"clip_vision_model": CLIPVisionConfig, "siglip_vision_model": SiglipVisionConfig}[
        vision_model_type
    ]
    text_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=IM_START_ID,
        eos_token_id=IM_END_ID,
        pad_token_id=IM_END_ID,
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision_config_class(**vision_shape),
        text_config=text_config,
        image_token_id=image_token_id,
        vision_feature_select_strategy=select_strategy,
        vision_feature_layer=feature_layer,
    )

    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0.0, 0.1)
    config.image_seq_length = _num_image_tokens(model)
    model.generation_config.bos_token_id = IM_START_ID
    model.generation_config.eos_token_id = IM_END_ID
    model.generation_config.pad_token_id = IM_END_ID
    model.save_pretrained(folder)

    tokenizer.save_pretrained(folder)
    CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(folder)
    return folder


def _num_image_tokens(model) -> int:
    with torch.no_grad():
        return model.get_image_features(pixel_values=torch.zeros(1, 3, 32, 32)).pooler_output[0].shape[0]
