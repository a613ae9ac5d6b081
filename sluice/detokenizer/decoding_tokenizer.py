"""The detokenizer's tokenizer, loaded without transformers where it can be.

The detokenizer only decodes, and a fast tokenizer's `decode` is its Rust tokenizer's (the
`tokenizers` package) unless it cleans up spaces after. Importing transformers and setting
up its tokenizer took 2.4 s of CPU in the detokenizer at every start, on two cores beside
the Scheduler's torch import and the HTTP process. So the first start saves the Rust
tokenizer (checked to decode the whole vocabulary as transformers does) into sluice's
cache, and later starts load that alone: 0.2-0.3 s for SmolLM2's on two busy cores.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import logging
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers

from sluice.tokenizer_files import default_tokenizer_cache_dir, load_tokenizer, tokenizer_source_digest

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Consecutive ids decoded together when a tokenizer is checked: each window also tests how
# its tokens join (spaces, byte fallback, added tokens between ordinary ones).
CHECK_WINDOW_TOKENS = 16


class DecodingTokenizer:
    """What the detokenizer asks of a tokenizer (`decode` and `added_tokens_decoder`, as
    transformers names them), answered by a Rust tokenizer alone."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self.added_tokens_decoder: dict[int, tokenizers.AddedToken] = backend.get_added_tokens_decoder()

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)


def load_decoding_tokenizer(
    model_path: str, cache_dir: str | None = None
) -> DecodingTokenizer | PreTrainedTokenizerBase:
    """The tokenizer that decodes `model_path`'s tokens: its cached Rust tokenizer, else
    transformers' (whose Rust tokenizer is cached for the next start where it decodes alike)."""
    cached = _cached_backend(model_path, cache_dir)
    if cached is None:  # a path load_tokenizer refuses, with its reason
        return load_tokenizer(model_path)
    if cached.is_file():
        started = time.perf_counter()
        try:
            backend = tokenizers.Tokenizer.from_file(str(cached))
        except Exception:  # a damaged cache must not stop the server: build it again
            logger.warning("decoding tokenizer cache %s is unreadable; building it again", cached, exc_info=True)
            with contextlib.suppress(OSError):
                cached.unlink()
        else:
            logger.info("loaded the decoding tokenizer from cache %s in %.2f s", cached, time.perf_counter() - started)
            return DecodingTokenizer(backend)
    tokenizer = load_tokenizer(model_path)
    alike = backend_that_decodes_alike(tokenizer)
    if alike is None:
        return tokenizer
    _publish(alike, cached)
    return DecodingTokenizer(alike)


def backend_that_decodes_alike(tokenizer: Any) -> tokenizers.Tokenizer | None:
    """A copy of the Rust tokenizer under a transformers tokenizer, where it decodes every
    window of the vocabulary, with and without skip_special_tokens, to the same text as the
    transformers tokenizer does; None where it does not (a slow tokenizer, one that cleans
    up spaces after decoding, a class whose decode adds its own steps)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not getattr(tokenizer, "is_fast", False) or backend is None or tokenizer.clean_up_tokenization_spaces:
        return None
    copy = tokenizers.Tokenizer.from_str(backend.to_str())  # as the cache will give it back
    vocab_size = len(tokenizer)
    for start in range(0, vocab_size, CHECK_WINDOW_TOKENS):
        window = list(range(start, min(start + CHECK_WINDOW_TOKENS, vocab_size)))
        for skip in (False, True):
            if tokenizer.decode(window, skip_special_tokens=skip) != copy.decode(window, skip_special_tokens=skip):
                return None
    return copy


def _cached_backend(model_path: str, cache_dir: str | None) -> Path | None:
    """Where the Rust tokenizer of `model_path` is kept: named by what the tokenizer is made
    from, and by the transformers and tokenizers versions that made and read it."""
    source = tokenizer_source_digest(model_path)
    if source is None:
        return None
    digest = hashlib.sha256(source)
    for package in ("transformers", "tokenizers"):
        digest.update(f"{package} {importlib.metadata.version(package)}\n".encode())
    root = Path(cache_dir) if cache_dir is not None else default_tokenizer_cache_dir()
    return root / f"decoding-{digest.hexdigest()[:16]}.json"


def _publish(backend: tokenizers.Tokenizer, cached: Path) -> None:
    """Written to a temporary file, then renamed into place: a reader sees a whole file."""
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{cached.name}.", dir=cached.parent)
    except OSError:
        logger.warning("cannot write the decoding tokenizer cache in %s", cached.parent, exc_info=True)
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(backend.to_str())
        os.replace(staging, cached)
    except OSError:
        logger.warning("cannot write the decoding tokenizer cache %s", cached, exc_info=True)
        with contextlib.suppress(OSError):
            os.unlink(staging)
