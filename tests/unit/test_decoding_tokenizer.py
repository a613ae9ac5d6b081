"""The detokenizer's tokenizer: a Rust tokenizer cached from transformers' and loaded without
it, decoding as transformers does."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AddedToken, PreTrainedTokenizerFast

from sluice.detokenizer.decoding_tokenizer import DecodingTokenizer, backend_that_decodes_alike, load_decoding_tokenizer
from sluice.model_files import default_model_path
from sluice.tokenizer_files import load_tokenizer
from tests.llama2_tokenizer import llama2_style_tokenizer


def _tiny_folder(folder: Path, **config: object) -> Path:
    """The Llama-2-style tokenizer (byte fallback, a decoder that drops the first space) with
    an added special token and an added ordinary one, saved as a HF folder."""
    tokenizer = llama2_style_tokenizer()
    tokenizer.add_tokens([AddedToken("<|tool|>", special=False)])
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|end|>"]})
    tokenizer.save_pretrained(str(folder))
    config_file = folder / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}))
    return folder


def _sequences(vocab_size: int, specials: list[int], count: int = 300) -> list[list[int]]:
    draw = random.Random(0)
    sequences = [[draw.randrange(vocab_size) for _ in range(draw.randint(1, 24))] for _ in range(count)]
    for sequence in sequences[: count // 3]:  # added tokens between ordinary ones
        sequence.insert(draw.randrange(len(sequence) + 1), draw.choice(specials))
    return sequences


def _assert_decodes_alike(ours: DecodingTokenizer, theirs: PreTrainedTokenizerFast) -> None:
    assert {i: (t.content, t.special) for i, t in ours.added_tokens_decoder.items()} == {
        i: (t.content, t.special) for i, t in theirs.added_tokens_decoder.items()
    }
    for ids in _sequences(len(theirs), list(theirs.added_tokens_decoder)):
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip), ids
    assert ours.decode((3, 4)) == theirs.decode([3, 4])  # a tuple too


def test_a_folder_tokenizer_is_cached_and_the_cache_decodes_as_transformers(tmp_path):
    folder = _tiny_folder(tmp_path / "model")
    cache = tmp_path / "cache"
    first = load_decoding_tokenizer(str(folder), str(cache))
    assert isinstance(first, DecodingTokenizer)
    assert [path.name.startswith("decoding-") for path in cache.iterdir()] == [True]
    second = load_decoding_tokenizer(str(folder), str(cache))
    assert isinstance(second, DecodingTokenizer)
    theirs = load_tokenizer(str(folder))
    _assert_decodes_alike(first, theirs)
    _assert_decodes_alike(second, theirs)
    assert second.decode(theirs.encode("I like<|tool|>cat<|end|>", add_special_tokens=False)) == (
        "I like<|tool|>cat<|end|>"
    )


def test_the_default_models_cached_decoder_decodes_as_transformers_and_loads_without_it(tmp_path):
    model_path = default_model_path()
    assert isinstance(load_decoding_tokenizer(model_path, str(tmp_path)), DecodingTokenizer)
    cached = load_decoding_tokenizer(model_path, str(tmp_path))
    assert isinstance(cached, DecodingTokenizer)
    _assert_decodes_alike(cached, load_tokenizer(model_path))
    script = (
        "import sys; from sluice.procutil import keep_torch_out; assert keep_torch_out();"
        "from sluice.detokenizer.decoding_tokenizer import DecodingTokenizer, load_decoding_tokenizer;"
        f"t = load_decoding_tokenizer({model_path!r}, {str(tmp_path)!r});"
        "assert isinstance(t, DecodingTokenizer), type(t);"
        "assert t.decode([1, 504, 3458, 2], skip_special_tokens=True) == 'Therong', t.decode([1, 504, 3458, 2]);"
        "assert 'transformers' not in sys.modules and sys.modules['torch'] is None"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(tmp_path):
    folder = _tiny_folder(tmp_path / "model", clean_up_tokenization_spaces=True)
    tokenizer = load_decoding_tokenizer(str(folder), str(tmp_path / "cache"))
    assert isinstance(tokenizer, PreTrainedTokenizerFast) and tokenizer.clean_up_tokenization_spaces
    assert not (tmp_path / "cache").exists()


def test_a_tokenizer_whose_decode_is_its_own_is_not_replaced():
    class Shouting(PreTrainedTokenizerFast):
        def decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs).upper()

    plain = llama2_style_tokenizer()
    assert backend_that_decodes_alike(plain) is not None
    shouting = Shouting(tokenizer_object=plain.backend_tokenizer, unk_token="<unk>")
    assert backend_that_decodes_alike(shouting) is None


def test_a_damaged_cache_is_built_again_and_a_changed_tokenizer_gets_its_own(tmp_path, caplog):
    folder = _tiny_folder(tmp_path / "model")
    cache = tmp_path / "cache"
    load_decoding_tokenizer(str(folder), str(cache))
    (cached,) = cache.iterdir()
    cached.write_text("{not json")
    with caplog.at_level("WARNING"):
        rebuilt = load_decoding_tokenizer(str(folder), str(cache))
    assert "unreadable" in caplog.text
    assert isinstance(rebuilt, DecodingTokenizer)
    assert rebuilt.decode([1, 262]) == load_tokenizer(str(folder)).decode([1, 262])
    # The same folder with one more added token: a cache of its own, which knows the token.
    tokenizer = load_tokenizer(str(folder))
    tokenizer.add_tokens(["<|new|>"])
    tokenizer.save_pretrained(str(folder))
    changed = load_decoding_tokenizer(str(folder), str(cache))
    assert len(list(cache.iterdir())) == 2
    assert changed.decode([len(tokenizer) - 1]) == "<|new|>"


@pytest.mark.parametrize("path", ["missing.gguf", "not-a-model.txt"])
def test_a_path_load_tokenizer_refuses_is_refused_the_same_way(tmp_path, path):
    with pytest.raises(FileNotFoundError, match="model_path must be"):
        load_decoding_tokenizer(str(tmp_path / path), str(tmp_path))
