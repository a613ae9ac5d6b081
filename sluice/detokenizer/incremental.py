"""Incremental detokenization of one request's output, with stop strings.

Text is decoded from a short window of recent tokens (the prefix_offset/read_offset
technique): the window's text minus the text of its already-shown start is the new
text. It is held back while it ends in U+FFFD, i.e. while a multi-byte character is
still split across tokens, so a client never sees a broken character. Then stop
strings are matched on what is new plus the few characters held back because they
could start a stop string.

Special tokens and spaces: transformers 5.x fast tokenizers ignore
`spaces_between_special_tokens` and always join special tokens to the text without
spaces. Here the option means what it meant for slow tokenizers (and in vLLM/SGLang):
when True, every added token that is not skipped stands alone and is joined to its
neighbours with one space ("Hi <|im_end|>"); when False the text is exactly
`tokenizer.decode` ("Hi<|im_end|>"). With skip_special_tokens=True and no non-special
added tokens the two agree. `decode_tokens` is the whole-sequence form; the stream
always adds up to it.

The output goes on from the prompt: its first run of ordinary tokens is decoded after the
prompt's last ones (`prompt_tail`, the ordinary tokens after the last standalone one), as
SGLang and vLLM decode it, so that the space a SentencePiece first token spells stays
(the completion of "The" is " cat", not "cat"). An output whose first shown token stands
alone starts afresh.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from sluice.special_tokens import special_token_roles

_REPLACEMENT_CHAR = "\ufffd"
# Text ending in a broken character waits for the tokens that complete it. A UTF-8 character
# spans at most 4 bytes, so ids that still end broken after this many are invalid bytes, as
# the whole decode shows them (U+FFFD): shown, or each step would decode a window growing
# with the output (a model made to repeat a lone byte token, say).
MAX_TOKENS_HELD_FOR_A_CHARACTER = 16


class DetokStep(NamedTuple):
    text: str  # new text to show, beyond what earlier steps returned
    stop_matched: str | None  # set on the step whose text ended at a stop string
    num_tokens: int  # output tokens covered by all text returned so far


class _TokenDecoder:
    """Decodes token ids with the special-token spacing rule described above."""

    def __init__(self, tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        roles = special_token_roles(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._skipped_ids, self._standalone = roles.skipped, roles.standalone

    def decode(self, token_ids: Sequence[int]) -> str:
        """The text of token_ids."""
        if not self._standalone or not self._standalone.keys() & set(token_ids):
            return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        pieces: list[str] = []
        run: list[int] = []
        run_shows = False  # whether the run holds a token that is not skipped
        for token_id in token_ids:
            content = self._standalone.get(token_id)
            if content is None:
                run.append(token_id)
                run_shows = run_shows or token_id not in self._skipped_ids
                continue
            if run_shows:
                pieces.append(self._decode_run(run))
            run, run_shows = [], False
            pieces.append(content)
        if run_shows:
            pieces.append(self._decode_run(run))
        return " ".join(piece for piece in pieces if piece)

    def _decode_run(self, run: list[int]) -> str:
        return self._tokenizer.decode(run, skip_special_tokens=self._skip_special_tokens)

    def prompt_context(self, prompt_tail: Sequence[int]) -> list[int]:
        """The prompt's last tokens an output's first run of ordinary tokens goes on from: those
        after the last standalone one. None where none shows, or where their text ends inside
        a character (the output's first tokens would end it: text of neither)."""
        start = max((i + 1 for i, token_id in enumerate(prompt_tail) if token_id in self._standalone), default=0)
        context = list(prompt_tail[start:])
        if all(token_id in self._skipped_ids for token_id in context) or self.decode(context).endswith(
            _REPLACEMENT_CHAR
        ):
            return []
        return context

    def shows(self, token_id: int) -> bool:
        return token_id not in self._skipped_ids

    def stands_alone(self, token_id: int) -> bool:
        return token_id in self._standalone


def decode_tokens(
    tokenizer,
    token_ids: Sequence[int],
    *,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    prompt_tail: Sequence[int] = (),
) -> str:
    """The whole text of token_ids after a prompt ending in prompt_tail, as
    IncrementalDetokenizer streams it."""
    decoder = _TokenDecoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
    context = decoder.prompt_context(prompt_tail)
    first_shown = next((token_id for token_id in token_ids if decoder.shows(token_id)), None)
    if first_shown is not None and decoder.stands_alone(first_shown):
        context = []
    return decoder.decode([*context, *token_ids])[len(decoder.decode(context)) :]


class _StopStringFilter:
    """Finds stop strings in a stream of text chunks and holds back possible starts of one."""

    def __init__(self, stop: Sequence[str], keep_stop: bool):
        if any(not stop_string for stop_string in stop):
            raise ValueError("stop strings must not be empty")
        self.stop = tuple(dict.fromkeys(stop))
        self._keep_stop = keep_stop
        self._proper_prefixes = frozenset(s[:length] for s in self.stop for length in range(1, len(s)))
        self._longest_prefix_len = max(map(len, self._proper_prefixes), default=0)
        self.held = ""  # the longest suffix of the text so far that may start a stop string

    def push(self, chunk: str, may_stop: bool = True) -> tuple[str, str | None]:
        """Returns the text now safe to show and the stop string that matched, if any (none
        unless `may_stop`: the held text may still start one that a later chunk ends)."""
        text = self.held + chunk
        match = self._first_match(text, len(self.held)) if may_stop else None
        if match is not None:
            start, stop_string = match
            self.held = ""
            return text[: start + len(stop_string) if self._keep_stop else start], stop_string
        hold_len = self._held_suffix_len(text)
        self.held = text[len(text) - hold_len :]
        return text[: len(text) - hold_len], None

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held

    def _first_match(self, text: str, new_from: int) -> tuple[int, str] | None:
        # The match that ends first is the one a character-by-character stream would
        # hit first, so the result does not depend on how tokens were batched; among
        # those ending together the longest wins. Earlier matches were found earlier.
        best: tuple[int, int, str] | None = None
        for stop_string in self.stop:
            start = text.find(stop_string, max(0, new_from - len(stop_string) + 1))
            if start < 0:
                continue
            candidate = (start + len(stop_string), start, stop_string)
            if best is None or candidate[:2] < best[:2]:
                best = candidate
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        for length in range(min(len(text), self._longest_prefix_len), 0, -1):
            if text[-length:] in self._proper_prefixes:
                return length
        return 0


class IncrementalDetokenizer:
    """Turns one request's output token ids into text, step by step.

    Each step decodes only a window of recent tokens, so its cost does not grow with the
    length of the output. After the request has finished (a stop string matched, or
    `finished=True` was passed) further steps return no text and stop_matched=None. A stop
    string ends the output only once it is `min_new_tokens` tokens long, as EOS and stop
    tokens do: the match must end in the text of a later token (as in vLLM). `prompt_tail`: the
    prompt's last tokens, which the text goes on from (`continues_prompt`; see the module's doc).
    """

    def __init__(
        self,
        tokenizer,
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: Sequence[str] = (),
        min_new_tokens: int = 0,
        no_stop_trim: bool = False,
        stream: bool = True,
        prompt_tail: Sequence[int] = (),
    ):
        self._min_new_tokens = min_new_tokens
        self._decoder = _TokenDecoder(tokenizer, skip_special_tokens, spaces_between_special_tokens)
        self._stop_filter = _StopStringFilter(stop, keep_stop=no_stop_trim)
        self._stream = stream
        # The window: ids from the last shown piece on (the prefix), then the ids not yet
        # shown from read_offset on. It starts with the prompt's tokens the text goes on from,
        # kept until the first shown output token says whether it does.
        self._window_ids = self._decoder.prompt_context(prompt_tail)
        self.continues_prompt = bool(self._window_ids)
        self._context_len = len(self._window_ids)
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decoder.decode(self._window_ids)
        # Accounting, in characters of decoded output text and in output tokens.
        self._output_tokens = 0
        self._decoded_chars = 0
        self._returned_chars = 0
        # (decoded_chars, output_tokens) wherever all tokens so far were fully decoded.
        self._checkpoints: deque[tuple[int, int]] = deque([(0, 0)])
        self._unreturned: list[str] = []  # text past the stop-string check, not yet returned
        self._stopped_at_tokens: int | None = None
        self.finished = False

    def step(self, new_token_ids: list[int], finished: bool) -> DetokStep:
        if self.finished:
            return DetokStep("", None, self._num_tokens())
        stop_matched = None
        for token_id in new_token_ids:
            self._output_tokens += 1
            stop_matched = self._accept(self._decode_next(token_id))
            if stop_matched is not None:
                break
        if stop_matched is None and finished:
            stop_matched = self._accept(self._flush_window())
            if stop_matched is None:
                self._unreturned.append(self._stop_filter.flush())
        if stop_matched is not None:
            self._stopped_at_tokens = self._output_tokens
        self.finished = finished or stop_matched is not None
        text = ""
        if self._stream or self.finished:
            text = "".join(self._unreturned)
            self._unreturned.clear()
            self._returned_chars += len(text)
        return DetokStep(text, stop_matched, self._num_tokens())

    def _decode_next(self, token_id: int) -> str:
        """The text token_id completes; "" while it ends inside a character."""
        if self._context_len and self._decoder.shows(token_id):
            if self._decoder.stands_alone(token_id):  # the output starts afresh
                del self._window_ids[: self._context_len]
                self._read_offset, self._prefix_text = 0, ""
            self._context_len = 0
        self._window_ids.append(token_id)
        window_text = self._decode_window(len(self._window_ids))
        held = len(self._window_ids) - self._read_offset
        if window_text.endswith(_REPLACEMENT_CHAR) and held < MAX_TOKENS_HELD_FOR_A_CHARACTER:
            return ""
        self._checkpoint(len(window_text) - len(self._prefix_text))
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. a skipped special token: nothing to show yet, keep the window
        new_text = window_text[len(self._prefix_text) :]
        self._advance_window()
        return new_text

    def _flush_window(self) -> str:
        """At the end, whatever the window still holds, broken characters included."""
        window_text = self._decode_window(len(self._window_ids))
        new_text = window_text[len(self._prefix_text) :]
        self._checkpoint(len(new_text))
        return new_text

    def _decode_window(self, end: int) -> str:
        return self._decoder.decode(self._window_ids[:end])

    def _advance_window(self) -> None:
        # The ids just shown become the prefix of the next window.
        del self._window_ids[: self._read_offset]
        self._read_offset = len(self._window_ids)
        self._prefix_text = self._decode_window(self._read_offset)

    def _checkpoint(self, new_chars: int) -> None:
        if new_chars > 0:
            self._decoded_chars += new_chars
        self._checkpoints.append((self._decoded_chars, self._output_tokens))

    def _accept(self, new_text: str) -> str | None:
        if not new_text:
            return None
        may_stop = self._output_tokens > self._min_new_tokens
        safe_text, stop_matched = self._stop_filter.push(new_text, may_stop)
        self._unreturned.append(safe_text)
        return stop_matched

    def _num_tokens(self) -> int:
        if self._stopped_at_tokens is not None:
            return self._stopped_at_tokens
        # Drop checkpoints that returned text has passed; the first left is the answer.
        checkpoints = self._checkpoints
        while len(checkpoints) > 1 and checkpoints[1][0] <= self._returned_chars:
            checkpoints.popleft()
        return checkpoints[0][1]
