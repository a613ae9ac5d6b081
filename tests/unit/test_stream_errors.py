"""The one rule for errors on streams (sluice/server/sse.py), for the native format and an
OpenAI view: a failure before the first chunk is a real status with the error envelope; a
failure after it is one error event with the same envelope (typed by its status), then
[DONE]. The e2e tests drive the same rule through a real Scheduler refusal and a dead
Scheduler; here each case is exact, including a 400 after the first token."""

from __future__ import annotations

import json

import pytest
from fastapi.responses import JSONResponse, StreamingResponse

from sluice.messages import FinishReason
from sluice.sampling import ClientError
from sluice.server.app import NativeStreamFormat
from sluice.server.logprobs import TokenTexts
from sluice.server.openai_protocol import CompletionRequest
from sluice.server.openai_views import CompletionView
from sluice.server.sse import stream_response
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.result import GenerateChunk


def chunk(text: str, finish: FinishReason | None = None, index: int | None = None) -> GenerateChunk:
    return GenerateChunk(
        rid="r",
        path="single" if index is None else "batch",
        index=index,
        text=text,
        output_ids=[1] * len(text),
        finish_reason=finish,
        prompt_tokens=3,
        completion_tokens=len(text),
    )


REFUSED = FinishReason(
    type="abort", message="Multimodal prompt is too long after expanding image tokens: 9 >= 8", status_code=400
)


class Chunks:
    """An async generator's interface over a script of chunks and exceptions; remembers closing."""

    def __init__(self, *script):
        self.script = list(script)
        self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    async def aclose(self):
        self.closed = True


def completion_view() -> CompletionView:
    body = CompletionRequest(prompt="Hi", stream=True)
    return CompletionView("model", "id", TokenTexts(), body, ["Hi"])


FORMATS = {"native": NativeStreamFormat, "openai": completion_view}


async def events(response: StreamingResponse) -> list:
    out = []
    async for raw in response.body_iterator:
        payload = raw.decode().removeprefix("data: ").strip()
        out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def envelope(status_code: int, error_type: str, message: str) -> dict:
    return {"error": {"message": message, "type": error_type, "param": None, "code": status_code}}


@pytest.mark.parametrize("kind", FORMATS)
async def test_a_refusal_before_the_first_token_is_a_real_400(kind):
    chunks = Chunks(chunk("", REFUSED))
    response = await stream_response(chunks, FORMATS[kind]())
    assert isinstance(response, JSONResponse) and response.status_code == 400
    assert json.loads(response.body) == envelope(400, "BadRequestError", REFUSED.message)
    assert chunks.closed


@pytest.mark.parametrize("kind", FORMATS)
async def test_a_client_error_before_the_first_chunk_propagates_to_the_handlers(kind):
    with pytest.raises(ClientError):
        await stream_response(Chunks(ClientError("temperature must be >= 0", "temperature")), FORMATS[kind]())


@pytest.mark.parametrize("kind", FORMATS)
async def test_a_400_after_the_first_token_is_an_error_event_typed_by_its_status(kind):
    chunks = Chunks(chunk("Hel"), chunk("", REFUSED))
    response = await stream_response(chunks, FORMATS[kind]())
    assert isinstance(response, StreamingResponse) and response.status_code == 200
    sent = await events(response)
    assert sent[-2:] == [envelope(400, "BadRequestError", REFUSED.message), "[DONE]"]
    assert len(sent) == 3 and "error" not in sent[0]
    assert chunks.closed


@pytest.mark.parametrize("kind", FORMATS)
async def test_a_dead_back_end_after_the_first_token_is_a_503_event(kind):
    response = await stream_response(Chunks(chunk("Hel"), BackendError("the scheduler died")), FORMATS[kind]())
    sent = await events(response)
    assert sent[-2:] == [envelope(503, "ServiceUnavailableError", "the scheduler died"), "[DONE]"]


async def test_a_failed_batch_item_is_named_in_the_native_message():
    failed = chunk("", REFUSED, index=1)
    response = await stream_response(Chunks(failed), NativeStreamFormat())
    assert json.loads(response.body)["error"]["message"] == f"item 1: {REFUSED.message}"
