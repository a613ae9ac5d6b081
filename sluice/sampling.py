"""Client errors, and the check that a request's sampling parameters are in range.

The main process validates every request here before anything is scheduled, so the
scheduler and the sampler can trust the values they are given.
"""

from __future__ import annotations

import math
from typing import Final

from sluice.messages import SamplingParams

MAX_STOP_STRINGS: Final = 16
MAX_STOP_STRING_CHARS: Final = 256
MAX_SEED: Final = 2**63  # exclusive
# Any larger top_k means the whole vocabulary as well; this bound keeps the value within
# what msgpack carries to the Scheduler (a larger one failed the send with a 500).
MAX_TOP_K: Final = 2**31 - 1
# Most alternatives a request may ask for per token (native top_logprobs_num, OpenAI chat's top_logprobs).
MAX_TOP_LOGPROBS: Final = 20
# OpenAI's range for a logit bias, and a bound on how many tokens one request may bias.
MAX_LOGIT_BIAS: Final = 100.0
MAX_LOGIT_BIAS_TOKENS: Final = 1024
MIN_REPETITION_PENALTY: Final = 0.01
MAX_REPETITION_PENALTY: Final = 100.0


class ClientError(ValueError):
    """A request the client got wrong; the server answers it with 400."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def validate_sampling_params(p: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise ClientError naming the first field that is out of range, and its range."""
    _check(p.max_new_tokens >= 0, "max_new_tokens", "must be >= 0", p.max_new_tokens)
    _check(
        0 <= p.min_new_tokens <= p.max_new_tokens,
        "min_new_tokens",
        f"must be in [0, max_new_tokens={p.max_new_tokens}]",
        p.min_new_tokens,
    )
    _check(
        math.isfinite(p.temperature) and p.temperature >= 0,
        "temperature",
        "must be a finite number >= 0",
        p.temperature,
    )
    _check(0 < p.top_p <= 1, "top_p", "must be in (0, 1]", p.top_p)
    _check(-1 <= p.top_k <= MAX_TOP_K, "top_k", f"must be -1 or 0 (disabled) or in [1, {MAX_TOP_K}]", p.top_k)
    _check(0 <= p.min_p <= 1, "min_p", "must be in [0, 1]", p.min_p)
    # Bounded so that a logit divided or multiplied by it stays a float32 number: 1e-45
    # became 0 there, and the logits it divided, inf (garbage, or a grammar's dead end).
    _check(
        MIN_REPETITION_PENALTY <= p.repetition_penalty <= MAX_REPETITION_PENALTY,
        "repetition_penalty",
        f"must be in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY}]",
        p.repetition_penalty,
    )
    _check(-2 <= p.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]", p.frequency_penalty)
    _check(-2 <= p.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]", p.presence_penalty)
    if p.seed is not None:
        _check(0 <= p.seed < MAX_SEED, "seed", "must be in [0, 2**63)", p.seed)
    if p.stream_interval is not None:
        _check(1 <= p.stream_interval < 2**31, "stream_interval", "must be in [1, 2**31)", p.stream_interval)
    _check_stop(p.stop)
    _check_stop_token_ids(p.stop_token_ids, vocab_size)
    _check_logit_bias(p.logit_bias, vocab_size)


def _check_logit_bias(logit_bias: dict[int, float], vocab_size: int | None) -> None:
    _check(
        len(logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
        "logit_bias",
        f"must bias at most {MAX_LOGIT_BIAS_TOKENS} tokens",
        f"{len(logit_bias)} tokens",
    )
    for token_id, bias in logit_bias.items():
        within = token_id >= 0 and (vocab_size is None or token_id < vocab_size)
        _check(within, "logit_bias", f"keys must be token ids in [0, {vocab_size})", token_id)
        _check(
            math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
            "logit_bias",
            f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            f"{bias} for token {token_id}",
        )


def _check_stop(stop: list[str]) -> None:
    _check(len(stop) <= MAX_STOP_STRINGS, "stop", f"must hold at most {MAX_STOP_STRINGS} strings", len(stop))
    for text in stop:
        _check(
            0 < len(text) <= MAX_STOP_STRING_CHARS,
            "stop",
            f"must hold non-empty strings of at most {MAX_STOP_STRING_CHARS} characters",
            f"a string of {len(text)} characters",
        )


def _check_stop_token_ids(stop_token_ids: list[int], vocab_size: int | None) -> None:
    if vocab_size is None:
        bound, allowed = None, "must be >= 0"
    else:
        bound, allowed = vocab_size, f"must be in [0, {vocab_size})"
    for token_id in stop_token_ids:
        _check(token_id >= 0 and (bound is None or token_id < bound), "stop_token_ids", allowed, token_id)


def _check(ok: bool, param: str, allowed: str, got: object) -> None:
    if not ok:
        raise ClientError(f"{param} {allowed}, got {got}", param=param)
