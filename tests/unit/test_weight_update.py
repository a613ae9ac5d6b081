"""A weight update in the Scheduler, in-process on tiny random-weight models: it waits for the
running requests (which finish on the old weights), holds new ones back (they run on the new
weights), flushes the prefix cache, and never leaves the server without weights."""

from __future__ import annotations

import shutil

import pytest
import torch

from sluice.config import ServerArgs
from sluice.messages import SamplingParams, TokenizedGenerateReqInput, UpdateWeightsFromDiskReq
from sluice.model.model_runner import ModelRunner
from sluice.scheduler.scheduler import Scheduler
from tests.tiny_lms import build_tiny_model

PROMPT = [1, 4093, 198, 19556, 2, 198, 1, 520, 9531, 198]
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Two Qwen3 models of one shape with different weights, and a Phi-3 of the same sizes."""
    made = {}
    for name, family, seed in (("old", "qwen3", 0), ("new", "qwen3", 1), ("phi3", "phi3", 0)):
        made[name] = tmp_path_factory.mktemp(name)
        build_tiny_model(made[name], family, seed)
    return made


def new_scheduler(folder, max_total_tokens: int = 2048, **overrides) -> Scheduler:
    torch.set_num_threads(2)
    args = ServerArgs(model_path=str(folder), dtype="float32", debug_checks=True, **overrides)
    runner = ModelRunner(str(folder), torch.float32, context_length=args.context_length)
    return Scheduler(args, runner, max_total_tokens)


def add(scheduler: Scheduler, rid: str, ids: list[int] = PROMPT, new_tokens: int = NEW_TOKENS) -> None:
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0, ignore_eos=True)
    assert scheduler.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params)) is None


def drive(scheduler: Scheduler, tokens: dict, versions: dict, replies: list, steps: int = 10_000) -> None:
    """Step as the Scheduler process does (an update is tried before each step), at most `steps`."""
    for _ in range(steps):
        if scheduler.is_idle and scheduler.pending_update is None:
            return
        if (reply := scheduler.apply_pending_update()) is not None:
            replies.append(reply)
        for out in scheduler.step():
            tokens.setdefault(out.output.rid, []).extend(out.output.new_token_ids)
            versions.setdefault(out.output.rid, set()).add(out.output.weight_version)
        scheduler.check_integrity()


def greedy_on(folder, new_tokens: int = NEW_TOKENS) -> list[int]:
    tokens: dict = {}
    scheduler = new_scheduler(folder)
    add(scheduler, "r", new_tokens=new_tokens)
    drive(scheduler, tokens, {}, [])
    return tokens["r"]


def test_running_requests_finish_on_the_old_weights_and_new_ones_start_on_the_new(folders):
    on_old, on_new = greedy_on(folders["old"]), greedy_on(folders["new"])
    assert on_old != on_new  # else the test could not tell the weights apart

    scheduler = new_scheduler(folders["old"])
    tokens: dict = {}
    versions: dict = {}
    replies: list = []
    add(scheduler, "before")
    drive(scheduler, tokens, versions, replies, steps=3)  # prefilled, decoding
    assert scheduler.running
    assert scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(folders["new"]))) is None
    add(scheduler, "after")  # same prompt: its prefix is in the cache, computed by the old weights
    drive(scheduler, tokens, versions, replies)

    [reply] = replies
    assert reply.success, reply.message
    assert (reply.weight_version, reply.model_path) == ("1", str(folders["new"]))
    assert tokens["before"] == on_old and versions["before"] == {"0"}
    assert tokens["after"] == on_new and versions["after"] == {"1"}
    assert scheduler.weight_version == "1"


def test_new_weights_are_served_at_the_servers_context_length(folders):
    """With --context-length below the model's, weights of the same model fit (they are served
    at that length too); the served limit stays."""
    scheduler = new_scheduler(folders["old"], context_length=64)
    assert scheduler.config.context_len == 64
    replies: list = []
    assert scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(folders["new"]))) is None
    drive(scheduler, {}, {}, replies)
    [reply] = replies
    assert reply.success, reply.message
    assert scheduler.config.context_len == 64 and scheduler.weight_version == "1"


def test_a_request_retracted_while_the_update_waits_finishes_on_the_old_weights(folders):
    on_old = greedy_on(folders["old"], new_tokens=30)
    scheduler = new_scheduler(folders["old"], max_total_tokens=64)  # two requests of 40 tokens do not fit
    tokens: dict = {}
    versions: dict = {}
    replies: list = []
    for rid in ("a", "b"):
        add(scheduler, rid, new_tokens=30)
    drive(scheduler, tokens, versions, replies, steps=3)
    assert len(scheduler.running) == 2
    assert scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(folders["new"]))) is None
    drive(scheduler, tokens, versions, replies)
    assert scheduler.num_retractions > 0
    assert tokens["a"] == tokens["b"] == on_old
    assert versions["a"] == versions["b"] == {"0"}
    assert [reply.success for reply in replies] == [True]


def test_a_named_version_is_taken_and_a_name_cannot_be_counted_up(folders):
    scheduler = new_scheduler(folders["old"], weight_version="base")
    refused = scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(folders["new"])))
    assert refused is not None and not refused.success and refused.param == "weight_version"
    assert scheduler.pending_update is None
    named = UpdateWeightsFromDiskReq(model_path=str(folders["new"]), weight_version="tuned-2")
    assert scheduler.request_weight_update(named) is None
    reply = scheduler.apply_pending_update()
    assert reply is not None and reply.success and reply.weight_version == "tuned-2"


@pytest.mark.parametrize(
    ("which", "says"),
    [("missing", "no such file"), ("phi3", "architecture is 'Phi3ForCausalLM'"), ("empty", "neither")],
)
def test_weights_that_do_not_fit_are_refused_at_once_and_the_old_keep_serving(folders, tmp_path, which, says):
    path = {"missing": tmp_path / "gone.gguf", "phi3": folders["phi3"], "empty": tmp_path}[which]
    scheduler = new_scheduler(folders["old"])
    refused = scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(path)))
    assert refused is not None and not refused.success
    assert refused.param == "model_path" and says in refused.message, refused.message
    assert refused.weight_version == "0" and scheduler.pending_update is None
    tokens: dict = {}
    add(scheduler, "r")
    drive(scheduler, tokens, {}, [])
    assert tokens["r"] == greedy_on(folders["old"])


def test_weights_that_fail_to_load_leave_the_old_serving(folders, tmp_path):
    from safetensors.torch import load_file, save_file

    cut = tmp_path / "cut"
    shutil.copytree(folders["new"], cut)
    for weights in cut.glob("*.safetensors"):
        weights.write_bytes(weights.read_bytes()[:1000])  # the tensors are cut off: refused at once
    scheduler = new_scheduler(folders["old"])
    refused = scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(cut)))
    assert refused is not None and "cannot be read as safetensors" in refused.message
    broken = tmp_path / "broken"
    shutil.copytree(folders["new"], broken)
    for weights in broken.glob("*.safetensors"):  # whole files and the config fits; one weight does not
        tensors = load_file(str(weights))
        tensors["model.layers.0.mlp.gate_proj.weight"] = torch.zeros(3, 3)
        save_file(tensors, str(weights))
    assert scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(broken))) is None
    reply = scheduler.apply_pending_update()
    assert reply is not None and not reply.success and "old weights keep serving" in reply.message
    assert reply.weight_version == "0" and reply.model_path == str(folders["old"])
    tokens: dict = {}
    add(scheduler, "r")
    drive(scheduler, tokens, {}, [])
    assert tokens["r"] == greedy_on(folders["old"])


def test_a_second_update_while_one_waits_is_refused(folders):
    scheduler = new_scheduler(folders["old"])
    add(scheduler, "r")
    drive(scheduler, {}, {}, [], steps=2)
    first = UpdateWeightsFromDiskReq(model_path=str(folders["new"]))
    assert scheduler.request_weight_update(first) is None
    second = scheduler.request_weight_update(UpdateWeightsFromDiskReq(model_path=str(folders["old"])))
    assert second is not None and "in progress" in second.message
