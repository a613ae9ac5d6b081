"""A tiny Llama-2-style tokenizer: "▁" for spaces, bytes as <0xXX> where no piece fits, a
piece of two spaces ("▁▁") merged first, as Llama 2's vocabulary has it, and a decoder that
drops the first token's space ("▁I▁like" decodes to "I like")."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast


def llama2_style_tokenizer() -> PreTrainedTokenizerFast:
    merges = [("▁", "▁"), ("▁", "I"), ("▁", "l"), ("▁l", "i"), ("▁li", "k"), ("▁lik", "e"), ("▁", "c"), ("▁c", "a")]
    merges += [("▁ca", "t"), ("▁", "a")]
    letters = ["▁", *"Ilikecat"]
    pieces = [
        "<unk>",
        "<s>",
        "</s>",
        *(f"<0x{byte:02X}>" for byte in range(256)),
        *letters,
        *(a + b for a, b in merges),
    ]
    vocab = {piece: i for i, piece in enumerate(dict.fromkeys(pieces))}
    model = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    backend = Tokenizer(model)
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def encode_marked(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    """The ids of text as written (no BOS), with each "</s>" in it the EOS token."""
    return [
        token_id
        for i, part in enumerate(text.split("</s>"))
        for token_id in ([tokenizer.eos_token_id] if i else []) + tokenizer.encode(part, add_special_tokens=False)
    ]
