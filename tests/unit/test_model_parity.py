"""sluice's model against transformers on the real default model (SmolLM2-135M Q4_1 GGUF).

Both load the same GGUF in float32, so any difference is sluice's: weight layout, RoPE,
attention over the KV pool, batching.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sluice.model.model_runner import ModelRunner
from sluice.model_files import default_model_path
from tests.forward_batches import make_batch

PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWrite a haiku about the sea and the wind over the old harbour.<|im_end|>\n"
    "<|im_start|>assistant\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    return',
]
NUM_GREEDY_TOKENS = 32


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def scattered_slots(count: int, generator_seed: int) -> torch.Tensor:
    """Distinct non-padding slots in shuffled order, as a fragmented pool would hand out."""
    generator = torch.Generator().manual_seed(generator_seed)
    return torch.randperm(4 * count, generator=generator)[:count] + 1


def sluice_greedy(runner: ModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Prefill the prompt, then decode one token per step through the KV pool."""
    slots = scattered_slots(len(prompt_ids) + num_tokens, generator_seed=len(prompt_ids))
    kv_buffers = runner.new_kv_buffers(4 * len(slots) + 1)
    logits = runner.forward(make_batch([(prompt_ids, slots[: len(prompt_ids)])], kv_buffers))
    generated = [int(logits[-1].argmax())]
    while len(generated) < num_tokens:
        seq_len = len(prompt_ids) + len(generated)
        logits = runner.forward(make_batch([([generated[-1]], slots[:seq_len])], kv_buffers))
        generated.append(int(logits[-1].argmax()))
    return generated


@pytest.fixture(scope="module")
def model_path() -> Path:
    return Path(default_model_path())


@pytest.fixture(scope="module")
def prompt_ids(transformers_default_model) -> list[list[int]]:
    return [transformers_default_model.tokenizer(prompt).input_ids for prompt in PROMPTS]


@pytest.fixture(scope="module")
def hf_model(transformers_default_model):
    return transformers_default_model.model


@pytest.fixture(scope="module")
def runner(model_path: Path) -> ModelRunner:
    return ModelRunner(str(model_path), torch.float32, kv_cache_dtype="float32")  # the float reference


@pytest.fixture(scope="module")
def hf_prompt_logits(hf_model, prompt_ids: list[list[int]]) -> list[torch.Tensor]:
    """transformers' logits at every position of every prompt."""
    with torch.inference_mode():
        return [hf_model(torch.tensor([ids])).logits[0].float() for ids in prompt_ids]


def test_prompt_logits_match_transformers_at_every_position(runner, prompt_ids, hf_prompt_logits):
    for ids, expected in zip(prompt_ids, hf_prompt_logits, strict=True):
        kv_buffers = runner.new_kv_buffers(len(ids) + 1)
        slots = torch.arange(1, len(ids) + 1)
        logits = runner.forward(make_batch([(ids, slots)], kv_buffers, all_logits=True))
        assert logits.shape == expected.shape
        assert logits.dtype == torch.float32
        assert relative_error(logits, expected) < 1e-3


def test_greedy_generation_matches_transformers(runner, hf_model, prompt_ids):
    for ids in prompt_ids:
        with torch.inference_mode():
            output = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
                do_sample=False,
                max_new_tokens=NUM_GREEDY_TOKENS,
                pad_token_id=2,
            )
        expected = output[0, len(ids) :].tolist()
        # transformers stops early at eos; sluice's loop does not, so compare what both made.
        assert sluice_greedy(runner, ids, NUM_GREEDY_TOKENS)[: len(expected)] == expected


def test_batched_prompts_match_each_prompt_alone(runner, prompt_ids):
    kv_buffers = runner.new_kv_buffers(sum(map(len, prompt_ids)) + 1)
    requests, next_slot = [], 1
    for ids in prompt_ids:
        requests.append((ids, torch.arange(next_slot, next_slot + len(ids))))
        next_slot += len(ids)
    batched = runner.forward(make_batch(requests, kv_buffers))
    assert len({len(ids) for ids in prompt_ids}) == len(prompt_ids)  # lengths really differ
    for row, ids in enumerate(prompt_ids):
        alone = runner.forward(make_batch([(ids, torch.arange(1, len(ids) + 1))], runner.new_kv_buffers(len(ids) + 1)))
        assert relative_error(batched[row], alone[0]) < 1e-4


def test_mixed_batch_of_decodes_prefill_and_prefix_extend_matches_transformers(runner, prompt_ids, hf_prompt_logits):
    """Two decodes with different cached lengths (padded gather), a fresh prefill and an
    extend on top of a cached prefix, all in one step."""
    short, chat, code = prompt_ids
    kv_buffers = runner.new_kv_buffers(512)
    code_slots = torch.arange(200, 200 + len(code))
    short_slots = torch.arange(300, 300 + len(short))
    chat_slots = torch.arange(400, 400 + len(chat))
    # Fill the caches: chat's first 10 tokens, code's first 20, and a 3-token prefix of short.
    runner.forward(
        make_batch(
            [(chat[:10], chat_slots[:10]), (code[:20], code_slots[:20]), (short[:3], short_slots[:3])], kv_buffers
        )
    )

    logits = runner.forward(
        make_batch(
            [
                (chat[10:11], chat_slots[:11]),  # decode at position 10
                (code[20:21], code_slots[:21]),  # decode at position 20
                (short[3:], short_slots),  # extend after a 3-token prefix
                (chat, torch.arange(1, 1 + len(chat))),  # fresh prefill of the whole chat prompt
            ],
            kv_buffers,
        )
    )

    chat_logits, code_logits, short_logits = hf_prompt_logits[1], hf_prompt_logits[2], hf_prompt_logits[0]
    assert relative_error(logits[0], chat_logits[10]) < 1e-3
    assert relative_error(logits[1], code_logits[20]) < 1e-3
    assert relative_error(logits[2], short_logits[-1]) < 1e-3
    assert relative_error(logits[3], chat_logits[-1]) < 1e-3


# The quantized path (--quantization auto: the GGUF's own Q4_1/Q8_0 blocks through the C
# kernel, activations rounded to int8 blocks) against the dense float32 reference.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a hash table is in two sentences.",
    "Write a short poem about autumn leaves.",
    "How do I reverse a list in Python?",
]
# max |difference| / max |logit| at a decode step. Rounding activations to int8 blocks is
# chaotic over 30 layers: measured 2.6-4.0% with a float32 KV cache and 1.5-5.9% with the
# default float16 one on these prompts, while float16 KV alone moves the dense path's logits
# by 0.03% (test below). The bound leaves room for that spread, not for a broken kernel
# (a wrong block layout or scale is off by 100%).
QUANTIZED_LOGITS_TOLERANCE = 7.5e-2


@pytest.fixture(scope="module")
def quantized_runner(model_path: Path) -> ModelRunner:
    runner = ModelRunner(str(model_path), torch.float32, quantization="auto")  # the default path: float16 KV
    if not runner.quantized:
        pytest.skip("the C kernels are unavailable on this machine")
    return runner


@pytest.fixture(scope="module")
def chat_prompt_ids(transformers_default_model) -> list[list[int]]:
    tokenizer = transformers_default_model.tokenizer
    texts = [
        tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
        for prompt in CHAT_PROMPTS
    ]
    return [tokenizer(text).input_ids for text in texts]


def greedy_choices_along(runner: ModelRunner, prompt_ids: list[int], tokens: list[int]) -> list[int]:
    """The runner's argmax at each step of decoding `tokens` one by one after the prompt
    (teacher forcing: every step sees the same prefix, so one near-tie does not derail the rest)."""
    slots = torch.arange(1, len(prompt_ids) + len(tokens) + 1)
    kv_buffers = runner.new_kv_buffers(len(slots) + 1)
    logits = runner.forward(make_batch([(prompt_ids, slots[: len(prompt_ids)])], kv_buffers))
    choices = [int(logits[-1].argmax())]
    for index, token in enumerate(tokens[:-1]):
        seq_len = len(prompt_ids) + index + 1
        logits = runner.forward(make_batch([([token], slots[:seq_len])], kv_buffers))
        choices.append(int(logits[-1].argmax()))
    return choices


def test_quantized_greedy_choices_match_the_dense_path_on_90_percent_of_tokens(
    runner, quantized_runner, chat_prompt_ids
):
    same = total = 0
    for ids in chat_prompt_ids:
        dense = sluice_greedy(runner, ids, NUM_GREEDY_TOKENS)
        quantized = greedy_choices_along(quantized_runner, ids, dense)
        same += sum(a == b for a, b in zip(dense, quantized, strict=True))
        total += len(dense)
    assert same / total >= 0.9


def test_the_tied_q8_0_table_is_looked_up_in_its_blocks_and_its_float_copy_freed(quantized_runner, runner):
    """The GGUF's Q8_0 embedding serves both as LM head and as the token table: no float32
    copy of its 49,152 x 576 values stays (113 MB), and lookups give the float table's values."""
    model = quantized_runner.model
    assert model.embedding_blocks is not None and model.embed_tokens.numel() == 0
    ids = torch.tensor([0, 1, 2, 17, 4093, 49151])
    assert torch.equal(model.lookup(ids), runner.model.lookup(ids))
    with pytest.raises(IndexError):
        model.lookup(torch.tensor([49152]))


def test_quantized_decode_logits_stay_close_to_the_dense_path(runner, quantized_runner, chat_prompt_ids):
    for ids in chat_prompt_ids:
        slots = torch.arange(1, len(ids) + 1)
        step = [(ids[:-1], slots[:-1])], [(ids[-1:], slots)]
        logits = []
        for model in (runner, quantized_runner):
            kv_buffers = model.new_kv_buffers(len(ids) + 1)
            model.forward(make_batch(step[0], kv_buffers))
            logits.append(model.forward(make_batch(step[1], kv_buffers)))
        assert relative_error(logits[1], logits[0]) < QUANTIZED_LOGITS_TOLERANCE


def test_a_float16_kv_cache_moves_the_dense_logits_by_under_a_thousandth(runner, model_path: Path, chat_prompt_ids):
    half_kv = ModelRunner(str(model_path), torch.float32, kv_cache_dtype="float16")
    assert half_kv.kv_dtype == torch.float16
    for ids in chat_prompt_ids:
        slots = torch.arange(1, len(ids) + 1)
        logits = []
        for model in (runner, half_kv):
            kv_buffers = model.new_kv_buffers(len(ids) + 1)
            model.forward(make_batch([(ids[:-1], slots[:-1])], kv_buffers))
            logits.append(model.forward(make_batch([(ids[-1:], slots)], kv_buffers)))
        assert relative_error(logits[1], logits[0]) < 1e-3
