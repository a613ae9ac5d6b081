"""The TokenizerManager's per-request state: chunks carry what is new, /generate's JSON adds them up."""

from __future__ import annotations

import msgspec

from sluice.messages import FinishReason, ReqOutput, StrOutput, TokenLogprob
from sluice.tokenizer.req_state import LiveRids, ReqState
from sluice.tokenizer.result import NativeStream, native_json

LENGTH = FinishReason(type="length")


def output(text: str, ids: list[int], total: int, finish: FinishReason | None = None, first: bool = False) -> StrOutput:
    """One detokenizer output: `ids` are new, `total` the output tokens so far; logprobs -id/10."""
    req = ReqOutput(
        rid="r",
        new_token_ids=ids,
        finish_reason=finish,
        prompt_tokens=3,
        completion_tokens=total,
        output_logprobs=[-t / 10 for t in ids],
        output_top_logprobs=[[TokenLogprob(t, -t / 10)] for t in ids],
    )
    if first:
        req.input_token_ids, req.input_logprobs = [7, 8, 9], [None, -0.5, -0.25]
        req.input_top_logprobs = [[], [TokenLogprob(8, -0.5)], [TokenLogprob(9, -0.25)]]
    return StrOutput(output=req, text=text)


OUTPUTS = [output("Once", [1, 2], 2, first=True), output(" upon", [3], 3), output(' "a"\n time', [4, 5], 5, LENGTH)]


def event(stream: NativeStream, chunk) -> dict:
    """A streamed event as the client reads it."""
    return msgspec.json.decode(msgspec.json.encode(stream.add(chunk)))


def test_stream_chunks_carry_only_what_is_new():
    state = ReqState(rid="r", stream=True, return_logprob=True)
    chunks = [state.absorb(out) for out in OUTPUTS]
    assert [c.text for c in chunks] == ["Once", " upon", ' "a"\n time']
    assert [c.output_ids for c in chunks] == [[1, 2], [3], [4, 5]]
    assert [c.output_logprobs for c in chunks] == [[-0.1, -0.2], [-0.3], [-0.4, -0.5]]
    assert [c.completion_tokens for c in chunks] == [2, 3, 5]
    assert chunks[0].input_token_ids == [7, 8, 9] and chunks[1].input_token_ids == []  # sent once
    assert [c.finished for c in chunks] == [False, False, True] and state.finished


def test_streamed_events_add_up_to_the_non_streamed_result():
    streamed = ReqState(rid="r", stream=True, return_logprob=True)
    native = NativeStream()
    events = [event(native, streamed.absorb(out)) for out in OUTPUTS]
    whole = ReqState(rid="r", stream=False, return_logprob=True)
    results = [whole.absorb(out) for out in OUTPUTS]
    assert results[:2] == [None, None]  # a non-streaming request gets one chunk, at the end
    final = msgspec.json.decode(msgspec.json.encode(native_json(results[2])))
    assert events[0]["text"] == "Once" and events[0]["output_ids"] == [1, 2]
    assert events[0]["meta_info"]["output_token_logprobs"] == [[-0.1, 1, None], [-0.2, 2, None]]
    assert events[1]["meta_info"]["input_token_logprobs"] == events[0]["meta_info"]["input_token_logprobs"]
    assert events[-1]["text"] == final["text"] == 'Once upon "a"\n time'
    assert events[-1] == {
        **final,
        "meta_info": {
            **final["meta_info"],
            "e2e_latency": events[-1]["meta_info"]["e2e_latency"],
            "ttft": events[-1]["meta_info"]["ttft"],
        },
    }
    assert events[-1]["output_ids"] == final["output_ids"] == [1, 2, 3, 4, 5]
    for key in ("output_token_logprobs", "output_top_logprobs", "input_token_logprobs", "input_top_logprobs"):
        assert events[-1]["meta_info"][key] == final["meta_info"][key], key
    assert final["meta_info"]["output_token_logprobs"][2] == [-0.3, 3, None]
    assert final["meta_info"]["input_token_logprobs"] == [[None, 7, None], [-0.5, 8, None], [-0.25, 9, None]]
    assert final["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    assert final["meta_info"]["completion_tokens"] == 5 and "index" not in final


def test_a_stop_string_drops_tokens_already_streamed():
    """The detokenizer found a stop string inside text it held back: only 2 of the 4
    streamed tokens hold, and the last event says so."""
    state = ReqState(rid="r", stream=True, return_logprob=True)
    native = NativeStream()
    event(native, state.absorb(output("Once", [1, 2, 3, 4], 4, first=True)))
    last = state.absorb(output("", [], 2, FinishReason(type="stop", matched="\n")))
    assert last.output_ids == [] and last.completion_tokens == 2
    final = event(native, last)
    assert final["output_ids"] == [1, 2] and final["meta_info"]["completion_tokens"] == 2
    assert final["meta_info"]["output_token_logprobs"] == [[-0.1, 1, None], [-0.2, 2, None]]
    assert len(final["meta_info"]["output_top_logprobs"]) == 2

    whole = ReqState(rid="r", stream=False)
    whole.absorb(output("Once", [1, 2, 3], 3))
    final = whole.absorb(output("", [4], 4 - 2, FinishReason(type="stop", matched="\n")))
    assert final.output_ids == [1, 2] and final.completion_tokens == 2


def test_abort_chunk_ends_with_what_was_not_sent():
    state = ReqState(rid="r", stream=False, path="batch", index=3)
    assert state.absorb(output("Once", [1, 2], 2)) is None
    chunk = state.abort_chunk("the scheduler died", status_code=503)
    assert chunk.output_ids == [1, 2] and chunk.text == "Once" and chunk.index == 3
    assert chunk.finish_reason.status_code == 503 and chunk.finished
    result = native_json(chunk)
    assert result["index"] == 3 and result["meta_info"]["path"] == "batch" and result["meta_info"]["index"] == 3


def test_a_rid_stays_taken_while_any_state_of_its_family_lives():
    """A client that left during an n > 1 warm-up: its `rid::prefix` state lives until the
    abort comes back, and a retry with the same rid would take it over."""
    live = LiveRids({})
    live.add(ReqState(rid="x::prefix", stream=False))
    assert "x" in live and "x::prefix" in live and "y" not in live
    live.add(ReqState(rid="x::0", stream=False))
    live.remove("x::prefix")
    assert "x" in live
    live.remove("x::0")
    assert "x" not in live and not live.rid_to_state
    live.sampled.add("x")  # its warm-up ended, its samples not yet added
    assert "x" in live
