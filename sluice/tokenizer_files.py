"""Loading a model's tokenizer and chat template, and rendering chat templates.

Used by the main process (prompts) and the detokenizer process (output text). Both may
start at once, so the converted-tokenizer cache is written with an atomic rename.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sluice.config import cache_root
from sluice.model.gguf_file import read_gguf
from sluice.procutil import keep_torch_out

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def default_tokenizer_cache_dir() -> Path:
    return cache_root() / "tokenizers"


def load_tokenizer(model_path: str, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """The fast tokenizer of a `.gguf` file or a HF folder.

    Converting a GGUF vocabulary takes seconds, so the result is saved under `cache_dir`
    (default the `tokenizers` folder of sluice's cache, ~/.cache/sluice) and later loads read
    that copy.
    """
    from transformers import AutoTokenizer

    path = Path(model_path)
    if path.is_dir():
        check_folder_has_a_tokenizer(path)
        with _unreadable_tokenizer_refused(path):
            return AutoTokenizer.from_pretrained(str(path))
    if path.suffix != ".gguf" or not path.is_file():
        raise FileNotFoundError(f"model_path must be a .gguf file or a HF folder, got {model_path!r}")

    cached = _cached_copy(path, cache_dir)
    if cached.is_dir():
        started = time.perf_counter()
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # a damaged cache must not stop the server: convert again
            logger.warning("tokenizer cache %s is unreadable; converting %s again", cached, path, exc_info=True)
            shutil.rmtree(cached, ignore_errors=True)
        else:
            logger.info("loaded tokenizer from cache %s in %.2f s", cached, time.perf_counter() - started)
            return tokenizer

    started = time.perf_counter()
    with _unreadable_tokenizer_refused(path):
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    logger.info("converted the GGUF tokenizer of %s in %.2f s", path, time.perf_counter() - started)
    _publish_cache(tokenizer, cached)
    return tokenizer


class TokenizerUnreadable(ValueError):
    """What the tokenizer side needs of the model's files (its tokenizer, chat template or
    image processor config) cannot be built; the message names the model and why."""


# A folder's tokenizer is in one of these; without any, transformers builds an empty
# tokenizer from config.json's model type, and every prompt would be no tokens.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


# What transformers may read to build a folder's tokenizer (config.json names its class where
# tokenizer_config.json does not).
_TOKENIZER_INPUTS = (
    *_TOKENIZER_FILES,
    "merges.txt",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "config.json",
)


def tokenizer_source_digest(model_path: str) -> bytes | None:
    """A digest of what `load_tokenizer` builds the tokenizer of `model_path` from: a GGUF
    file's metadata, or the names and contents of a HF folder's tokenizer files. None for a
    path it refuses."""
    path = Path(model_path)
    if path.is_dir():
        digest = hashlib.sha256()
        for name in _TOKENIZER_INPUTS:
            if (file := path / name).is_file():
                contents = file.read_bytes()
                digest.update(f"{name} {len(contents)}\n".encode())
                digest.update(contents)
        return digest.digest()
    if path.suffix == ".gguf" and path.is_file():
        return _gguf_metadata_digest(path)
    return None


def _gguf_metadata_digest(path: Path) -> bytes:
    """A GGUF file's tokenizer is built from its metadata alone (vocabulary, merges, special
    token ids, chat template): files that share it share one tokenizer."""
    return hashlib.sha256(read_gguf(path).metadata).digest()


def check_folder_has_a_tokenizer(path: str | Path) -> None:
    """Refuse a HF folder without tokenizer files (a GGUF file always holds its vocabulary)."""
    path = Path(path)
    if path.is_dir() and not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise TokenizerUnreadable(f"{path}: has no tokenizer: none of {', '.join(_TOKENIZER_FILES)}")


@contextlib.contextmanager
def _unreadable_tokenizer_refused(path: Path) -> Iterator[None]:
    """What transformers raises for a tokenizer it cannot build (a GGUF vocabulary without
    the merges or scores its type needs, a folder's broken tokenizer files) as one ValueError
    that names the model: TokenizerUnreadable."""
    try:
        yield
    except KeyError as e:
        key = str(e.args[0]) if e.args else ""
        if not key or any(c.isspace() for c in key):  # a sentence, not a missing key's name
            raise TokenizerUnreadable(f"{path}: its tokenizer cannot be read: {key or 'KeyError'}") from e
        missing = f"tokenizer.ggml.{key}" if path.suffix == ".gguf" else key
        raise TokenizerUnreadable(f"{path}: its tokenizer cannot be read: it has no {missing}") from e
    except Exception as e:
        raise TokenizerUnreadable(f"{path}: its tokenizer cannot be read: {type(e).__name__}: {e}") from e


def tokenizer_loads_without_torch(model_path: str, cache_dir: str | None = None) -> bool:
    """Whether `load_tokenizer` reads this model's tokenizer without torch: from a HF folder,
    or from the cached conversion of a GGUF file (transformers' GGUF reader imports torch)."""
    path = Path(model_path)
    if path.is_dir():
        return True
    return path.suffix == ".gguf" and path.is_file() and _cached_copy(path, cache_dir).is_dir()


def keep_torch_out_where_the_tokenizer_allows(model_path: str) -> bool:
    """For a process that runs no tensors: keep torch out of it (procutil.keep_torch_out)
    when this model's tokenizer loads without torch. Whether torch is kept out."""
    return tokenizer_loads_without_torch(model_path) and keep_torch_out()


def cache_gguf_tokenizer(model_path: str, cache_dir: str | None = None) -> None:
    """Converts a GGUF file's tokenizer into the cache in a child process, once: the torch it
    needs ends with that process, and the processes that run no tensors load the cached copy."""
    if tokenizer_loads_without_torch(model_path, cache_dir):
        return
    context = mp.get_context("spawn")
    why_not, report = context.Pipe(duplex=False)
    process = context.Process(
        target=_convert_into_cache, args=(model_path, cache_dir, report), name="sluice-tokenizer-cache", daemon=True
    )
    process.start()
    report.close()
    process.join()
    if process.exitcode != 0:
        if why_not.poll():
            raise TokenizerUnreadable(why_not.recv_bytes().decode())
        raise TokenizerUnreadable(f"{model_path}: converting its tokenizer failed (exit code {process.exitcode})")


def _convert_into_cache(model_path: str, cache_dir: str | None, report: Connection) -> None:
    """The child of cache_gguf_tokenizer: a tokenizer that cannot be read is reported to the
    parent in one line (bytes, not a pickle), not printed as a traceback."""
    try:
        load_tokenizer(model_path, cache_dir)
    except ValueError as e:
        report.send_bytes(str(e).encode())
        sys.exit(1)


def _cached_copy(path: Path, cache_dir: str | None) -> Path:
    """Where the converted tokenizer of the GGUF file at `path` is kept."""
    cache_root = Path(cache_dir) if cache_dir is not None else default_tokenizer_cache_dir()
    return cache_root / _gguf_cache_key(path)


def _gguf_cache_key(path: Path) -> str:
    """The conversion reads the file's metadata only: files that hold the same metadata (a
    copy, a moved file, weights rewritten in other blocks) share one converted tokenizer.
    The transformers version is part of the key because its GGUF converter changes between
    releases; it is read from the package's metadata: importing transformers would decide,
    for this process, whether torch is there."""
    digest = hashlib.sha256(_gguf_metadata_digest(path))
    digest.update(importlib.metadata.version("transformers").encode())
    return f"gguf-{digest.hexdigest()[:16]}"


def _publish_cache(tokenizer: PreTrainedTokenizerBase, cached: Path) -> None:
    """Saves into a private temporary folder, then renames it into place in one step.

    A process that loses the race to another one's rename keeps its own copy in memory
    and deletes its temporary folder; readers only ever see a complete folder.
    """
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
    except OSError:
        logger.warning("cannot write the tokenizer cache in %s", cached.parent, exc_info=True)
        return
    try:
        tokenizer.save_pretrained(str(staging))
        os.rename(staging, cached)
    except OSError:
        if not cached.is_dir():
            logger.warning("cannot write the tokenizer cache %s", cached, exc_info=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_chat_template(model_path: str, tokenizer: PreTrainedTokenizerBase | None = None) -> str | None:
    """The model's Jinja chat template, or None when it has none.

    Looks in the tokenizer, then in the GGUF metadata, then in a HF folder's
    chat_template.jinja, chat_template.json and tokenizer_config.json.
    """
    if tokenizer is not None and (template := _named_default(getattr(tokenizer, "chat_template", None))):
        return template
    path = Path(model_path)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_chat_template(path)
    if path.is_dir():
        return _folder_chat_template(path)
    return None


def _gguf_chat_template(path: Path) -> str | None:
    template = read_gguf(path).fields.get(_GGUF_CHAT_TEMPLATE_KEY)
    return template if isinstance(template, str) and template else None


def _folder_chat_template(folder: Path) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8") or None
    for config_name in ("chat_template.json", "tokenizer_config.json"):
        config_file = folder / config_name
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise TokenizerUnreadable(f"{config_file} is not JSON: {e}") from None
            if not isinstance(config, dict):
                raise TokenizerUnreadable(f"{config_file} is not a JSON object")
            if template := _named_default(config.get("chat_template")):
                return template
    return None


def _named_default(template: Any) -> str | None:
    """A template given as a string, or the "default" one of several named templates."""
    if isinstance(template, str):
        return template or None
    if isinstance(template, Mapping):
        return _named_default(template.get("default"))
    if isinstance(template, Sequence):  # tokenizer_config.json: [{"name": ..., "template": ...}]
        by_name = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, Mapping)}
        return _named_default(by_name.get("default"))
    return None


class ChatTemplate:
    """A chat template compiled once and rendered in Jinja's immutable sandbox.

    Templates come with model files, so they are untrusted code: the sandbox keeps them
    from reaching Python internals or changing the caller's messages. The environment
    matches the one transformers uses, so the rendered prompt is the one the model was
    trained on.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None):
        try:
            self._template = _sandbox().from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise ValueError(f"the chat template does not compile (line {error.lineno}): {error.message}") from error
        self.source = source
        # Templates may refer to bos_token, eos_token, ... like in transformers.
        self._special_tokens = dict(special_tokens or {})

    @classmethod
    def from_model(cls, model_path: str, tokenizer: PreTrainedTokenizerBase) -> ChatTemplate | None:
        source = load_chat_template(model_path, tokenizer)
        if source is None:
            return None
        special_tokens = {
            name: str(value) for name, value in tokenizer.special_tokens_map.items() if isinstance(value, str)
        }
        try:
            return cls(source, special_tokens)
        except ValueError as e:
            raise TokenizerUnreadable(f"{model_path}: {e}") from None

    def render(self, messages: list[dict], /, add_generation_prompt: bool = True, **kwargs: Any) -> str:
        # Keys set to None are dropped as transformers does: an OpenAI client sends
        # content=None with tool calls, and templates test for a missing key.
        if not all(isinstance(message, Mapping) for message in messages):
            raise ValueError("chat messages must be objects with a role and content")
        plain_messages = [{key: value for key, value in message.items() if value is not None} for message in messages]
        context = {
            **self._special_tokens,
            "tools": None,
            "documents": None,
            **kwargs,
            "messages": plain_messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(context)
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template failed: {error.message or type(error).__name__}") from error
        except (TypeError, KeyError, IndexError, AttributeError, ValueError) as error:
            # Raised by template code on messages it does not expect (e.g. a list
            # where it adds strings): the request's fault, not the server's.
            raise ValueError(f"the chat template failed on these messages: {type(error).__name__}: {error}") from error


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged.

    transformers uses the tag to mark assistant tokens for training masks; templates
    that contain it must still compile here.
    """

    tags = {"generation"}  # noqa: RUF012 (jinja2.ext.Extension declares it as a plain set attribute)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _sandbox() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationBlock],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment
