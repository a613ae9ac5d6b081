"""A Scheduler step or a request that raises (a bug no client should be able to reach) ends
the requests in flight with a 500, and the process goes on serving later ones as if it had
just started: the Scheduler's loop in-process, on a tiny random-weight model."""

from __future__ import annotations

import shutil

import pytest
import torch

from sluice.config import PortArgs, ServerArgs
from sluice.messages import BatchTokenizedGenerateReqInput, SamplingParams, TokenizedGenerateReqInput
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
