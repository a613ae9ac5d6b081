"""Shared fixtures. The real server with the real default model starts once per session,
once with one HTTP worker and once with two behind the MultiTokenizerRouter: every
end-to-end test runs against both topologies."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

from tests.helpers import RunningServer


@pytest.fixture(scope="session", params=[1, 2], ids=["workers1", "workers2"])
def server(request):
    running = RunningServer("--max-total-tokens", "20000", "--tokenizer-worker-num", str(request.param))
    running.tokenizer_worker_num = request.param
    yield running
    running.stop()


@pytest.fixture(scope="session")
def base_url(server) -> str:
    return server.base_url


class TransformersReference(NamedTuple):
    tokenizer: object
    model: object  # a float32 transformers causal LM, in eval mode


@pytest.fixture(scope="session")
def transformers_default_model() -> TransformersReference:
    """transformers' own tokenizer and float32 model of the default GGUF, the reference the
    parity and embedding tests hold sluice to. Loading the model takes transformers half a
    minute on a slow core, so the whole session shares one. The tokenizer is transformers'
    conversion of the file's vocabulary as sluice caches it (test_tokenizer_files checks the
    cached copy against a fresh conversion): converting it again took another 5-10 s."""
    import torch
    from transformers import AutoModelForCausalLM

    from sluice.model_files import default_model_path
    from sluice.tokenizer_files import load_tokenizer

    path = Path(default_model_path())
    tokenizer = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return TransformersReference(tokenizer, model.eval())
