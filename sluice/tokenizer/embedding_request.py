"""The embedding path (seed 003's EmbeddingReqInput): every prompt of a request is
tokenized in one call, sent to the Scheduler in one message, and answered with one final
chunk that carries its pooled vector (BatchEmbeddingOutput through the same handle_loop).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sluice.messages import BatchTokenizedEmbeddingReqInput
from sluice.tokenizer.batch_request import RequestChannel, merge_streams
from sluice.tokenizer.io_struct import EmbeddingReqInput
from sluice.tokenizer.req_state import ClientConnection
from sluice.tokenizer.result import GenerateChunk


async def handle_embedding_request(
    tm: RequestChannel, obj: EmbeddingReqInput, request: ClientConnection | None, received_at: float
) -> AsyncIterator[GenerateChunk]:
    """One chunk per prompt, as each ends; a list's chunks carry their `index`."""
    tokenized = await tm.inputs.tokenize_embeddings(obj, tm.live_rids, received_at)
    single = obj.is_single
    states = [tm.add_req_state(t, "embedding", None if single else i) for i, t in enumerate(tokenized)]
    tm.send_new([tokenized[0] if single else BatchTokenizedEmbeddingReqInput(reqs=tokenized)], states)
    async for chunk in merge_streams([tm.wait_response(state, request) for state in states]):
        yield chunk
