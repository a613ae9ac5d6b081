"""The DetokenizerManager fed BatchTokenIDOutput messages directly (no sockets), with the
real SmolLM2 tokenizer: text per request across batches, stop strings that end a request
early, and what it tells the Scheduler to release."""

from __future__ import annotations

import pytest

from sluice.detokenizer.manager import DetokenizerManager
from sluice.messages import BatchTokenIDOutput, FinishReason, ReqOutput, TokenIDOutput, TokenLogprob
from sluice.model_files import default_model_path
from sluice.tokenizer_files import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_path())


def token_output(rid: str, ids: list[int], reason: FinishReason | None = None, **options) -> TokenIDOutput:
    return TokenIDOutput(
        output=ReqOutput(rid=rid, new_token_ids=ids, finish_reason=reason, completion_tokens=len(ids)), **options
    )


def in_pieces(ids: list[int], size: int) -> list[list[int]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]


def test_interleaved_requests_each_get_their_own_text(tokenizer):
    manager = DetokenizerManager(tokenizer)
    texts = {"a": "The capital of France is Paris.", "b": "héllo 世界 🎉👍🏽 naïve café"}
    pieces = {rid: in_pieces(tokenizer.encode(text), 2) for rid, text in texts.items()}
    received = dict.fromkeys(texts, "")
    steps = max(len(p) for p in pieces.values())
    for step in range(steps):
        batch = [
            token_output(rid, p[step], FinishReason(type="length") if step == len(p) - 1 else None)
            for rid, p in pieces.items()
            if step < len(p)
        ]
        outputs, to_release = manager.handle(BatchTokenIDOutput(outputs=batch))
        assert to_release == []
        assert [out.output.rid for out in outputs] == [out.output.rid for out in batch]
        for out in outputs:
            assert "\ufffd" not in out.text  # never half a character
            received[out.output.rid] += out.text
    assert received == texts
    assert manager.decoders == {}  # nothing kept for finished requests


def test_a_stop_string_ends_the_request_and_releases_it(tokenizer):
    manager = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("one, two, three, four, five")
    options = {"stop": [" three"], "stream": True}
    shown = ""
    released: list[str] = []
    final = None
    for piece in in_pieces(ids, 1):
        outputs, to_release = manager.handle(BatchTokenIDOutput(outputs=[token_output("s", piece, **options)]))
        released += to_release
        for out in outputs:
            shown += out.text
            if out.output.finish_reason is not None:
                final = out.output
        if final is not None:
            break
    assert shown == "one, two,"
    assert final.finish_reason == FinishReason(type="stop", matched=" three")
    assert final.completion_tokens == len(tokenizer.encode("one, two, three"))
    assert released == ["s"]

    # What the Scheduler produced before it heard of the stop is dropped, its final too.
    late = [token_output("s", ids[-2:-1], **options), token_output("s", ids[-1:], FinishReason(type="stop"), **options)]
    for out in late:
        assert manager.handle(BatchTokenIDOutput(outputs=[out])) == ([], [])
    assert manager.stopped_rids == set() and manager.decoders == {}

    # The rid is free again: a new request with it starts from nothing.
    outputs, _ = manager.handle(BatchTokenIDOutput(outputs=[token_output("s", ids, FinishReason(type="length"))]))
    assert outputs[0].text == "one, two, three, four, five"


def test_the_output_fields_pass_through_beside_the_text(tokenizer):
    manager = DetokenizerManager(tokenizer)
    output = ReqOutput(
        rid="f",
        new_token_ids=tokenizer.encode("Hi"),
        finish_reason=FinishReason(type="length"),
        prompt_tokens=7,
        completion_tokens=1,
        cached_tokens=6,
        output_logprobs=[-0.25],
        output_top_logprobs=[[TokenLogprob(5, -0.25)]],
        http_worker_ipc="ipc:///worker",
    )
    [out], _ = manager.handle(BatchTokenIDOutput(outputs=[TokenIDOutput(output=output)]))
    assert out.output == output and out.text == "Hi"


def test_special_tokens_follow_the_request_options(tokenizer):
    manager = DetokenizerManager(tokenizer)
    ids = [*tokenizer.encode("Hi"), 2]  # <|im_end|>
    batch = [
        token_output("hide", ids, FinishReason(type="length")),
        token_output("show", ids, FinishReason(type="length"), skip_special_tokens=False),
        token_output(
            "tight", ids, FinishReason(type="length"), skip_special_tokens=False, spaces_between_special_tokens=False
        ),
    ]
    outputs, _ = manager.handle(BatchTokenIDOutput(outputs=batch))
    assert [out.text for out in outputs] == ["Hi", "Hi <|im_end|>", "Hi<|im_end|>"]


def test_the_heartbeat_passes_through_empty(tokenizer):
    assert DetokenizerManager(tokenizer).handle(BatchTokenIDOutput(outputs=[])) == ([], [])
