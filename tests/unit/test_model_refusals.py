"""Models the server cannot load are refused before any process starts, in one line that
names what is wrong, with a non-zero exit."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from sluice.config import ServerArgs
from sluice.model.gguf_config import config_from_gguf
from sluice.model.gguf_file import GGUFHeaderError, read_architecture
from sluice.model.model_config import ModelConfig, check_servable
from sluice.model.model_runner import ModelRunner
from tests.gguf_files import copy_gguf, write_gguf
from tests.helpers import free_port
from tests.tiny_lms import build_tiny_model
from tests.unit.test_model_tiny import qwen3_with_qk_norm, save_random_model


@pytest.fixture(scope="module")
def qwen3_gguf(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3")
    return write_gguf(save_random_model(qwen3_with_qk_norm, folder / "hf"), folder / "model.gguf", "qwen3", "Q8_0")


def write_unsupported(path: Path) -> Path:
    import gguf

    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_without_tokenizer_scores(path: Path) -> Path:
    """A Qwen3 GGUF whose gpt2 vocabulary lacks what transformers needs to build it."""
    return write_gguf(save_random_model(qwen3_with_qk_norm, path.parent / "hf"), path, "qwen3")


def write_folder_without_tokenizer(folder: Path) -> Path:
    save_random_model(qwen3_with_qk_norm, folder)
    return folder


def write_folder_with_config(folder: Path, edit) -> Path:
    """A tiny Qwen3 folder (SmolLM2's tokenizer) whose config.json text is edit(text)."""
    build_tiny_model(folder, "qwen3")
    config_path = folder / "config.json"
    config_path.write_text(edit(config_path.read_text()))
    return folder


def without_hidden_size(text: str) -> str:
    return json.dumps({key: value for key, value in json.loads(text).items() if key != "hidden_size"})


def serve(model_path: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`sluice serve` of `model_path` on a free port (flags after it, environment `env` added)."""
    return subprocess.run(
        [sys.executable, "-m", "sluice", "serve", "--model-path", str(model_path), "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )


def test_the_header_gives_the_architecture_of_a_whole_file(qwen3_gguf):
    assert read_architecture(qwen3_gguf) == "qwen3"
    check_servable(qwen3_gguf)


def test_a_truncated_file_is_refused_naming_the_tensor_past_its_end(qwen3_gguf, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(qwen3_gguf.read_bytes()[: qwen3_gguf.stat().st_size - 100])
    with pytest.raises(GGUFHeaderError, match=r"truncated: tensor \S+ ends at byte"):
        read_architecture(truncated)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(qwen3_gguf.read_bytes()[:30])
    with pytest.raises(GGUFHeaderError, match="truncated"):
        read_architecture(header_only)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(GGUFHeaderError, match="not a GGUF file"):
        read_architecture(path)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda tmp: write_unsupported(tmp / "mamba.gguf"), "GGUF architecture 'mamba' is not supported"),
        (lambda tmp: tmp / "missing.gguf", "no such file"),
        (lambda tmp: tmp, "neither a .gguf file nor a folder with config.json"),
        (lambda tmp: write_without_tokenizer_scores(tmp / "model.gguf"), "its tokenizer cannot be read"),
        (lambda tmp: write_folder_without_tokenizer(tmp / "hf"), "has no tokenizer: none of tokenizer.json"),
        (lambda tmp: write_folder_with_config(tmp / "hf", without_hidden_size), "config.json has no hidden_size"),
        (lambda tmp: write_folder_with_config(tmp / "hf", lambda text: text[:-5]), "config.json is not JSON"),
    ],
    ids=[
        "unsupported-architecture",
        "missing-file",
        "empty-folder",
        "unreadable-tokenizer",
        "no-tokenizer",
        "config-without-a-shape-field",
        "config-not-json",
    ],
)
def test_serve_refuses_in_one_line_and_exits_non_zero(make, message, tmp_path):
    result = serve(make(tmp_path))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"qwen3.rope.scaling.type": "dynamic"}, "qwen3.rope.scaling.type 'dynamic' is not supported"),
        ({"qwen3.rope.scaling.type": "longrope"}, "no rope_factors_long and rope_factors_short tensors"),
        ({"qwen3.rope.scaling.type": "yarn"}, "qwen3.rope.scaling.factor is missing"),
        (
            {
                "qwen3.rope.scaling.type": "yarn",
                "qwen3.rope.scaling.factor": 4.0,
                "qwen3.rope.scaling.yarn_log_multiplier": 0.1,
            },
            "qwen3.rope.scaling.yarn_log_multiplier 0.1",
        ),
        ({"qwen3.attention.value_length": 16.0}, "attention.value_length differs from key_length 32"),
        ({"qwen3.attention.value_length": [32, 16]}, "qwen3.attention.value_length differs between layers ([32, 16])"),
    ],
    ids=[
        "unknown-type",
        "longrope-without-factors",
        "yarn-without-factor",
        "yarn-log-multiplier",
        "value-length",
        "per-layer-values",
    ],
)
def test_gguf_settings_sluice_cannot_apply_are_refused_naming_the_key(metadata, message, tmp_path):
    """Nothing in a file's metadata is passed over: a GGUF that asks for RoPE scaling sluice
    does not do, or for shapes it does not take, is refused, not served as something else."""
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", metadata=metadata)
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_gguf(path)


@pytest.mark.parametrize("from_gguf", [False, True], ids=["folder", "gguf"])
@pytest.mark.parametrize(
    "bias, first_left",
    [("attention_bias", "model.layers.0.self_attn.o_proj.bias"), ("mlp_bias", "model.layers.0.mlp.")],
)
def test_weights_the_model_has_no_place_for_are_refused_not_left_out(bias, first_left, from_gguf, tmp_path):
    """A Llama with attention_bias has an o_proj bias, one with mlp_bias MLP biases: sluice
    applies neither, so it refuses such a model rather than answer without them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.unit.test_model_tiny import SHAPE

    hf_model = save_random_model(lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, **{bias: True})), tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama") if from_gguf else tmp_path / "hf"
    with pytest.raises(ValueError, match=re.escape(first_left) + r".* has no place for it"):
        ModelRunner(str(path), torch.float32)


@pytest.mark.parametrize(
    "array, message",
    [
        # A tensor the GGUF loader has no name for (an MoE layer's router, say) is not dropped.
        (np.zeros((64, 4), dtype=np.float32), "is not one sluice reads"),
        # gguf knows types it cannot dequantize (I32, F64, Q8_K, ...): refused before loading.
        (np.zeros((4, 8), dtype=np.int32), "is I32, a type sluice cannot read"),
    ],
    ids=["unknown-name", "unreadable-type"],
)
def test_a_gguf_tensor_sluice_cannot_take_is_refused_naming_it(array, message, tmp_path):
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", extra_tensors={"blk.0.ffn_gate_inp.weight": array})
    with pytest.raises(ValueError, match=re.escape(f"tensor blk.0.ffn_gate_inp.weight of model.gguf {message}")):
        ModelRunner(str(path), torch.float32)


def write_folder_with_broken_weights(folder: Path, how: str) -> Path:
    """A tiny Qwen3 folder whose safetensors are cut short, named by an index but absent,
    or only a pytorch_model.bin."""
    build_tiny_model(folder, "qwen3")
    weights = folder / "model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif how == "index-names-a-missing-shard":
        index = {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        weights.rename(folder / "pytorch_model.bin")
    return folder


@pytest.mark.parametrize(
    "how, message",
    [
        ("truncated", "model.safetensors cannot be read as safetensors"),
        ("index-names-a-missing-shard", "model-00002-of-00002.safetensors, named in model.safetensors.index.json"),
        ("bin-only", "no .safetensors files in"),
    ],
)
def test_broken_safetensors_are_refused_in_a_line_before_anything_starts(how, message, tmp_path):
    result = serve(write_folder_with_broken_weights(tmp_path / "hf", how))
    assert result.returncode != 0
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


def test_broken_tokenizer_files_are_refused_in_a_line_not_a_traceback(tmp_path):
    """Found where the HTTP front end loads the tokenizer, while the back end starts: the
    back end stops too, and the server exits 1 saying why."""
    folder = write_folder_without_tokenizer(tmp_path / "hf")
    (folder / "tokenizer.json").write_text("{}")
    result = serve(folder)
    assert result.returncode == 1
    assert "its tokenizer cannot be read" in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_weights_the_config_does_not_fit_are_refused_naming_the_weight(tmp_path):
    """The check happens where the weights load (the Scheduler); the server still exits
    promptly with status 1 and says which weight, in a line, not a traceback."""
    build_tiny_model(tmp_path, "qwen3")
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "intermediate_size": 96}))
    result = serve(tmp_path)
    assert result.returncode == 1
    assert "model.layers.0.mlp.gate_proj.weight [128, 64]" in result.stderr
    assert "the config implies [192, 64]" in result.stderr and "Traceback" not in result.stderr


def test_config_fields_are_read_as_transformers_reads_them(tmp_path):
    """Where a file leaves a field out, or names one its architecture does not use, the
    model served is the one transformers (or llama.cpp, for a GGUF) would run."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig

    from sluice.model.model_config import ModelConfig
    from tests.unit.test_model_tiny import SHAPE

    # transformers' Llama has no sliding window; Mistral's slides in every layer.
    LlamaConfig(**SHAPE, sliding_window=16).save_pretrained(tmp_path / "llama")
    assert ModelConfig.from_path(tmp_path / "llama").layer_windows == []
    MistralConfig(**SHAPE, sliding_window=16).save_pretrained(tmp_path / "mistral")
    assert ModelConfig.from_path(tmp_path / "mistral").layer_windows == [16, 16]
    # Gemma ties its output to its embeddings unless its config.json says otherwise.
    config_path = tmp_path / "gemma2" / "config.json"
    Gemma2Config(**SHAPE, head_dim=16).save_pretrained(config_path.parent)
    config_path.write_text(
        json.dumps({k: v for k, v in json.loads(config_path.read_text()).items() if k != "tie_word_embeddings"})
    )
    assert ModelConfig.from_path(config_path.parent).tie_word_embeddings
    # A Gemma 2 GGUF written before llama.cpp stored the soft-caps: llama.cpp's 50 and 30.
    uncapped = Gemma2Config(**SHAPE, head_dim=16, attn_logit_softcapping=None, final_logit_softcapping=None)
    hf_model = save_random_model(lambda: Gemma2ForCausalLM(uncapped), tmp_path / "gemma2-hf")
    config = config_from_gguf(write_gguf(hf_model, tmp_path / "gemma2.gguf", "gemma2"))
    assert (config.attn_logit_softcap, config.final_logit_softcap) == (50.0, 30.0)
    # An untied output whose weight is missing is refused, not tied behind the config's back.
    save_random_model(lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, tie_word_embeddings=True)), tmp_path / "untied")
    config_path = tmp_path / "untied" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tie_word_embeddings": False}))
    with pytest.raises(ValueError, match=re.escape("weight lm_head.weight is missing")):
        ModelRunner(str(tmp_path / "untied"), torch.float32)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_chat_template_that_does_not_compile_is_refused_in_a_line(workers, tmp_path):
    """Found where the tokenizer side starts: in the one HTTP process, or, before the HTTP
    workers start, in the main process (else each worker would fail and be started again)."""
    folder = write_folder_with_config(tmp_path / "hf", lambda text: text)
    (folder / "chat_template.jinja").write_text("{% if %}")
    result = serve(folder, "--tokenizer-worker-num", workers, "--skip-warmup")
    assert result.returncode == 1
    assert "the chat template does not compile" in result.stderr and "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--context-length", "8"], "context_length must be 0 (the model's own) or at least 32"),
        (["--kv-cache-memory-gb", "inf"], "kv_cache_memory_gb must be a number > 0"),
        (["--soft-watchdog-timeout", "inf"], "soft_watchdog_timeout must be a number > 0"),  # JSON made it null
        (["--max-total-tokens", str(10**12)], f"--max-total-tokens {10**12} makes a KV cache of"),
        (
            ["--kv-cache-memory-gb", "100000", "--max-running-requests", "100000"],
            "--kv-cache-memory-gb 100000.0 makes a KV cache of",
        ),
        (["--max-running-requests", str(10**8)], f"--max-running-requests {10**8} needs a token table of"),
    ],
)
def test_sizes_the_server_cannot_serve_or_allocate_are_refused_in_a_line(flags, message, tmp_path):
    result = serve(Path(ServerArgs().resolved_model_path()), *flags)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_a_shutdown_timeout_below_one_second_is_refused():
    """uvicorn and Granian read 0 as no limit: a SIGTERM would wait for every stream."""
    with pytest.raises(ValueError, match="shutdown_timeout must be >= 1"):
        ServerArgs(shutdown_timeout=0)


def test_every_replica_s_kv_cache_counts_against_the_memory(monkeypatch):
    """--dp-size replicas each allocate their own KV cache and token table: two that each fit
    alone but not together were let through (the kernel would kill one as they filled)."""
    from sluice.scheduler import process

    monkeypatch.setattr(process, "usable_memory_bytes", lambda: 10 * 2**30)
    kv_bytes_per_token = 2**20  # 6 GiB of KV for 6,144 tokens
    one = ServerArgs(max_total_tokens=6144)
    process.check_fits_in_memory(one, 6144, kv_bytes_per_token, context_len=4096)
    two = ServerArgs(max_total_tokens=6144, dp_size=2)
    with pytest.raises(ValueError, match=re.escape("6.0 GiB in each of --dp-size 2 replicas: more than the 10.0 GiB")):
        process.check_fits_in_memory(two, 6144, kv_bytes_per_token, context_len=4096)
    # 1.5 GiB of token table each: under a quarter of memory alone, over it for two.
    tables = {"max_running_requests": 49152, "max_total_tokens": 4096}
    process.check_fits_in_memory(ServerArgs(**tables), 4096, 1024, context_len=4096)
    with pytest.raises(ValueError, match=re.escape("in each of --dp-size 2 replicas, more than a quarter")):
        process.check_fits_in_memory(ServerArgs(**tables, dp_size=2), 4096, 1024, context_len=4096)


def edited(**changes):
    return lambda text: json.dumps({**json.loads(text), **changes})


@pytest.mark.parametrize(
    "edit, message",
    [
        (edited(num_attention_heads=0), "num_attention_heads must be a positive integer, got 0"),
        (edited(hidden_size="64"), "hidden_size must be a positive integer, got '64'"),
        (edited(num_hidden_layers=2.5), "num_hidden_layers must be a positive integer, got 2.5"),
        (edited(rope_scaling=[1, 2], rope_parameters=None), "rope_scaling must be an object"),
        (
            edited(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}),
            "rope_scaling of rope_type 'llama3' has no low_freq_factor",
        ),
        (edited(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0}), "rope_type 'linear' has no factor"),
        (edited(eos_token_id="2"), "eos_token_id must be a token id or a list of them, got '2'"),
        # Numbers no model has: they loaded and answered token 0 (NaN logits) or failed every step.
        (edited(rms_norm_eps=-1.0), "the model's rms_norm_eps is -1.0: it must be a finite number > 0"),
        (
            edited(num_attention_heads=4, num_key_value_heads=3),
            "the model's num_heads 4 is not a multiple of its num_kv_heads 3",
        ),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_naming_the_key(edit, message, tmp_path):
    from sluice.model.model_config import ModelConfig

    folder = write_folder_with_config(tmp_path / "hf", edit)
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_path(folder)


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize(
    "edit, message",
    [
        # Values of the wrong kind were tracebacks, or a string times a head size.
        (edited(rope_theta="abc", rope_parameters=None), "config.json: rope_theta must be a finite number, got 'abc'"),
        (
            edited(rope_theta=[10000.0], rope_parameters=None),
            "config.json: rope_theta must be a finite number, got [10000.0]",
        ),
        (edited(partial_rotary_factor="0.5"), "config.json: partial_rotary_factor must be a finite number, got '0.5'"),
        (
            edited(rope_parameters={**YARN, "original_max_position_embeddings": "128"}),
            "config.json: rope_parameters.original_max_position_embeddings must be a finite number, got '128'",
        ),
        (
            edited(rope_parameters={**YARN, "factor": "4"}),
            "config.json: rope_parameters.factor must be a finite number, got '4'",
        ),
        # Blamed on the tokenizer (transformers checks config.json as it builds one).
        (edited(sliding_window="16"), "config.json: sliding_window must be a whole number, got '16'"),
        (edited(tie_word_embeddings="false"), "config.json: tie_word_embeddings must be true or false, got 'false'"),
        (edited(architectures="Qwen3ForCausalLM"), "config.json: architectures must be a list of class names"),
        (edited(architectures=7), "config.json: architectures must be a list of class names, got 7"),  # TypeError
        # Infinity is JSON to Python: int() of it overflowed, a traceback.
        (edited(partial_rotary_factor=float("inf")), "config.json: partial_rotary_factor must be a finite number"),
        (
            edited(rope_parameters={**YARN, "factor": float("inf")}),
            "config.json: rope_parameters.factor must be a finite number, got inf",
        ),
        (edited(layer_types=["full_attention", "chunked_attention"]), "layer_types holds 'chunked_attention'"),
        # Numbers no model has: each loaded and answered token 0 to everything, or never stopped.
        (edited(rope_parameters={**YARN, "factor": 0.0}), "rope_scaling factor (yarn) is 0.0: it must be a finite"),
        (
            edited(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 0.0}),
            "rope_scaling factor (linear) is 0.0",
        ),
        (
            edited(rope_parameters={"rope_type": "longrope", "long_factor": [1.0] * 16, "short_factor": [0.0] * 16}),
            "rope_scaling short_factor (longrope) must be a list of finite numbers > 0",
        ),
        (
            edited(rope_parameters={"rope_type": "longrope", "long_factor": [1.0] * 16, "short_factor": [1.0] * 3}),
            "rope_scaling short_factor (longrope) has 3 values: its heads rotate 16 pairs of dimensions",
        ),
        (edited(eos_token_id=-1), "end-of-sequence token id -1 is not in its vocabulary"),
        (edited(eos_token_id=[2, 10**6]), f"end-of-sequence token id {10**6} is not in its vocabulary"),
        (edited(sliding_window=0, layer_types=["sliding_attention"] * 2), "sliding window is 0"),
        (edited(head_dim=15), "the model's head_dim 15 is odd: RoPE rotates pairs of dimensions"),
        (
            edited(rope_parameters={**YARN, "original_max_position_embeddings": 0}),
            "rope_parameters.original_max_position_embeddings must be a whole number > 0, got 0",
        ),
        (
            edited(layer_types=["sliding_attention", "chunked_attention"], sliding_window=16),
            "layer_types holds 'chunked_attention'",
        ),
    ],
)
def test_config_values_no_model_has_are_refused_naming_the_field(edit, message, tmp_path):
    folder = write_folder_with_config(tmp_path / "hf", edit)
    (folder / "generation_config.json").unlink()  # its eos would hide config.json's
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelConfig.from_path(folder)


def test_rope_factors_and_token_ids_are_checked_whichever_file_gave_them():
    """As a GGUF gives them too (rope_freqs.weight, Phi-3's factor tensors): zeros divided the
    rotation's frequencies into NaN; a list of the wrong length failed every step."""
    config = config_from_gguf(Path(ServerArgs().resolved_model_path()))
    pairs = config.head_dim // 2
    for scaling, message in [
        ({"rope_type": "frequency_factors", "factors": [0.0] * pairs}, "factors (frequency_factors) must be a list"),
        ({"rope_type": "frequency_factors", "factors": [1.0] * 3}, f"has 3 values: its heads rotate {pairs} pairs"),
        ({"rope_type": "linear", "factor": float("nan")}, "rope_scaling factor (linear) is nan"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(config, rope_scaling=scaling)
    for field, value, message in [
        ("query_pre_attn_scalar", -16.0, "query_pre_attn_scalar is -16.0: it must be a finite number > 0"),
        ("attn_logit_softcap", float("nan"), "attn_logit_softcap is nan"),
        ("eos_token_ids", [config.vocab_size], f"token id {config.vocab_size} is not in its vocabulary"),
    ]:
        with pytest.raises(ValueError, match=re.escape(message)):
            dataclasses.replace(config, **{field: value})


@pytest.mark.parametrize(
    "spoil, message",
    [
        (lambda w: w["model.layers.0.self_attn.q_proj.weight"].view(-1).__setitem__(0, float("nan")), "holds NaN"),
        (lambda w: w["model.norm.weight"].fill_(float("inf")), "model.norm.weight in model.safetensors holds NaN"),
        (lambda w: w.__setitem__("model.norm.weight", w["model.norm.weight"].to(torch.int32)), "is torch.int32"),
    ],
    ids=["nan", "inf", "int32"],
)
def test_weights_no_model_serves_from_are_refused_naming_the_tensor(spoil, message, tmp_path):
    """Each loaded, warmed up ('' generated) and answered token 0 to everything, or was cast
    to floats."""
    from safetensors.torch import load_file, save_file

    folder = write_folder_with_config(tmp_path / "hf", lambda text: text)
    weights = load_file(str(folder / "model.safetensors"))
    spoil(weights)
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(str(folder), torch.float32)


def test_integer_buffers_that_are_no_weights_are_left_out(tmp_path):
    """A vision tower's position_ids (int64) of an older checkpoint: not a weight, not refused."""
    from safetensors.torch import load_file, save_file

    folder = write_folder_with_config(tmp_path / "hf", lambda text: text)
    weights = load_file(str(folder / "model.safetensors"))
    save_file({**weights, "model.embed_positions.position_ids": torch.arange(8)}, str(folder / "model.safetensors"))
    ModelRunner(str(folder), torch.float32)


def test_shards_are_read_as_the_index_maps_them(tmp_path):
    """A weight in two shards was read from whichever came last (a zeroed copy: token 0 for
    everything), and an index could name a shard outside the model's folder."""
    from safetensors.torch import load_file, save_file

    folder = write_folder_with_config(tmp_path / "hf", lambda text: text)
    weights = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").rename(folder / "a.safetensors")
    save_file({name: torch.zeros_like(weight) for name, weight in weights.items()}, str(folder / "b.safetensors"))
    index = {"weight_map": {**dict.fromkeys(weights, "a.safetensors"), "x": "b.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    message = "is in b.safetensors, but model.safetensors.index.json puts it in a.safetensors"
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(str(folder), torch.float32)
    (folder / "model.safetensors.index.json").unlink()  # no index: every shard, each weight in one
    with pytest.raises(ValueError, match=r"is in both a\.safetensors and b\.safetensors"):
        ModelRunner(str(folder), torch.float32)
    index = {"weight_map": dict.fromkeys(weights, "../elsewhere/model.safetensors")}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    result = serve(folder)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "names the shard '../elsewhere/model.safetensors', which is not a file of the model" in result.stderr


def test_a_broken_chat_template_json_and_a_blank_served_name_are_refused_in_a_line(tmp_path):
    folder = write_folder_with_config(tmp_path / "hf", lambda text: text)
    (folder / "chat_template.jinja").unlink()
    (folder / "chat_template.json").write_text("{not json")
    for workers in ("1", "2"):  # was a traceback and exit status 3 with one HTTP worker
        result = serve(folder, "--tokenizer-worker-num", workers)
        assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
        assert "chat_template.json is not JSON" in result.stderr, result.stderr
    result = serve(Path(ServerArgs().resolved_model_path()), "--served-model-name", " ")
    assert result.returncode == 1 and "served_model_name must not begin or end with spaces" in result.stderr


def test_a_gguf_rope_base_that_is_not_a_number_is_refused(tmp_path):
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", metadata={"qwen3.rope.freq_base": float("nan")})
    with pytest.raises(ValueError, match=re.escape("the model's rope_theta is nan")):
        config_from_gguf(path)


@pytest.mark.parametrize(
    "metadata, message",
    [
        ({"qwen3.context_length": "x"}, "qwen3.context_length must be a whole number from 1 to 2,147,483,647, got 'x'"),
        (
            {"qwen3.embedding_length": float(2**40)},
            "qwen3.embedding_length must be a whole number from 1 to 2,147,483,647, got 1099511627776.0",
        ),
        ({"qwen3.rope.freq_base": "x"}, "qwen3.rope.freq_base must be a number, got 'x'"),
        ({"qwen3.rope.dimension_count": float("nan")}, "qwen3.rope.dimension_count must be a whole number"),
        ({"tokenizer.ggml.eos_token_id": "2"}, "tokenizer.ggml.eos_token_id must be a token id below"),
        ({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": "4"}, "rope.scaling.factor must be a number"),
        ({"general.alignment": 0.0}, "general.alignment must be a power of two, got 0.0"),
        ({"tokenizer.ggml.bos_token_id": 1e6}, "tokenizer.ggml.bos_token_id must be a token id below"),
        ({"qwen3.rope.scaling.type": "yarn", "qwen3.rope.scaling.factor": 0.0}, "rope_scaling factor (yarn) is 0.0"),
        (
            {"qwen3.attention.sliding_window": 16.0, "qwen3.attention.sliding_window_pattern": "x"},
            "sliding_window_pattern must be a whole number or a list of flags, got 'x'",
        ),
    ],
    ids=[
        "context-string",
        "huge-width",
        "rope-base-string",
        "nan-count",
        "eos-string",
        "yarn-factor",
        "alignment",
        "bos-out-of-range",
        "yarn-factor-0",
        "pattern-string",
    ],
)
def test_gguf_metadata_of_the_wrong_kind_is_refused_naming_the_key(metadata, message, tmp_path):
    """They were a TypeError or ZeroDivisionError traceback, or were blamed on the tokenizer
    (transformers builds a GGUF's tokenizer from the same metadata)."""
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", metadata=metadata)
    with pytest.raises(ValueError, match=re.escape(message)):
        config_from_gguf(path)
    result = serve(path)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert message in result.stderr and "its tokenizer cannot be read" not in result.stderr, result.stderr


def test_llama_gguf_heads_the_rows_do_not_hold_are_refused_naming_the_weight(tmp_path):
    """llama.cpp's converter interleaves a Llama's Q/K rows head by head; undoing that for a
    head count the rows do not hold raised a reshape's RuntimeError, a traceback."""
    from tests.unit.test_model_tiny import llama_linear_rope_tied

    hf_model = save_random_model(llama_linear_rope_tied, tmp_path / "hf")
    heads = hf_model.config.num_attention_heads
    path = write_gguf(
        hf_model,
        tmp_path / "model.gguf",
        "llama",
        metadata={
            "llama.attention.head_count": float(2 * heads),
            **dict.fromkeys(("llama.attention.key_length", "llama.attention.value_length"), 4.0),
            "llama.rope.dimension_count": 4.0,
        },
    )
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.weight has \d+ rows: the config implies"):
        ModelRunner(str(path), torch.float32)


def test_a_head_count_that_does_not_divide_is_refused_before_any_process_starts(tmp_path):
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", metadata={"qwen3.attention.head_count_kv": 3.0})
    result = serve(path)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
    assert "is not a multiple of its num_kv_heads 3" in result.stderr


def test_what_the_machine_cannot_give_is_refused_before_the_model_loads(tmp_path):
    """Each found before the model loads, in a line: before, an address in use was found once
    the model had loaded (after "ready"), a cache path that is a file was a traceback, and an
    unknown SLUICE_DISABLE_ISA name, a missing media folder and a thousand threads were taken."""
    model = Path(ServerArgs().resolved_model_path())
    (tmp_path / "a-file").write_text("")
    cpus = len(os.sched_getaffinity(0))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases = [
            (("--allowed-local-media-path", str(tmp_path / "none")), {}, "--allowed-local-media-path"),
            (("--num-threads", str(cpus + 1)), {}, f"--num-threads {cpus + 1} is more than the {cpus} CPUs"),
            (
                ("--num-threads", "1", "--dp-size", str(cpus + 1)),
                {},
                f"--num-threads 1 x --dp-size {cpus + 1} is more than the {cpus} CPUs",
            ),
            ((), {"SLUICE_CACHE_DIR": str(tmp_path / "a-file")}, "cannot make sluice's cache folder"),
            (("--port", str(port)), {}, f"cannot listen on --host 127.0.0.1 --port {port}"),
            (("--http-server", "granian", "--host", "localhost"), {}, "host must be an IP address"),
            (("--http-server", "granian", "--host", "fe80::1%lo"), {}, "host must be an IP address"),
            (("--kv-cache-memory-gb", "1e300"), {}, "kv_cache_memory_gb must be a number > 0 and at most 1,000,000"),
        ]
        for flags, env, message in cases:
            result = serve(model, *flags, env=env)
            assert result.returncode == 1, (flags, env, result.stderr)
            assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr
            assert message in result.stderr, result.stderr
    # Read where the kernels load (the Scheduler, as it loads the model): a line, status 1.
    result = serve(model, env={"SLUICE_DISABLE_ISA": "amx,avx-512"})
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "SLUICE_DISABLE_ISA names avx-512, which it does not know" in result.stderr, result.stderr


def test_a_gguf_head_count_of_zero_is_refused_naming_the_key(tmp_path):
    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", metadata={"qwen3.attention.head_count": 0.0})
    with pytest.raises(
        ValueError,
        match=re.escape("qwen3.attention.head_count must be a whole number from 1 to 2,147,483,647, got 0.0"),
    ):
        config_from_gguf(path)


def test_an_explicit_quantization_that_cannot_apply_is_refused_not_run_dense(tmp_path):
    save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    with pytest.raises(ValueError, match=re.escape("--quantization gguf keeps a GGUF file's blocks")):
        ModelRunner(str(tmp_path / "hf"), torch.float32, "gguf")


@pytest.mark.parametrize("block_type", ["Q8_0", "Q4_1"])
def test_gguf_blocks_with_a_nan_scale_are_refused_naming_the_tensor(block_type, tmp_path):
    """The float scan covered dense and dequantized tensors; blocks kept as blocks were served
    with a NaN scale: token 0 for everything."""
    import gguf

    hf_model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "qwen3", block_type)
    tensor = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_q.weight")
    blocks = np.array(tensor.data, dtype=np.uint8)
    blocks.reshape(-1)[:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)  # the first block's d
    spoiled = copy_gguf(path, tmp_path / "spoiled.gguf", replace={tensor.name: (blocks, block_type)})
    message = "tensor blk.0.attn_q.weight of spoiled.gguf holds NaN or infinite block scales"
    with pytest.raises(ValueError, match=re.escape(message)):
        ModelRunner(str(spoiled), torch.float32, quantization="auto")
