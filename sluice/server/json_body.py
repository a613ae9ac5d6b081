"""Request bodies: the one JSON decoder every route uses, and the nesting bound it checks first.

msgspec decodes nested arrays and objects by recursion, so a body nested thousands of
levels deep (`[[[[...`) would end in a RecursionError: a 500, or a dropped connection. No
request to sluice needs more than a few levels, so a body nested deeper than
MAX_JSON_DEPTH is refused with 400 before it is decoded. The check is not recursive and
not a Python loop over bytes: numpy finds the string quotes that are not escaped, masks
what lies inside strings, and a running sum of +1 per `[`/`{` and -1 per `]`/`}` is the
depth (about 0.1 s for the largest body --max-request-body-bytes allows).
"""

from __future__ import annotations

import re
from typing import Any, Final, TypeVar

import msgspec
import numpy as np

from sluice.sampling import ClientError

MAX_JSON_DEPTH: Final = 64

SCAN_CHUNK_BYTES: Final = 1 << 20  # the scan's arrays stay small whatever the body's size
_BACKSLASH, _QUOTE = ord("\\"), ord('"')
_DEPTH_CHANGE = np.zeros(256, dtype=np.int8)
_DEPTH_CHANGE[list(b"[{")] = 1
_DEPTH_CHANGE[list(b"]}")] = -1

_PATH_IN_ERROR = re.compile(r"at `\$\.?([^`]*)`")
_NULL_AT = re.compile(r"^Expected `[^`]*`, got `null` - at `\$([^`]*)`$")
_PATH_STEP = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_UNKNOWN_FIELD = re.compile(r"unknown field `([^`]*)`")
_MISSING_FIELD = re.compile(r"missing required field `([^`]*)`")

T = TypeVar("T")


def nests_deeper_than(body: bytes, limit: int, chunk_bytes: int = SCAN_CHUNK_BYTES) -> bool:
    """Whether arrays and objects in the JSON text `body` nest more than `limit` deep.
    Brackets inside strings do not count. On text that is not JSON the answer is only
    cheap, not meaningful: the decoder then says what is wrong."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # every real request: no scan at all
    data = np.frombuffer(body, dtype=np.uint8)
    depth, in_string, backslashes = 0, 0, 0  # carried from one chunk to the next
    for start in range(0, len(data), chunk_bytes):
        chunk = data[start : start + chunk_bytes]
        is_quote = chunk == _QUOTE
        is_backslash = chunk == _BACKSLASH
        if backslashes or is_backslash.any():
            # The run of backslashes ending at each byte (0 on other bytes); a run that
            # started in an earlier chunk goes on into this one. A quote after an odd run
            # is escaped; the others open or close strings.
            index = np.arange(len(chunk), dtype=np.int32)
            last_other = np.maximum.accumulate(np.where(is_backslash, -1, index))
            run = index - last_other + np.where(last_other < 0, backslashes, 0)
            is_quote[1:] &= run[:-1] % 2 == 0
            is_quote[0] &= backslashes % 2 == 0
            backslashes = int(run[-1])
        inside = (np.cumsum(is_quote, dtype=np.int32) + in_string) % 2 == 1
        change = _DEPTH_CHANGE[chunk]
        change[inside] = 0
        depths = np.cumsum(change, dtype=np.int32)
        if depth + int(depths.max()) > limit:
            return True
        depth, in_string = depth + int(depths[-1]), int(inside[-1])
    return False


def decode_json(body: bytes, kind: type[T]) -> T:
    """Decode a request body into `kind`; anything wrong with it is a ClientError naming the
    field where msgspec can tell it."""
    if not body.strip():
        raise ClientError("the body is empty: send a JSON object")
    if nests_deeper_than(body, MAX_JSON_DEPTH):
        raise ClientError(
            f"the body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep (the limit is {MAX_JSON_DEPTH})"
        )
    try:
        return _decode_with_null_as_default(body, kind)
    except msgspec.ValidationError as e:
        match = _PATH_IN_ERROR.search(str(e))
        where = match.group(1) if match else ""
        unknown = _UNKNOWN_FIELD.search(str(e))
        if unknown:
            field = f"{where}.{unknown.group(1)}" if where else unknown.group(1)
            raise ClientError(f"{field} is not a field this route takes (nothing is silently ignored)", field) from None
        if missing := _MISSING_FIELD.search(str(e)):
            where = f"{where}.{missing.group(1)}" if where else missing.group(1)
        raise ClientError(f"invalid request: {e}", where or None) from None
    except msgspec.DecodeError as e:
        raise ClientError(f"the body is not valid JSON: {e}") from None


def _decode_with_null_as_default(body: bytes, kind: type[T]) -> T:
    """Decode `body`; a field sent as null that cannot be null takes its default, as OpenAI's
    nullable parameters and vLLM's Optional ones do (`"stream": null` is no stream). Only a
    body that has such a null pays for the second decode."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        match = _NULL_AT.match(str(e))
        if match is None:
            raise
        error = e
    document = msgspec.json.decode(body)
    while match is not None and _drop_null(document, match.group(1)):
        try:
            return msgspec.json.decode(msgspec.json.encode(document), type=kind)
        except msgspec.ValidationError as e:
            match, error = _NULL_AT.match(str(e)), e
    raise error


def _drop_null(document: object, path: str) -> bool:
    """Remove the null at `path` (msgspec's `.name` / `[index]` steps) from the object that
    holds it; False where no object field holds a null there (a null array item stays)."""
    steps = [(name, int(index) if index else None) for name, index in _PATH_STEP.findall(path)]
    if not steps or steps[-1][0] == "":
        return False
    parent: Any = document
    for name, index in steps[:-1]:
        parent = parent[name] if name else parent[index]
    last = steps[-1][0]
    if not isinstance(parent, dict) or parent.get(last, 0) is not None:
        return False
    del parent[last]
    return True
