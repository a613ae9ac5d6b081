"""Tokenizer loading (GGUF conversion cache) and sandboxed chat-template rendering."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sluice.model_files import default_model_path
from sluice.tokenizer_files import (
    ChatTemplate,
    _publish_cache,
    cache_gguf_tokenizer,
    load_chat_template,
    load_tokenizer,
    tokenizer_loads_without_torch,
)

SAMPLE_TEXT = "héllo 世界 🎉👍🏽 naïve café <|im_start|>user\nhi<|im_end|>"

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a joke about 猫 🐱."},
    ],
    [
        {"role": "system", "content": "Line one.\nLine two."},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "  spaced  "},
    ],
]


@pytest.fixture(scope="module")
def loads(tmp_path_factory):
    """A cold load (conversion) into an empty cache, then a load from that cache."""
    cache_dir = tmp_path_factory.mktemp("tokenizer-cache")
    started = time.perf_counter()
    converted = load_tokenizer(default_model_path(), cache_dir=str(cache_dir))
    cold_s = time.perf_counter() - started
    written = {path: path.stat().st_mtime_ns for path in cache_dir.rglob("*")}
    started = time.perf_counter()
    cached = load_tokenizer(default_model_path(), cache_dir=str(cache_dir))
    cached_s = time.perf_counter() - started
    print(f"\ntokenizer load: cold {cold_s:.2f} s, cached {cached_s:.2f} s")
    return cache_dir, converted, written, cached


@pytest.fixture(scope="module")
def tokenizer(loads):
    return loads[3]


def test_gguf_tokenizer_is_cached_and_the_cached_copy_behaves_the_same(loads):
    cache_dir, converted, written, cached = loads
    entries = list(cache_dir.iterdir())
    assert len(entries) == 1 and (entries[0] / "tokenizer.json").is_file()
    assert {path: path.stat().st_mtime_ns for path in cache_dir.rglob("*")} == written  # read, not converted again
    for tokenizer in (converted, cached):
        assert tokenizer.eos_token_id == 2
        assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert converted.bos_token_id not in converted.encode("Hi")  # no BOS is added
    ids = converted.encode(SAMPLE_TEXT)
    assert cached.encode(SAMPLE_TEXT) == ids
    assert cached.decode(ids) == converted.decode(ids) == SAMPLE_TEXT
    assert cached.chat_template == converted.chat_template


def test_a_copy_of_the_file_shares_its_converted_tokenizer_and_other_metadata_does_not(loads, tmp_path):
    """The cache is keyed by the file's metadata, which is all the conversion reads: a copy
    under another name (or weights rewritten in other blocks) loads the converted copy; a
    file whose metadata differs in one byte of its chat template is converted anew."""
    cache_dir = str(loads[0])
    original = Path(default_model_path()).read_bytes()
    copy = tmp_path / "renamed.gguf"
    copy.write_bytes(original)
    assert tokenizer_loads_without_torch(str(copy), cache_dir)
    edited = original.replace(b"You are a helpful AI assistant", b"You are a helpful AI assistanT", 1)
    assert edited != original
    copy.write_bytes(edited)
    assert not tokenizer_loads_without_torch(str(copy), cache_dir)


def test_a_gguf_tokenizer_is_converted_in_a_child_then_loads_without_torch(tmp_path):
    """Converting a GGUF vocabulary needs torch (transformers' GGUF reader imports it); the
    server converts it into the cache in a child process, and then a process that keeps torch
    out loads the cached copy."""
    model_path = default_model_path()
    assert not tokenizer_loads_without_torch(model_path, str(tmp_path))
    cache_gguf_tokenizer(model_path, str(tmp_path))
    assert tokenizer_loads_without_torch(model_path, str(tmp_path))
    assert tokenizer_loads_without_torch(str(tmp_path / next(tmp_path.iterdir()).name))  # a folder
    script = (
        "import sys; from sluice.procutil import keep_torch_out; assert keep_torch_out();"
        "from sluice.tokenizer_files import load_tokenizer;"
        f"t = load_tokenizer({model_path!r}, {str(tmp_path)!r});"
        "assert t.decode(t.encode('hello world')) == 'hello world';"
        "assert sys.modules['torch'] is None"
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)


def test_concurrent_cache_writers_leave_one_complete_copy(loads, tmp_path):
    converted = loads[1]
    target = tmp_path / "tokenizer"
    threads = [threading.Thread(target=_publish_cache, args=(converted, target)) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    _publish_cache(converted, target)  # the cache already exists: no error, nothing changes
    assert [entry.name for entry in tmp_path.iterdir()] == ["tokenizer"]  # no staging folders left
    reloaded = load_tokenizer(str(target))
    assert reloaded.encode(SAMPLE_TEXT) == converted.encode(SAMPLE_TEXT)


def test_hf_folder_loads_with_its_chat_template(loads, tokenizer):
    folder = next(loads[0].iterdir())
    assert load_tokenizer(str(folder)).encode(SAMPLE_TEXT) == tokenizer.encode(SAMPLE_TEXT)
    assert load_chat_template(str(folder)) == tokenizer.chat_template


def test_missing_model_path_is_reported():
    with pytest.raises(FileNotFoundError, match="gguf"):
        load_tokenizer("/nonexistent/model.bin")


def test_chat_template_comes_from_gguf_metadata_without_a_tokenizer(tokenizer):
    template = load_chat_template(default_model_path(), None)
    assert template is not None and template == tokenizer.chat_template
    assert "<|im_start|>" in template


def test_chat_template_comes_from_tokenizer_config_json(tmp_path: Path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    assert load_chat_template(str(tmp_path)) == "{{ messages[0]['content'] }}"
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert load_chat_template(str(tmp_path)) == "plain"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({}))
    assert load_chat_template(str(tmp_path)) is None


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_prompt_matches_transformers(tokenizer, messages, add_generation_prompt):
    template = ChatTemplate.from_model(default_model_path(), tokenizer)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert template.render(messages, add_generation_prompt=add_generation_prompt) == expected


BLOCK_TEMPLATE = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        [SYS] {{ message['content'] | trim }}
    {% else %}
        {{ message['role'] }}: {{ message['content'] }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
assistant:
{% endif %}
"""


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_block_whitespace_and_special_tokens_match_transformers(loads, tmp_path, messages):
    # trim_blocks/lstrip_blocks and bos_token/eos_token as transformers sets them up.
    folder = tmp_path / "model"
    shutil.copytree(next(loads[0].iterdir()), folder)
    (folder / "chat_template.jinja").write_text(BLOCK_TEMPLATE)
    tokenizer = load_tokenizer(str(folder))
    template = ChatTemplate.from_model(str(folder), tokenizer)
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "<|im_end|>" in expected and "\n\n" not in expected
    assert template.render(messages) == expected


def test_smollm2_default_system_prompt_and_generation_prompt(tokenizer):
    prompt = ChatTemplate.from_model(default_model_path(), tokenizer).render([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_template_can_use_special_tokens_and_helpers():
    template = ChatTemplate(
        "{{ bos_token }}{{ messages | tojson }}{% generation %}|{{ strftime_now('%Y') }}{% endgeneration %}",
        {"bos_token": "<s>"},
    )
    rendered = template.render([{"role": "user", "content": "é <b>"}])
    assert rendered == f'<s>[{{"role": "user", "content": "é <b>"}}]|{time.strftime("%Y")}'


def test_none_fields_are_dropped_like_transformers():
    template = ChatTemplate("{% if 'content' in messages[0] %}has{% else %}none{% endif %}")
    assert template.render([{"role": "assistant", "content": None}]) == "none"


def test_raise_exception_becomes_value_error():
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_syntax_error_becomes_value_error():
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_type_error_in_template_becomes_value_error():
    template = ChatTemplate("{{ messages[0]['content'] + '!' }}")
    with pytest.raises(ValueError, match="chat template failed"):
        template.render([{"role": "user", "content": [{"type": "text", "text": "x"}]}])


def test_template_cannot_reach_python_internals_or_change_messages():
    messages = [{"role": "user", "content": "x"}]
    with pytest.raises(ValueError):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render(messages)
    with pytest.raises(ValueError):
        ChatTemplate("{{ messages.append({'role': 'system'}) }}").render(messages)
    assert messages == [{"role": "user", "content": "x"}]
