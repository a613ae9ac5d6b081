"""Structured output through the real server and model: json_schema / regex / ebnf natively,
response_format and the SDK's parse() on the OpenAI routes."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from tests.helpers import wait_until_drained

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


def generate(http: httpx.Client, **body) -> dict:
    result = http.post("/generate", json={"text": PROMPT, **body})
    assert result.status_code == 200, result.text
    return result.json()


def test_json_schema_holds_at_temperature_one_for_every_seed(http):
    params = {"json_schema": json.dumps(PERSON), "temperature": 1.0, "max_new_tokens": 60}
    texts = set()
    for seed in range(8):
        result = generate(http, sampling_params={**params, "seed": seed})
        jsonschema.validate(json.loads(result["text"]), PERSON)
        assert result["meta_info"]["finish_reason"]["type"] == "stop"
        texts.add(result["text"])
    assert len(texts) > 1  # sampled, not one forced answer


def test_regex_and_ebnf_are_matched_whole(http):
    result = generate(http, sampling_params={"regex": "[0-9]{3}-[a-z]{2}", "max_new_tokens": 20, "temperature": 0})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", result["text"]), result["text"]
    grammar = 'root ::= "answer: " ("yes" | "no")'
    result = generate(http, sampling_params={"ebnf": grammar, "max_new_tokens": 20, "temperature": 0.7, "seed": 3})
    assert result["text"] in ("answer: yes", "answer: no")


def test_constrained_and_free_requests_share_a_batch(http):
    free = {"max_new_tokens": 24, "temperature": 0}
    alone = generate(http, sampling_params=free)["text"]
    constrained = {"json_schema": json.dumps(PERSON), "max_new_tokens": 60, "temperature": 0}
    batch = http.post(
        "/generate", json={"text": [PROMPT, PROMPT, PROMPT], "sampling_params": [free, constrained, free]}
    ).json()
    assert batch[0]["text"] == batch[2]["text"] == alone
    jsonschema.validate(json.loads(batch[1]["text"]), PERSON)


def test_min_new_tokens_holds_within_a_grammar_or_the_request_fails(http):
    """Digits go on past where the model would stop, up to min_new_tokens; a grammar that is
    complete before then cannot give the answer asked for: a 400, not a shorter answer."""
    params = {"regex": "[0-9]+", "min_new_tokens": 6, "max_new_tokens": 12, "temperature": 0}
    result = generate(http, sampling_params=params)
    assert result["meta_info"]["completion_tokens"] >= 6 and result["text"].isdigit(), result
    params = {"regex": "a", "min_new_tokens": 3, "max_new_tokens": 8}
    result = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert result.status_code == 400, result.text
    assert "before min_new_tokens 3" in result.json()["error"]["message"]


def test_parallel_samples_each_follow_the_grammar(http):
    params = {"json_schema": json.dumps(PERSON), "n": 3, "temperature": 1.0, "max_new_tokens": 60}
    results = generate(http, sampling_params=params)
    assert len(results) == 3
    for result in results:
        jsonschema.validate(json.loads(result["text"]), PERSON)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=120)


def test_the_sdk_parse_gives_a_pydantic_object(client, model_name):
    completion = client.chat.completions.parse(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format=Person,
        max_tokens=60,
        temperature=0,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 120


def test_json_object_and_streamed_json_schema(client, model_name):
    result = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=80,
        temperature=0,
    )
    if result.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(result.choices[0].message.content), dict)
    else:  # an object may run long; what came so far is still its start
        assert result.choices[0].message.content.startswith("{")
    stream = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=60,
        temperature=0,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    jsonschema.validate(json.loads(text), PERSON)


ANSWER_TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "The answer is ", "schema": {"type": "integer", "minimum": 0, "maximum": 99}, "end": "."}],
    "triggers": ["The"],
}
THE = 504  # SmolLM2's token "The": a bias of +100 makes the model say it wherever it may


@pytest.mark.parametrize("route", ["/generate", "/v1/completions"])
def test_a_structural_tag_holds_what_follows_its_trigger(http, route):
    """Forced to say "The" again and again, the model must go on as the tag's structure each
    time (without the tag the text is "TheTheThe...")."""
    if route == "/generate":
        params = {"structural_tag": json.dumps(ANSWER_TAG), "logit_bias": {str(THE): 100}, "max_new_tokens": 24}
        text = generate(http, sampling_params={**params, "temperature": 0})["text"]
    else:
        body = {"prompt": PROMPT, "response_format": ANSWER_TAG, "logit_bias": {str(THE): 100}, "max_tokens": 24}
        result = http.post(route, json={**body, "temperature": 0})
        assert result.status_code == 200, result.text
        text = result.json()["choices"][0]["text"]
    assert re.match(r"(The answer is [0-9]{1,2}\.){2}", text), text


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.mark.parametrize(
    "params, field",
    [
        ({"json_schema": "{not json"}, "json_schema"),
        ({"json_schema": '{"type": "nonsense"}'}, "json_schema"),
        ({"json_schema": "[1, 2]"}, "json_schema"),
        ({"regex": "[0-9"}, "regex"),
        ({"ebnf": "root ::= ("}, "ebnf"),
        ({"ebnf": "root ::= undefined_rule"}, "ebnf"),
        ({"regex": "a", "json_schema": "{}"}, "regex"),
        ({"structural_tag": '{"structures": [{"begin": "a", "end": "b"}], "triggers": ["x"]}'}, "structural_tag"),
        (
            {
                "structural_tag": json.dumps(
                    {"structures": [{"begin": "a", "end": "b", "schema": {"type": 1}}], "triggers": ["a"]}
                )
            },
            "structural_tag",
        ),
    ],
)
def test_bad_grammars_are_400_naming_the_field(http, base_url, params, field):
    result = http.post("/generate", json={"text": "hi", "sampling_params": params})
    assert result.status_code == 400, result.text
    assert field in result.json()["error"]["message"]
    wait_until_drained(base_url)  # refused before the Scheduler: nothing left in rid_to_state


def chained_schema(levels: int) -> dict:
    """Objects each holding the next through a $ref: a chain llguidance compiles recursively."""
    defs = {f"d{i}": {"type": "object", "properties": {"x": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(levels)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{levels}": {"type": "string"}}}


def test_a_deeply_chained_schema_compiles_and_the_server_lives(http, base_url):
    """1,500 chained $refs (85 KB) overflow a thread's default 8 MB of stack in llguidance's
    compile (a segfault of the whole server): compiled on threads with stack for them, in
    the HTTP process and in the Scheduler."""
    params = {"json_schema": json.dumps(chained_schema(1500)), "max_new_tokens": 3}
    result = http.post("/generate", json={"text": "hi", "sampling_params": params})
    assert result.status_code == 200, result.text
    assert http.get("/health").status_code == 200
    wait_until_drained(base_url)


def test_a_grammar_past_the_size_limits_is_400_naming_it(http, base_url):
    schema = json.dumps({"enum": ["x" * 1000] * 300})  # ~300 K characters
    result = http.post("/generate", json={"text": "hi", "sampling_params": {"json_schema": schema}})
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == "json_schema"
    assert "262,144" in result.json()["error"]["message"]
    rules = "root ::= r0\n" + "\n".join(f'r{i} ::= "x" r{i + 1} | "y"' for i in range(2000)) + '\nr2000 ::= "z"'
    result = http.post("/generate", json={"text": "hi", "sampling_params": {"ebnf": rules}})
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == "ebnf"
    assert "2,002 rules" in result.json()["error"]["message"]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "big", "schema": json.loads(schema)}}
    result = http.post("/v1/chat/completions", json=body)
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == "response_format"
    wait_until_drained(base_url)


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"schema": [1]}},
        "json",
        # A field the type does not have would be left without effect: refused.
        {"type": "json_object", "json_schema": {"name": "person", "schema": PERSON}},
        {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "schema_version": 2}},
        {"type": "json_schema", "json_schema": {"name": 7, "schema": PERSON}},
        {"type": "text", "json_schema": {"name": "person", "schema": PERSON}},
    ],
)
def test_bad_response_formats_are_400(http, response_format):
    body = {"messages": [{"role": "user", "content": "hi"}], "response_format": response_format, "max_tokens": 4}
    result = http.post("/v1/chat/completions", json=body)
    assert result.status_code == 400, result.text
    assert result.json()["error"]["param"] == "response_format"


def test_json_object_with_a_schema_follows_the_schema(client, model_name):
    """Fireworks and Together take a schema beside json_object; sluice honours it too."""
    result = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Describe a person."}],
        response_format={"type": "json_object", "schema": PERSON},
        max_tokens=60,
        temperature=0,
    )
    jsonschema.validate(json.loads(result.choices[0].message.content), PERSON)


def test_completions_take_response_format_too(http):
    body = {
        "prompt": PROMPT,
        "max_tokens": 60,
        "temperature": 0,
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    }
    result = http.post("/v1/completions", json=body)
    assert result.status_code == 200, result.text
    jsonschema.validate(json.loads(result.json()["choices"][0]["text"]), PERSON)
