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
from typing import TYPE_CHECKING, Any

import msgspec

from sluice.messages import BatchTokenizedGenerateReqInput, TokenizedGenerateReqInput
from sluice.sampling import ClientError
from sluice.tokenizer.io_struct import GenerateReqInput

if TYPE_CHECKING:
    from sluice.tokenizer.manager import TokenizerManager


async def handle_batch_request(tm: TokenizerManager, obj: GenerateReqInput, request) -> AsyncIterator[dict[str, Any]]:
    """Yields chunks tagged with `index`: all of them when streaming, else each item's last."""
    items = [obj.item(i) for i in range(obj.batch_size)] if not obj.is_single else [obj]
    n = obj.sample_count()
    images = await asyncio.gather(*(tm._process_images(item) for item in items))
    tokenized = _tokenize_all(tm, items, images)
    if n == 1:
        path = "batch" if _can_send_as_one_batch(tm, items) else "batch_sequential"
        children = [(i, t) for i, t in enumerate(tokenized)]
    else:
        await _warm_prefixes(tm, tokenized, request)
        path = "parallel_sample"
        children = _expand_samples(tokenized, n)
    states = [tm._init_req_state(_child_obj(obj, t), {"path": path, "index": index}) for index, t in children]
    if path == "batch_sequential":
        for _, t in children:
            tm._send_one_request(t)
    else:
        tm._send_to_scheduler(BatchTokenizedGenerateReqInput(reqs=[t for _, t in children]))
    streams = [tm._wait_one_response(state, request) for state in states]
    async for chunk in merge_streams(streams):
        chunk["index"] = chunk["meta_info"]["index"]
        yield chunk


def _tokenize_all(tm: TokenizerManager, items: list[GenerateReqInput], images: list[list]) -> list[TokenizedGenerateReqInput]:
    """Tokenize and validate every item; the first bad one fails the whole request."""
    texts = [tm.mm_processor.prompt_with_placeholders(item.text, len(imgs)) if imgs else item.text
             for item, imgs in zip(items, images) if item.input_ids is None]
    # One tokenizer call for all texts: the fast tokenizer encodes a list in parallel Rust.
    encoded = iter(tm.tokenizer(texts).input_ids) if texts else iter(())
    tokenized = []
    seen: set[str] = set()
    for i, item in enumerate(items):
        if item.rid in seen or item.rid in tm.rid_to_state:
            raise ClientError(f"item {i}: a request with rid '{item.rid}' is already running", "rid")
        seen.add(item.rid)
        ids = list(item.input_ids) if item.input_ids is not None else next(encoded)
        try:
            tokenized.append(tm._tokenize_one_request(item, input_ids=ids, images=images[i]))
        except ClientError as e:
            raise ClientError(f"item {i}: {e.message}", e.param) from None
    return tokenized


def _can_send_as_one_batch(tm: TokenizerManager, items: list[GenerateReqInput]) -> bool:
    # Items that carry images are sent one by one: each has its own pixel payload and
    # expansion in the Scheduler, and a mixed batch must not hold text items back behind
    # image work. A slow (Python) tokenizer gains nothing from one call either.
    return getattr(tm.tokenizer, "is_fast", False) and not any(item.image_data for item in items)


async def _warm_prefixes(tm: TokenizerManager, tokenized: list[TokenizedGenerateReqInput], request) -> None:
    """Prefill each prompt once so that its n children find it in the RadixCache."""
    warmups = []
    for t in tokenized:
        params = msgspec.structs.replace(t.sampling_params, max_new_tokens=0, min_new_tokens=0)
        warm = msgspec.structs.replace(t, rid=f"{t.rid}::prefix", sampling_params=params,
                                       stream=False, return_logprob=False, top_logprobs_num=0, logprob_start_len=-1)
        state = tm._init_req_state(GenerateReqInput(input_ids=[], rid=warm.rid), {"path": "prefix_warmup"})
        warmups.append((warm, state))
    tm._send_to_scheduler(BatchTokenizedGenerateReqInput(reqs=[w for w, _ in warmups]))
    for _, state in warmups:
        async for _ in tm._wait_one_response(state, request):
            pass


def _expand_samples(tokenized: list[TokenizedGenerateReqInput], n: int) -> list[tuple[int, TokenizedGenerateReqInput]]:
    children: list[tuple[int, TokenizedGenerateReqInput]] = []
    for prompt_index, t in enumerate(tokenized):
        for sample_index in range(n):
            seed = t.sampling_params.seed
            # Distinct seeds, or every sample of a seeded request would be the same.
            params = msgspec.structs.replace(t.sampling_params, seed=None if seed is None else seed + sample_index)
            child = msgspec.structs.replace(t, rid=f"{t.rid}::{sample_index}", sampling_params=params)
            children.append((prompt_index * n + sample_index, child))
    return children


def _child_obj(obj: GenerateReqInput, t: TokenizedGenerateReqInput) -> GenerateReqInput:
    return GenerateReqInput(input_ids=[], rid=t.rid, stream=obj.stream, return_logprob=obj.return_logprob)


async def merge_streams(streams: list[AsyncIterator[dict[str, Any]]]) -> AsyncIterator[dict[str, Any]]:
    """Interleave several generators' chunks as they come. Closing the merged stream
    cancels the rest, and each generator's cleanup aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream):
        try:
            async for chunk in stream:
                await queue.put(chunk)
        except BaseException as e:  # handed to the consumer, who re-raises it
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    remaining = len(tasks)
    try:
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
