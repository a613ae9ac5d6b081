"""The batch path without a server: how a list of prompts and n > 1 are sent to the
Scheduler, and how the items' streams are merged (merge_streams)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import ClassVar

import pytest

from sluice.config import ServerArgs
from sluice.messages import BatchTokenizedGenerateReqInput, FinishReason, Message, SchedulerReady
from sluice.messages import TokenizedGenerateReqInput as Tokenized
from sluice.sampling import ClientError
from sluice.tokenizer.batch_request import handle_batch_request, merge_streams
from sluice.tokenizer.io_struct import GenerateReqInput
from sluice.tokenizer.req_state import ClientConnection, LiveRids, ReqState
from sluice.tokenizer.request_tokenizer import RequestTokenizer
from sluice.tokenizer.result import GenerateChunk


def chunk(rid: str, text: str, index: int | None = None, finished: bool = False, path: str = "batch") -> GenerateChunk:
    reason = FinishReason(type="length") if finished else None
    return GenerateChunk(rid=rid, path=path, index=index, text=text, output_ids=[], finish_reason=reason)


# ------------------------------------------------------------------ merge_streams


class Source:
    """A stream whose chunks the test releases one by one; it records being closed."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.queue: asyncio.Queue[GenerateChunk | Exception | None] = asyncio.Queue()
        self.closed = False

    async def stream(self) -> AsyncIterator[GenerateChunk]:
        try:
            while (item := await self.queue.get()) is not None:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.closed = True  # where wait_response aborts its request


async def test_chunks_come_out_in_the_order_they_arrive_from_any_stream():
    a, b = Source("a"), Source("b")
    merged = merge_streams([a.stream(), b.stream()])
    order = [(b, "b1"), (a, "a1"), (b, "b2"), (b, "b3"), (a, "a2")]
    for source, text in order:
        source.queue.put_nowait(chunk(source.name, text))
        assert (await anext(merged)).text == text
    a.queue.put_nowait(None)
    b.queue.put_nowait(chunk("b", "b4"))
    b.queue.put_nowait(None)
    assert [c.text async for c in merged] == ["b4"]  # ends once every stream has ended
    assert a.closed and b.closed


async def test_an_error_in_one_stream_reaches_the_consumer_and_closes_the_others():
    a, b = Source("a"), Source("b")
    merged = merge_streams([a.stream(), b.stream()])
    a.queue.put_nowait(chunk("a", "a1"))
    assert (await anext(merged)).text == "a1"
    b.queue.put_nowait(ClientError("item 1 failed"))
    with pytest.raises(ClientError, match="item 1 failed"):
        await anext(merged)
    assert a.closed and b.closed


async def test_closing_the_merged_stream_closes_every_stream():
    """A client that leaves a streaming batch aborts every item, finished or not."""
    sources = [Source(name) for name in "abc"]
    merged = merge_streams([s.stream() for s in sources])
    sources[2].queue.put_nowait(chunk("c", "c1"))
    assert (await anext(merged)).text == "c1"
    await merged.aclose()
    assert all(s.closed for s in sources)


# ------------------------------------------------------------------ handle_batch_request


class WordTokenizer:
    """One token per word, ids from a fixed vocabulary; `is_fast` as the test needs."""

    vocab: ClassVar[dict[str, int]] = {word: i for i, word in enumerate("a b c hello world one two three four".split())}

    def __init__(self, is_fast: bool = True) -> None:
        self.is_fast = is_fast
        self.calls: list[list[str]] = []

    def __call__(self, texts: list[str], add_special_tokens: bool = True):
        self.calls.append(list(texts))
        return type("Encoding", (), {"input_ids": [[self.vocab[w] for w in text.split()] for text in texts]})()

    def __len__(self) -> int:
        return len(self.vocab)


class Channel:
    """The TokenizerManager as the batch path sees it: every request ends with one chunk
    whose text is its rid; those in `aborted` end aborted."""

    def __init__(self, tokenizer: WordTokenizer, aborted: frozenset[str] = frozenset()) -> None:
        self.aborted = aborted
        self.inputs = RequestTokenizer(ServerArgs(), tokenizer)
        self.inputs.scheduler_info = SchedulerReady(
            max_req_input_len=100, context_len=200, max_total_tokens=1000, eos_token_ids=[0], vocab_size=100
        )
        self.rid_to_state: dict[str, ReqState] = {}
        self.live_rids = LiveRids(self.rid_to_state)
        self.sent: list[Message] = []

    def add_req_state(self, req: Tokenized, path: str, index: int | None = None, log_metrics: bool = True) -> ReqState:
        state = ReqState(rid=req.rid, stream=req.stream, path=path, index=index, log_metrics=log_metrics)
        self.live_rids.add(state)
        return state

    def send_new(self, messages: list[Message], states: list[ReqState]) -> None:
        self.sent.extend(messages)

    async def wait_response(
        self, state: ReqState, request: ClientConnection | None = None
    ) -> AsyncIterator[GenerateChunk]:
        self.live_rids.remove(state.rid)
        end = chunk(state.rid, state.rid, state.index, finished=True, path=state.path)
        if state.rid in self.aborted:
            end.finish_reason = FinishReason(type="abort", message="aborted")
        yield end


async def results(channel: Channel, obj: GenerateReqInput) -> list[GenerateChunk]:
    obj.normalize()
    if not obj.is_single:
        obj.normalize_batch(max_items=64)
    return [c async for c in handle_batch_request(channel, obj, None, 0.0)]


async def test_texts_are_tokenized_in_one_call_and_sent_as_one_batch():
    channel = Channel(tokenizer := WordTokenizer())
    obj = GenerateReqInput(text=["a b", "hello world", "one two three"], rid=["x", "y", "z"])
    chunks = await results(channel, obj)
    assert tokenizer.calls == [["a b", "hello world", "one two three"]]
    [batch] = channel.sent
    assert isinstance(batch, BatchTokenizedGenerateReqInput)
    assert [(r.rid, r.input_ids) for r in batch.reqs] == [("x", [0, 1]), ("y", [3, 4]), ("z", [5, 6, 7])]
    assert sorted((c.index, c.text, c.path) for c in chunks) == [
        (0, "x", "batch"),
        (1, "y", "batch"),
        (2, "z", "batch"),
    ]
    assert not channel.rid_to_state


async def test_a_slow_tokenizer_sends_item_by_item():
    channel = Channel(WordTokenizer(is_fast=False))
    chunks = await results(channel, GenerateReqInput(text=["a", "b"], rid=["x", "y"]))
    assert [type(m) for m in channel.sent] == [Tokenized, Tokenized]
    assert [m.rid for m in channel.sent] == ["x", "y"]
    assert {c.index: (c.text, c.path) for c in chunks} == {0: ("x", "batch_sequential"), 1: ("y", "batch_sequential")}


async def test_n_samples_warm_the_prefix_once_then_send_n_children_per_prompt():
    channel = Channel(WordTokenizer())
    obj = GenerateReqInput(
        text=["a b c", "one two"], rid=["p", "q"], sampling_params={"n": 2, "max_new_tokens": 5, "seed": 7}
    )
    chunks = await results(channel, obj)
    warmup, children = channel.sent
    assert [r.rid for r in warmup.reqs] == ["p::prefix", "q::prefix"]
    assert all(r.sampling_params.max_new_tokens == 0 and not r.stream for r in warmup.reqs)
    assert [r.rid for r in children.reqs] == ["p::0", "p::1", "q::0", "q::1"]
    assert [r.sampling_params.seed for r in children.reqs] == [7, 8, 7, 8]  # each sample its own seed
    assert all(r.sampling_params.max_new_tokens == 5 for r in children.reqs)
    # index = prompt_index * n + sample_index; the warm-ups yield nothing of their own.
    assert sorted((c.index, c.text) for c in chunks) == [(0, "p::0"), (1, "p::1"), (2, "q::0"), (3, "q::1")]
    assert {c.path for c in chunks} == {"parallel_sample"}


async def test_a_bad_item_fails_the_request_before_anything_is_sent():
    channel = Channel(WordTokenizer())
    obj = GenerateReqInput(text=["a", "b"], rid=["x", "y"], sampling_params=[{}, {"temperature": -1}])
    with pytest.raises(ClientError, match=r"item 1: .*temperature"):
        await results(channel, obj)
    assert channel.sent == [] and channel.rid_to_state == {}


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"input_ids": [1, 8]}, "input_ids"),
        ({"text": "a", "sampling_params": {"logit_bias": {"8": 1.0}}}, "logit_bias"),
        ({"text": "a", "sampling_params": {"stop_token_ids": [8]}}, "stop_token_ids"),
    ],
)
async def test_token_ids_the_tokenizer_has_but_the_model_lacks_are_refused(fields, param):
    """The tokenizer lists 9 tokens, the model's logits only 8: id 8 would index past them."""
    channel = Channel(WordTokenizer())
    channel.inputs.scheduler_info.vocab_size = 8
    with pytest.raises(ClientError, match=r"\[0, 8\)") as refused:
        await results(channel, GenerateReqInput(rid="x", **fields))
    assert refused.value.param == param and channel.sent == []


async def test_samples_of_a_prompt_whose_warm_up_was_aborted_are_never_sent():
    """/abort_request of the parent rid during the prompt's prefill ends its samples too."""
    channel = Channel(WordTokenizer(), aborted=frozenset({"p::prefix"}))
    obj = GenerateReqInput(text=["a b c", "one two"], rid=["p", "q"], sampling_params={"n": 2})
    chunks = await results(channel, obj)
    _, children = channel.sent
    assert [r.rid for r in children.reqs] == ["q::0", "q::1"]
    ends = {c.index: (c.rid, c.finish_reason.type) for c in chunks}
    assert ends == {0: ("p::0", "abort"), 1: ("p::1", "abort"), 2: ("q::0", "length"), 3: ("q::1", "length")}
    assert not channel.rid_to_state


@pytest.mark.parametrize("return_logprob", [False, True])
async def test_nothing_is_sent_when_every_warm_up_was_aborted(return_logprob):
    """The samples end as any request aborted before its first token: with return_logprob,
    their (empty) logprob fields are there."""
    channel = Channel(WordTokenizer(), aborted=frozenset({"p::prefix"}))
    obj = GenerateReqInput(text="a b", rid="p", sampling_params={"n": 3}, return_logprob=return_logprob)
    chunks = await results(channel, obj)
    assert len(channel.sent) == 1  # the warm-up only
    assert [(c.index, c.finish_reason.type, c.path, c.return_logprob) for c in chunks] == [
        (0, "abort", "parallel_sample", return_logprob),
        (1, "abort", "parallel_sample", return_logprob),
        (2, "abort", "parallel_sample", return_logprob),
    ]
