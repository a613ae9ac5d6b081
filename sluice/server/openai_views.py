"""How native chunks become OpenAI's JSON: whole responses, stream deltas, logprobs, usage.

A view belongs to one request. Choice k is the native chunk with index k
(prompt_index * n + sample_index). A chunk carries what is new since that choice's
previous chunk, so a stream delta is the chunk itself.
"""

from __future__ import annotations

import time
from typing import Any

from sluice.server.errors import failure_message
from sluice.server.logprobs import (
    LogprobEntry,
    TextOffsets,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
    logprob_entries,
)
from sluice.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from sluice.server.reasoning import split_reasoning
from sluice.server.tool_calls import ToolCall, forced_calls, may_start_call, parse_tool_calls
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.result import GenerateChunk


def choice_index(chunk: GenerateChunk) -> int:
    return 0 if chunk.index is None else chunk.index  # the native single path (one prompt, n = 1) sets none


# ------------------------------------------------------------------ responses


def finish_reason(chunk: GenerateChunk) -> str | None:
    """Why a choice ended, in OpenAI's names: "stop" or "length". OpenAI has no name for a
    request aborted on the server (/abort_request), so that one ends as an error: 503, as
    when the back end is lost (a response, or the stream's error event)."""
    reason = chunk.finish_reason
    if reason is None:
        return None
    if reason.type == "abort":
        raise BackendError("the request was aborted on the server")
    return reason.type


class OpenAIView:
    """Shared by both routes: the response envelope of one request, its choices and usage."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(
        self, model_name: str, request_id: str, texts: TokenTexts, include_usage: bool, prompt_count: int, n: int
    ):
        self.model_name = model_name
        self.id = f"{self.id_prefix}-{request_id}"
        self.created = int(time.time())
        self.texts = texts
        self.include_usage = include_usage
        self.n = n
        self.choice_count = prompt_count * n
        self.finished_chunks: dict[int, GenerateChunk] = {}

    @property
    def finished(self) -> bool:
        return len(self.finished_chunks) == self.choice_count

    def envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model_name,
            "choices": choices,
        }

    def usage(self, finals: dict[int, GenerateChunk]) -> dict[str, Any]:
        """Completion tokens of every choice; prompt tokens of every prompt once, as OpenAI counts them."""
        prompt_finals: dict[int, GenerateChunk] = {}
        for index in sorted(finals):
            prompt_finals.setdefault(index // self.n, finals[index])
        prompt = sum(chunk.prompt_tokens for chunk in prompt_finals.values())
        cached = sum(chunk.cached_tokens for chunk in prompt_finals.values())
        completion = sum(chunk.completion_tokens for chunk in finals.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def error_message(self, chunk: GenerateChunk) -> str:
        message = failure_message(chunk)
        return message if self.choice_count == 1 else f"choice {choice_index(chunk)}: {message}"

    def response(self, finals: list[GenerateChunk]) -> dict[str, Any]:
        """The whole response from each choice's final chunk, in index order."""
        choices = [self.final_choice(choice_index(chunk), chunk) for chunk in finals]
        by_index = {choice_index(chunk): chunk for chunk in finals}
        return {**self.envelope(self.object_name, choices), "usage": self.usage(by_index)}

    def stream_start(self) -> list[dict[str, Any]]:
        return []

    def stream_chunk(self, chunk: GenerateChunk) -> list[dict[str, Any]]:
        """The events for one chunk of one choice; after the last choice's end, the usage."""
        index = choice_index(chunk)
        events = [self.stream_envelope([choice]) for choice in self.stream_choices(index, chunk)]
        if chunk.finished:
            self.finished_chunks[index] = chunk
            if self.finished and self.include_usage:
                events.append({**self.envelope(self.chunk_object_name, []), "usage": self.usage(self.finished_chunks)})
        return events

    def stream_envelope(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        event = self.envelope(self.chunk_object_name, choices)
        if self.include_usage:
            event["usage"] = None  # OpenAI: every chunk but the last has a null usage
        return event

    def final_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any]:
        raise NotImplementedError

    def stream_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any] | None:
        """The delta of one choice, or None when the chunk brings nothing new."""
        raise NotImplementedError

    def stream_choices(self, index: int, chunk: GenerateChunk) -> list[dict[str, Any]]:
        """The deltas one chunk of one choice makes (each its own event)."""
        choice = self.stream_choice(index, chunk)
        return [] if choice is None else [choice]


class CompletionView(OpenAIView):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model_name, request_id, texts, body: CompletionRequest, prompts: list[str] | list[list[int]]):
        super().__init__(model_name, request_id, texts, body.include_usage, len(prompts), body.sample_count)
        self.wants_logprobs = body.logprobs is not None
        self.echo = body.echo
        self.prompts = prompts
        self.prompt_texts: dict[int, str] = {}
        # Per choice, made when its first chunk comes (a view is made before `n` is checked:
        # nothing here may grow with it). Where each choice's next token starts, as
        # text_offset counts it (the tokens before it): text held back from the stream (a
        # possible stop string) counts too.
        self.stream_offsets: dict[int, TextOffsets] = {}
        # The output's text leaves skipped special tokens out and spaces standalone ones (asked
        # for only with logprobs: text_offset counts by them).
        self.roles = (
            texts.special_token_roles(
                body.skip_special_tokens is not False, body.spaces_between_special_tokens is not False
            )
            if self.wants_logprobs
            else None
        )
        self.strips_first_space = self.wants_logprobs and texts.strips_first_space

    def prompt_text(self, index: int) -> str:
        prompt_index = index // self.n
        if prompt_index not in self.prompt_texts:
            # Token ids are decoded only now: the TokenizerManager has checked they are in the vocabulary.
            prompt = self.prompts[prompt_index]
            self.prompt_texts[prompt_index] = prompt if isinstance(prompt, str) else self.texts.decode(prompt)
        return self.prompt_texts[prompt_index]

    def choice(
        self, index: int, text: str, entries: list[LogprobEntry], chunk: GenerateChunk, echo: bool, offsets: TextOffsets
    ) -> dict[str, Any]:
        prompt_entries = logprob_entries(chunk, "input") if echo else []
        prompt_text = self.prompt_text(index) if echo else ""
        logprobs = (
            completion_logprobs(prompt_entries + entries, self.texts, offsets, len(prompt_entries), prompt_text)
            if self.wants_logprobs
            else None
        )
        text = prompt_text + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason(chunk)}

    def final_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any]:
        return self.choice(
            index,
            chunk.text,
            logprob_entries(chunk, "output"),
            chunk,
            self.echo,
            TextOffsets(self.roles, self.strips_first_space, chunk.continues_prompt),
        )

    def stream_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any] | None:
        echo = self.echo and index not in self.stream_offsets  # the prompt goes before the first chunk
        entries = logprob_entries(chunk, "output")
        if not (chunk.text or entries or echo or chunk.finished):
            return None
        offsets = self.stream_offsets.get(index)
        if offsets is None:
            offsets = self.stream_offsets[index] = TextOffsets(
                self.roles, self.strips_first_space, chunk.continues_prompt
            )
        return self.choice(index, chunk.text, entries, chunk, echo, offsets)


class ChatView(OpenAIView):
    """Chat responses. With `--reasoning-parser`, the thinking goes to `reasoning_content`.
    With tools offered, calls are read out of the answer: a forced call (tool_choice
    'required' or named) is the whole answer, held back until it ends; with 'auto', text
    streams until a call may begin, and the rest waits for the end."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(
        self,
        model_name,
        request_id,
        texts,
        body: ChatCompletionRequest,
        tool_call_parser: str = "hermes",
        reasoning_parser: str = "none",
    ):
        super().__init__(model_name, request_id, texts, body.include_usage, 1, body.sample_count)
        self.wants_logprobs = body.logprobs
        self.top_count = body.top_logprobs or 0
        self.forced = bool(body.forced_functions)
        # OpenAI ends a call of a named function with "stop", one that "required" forced with "tool_calls".
        self.forced_finish = "tool_calls" if body.tool_choice == "required" else "stop"
        self.known_tools = {tool.function.name for tool in body.tools_offered}
        self.one_call = body.parallel_tool_calls is False  # calls after the first are dropped, as vLLM does
        self.parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.text: dict[int, str] = {}  # each choice's text so far
        self.reasoning_sent: dict[int, int] = {}  # how much of its reasoning went out
        self.sent: dict[int, int] = {}  # how much of its content went out

    def logprobs(self, entries: list[LogprobEntry]) -> dict[str, Any] | None:
        if not self.wants_logprobs:
            return None
        return {"content": chat_logprobs(entries, self.texts, self.top_count)}

    def answer(self, text: str, chunk: GenerateChunk) -> tuple[str, str | None, list[ToolCall], str | None]:
        """(reasoning, content, tool calls, finish reason) of a whole answer."""
        reasoning, text, _ = split_reasoning(text, self.reasoning_parser)
        reason = finish_reason(chunk)
        if self.forced:
            calls = forced_calls(text) if reason == "stop" else None
            if calls is not None:
                return reasoning, None, calls, self.forced_finish
            return reasoning, text, [], reason  # cut short (length, a stop string): no complete call to give
        if self.known_tools:
            content, calls = parse_tool_calls(text, self.parser, self.known_tools)
            if calls:
                return reasoning, content or None, calls[:1] if self.one_call else calls, "tool_calls"
        return reasoning, text, [], reason

    def final_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any]:
        reasoning, content, calls, reason = self.answer(chunk.text, chunk)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning_parser != "none":
            message["reasoning_content"] = reasoning or None
        if calls:
            message["tool_calls"] = [call.as_dict() for call in calls]
        return {
            "index": index,
            "message": message,
            "logprobs": self.logprobs(logprob_entries(chunk, "output")),
            "finish_reason": reason,
        }

    def stream_start(self) -> list[dict[str, Any]]:
        return [
            self.stream_envelope(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
            for index in range(self.choice_count)
        ]

    def stream_choice(self, index: int, chunk: GenerateChunk) -> dict[str, Any] | None:
        text, entries = chunk.text, logprob_entries(chunk, "output")
        if not (text or entries or chunk.finished):
            return None
        return {
            "index": index,
            "delta": {"content": text} if text else {},
            "logprobs": self.logprobs(entries) if entries else None,
            "finish_reason": finish_reason(chunk),
        }

    def stream_choices(self, index: int, chunk: GenerateChunk) -> list[dict[str, Any]]:
        if not (self.forced or self.known_tools or self.reasoning_parser != "none"):
            return super().stream_choices(index, chunk)
        text = self.text[index] = self.text.get(index, "") + chunk.text
        entries = logprob_entries(chunk, "output")
        logprobs = self.logprobs(entries) if entries else None
        reasoning, content, _ = split_reasoning(text, self.reasoning_parser, final=chunk.finished)
        delta: dict[str, Any] = {}
        reasoning_sent = self.reasoning_sent.get(index, 0)
        if len(reasoning) > reasoning_sent:
            delta["reasoning_content"] = reasoning[reasoning_sent:]
            self.reasoning_sent[index] = len(reasoning)
        sent = self.sent.get(index, 0)
        if not chunk.finished:
            safe = sent if self.forced else self._may_send(content, sent)
            if safe > sent:
                delta["content"] = content[sent:safe]
                self.sent[index] = safe
            if not (delta or entries):
                return []
            return [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        _, final_content, calls, reason = self.answer(text, chunk)
        # What was sent is the start of the whole answer's content (parse_tool_calls keeps
        # what _may_send lets out): the rest goes out now.
        final_content, already = final_content or "", content[:sent]
        if final_content.startswith(already) and len(final_content) > len(already):
            delta["content"] = final_content[len(already) :]
        choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
        for position, call in enumerate(calls):
            whole = call.as_dict(position)
            arguments = whole["function"].pop("arguments")
            whole["function"]["arguments"] = ""
            choices.append({"index": index, "delta": {"tool_calls": [whole]}, "logprobs": None, "finish_reason": None})
            fragment = {"index": position, "function": {"arguments": arguments}}
            choices.append(
                {"index": index, "delta": {"tool_calls": [fragment]}, "logprobs": None, "finish_reason": None}
            )
        choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return choices

    def _may_send(self, content: str, sent: int) -> int:
        """How much of the content can go out while a call may still come."""
        if not self.known_tools:
            return len(content)
        if self.parser == "llama3":
            stripped = content.lstrip()
            return sent if not stripped or stripped[0] in "{<" else len(content)
        # Whitespace before a call waits with it: the whole answer's content around calls is
        # stripped, so what went out must not end in whitespace the answer drops.
        safe = may_start_call(content)
        while safe > sent and content[safe - 1].isspace():
            safe -= 1
        return safe
