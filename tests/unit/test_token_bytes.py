"""Each token's own bytes for logprobs (sluice/server/token_bytes.py): joined, an answer's
tokens give back its text even where a character is split over tokens."""

from __future__ import annotations

import pytest

from sluice.detokenizer.incremental import IncrementalDetokenizer
from sluice.messages import FinishReason
from sluice.model_files import default_model_path
from sluice.server.logprobs import LogprobEntry, TokenTexts, chat_logprobs
from sluice.server.openai_protocol import CompletionRequest
from sluice.server.openai_views import CompletionView
from sluice.server.token_bytes import byte_level_alphabet
from sluice.tokenizer.result import GenerateChunk
from sluice.tokenizer_files import load_tokenizer
from tests.llama2_tokenizer import encode_marked, llama2_style_tokenizer

TEXT = "I like 🦙, 世界 and naïve cafés."


def texts_of(tokenizer) -> TokenTexts:
    texts = TokenTexts()
    texts.bind(tokenizer)
    return texts


def final_completion_choice(
    texts: TokenTexts, request: CompletionRequest, text: str, ids: list[int], continues_prompt: bool = False
) -> dict:
    """The completions choice of a finished answer `text` of tokens `ids`, with logprobs."""
    view = CompletionView("model-x", "abc", texts, request, [request.prompt])
    answer = GenerateChunk(
        rid="r0",
        path="batch",
        index=0,
        text=text,
        output_ids=ids,
        finish_reason=FinishReason(type="length"),
        return_logprob=True,
        output_logprobs=[-0.5] * len(ids),
        output_top_logprobs=[[]] * len(ids),
        continues_prompt=continues_prompt,
    )
    return view.final_choice(0, answer)


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
    return llama2_style_tokenizer()


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
    choice = final_completion_choice(texts, CompletionRequest(prompt="Hi", logprobs=0), tokenizer.decode(ids), ids)
    assert choice["text"] == "I like cat"
    assert choice["logprobs"]["text_offset"] == [0, 1, 6]


@pytest.mark.parametrize(
    "prompt, output_text, skip_special_tokens, text, offsets",
    [
        ("I", "like cat", True, " like cat", [0, 5]),  # goes on from the prompt: " like" keeps its space
        ("", "like cat", True, "like cat", [0, 4]),  # nothing shown before it: decoded afresh
        ("I", "</s>like cat", False, "</s> like cat", [0, 5, 9]),  # a standalone start: afresh
        ("I", "like</s>cat", False, " like </s> cat", [0, 6, 11]),
    ],
)
def test_text_offsets_follow_an_output_that_goes_on_from_the_prompt(
    sentencepiece_tokenizer, prompt, output_text, skip_special_tokens, text, offsets
):
    """The detokenizer decodes the output after the prompt's last tokens ("I" + " like cat");
    text_offset counts the space the first token keeps, and the standalone starts it does not."""
    tokenizer = sentencepiece_tokenizer
    prompt_ids = tokenizer.encode(prompt)
    ids = encode_marked(tokenizer, output_text)
    detokenizer = IncrementalDetokenizer(
        tokenizer, skip_special_tokens=skip_special_tokens, prompt_tail=prompt_ids[-5:]
    )
    streamed = detokenizer.step(ids, True).text
    assert streamed == text
    request = CompletionRequest(prompt=prompt, logprobs=0, skip_special_tokens=skip_special_tokens)
    choice = final_completion_choice(texts_of(tokenizer), request, streamed, ids, detokenizer.continues_prompt)
    assert choice["text"] == text
    assert choice["logprobs"]["text_offset"] == offsets
