"""sluice's model against transformers on tiny random-weight checkpoints of each family.

Each variant is saved with `save_pretrained` (safetensors) and loaded back by sluice's
ModelRunner from the folder, so config parsing and weight naming are covered too.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.kernels.loader import kernels_available
from sluice.model.block_rows import BlockFormat
from sluice.model.model_config import ModelConfig
from sluice.model.model_runner import ModelRunner
from tests.forward_batches import make_batch
from tests.gguf_files import write_gguf
from tests.tiny_lms import hf_greedy, randomize

SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,  # no early stop in generate()
)
PROMPT_IDS = [17, 200, 3, 99, 45, 45, 128, 7, 250, 64, 1, 33]
NUM_GREEDY_TOKENS = 16


def llama_llama3_rope_untied():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=False, rope_parameters=rope))


def llama_linear_rope_tied():
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_parameters=rope))


def qwen2_with_qkv_bias():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False))


def qwen3_with_qk_norm():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # Per-head q/k RMSNorm; head_dim * heads != hidden_size, as in Qwen3's own sizes.
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True))


def qwen3_yarn():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # YaRN as Qwen's model cards switch it on (4 times the trained length), at a trained
    # length of 64 so that its ramp falls within a 32-dimension head.
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64}
    return Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32, tie_word_embeddings=True, rope_parameters=rope))


def qwen2_yarn_with_its_own_attention_factor_and_betas():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 128,
        "attention_factor": 1.5,
        "beta_fast": 16.0,
        "beta_slow": 2.0,
    }
    return Qwen2ForCausalLM(Qwen2Config(**SHAPE, tie_word_embeddings=False, rope_parameters=rope))


def llama_yarn_untruncated_with_mscales():
    from transformers import LlamaConfig, LlamaForCausalLM

    # DeepSeek's spelling of the attention factor (a ratio of two mscales), the ramp's ends
    # not rounded to whole dimensions, and no trained length: max_position_embeddings's.
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.5}
    rope["truncate"] = False
    return LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True, rope_parameters=rope))


def phi3_longrope():
    from transformers import Phi3Config, Phi3ForCausalLM

    # Fused qkv_proj / gate_up_proj; LongRoPE (the short factors below 64 tokens, cos/sin
    # scaled by sqrt(1 + ln 8 / ln 64)). pad_token_id must be a real id for Phi3Config.
    half = 64 // 4 // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.25 * i for i in range(half)],
        "long_factor": [2.0 + i for i in range(half)],
    }
    shape = {**SHAPE, "pad_token_id": 0}
    return Phi3ForCausalLM(Phi3Config(**shape, original_max_position_embeddings=64, rope_parameters=rope))


def phi4_mini_partial_rotary():
    from transformers import Phi3Config, Phi3ForCausalLM

    # Phi-4-mini's rotation of 3/4 of each head (12 of 16 dimensions here), with LongRoPE
    # factors for those 6 frequencies only.
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.75,
        "short_factor": [1.0 + 0.25 * i for i in range(6)],
        "long_factor": [2.0 + i for i in range(6)],
    }
    shape = {**SHAPE, "pad_token_id": 0}
    return Phi3ForCausalLM(Phi3Config(**shape, original_max_position_embeddings=64, rope_parameters=rope))


def mistral_wide_heads():
    from transformers import MistralConfig, MistralForCausalLM

    # head_dim * heads != hidden_size: o_proj maps 128 -> 64.
    return MistralForCausalLM(MistralConfig(**SHAPE, head_dim=32, sliding_window=None))


def mistral_sliding_window():
    from transformers import MistralConfig, MistralForCausalLM

    # Mistral v0.1's window over every layer: 6 keys, so most of the 28 tokens look past it.
    return MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=6))


def gemma2(query_pre_attn_scalar: int):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    # Layer 0 attends over a window of 5 keys, layer 1 over everything; scores and logits
    # soft-capped low enough to bend them.
    config = Gemma2Config(
        **SHAPE,
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=query_pre_attn_scalar,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=4.0,
        attn_implementation="eager",
    )
    return Gemma2ForCausalLM(config)


def gemma2_softcapped_windows():
    return gemma2(query_pre_attn_scalar=24)  # scores scaled by 1/sqrt(24), not 1/sqrt(head_dim)


def gemma2_as_llama_cpp_reads_it():
    # A GGUF does not store query_pre_attn_scalar: llama.cpp takes head_dim.
    return gemma2(query_pre_attn_scalar=16)


def gemma3_local_and_global_rope():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    # Per-head q/k norms; the global layer rotates with base 1,000,000 and linear scaling by
    # 8 (Gemma 3 4B's), the sliding one with a base of its own (Gemma 3's is 10,000; another
    # here, so that a GGUF's rope.freq_base_swa must be read).
    rope = {
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20_000.0},
    }
    config = Gemma3TextConfig(
        **SHAPE,
        head_dim=32,
        sliding_window=7,
        layer_types=["sliding_attention", "full_attention"],
        query_pre_attn_scalar=32,
        rope_parameters=rope,
    )
    return Gemma3ForCausalLM(config)


VARIANTS = [
    llama_llama3_rope_untied,
    llama_linear_rope_tied,
    qwen2_with_qkv_bias,
    qwen3_with_qk_norm,
    qwen3_yarn,
    qwen2_yarn_with_its_own_attention_factor_and_betas,
    llama_yarn_untruncated_with_mscales,
    phi3_longrope,
    phi4_mini_partial_rotary,
    mistral_wide_heads,
    mistral_sliding_window,
    gemma2_softcapped_windows,
    gemma3_local_and_global_rope,
]
# Every variant's decode steps run in one C call once all its projections are quantized,
# Gemma's too (sandwich norms, GeGLU, soft-capping, two RoPE bases).
ONE_CALL_VARIANTS = VARIANTS


def save_random_model(build, folder: Path):
    """Save a model whose every weight is random (tests.tiny_lms.randomize)."""
    torch.manual_seed(0)
    model = build().eval()
    randomize(model)
    model.save_pretrained(folder)
    return model


def assert_same_bits_chunked_and_batched(runner: ModelRunner, whole: torch.Tensor, prompt: bool = False) -> None:
    """PROMPT_IDS prefilled in two chunks, beside another request, and beside a decode step,
    give `whole` (its logits prefilled at once) bit for bit. `prompt`: flagged as prompt rows
    (then `whole` must have been too), which an AMX-BF16 build multiplies on bf16 tiles."""
    slots = torch.arange(1, len(PROMPT_IDS) + 1)
    kv_buffers = runner.new_kv_buffers(64)
    first = runner.forward(make_batch([(PROMPT_IDS[:5], slots[:5])], kv_buffers, all_logits=True, prompt=prompt))
    rest = runner.forward(make_batch([(PROMPT_IDS[5:], slots)], kv_buffers, all_logits=True, prompt=prompt))
    assert torch.equal(torch.cat([first, rest]), whole)

    kv_buffers = runner.new_kv_buffers(64)
    neighbour = ([9, 8, 7, 6, 5, 4, 3, 2, 1], torch.arange(40, 49))
    batch = make_batch([neighbour, (PROMPT_IDS, slots)], kv_buffers, all_logits=True, prompt=prompt)
    batched = runner.forward(batch)
    assert torch.equal(batched[len(neighbour[0]) :], whole)

    # The neighbour's last token a decode row (not a prompt row) in the same matmuls.
    runner.forward(make_batch([(neighbour[0][:-1], neighbour[1][:-1])], kv_buffers, prompt=prompt))
    decode_step = (neighbour[0][-1:], neighbour[1])
    batch = make_batch([decode_step, (PROMPT_IDS, slots)], kv_buffers, all_logits=True, prompt=prompt)
    if prompt:
        assert batch.prompt_rows is not None
        batch.prompt_rows[0] = False
    assert torch.equal(runner.forward(batch)[1:], whole)


def sluice_greedy(runner: ModelRunner, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Prefill the prompt, then decode one token per step through the KV pool (slots reversed,
    so that nothing relies on a sequence's slots being ascending)."""
    slots = torch.arange(len(prompt_ids) + num_tokens, 0, -1)
    kv_buffers = runner.new_kv_buffers(len(slots) + 1)
    logits = runner.forward(make_batch([(prompt_ids, slots[: len(prompt_ids)])], kv_buffers))
    generated = [int(logits[-1].argmax())]
    while len(generated) < num_tokens:
        seq_len = len(prompt_ids) + len(generated)
        logits = runner.forward(make_batch([([generated[-1]], slots[:seq_len])], kv_buffers))
        generated.append(int(logits[-1].argmax()))
    return generated


def assert_matches_transformers(runner: ModelRunner, hf_model) -> None:
    """PROMPT_IDS's logits within 1e-4 of the largest of transformers', and its greedy tokens."""
    kv_buffers = runner.new_kv_buffers(len(PROMPT_IDS) + 1)
    logits = runner.forward(
        make_batch([(PROMPT_IDS, torch.arange(1, len(PROMPT_IDS) + 1))], kv_buffers, all_logits=True)
    )
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT_IDS])).logits[0]
    assert ((logits - expected).abs().max() / expected.abs().max()).item() < 1e-4
    assert sluice_greedy(runner, PROMPT_IDS, NUM_GREEDY_TOKENS) == hf_greedy(hf_model, PROMPT_IDS, NUM_GREEDY_TOKENS)


@pytest.mark.parametrize("build", VARIANTS, ids=lambda build: build.__name__)
def test_logits_and_greedy_tokens_match_transformers(build, tmp_path: Path):
    hf_model = save_random_model(build, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, kv_cache_dtype="float32")
    assert_matches_transformers(runner, hf_model)


@pytest.mark.parametrize(
    "build", [mistral_sliding_window, gemma2_softcapped_windows, gemma3_local_and_global_rope], ids=lambda b: b.__name__
)
def test_the_torch_path_takes_windows_and_soft_capping_too(build, tmp_path: Path, monkeypatch):
    """Without the C kernels (torch ops in float32), sliding windows, soft-capped scores and
    Gemma's layers still give transformers' logits and tokens."""
    import sluice.model.execution as execution

    def no_kernels():
        raise execution.KernelUnavailable("disabled by this test")

    monkeypatch.setattr(execution, "load_kernels", no_kernels)
    hf_model = save_random_model(build, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, kv_cache_dtype="float32")
    assert not runner.execution.uses_kernels
    assert_matches_transformers(runner, hf_model)


def test_the_language_model_of_a_gemma3_vision_checkpoint_serves_alone(tmp_path: Path):
    """Gemma 3 4 B and up come as Gemma3ForConditionalGeneration: its language model loads
    (weights under language_model., the vision tower left out, a text_config of defaults
    filled in by transformers) and gives transformers' text-only logits and tokens."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {key: value for key, value in SHAPE.items() if not key.endswith("token_id")}
    config = Gemma3Config(
        text_config={**text, "head_dim": 16, "sliding_window": 6, "query_pre_attn_scalar": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2},
        image_token_index=255,
    )
    hf_model = save_random_model(lambda: Gemma3ForConditionalGeneration(config), tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, kv_cache_dtype="float32")
    assert runner.config.text_of == "Gemma3ForConditionalGeneration" and runner.config.vision is None
    assert runner.config.layer_windows == [6, 6]  # transformers' default: 5 of every 6 layers slide
    assert_matches_transformers(runner, hf_model)


GGUF_VARIANTS = [
    (qwen3_with_qk_norm, "qwen3"),
    (qwen2_with_qkv_bias, "qwen2"),
    (qwen3_yarn, "qwen3"),  # YaRN as llama.cpp's converter writes it
    (qwen2_yarn_with_its_own_attention_factor_and_betas, "qwen2"),
    (phi3_longrope, "phi3"),
    (phi4_mini_partial_rotary, "phi3"),
    (llama_llama3_rope_untied, "llama"),  # llama3 scaling as llama.cpp's rope_freqs tensor
    (gemma2_as_llama_cpp_reads_it, "gemma2"),  # norms stored as 1 + w, the default interleaving
    (gemma3_local_and_global_rope, "gemma3"),  # which layers slide, as a pattern of bools
]


@pytest.mark.parametrize("build, arch", GGUF_VARIANTS, ids=[build.__name__ for build, _ in GGUF_VARIANTS])
def test_a_gguf_of_the_same_weights_matches_transformers(build, arch, tmp_path: Path):
    """The GGUF path (metadata, tensor names, layout) gives the folder's model: float32
    tensors, so logits match transformers as closely as the folder's do."""
    hf_model = save_random_model(build, tmp_path / "hf")
    runner = ModelRunner(
        str(write_gguf(hf_model, tmp_path / "model.gguf", arch)), torch.float32, kv_cache_dtype="float32"
    )
    assert runner.config.architecture == type(hf_model).__name__
    assert_matches_transformers(runner, hf_model)


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
@pytest.mark.parametrize(
    "build, arch, tolerance",
    [
        (qwen3_with_qk_norm, "qwen3", 0.05),
        (phi3_longrope, "phi3", 0.05),
        # Four random norms of weight 1.5-2.5 a layer amplify the rounding of the weights alone
        # to 4-5% of the largest logit (the same GGUF dequantized to float32 is that far too).
        (gemma2_as_llama_cpp_reads_it, "gemma2", 0.1),
        (gemma3_local_and_global_rope, "gemma3", 0.1),
    ],
    ids=["qwen3", "phi3", "gemma2", "gemma3"],
)
def test_a_q8_0_gguf_runs_its_blocks_and_stays_invariant(build, arch, tolerance, tmp_path: Path):
    """Q8_0 matrices (Phi-3's fused ones too) go through qgemm, decode steps through the
    one-call path (with Qwen3's per-head q/k norm and Gemma's layers); logits stay
    near the float model's and do not depend on chunking, batching or which path ran."""
    hf_model = save_random_model(build, tmp_path / "hf")
    runner = ModelRunner(str(write_gguf(hf_model, tmp_path / "q8.gguf", arch, "Q8_0")), torch.float32, "auto")
    assert len(runner.model.quantized_weights()) == 4 * 2 + 1  # every projection and the LM head
    assert runner.model.decode_layers is not None
    slots = torch.arange(1, len(PROMPT_IDS) + 1)

    kv_buffers = runner.new_kv_buffers(64)
    whole = runner.forward(make_batch([(PROMPT_IDS, slots)], kv_buffers, all_logits=True))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT_IDS])).logits[0]
    assert ((whole - expected).abs().max() / expected.abs().max()).item() < tolerance

    assert_same_bits_chunked_and_batched(runner, whole)


def test_sliding_windows_are_read_per_layer_and_keep_the_whole_context(tmp_path: Path):
    save_random_model(mistral_wide_heads, tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "sliding_window": 64}))
    read = ModelConfig.from_path(tmp_path)
    assert (read.context_len, read.layer_windows) == (512, [64, 64])
    config_path.write_text(json.dumps({**config, "sliding_window": 64, "use_sliding_window": False}))
    assert ModelConfig.from_path(tmp_path).layer_windows == []
    layer_types = ["full_attention", "sliding_attention"]
    config_path.write_text(json.dumps({**config, "sliding_window": 64, "layer_types": layer_types}))
    assert ModelConfig.from_path(tmp_path).layer_windows == [None, 64]
    config_path.write_text(json.dumps({**config, "sliding_window": 64, "layer_types": ["full_attention"]}))
    with pytest.raises(ValueError, match="layer_types lists 1 layers"):
        ModelConfig.from_path(tmp_path)


def test_longrope_takes_the_long_factors_from_the_original_length_on_per_position():
    """A token's rotation depends on its position only (as in vLLM), never on how long its
    sequence has grown, so the KV cache and batching stay valid past the original length."""
    from sluice.model.layers import RotaryEmbedding

    head_dim, theta, original = 8, 10000.0, 16
    scaling = {
        "rope_type": "longrope",
        "original_max_position_embeddings": original,
        "factor": 4.0,
        "short_factor": [1.0, 1.5, 2.0, 2.5],
        "long_factor": [3.0, 5.0, 7.0, 9.0],
    }
    rotary = RotaryEmbedding(head_dim, theta, scaling, context_len=64, dtype=torch.float32)
    scale = (1 + torch.log(torch.tensor(4.0)) / torch.log(torch.tensor(16.0))).sqrt()
    base = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    for position, factors in [
        (original - 1, scaling["short_factor"]),
        (original, scaling["long_factor"]),
        (63, scaling["long_factor"]),
    ]:
        angles = position / (torch.tensor(factors) * base)
        cos, _ = rotary.lookup(torch.tensor([position]))
        torch.testing.assert_close(cos[0], torch.cat([angles, angles]).cos() * scale)


def test_rotary_tables_grow_as_positions_are_reached_and_never_change_a_position():
    """Tables for a long context are computed a block at a time, when a token first reaches
    it: a position gets the same bits whether the tables grew to it at once or step by step."""
    from sluice.model.layers import RotaryEmbedding

    def rotary() -> RotaryEmbedding:
        return RotaryEmbedding(64, 500000.0, None, context_len=20_000, dtype=torch.float32, rotary_dim=48)

    stepwise, at_once = rotary(), rotary()
    assert len(stepwise.cos) < 20_000
    for position in (10, 4095, 4096, 9000, 19_999):
        stepwise.lookup(torch.tensor([position]))
    probe = torch.tensor([0, 4095, 4096, 8191, 9000, 12_288, 19_999])
    expected_cos, expected_sin = at_once.lookup(probe)
    cos, signed_sin = stepwise.lookup(probe)
    assert torch.equal(cos, expected_cos) and torch.equal(signed_sin, expected_sin)
    assert len(stepwise.cos) == len(at_once.cos) == 20_000
    angles = 19_999.0 * (1.0 / 500000.0 ** (torch.arange(0, 48, 2).float() / 48))
    torch.testing.assert_close(cos[-1, :24], angles.cos())
    assert torch.equal(cos[-1, 24:32], torch.ones(8)) and torch.equal(signed_sin[-1, 24:32], torch.zeros(8))
    with pytest.raises(IndexError):
        stepwise.lookup(torch.tensor([20_000]))


def test_a_rotary_dimension_count_that_does_not_fit_a_head_is_refused(tmp_path: Path):
    save_random_model(phi3_longrope, tmp_path)
    config_path = tmp_path / "config.json"
    config = json.loads(config_path.read_text())
    assert ModelConfig.from_path(tmp_path).rotary_dim is None
    # A factor for each rotating pair of dimensions: 6 of a head of 16 (Phi-4-mini: 48 of 128).
    rope = {**config["rope_parameters"]}
    rope.update({name: rope[name][:6] for name in ("long_factor", "short_factor")})
    config_path.write_text(json.dumps({**config, "rope_parameters": {**rope, "partial_rotary_factor": 0.75}}))
    assert ModelConfig.from_path(tmp_path).rotary_dim == 12
    # transformers 4 wrote it at the top level (Phi-4-mini's own config.json).
    del rope["partial_rotary_factor"]
    config_path.write_text(json.dumps({**config, "rope_parameters": rope, "partial_rotary_factor": 0.75}))
    assert ModelConfig.from_path(tmp_path).rotary_dim == 12
    config_path.write_text(
        json.dumps({**config, "rope_parameters": rope, "partial_rotary_factor": 0.1})
    )  # 1.6 dimensions
    with pytest.raises(ValueError, match="rotary dimension count of 1 "):
        ModelConfig.from_path(tmp_path)


def test_bfloat16_forward_gives_finite_float32_logits(tmp_path: Path):
    save_random_model(qwen2_with_qkv_bias, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.bfloat16)
    kv_buffers = runner.new_kv_buffers(2 * len(PROMPT_IDS) + 1)
    assert kv_buffers[0][0].dtype == torch.bfloat16

    prefill = runner.forward(make_batch([(PROMPT_IDS, torch.arange(1, len(PROMPT_IDS) + 1))], kv_buffers))
    decode = runner.forward(make_batch([([5], torch.arange(1, len(PROMPT_IDS) + 2))], kv_buffers))
    for logits in (prefill, decode):
        assert logits.shape == (1, 256)
        assert logits.dtype == torch.float32
        assert torch.isfinite(logits).all()


def test_a_qwen_config_slides_only_from_max_window_layers_and_only_when_asked(tmp_path: Path):
    """A Qwen config.json as the hub has it (no layer_types): with use_sliding_window, only
    the layers from max_window_layers on slide, as transformers reads it; without it (the
    default), none, though sliding_window is set."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=6, max_window_layers=1)
    hf_model = save_random_model(lambda: Qwen2ForCausalLM(config), tmp_path)
    config_path = tmp_path / "config.json"
    saved = json.loads(config_path.read_text())
    del saved["layer_types"]
    config_path.write_text(json.dumps(saved))
    runner = ModelRunner(str(tmp_path), torch.float32, kv_cache_dtype="float32")
    assert runner.config.layer_windows == [None, 6]
    assert_matches_transformers(runner, hf_model)

    del saved["use_sliding_window"]
    config_path.write_text(json.dumps(saved))
    assert ModelConfig.from_path(tmp_path).layer_windows == []


def test_an_activation_other_than_silu_is_refused_for_a_llama(tmp_path: Path):
    save_random_model(llama_linear_rope_tied, tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported for LlamaForCausalLM"):
        ModelConfig.from_path(tmp_path)


def test_context_length_caps_the_model_s_own_and_cannot_pass_it(tmp_path: Path):
    save_random_model(qwen3_with_qk_norm, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, context_length=100)
    assert runner.config.context_len == 100 and ModelConfig.from_path(tmp_path).context_len == 512
    with pytest.raises(ValueError, match="--context-length 513 is more than the model's context length 512"):
        ModelConfig.from_path(tmp_path).with_context_length(513)


def test_yarn_serves_factor_times_the_trained_length(tmp_path: Path):
    """A Qwen3 config with YaRN switched on as its model card says serves 4 x 32 K tokens, as
    vLLM does; without YaRN, max_position_embeddings."""
    save_random_model(qwen3_with_qk_norm, tmp_path)
    config_path = tmp_path / "config.json"
    # Written as Qwen3's own config.json is (transformers 4's keys), YaRN added as the card says.
    plain = {**json.loads(config_path.read_text()), "max_position_embeddings": 40960, "rope_theta": 1e6}
    del plain["rope_parameters"]
    config_path.write_text(json.dumps(plain))
    assert ModelConfig.from_path(tmp_path).context_len == 40960
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    config_path.write_text(json.dumps({**plain, "rope_scaling": yarn}))
    config = ModelConfig.from_path(tmp_path)
    assert config.context_len == 131072
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "yarn"


def test_config_reads_eos_from_both_files_and_sizes_kv(tmp_path: Path):
    save_random_model(mistral_wide_heads, tmp_path)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))

    config = ModelConfig.from_path(tmp_path)
    assert config.architecture == "MistralForCausalLM"
    assert config.eos_token_ids == [2, 7]
    assert (config.num_layers, config.num_kv_heads, config.head_dim) == (2, 2, 32)

    runner = ModelRunner(str(tmp_path), torch.bfloat16)
    assert runner.kv_bytes_per_token() == 2 * 2 * 2 * 32 * 2  # K and V, layers, kv heads, head_dim, bytes
    k_buffers, v_buffers = runner.new_kv_buffers(10)
    assert len(k_buffers) == len(v_buffers) == 2
    assert k_buffers[0].shape == (10, 2, 32)


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
@pytest.mark.parametrize("build", ONE_CALL_VARIANTS, ids=lambda build: build.__name__)
def test_one_call_layers_equal_the_per_op_path(build, tmp_path: Path):
    """A quantized float32 model runs all layers of a step in one C call; its logits must be
    those of the layer-by-layer path, bit for bit, for a prefill and the decode steps after."""
    save_random_model(build, tmp_path)
    assert_one_call_equals_per_op(ModelRunner(str(tmp_path), torch.float32, quantization="q8_0"))


def assert_one_call_equals_per_op(runner: ModelRunner) -> None:
    fused = runner.model.decode_layers
    assert fused is not None
    prompts = [PROMPT_IDS, PROMPT_IDS[::-1][:7]]
    slots = [torch.arange(1, 40), torch.arange(40, 80)]

    def run(use_one_call: bool) -> list[torch.Tensor]:
        runner.model.decode_layers = fused if use_one_call else None
        kv_buffers = runner.new_kv_buffers(81)
        step_logits = [
            runner.forward(
                make_batch([(ids, s[: len(ids)]) for ids, s in zip(prompts, slots, strict=True)], kv_buffers)
            )
        ]
        for step in range(5):
            new = [([3 + step], s[: len(ids) + step + 1]) for ids, s in zip(prompts, slots, strict=True)]
            step_logits.append(runner.forward(make_batch(new, kv_buffers)))
        runner.model.decode_layers = fused
        return step_logits

    for one_call, per_op in zip(run(True), run(False), strict=True):
        assert torch.equal(one_call, per_op)


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
@pytest.mark.parametrize("build", [llama_linear_rope_tied, qwen3_with_qk_norm, gemma3_local_and_global_rope])
def test_quantized_results_do_not_depend_on_chunking_or_batching(tmp_path: Path, build):
    """On the kernels every token attends like a decode step at its position and every matmul
    row is computed alone, so a prompt gives the same logits bit for bit whether it is
    prefilled at once, in chunks (as with a cached prefix), or beside other requests. With the
    rows flagged as prompt rows too, which an AMX-BF16 build multiplies and (for Qwen3's and
    Gemma 3's 32-wide heads, windows included) attends on bf16 tiles."""
    save_random_model(build, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, quantization="q8_0")
    slots = torch.arange(1, len(PROMPT_IDS) + 1)

    for prompt in (False, True):
        kv_buffers = runner.new_kv_buffers(64)
        whole = runner.forward(make_batch([(PROMPT_IDS, slots)], kv_buffers, all_logits=True, prompt=prompt))
        assert_same_bits_chunked_and_batched(runner, whole, prompt)


def _decode_step_logits(runner: ModelRunner) -> torch.Tensor:
    """The logits of a decode step of PROMPT_IDS' last token over the rest in runner's pool."""
    kv_buffers = runner.new_kv_buffers(2 * len(PROMPT_IDS) + 1)
    runner.forward(make_batch([(PROMPT_IDS[:-1], torch.arange(1, len(PROMPT_IDS)))], kv_buffers))
    return runner.forward(make_batch([(PROMPT_IDS[-1:], torch.arange(1, len(PROMPT_IDS) + 1))], kv_buffers))


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_16_bit_kv_cache_keeps_logits_close_and_the_greedy_tokens(dtype, kv_cache_dtype, tmp_path: Path):
    """Half the KV bytes: the pool rounds K and V to 16 bits, attention widens them again."""
    save_random_model(llama_linear_rope_tied, tmp_path)
    reference = ModelRunner(str(tmp_path), dtype, kv_cache_dtype="float32")
    narrow = ModelRunner(str(tmp_path), dtype, kv_cache_dtype=kv_cache_dtype)
    kv_buffers = narrow.new_kv_buffers(4)
    assert kv_buffers[0][0].dtype == getattr(torch, kv_cache_dtype)
    assert narrow.kv_bytes_per_token() == reference.kv_bytes_per_token() // 2

    step_logits = [_decode_step_logits(runner) for runner in (reference, narrow)]
    tolerance = 1e-2 if dtype == torch.float32 else 5e-2
    assert ((step_logits[1] - step_logits[0]).abs().max() / step_logits[0].abs().max()).item() < tolerance
    assert sluice_greedy(narrow, PROMPT_IDS, NUM_GREEDY_TOKENS) == sluice_greedy(
        reference, PROMPT_IDS, NUM_GREEDY_TOKENS
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_an_fp8_kv_cache_holds_a_byte_an_element_and_keeps_logits_near(dtype, tmp_path: Path):
    """fp8_e5m2 (on the kernels and on torch ops alike): a quarter of float32's bytes, K and V
    rounded to 2 mantissa bits, so the logits move more than with 16 bits but stay near."""
    save_random_model(llama_linear_rope_tied, tmp_path)
    reference = ModelRunner(str(tmp_path), dtype, kv_cache_dtype="float32")
    narrow = ModelRunner(str(tmp_path), dtype, kv_cache_dtype="fp8_e5m2")
    assert narrow.new_kv_buffers(4)[0][0].dtype == torch.float8_e5m2
    assert narrow.kv_bytes_per_token() == reference.kv_bytes_per_token() // 4

    step_logits = [_decode_step_logits(runner) for runner in (reference, narrow)]
    # Measured: 0.13 of the largest logit on the kernels, 0.09 on bf16 torch ops (16-bit K/V:
    # under 0.01); the kernel tests check the attention itself against the rounded values.
    drift = ((step_logits[1] - step_logits[0]).abs().max() / step_logits[0].abs().max()).item()
    assert 0 < drift < 0.25


def test_on_torch_ops_an_fp8_kv_cache_gives_a_prompt_the_same_logits_whole_or_in_chunks(tmp_path: Path, monkeypatch):
    """On torch ops a prompt's own K/V are rounded as the pool rounds them before it attends,
    so a chunk (or a cache hit) that reads the pool back sees what the whole prompt saw. In
    float32: bf16 torch GEMMs of 5 and of 12 rows round apart by a bf16 step on CPUs that
    emulate bf16 (seen on Zen 3: 0.03 of logits up to 2.9), which would hide what this checks."""
    import sluice.model.execution as execution

    def no_kernels():
        raise execution.KernelUnavailable("disabled by this test")

    monkeypatch.setattr(execution, "load_kernels", no_kernels)
    save_random_model(llama_linear_rope_tied, tmp_path)
    runner = ModelRunner(str(tmp_path), torch.float32, kv_cache_dtype="fp8_e5m2")
    assert not runner.execution.uses_kernels
    slots = torch.arange(1, len(PROMPT_IDS) + 1)
    whole = runner.forward(make_batch([(PROMPT_IDS, slots)], runner.new_kv_buffers(64), all_logits=True))
    kv_buffers = runner.new_kv_buffers(64)
    first = runner.forward(make_batch([(PROMPT_IDS[:5], slots[:5])], kv_buffers, all_logits=True))
    rest = runner.forward(make_batch([(PROMPT_IDS[5:], slots)], kv_buffers, all_logits=True))
    torch.testing.assert_close(torch.cat([first, rest]), whole, rtol=0, atol=1e-3 * whole.abs().max().item())


def _k_m_type(hf_name: str, body_type: str) -> str:
    """A Q4_K_M (body_type Q4_K) or Q5_K_M (Q5_K) file's mix: Q6_K for layer 0's v and down
    (llama.cpp gives a share of the layers more bits there) and the embedding, the body's
    type for the rest."""
    if hf_name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        return "Q6_K"
    return "Q6_K" if hf_name == "model.embed_tokens.weight" else body_type


# Block scales that give weights of standard deviation ~0.02 for each type.
_TYPICAL_SCALE = {"Q4_K": 1e-4, "Q5_K": 3e-5, "Q6_K": 2e-5}


@pytest.mark.skipif(not kernels_available(), reason="the C kernels need an x86-64 CPU with AVX2 and gcc")
@pytest.mark.parametrize(
    ("arch", "mode", "body_type"),
    [
        ("llama", "auto", "Q4_K"),
        ("qwen3", "auto", "Q4_K"),
        ("llama", "gguf", "Q4_K"),
        ("llama", "auto as on AVX-512", "Q4_K"),
        ("llama", "auto", "Q5_K"),
    ],
)
def test_a_k_quant_gguf_runs_the_files_blocks(arch, mode, body_type, tmp_path: Path, monkeypatch):
    """A Q4_K_M- or Q5_K_M-style file (widths of whole 256-weight super-blocks): Q6_K and Q5_K
    matrices run as the file's own q6_k and q5_k blocks, Q4_K ones as its q4_k blocks (gguf,
    and auto on AVX2) or as q4_1 blocks of the file's quants (auto on AVX-512 and AMX, taken
    on this CPU's build too by "auto as on AVX-512"), and a fused q/k/v whose v is Q6_K as
    q/k's blocks above v's (on both paths); the Q6_K embedding is looked up in its blocks (no
    float table), and logits stay near those of transformers on what the file's blocks
    dequantize to."""
    import gguf

    from sluice.kernels.cpu import ISA_NAMES
    from sluice.model import quantization
    from tests.gguf_files import _interleave_rotary_halves, random_blocks

    as_on_avx512 = mode == "auto as on AVX-512"
    if as_on_avx512:
        monkeypatch.setattr(quantization, "Q4_K_AS_Q4_1_ISAS", ISA_NAMES)
        mode = "auto"

    shape = {**SHAPE, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4}
    if arch == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        hf_model = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=True)).eval()
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        hf_model = Qwen3ForCausalLM(Qwen3Config(**shape, head_dim=64, tie_word_embeddings=True)).eval()
    torch.manual_seed(0)
    randomize(hf_model)
    raw_matrices = {}
    heads = {"q_proj": shape["num_attention_heads"], "k_proj": shape["num_key_value_heads"]}
    with torch.no_grad():
        for index, (name, parameter) in enumerate(hf_model.named_parameters()):
            if parameter.ndim != 2:
                continue
            type_name = _k_m_type(name, body_type)
            raw = random_blocks(*parameter.shape, type_name, seed=index, scale=_TYPICAL_SCALE[type_name])
            weight = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
            projection = name.split(".")[-2]
            if arch == "llama" and projection in heads:
                # The file holds llama.cpp's row order; the model takes the inverse of it.
                order = _interleave_rotary_halves(np.arange(len(weight)), heads[projection])
                weight = weight[np.argsort(order)]
            parameter.copy_(torch.from_numpy(weight.copy()))
            raw_matrices[name] = (raw, type_name)
    path = write_gguf(hf_model, tmp_path / "k_m.gguf", arch, raw_matrices=raw_matrices)
    runner = ModelRunner(str(path), torch.float32, mode)
    # auto: q4_k on the AVX2 build only (measured there), q4_1 on the AVX-512 and AMX ones.
    q4_k_kept = mode == "gguf" or (not as_on_avx512 and runner.execution.backend.isa == "avx2")
    exact = body_type == "Q5_K" or q4_k_kept  # else Q4_K's block scales are rounded to float16
    four_bit = BlockFormat.Q4_1 if not exact else BlockFormat[body_type]

    model = runner.model
    layer0, layer1 = model.decoder_layers
    formats = [[part.format for part in layer.qkv_proj.quantized.parts] for layer in (layer0, layer1)]
    assert formats == [[four_bit, BlockFormat.Q6_K], [four_bit]]  # layer 0's v is Q6_K: kept apart from q and k
    v = hf_model.model.layers[0].self_attn.v_proj.weight
    assert torch.equal(layer0.qkv_proj.quantized.tail.dequantize(), v)
    assert layer0.mlp.down_quantized.format is BlockFormat.Q6_K
    assert layer1.mlp.down_quantized.format is four_bit
    assert model.lm_head_quantized.format is BlockFormat.Q6_K
    assert torch.equal(layer0.mlp.down_quantized.dequantize(), hf_model.model.layers[0].mlp.down_proj.weight)
    down = hf_model.model.layers[1].mlp.down_proj.weight  # Q4_K: exact as q4_k, float16 block scales as q4_1
    bound = 0 if exact else 2**-10 * down.abs().max()
    assert (layer1.mlp.down_quantized.dequantize() - down).abs().max() <= bound
    assert layer0.o_proj.quantized.format is layer0.mlp.gate_up_quantized.format is four_bit
    assert model.embedding_blocks is model.lm_head_quantized and model.embed_tokens.numel() == 0
    assert all(p.numel() == 0 for layer in (layer0, layer1) for p in (layer.qkv_proj.weight, layer.mlp.down_weight))

    slots = torch.arange(1, len(PROMPT_IDS) + 1)
    whole = runner.forward(make_batch([(PROMPT_IDS, slots)], runner.new_kv_buffers(64), all_logits=True))
    with torch.inference_mode():
        expected = hf_model(torch.tensor([PROMPT_IDS])).logits[0]
    # Random K-quant blocks give biased weights (a block's minimum is not its quants' mean):
    # at larger scales the activations grow tenfold a layer, attention turns to an argmax and
    # the kernels' int8 rounding of activations flips it, so the scales above are kept small.
    assert ((whole - expected).abs().max() / expected.abs().max()).item() < 0.05
    assert_same_bits_chunked_and_batched(runner, whole)
    assert_one_call_equals_per_op(runner)  # layer 0's qkv in two parts there too
