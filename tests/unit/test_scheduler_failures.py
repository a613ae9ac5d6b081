"""A Scheduler step or a request that raises (a bug no client should be able to reach) ends
the requests in flight with a 500, and the process goes on serving later ones as if it had
just started: the Scheduler's loop in-process, on a tiny random-weight model."""

from __future__ import annotations

import shutil
from concurrent.futures import Future

import pytest
import torch

from sluice.config import PortArgs, ServerArgs
from sluice.messages import AbortReq, BatchTokenizedGenerateReqInput, SamplingParams, TokenizedGenerateReqInput
from sluice.model.model_runner import ModelRunner
from sluice.scheduler.process import SchedulerLoop
from sluice.scheduler.req import Req
from sluice.scheduler.scheduler import Scheduler
from tests.tiny_lms import build_tiny_model

PROMPT = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    made = tmp_path_factory.mktemp("qwen3")
    build_tiny_model(made, "qwen3")
    return made


@pytest.fixture
def loop(folder):
    torch.set_num_threads(2)
    args = ServerArgs(model_path=str(folder), dtype="float32", debug_checks=True)
    runner = ModelRunner(str(folder), torch.float32, context_length=args.context_length)
    port_args = PortArgs.create()
    made = SchedulerLoop(Scheduler(args, runner, 2048), port_args)
    yield made
    made.context.destroy(linger=0)
    shutil.rmtree(port_args.ipc_dir)


def request(rid: str, ids: list[int] = PROMPT, new_tokens: int = 8) -> TokenizedGenerateReqInput:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    return TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params)


def run_to_the_end(loop: SchedulerLoop) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while not loop.scheduler.is_idle:
        for out in loop.step():
            tokens.setdefault(out.output.rid, []).extend(out.output.new_token_ids)
        loop.scheduler.check_integrity()
    return tokens


def test_a_failed_step_ends_its_requests_with_a_500_and_the_next_request_runs_as_on_a_fresh_server(loop, monkeypatch):
    scheduler = loop.scheduler
    assert loop.handle(request("before")) == []
    expected = run_to_the_end(loop)["before"]  # its prefix is now in the radix cache

    assert loop.handle(request("a")) == []
    assert loop.handle(request("b", [*PROMPT[:4], 7, 8, 9])) == []
    assert loop.step() == []  # both prefilled (a's prompt from the cache), and decoding
    assert [req.rid for req in scheduler.running] == ["a", "b"] and scheduler.running[0].cached_tokens > 0
    real_forward = scheduler.runner.forward

    def fail_once(batch):
        monkeypatch.setattr(scheduler.runner, "forward", real_forward)
        raise RuntimeError("boom")

    monkeypatch.setattr(scheduler.runner, "forward", fail_once)
    outputs = loop.step()
    assert sorted(out.output.rid for out in outputs) == ["a", "b"]
    for out in outputs:
        assert out.output.finish_reason.type == "abort"
        assert out.output.finish_reason.status_code == 500
        assert out.output.finish_reason.message == "internal error: RuntimeError: boom"
    assert scheduler.is_idle
    state = scheduler.internal_state()
    assert state.num_failed_steps == 1
    assert state.kv_tokens_free == state.kv_tokens_total  # the cache starts afresh
    scheduler.check_integrity()

    assert loop.handle(request("after")) == []
    assert run_to_the_end(loop)["after"] == expected


def test_a_request_the_scheduler_fails_to_take_ends_alone_with_a_500(loop, monkeypatch):
    real_from_message = Req.from_message

    def from_message(msg):
        if msg.rid == "bad":
            raise KeyError("boom")
        return real_from_message(msg)

    monkeypatch.setattr(Req, "from_message", from_message)
    [refused] = loop.handle(BatchTokenizedGenerateReqInput(reqs=[request("good"), request("bad")]))
    assert refused.output.rid == "bad"
    assert refused.output.finish_reason.status_code == 500
    assert refused.output.finish_reason.message == "internal error: KeyError: 'boom'"
    assert refused.output.prompt_tokens == len(PROMPT)
    assert len(run_to_the_end(loop)["good"]) == 8
    assert loop.scheduler.internal_state().finished_reqs == {"abort": 1, "length": 1}


def test_a_step_that_fails_after_a_request_ended_still_sends_its_end(loop, monkeypatch):
    """A request that ended in the step is out of every queue when a later stage fails: its
    final output goes out as made, and each other request ends once, with a 500."""
    scheduler = loop.scheduler
    assert loop.handle(request("short", new_tokens=1)) == []
    assert loop.handle(request("long", [*PROMPT, 5], new_tokens=8)) == []

    def fail(running):
        raise RuntimeError("trim failed")

    monkeypatch.setattr(scheduler.kv, "trim_window_slots", fail)
    outputs = loop.step()  # both prefill; short samples its one token and ends
    ends = {out.output.rid: out.output.finish_reason for out in outputs}
    assert len(outputs) == 2 and ends["short"].type == "length"
    assert (ends["long"].type, ends["long"].status_code) == ("abort", 500)
    assert scheduler.is_idle and not scheduler.live
    scheduler.check_integrity()


def test_a_grammar_compiler_that_fails_ends_only_its_request(loop, monkeypatch):
    scheduler = loop.scheduler
    broken: Future = Future()
    broken.set_exception(RuntimeError("the grammar tokenizer did not load"))
    monkeypatch.setattr(scheduler.grammars, "compile", lambda params: broken if params.regex else None)
    constrained = request("constrained")
    constrained.sampling_params.regex = "a+"
    assert loop.handle(constrained) == [] and loop.handle(request("plain")) == []
    tokens: dict[str, list[int]] = {}
    ends = {}
    while not scheduler.is_idle:
        for out in loop.step():
            tokens.setdefault(out.output.rid, []).extend(out.output.new_token_ids)
            ends[out.output.rid] = out.output.finish_reason
    assert (ends["constrained"].status_code, ends["constrained"].message) == (
        500,
        "internal error: RuntimeError: the grammar tokenizer did not load",
    )
    assert ends["plain"].type == "length" and len(tokens["plain"]) == 8
    assert scheduler.internal_state().num_failed_steps == 0


def test_an_abort_that_fails_ends_the_requests_in_flight_not_the_process(loop, monkeypatch):
    scheduler = loop.scheduler
    assert loop.handle(request("a")) == []
    loop.step()

    def fail(req, keep_in_cache):
        raise RuntimeError("release failed")

    monkeypatch.setattr(scheduler.kv, "release", fail)
    [end] = loop.handle_safely(AbortReq(rid="a"))
    assert (end.output.rid, end.output.finish_reason.status_code) == ("a", 500)
    assert scheduler.is_idle and not scheduler.live
