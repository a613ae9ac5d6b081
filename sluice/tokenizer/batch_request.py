"""The enlarged paths of a request (seed 000): a list of prompts, and n > 1.

A batch is not N single requests in a loop. Every item is checked before anything is
sent; then either all texts go through one tokenizer call and the Scheduler receives one
BatchTokenizedGenerateReqInput ("batch"), or, where the input does not allow that, each
item is tokenized and sent on its own ("batch_sequential").

Parallel sampling (n > 1) tokenizes each prompt once, sends it once with
max_new_tokens = 0 so its prefix lands in the RadixCache, then sends n children with new
rids; results carry index = prompt_index * n + sample_index. Aborting a parent rid aborts
its children: their rids are `parent::sample_index`, so the Scheduler aborts them by
prefix, whichever worker asks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from sluice.messages import (
    RID_SEPARATOR,
    BatchTokenizedGenerateReqInput,
    Message,
    TokenizedGenerateReqInput,
    TokenizedRequest,
)
from sluice.tokenizer.admission import check_fits_in_token_queue
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.req_state import ClientConnection, LiveRids, ReqState
from sluice.tokenizer.request_tokenizer import RequestTokenizer
from sluice.tokenizer.result import GenerateChunk


class RequestChannel(Protocol):
    """What the batch path uses of the TokenizerManager."""

    inputs: RequestTokenizer
    rid_to_state: dict[str, ReqState]
    live_rids: LiveRids

    def add_req_state(
        self, req: TokenizedRequest, path: str, index: int | None = None, log_metrics: bool = True
    ) -> ReqState: ...

    def send_new(self, messages: list[Message], states: list[ReqState]) -> None: ...

    def wait_response(
        self, state: ReqState, request: ClientConnection | None = None
    ) -> AsyncIterator[GenerateChunk]: ...


async def handle_batch_request(
    tm: RequestChannel, obj: GenerateReqInput, request: ClientConnection | None, received_at: float
) -> AsyncIterator[GenerateChunk]:
    """Yields every item's chunks, each tagged with its `index`, as they come: streaming,
    each with what is new; else one per item, with everything."""
    items = [obj.item(i) for i in range(obj.batch_size)] if not obj.is_single else [obj]
    n = obj.sample_count()
    tokenized = await tm.inputs.tokenize(items, tm.live_rids, label_items=not obj.is_single, received_at=received_at)
    # Every sample of a prompt is a request of its length in the Scheduler's queue.
    lens = [tm.inputs.expanded_length(t.input_ids, len(t.images)) for t in tokenized for _ in range(n)]
    param = "n" if n > 1 else obj.prompt_field
    check_fits_in_token_queue(lens, tm.inputs.server_args, param, one_replica=len(tokenized) == 1)
    if n == 1:
        path = "batch" if tm.inputs.can_send_as_one_batch(items) else "batch_sequential"
        async for chunk in _send_and_wait(tm, list(enumerate(tokenized)), path, request, obj.log_metrics):
            yield chunk
        return
    # The client's rids stay taken while their samples run (no await since they were checked).
    parents = {t.rid for t in tokenized}
    tm.live_rids.sampled |= parents
    try:
        async for chunk in _sample(tm, tokenized, n, request, obj.log_metrics):
            yield chunk
    finally:
        tm.live_rids.sampled -= parents


async def _sample(
    tm: RequestChannel,
    tokenized: list[TokenizedGenerateReqInput],
    n: int,
    request: ClientConnection | None,
    log_metrics: bool,
) -> AsyncIterator[GenerateChunk]:
    ends = await _warm_prefixes(tm, tokenized, request)
    if ends is None:
        return  # the client left during the warm-up, which was aborted
    path = "parallel_sample"
    children = []
    for index, child in _expand_samples(tokenized, n):
        end = ends[index // n]
        if end.finish_reason is not None and end.finish_reason.type == "abort":
            # The prompt's prefill was aborted (its parent rid) or refused: so are its
            # samples, which are never sent.
            # (With return_logprob, its logprob fields are there, empty, as for any request
            # that ended before its first token.)
            yield msgspec.structs.replace(
                end, rid=child.rid, path=path, index=index, return_logprob=child.return_logprob
            )
        else:
            children.append((index, child))
    if children:
        async for chunk in _send_and_wait(tm, children, path, request, log_metrics):
            yield chunk


async def _send_and_wait(
    tm: RequestChannel,
    children: list[tuple[int, TokenizedGenerateReqInput]],
    path: str,
    request: ClientConnection | None,
    log_metrics: bool = True,
) -> AsyncIterator[GenerateChunk]:
    states = [tm.add_req_state(t, path, index, log_metrics) for index, t in children]
    if path == "batch_sequential":
        tm.send_new([t for _, t in children], states)
    else:
        tm.send_new([BatchTokenizedGenerateReqInput(reqs=[t for _, t in children])], states)
    streams = [tm.wait_response(state, request) for state in states]
    async for chunk in merge_streams(streams):
        yield chunk


async def _warm_prefixes(
    tm: RequestChannel, tokenized: list[TokenizedGenerateReqInput], request: ClientConnection | None
) -> list[GenerateChunk] | None:
    """Prefill each prompt once so that its n children find it in the RadixCache. Returns
    each prompt's final warm-up chunk, or None when the client left before they all came."""
    warmups = []
    for t in tokenized:
        params = msgspec.structs.replace(t.sampling_params, max_new_tokens=0, min_new_tokens=0)
        warm = msgspec.structs.replace(
            t,
            rid=f"{t.rid}{RID_SEPARATOR}prefix",
            sampling_params=params,
            stream=False,
            return_logprob=False,
            top_logprobs_num=0,
            logprob_start_len=-1,
        )
        warmups.append((warm, tm.add_req_state(warm, "prefix_warmup")))
    tm.send_new([BatchTokenizedGenerateReqInput(reqs=[w for w, _ in warmups])], [state for _, state in warmups])
    ends: list[GenerateChunk] = []
    for _, state in warmups:
        async for chunk in tm.wait_response(state, request):
            if chunk.finished:
                ends.append(chunk)
    return ends if len(ends) == len(warmups) else None


def _expand_samples(tokenized: list[TokenizedGenerateReqInput], n: int) -> list[tuple[int, TokenizedGenerateReqInput]]:
    children: list[tuple[int, TokenizedGenerateReqInput]] = []
    for prompt_index, t in enumerate(tokenized):
        for sample_index in range(n):
            seed = t.sampling_params.seed
            # Distinct seeds, or every sample of a seeded request would be the same.
            params = msgspec.structs.replace(t.sampling_params, seed=None if seed is None else seed + sample_index)
            child = msgspec.structs.replace(t, rid=f"{t.rid}{RID_SEPARATOR}{sample_index}", sampling_params=params)
            children.append((prompt_index * n + sample_index, child))
    return children


async def merge_streams(streams: list[AsyncIterator[GenerateChunk]]) -> AsyncIterator[GenerateChunk]:
    """Interleave several generators' chunks as they come. Closing the merged stream
    cancels the rest, and each generator's cleanup aborts its request."""
    # Each stream's chunks, then its exception if it raised one, then None.
    queue: asyncio.Queue[GenerateChunk | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[GenerateChunk]) -> None:
        try:
            async for chunk in stream:
                await queue.put(chunk)
        except BaseException as e:  # noqa: BLE001 (handed to the consumer, who re-raises it)
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
