"""Structured output: a request's `json_schema`, `regex`, `ebnf` or `structural_tag` (SGLang's
names) as an llguidance grammar.

llguidance (guidance-ai's grammar engine, as vLLM and SGLang use it) is a Rust wheel with no
dependencies: it pulls in no torch and no CUDA. It works on the tokenizer's own tokens: from
a grammar and the tokens so far it gives the set of tokens that may come next (a bitmask),
computed lazily, a few hundred microseconds a step. The main process checks a grammar here
before the request goes anywhere (a 400 naming the field); the Scheduler keeps one matcher
per request (`scheduler/grammar.py`).

JSON is generated compact (no whitespace between tokens): a small model given the choice
fills the answer with newlines until it runs out of tokens. With `--reasoning-parser`, the
grammar covers the answer after the thinking, not the thinking.
"""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Final

from sluice.messages import SamplingParams
from sluice.sampling import ClientError

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

GRAMMAR_FIELDS: Final = ("json_schema", "regex", "ebnf", "structural_tag")
_JSON_DEFAULTS: Final[JsonCompileOptions] = {"whitespace_flexible": False}

# llguidance compiles a grammar recursively: a level of a chain of $refs or of rules takes up
# to ~12 KB of stack, so ~700 chained $refs overflow a thread's default 8 MB, and the process
# dies of a segfault without a word. Grammars compile only on threads with COMPILE_STACK_BYTES
# of stack (grammar_compiler), and a grammar field holds at most MAX_GRAMMAR_CHARS: the worst
# chains that fit (5,300 $refs through `properties`, 21,000 GBNF rules each naming the next)
# compile with a quarter of that stack.
COMPILE_STACK_BYTES: Final = 256 << 20
MAX_GRAMMAR_CHARS: Final = 256 << 10
# llguidance's GBNF converter (Python) takes time quadratic in a chain of rules: 0.65 s for
# 1,000 rules each naming the next, 11 s for 4,000.
MAX_GBNF_RULES: Final = 2000


def grammar_compiler(name: str) -> ThreadPoolExecutor:
    """A one-thread executor whose thread has COMPILE_STACK_BYTES of stack (address space:
    only the pages a deep grammar touches take memory), for llguidance's compiles."""
    executor = ThreadPoolExecutor(1, thread_name_prefix=name)
    previous = threading.stack_size(COMPILE_STACK_BYTES)
    try:
        executor.submit(lambda: None).result()  # its thread starts now, with the stack asked for
    finally:
        threading.stack_size(previous)
    return executor


def parser_limits() -> llguidance.LLParserLimits:
    """llguidance's default limits, with errors that do not dump the parser's state."""
    import llguidance

    return llguidance.LLParserLimits(verbose_errors=False)


def grammar_field(params: SamplingParams) -> str | None:
    """The one grammar field the request sets, or None; two at once are a ClientError."""
    given = [name for name in GRAMMAR_FIELDS if getattr(params, name) is not None]
    if len(given) > 1:
        raise ClientError(
            f"give at most one of json_schema, regex, ebnf and structural_tag, not {' and '.join(given)}", given[1]
        )
    return given[0] if given else None


def grammar_key(params: SamplingParams) -> str | None:
    """`field:text` of the request's grammar (what its compiled form depends on), or None
    when it has none: the key of the caches of compiled grammars and of verdicts."""
    field = grammar_field(params)
    return None if field is None else f"{field}:{getattr(params, field)}"


def grammar_of(params: SamplingParams, reasoning_parser: str = "none") -> str | None:
    """The llguidance grammar of the request's constraint, or None when it has none; a
    ClientError naming the field when the text is not valid JSON or EBNF. With a reasoning
    parser, the constraint applies to the answer after the thinking (see _after_thinking),
    except a structural tag's, which is free text already (see structural_tag_lark)."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    field = grammar_field(params)
    if field is None:
        return None
    text: str = getattr(params, field)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise ClientError(f"{field} has {len(text):,} characters, more than the {MAX_GRAMMAR_CHARS:,} allowed", field)
    thinks = reasoning_parser != "none"
    if field == "json_schema":
        schema = _json_of(text, "json_schema")
        if not isinstance(schema, dict):
            raise ClientError("json_schema must be a JSON Schema (an object)", "json_schema")
        try:
            if thinks:
                return _after_thinking(f"{_ANSWER}: %json {json.dumps(_compact(schema))}\n", reasoning_parser)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_DEFAULTS)
        except (ValueError, TypeError) as e:
            raise ClientError(f"json_schema is not a usable JSON Schema: {e}", "json_schema") from None
    if field == "structural_tag":  # free text already, thinking included (see structural_tag_lark)
        return llguidance.LLMatcher.grammar_from_lark(structural_tag_lark(text))
    if field == "regex":
        if thinks:
            return _after_thinking(f"{_ANSWER}: /{llguidance.regex_to_lark(text)}/\n", reasoning_parser)
        return llguidance.LLMatcher.grammar_from_regex(text)
    if (rules := text.count("::=")) > MAX_GBNF_RULES:
        raise ClientError(f"ebnf has {rules:,} rules, more than the {MAX_GBNF_RULES:,} allowed", "ebnf")
    try:
        lark = gbnf_to_lark(text)
    except Exception as e:  # noqa: BLE001 -- the converter raises bare Exception too (an undefined rule)
        raise ClientError(f"ebnf is not a valid GBNF grammar: {e}", "ebnf") from None
    if thinks:  # the converted grammar's start rule becomes the answer
        return _after_thinking(re.sub(r"^start:", f"{_ANSWER}:", lark, flags=re.MULTILINE), reasoning_parser)
    return llguidance.LLMatcher.grammar_from_lark(lark)


_ANSWER: Final = "sluice_answer"


def _json_of(text: str, field: str) -> Any:
    """A grammar field's JSON; ClientError naming the field when it is not JSON, or nests
    deeper than Python's stack (the body's depth check does not look inside strings)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ClientError(f"{field} is not valid JSON: {e}", field) from None
    except RecursionError:
        raise ClientError(f"{field} nests arrays and objects too deep to read", field) from None


_STRUCTURAL_TAG_SHAPE: Final = (
    'structural_tag must be {"structures": [{"begin": ..., "schema": {...}, "end": ...}, ...], '
    '"triggers": [...]}, each begin starting with one of the triggers'
)


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema with llguidance told to generate it compact (_JSON_DEFAULTS), for grammars
    that embed it in Lark (`%json`), where the defaults argument does not reach."""
    return {**schema, "x-guidance": {**schema.get("x-guidance", {}), **_JSON_DEFAULTS}}


def structural_tag_lark(text: str) -> str:
    """The Lark grammar of a structural tag (SGLang's form, as JSON text): the answer is free
    text until one of the `triggers` appears; from there it must go on as one of the
    structures whose `begin` starts with that trigger (its begin, JSON valid against its
    `schema`, its end), then free text again. Triggers are matched as text (a trigger that
    is a special token of the tokenizer never appears in free text). With a reasoning parser
    the tag covers the thinking too: llguidance's lexer ends a lazy trigger as soon as it
    matches, so a thinking rule around the free text cannot hold a trigger back."""
    from llguidance import StructTag

    tag = _json_of(text, "structural_tag")
    if not isinstance(tag, dict) or set(tag) - {"type", "structures", "triggers"}:
        raise ClientError(_STRUCTURAL_TAG_SHAPE, "structural_tag")
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if tag.get("type", "structural_tag") != "structural_tag" or not isinstance(structures, list) or not structures:
        raise ClientError(_STRUCTURAL_TAG_SHAPE, "structural_tag")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise ClientError("structural_tag.triggers must be a list of non-empty strings", "structural_tag")
    tags = []
    for i, given in enumerate(structures):
        structure = given if isinstance(given, dict) and not set(given) - {"begin", "schema", "end"} else {}
        begin, end, schema = structure.get("begin"), structure.get("end"), structure.get("schema")
        schema = {} if schema is None else schema  # any JSON, as SGLang's optional schema
        trigger = next((t for t in triggers if begin.startswith(t)), None) if isinstance(begin, str) else None
        if trigger is None or not isinstance(begin, str) or not isinstance(end, str) or not isinstance(schema, dict):
            raise ClientError(f"structural_tag.structures[{i}]: {_STRUCTURAL_TAG_SHAPE}", "structural_tag")
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=_compact(schema), end=end))
    return StructTag.to_grammar(tags, assume_special=False)


def _after_thinking(answer_rules: str, reasoning_parser: str) -> str:
    """A Lark grammar (llguidance's dialect): free thinking up to `</think>` (qwen3: only if
    the answer opens with `<think>`; deepseek-r1: the answer starts inside it), whitespace,
    then the rules of `_ANSWER`."""
    import llguidance

    thinking = 'sluice_thinking[stop="</think>"]: /(.|\\n)*/'
    if reasoning_parser == "qwen3":
        start = f'start: sluice_think? {_ANSWER}\nsluice_think: "<think>" sluice_thinking /[ \\t\\r\\n]*/'
    else:
        start = f'start: "<think>"? sluice_thinking /[ \\t\\r\\n]*/ {_ANSWER}'
    return llguidance.LLMatcher.grammar_from_lark(f"{answer_rules}\n{start}\n{thinking}\n")


def check_grammar(params: SamplingParams, tokenizer: llguidance.LLTokenizer, reasoning_parser: str = "none") -> None:
    """ClientError naming the field when the request's grammar does not compile. Call it on
    a grammar_compiler's thread."""
    import llguidance

    grammar = grammar_of(params, reasoning_parser)
    if grammar is None:
        return
    error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=parser_limits())
    if error:
        field = grammar_field(params)
        raise ClientError(f"{field} does not compile: {error.strip()}", field)


def grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it (about 0.4 s for SmolLM2's 49,152 tokens), over the
    model's vocab_size token ids or the tokenizer's, whichever is more: a tokenizer may name
    ids past the model's embedding rows (the masks' extra columns are dropped, as the model
    never samples those ids), and llguidance refuses an n_vocab below its own count."""
    import llguidance.hf

    return llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)))


def start_grammar_tokenizer(hf_tokenizer: Any, vocab_size: int) -> Future[llguidance.LLTokenizer]:
    """grammar_tokenizer, built in a thread of its own. llguidance.hf, and the transformers
    classes it names, are imported first in the caller's thread: transformers' lazy module
    is not safe to import from two threads at once (with 5.24 a concurrent `from
    transformers import AutoTokenizer` failed with an ImportError)."""
    import llguidance.hf  # noqa: F401

    return ThreadPoolExecutor(1, thread_name_prefix="grammar-tokenizer").submit(
        grammar_tokenizer, hf_tokenizer, vocab_size
    )
