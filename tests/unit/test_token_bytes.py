"""Each token's own bytes for logprobs (sluice/server/token_bytes.py): joined, an answer's
tokens give back its text even where a character is split over tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers
from transformers import PreTrainedTokenizerFast

from sluice.messages import FinishReason
from sluice.model_files import default_model_path
from sluice.server.logprobs import LogprobEntry, TokenTexts, chat_logprobs
from sluice.server.openai_protocol import CompletionRequest
from sluice.server.openai_views import CompletionView
from sluice.server.token_bytes import byte_level_alphabet
from sluice.tokenizer.result import GenerateChunk
from sluice.tokenizer_files import load_tokenizer

TEXT = "I like 🦙, 世界 and naïve cafés."


def texts_of(tokenizer) -> TokenTexts:
    texts = TokenTexts()
    texts.bind(tokenizer)
    return texts


def test_the_byte_level_alphabet_spells_every_byte_once():
    alphabet = byte_level_alphabet()
    assert sorted(alphabet.values()) == list(range(256))
    assert alphabet["A"] == ord("A") and alphabet["Ġ"] == ord(" ") and alphabet["Ċ"] == ord("\n")


def test_byte_level_tokens_join_to_the_text():
    tokenizer = load_tokenizer(default_model_path())
    ids = tokenizer.encode(TEXT)
    texts = texts_of(tokenizer)
    assert b"".join(texts.bytes_of(i) for i in ids) == TEXT.encode()
    broken = [i for i in ids if texts(i) == "\ufffd"]
    assert broken, "the test needs a character split over tokens"
    assert all(len(texts.bytes_of(i)) < 4 for i in broken)  # pieces of a character, not U+FFFD's 3 bytes
    entries = [LogprobEntry(i, -1.0, []) for i in ids]
    assert bytes(b for entry in chat_logprobs(entries, texts, 0) for b in entry["bytes"]).decode() == TEXT
    assert texts.bytes_of(2) == b"<|im_end|>"  # an added token is its text


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A Llama-2-style tokenizer: "▁" for spaces, bytes as <0xXX> where no piece fits, and a
    piece of two spaces ("▁▁") merged first, as Llama 2's vocabulary has it."""
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


def test_sentencepiece_tokens_keep_their_space_and_bytes(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    ids = tokenizer.encode("I like cat 🦙", add_special_tokens=False)
    texts = texts_of(tokenizer)
    assert [texts(i) for i in ids[:4]] == [" I", " like", " cat", " "]  # decoded alone, " I" would be "I"
    assert b"".join(texts.bytes_of(i) for i in ids) == " I like cat 🦙".encode()
    assert [texts.bytes_of(i) for i in ids[4:]] == [bytes([b]) for b in "🦙".encode()]


def test_text_offsets_start_where_the_text_does_when_decoding_drops_the_first_space(sentencepiece_tokenizer):
    """A Llama-2 tokenizer decodes "▁I▁like▁cat" to "I like cat": counted by their bytes the
    offsets ran a character ahead of the text from the first token on."""
    tokenizer = sentencepiece_tokenizer
    texts = texts_of(tokenizer)
    assert texts.strips_first_space and not texts_of(load_tokenizer(default_model_path())).strips_first_space
    ids = tokenizer.encode("I like cat", add_special_tokens=False)
    request = CompletionRequest(prompt="Hi", logprobs=0)
    view = CompletionView("model-x", "abc", texts, request, ["Hi"])
    answer = GenerateChunk(
        rid="r0",
        path="batch",
        index=0,
        text=tokenizer.decode(ids),
        output_ids=ids,
        finish_reason=FinishReason(type="length"),
        return_logprob=True,
        output_logprobs=[-0.5] * len(ids),
        output_top_logprobs=[[]] * len(ids),
    )
    choice = view.final_choice(0, answer)
    assert choice["text"] == "I like cat"
    assert choice["logprobs"]["text_offset"] == [0, 1, 6]
