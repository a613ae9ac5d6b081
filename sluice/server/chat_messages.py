"""Chat messages as a client sends them (OpenAI's shapes: text and image parts, an
assistant's tool calls, a tool's result) and as a chat template takes them."""

from __future__ import annotations

import json
from typing import Any, Final, Literal

import msgspec

from sluice.sampling import ClientError


class ImageURL(msgspec.Struct, forbid_unknown_fields=True):
    url: str
    detail: str | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None


class FunctionCall(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"  # the only kind of call there is


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: the call it answers


CHAT_ROLES: Final = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def template_messages(
    messages: list[ChatMessage], image_token: str | None, model_name: str
) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages as the chat template takes them (a role, one string of content with
    each image part replaced by the model's image token, and the message's name, tool calls
    and tool_call_id where it has them), and the image URLs in order."""
    image_urls: list[str] = []
    rendered = [
        _template_message(message, index, image_token, model_name, image_urls) for index, message in enumerate(messages)
    ]
    return rendered, image_urls


def _template_message(
    message: ChatMessage, index: int, image_token: str | None, model_name: str, image_urls: list[str]
) -> dict[str, Any]:
    where = f"messages[{index}]"
    role = CHAT_ROLES.get(message.role)
    if role is None:
        raise ClientError(
            f"{where}.role '{message.role}' is not supported; use one of {sorted(CHAT_ROLES)}", f"{where}.role"
        )
    content = message.content
    if message.tool_calls is not None and role != "assistant":
        raise ClientError(f"{where}.tool_calls is for assistant messages", f"{where}.tool_calls")
    if role == "tool" and not message.tool_call_id:
        raise ClientError(f"{where}.tool_call_id is required for a tool's result", f"{where}.tool_call_id")
    if role != "tool" and message.tool_call_id is not None:
        raise ClientError(f"{where}.tool_call_id is for tool messages", f"{where}.tool_call_id")
    if content is None:
        if role != "assistant":
            raise ClientError(f"{where}.content is required for role '{message.role}'", f"{where}.content")
        content = ""
    elif isinstance(content, list):
        # One part a line, as vLLM joins them ("Hello" and "world" made "Helloworld").
        content = "\n".join(
            _part_text(part, f"{where}.content[{i}]", image_token, model_name, image_urls)
            for i, part in enumerate(content)
        )
    rendered: dict[str, Any] = {"role": role, "content": content}
    if message.name is not None:
        rendered["name"] = message.name  # for the template to use, as vLLM passes it
    if message.tool_calls:
        # Templates take arguments as an object (most write them with tojson).
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _json_or_text(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    return rendered


def _json_or_text(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (json.JSONDecodeError, RecursionError):  # not JSON, or nested past Python's stack
        return arguments


def _part_text(part: ContentPart, where: str, image_token: str | None, model_name: str, image_urls: list[str]) -> str:
    if part.type == "text":
        if part.text is None:
            raise ClientError(f"{where}.text is required for a text part", f"{where}.text")
        if part.image_url is not None:
            raise ClientError(f"{where}.image_url is not a field of a text part", f"{where}.image_url")
        return part.text
    if part.type in ("image_url", "input_image"):
        if part.text is not None:
            raise ClientError(f"{where}.text is not a field of an image part", f"{where}.text")
        if image_token is None:
            raise ClientError(f"the model {model_name} does not accept images", where)
        url = part.image_url.url if isinstance(part.image_url, ImageURL) else part.image_url
        detail = part.image_url.detail if isinstance(part.image_url, ImageURL) else None
        if detail not in (None, "auto", "high"):
            # OpenAI's "low" sees a 512-pixel copy: here every image is seen at the resolution
            # of the model's own image processor, which is what "auto" and "high" get.
            raise ClientError(
                f"{where}.image_url.detail '{detail}' is not supported: images are seen at the model's own "
                "resolution ('auto' or 'high')",
                f"{where}.image_url.detail",
            )
        if not url:
            raise ClientError(f"{where}.image_url.url is required for an image part", f"{where}.image_url")
        image_urls.append(url)
        return image_token
    raise ClientError(f"{where}.type '{part.type}' is not supported; use 'text' or 'image_url'", f"{where}.type")
