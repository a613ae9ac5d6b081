"""Logprobs in OpenAI's formats: the text and bytes of single tokens (cached), the entries of
a native chunk, and the completions and chat shapes built from them."""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluice.messages import TokenLogprob
from sluice.server.token_bytes import TokenBytes
from sluice.special_tokens import SpecialTokenRoles, special_token_roles
from sluice.tokenizer.result import GenerateChunk

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TokenTexts:
    """The text and bytes of single tokens, cached: logprobs name every token and its top
    alternatives. A token's text is its bytes where they are whole characters (" cat", with
    the space a SentencePiece token spells), else the token decoded alone ("�" for a piece
    of a character, whose bytes are then the token's own)."""

    def __init__(self) -> None:
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._token_bytes: TokenBytes | None = None
        self._texts: dict[int, tuple[str, bytes]] = {}
        self._roles: dict[tuple[bool, bool], SpecialTokenRoles] = {}
        self._strips_first_space: bool | None = None

    def bind(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if tokenizer is not self._tokenizer:
            self._tokenizer, self._token_bytes, self._texts = tokenizer, TokenBytes(tokenizer), {}
            self._roles, self._strips_first_space = {}, None

    @property
    def strips_first_space(self) -> bool:
        """Whether decoding drops the space that a text's first token spells (SentencePiece
        tokenizers whose decoder strips it: Llama 2, Mistral, Phi-3), so that an output's text,
        decoded a run of ordinary tokens at a time, starts each run without it."""
        if self._strips_first_space is None:
            if self._tokenizer is None:
                raise RuntimeError("TokenTexts.bind() names the tokenizer before any text is asked for")
            # "a" alone: a SentencePiece tokenizer puts its own space in front ("▁a"), where
            # " a" may begin with a piece of spaces ("▁▁", which decodes to one).
            ids = self._tokenizer.encode("a", add_special_tokens=False)
            spaced = next((i for i in ids if self.bytes_of(i).startswith(b" ")), None)
            self._strips_first_space = spaced is not None and not self.decode([spaced]).startswith(" ")
        return self._strips_first_space

    def special_token_roles(self, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> SpecialTokenRoles:
        """What the output's text makes of added tokens, with these settings (see special_tokens)."""
        key = (skip_special_tokens, spaces_between_special_tokens)
        if key not in self._roles:
            self._roles[key] = special_token_roles(self._tokenizer, *key)
        return self._roles[key]

    def __call__(self, token_id: int) -> str:
        return self._text_and_bytes(token_id)[0]

    def bytes_of(self, token_id: int) -> bytes:
        return self._text_and_bytes(token_id)[1]

    def is_added(self, token_id: int) -> bool:
        return self._token_bytes is not None and self._token_bytes.is_added(token_id)

    def _text_and_bytes(self, token_id: int) -> tuple[str, bytes]:
        known = self._texts.get(token_id)
        if known is None:
            own = self._token_bytes(token_id) if self._token_bytes is not None else None
            try:
                text = own.decode("utf-8") if own is not None else None
            except UnicodeDecodeError:
                text = None
            text = self.decode([token_id]) if text is None else text
            known = self._texts[token_id] = (text, text.encode("utf-8") if own is None else own)
        return known

    def decode(self, token_ids: list[int]) -> str:
        if self._tokenizer is None:
            raise RuntimeError("TokenTexts.bind() names the tokenizer before any text is asked for")
        text = self._tokenizer.decode(token_ids)
        if not isinstance(text, str):  # a list of lists would decode to several texts
            raise TypeError(f"decoding one sequence gave {type(text).__name__}")
        return text


@dataclass(slots=True)
class LogprobEntry:
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


def logprob_entries(chunk: GenerateChunk, kind: str) -> list[LogprobEntry]:
    """kind "output" or "input": the chunk's token logprobs with their top alternatives."""
    logprobs: Sequence[float | None]
    if kind == "output":
        logprobs, token_ids, tops = chunk.output_logprobs, chunk.output_ids, chunk.output_top_logprobs
    else:
        logprobs, token_ids, tops = chunk.input_logprobs, chunk.input_token_ids, chunk.input_top_logprobs
    # Without logprobs asked for, the chunk carries none: no entries.
    return [
        LogprobEntry(token_id, logprob, _alternatives(tops, i))
        for i, (logprob, token_id) in enumerate(zip(logprobs, token_ids, strict=False))
    ]


def _alternatives(tops: list[list[TokenLogprob]], position: int) -> list[tuple[int, float]]:
    return [(t.token_id, t.logprob) for t in tops[position]] if position < len(tops) else []


class TextOffsets:
    """Where each token starts in a choice's text, in characters, streamed token by token.
    Counted over the tokens' bytes, so the pieces of one character (a CJK character is often
    two or three byte-level tokens, each "�" alone) take one character of the text, not one
    each; a token that ends a character begun before it starts at that character. Output
    tokens count as the detokenizer writes them (`roles`): a skipped special token takes no
    characters, a standalone one stands one space from its neighbours; where decoding strips
    the space a text's first token spells (`strips_first_space`, SentencePiece's Llama 2),
    a run of ordinary tokens starts without it, unless it goes on from the prompt's
    (`continues_prompt`: the detokenizer decoded it after the prompt's last tokens)."""

    def __init__(
        self, roles: SpecialTokenRoles | None = None, strips_first_space: bool = False, continues_prompt: bool = False
    ) -> None:
        self.chars = 0
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._roles = roles or SpecialTokenRoles()
        self._strips_first_space = strips_first_space
        self._output_shown = continues_prompt  # the output's text so far holds a piece (or the prompt's)
        self._in_run = continues_prompt  # and the last piece is a run of ordinary tokens, still going
        self._before_first_shown = continues_prompt  # the prompt's run is still there to go on from

    def prompt(self, token_ids: list[int], text: str, texts: TokenTexts) -> list[int]:
        """Where each prompt token (echo) starts in the prompt's text as written; the output's
        tokens then count from its end. A token the text does not hold where the count stands
        takes no characters (the BOS the tokenizer put in: Llama 3's pointed every offset 17
        characters on), or one fewer (the space a SentencePiece tokenizer puts before the
        first word); one the tokenizer normalised counts as it is spelt."""
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        at, starts = 0, []
        for token_id in token_ids:
            piece = utf8.decode(texts.bytes_of(token_id))
            starts.append(min(at, len(text)))
            if text.startswith(piece, at):
                at += len(piece)
            elif piece.startswith(" ") and text.startswith(piece[1:], at):
                at += len(piece) - 1
            elif not texts.is_added(token_id):
                at += len(piece)
        self.chars = len(text)
        return starts

    def next(self, token_id: int, token_bytes: bytes) -> int:
        """The start of output token `token_id`."""
        if token_id in self._roles.skipped:
            return self.chars
        standalone = self._roles.standalone.get(token_id)
        if self._before_first_shown:  # an output that starts with a standalone token starts afresh
            self._before_first_shown = False
            if standalone is not None:
                self._output_shown = self._in_run = False
        # A piece after another starts one space on: a standalone token, or the run of
        # ordinary tokens after one.
        if (standalone is not None or not self._in_run) and self._output_shown:
            self.chars += 1
        starts_run = standalone is None and not self._in_run
        self._output_shown, self._in_run = True, standalone is None
        if standalone is not None:
            start = self.chars
            self.chars += len(standalone)
            return start
        if starts_run and self._strips_first_space and token_bytes.startswith(b" "):
            token_bytes = token_bytes[1:]
        return self._count(token_bytes)

    def _count(self, token_bytes: bytes) -> int:
        start = self.chars
        self.chars += len(self._utf8.decode(token_bytes))
        return start


def completion_logprobs(
    entries: list[LogprobEntry],
    texts: TokenTexts,
    offsets: TextOffsets,
    prompt_entries: int = 0,
    prompt_text: str = "",
) -> dict[str, Any]:
    """OpenAI's completions format; text_offset indexes the choice's text, `offsets` goes on
    from the choice's earlier chunks. The first `prompt_entries` are the prompt's (echo), whose
    text is `prompt_text`."""
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []
    prompt_ids = [e.token_id for e in entries[:prompt_entries]]
    starts = offsets.prompt(prompt_ids, prompt_text, texts) if prompt_ids else []
    starts += [offsets.next(e.token_id, texts.bytes_of(e.token_id)) for e in entries[prompt_entries:]]
    for entry in entries:
        text = texts(entry.token_id)
        tokens.append(text)
        if entry.logprob is None:
            top_logprobs.append(None)  # the first prompt token: nothing to condition on
            continue
        # Like OpenAI, the chosen token is always among its alternatives.
        top = {texts(token_id): logprob for token_id, logprob in entry.top}
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": top_logprobs,
        "text_offset": starts,
    }


def chat_logprobs(entries: list[LogprobEntry], texts: TokenTexts, top_count: int) -> list[dict[str, Any]]:
    def token_info(token_id: int, logprob: float | None) -> dict[str, Any]:
        return {"token": texts(token_id), "logprob": logprob, "bytes": list(texts.bytes_of(token_id))}

    return [
        {**token_info(e.token_id, e.logprob), "top_logprobs": [token_info(t, lp) for t, lp in e.top[:top_count]]}
        for e in entries
    ]
