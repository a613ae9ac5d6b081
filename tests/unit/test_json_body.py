"""The nesting bound on request bodies (sluice/server/json_body.py): the vectorised scan
agrees with a byte-by-byte reading of JSON, whatever the chunk size, and decode_json
refuses a body nested past MAX_JSON_DEPTH with a ClientError naming the limit."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sluice.sampling import ClientError
from sluice.server.json_body import MAX_JSON_DEPTH, decode_json, nests_deeper_than
from sluice.server.openai_protocol import ChatCompletionRequest, CompletionRequest


def reference_depth(text: bytes) -> int:
    """The deepest nesting of arrays and objects, reading one byte at a time."""
    depth = deepest = 0
    in_string = escaped = False
    for byte in text:
        if in_string:
            if escaped:
                escaped = False
            elif byte == ord("\\"):
                escaped = True
            elif byte == ord('"'):
                in_string = False
        elif byte == ord('"'):
            in_string = True
        elif byte in b"[{":
            depth += 1
            deepest = max(deepest, depth)
        elif byte in b"]}":
            depth -= 1
    return deepest


def random_value(rng: random.Random, depth: int):
    kind = rng.random()
    if depth > 0 and kind < 0.35:
        return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    if depth > 0 and kind < 0.6:
        return {rng.choice(["a", "[", "{\\", '"]']): random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))}
    if kind < 0.85:  # strings full of brackets, quotes and backslashes
        return "".join(
            rng.choice(["[", "]", "{", "}", '"', "\\", "\\\\", '\\"', "x", " "]) for _ in range(rng.randint(0, 12))
        )
    return rng.choice([0, 1.5, None, True])


@pytest.mark.parametrize("seed", range(40))
def test_the_scan_agrees_with_a_byte_by_byte_reading(seed):
    rng = random.Random(seed)
    text = json.dumps(random_value(rng, rng.randint(1, 12))).encode()
    deepest = reference_depth(text)
    for chunk_bytes in (1, 2, 3, 7, 64, 1 << 20):
        for limit in (0, 1, deepest - 1, deepest, deepest + 1):
            assert nests_deeper_than(text, limit, chunk_bytes) == (deepest > limit), (text, limit, chunk_bytes)


def test_backslash_runs_across_chunk_boundaries():
    # A string ending in an even run of backslashes closes at the quote; an odd run escapes it.
    closed = b'["' + b"\\" * 6 + b'", [[[1]]]]'
    escaped = b'["' + b"\\" * 5 + b'" [[[1]]] "]'
    for chunk_bytes in range(1, 12):
        assert nests_deeper_than(closed, 3, chunk_bytes)
        assert not nests_deeper_than(escaped, 1, chunk_bytes)


@pytest.mark.parametrize(
    "body",
    [
        b'{"text": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b"[" * 100_000,  # not even closed
        b'{"a": ' * (MAX_JSON_DEPTH + 1) + b"1" + b"}" * (MAX_JSON_DEPTH + 1),
    ],
)
def test_deep_bodies_are_a_client_error_naming_the_limit(body):
    with pytest.raises(ClientError) as error:
        decode_json(body, Any)
    assert f"the limit is {MAX_JSON_DEPTH}" in error.value.message


def test_the_limit_itself_and_brackets_in_strings_are_fine():
    at_limit = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    assert reference_depth(at_limit) == MAX_JSON_DEPTH
    assert decode_json(at_limit, Any) is not None
    assert decode_json(json.dumps({"text": "[" * 10_000}).encode(), Any) == {"text": "[" * 10_000}


def test_a_null_where_the_field_takes_none_is_its_default():
    """As OpenAI's nullable parameters: `"stream": null` is no stream, at any depth; a null
    where a value is required stays an error naming the field."""
    body = {
        "messages": [{"role": "user", "content": "hi", "name": None}],
        "stream": None,
        "logprobs": None,
        "stream_options": {"include_usage": None},
        "top_logprobs": None,
    }
    request = decode_json(json.dumps(body).encode(), ChatCompletionRequest)
    assert request.stream is False and request.logprobs is False and request.stream_options.include_usage is False
    assert decode_json(b'{"prompt": "hi", "echo": null}', CompletionRequest).echo is False
    for bad, field in [(b'{"prompt": null}', "prompt"), (b'{"prompt": "hi", "echo": 3}', "echo")]:
        with pytest.raises(ClientError) as refused:
            decode_json(bad, CompletionRequest)
        assert refused.value.param == field
    with pytest.raises(ClientError, match=r"got `null` - at `\$.messages\[0\]`"):
        decode_json(b'{"messages": [null]}', ChatCompletionRequest)
