"""Weights read from the model file only as the model takes them (sluice/model/lazy_weights.py)."""

from __future__ import annotations

import pytest
import torch

from sluice.model import weights as weights_module
from sluice.model.block_rows import BlockFormat, BlockRows
from sluice.model.lazy_weights import LazyWeights
from sluice.model.model_config import ModelConfig
from sluice.model.weights import load_weights
from tests.gguf_files import write_gguf
from tests.unit.test_model_tiny import qwen3_with_qk_norm, save_random_model


def counting_readers(values: dict[str, list[int]]) -> tuple[dict, list[str]]:
    reads: list[str] = []

    def reader(name: str):
        def read() -> list[int]:
            reads.append(name)
            return list(values[name])

        return read

    return {name: reader(name) for name in values}, reads


def test_a_weight_is_read_once_when_first_taken_and_gone_once_deleted():
    readers, reads = counting_readers({"a": [1], "b": [2]})
    weights = LazyWeights(readers)
    assert reads == [] and set(weights) == {"a", "b"} and len(weights) == 2 and "a" in weights
    assert weights["a"] == [1] and weights["a"] == [1]
    assert reads == ["a"]
    del weights["a"]
    assert "a" not in weights and weights.get("a") is None and reads == ["a"]
    with pytest.raises(KeyError):
        del weights["missing"]


def test_transform_and_split_wait_for_the_read():
    readers, reads = counting_readers({"fused": [1, 2, 3], "w": [5]})
    weights = LazyWeights(readers)
    weights.transform("w", lambda value: value * 2)
    weights.split("fused", ["x", "y"], lambda value: [value[:1], value[1:]])
    assert reads == [] and set(weights) == {"w", "x", "y"}
    assert weights["y"] == [2, 3] and reads == ["fused"]
    assert weights["x"] == [1] and reads == ["fused"]  # the whole was read once for both parts
    assert weights["w"] == [5, 5]


def test_transform_and_split_of_weights_already_in_memory():
    weights = LazyWeights.of({"fused": [1, 2], "w": [3]})
    weights.transform("w", lambda value: [*value, 4])
    weights.split("fused", ["x", "y"], lambda value: [value[:1], value[1:]])
    assert dict(weights) == {"w": [3, 4], "x": [1], "y": [2]}


def test_a_gguf_tensor_is_read_from_the_file_only_when_taken(tmp_path, monkeypatch):
    model = save_random_model(qwen3_with_qk_norm, tmp_path / "hf")
    path = write_gguf(model, tmp_path / "model.gguf", "qwen3", "Q8_0")
    config = ModelConfig.from_path(str(path))
    read: list[tuple[int, int]] = []
    real_block_rows = weights_module.block_rows

    def counting_block_rows(data, type_name, shape, format):
        read.append(shape)
        return real_block_rows(data, type_name, shape, format)

    monkeypatch.setattr(weights_module, "block_rows", counting_block_rows)
    weights = load_weights(str(path), config, torch.float32, lambda name: BlockFormat.Q8_0)
    names = [name for name in weights if name.endswith("mlp.down_proj.weight")]
    assert read == [] and len(names) == config.num_layers
    down = weights[names[0]]
    assert isinstance(down, BlockRows) and down.shape == (config.hidden_size, config.intermediate_size)
    assert read == [down.shape]
