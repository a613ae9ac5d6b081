"""sluice's LLaVA against transformers' LlavaForConditionalGeneration on a tiny random checkpoint.

The folder comes from `tests.tiny_vlm.build_tiny_llava` (the one servers load), so config
parsing, weight naming, tokenizer, chat template and image processor are covered too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.model.model_config import ModelConfig
from sluice.model.model_runner import ModelRunner
from tests.forward_batches import make_batch
from tests.tiny_vlm import CHAT_TEMPLATE, IMAGE_TOKEN, build_tiny_llava

TEXT_BEFORE = [1, 4093, 198, 1780, 314]  # "<|im_start|>user\nWhat is"
TEXT_AFTER = [47, 2, 198, 1, 520, 9531, 198]  # "?<|im_end|>\n<|im_start|>assistant\n"
NUM_GREEDY_TOKENS = 16


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def random_pixels(seed: int, num_images: int = 1) -> torch.Tensor:
    return torch.randn(num_images, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


class Prompt:
    """Text, one image, text: the ids transformers sees and the rows sluice overwrites."""

    def __init__(self, config: ModelConfig, placeholder_id: int):
        num_image_tokens = config.num_image_tokens
        self.image_rows = list(range(len(TEXT_BEFORE), len(TEXT_BEFORE) + num_image_tokens))
        self.hf_ids = TEXT_BEFORE + [config.image_token_id] * num_image_tokens + TEXT_AFTER
        # sluice must not read the placeholder ids: give it one outside the vocabulary.
        self.sluice_ids = TEXT_BEFORE + [placeholder_id] * num_image_tokens + TEXT_AFTER


def sluice_prompt_logits(runner: ModelRunner, prompt: Prompt, pixels: torch.Tensor) -> torch.Tensor:
    image_embeds = runner.encode_images(pixels)[0]
    kv_buffers = runner.new_kv_buffers(len(prompt.sluice_ids) + 1)
    slots = torch.arange(1, len(prompt.sluice_ids) + 1)
    return runner.forward(
        make_batch([(prompt.sluice_ids, slots, prompt.image_rows, image_embeds)], kv_buffers, all_logits=True)
    )


def sluice_greedy(runner: ModelRunner, prompt: Prompt, pixels: torch.Tensor, num_tokens: int) -> list[int]:
    """Prefill with the image, then decode one token per step through the KV pool (slots reversed)."""
    ids = prompt.sluice_ids
    slots = torch.arange(len(ids) + num_tokens, 0, -1)
    kv_buffers = runner.new_kv_buffers(len(slots) + 1)
    image_embeds = runner.encode_images(pixels)[0]
    logits = runner.forward(make_batch([(ids, slots[: len(ids)], prompt.image_rows, image_embeds)], kv_buffers))
    generated = [int(logits[-1].argmax())]
    while len(generated) < num_tokens:
        seq_len = len(ids) + len(generated)
        logits = runner.forward(make_batch([([generated[-1]], slots[:seq_len], [], None)], kv_buffers))
        generated.append(int(logits[-1].argmax()))
    return generated


def hf_greedy(hf_model, ids: list[int], pixels: torch.Tensor, num_tokens: int) -> list[int]:
    """Greedy tokens by full recomputation: no cache and no generate() stopping rules."""
    generated: list[int] = []
    with torch.inference_mode():
        for _ in range(num_tokens):
            logits = hf_model(input_ids=torch.tensor([ids + generated]), pixel_values=pixels).logits
            generated.append(int(logits[0, -1].argmax()))
    return generated


def hf_logits(hf_model, ids: list[int], pixels: torch.Tensor | None) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(input_ids=torch.tensor([ids]), pixel_values=pixels).logits[0].float()


def load_hf(folder: Path):
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return build_tiny_llava(tmp_path_factory.mktemp("tiny_llava"))


@pytest.fixture(scope="module")
def runner(folder: Path) -> ModelRunner:
    return ModelRunner(str(folder), torch.float32, kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def hf_model(folder: Path):
    return load_hf(folder)


@pytest.fixture(scope="module")
def prompt(runner: ModelRunner) -> Prompt:
    return Prompt(runner.config, placeholder_id=runner.config.vocab_size + 7)


def test_config_describes_the_vision_tower_and_image_token(folder: Path):
    from transformers import AutoTokenizer

    config = ModelConfig.from_path(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert config.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    assert config.vocab_size == len(tokenizer)
    assert config.num_image_tokens == (32 // 8) ** 2  # "default" drops CLIP's class token
    assert config.vision.select_strategy == "default" and config.vision.feature_layers == [1]
    assert (config.hidden_size, config.num_layers, config.num_kv_heads) == (64, 2, 2)
    assert config.eos_token_ids == [2]
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


def test_text_only_config_has_no_vision(tmp_path: Path):
    from transformers import LlamaConfig

    LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    ).save_pretrained(tmp_path)
    config = ModelConfig.from_path(tmp_path)
    assert config.vision is None and config.image_token_id is None and config.num_image_tokens == 0


def test_chat_template_and_image_processor_make_model_inputs(folder: Path, runner: ModelRunner):
    from PIL import Image
    from transformers import AutoImageProcessor, AutoTokenizer

    from sluice.tokenizer_files import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = ChatTemplate.from_model(str(folder), tokenizer)
    assert template.source == CHAT_TEMPLATE
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is"},
                {"type": "image_url", "image_url": {"url": "data:,"}},
                {"type": "text", "text": "?"},
                {"type": "image"},
            ],
        }
    ]
    text = template.render(messages)
    assert text == "<|im_start|>user\nWhat is<image>?<image><|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer(text).input_ids.count(runner.config.image_token_id) == 2
    assert tokenizer("<|im_start|>user\nWhat is").input_ids == TEXT_BEFORE
    assert tokenizer("?<|im_end|>\n<|im_start|>assistant\n").input_ids == TEXT_AFTER

    image = Image.new("RGB", (48, 40), (200, 30, 90))
    pixel_values = AutoImageProcessor.from_pretrained(folder)(image, return_tensors="pt")["pixel_values"]
    embeds = runner.encode_images(pixel_values)
    assert embeds.shape == (1, runner.config.num_image_tokens, runner.config.hidden_size)
    assert embeds.dtype == torch.float32


def test_image_prompt_logits_and_greedy_tokens_match_transformers(runner, hf_model, prompt):
    pixels = random_pixels(seed=1)
    expected = hf_logits(hf_model, prompt.hf_ids, pixels)
    logits = sluice_prompt_logits(runner, prompt, pixels)
    assert logits.shape == expected.shape
    assert relative_error(logits, expected) < 1e-4
    assert sluice_greedy(runner, prompt, pixels, NUM_GREEDY_TOKENS) == hf_greedy(
        hf_model, prompt.hf_ids, pixels, NUM_GREEDY_TOKENS
    )


def test_different_images_give_different_logits(runner, prompt):
    first = sluice_prompt_logits(runner, prompt, random_pixels(seed=1))
    second = sluice_prompt_logits(runner, prompt, random_pixels(seed=2))
    text_rows = slice(0, prompt.image_rows[0])
    assert torch.equal(first[text_rows], second[text_rows])  # causal: text before the image cannot see it
    assert relative_error(first[-1], second[-1]) > 1e-2


def test_batch_of_two_images_matches_each_alone(runner, prompt):
    """Two requests, each with its image, in one step: mm_rows index the whole batch."""
    pixels = random_pixels(seed=3, num_images=2)
    embeds = runner.encode_images(pixels)
    ids = prompt.sluice_ids
    kv_buffers = runner.new_kv_buffers(2 * len(ids) + 1)
    batched = runner.forward(
        make_batch(
            [
                (ids, torch.arange(1, len(ids) + 1), prompt.image_rows, embeds[0]),
                (ids, torch.arange(len(ids) + 1, 2 * len(ids) + 1), prompt.image_rows, embeds[1]),
            ],
            kv_buffers,
        )
    )
    for index in range(2):
        alone = sluice_prompt_logits(runner, prompt, pixels[index : index + 1])[-1]
        assert relative_error(batched[index], alone) < 1e-5
    assert relative_error(batched[0], batched[1]) > 1e-2


def test_text_only_prompt_on_a_llava_runner_matches_transformers(runner, hf_model):
    ids = TEXT_BEFORE + TEXT_AFTER
    kv_buffers = runner.new_kv_buffers(len(ids) + 1)
    logits = runner.forward(make_batch([(ids, torch.arange(1, len(ids) + 1), [], None)], kv_buffers, all_logits=True))
    assert relative_error(logits, hf_logits(hf_model, ids, None)) < 1e-4


@pytest.mark.parametrize(
    "variant",
    [
        dict(select_strategy="full", feature_layer=-1),
        dict(feature_layer=[0, -2]),
        dict(vision_model_type="siglip_vision_model", select_strategy="full", feature_layer=-1),
    ],
    ids=["clip_full_last_layer", "clip_two_feature_layers", "siglip_full"],
)
def test_vision_variants_match_transformers(variant, tmp_path: Path):
    folder = build_tiny_llava(tmp_path, seed=4, **variant)
    runner = ModelRunner(str(folder), torch.float32, kv_cache_dtype="float32")
    prompt = Prompt(runner.config, placeholder_id=0)
    pixels = random_pixels(seed=5)
    assert (
        relative_error(sluice_prompt_logits(runner, prompt, pixels), hf_logits(load_hf(folder), prompt.hf_ids, pixels))
        < 1e-4
    )


def test_bfloat16_runner_encodes_images_in_bfloat16(folder: Path, prompt):
    runner = ModelRunner(str(folder), torch.bfloat16)
    embeds = runner.encode_images(random_pixels(seed=1))
    assert embeds.dtype == torch.bfloat16
    kv_buffers = runner.new_kv_buffers(len(prompt.sluice_ids) + 1)
    slots = torch.arange(1, len(prompt.sluice_ids) + 1)
    logits = runner.forward(make_batch([(prompt.sluice_ids, slots, prompt.image_rows, embeds[0])], kv_buffers))
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
