"""The Scheduler's grammars (scheduler/grammar.py): compiled once per text in the
background, each request with its own copy, masks per row."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from sluice.messages import SamplingParams
from sluice.model_files import default_model_path
from sluice.scheduler.grammar import Grammars
from sluice.server.tool_calls import strict_calls_tag
from sluice.tokenizer_files import load_tokenizer

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def takes(grammars: Grammars, compiled, text: str) -> bool:
    """Whether a fresh matcher of `compiled` takes the whole text and may end there."""
    matcher = grammars.matcher(compiled)
    ids = load_tokenizer(default_model_path())(text, add_special_tokens=False).input_ids
    return all(matcher.consume_token(token) for token in ids) and matcher.is_accepting()


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(default_model_path(), 49152)


def test_a_grammar_compiles_once_and_every_request_gets_its_own_matcher(grammars):
    first = grammars.compile(SamplingParams(json_schema=SCHEMA))
    assert first is not None and grammars.compile(SamplingParams(json_schema=SCHEMA)) is first
    assert grammars.compile(SamplingParams()) is None
    one, two = grammars.matcher(first), grammars.matcher(first)
    tokenizer = load_tokenizer(default_model_path())
    for token in tokenizer('{"a":', add_special_tokens=False).input_ids:
        assert one.consume_token(token)
    allowed = grammars.allowed([one, two, grammars.matcher(first)])
    assert torch.equal(allowed[1], allowed[2]) and not torch.equal(allowed[0], allowed[1])  # two took nothing
    digit = tokenizer("7", add_special_tokens=False).input_ids[0]
    assert allowed[0, digit] and not allowed[1, digit]


def test_the_tokenizer_a_grammar_needs_is_loaded_when_the_first_grammar_comes():
    """llguidance's view of the tokenizer needs transformers (~120 MB in the Scheduler): it is
    built for the first constrained request, not at start-up."""
    code = f"""
import sys
from sluice.messages import SamplingParams
from sluice.model_files import default_model_path
from sluice.scheduler.grammar import Grammars
from sluice.server.tool_calls import strict_calls_tag
grammars = Grammars(default_model_path(), 49152)
before = "transformers" in sys.modules
grammars.matcher(grammars.compile(SamplingParams(json_schema={SCHEMA!r})))
print(before, "transformers" in sys.modules)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert result.stdout.split() == ["False", "True"], result.stderr


def test_a_tokenizer_with_ids_past_the_models_vocabulary_still_constrains():
    """A tokenizer may name more ids than the model has embedding rows (a GGUF's converted
    vocabulary can add one): the grammar still compiles, and the mask covers the model's ids."""
    grammars = Grammars(default_model_path(), 49_000)
    compiled = grammars.compile(SamplingParams(json_schema=SCHEMA))
    assert compiled is not None
    allowed = grammars.allowed([grammars.matcher(compiled)])
    assert allowed.shape == (1, 49_000) and allowed.any()


def test_a_grammar_that_does_not_compile_fails_its_request_only(grammars):
    compiled = grammars.compile(SamplingParams(json_schema='{"type": "nonsense"}'))
    assert compiled is not None
    with pytest.raises(ValueError, match="nonsense"):
        grammars.matcher(compiled)


@pytest.mark.parametrize(
    "parser, accepted, refused",
    [
        ("qwen3", ['<think>a < b, so\n7</think>\n\n{"a":7}', '{"a":7}'], ["<think>x</think>seven", "seven"]),
        ("deepseek-r1", ['a < b, so 7</think>\n{"a":7}', '<think>so</think>{"a":7}'], ['{"a":7}</think>x']),
    ],
)
def test_with_a_reasoning_parser_the_schema_holds_after_the_thinking(parser, accepted, refused):
    grammars = Grammars(default_model_path(), 49152, reasoning_parser=parser)
    compiled = grammars.compile(SamplingParams(json_schema=SCHEMA))
    assert compiled is not None
    assert all(takes(grammars, compiled, text) for text in accepted)
    assert not any(takes(grammars, compiled, text) for text in refused)


@pytest.mark.parametrize(
    "fields, answer, wrong",
    [
        ({"regex": "[0-9]{3}-[a-z]{2}"}, "123-ab", "12-ab"),
        ({"ebnf": 'root ::= "answer: " ("yes" | "no")'}, "answer: yes", "answer: maybe"),
    ],
)
def test_regex_and_ebnf_also_hold_after_the_thinking(fields, answer, wrong):
    grammars = Grammars(default_model_path(), 49152, reasoning_parser="qwen3")
    compiled = grammars.compile(SamplingParams(**fields))
    assert compiled is not None
    assert takes(grammars, compiled, f"<think>so\n</think>\n{answer}") and takes(grammars, compiled, answer)
    assert not takes(grammars, compiled, f"<think>so</think>{wrong}")


ANSWER_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "The answer is ", "schema": {"type": "integer"}, "end": "."}],
    "triggers": ["The"],
}


@pytest.mark.parametrize("parser", ["none", "qwen3"])
def test_a_structural_tag_holds_only_what_follows_a_trigger(parser):
    grammars = Grammars(default_model_path(), 49152, reasoning_parser=parser)
    compiled = grammars.compile(SamplingParams(structural_tag=json.dumps(ANSWER_TAG)))
    assert compiled is not None
    for free in ["Hi. The answer is 42. Bye", "no trigger at all", "The answer is 7.The answer is 8."]:
        assert takes(grammars, compiled, free), free
    for held in ["The answer is four.", "Then", "Hi. The answer is 42"]:  # not an integer; a trigger; no end
        assert not takes(grammars, compiled, held), held


def test_strict_tools_hold_each_call_of_a_strict_function_to_its_parameters():
    zone = {"type": "object", "properties": {"zone": {"enum": ["UTC"]}}, "required": ["zone"]}
    grammars = Grammars(default_model_path(), 49152)
    for parser, gap, call in [
        ("hermes", "", '<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'),
        ("hermes", "\n", '<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'),
        ("llama3", "", '{{"name": "{name}", "parameters": {arguments}}}'),
    ]:
        tag = strict_calls_tag({"get_time": zone, "free": None}, {"get_time"}, parser, newlines=gap == "\n")
        compiled = grammars.compile(SamplingParams(structural_tag=tag))
        assert compiled is not None

        def said(name: str, arguments: str, call: str = call) -> str:
            return "Let me see. " + call.format(name=name, arguments=arguments)

        assert takes(grammars, compiled, said("get_time", '{"zone":"UTC"}'))
        assert takes(grammars, compiled, said("free", '{"anything":[1]}'))  # not strict: any object
        assert takes(grammars, compiled, "No call needed.")
        for wrong in [said("get_time", '{"zone":"CET"}'), said("unknown", "{}")]:
            assert not takes(grammars, compiled, wrong), (parser, wrong)


def test_a_compilation_no_request_waits_for_is_dropped_before_it_runs():
    """Aborted constrained requests leave no queue of compilations in front of the next one."""
    grammars = Grammars(default_model_path(), 49152)  # fresh: the first compile waits for the tokenizer
    first = grammars.compile(SamplingParams(json_schema=SCHEMA))
    queued = [grammars.compile(SamplingParams(regex=f"a{i}[0-9]+")) for i in range(5)]
    for compiled in queued:
        grammars.cancel(compiled)
    assert all(compiled.cancelled() for compiled in queued)
    again = grammars.compile(SamplingParams(regex="a4[0-9]+"))  # compiled anew, not the cancelled one
    assert again is not queued[-1] and takes(grammars, again, "a4123")
    assert takes(grammars, first, '{"a":1}')
