"""What the text of a token sequence makes of the tokenizer's added tokens: which leave no
text (special ones, with `skip_special_tokens`) and which stand alone, one space from their
neighbours (the others, with `spaces_between_special_tokens`, as slow tokenizers and
vLLM/SGLang have it). The DetokenizerManager writes the text by these rules, and the HTTP
process counts `text_offset` by them."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class SpecialTokenRoles:
    skipped: frozenset[int] = frozenset()  # ids that leave no text
    standalone: dict[int, str] = field(default_factory=dict)  # ids that stand alone, with their text


def special_token_roles(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool) -> SpecialTokenRoles:
    added_tokens = tokenizer.added_tokens_decoder
    skipped = frozenset(token_id for token_id, token in added_tokens.items() if skip_special_tokens and token.special)
    standalone = (
        {token_id: token.content for token_id, token in added_tokens.items() if token_id not in skipped}
        if spaces_between_special_tokens
        else {}
    )
    return SpecialTokenRoles(skipped, standalone)
