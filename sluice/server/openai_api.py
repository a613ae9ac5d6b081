"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, and
/tokenize and /detokenize as SGLang's and vLLM's OpenAI servers have them.

Each request is translated into a native GenerateReqInput and served by the
TokenizerManager; openai_views turns its cumulative chunks into OpenAI's
responses or stream deltas. A list of prompts and n > 1 take the native batch
and parallel-sampling paths.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Final

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from sluice.grammar import GRAMMAR_FIELDS
from sluice.sampling import ClientError
from sluice.server.api_types import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResult,
    EmbeddingResponse,
    ModelCard,
    ModelList,
    TokenizeResult,
)
from sluice.server.client_watch import ClientWatch
from sluice.server.embeddings import embedding_chunks, openai_response
from sluice.server.errors import NotFoundError, error_response, failure_response, finals_until_failure
from sluice.server.json_body import decode_json
from sluice.server.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    TokenizeRequest,
)
from sluice.server.openai_views import ChatView, CompletionView, OpenAIView, choice_index
from sluice.server.openapi import ApiDocs
from sluice.server.sse import stream_response
from sluice.server.state import ServerState
from sluice.server.tool_calls import (
    default_parser,
    forced_schema,
    strict_calls_tag,
    template_knows_tools,
    with_tools_in_text,
)
from sluice.tokenizer.control import BackendError
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.manager import TokenizerManager

# The native checks name SGLang's fields; the client wrote OpenAI's.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_PROMPT_PARAMS = {"text", "input_ids"}
_ERRORS = (400, 401, 403, 404, 413, 415, 503)  # 403, 415: RequestGuard's refusals of a POST


def install_openai_routes(app: FastAPI, state: ServerState, docs: ApiDocs) -> None:
    def checked_tm(model: str | None) -> TokenizerManager:
        # As on the native routes: refused while starting or once the back end is gone, not
        # for what /health reports besides (another HTTP worker died: this one serves on).
        if state.tm.backend_error:
            raise BackendError(state.tm.backend_error)
        if model and model != state.model_name:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")
        return state.tm

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": int(time.time()),  # as SGLang and vLLM write it
            "owned_by": "sluice",
            "max_model_len": state.tm.context_len,
        }

    @app.get("/v1/models", openapi_extra=docs.operation(response=ModelList, errors=(401,)))
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", openapi_extra=docs.operation(response=ModelCard, errors=(401, 404)))
    async def retrieve_model(model_id: str):
        """The served model's card (the SDK's models.retrieve); any other id is a 404."""
        if model_id != state.model_name:
            raise NotFoundError(f"The model `{model_id}` does not exist.", "model")
        return model_card()

    @app.post(
        "/v1/completions",
        openapi_extra=docs.operation(
            body=CompletionRequest, response=CompletionResponse, stream_event=CompletionChunk, errors=_ERRORS
        ),
    )
    async def completions(request: Request):
        body = decode_json(await request.body(), CompletionRequest)
        body.check()
        tm = checked_tm(body.model)
        prompts = body.prompts()
        wants_logprobs = body.logprobs is not None
        request_id = uuid.uuid4().hex
        obj = GenerateReqInput(
            sampling_params=body.sampling_params(body.max_new_tokens),
            stream=body.stream,
            return_logprob=wants_logprobs,
            top_logprobs_num=body.logprobs or 0,
            logprob_start_len=0 if wants_logprobs and body.echo else -1,
            priority=body.priority,
            rid=request_id if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))],
        )
        if isinstance(prompts[0], str):
            obj.text = prompts[0] if len(prompts) == 1 else prompts
        else:
            obj.input_ids = [*prompts[0]] if len(prompts) == 1 else [*prompts]
        view = CompletionView(state.model_name, request_id, state.token_texts, body, prompts)
        return await serve(tm, obj, request, view, "prompt", body.grammar_names)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=docs.operation(
            body=ChatCompletionRequest,
            response=ChatCompletionResponse,
            stream_event=ChatCompletionChunk,
            errors=_ERRORS,
        ),
    )
    async def chat_completions(request: Request):
        body = decode_json(await request.body(), ChatCompletionRequest)
        body.check()
        tm = checked_tm(body.model)
        input_ids, image_urls = await chat_prompt_ids(tm, body, state.model_name)
        max_new_tokens = body.requested_max_tokens
        if max_new_tokens is None:
            max_new_tokens = max(tm.context_len - tm.inputs.expanded_length(input_ids, len(image_urls)), 0)
        sampling_params = body.sampling_params(max_new_tokens)
        parameters = {tool.function.name: tool.function.parameters for tool in body.tools_offered}
        strict = {tool.function.name for tool in body.tools_offered if tool.function.strict}
        constrained = any(field in sampling_params for field in GRAMMAR_FIELDS)
        if forced := body.forced_functions:
            if constrained:
                raise ClientError("tool_choice forces a tool call: leave out response_format", "tool_choice")
            parallel = body.parallel_tool_calls is not False and body.tool_choice == "required"
            sampling_params["json_schema"] = forced_schema(parameters, forced, parallel)
        elif strict:
            if constrained:
                raise ClientError("tools marked strict hold the calls to a grammar: leave out response_format", "tools")
            parser = tool_call_parser(tm)
            newlines = template_knows_tools(tm.chat_template.source if tm.chat_template is not None else None)
            sampling_params["structural_tag"] = strict_calls_tag(parameters, strict, parser, newlines)
        obj = GenerateReqInput(
            input_ids=[*input_ids],
            sampling_params=sampling_params,
            stream=body.stream,
            return_logprob=body.logprobs,
            top_logprobs_num=(body.top_logprobs or 0) if body.logprobs else 0,
            rid=uuid.uuid4().hex,
            image_data=[*image_urls] or None,
            priority=body.priority,
        )
        view = ChatView(
            state.model_name, obj.rid, state.token_texts, body, tool_call_parser(tm), tm.server_args.reasoning_parser
        )
        # Errors name the fields the client set: the newer name of the limit, the tools
        # whose parameters gave the grammar.
        limit = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        names = {**body.grammar_names, "max_new_tokens": limit}
        if forced or strict:
            names.update(json_schema="tools", structural_tag="tools")
        return await serve(tm, obj, request, view, "messages", names)

    @app.post(
        "/v1/embeddings",
        openapi_extra=docs.operation(body=EmbeddingRequest, response=EmbeddingResponse, errors=_ERRORS),
    )
    async def embeddings(request: Request):
        body = decode_json(await request.body(), EmbeddingRequest)
        tm = checked_tm(body.model)
        try:
            obj = body.native(tm.limits.embedding_dim)
            chunks = await embedding_chunks(tm, obj, request)
        except ClientError as e:
            raise openai_client_error(e, "input") from None
        if isinstance(chunks, Response):
            return chunks
        return openai_response(chunks, state.model_name, body.encoding_format)

    @app.post("/tokenize", openapi_extra=docs.operation(body=TokenizeRequest, response=TokenizeResult, errors=_ERRORS))
    async def tokenize(request: Request):
        body = decode_json(await request.body(), TokenizeRequest)
        body.check()
        tm = checked_tm(body.model)

        if body.prompt is not None:
            prompt, given_as = body.prompt, "prompt"
        else:
            prompt, given_as = (await asyncio.to_thread(chat_prompt, tm, body.chat(), state.model_name))[0], "messages"
        # Counted up to the context length, as /generate counts up to its input limit: a
        # 14 MB text took the process 1.7 GB and 10 s (four at once: 7 GB).
        [encoded] = await tm.inputs.encode([prompt], body.special_tokens, limit=tm.context_len)
        if isinstance(encoded, int):
            raise ClientError(
                f"The input has at least {encoded:,} tokens, more than the context length max_model_len="
                f"{tm.context_len}: /tokenize counts prompts the model can take",
                given_as,
            )
        return {"tokens": encoded, "count": len(encoded), "max_model_len": tm.context_len}

    @app.post(
        "/detokenize", openapi_extra=docs.operation(body=DetokenizeRequest, response=DetokenizeResult, errors=_ERRORS)
    )
    async def detokenize(request: Request):
        body = decode_json(await request.body(), DetokenizeRequest)
        tm = checked_tm(body.model)
        vocab_size = len(tm.tokenizer)
        if (bad := next((token for token in body.tokens if not 0 <= token < vocab_size), None)) is not None:
            raise ClientError(f"tokens must be token ids in [0, {vocab_size}), got {bad}", "tokens")
        return {"text": await asyncio.to_thread(tm.tokenizer.decode, body.tokens)}


# Put after the last message's text where continue_final_message cuts the prompt: looking for
# the text itself found it again in what the template writes after it ("end" in <|im_end|>).
# Its space tells whether the template trimmed the message, as transformers marks it.
_CONTINUE_TAG: Final = "SLUICE_CONTINUE_FINAL_MESSAGE "


def _continued(rendered: str) -> str:
    """The prompt cut right after the last message's text (marked with _CONTINUE_TAG), so the
    model goes on with it: what the template writes after it, its end-of-turn marker, is
    dropped, and where the template trims a message, its trailing whitespace too."""
    at = rendered.rfind(_CONTINUE_TAG.strip())
    if at < 0:
        raise ClientError("the chat template does not write the last message's text", "continue_final_message")
    return rendered[:at] if rendered.startswith(_CONTINUE_TAG, at) else rendered[:at].rstrip()


def tool_call_parser(tm: TokenizerManager) -> str:
    chosen = tm.server_args.tool_call_parser
    if chosen != "auto":
        return chosen
    return default_parser(tm.chat_template.source if tm.chat_template is not None else None)


async def chat_prompt_ids(
    tm: TokenizerManager, body: ChatCompletionRequest, model_name: str
) -> tuple[list[int], list[str]]:
    """The prompt's token ids (one image token per image) and the image URLs in order; a
    prompt far longer than the model takes is refused before all of it is tokenized."""
    rendered, image_urls = chat_prompt(tm, body, model_name)
    # The template already wrote the special tokens (BOS, role markers) it wants.
    [encoded] = await tm.inputs.encode([rendered], add_special_tokens=False)
    return tm.inputs.whole(encoded, "messages"), image_urls


def chat_prompt(tm: TokenizerManager, body: ChatCompletionRequest, model_name: str) -> tuple[str, list[str]]:
    """The prompt as the chat template renders it (one image token per image) and the image
    URLs in order."""
    if tm.chat_template is None:
        raise ClientError("this model has no chat template; use /v1/completions", "messages")
    image_token = tm.mm_processor.image_token if tm.mm_processor is not None else None
    messages, image_urls = body.template_messages(image_token, model_name)
    template_kwargs = dict(body.chat_template_kwargs or {})
    tools = [msgspec.to_builtins(tool) for tool in body.tools or []]
    if tools and template_knows_tools(tm.chat_template.source):
        # With tool_choice "none" too, as vLLM and OpenAI: the model still sees the tools
        # (nothing is read as a call); only sluice's own tools block is left out then.
        template_kwargs["tools"] = tools
    else:
        offered = tools if body.tools_offered else []
        if offered or any("tool_calls" in message for message in messages):
            messages = with_tools_in_text(messages, offered)
    if body.continue_final_message:
        messages[-1]["content"] += _CONTINUE_TAG
    try:
        rendered = tm.chat_template.render(
            messages, add_generation_prompt=body.add_generation_prompt, **template_kwargs
        )
    except ValueError as e:
        raise ClientError(str(e), "messages") from None
    if body.continue_final_message:
        rendered = _continued(rendered)
    return rendered, image_urls


async def serve(
    tm: TokenizerManager,
    obj: GenerateReqInput,
    request: Request,
    view: OpenAIView,
    prompt_param: str,
    names: dict[str, str] | None = None,
) -> Response:
    generator = tm.generate_request(obj, ClientWatch(request))
    openai_names = {**_OPENAI_NAMES, **(names or {})}
    try:
        if obj.stream:
            return await stream_response(generator, view, openai_names)  # the rule for errors on streams
        # One final chunk per choice; the generator lets go of its lock once they are read.
        finals, failed = await finals_until_failure(generator)
    except ClientError as e:
        raise openai_client_error(e, prompt_param, names) from None
    if failed is not None:
        return failure_response(failed, view.error_message(failed), openai_names)
    if not finals:
        return error_response(400, "the client disconnected")  # no one reads this
    finals.sort(key=choice_index)
    return JSONResponse(view.response(finals))


def openai_client_error(e: ClientError, prompt_param: str, names: dict[str, str] | None = None) -> ClientError:
    """A native route's error in the OpenAI request's own names: `prompt_param` for the
    prompt (text or input_ids), `names` over _OPENAI_NAMES for the rest."""
    names = {**_OPENAI_NAMES, **(names or {})}
    message, param = e.message, e.param
    for native, openai in names.items():
        message = message.replace(native, openai, 1)  # ours comes first; not a schema quoted after it
    if param in names:
        param = names[param]
    elif param in _PROMPT_PARAMS:
        param = prompt_param
        message = message.replace("input_ids", prompt_param)
        if prompt_param not in message:
            message = f"{prompt_param}: {message}"  # e.g. too many prompts
    return ClientError(message, param)
