"""Tags (`<tool_call>`, `</think>`) that a streamed answer may be in the middle of."""

from __future__ import annotations


def partial_tag_len(text: str, tag: str) -> int:
    """The length of the longest tail of `text` that may be the start of `tag` (0 when
    none): that much waits for more tokens before it goes out."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0
