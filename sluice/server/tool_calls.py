"""Tool calls in chat: what the model is told, what it may say, and how its answer becomes
OpenAI's `message.tool_calls`.

`tool_choice` "required" or a named function is enforced by a JSON Schema (structured
output), so it holds even for a tiny model: the answer is a JSON array of `{"name",
"arguments"}` objects (one for a named function, or with `parallel_tool_calls: false`), each
`arguments` valid against its function's `parameters`. "auto" leaves the model free and
reads its own format out of the text (`--tool-call-parser`); where a function is marked
`strict`, a structural tag holds every call the model begins to that format (strict_calls_tag):

    hermes  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen)
    llama3  the whole answer one JSON object `{"name": ..., "parameters": {...}}` (Llama 3.x),
            optionally after `<|python_tag|>`

A chat template that has no tools section gets the tools in a system block (DEFAULT_TOOLS_PROMPT)
asking for the hermes format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Final

from sluice.server.stream_tags import partial_tag_len

TOOL_CALL_PARSERS: Final = ("hermes", "llama3")
HERMES_START: Final = "<tool_call>"
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG: Final = "<|python_tag|>"

DEFAULT_TOOLS_PROMPT: Final = (
    "You may call functions to answer. The functions, as JSON Schemas:\n{tools}\n"
    "To call one, answer with one block per call: "
    '<tool_call>{{"name": "function name", "arguments": {{...}}}}</tool_call>'
)


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = ""

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id or f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


def call_schema(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    # Arguments are an object, also where the schema leaves its type out (openai_protocol
    # refuses any other type).
    arguments = {**(parameters or {}), "type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def forced_schema(functions: dict[str, dict[str, Any] | None], names: list[str], parallel: bool) -> str:
    """The JSON Schema an answer must follow when it has to call one of `names`: an array of
    calls (exactly one unless `parallel`)."""
    items = [call_schema(name, functions[name]) for name in names]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": items[0] if len(items) == 1 else {"anyOf": items},
    }
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)


def strict_calls_tag(functions: dict[str, dict[str, Any] | None], strict: set[str], parser: str, newlines: bool) -> str:
    """For tool_choice "auto" with functions marked `strict`: a structural tag (SGLang's form,
    sluice/grammar.py) that leaves the answer free until a call begins, then holds the call
    to --tool-call-parser's format and, for the strict functions, their `parameters` (the
    others' arguments are any JSON object). hermes calls are written as the tools prompt asks
    (`newlines`: on lines of their own inside the tags, as the chat templates with a tools
    section show them)."""
    structures = []
    for name, parameters in functions.items():
        schema = {**(parameters or {}), "type": "object"} if name in strict else {"type": "object"}
        if parser == "llama3":
            begin, end = f'{{"name": {json.dumps(name)}, "parameters": ', "}"
        else:
            gap = "\n" if newlines else ""
            begin, end = f'{HERMES_START}{gap}{{"name": {json.dumps(name)}, "arguments": ', f"}}{gap}</tool_call>"
        structures.append({"begin": begin, "schema": schema, "end": end})
    trigger = '{"name": ' if parser == "llama3" else HERMES_START
    return json.dumps({"structures": structures, "triggers": [trigger]})


def forced_calls(text: str) -> list[ToolCall] | None:
    """The calls of an answer made under forced_schema, or None where a stop string or
    stop token ended it before its JSON array was whole."""
    try:
        calls = json.loads(text)
    except ValueError:
        return None
    return [ToolCall(call["name"], json.dumps(call["arguments"])) for call in calls]


def parse_tool_calls(text: str, parser: str, known: set[str]) -> tuple[str, list[ToolCall]]:
    """(the content left, the calls) of a free answer. Calls of functions not offered, or
    whose JSON does not parse, stay text: nothing the model said is lost."""
    if parser == "llama3":
        llama3_calls = _llama3_calls(text.strip().removeprefix(_PYTHON_TAG).strip(), known)
        return ("", llama3_calls) if llama3_calls else (text, [])
    calls: list[ToolCall] = []
    kept: list[str] = []
    position = 0
    for match in _HERMES_BLOCK.finditer(text):
        call = _call_of(match.group(1), "arguments", known)
        if call is None:
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.append(call)
    kept.append(text[position:])
    if not calls:
        return text, calls
    # As a stream sends it: the text before the first call as written, unless it is only
    # whitespace; no whitespace at the end.
    content = "".join(kept)
    return (content if kept[0].strip() else content.lstrip()).rstrip(), calls


def _llama3_calls(body: str, known: set[str]) -> list[ToolCall] | None:
    """The calls of a Llama 3 answer: JSON objects, one after another with "; " between them
    (as Llama 3.x writes several, and vLLM reads them); None unless every one is a call."""
    decoder, calls, position = json.JSONDecoder(), [], 0
    while True:
        try:
            parsed, position = decoder.raw_decode(body, position)
        except (json.JSONDecodeError, RecursionError):
            return None
        call = _call_from(parsed, "parameters", known)
        if call is None:
            return None
        calls.append(call)
        rest = body[position:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        if not rest[1:].strip():  # a ";" after the last call, as vLLM takes it
            return calls
        position = len(body) - len(rest[1:].lstrip())


def _call_of(body: str, arguments_key: str, known: set[str]) -> ToolCall | None:
    """The call a block's JSON makes (see _call_from); None where it is not JSON."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past Python's stack
        return None
    return _call_from(call, arguments_key, known)


def _call_from(call: Any, arguments_key: str, known: set[str]) -> ToolCall | None:
    """The call a parsed block makes: a function offered, with its arguments an object (or a
    string holding one) under `arguments_key` or "arguments", or no other key than the name.
    Anything else is text (None), as vLLM's parsers leave it."""
    if not isinstance(call, dict) or call.get("name") not in known:
        return None
    key = next((key for key in (arguments_key, "arguments") if key in call), None)
    if key is None:
        return ToolCall(call["name"], "{}") if call.keys() == {"name"} else None
    arguments = call[key]
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (json.JSONDecodeError, RecursionError):
            return None
    return ToolCall(call["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def may_start_call(text: str) -> int:
    """Where a hermes call may begin in streamed text (len(text) when it cannot): the text
    before can go out; the rest waits for more tokens."""
    start = text.find(HERMES_START)
    return start if start >= 0 else len(text) - partial_tag_len(text, HERMES_START)


def default_parser(chat_template_source: str | None) -> str:
    """llama3 for templates that speak of Llama 3's ipython role, hermes for the rest."""
    source = chat_template_source or ""
    return "llama3" if "<|python_tag|>" in source or "ipython" in source else "hermes"


def template_knows_tools(chat_template_source: str | None) -> bool:
    return "tools" in (chat_template_source or "")


def with_tools_in_text(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For a template with no tools section: the tools in a system block (appended to the
    first system message, or one of its own), and earlier calls written into their
    assistant message's content in the hermes format the block asks for."""
    messages = [dict(message) for message in messages]
    for message in messages:
        for call in message.pop("tool_calls", None) or []:
            function = call["function"]
            written = json.dumps({"name": function["name"], "arguments": function["arguments"]})
            message["content"] = f"{message['content']}{HERMES_START}{written}</tool_call>"
    if tools:
        block = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in tools))
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{block}"
        else:
            messages.insert(0, {"role": "system", "content": block})
    return messages
