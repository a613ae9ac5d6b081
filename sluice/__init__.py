"""sluice: an LLM serving runtime."""

from __future__ import annotations


def __getattr__(name: str):
    # Imported lazily: `import sluice` must stay cheap for the CLI and the tests.
    if name == "Engine":
        from sluice.launch import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
