"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Each request is translated into a native GenerateReqInput and served by the
TokenizerManager; its cumulative chunks are turned into OpenAI's responses or
stream deltas here.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluice.sampling import ClientError
from sluice.server.errors import NotFoundError, error_response, failure_status
from sluice.server.openai_protocol import ChatCompletionRequest, CompletionRequest, decode_request
from sluice.server.sse import SSE_DONE, sse_event
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import BackendError, TokenizerManager

if TYPE_CHECKING:
    from sluice.server.app import ServerState

# The native checks name SGLang's fields; the client wrote OpenAI's.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_PROMPT_PARAMS = {"text", "input_ids"}


def install_openai_routes(app: FastAPI, state: ServerState) -> None:
    token_texts = TokenTexts()

    def checked_tm(model: str | None) -> TokenizerManager:
        if reason := state.unavailable():
            raise BackendError(reason)
        if model and model != state.model_name:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        token_texts.bind(state.tm.tokenizer)
        return state.tm

    @app.get("/v1/models")
    async def list_models():
        model = {"id": state.model_name, "object": "model", "created": 0, "owned_by": "sluice"}
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = decode_request(await request.body(), CompletionRequest)
        body.check()
        tm = checked_tm(body.model)
        prompt = body.single_prompt()
        wants_logprobs = body.logprobs is not None
        obj = GenerateReqInput(
            sampling_params=body.sampling_params(body.max_new_tokens),
            stream=body.stream,
            return_logprob=wants_logprobs,
            top_logprobs_num=body.logprobs or 0,
            logprob_start_len=0 if wants_logprobs and body.echo else -1,
            rid=uuid.uuid4().hex,
        )
        if isinstance(prompt, str):
            obj.text = prompt
        else:
            obj.input_ids = prompt
        view = CompletionView(state.model_name, obj.rid, token_texts, body, prompt)
        return await serve(tm, obj, request, view, "prompt")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = decode_request(await request.body(), ChatCompletionRequest)
        body.check()
        tm = checked_tm(body.model)
        input_ids = chat_prompt_ids(tm, body)
        max_new_tokens = body.requested_max_tokens
        if max_new_tokens is None:
            max_new_tokens = max(tm.context_len - len(input_ids), 0)
        obj = GenerateReqInput(
            input_ids=input_ids,
            sampling_params=body.sampling_params(max_new_tokens),
            stream=body.stream,
            return_logprob=body.logprobs,
            top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0,
            rid=uuid.uuid4().hex,
        )
        view = ChatView(state.model_name, obj.rid, token_texts, body)
        return await serve(tm, obj, request, view, "messages")


def chat_prompt_ids(tm: TokenizerManager, body: ChatCompletionRequest) -> list[int]:
    if tm.chat_template is None:
        raise ClientError("this model has no chat template; use /v1/completions", "messages")
    messages = body.template_messages()
    try:
        rendered = tm.chat_template.render(messages, add_generation_prompt=True)
    except ValueError as e:
        raise ClientError(str(e), "messages") from None
    # The template already wrote the special tokens (BOS, role markers) it wants.
    return tm.tokenizer(rendered, add_special_tokens=False).input_ids


async def serve(tm: TokenizerManager, obj: GenerateReqInput, request: Request, view: OpenAIView,
                prompt_param: str) -> Response:
    generator = tm.generate_request(obj, request)
    try:
        # Errors before the first chunk become a plain 4xx. A non-streaming request has
        # only its final chunk; reading on lets the generator finish and let go of its lock.
        first = await anext(generator)
        last = first if obj.stream else await _last(generator, first)
    except ClientError as e:
        raise openai_client_error(e, prompt_param) from None
    except StopAsyncIteration:
        return error_response(400, "the client disconnected")  # no one reads this
    if obj.stream:
        return StreamingResponse(stream_events(first, generator, view), media_type="text/event-stream")
    if status_code := failure_status(last):
        return error_response(status_code, last["meta_info"]["finish_reason"]["message"])
    return JSONResponse(view.response(last))


async def _last(generator: AsyncIterator[dict[str, Any]], first: dict[str, Any]) -> dict[str, Any]:
    last = first
    async for chunk in generator:
        last = chunk
    return last


def openai_client_error(e: ClientError, prompt_param: str) -> ClientError:
    message, param = e.message, e.param
    for native, openai in _OPENAI_NAMES.items():
        message = message.replace(native, openai)
    if param in _OPENAI_NAMES:
        param = _OPENAI_NAMES[param]
    elif param in _PROMPT_PARAMS:
        param = prompt_param
    return ClientError(message, param)


async def stream_events(first: dict[str, Any], rest: AsyncIterator[dict[str, Any]],
                        view: OpenAIView) -> AsyncIterator[bytes]:
    """One SSE event per chunk with something new; a back-end failure becomes an error event."""
    try:
        for event in view.stream_start():
            yield sse_event(event)
        chunk = first
        while True:
            if status_code := failure_status(chunk):
                message = chunk["meta_info"]["finish_reason"]["message"]
                yield sse_event({"error": {"message": message, "type": "ServiceUnavailableError", "code": status_code}})
                break
            for event in view.stream_chunk(chunk):
                yield sse_event(event)
            if chunk["meta_info"]["finish_reason"] is not None:
                break
            chunk = await anext(rest)
    except (BackendError, StopAsyncIteration) as e:
        message = str(e) or "the request ended without a final chunk"
        yield sse_event({"error": {"message": message, "type": "ServiceUnavailableError", "code": 503}})
    finally:
        await rest.aclose()  # aborts the request when the client went away mid-stream
    yield SSE_DONE


# ------------------------------------------------------------------ logprobs


class TokenTexts:
    """The text of single tokens, cached: logprobs name every token and its top alternatives."""

    def __init__(self):
        self._tokenizer = None
        self._texts: dict[int, str] = {}

    def bind(self, tokenizer) -> None:
        if tokenizer is not self._tokenizer:
            self._tokenizer, self._texts = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    def decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids)


@dataclass(slots=True)
class LogprobEntry:
    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


def logprob_entries(meta: dict[str, Any], kind: str, start: int = 0) -> list[LogprobEntry]:
    """kind "output" or "input": meta_info's `{kind}_token_logprobs[start:]` with their top alternatives."""
    tokens = (meta.get(f"{kind}_token_logprobs") or [])[start:]
    tops = (meta.get(f"{kind}_top_logprobs") or [])[start:]
    return [
        LogprobEntry(token_id, logprob, [(t[1], t[0]) for t in (tops[i] if i < len(tops) else [])])
        for i, (logprob, token_id, _) in enumerate(tokens)
    ]


def completion_logprobs(entries: list[LogprobEntry], texts: TokenTexts, first_offset: int) -> dict[str, Any]:
    """OpenAI's completions format; text_offset indexes the choice's text."""
    tokens, offsets, top_logprobs = [], [], []
    offset = first_offset
    for entry in entries:
        text = texts(entry.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry.logprob is None:
            top_logprobs.append(None)  # the first prompt token: nothing to condition on
            continue
        # Like OpenAI, the chosen token is always among its alternatives.
        top = {texts(token_id): logprob for token_id, logprob in entry.top}
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(entries: list[LogprobEntry], texts: TokenTexts, top_count: int) -> list[dict[str, Any]]:
    def token_info(token_id: int, logprob: float) -> dict[str, Any]:
        text = texts(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return [
        {**token_info(e.token_id, e.logprob), "top_logprobs": [token_info(t, lp) for t, lp in e.top[:top_count]]}
        for e in entries
    ]


# ------------------------------------------------------------------ responses


def usage(meta: dict[str, Any]) -> dict[str, Any]:
    prompt, completion = meta["prompt_tokens"], meta["completion_tokens"]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": meta.get("cached_tokens", 0)}}


def finish_reason(meta: dict[str, Any]) -> str | None:
    reason = meta["finish_reason"]
    return None if reason is None else reason["type"]  # "stop" | "length" | "abort", as OpenAI names them


class StreamCursor:
    """How much of a request's cumulative text and tokens the client has been sent."""

    def __init__(self):
        self.text_len = 0
        self.tokens_sent = 0

    def new_text(self, chunk: dict[str, Any]) -> str:
        text = chunk["text"][self.text_len :]
        self.text_len = max(self.text_len, len(chunk["text"]))
        return text

    def new_entries(self, chunk: dict[str, Any]) -> list[LogprobEntry]:
        entries = logprob_entries(chunk["meta_info"], "output", self.tokens_sent)
        self.tokens_sent += len(entries)
        return entries


class OpenAIView:
    """Shared by both routes: the response envelope of one request."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model_name: str, rid: str, texts: TokenTexts, include_usage: bool):
        self.model_name = model_name
        self.id = f"{self.id_prefix}-{rid}"
        self.created = int(time.time())
        self.texts = texts
        self.include_usage = include_usage
        self.cursor = StreamCursor()

    def envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model_name,
                "choices": choices}

    def stream_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        event = self.envelope(self.chunk_object_name, choices)
        if self.include_usage:
            event["usage"] = None  # OpenAI: every chunk but the last has a null usage
        return event

    def stream_end(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.include_usage or chunk["meta_info"]["finish_reason"] is None:
            return []
        return [{**self.envelope(self.chunk_object_name, []), "usage": usage(chunk["meta_info"])}]

    def stream_start(self) -> list[dict[str, Any]]:
        return []


class CompletionView(OpenAIView):
    chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model_name, rid, texts, body: CompletionRequest, prompt: str | list[int]):
        super().__init__(model_name, rid, texts, body.include_usage)
        self.wants_logprobs = body.logprobs is not None
        self.echo = body.echo
        self.prompt = prompt
        self.echo_pending = body.echo

    def prompt_text(self) -> str:
        # Token ids are decoded only now: the TokenizerManager has checked they are in the vocabulary.
        return self.prompt if isinstance(self.prompt, str) else self.texts.decode(self.prompt)

    def choice(self, text: str, entries: list[LogprobEntry], meta: dict[str, Any], echo: bool, offset: int):
        if echo:
            prompt_text = self.prompt_text()
            text = prompt_text + text
            entries = logprob_entries(meta, "input") + entries
        logprobs = completion_logprobs(entries, self.texts, offset) if self.wants_logprobs else None
        return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(meta)}

    def response(self, chunk: dict[str, Any]) -> dict[str, Any]:
        meta = chunk["meta_info"]
        choice = self.choice(chunk["text"], logprob_entries(meta, "output"), meta, self.echo, 0)
        return {**self.envelope("text_completion", [choice]), "usage": usage(meta)}

    def stream_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        meta = chunk["meta_info"]
        offset = self.cursor.text_len + (len(self.prompt_text()) if self.echo else 0)
        text, entries = self.cursor.new_text(chunk), self.cursor.new_entries(chunk)
        events = []
        if text or entries or self.echo_pending or meta["finish_reason"] is not None:
            choice = self.choice(text, entries, meta, self.echo_pending, 0 if self.echo_pending else offset)
            self.echo_pending = False
            events.append(self.stream_envelope([choice]))
        return events + self.stream_end(chunk)


class ChatView(OpenAIView):
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model_name, rid, texts, body: ChatCompletionRequest):
        super().__init__(model_name, rid, texts, body.include_usage)
        self.wants_logprobs = body.logprobs
        self.top_count = body.top_logprobs or 0

    def logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        return {"content": chat_logprobs(entries, self.texts, self.top_count)}

    def response(self, chunk: dict[str, Any]) -> dict[str, Any]:
        meta = chunk["meta_info"]
        choice = {"index": 0, "message": {"role": "assistant", "content": chunk["text"]},
                  "logprobs": self.logprobs(logprob_entries(meta, "output")), "finish_reason": finish_reason(meta)}
        return {**self.envelope("chat.completion", [choice]), "usage": usage(meta)}

    def stream_start(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return [self.stream_envelope([choice])]

    def stream_chunk(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        meta = chunk["meta_info"]
        text, entries = self.cursor.new_text(chunk), self.cursor.new_entries(chunk)
        events = []
        if text or entries or meta["finish_reason"] is not None:
            choice = {"index": 0, "delta": {"content": text} if text else {},
                      "logprobs": self.logprobs(entries) if entries else None, "finish_reason": finish_reason(meta)}
            events.append(self.stream_envelope([choice]))
        return events + self.stream_end(chunk)

