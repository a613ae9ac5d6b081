"""The OpenAPI document (/openapi.json, shown at /docs): every route's request and response
schemas, generated from msgspec types.

The routes read raw requests and decode them with msgspec, so FastAPI sees no body model:
each route passes `docs.operation(...)` as its `openapi_extra`, which FastAPI merges into
the route's entry, and the components those schemas refer to join the document.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from sluice.server.api_types import ErrorResponse

_REF_TEMPLATE = "#/components/schemas/{name}"


class ApiDocs:
    def __init__(self) -> None:
        self.components: dict[str, Any] = {}
        self.field_schemas: dict[tuple[str, str], dict[str, Any]] = {}

    def schema(self, kind: Any) -> dict[str, Any]:
        """The schema of `kind`, its structs kept as components and referred to."""
        (schema,), components = msgspec.json.schema_components([kind], ref_template=_REF_TEMPLATE)
        self.components.update(components)
        return schema

    def operation(
        self,
        *,
        body: Any = None,
        body_fields: dict[str, Any] | None = None,
        response: Any = None,
        stream_event: Any = None,
        text_response: str | None = None,
        errors: tuple[int, ...] = (),
    ) -> dict[str, Any]:
        """A route's `openapi_extra`. `body_fields` documents fields of `body` that its struct
        types loosely (e.g. a dict the route converts itself); `stream_event` is the JSON of
        each server-sent event when the request asks for `stream`; `text_response` describes a
        plain-text answer."""
        operation: dict[str, Any] = {}
        if body is not None:
            operation["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": self.schema(body)}},
            }
            for field, kind in (body_fields or {}).items():
                self.field_schemas[body.__name__, field] = self.schema(kind)
        responses: dict[str, Any] = {}
        if response is not None:
            content = {"application/json": {"schema": self.schema(response)}}
            if stream_event is not None:
                content["text/event-stream"] = {"schema": self.stream_event_schema(stream_event)}
            responses["200"] = {"description": "OK", "content": content}
        if text_response is not None:
            text = {"text/plain": {"schema": {"type": "string", "description": text_response}}}
            responses["200"] = {"description": "OK", "content": text}
        for status_code in errors:
            responses[str(status_code)] = {
                "description": HTTPStatus(status_code).phrase,
                "content": {"application/json": {"schema": self.schema(ErrorResponse)}},
            }
        if responses:
            operation["responses"] = responses
        return operation

    def stream_event_schema(self, event: Any) -> dict[str, Any]:
        """One server-sent event (OpenAPI 3.1 describes each event of a stream): its `data`
        is the JSON of `event` or of an error, or the final `[DONE]`."""
        payload = {"anyOf": [self.schema(event), self.schema(ErrorResponse)]}
        return {
            "description": "With `stream`: one event per chunk; a failure after the first chunk is one error "
            "event; the last event is `data: [DONE]`.",
            "type": "object",
            "required": ["data"],
            "properties": {
                "data": {
                    "anyOf": [
                        {"const": "[DONE]"},
                        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
                    ]
                }
            },
        }

    def install(self, app: FastAPI) -> None:
        """Serve FastAPI's document with these components added."""

        def openapi() -> dict[str, Any]:
            if app.openapi_schema is None:
                document = get_openapi(title=app.title, version=app.version, routes=app.routes)
                schemas = document.setdefault("components", {}).setdefault("schemas", {})
                schemas.update(self.components)
                for (struct, field), schema in self.field_schemas.items():
                    schemas[struct]["properties"][field] = schema
                app.openapi_schema = document
            return app.openapi_schema

        app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend its document
