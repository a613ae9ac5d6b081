"""Incremental detokenization with the real SmolLM2 tokenizer: whole characters, stop strings;
with a Llama-2-style one, text that goes on from the prompt's."""

from __future__ import annotations

import random

import pytest

from sluice.detokenizer.incremental import DetokStep, IncrementalDetokenizer, decode_tokens
from sluice.model_files import default_model_path
from sluice.tokenizer_files import load_tokenizer
from tests.llama2_tokenizer import encode_marked, llama2_style_tokenizer

IM_START, IM_END = 1, 2

UNICODE_TEXTS = [
    "héllo 世界 🎉👍🏽 naïve café",
    "日本語のテキストと中文混合。",
    "family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, math: ∀x∈ℝ",  # noqa: RUF001 (the point of the test)
    "Ελληνικά, русский, עברית, हिन्दी, 한국어",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def feed(detokenizer: IncrementalDetokenizer, ids: list[int], chunk_size: int = 1) -> list[DetokStep]:
    steps = [detokenizer.step(ids[i : i + chunk_size], False) for i in range(0, len(ids), chunk_size)]
    steps.append(detokenizer.step([], True))
    return steps


def joined(steps: list[DetokStep]) -> str:
    return "".join(step.text for step in steps)


@pytest.mark.parametrize("text", UNICODE_TEXTS)
def test_characters_split_across_tokens_come_out_whole(tokenizer, text):
    ids = tokenizer.encode(text)
    steps = feed(IncrementalDetokenizer(tokenizer), ids)
    assert all("\ufffd" not in step.text for step in steps)
    assert joined(steps) == text == tokenizer.decode(ids)
    # The text really had characters split over tokens, which were held back.
    assert any(step.text == "" for step in steps[:-1])


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_stream_adds_up_to_the_whole_decode(tokenizer, seed, skip_special_tokens, spaces_between_special_tokens):
    rng = random.Random(seed)
    # Random ids break UTF-8 in every way; special ids are mixed in on purpose.
    ids = [rng.randrange(len(tokenizer)) for _ in range(300)]
    for position in rng.sample(range(len(ids)), 15):
        ids[position] = rng.randrange(17)
    detokenizer = IncrementalDetokenizer(
        tokenizer,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
    steps = feed(detokenizer, ids, chunk_size=rng.choice([1, 2, 5]))
    expected = decode_tokens(
        tokenizer,
        ids,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
    assert joined(steps) == expected
    if not spaces_between_special_tokens or skip_special_tokens:
        assert expected == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert steps[-1].num_tokens == len(ids)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_after_a_prompt_a_byte_level_text_is_what_it_was_alone(tokenizer, seed, skip_special_tokens):
    """Decoded after the prompt's last tokens, the stream still adds up to the whole decode
    (of the prompt's tail and the output, less the tail's), and a byte-level tokenizer's
    text is the output's alone: nothing changes for SmolLM2 but standalone spacing."""
    rng = random.Random(seed)
    prompt_tail = [rng.randrange(len(tokenizer)) for _ in range(5)]
    ids = [rng.randrange(len(tokenizer)) for _ in range(200)]
    for position in rng.sample(range(len(ids)), 10):
        ids[position] = rng.randrange(17)
    options = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=False)
    steps = feed(IncrementalDetokenizer(tokenizer, prompt_tail=prompt_tail, **options), ids, rng.choice([1, 3]))
    assert joined(steps) == decode_tokens(tokenizer, ids, prompt_tail=prompt_tail, **options)
    assert joined(steps) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def llama2_tokenizer():
    return llama2_style_tokenizer()


@pytest.mark.parametrize(
    "prompt, output, skip_special_tokens, expected, continues",  # encoded as written: "cat" is "▁cat"
    [
        # The space "▁cat" spells stays: "I like" + " cat cat" (decoded alone: "cat cat").
        ("I like", "cat cat", True, " cat cat", True),
        ("like", "cat", True, " cat", True),
        # A prompt whose last tokens show nothing (a skipped EOS): the text starts afresh.
        ("</s>", "cat", True, "cat", False),
        # An output that starts with a token standing alone starts afresh, as it did.
        ("I like", "</s>cat", False, "</s> cat", True),
        # After a standalone token at the prompt's end, nothing to go on from.
        ("I like</s>", "cat", False, "cat", False),
    ],
)
def test_the_text_goes_on_from_the_prompt(llama2_tokenizer, prompt, output, skip_special_tokens, expected, continues):
    tokenizer = llama2_tokenizer
    prompt_tail, output_ids = encode_marked(tokenizer, prompt)[-5:], encode_marked(tokenizer, output)
    options = dict(skip_special_tokens=skip_special_tokens, spaces_between_special_tokens=True)
    for chunk_size in (1, 2, len(output_ids)):
        detokenizer = IncrementalDetokenizer(tokenizer, prompt_tail=prompt_tail, **options)
        assert joined(feed(detokenizer, output_ids, chunk_size)) == expected
        assert detokenizer.continues_prompt is continues
    assert decode_tokens(tokenizer, output_ids, prompt_tail=prompt_tail, **options) == expected


def test_a_prompt_that_ends_inside_a_character_leaves_the_output_decoded_alone(llama2_tokenizer):
    """The output's first bytes end the prompt's last character: text of neither. The output
    is decoded alone, as the whole decode shows its bytes (nothing of its own text is lost)."""
    tokenizer = llama2_tokenizer
    split = encode_marked(tokenizer, "I 🦙")
    prompt_tail, output_ids = split[:-2], split[-2:] + encode_marked(tokenizer, "cat")
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_tail=prompt_tail)
    assert joined(feed(detokenizer, output_ids)) == tokenizer.decode(output_ids) == "\ufffd\ufffd cat"
    assert not detokenizer.continues_prompt


def test_special_tokens_skipped_or_shown(tokenizer):
    ids = [*tokenizer.encode("Hi there"), IM_END]

    def text_of(**options) -> str:
        return joined(feed(IncrementalDetokenizer(tokenizer, **options), ids))

    assert text_of(skip_special_tokens=True) == "Hi there"
    assert text_of(skip_special_tokens=False, spaces_between_special_tokens=False) == "Hi there<|im_end|>"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "Hi there<|im_end|>"
    assert text_of(skip_special_tokens=False, spaces_between_special_tokens=True) == "Hi there <|im_end|>"


def test_stop_string_spanning_tokens_is_trimmed(tokenizer):
    ids = tokenizer.encode("The answer is 42. More text")
    pieces = [tokenizer.decode([token_id]) for token_id in ids]
    assert not any("answer is" in piece for piece in pieces)  # it spans tokens
    steps = feed(IncrementalDetokenizer(tokenizer, stop=["answer is"]), ids)
    assert joined(steps) == "The "
    assert [step.stop_matched for step in steps if step.stop_matched] == ["answer is"]
    stop_step = next(step for step in steps if step.stop_matched)
    assert stop_step.num_tokens == _tokens_until(tokenizer, ids, "The answer is")


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_a_stop_string_ends_the_output_only_past_min_new_tokens(tokenizer, chunk_size):
    """As EOS: the first stop string whose last character comes from a token after the first
    min_new_tokens ends the output; one begun within them and ended after them counts."""
    ids = tokenizer.encode("a. b. c. d. e. f.")
    assert [tokenizer.decode([i]) for i in ids[:4]] == ["a", ".", " b", "."]  # every 2nd token a "."
    cases = [(0, "a"), (2, "a. b"), (3, "a. b"), (4, "a. b. c"), (len(ids), "a. b. c. d. e. f."), (3, "a. ", "b. c")]
    for min_new_tokens, expected, *stop in cases:
        detokenizer = IncrementalDetokenizer(tokenizer, stop=stop or ["."], min_new_tokens=min_new_tokens)
        assert joined(feed(detokenizer, ids, chunk_size)) == expected, (min_new_tokens, stop)


def test_no_stop_trim_keeps_the_stop_string(tokenizer):
    ids = tokenizer.encode("The answer is 42. More text")
    steps = feed(IncrementalDetokenizer(tokenizer, stop=["answer is"], no_stop_trim=True), ids)
    assert joined(steps) == "The answer is"


def test_stream_never_shows_the_start_of_a_stop_string(tokenizer):
    ids = tokenizer.encode("hello ###")
    shown = ""
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###"])
    for token_id in ids:
        step = detokenizer.step([token_id], False)
        shown += step.text
        assert "#" not in shown
        if step.stop_matched:
            break
    assert step.stop_matched == "###"
    assert shown == "hello "


def test_held_text_is_released_once_it_cannot_be_a_stop_string(tokenizer):
    text = "a ## b #"
    ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["###"])
    shown_after_each = []
    shown = ""
    for token_id in ids:
        shown += detokenizer.step([token_id], False).text
        shown_after_each.append(shown)
    decoded_after_each = [tokenizer.decode(ids[: count + 1]) for count in range(len(ids))]
    # "##" was held back while it could start "###", and shown once " b" ruled that out.
    assert any(
        "##" in decoded and "#" not in shown
        for decoded, shown in zip(decoded_after_each, shown_after_each, strict=True)
    )
    assert shown == "a ## b "  # the trailing "#" may still become "###"
    final = detokenizer.step([], True)
    assert shown + final.text == text and final.stop_matched is None


def test_text_after_a_stop_string_is_never_returned(tokenizer):
    ids = tokenizer.encode("one two STOP three four")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["STOP"])
    step = detokenizer.step(ids, False)  # all tokens in one step
    assert step == DetokStep("one two ", "STOP", _tokens_until(tokenizer, ids, "one two STOP"))
    assert detokenizer.finished
    assert detokenizer.step(tokenizer.encode(" more"), True) == DetokStep("", None, step.num_tokens)


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        # "bc" completes first, though "abcdef" starts first
        ("xyz abcdef", ["abcdef", "bc"], ("xyz a", "bc")),
        # the same inside one token, " hello"
        ("say hello world", ["hello", "ell"], ("say h", "ell")),
        # both complete on the same character: the longer one wins
        ("xyz abcdef", ["bc", "z abc"], ("xy", "z abc")),
    ],
)
def test_first_completed_stop_string_wins_however_tokens_are_batched(tokenizer, text, stop, expected):
    ids = tokenizer.encode(text)
    for chunk_size in (1, 2, len(ids)):
        steps = feed(IncrementalDetokenizer(tokenizer, stop=stop), ids, chunk_size)
        assert (joined(steps), next(step.stop_matched for step in steps if step.stop_matched)) == expected


def test_non_stream_returns_all_text_at_the_end(tokenizer):
    text = "Hello 世界, bye"
    ids = tokenizer.encode(text)
    steps = feed(IncrementalDetokenizer(tokenizer, stream=False), ids)
    assert all(step.text == "" for step in steps[:-1])
    assert steps[-1] == DetokStep(text, None, len(ids))
    stopped = feed(IncrementalDetokenizer(tokenizer, stop=[","], stream=False), ids)
    assert [(step.text, step.stop_matched) for step in stopped if step.text or step.stop_matched] == [
        ("Hello 世界", ",")
    ]


def test_num_tokens_counts_only_tokens_whose_text_was_shown(tokenizer):
    ids = tokenizer.encode("a b <END")
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["<END>"])
    step = detokenizer.step(ids, False)
    assert step.text == "a b "  # "<END" may still become "<END>"
    assert step.num_tokens == _tokens_within(tokenizer, ids, "a b ") < len(ids)
    assert detokenizer.step([], True) == DetokStep("<END", None, len(ids))


def test_each_step_decodes_only_a_short_window(tokenizer):
    class RecordingTokenizer:
        longest_decode = 0

        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, ids, **options):
            RecordingTokenizer.longest_decode = max(RecordingTokenizer.longest_decode, len(ids))
            return tokenizer.decode(ids, **options)

    ids = tokenizer.encode("Streaming 世界 🎉 text, " * 150)
    steps = feed(IncrementalDetokenizer(RecordingTokenizer(), stop=["never appears"]), ids)
    assert joined(steps) == tokenizer.decode(ids)
    assert len(ids) > 1000 and RecordingTokenizer.longest_decode <= 8
    # Bytes that never make a character (token 111 is a lone 0xA1) are shown as the whole
    # decode shows them, without the window growing with the output.
    RecordingTokenizer.longest_decode = 0
    broken = [111] * 1000 + tokenizer.encode(" then text")
    steps = feed(IncrementalDetokenizer(RecordingTokenizer()), broken)
    assert joined(steps) == tokenizer.decode(broken) and RecordingTokenizer.longest_decode <= 40


def test_empty_stop_string_is_rejected(tokenizer):
    with pytest.raises(ValueError, match="stop strings"):
        IncrementalDetokenizer(tokenizer, stop=[""])


def _tokens_until(tokenizer, ids: list[int], text_prefix: str) -> int:
    """The fewest leading tokens whose text contains text_prefix."""
    return next(count for count in range(1, len(ids) + 1) if tokenizer.decode(ids[:count]).startswith(text_prefix))


def _tokens_within(tokenizer, ids: list[int], shown: str) -> int:
    """The most leading tokens whose text is all within shown."""
    return max(count for count in range(len(ids) + 1) if shown.startswith(tokenizer.decode(ids[:count])))
