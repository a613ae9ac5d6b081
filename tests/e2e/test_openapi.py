"""/openapi.json describes every route's body and responses, and schemathesis, generating
requests from that document, finds no 5xx on any non-admin route, while every JSON response
conforms to the schema the document gives it."""

from __future__ import annotations

import copy

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.config import SchemathesisConfig
from schemathesis.specs.openapi.checks import response_schema_conformance

from sluice.sampling import MAX_REPETITION_PENALTY, MAX_TOP_K, MIN_REPETITION_PENALTY
from sluice.server.guard import ADMIN_PATHS
from tests.helpers import wait_until_drained

# Generated requests stay cheap: every generative body asks for at most this many tokens.
MAX_GENERATED_TOKENS = 4
MAX_GENERATED_N = 3
EXAMPLES_PER_ROUTE = 40


def test_every_route_publishes_its_body_and_responses(base_url):
    document = httpx.get(base_url + "/openapi.json", timeout=30).json()
    paths, schemas = document["paths"], document["components"]["schemas"]
    bodies = {
        path: operation["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        for path, operation in paths.items()
        if "requestBody" in operation.get("post", {})
    }
    assert bodies == {
        "/generate": "#/components/schemas/GenerateReqInput",
        "/abort_request": "#/components/schemas/AbortRequestInput",
        "/pause_generation": "#/components/schemas/PauseGenerationReqInput",
        "/v1/completions": "#/components/schemas/CompletionRequest",
        "/v1/chat/completions": "#/components/schemas/ChatCompletionRequest",
        "/tokenize": "#/components/schemas/TokenizeRequest",
        "/detokenize": "#/components/schemas/DetokenizeRequest",
        "/encode": "#/components/schemas/EmbeddingReqInput",
        "/v1/embeddings": "#/components/schemas/EmbeddingRequest",
        "/update_weights_from_disk": "#/components/schemas/UpdateWeightsFromDiskReqInput",
    }
    assert "temperature" in schemas["SamplingParams"]["properties"]
    assert "messages" in schemas["ChatCompletionRequest"]["required"]
    for path, operations in paths.items():
        for operation in operations.values():
            responses = operation["responses"]
            content = responses.get("200", {}).get("content", {})
            answer = content.get("text/plain" if path == "/metrics" else "application/json", {})
            assert path.startswith("/health") or "schema" in answer, path
            if "requestBody" in operation:
                assert responses["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    chat_200 = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    event_data = chat_200["text/event-stream"]["schema"]["properties"]["data"]["anyOf"]
    assert event_data[0] == {"const": "[DONE]"}
    assert {"$ref": "#/components/schemas/ChatCompletionChunk"} in event_data[1]["contentSchema"]["anyOf"]
    docs_page = httpx.get(base_url + "/docs", timeout=30)
    assert docs_page.status_code == 200 and "/openapi.json" in docs_page.text


def enum(values) -> dict:
    return {"enum": list(values)}


def nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


FEW_TOKENS = enum(range(MAX_GENERATED_TOKENS + 1))
TEXT = {"type": "string", "minLength": 1, "maxLength": 200}
TEXTS = {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 3}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1, "maxItems": 12}
# The ranges the server accepts (sluice/sampling.py), so that most requests reach the model.
SAMPLING = {
    "n": enum(range(1, MAX_GENERATED_N + 1)),
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": "integer", "minimum": -1, "maximum": MAX_TOP_K},
    "min_p": {"type": "number", "minimum": 0, "maximum": 1},
    "repetition_penalty": {"type": "number", "minimum": MIN_REPETITION_PENALTY, "maximum": MAX_REPETITION_PENALTY},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "seed": nullable({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
    "stop": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 8}, "maxItems": 3},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "maxItems": 3},
}
NARROWED = {
    "SamplingParams": {**SAMPLING, "max_new_tokens": FEW_TOKENS, "min_new_tokens": FEW_TOKENS},
    "CompletionRequest": {
        **SAMPLING,
        "max_tokens": FEW_TOKENS,
        "min_tokens": FEW_TOKENS,
        "prompt": {"anyOf": [TEXT, TEXTS, TOKEN_IDS]},
        "logprobs": nullable(enum(range(6))),
    },
    "ChatCompletionRequest": {
        **SAMPLING,
        "max_tokens": FEW_TOKENS,
        "max_completion_tokens": nullable(FEW_TOKENS),
        "min_tokens": FEW_TOKENS,
        "top_logprobs": nullable(enum(range(6))),
        "messages": {
            "type": "array",
            "items": {"$ref": "#/components/schemas/ChatMessage"},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "ChatMessage": {
        "role": enum(["system", "developer", "user", "assistant"]),
        "content": {
            "anyOf": [
                TEXT,
                {"type": "array", "items": {"$ref": "#/components/schemas/ContentPart"}, "minItems": 1, "maxItems": 2},
            ]
        },
    },
    "ContentPart": {"type": enum(["text"]), "text": TEXT},
    "EmbeddingRequest": {"input": {"anyOf": [TEXT, TEXTS, TOKEN_IDS]}},
    "EmbeddingReqInput": {"rid": {"type": "null"}, "text": nullable({"anyOf": [TEXT, TEXTS]})},
    "GenerateReqInput": {
        "rid": {"type": "null"},
        "image_data": {"type": "null"},
        "top_logprobs_num": enum(range(6)),
        "logprob_start_len": enum(range(-1, 3)),
    },
}
REQUIRED = {
    "SamplingParams": ["max_new_tokens"],
    "CompletionRequest": ["max_tokens"],
    "ChatCompletionRequest": ["max_tokens"],
    "ChatMessage": ["content"],
    "ContentPart": ["text"],
}


def bounded(document: dict, model_name: str) -> dict:
    """The published document, narrowed for the fuzzer only, to what the server accepts (the
    refusals are tested elsewhere) at a bounded cost: few new tokens, required so that no
    request falls back to a long default; small n; the served model's name."""
    document = copy.deepcopy(document)
    schemas = document["components"]["schemas"]
    for struct, fields in NARROWED.items():
        schemas[struct]["properties"].update(fields)
    for struct, fields in REQUIRED.items():
        schemas[struct].setdefault("required", []).extend(fields)
    for struct in ("CompletionRequest", "ChatCompletionRequest", "EmbeddingRequest"):
        schemas[struct]["properties"]["model"] = enum([model_name])
    # Exactly one of text and input_ids, and sampling_params (for max_new_tokens).
    generate = schemas.pop("GenerateReqInput")
    params = {"$ref": "#/components/schemas/SamplingParams"}
    generate["properties"]["sampling_params"] = {"anyOf": [params, {"type": "array", "items": params, "maxItems": 3}]}
    with_text, with_ids = copy.deepcopy(generate), copy.deepcopy(generate)
    with_text["properties"].update(text={"anyOf": [TEXT, TEXTS]}, input_ids={"type": "null"})
    with_ids["properties"].update(
        input_ids={"anyOf": [TOKEN_IDS, {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 3}]},
        text={"type": "null"},
    )
    with_text["required"], with_ids["required"] = ["text", "sampling_params"], ["input_ids", "sampling_params"]
    schemas["GenerateReqInput"] = {"anyOf": [with_text, with_ids]}
    return document


# Every route but the admin ones (which pause, flush and abort for everyone).
FUZZED_ROUTES = [
    ("GET", "/health"),
    ("GET", "/health_generate"),
    ("POST", "/generate"),
    ("GET", "/get_model_info"),
    ("GET", "/get_weight_version"),
    ("GET", "/v1/loads"),
    ("GET", "/get_server_info"),
    ("GET", "/metrics"),
    ("POST", "/encode"),
    ("POST", "/v1/embeddings"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model_id}"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


@pytest.fixture(scope="module")
def api_schema(server):
    if server.tokenizer_worker_num != 1:
        pytest.skip("the routes and their checks are the same behind two workers: fuzzed once, on one")
    document = httpx.get(server.base_url + "/openapi.json", timeout=30).json()
    published = {
        (method.upper(), path)
        for path, operations in document["paths"].items()
        for method in operations
        if path not in ADMIN_PATHS
    }
    assert published == set(FUZZED_ROUTES)  # a new route joins the fuzzed ones
    model_name = httpx.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    config = SchemathesisConfig.from_dict({"base-url": server.base_url})
    return schemathesis.openapi.from_dict(bounded(document, model_name), config=config)


@pytest.mark.parametrize("method, path", FUZZED_ROUTES)
def test_no_generated_request_gets_a_server_error(api_schema, method, path):
    @given(case=api_schema[path][method].as_strategy())
    @settings(max_examples=EXAMPLES_PER_ROUTE, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def no_server_error(case):
        case.call_and_validate(checks=[not_a_server_error, response_schema_conformance], timeout=60)

    no_server_error()
    wait_until_drained(api_schema.config.base_url)
