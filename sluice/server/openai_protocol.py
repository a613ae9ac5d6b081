"""The bodies of the OpenAI routes: decoded with msgspec, checked, turned into sampling_params.

Nothing a client sends is silently ignored. Every field is one of three kinds:
honoured; accepted without effect, because it changes nothing in the answer (`user`,
`metadata`, `store`, ...); or refused with 400 naming it unless it holds its neutral
value (`tools`, `tool_choice`, `audio`, ...). A field no kind
lists is refused as unknown. A wrong type or an out-of-range value is a ClientError that
names the field. README.md lists the three kinds.
"""

from __future__ import annotations

import json
from typing import Any, Final

import msgspec

from sluice.sampling import MAX_TOP_LOGPROBS, ClientError
from sluice.server.chat_messages import ChatMessage, template_messages
from sluice.tokenizer.io_struct import EmbeddingReqInput

MAX_COMPLETION_LOGPROBS: Final = 5
DEFAULT_COMPLETION_MAX_TOKENS: Final = 16  # OpenAI's default for /v1/completions


def _check_range(value: int | None, name: str, low: int, high: int | None = None) -> None:
    if value is None:
        return
    if value < low or (high is not None and value > high):
        allowed = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ClientError(f"{name} must be {allowed}, got {value}", name)


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


def _refuse_unless(neutral: bool, name: str, what: str = "") -> None:
    if not neutral:
        described = f"{name} {what}" if what else name
        raise ClientError(f"{described} is not supported by this server; leave it out", name)


def _is_empty(value: Any) -> bool:
    return value is None or value == [] or value == {} or value == ""


class SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields both routes share: the model, streaming, and sampling (OpenAI's and SGLang's/vLLM's extras)."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    logit_bias: dict[str, float] | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}
    # or {"type": "structural_tag", "structures": [{"begin", "schema", "end"}], "triggers": [...]}
    response_format: Any = None
    # SGLang's / vLLM's constraints, as extras (vLLM's guided_* names are not taken).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    # SGLang's / vLLM's extra: higher runs sooner under --schedule-policy priority.
    priority: int | None = None
    # Accepted without effect: they change nothing in what comes back.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_common(self) -> None:
        # The remaining ranges, and n's upper limit, are checked with the native path's
        # names, which match OpenAI's.
        _check_range(self.n, "n", 1)
        if self.stream_options is not None and not self.stream:
            raise ClientError("stream_options is only allowed when stream is true (as OpenAI says)", "stream_options")

    def _constraint(self) -> dict[str, str]:
        """The native grammar field (json_schema or structural_tag) that response_format or
        the json_schema extra asks for, or none."""
        response_format = self.response_format
        if response_format is None or response_format == {"type": "text"}:
            return {} if self.json_schema is None else {"json_schema": self.json_schema}
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if isinstance(response_format, dict) and kind in _FORMAT_FIELDS:
            _check_fields(response_format, _FORMAT_FIELDS[kind], f"response_format of type {kind!r}")
        if kind == "json_object":
            # A schema beside it is honoured, as Fireworks and Together take it.
            constraint = {"json_schema": json.dumps(_schema(response_format.get("schema", {"type": "object"})))}
        elif kind == "json_schema" and isinstance(response_format.get("json_schema"), dict):
            spec = response_format["json_schema"]
            _check_fields(spec, _JSON_SCHEMA_FIELDS, "response_format.json_schema")
            if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", True), bool | None):
                raise ClientError(
                    "response_format.json_schema's name must be a string and strict a boolean", "response_format"
                )
            constraint = {"json_schema": json.dumps(_schema(spec.get("schema", {})))}
        elif kind == "structural_tag":  # SGLang's and vLLM's: checked by the grammar (sluice/grammar.py)
            constraint = {"structural_tag": json.dumps(response_format)}
        else:
            raise ClientError(
                "response_format must be {'type': 'text'}, {'type': 'json_object'}, "
                "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}} or "
                "{'type': 'structural_tag', 'structures': [...], 'triggers': [...]}",
                "response_format",
            )
        if self.json_schema is not None or self.regex is not None or self.ebnf is not None:
            raise ClientError("give response_format or one of json_schema, regex, ebnf, not both", "response_format")
        return constraint

    @property
    def grammar_names(self) -> dict[str, str]:
        """The request field that a grammar error of the native path is about, by its native
        name: response_format where that gave the grammar (a bad schema in it, say)."""
        if self.response_format is None or self.response_format == {"type": "text"}:
            return {}
        return {"json_schema": "response_format", "structural_tag": "response_format"}

    @property
    def sample_count(self) -> int:
        return 1 if self.n is None else self.n

    def sampling_params(self, max_new_tokens: int) -> dict[str, Any]:
        """The native sampling_params; fields the client left out keep the native defaults."""
        params = {
            "n": self.n,
            "max_new_tokens": max_new_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "seed": self.seed,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "no_stop_trim": self.no_stop_trim,
            "logit_bias": self.logit_bias or None,
            "regex": self.regex,
            "ebnf": self.ebnf,
            **self._constraint(),
        }
        return {key: value for key, value in params.items() if value is not None}


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, token ids, or a list of either: the shape is checked by hand because
    # msgspec cannot tell list[int] from list[str] in a union.
    prompt: str | list[Any]
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self.check_common()
        _check_range(self.best_of, "best_of", 1)
        _refuse_unless(
            self.best_of in (None, self.sample_count), "best_of", "other than n (picking the best of more samples)"
        )
        _refuse_unless(not self.suffix, "suffix", "(insertion after the completion)")
        _check_range(self.max_tokens, "max_tokens", 0)
        _check_range(self.logprobs, "logprobs", 0, MAX_COMPLETION_LOGPROBS)

    @property
    def max_new_tokens(self) -> int:
        return DEFAULT_COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    def prompts(self) -> list[str] | list[list[int]]:
        """Every prompt, each a string or token ids; a single prompt is a list of one."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ClientError("prompt must not be empty", "prompt")
        if _is_token_ids(prompt):
            return [prompt]
        if all(isinstance(item, str) for item in prompt) or all(_is_token_ids(item) for item in prompt):
            return prompt
        raise ClientError(
            "prompt must be a string, a list of token ids, or a list of strings or of token-id lists (not both)",
            "prompt",
        )


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(token) is int for token in value)


class EmbeddingRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The body of /v1/embeddings."""

    # A string, token ids, or a list of either (checked by hand, as CompletionRequest.prompt).
    input: str | list[Any]
    model: str | None = None
    encoding_format: str = "float"  # "float" | "base64" (float32 little-endian bytes)
    dimensions: int | None = None
    # SGLang's / vLLM's extra: higher runs sooner under --schedule-policy priority.
    priority: int | None = None
    user: str | None = None  # accepted without effect

    def native(self, embedding_dim: int) -> EmbeddingReqInput:
        """The /encode request this asks for; a shape or option the server cannot honour is a ClientError."""
        if self.encoding_format not in ("float", "base64"):
            message = f"encoding_format must be float or base64, got {self.encoding_format!r}"
            raise ClientError(message, "encoding_format")
        if self.dimensions is not None and self.dimensions != embedding_dim:
            raise ClientError(
                f"dimensions {self.dimensions} is not supported: this model's embeddings have {embedding_dim} "
                "dimensions and are not truncated",
                "dimensions",
            )
        value = self.input
        if isinstance(value, str):
            return EmbeddingReqInput(text=value, priority=self.priority)
        if value and _is_token_ids(value):
            return EmbeddingReqInput(input_ids=[*value], priority=self.priority)
        if value and all(isinstance(item, str) for item in value):
            return EmbeddingReqInput(text=[*value], priority=self.priority)
        if value and all(_is_token_ids(item) for item in value):
            return EmbeddingReqInput(input_ids=[*value], priority=self.priority)
        raise ClientError(
            "input must be a non-empty string, a list of token ids, or a non-empty list of strings or of token-id "
            "lists (not both)",
            "input",
        )


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class ToolDefinition(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    function: NamedFunction


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's and SGLang's: extra variables for the chat template (e.g. enable_thinking), and
    # how the prompt ends (a new assistant turn, or the last assistant message continued).
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # Refused unless neutral: they change the answer and are not honoured. Typed Any so that
    # any shape gets this refusal rather than a type error.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    # Accepted without effect: a prediction only speeds up an answer in OpenAI's service.
    prediction: Any = None

    def check(self) -> None:
        self.check_common()
        self._check_tools()
        self._check_prompt_end()
        _refuse_unless(_is_empty(self.functions), "functions", "(the old form of tools: use tools)")
        _refuse_unless(self.function_call in (None, "none"), "function_call", "other than 'none' (function calls)")
        _refuse_unless(self.audio is None, "audio", "(audio output)")
        _refuse_unless(self.modalities in (None, ["text"]), "modalities", "other than ['text']")
        _refuse_unless(self.reasoning_effort is None, "reasoning_effort", "(reasoning models)")
        _refuse_unless(self.verbosity is None, "verbosity")
        _refuse_unless(self.web_search_options is None, "web_search_options", "(web search)")
        _check_range(self.max_tokens, "max_tokens", 0)
        _check_range(self.max_completion_tokens, "max_completion_tokens", 0)
        _check_range(self.top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM: not an answer without them
            raise ClientError("top_logprobs needs logprobs set to true", "top_logprobs")
        if not self.messages:
            raise ClientError("messages must not be empty", "messages")

    def _check_tools(self) -> None:
        names = []
        for index, tool in enumerate(self.tools or []):
            if tool.type != "function":
                raise ClientError(f"tools[{index}].type must be 'function', got {tool.type!r}", f"tools[{index}].type")
            if not tool.function.name or tool.function.name in names:
                raise ClientError(f"tools[{index}].function.name must be a new, non-empty name", f"tools[{index}]")
            names.append(tool.function.name)
            parameters = tool.function.parameters
            if parameters is not None and parameters.get("type", "object") != "object":
                # A call's arguments are a JSON object (OpenAI refuses other schemas too).
                raise ClientError(
                    f"tools[{index}].function.parameters must be a JSON Schema of type 'object', "
                    f"got type {parameters['type']!r}",
                    f"tools[{index}].function.parameters",
                )
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            if choice.type != "function":
                raise ClientError(f"tool_choice.type must be 'function', got {choice.type!r}", "tool_choice")
            if choice.function.name not in names:
                raise ClientError(
                    f"tool_choice names the function {choice.function.name!r}, which tools does not hold", "tool_choice"
                )
        elif choice not in (None, "none", "auto", "required"):
            raise ClientError("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
        elif choice == "required" and not names:
            raise ClientError("tool_choice 'required' needs tools", "tool_choice")

    def _check_prompt_end(self) -> None:
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ClientError(
                    "continue_final_message continues the last message: set add_generation_prompt to false",
                    "continue_final_message",
                )
            if not self.messages or self.messages[-1].role != "assistant":
                raise ClientError("continue_final_message needs an assistant message last", "continue_final_message")
            if self.messages[-1].tool_calls:
                # The template writes calls after the text, where the continued prompt ends.
                raise ClientError(
                    "continue_final_message continues the last message's text: it may not carry tool_calls",
                    f"messages[{len(self.messages) - 1}].tool_calls",
                )
        # The request's own fields: in the kwargs they would be ignored (the prompt's end is
        # not the template's to continue) or clash.
        reserved = {"messages", "add_generation_prompt", "continue_final_message", "tools"}
        if given := sorted(reserved & set(self.chat_template_kwargs or {})):
            raise ClientError(
                f"chat_template_kwargs may not set {given[0]}: it is a field of the request", "chat_template_kwargs"
            )

    @property
    def tools_offered(self) -> list[ToolDefinition]:
        """The tools a call may be read for: none with tool_choice 'none'."""
        return [] if self.tool_choice == "none" else list(self.tools or [])

    @property
    def forced_functions(self) -> list[str]:
        """The functions the answer must call one of (tool_choice 'required' or named)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [self.tool_choice.function.name]
        if self.tool_choice == "required":
            return [tool.function.name for tool in self.tools or []]
        return []

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self, image_token: str | None, model_name: str) -> tuple[list[dict[str, Any]], list[str]]:
        """The messages as the chat template takes them, and the image URLs in order."""
        return template_messages(self.messages, image_token, model_name)


class TokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """/tokenize: a prompt, or chat messages rendered through the model's chat template with
    the chat route's prompt fields (vLLM's tokenize-chat request)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # Absent: true for a prompt, false for messages (the chat template writes its own), as vLLM.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None

    def check(self) -> None:
        if self.prompt is None and self.messages is None:
            raise ClientError("give prompt (a string) or messages (a chat)", "prompt")
        if self.prompt is not None and self.messages is not None:
            raise ClientError("give prompt (a string) or messages (a chat), not both", "prompt")
        if self.prompt is not None:
            chat_only = {
                "add_generation_prompt": not self.add_generation_prompt,
                "continue_final_message": self.continue_final_message,
                "chat_template_kwargs": self.chat_template_kwargs is not None,
                "tools": self.tools is not None,
            }
            if given := next((name for name, changed in chat_only.items() if changed), None):
                raise ClientError(f"{given} applies to messages (a chat), not to a prompt", given)
        else:
            self.chat().check()

    @property
    def special_tokens(self) -> bool:
        return self.add_special_tokens if self.add_special_tokens is not None else self.prompt is not None

    def chat(self) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            messages=self.messages or [],
            add_generation_prompt=self.add_generation_prompt,
            continue_final_message=self.continue_final_message,
            chat_template_kwargs=self.chat_template_kwargs,
            tools=self.tools,
        )


class DetokenizeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    tokens: list[int]


# The fields each response_format type has (OpenAI's; json_object's schema as Fireworks and
# Together take it): any other is refused rather than left without effect.
_FORMAT_FIELDS = {"text": {"type"}, "json_object": {"type", "schema"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


def _check_fields(given: dict[str, Any], known: set[str], where: str) -> None:
    if unknown := sorted(set(given) - known):
        raise ClientError(f"{where} has no field {unknown[0]!r} (it has {', '.join(sorted(known))})", "response_format")


def _schema(schema: Any) -> dict[str, Any]:
    if not isinstance(schema, dict):
        raise ClientError("response_format's schema must be a JSON Schema object", "response_format")
    return schema
