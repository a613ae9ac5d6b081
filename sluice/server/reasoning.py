"""Reasoning models' thinking, moved out of the answer into `reasoning_content`
(`--reasoning-parser`), as SGLang and vLLM do:

    qwen3        `<think>...</think>` at the start of the answer; an answer without `<think>`
                 (thinking turned off, `enable_thinking: false`) is all content
    deepseek-r1  the template opens `<think>` in the prompt, so the answer starts inside the
                 thinking; everything up to `</think>` is reasoning (all of it while no
                 `</think>` came)
"""

from __future__ import annotations

from typing import Final

from sluice.server.stream_tags import partial_tag_len

REASONING_PARSERS: Final = ("none", "qwen3", "deepseek-r1")
THINK_START: Final = "<think>"
THINK_END: Final = "</think>"


def split_reasoning(text: str, parser: str, final: bool = True) -> tuple[str, str, bool]:
    """(reasoning, content, whether the thinking is over) of an answer so far. With `final`
    false, a tail that may be the start of `</think>` is held back from both."""
    if parser == "none":
        return "", text, True
    stripped = text.lstrip()
    opened = stripped.startswith(THINK_START)
    if not opened and not final and THINK_START.startswith(stripped):
        # "<thi" or only whitespace: it may still open, and what is sent now cannot be taken
        # back (deepseek-r1 sent "<thi" as reasoning, then cut as much off the real one).
        return "", "", False
    if parser == "qwen3" and not opened:
        return "", text, True
    body = stripped[len(THINK_START) :] if opened else text
    end = body.find(THINK_END)
    if end >= 0:
        return body[:end], body[end + len(THINK_END) :], True
    held = 0 if final else partial_tag_len(body, THINK_END)
    return body[: len(body) - held], "", False
