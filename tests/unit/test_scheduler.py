"""The Scheduler in-process on the real default model (fp32): greedy output must not depend
on batching, prefix caching, chunked prefill or retraction."""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Callable

import pytest
import torch

from sluice.config import ServerArgs
from sluice.messages import AbortReq, SamplingParams, TokenizedGenerateReqInput
from sluice.model.model_runner import ModelRunner
from sluice.scheduler.kv_manager import SLOT_RUN
from sluice.scheduler.policy import CHEAP_OVERTAKES_S, order_waiting
from sluice.scheduler.req import Req
from sluice.scheduler.scheduler import Scheduler
from sluice.tokenizer_files import load_tokenizer

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def runner():
    torch.set_num_threads(2)
    args = ServerArgs(dtype="float32")
    return ModelRunner(args.resolved_model_path(), torch.float32)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(ServerArgs().resolved_model_path())
    topics = [
        "the sea",
        "a red fox",
        "mountains",
        "the history of Rome",
        "bread",
        "a violin",
        "winter",
        "robots",
        "the moon",
        "coffee",
        "a library",
        "trains",
        "gardens",
        "chess",
        "rain",
        "music",
    ]
    texts = [f"Write one sentence about {t}." + " Please be brief." * (i % 4) for i, t in enumerate(topics)]
    return [tok(text).input_ids for text in texts]


def make_scheduler(runner, **overrides) -> Scheduler:
    args = dataclasses.replace(ServerArgs(dtype="float32", debug_checks=True), **overrides)
    return Scheduler(args, runner, overrides.get("max_total_tokens") or 8192)


def run(
    scheduler: Scheduler,
    prompts: list[list[int]],
    max_new_tokens: int = NEW_TOKENS,
    before_step: Callable[[int], None] | None = None,
    **fields,
) -> dict[str, list[int]]:
    """Greedy tokens of each prompt, keyed `r0`, `r1`, ...; `before_step(n)` runs before step n."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True, **fields)
        out = scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params))
        assert out is None
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached: dict[str, int] = {}
    for step in range(10_000):
        if scheduler.is_idle:
            break
        if before_step is not None:
            before_step(step)
        for out in scheduler.step():
            tokens.setdefault(out.output.rid, []).extend(out.output.new_token_ids)
            cached[out.output.rid] = out.output.cached_tokens
        scheduler.check_integrity()
    assert scheduler.is_idle
    scheduler.check_integrity()
    run.cached = cached
    return tokens


@pytest.fixture(scope="module")
def alone(runner, prompts):
    """Each prompt on its own, on a fresh scheduler, without any cache."""
    results = []
    for ids in prompts:
        scheduler = make_scheduler(runner, disable_radix_cache=True)
        results.append(run(scheduler, [ids])["r0"])
    return results


def test_batch_of_16_matches_alone(runner, prompts, alone):
    scheduler = make_scheduler(runner, disable_radix_cache=True)
    tokens = run(scheduler, prompts)
    assert [tokens[f"r{i}"] for i in range(16)] == alone
    assert scheduler.internal_state().finished_reqs == {"length": 16}


def test_the_thread_count_changing_between_steps_changes_no_token(runner, prompts, alone):
    """The forward pass gives up a thread while another process keeps a core busy
    (scheduler/forward_threads.py), in the middle of requests: prompt chunks and decode steps
    on one thread give the tokens they give on two."""
    scheduler = make_scheduler(runner, chunked_prefill_size=16, disable_radix_cache=True)
    try:
        tokens = run(scheduler, prompts, before_step=lambda step: torch.set_num_threads(1 + step % 2))
    finally:
        torch.set_num_threads(2)
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == alone


def test_prefix_from_radix_cache_matches(runner, prompts, alone):
    scheduler = make_scheduler(runner)
    run(scheduler, [prompts[0]])
    again = run(scheduler, [prompts[0]])
    assert run.cached["r0"] >= len(prompts[0]) - 1
    assert again["r0"] == alone[0]
    # A prompt that extends a cached sequence reuses its whole prefix.
    extended = prompts[0] + alone[0][:5]
    alone_extended = run(make_scheduler(runner, disable_radix_cache=True), [extended])["r0"]
    assert run(scheduler, [extended])["r0"] == alone_extended
    assert run.cached["r0"] >= len(prompts[0])


def test_requests_arriving_together_with_one_long_prefix_compute_it_once(runner, prompts):
    shared = [token for ids in prompts[:6] for token in ids]  # ~60 tokens every request shares
    together = [shared + ids for ids in prompts[6:10]]
    scheduler = make_scheduler(runner, chunked_prefill_size=32)
    tokens = run(scheduler, together)
    # The first computes the shared part; the rest wait for it to reach the radix cache.
    assert sum(1 for cached in run.cached.values() if cached >= len(shared)) == 3
    expected = [run(make_scheduler(runner, disable_radix_cache=True), [ids])["r0"] for ids in together]
    assert [tokens[f"r{i}"] for i in range(4)] == expected


def test_chunked_prefill_matches(runner, prompts, alone):
    scheduler = make_scheduler(runner, chunked_prefill_size=16, disable_radix_cache=True)
    long_ones = [i for i, ids in enumerate(prompts) if len(ids) > 16][:3]
    tokens = run(scheduler, [prompts[i] for i in long_ones])
    assert [tokens[f"r{k}"] for k in range(len(long_ones))] == [alone[i] for i in long_ones]


def test_retracted_request_resumes_unchanged(runner, prompts, alone):
    # Room for every prompt but not for all of their outputs: decoding must retract.
    budget = sum(len(p) for p in prompts[:6]) + 40
    scheduler = make_scheduler(runner, max_total_tokens=budget)
    tokens = run(scheduler, prompts[:6])
    assert scheduler.num_retractions > 0
    assert [tokens[f"r{i}"] for i in range(6)] == alone[:6]


def test_prompts_too_long_to_prefill_side_by_side_take_turns(runner):
    """Three 120-token prompts sent together to a 160-token cache, 16 tokens a chunk: each is
    admitted once the cache has room for its whole prompt, so they run one after another.
    Admitted on a chunk's room they filled the cache between them before any was whole, and
    retracted each other in turn for ever."""
    long_prompts = [[100 + (7 * i + k) % 900 for i in range(120)] for k in range(3)]
    scheduler = make_scheduler(runner, max_total_tokens=160, chunked_prefill_size=16, max_prefill_tokens=128)
    tokens = run(scheduler, long_prompts, max_new_tokens=8)
    assert scheduler.num_retractions == 0
    for k, ids in enumerate(long_prompts):
        assert tokens[f"r{k}"] == run(make_scheduler(runner, disable_radix_cache=True), [ids], max_new_tokens=8)["r0"]


def test_prompts_prefilled_in_chunks_side_by_side_never_fill_the_cache_for_good(runner):
    """Two prompts prefilling in chunks side by side that fill the cache before either is
    whole (admission leaves room for every admitted prompt, but decoding requests may take
    more than their reserve): the later one goes back to wait, and both finish."""
    long_prompts = [[100 + (7 * i + k) % 900 for i in range(120)] for k in range(2)]
    scheduler = make_scheduler(runner, max_total_tokens=160, chunked_prefill_size=16, max_prefill_tokens=128)
    for k, ids in enumerate(long_prompts):
        params = SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True)
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{k}", input_ids=ids, sampling_params=params))
    scheduler.running, scheduler.waiting = scheduler.waiting, []
    for req in scheduler.running:  # both admitted at once, as if the cache had had room for both
        assert scheduler.kv.admit(req)
    tokens = run(scheduler, [])
    assert scheduler.num_retractions > 0
    for k, ids in enumerate(long_prompts):
        assert tokens[f"r{k}"] == run(make_scheduler(runner, disable_radix_cache=True), [ids], max_new_tokens=8)["r0"]


def test_a_retracted_request_keeps_its_grammar_state(runner, prompts):
    """Constrained requests retracted mid-answer resume where their grammar was: each gets the
    tokens it gets alone, and they still follow the schema."""
    schema = '{"type": "array", "minItems": 100, "items": {"type": "integer", "maximum": 999}}'
    tok = load_tokenizer(ServerArgs().resolved_model_path())
    alone = [
        run(make_scheduler(runner, disable_radix_cache=True), [ids], json_schema=schema)["r0"] for ids in prompts[:4]
    ]
    budget = sum(len(p) for p in prompts[:4]) + 40
    scheduler = make_scheduler(runner, max_total_tokens=budget)
    tokens = run(scheduler, prompts[:4], json_schema=schema)
    assert scheduler.num_retractions > 0
    assert [tokens[f"r{i}"] for i in range(4)] == alone
    for ids in alone:  # a prefix of a JSON array of integers (the request ran out of tokens)
        assert re.fullmatch(r"\[(-?[0-9]+(,-?[0-9]+)*(,-?[0-9]*)?|-?[0-9]*)", tok.decode(ids)), tok.decode(ids)


def test_a_retracted_request_sends_its_prompt_logprobs_once(runner, prompts):
    """A request retracted before its first output prefills its prompt again: the prompt's
    logprobs, computed again, replace the first ones instead of following them."""
    scheduler = make_scheduler(runner, max_total_tokens=sum(len(p) for p in prompts[:6]) + 40)
    for i, ids in enumerate(prompts[:6]):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        request = TokenizedGenerateReqInput(
            rid=f"r{i}",
            input_ids=ids,
            sampling_params=params,
            return_logprob=True,
            top_logprobs_num=2,
            logprob_start_len=0,
        )
        scheduler.add_request(request)
    outputs = {}
    while not scheduler.is_idle:
        outputs.update((out.output.rid, out.output) for out in scheduler.step() if out.output.input_logprobs)
    assert scheduler.num_retractions > 0
    for i, ids in enumerate(prompts[:6]):
        output = outputs[f"r{i}"]
        assert output.input_token_ids == ids
        assert len(output.input_logprobs) == len(output.input_top_logprobs) == len(ids)


def test_a_grammar_in_error_ends_its_request_with_a_400_not_a_stop(runner, prompts):
    """llguidance reports a matcher in error as stopped, allowing only EOS: the request must
    not end as a complete answer."""
    scheduler = make_scheduler(runner)
    params = SamplingParams(max_new_tokens=8, temperature=0, regex="[0-9]+")
    scheduler.add_request(TokenizedGenerateReqInput(rid="r", input_ids=prompts[0], sampling_params=params))
    while not scheduler.running:
        assert not scheduler.step()
    [req] = scheduler.running
    req.grammar.consume_token(28)  # "," puts it in error, as a failed mask computation would
    outputs = []
    while not scheduler.is_idle:
        outputs += scheduler.step()
    [final] = outputs
    assert final.output.finish_reason.type == "abort" and final.output.finish_reason.status_code == 400
    assert "dead end" in final.output.finish_reason.message
    assert final.output.finish_reason.param == "regex"  # the field that gave the grammar
    scheduler.check_integrity()


def test_aborted_requests_whose_grammar_waits_to_compile_cancel_the_compilation(runner, prompts):
    scheduler = make_scheduler(runner)
    for i in range(4):  # distinct grammars: the first occupies the compiler, the rest queue
        params = SamplingParams(max_new_tokens=8, temperature=0, regex=f"x{i}[0-9]+")
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"g{i}", input_ids=prompts[0], sampling_params=params))
    compilations = [req.compiling_grammar for req in scheduler.compiling]
    outputs = scheduler.abort(AbortReq(rid="", abort_all=True))
    assert len(outputs) == 4 and scheduler.is_idle
    assert all(compiled.cancelled() for compiled in compilations[1:])


def test_a_workers_abort_of_its_own_request_spares_the_rid_sent_again_by_another(runner, prompts):
    """Worker a's client left as its request ended, and sent the rid again through worker b
    before a's abort arrived: the abort ends only a request of a's."""
    scheduler = make_scheduler(runner)
    params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
    for rid, worker in (("same", "b"), ("family::0", "b"), ("mine", "a")):
        scheduler.add_request(
            TokenizedGenerateReqInput(rid=rid, input_ids=prompts[0], sampling_params=params, http_worker_ipc=worker)
        )
    scheduler.step()
    assert scheduler.abort(AbortReq(rid="same", own_request=True, http_worker_ipc="a")) == []
    assert scheduler.abort(AbortReq(rid="family", own_request=True, http_worker_ipc="a")) == []
    [ended] = scheduler.abort(AbortReq(rid="mine", own_request=True, http_worker_ipc="a"))
    assert ended.output.rid == "mine" and ended.output.finish_reason.type == "abort"
    # A client's /abort_request, through any worker, ends the rid wherever it runs.
    [ended] = scheduler.abort(AbortReq(rid="same", http_worker_ipc="a"))
    assert ended.output.rid == "same"
    scheduler.abort(AbortReq(abort_all=True))
    scheduler.check_integrity()


def test_abort_frees_waiting_and_running(runner, prompts):
    scheduler = make_scheduler(runner, max_running_requests=2)
    for i, ids in enumerate(prompts[:4]):
        params = SamplingParams(max_new_tokens=50, temperature=0, ignore_eos=True)
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params))
    scheduler.step()
    assert len(scheduler.running) == 2 and len(scheduler.waiting) == 2
    outs = scheduler.abort(AbortReq(rid="r0")) + scheduler.abort(AbortReq(rid="r3"))
    assert {o.output.rid for o in outs} == {"r0", "r3"}
    assert all(o.output.finish_reason.type == "abort" for o in outs)
    # The detokenizer matched a stop string: the request is released as finished, not aborted.
    [released] = scheduler.abort(AbortReq(rid="r1", finished_by_stop_string=True))
    assert released.output.finish_reason.type == "stop"
    outs = scheduler.abort(AbortReq(abort_all=True))
    assert {o.output.rid for o in outs} == {"r2"}
    assert scheduler.is_idle
    scheduler.check_integrity()
    state = scheduler.internal_state()
    assert state.kv_tokens_in_use == 0
    assert state.finished_reqs == {"abort": 3, "stop": 1}


def test_each_request_takes_its_slots_in_runs_and_its_reserve_goes_back(runner):
    """Decoding side by side, each request's K/V slots still lie in runs of SLOT_RUN (a break
    a run), not one slot per request per step; the unused rest of a run is reserved for the
    request and freed with it. (Prompts with nothing in common: a prefix the cache already
    holds replaces a request's own slots, which go back to be reused in pieces.)"""
    scheduler = make_scheduler(runner)
    for i, ids in enumerate([list(range(1000 + 100 * i, 1000 + 100 * i + 10 + 7 * i)) for i in range(4)]):
        params = SamplingParams(max_new_tokens=100, temperature=0, ignore_eos=True)
        scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params))
    for _ in range(60):
        scheduler.step()
        scheduler.check_integrity()
    assert len(scheduler.running) == 4
    for req in scheduler.running:
        slots = req.kv_slots(scheduler.kv.req_to_token).tolist()
        breaks = sum(b != a + 1 for a, b in itertools.pairwise(slots))
        assert breaks <= len(slots) // SLOT_RUN, slots
        assert req.reserved_slots == list(range(slots[-1] + 1, slots[-1] + 1 + len(req.reserved_slots)))
    assert sum(len(req.reserved_slots) for req in scheduler.running) > 0
    scheduler.abort(AbortReq(abort_all=True))
    scheduler.check_integrity()
    assert scheduler.internal_state().kv_tokens_in_use == 0


def test_bad_request_is_refused_before_scheduling(runner):
    scheduler = make_scheduler(runner)
    out = scheduler.add_request(TokenizedGenerateReqInput(rid="x", input_ids=[10**9], sampling_params=SamplingParams()))
    assert out.output.finish_reason.type == "abort" and out.output.finish_reason.status_code == 400
    assert scheduler.is_idle
    assert scheduler.internal_state().finished_reqs == {"abort": 1}


def test_fill_slice_reads_prompt_then_output():
    """A decode step reads one token of the sequence; any range must read like the whole."""
    req = Req(rid="r", prompt_ids=[1, 2, 3], sampling_params=SamplingParams(), output_ids=[4, 5])
    whole = [1, 2, 3, 4, 5]
    assert all(req.fill_slice(a, b) == whole[a:b] for a in range(6) for b in range(a, 6))


def add(scheduler: Scheduler, rid: str, ids: list[int], max_new_tokens: int = 50, priority: int = 0):
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
    msg = TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, priority=priority)
    return scheduler.add_request(msg)


def test_stream_interval_sends_the_first_token_at_once_then_every_n(runner, prompts):
    scheduler = make_scheduler(runner, stream_interval=4)
    params = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    scheduler.add_request(TokenizedGenerateReqInput(rid="r", input_ids=prompts[0], sampling_params=params, stream=True))
    sent = []
    while not scheduler.is_idle:
        sent += [len(out.output.new_token_ids) for out in scheduler.step()]
    assert sent == [1, 4, 4, 1]  # tokens 1, 2-5, 6-9 and the last with the end


def test_a_full_queue_refuses_with_503(runner, prompts):
    scheduler = make_scheduler(runner, max_queued_requests=2, max_running_requests=1)
    # Arriving together at an idle server: one takes the running slot, two queue.
    assert [add(scheduler, rid, prompts[i]) for i, rid in enumerate("abc")] == [None] * 3
    refused = add(scheduler, "d", prompts[3])
    reason = refused.output.finish_reason
    assert (reason.type, reason.status_code, reason.rejected) == ("abort", 503, "queue_full")
    assert "--max-queued-requests 2" in reason.message
    scheduler.step()  # a runs; b and c still queue
    assert add(scheduler, "d", prompts[3]).output.finish_reason.rejected == "queue_full"
    scheduler.abort(AbortReq(rid="b"))
    assert add(scheduler, "d", prompts[3]) is None
    scheduler.abort(AbortReq(abort_all=True))
    scheduler.check_integrity()


def test_queued_prompt_tokens_are_bounded(runner, prompts):
    limit = len(prompts[0]) + len(prompts[1])
    scheduler = make_scheduler(runner, max_total_queued_tokens=limit, max_running_requests=1)
    assert add(scheduler, "runs", prompts[2] * 30) is None  # to the free running slot: not queued
    assert add(scheduler, "big", prompts[0] * 20) is None  # an empty queue takes any prompt
    refused = add(scheduler, "a", prompts[1])
    assert refused.output.finish_reason.rejected == "queued_tokens"
    assert "--max-total-queued-tokens" in refused.output.finish_reason.message
    scheduler.abort(AbortReq(abort_all=True))
    assert [add(scheduler, rid, prompts[i]) for i, rid in zip((2, 0, 1), ("runs", "a", "b"), strict=True)] == [None] * 3
    assert add(scheduler, "c", prompts[2]).output.finish_reason.status_code == 503
    scheduler.abort(AbortReq(abort_all=True))


@pytest.mark.parametrize("long1_waited_s", [0.0, 2.0])
def test_a_cached_prompt_does_not_wait_behind_long_prompts_queued_before_it(runner, prompts, long1_waited_s):
    """fcfs, but a request whose prompt the radix cache holds is admitted before the longer
    ones ahead of it: its first token comes with the first step, not after their chunks. It
    does not pass one that has waited CHEAP_OVERTAKES_S or more."""
    scheduler = make_scheduler(runner, max_prefill_tokens=64, chunked_prefill_size=64)
    run(scheduler, [prompts[0]])  # now in the cache
    params = SamplingParams(max_new_tokens=2, temperature=0, ignore_eos=True)
    for rid, ids in [("long1", prompts[1] * 10), ("long2", prompts[2] * 10), ("cached", prompts[0])]:
        scheduler.add_request(TokenizedGenerateReqInput(rid=rid, input_ids=ids, sampling_params=params, stream=True))
    for req in scheduler.waiting:
        req.queued_at += 60  # still recent however slowly this machine steps (a loaded CI machine: 1 s passed)
    if long1_waited_s:
        scheduler.waiting[0].queued_at -= 60 + long1_waited_s
    first_token_step: dict[str, int] = {}
    for step in itertools.count():
        if scheduler.is_idle:
            break
        for out in scheduler.step():
            if out.output.new_token_ids:
                first_token_step.setdefault(out.output.rid, step)
    steps = first_token_step
    if long1_waited_s < CHEAP_OVERTAKES_S:
        assert steps["cached"] == 0 < steps["long1"] < steps["long2"], steps
    else:
        assert steps["long1"] <= steps["cached"] < steps["long2"], steps
    scheduler.check_integrity()


def test_a_cheap_request_does_not_pass_one_resuming_after_a_retraction():
    class Cache:
        def cached_prefix_len(self, req) -> int:
            return 0

    def req(rid: str, length: int, output_ids: list[int]) -> Req:
        made = Req(rid, list(range(length)), SamplingParams())
        made.output_ids = output_ids
        return made

    resumed, new_long, cheap = req("resumed", 500, [1, 2]), req("long", 500, []), req("cheap", 8, [])
    order = order_waiting([resumed, new_long, cheap], "fcfs", Cache(), time.monotonic())
    assert [r.rid for r in order] == ["resumed", "cheap", "long"]


def test_higher_priority_runs_first_then_arrival(runner, prompts):
    scheduler = make_scheduler(runner, schedule_policy="priority", max_running_requests=1)
    for rid, priority in [("low0", 0), ("low1", 0), ("high", 5), ("mid", 2)]:
        add(scheduler, rid, prompts[0], max_new_tokens=2, priority=priority)
    order = []
    while not scheduler.is_idle:
        order += [out.output.rid for out in scheduler.step() if out.output.finish_reason is not None]
    assert order == ["high", "mid", "low0", "low1"]


def test_priority_preemption_retracts_the_lowest_and_it_resumes_unchanged(runner, prompts, alone):
    scheduler = make_scheduler(runner, schedule_policy="priority", priority_preemption=True, max_running_requests=2)
    add(scheduler, "r0", prompts[0], max_new_tokens=NEW_TOKENS, priority=1)
    add(scheduler, "r1", prompts[1], max_new_tokens=NEW_TOKENS, priority=0)
    for _ in range(4):
        scheduler.step()
    add(scheduler, "urgent", prompts[2], max_new_tokens=NEW_TOKENS, priority=9)
    tokens: dict[str, list[int]] = {"r0": [], "r1": [], "urgent": []}
    order = []
    while not scheduler.is_idle:
        for out in scheduler.step():
            tokens[out.output.rid] += out.output.new_token_ids
            if out.output.finish_reason is not None:
                order.append(out.output.rid)
        scheduler.check_integrity()
    assert scheduler.num_retractions == 1  # r1, the lower of the two running
    assert order.index("urgent") < order.index("r1")
    assert [tokens["r0"], tokens["r1"], tokens["urgent"]] == alone[:3]


@pytest.fixture(scope="module")
def hf_last_hidden(transformers_default_model):
    """transformers' final (normed) hidden states of a prompt, on the same GGUF weights."""
    model = transformers_default_model.model

    def last_hidden(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]

    return last_hidden


def embed(scheduler: Scheduler, prompts: list[list[int]], generate: list[int] | None = None) -> list[torch.Tensor]:
    """Run embedding requests (beside one generation, if given) to the end; their vectors."""
    from sluice.messages import TokenizedEmbeddingReqInput

    if generate is not None:
        add(scheduler, "gen", generate, max_new_tokens=8)
    for i, ids in enumerate(prompts):
        assert scheduler.add_embedding_request(TokenizedEmbeddingReqInput(rid=f"e{i}", input_ids=ids)) is None
    vectors: dict[str, torch.Tensor] = {}
    while not scheduler.is_idle:
        for out in scheduler.step():
            if out.output.rid.startswith("e"):
                assert out.output.finish_reason.type == "length" and out.output.prompt_tokens > 0
                vectors[out.output.rid] = torch.frombuffer(bytearray(out.embedding), dtype=torch.float32)
        scheduler.check_integrity()
    return [vectors[f"e{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_embeddings_match_transformers_in_chunks_and_beside_generation(runner, prompts, hf_last_hidden, pooling):
    long_prompt = prompts[0] + prompts[1] + prompts[2]
    chosen = [prompts[3], long_prompt, prompts[5]]
    scheduler = make_scheduler(runner, pooling=pooling, chunked_prefill_size=16)  # the long one in chunks
    vectors = embed(scheduler, chosen, generate=prompts[6])
    for ids, vector in zip(chosen, vectors, strict=True):
        hidden = hf_last_hidden(ids)
        expected = {"last": hidden[-1], "mean": hidden.mean(dim=0), "cls": hidden[0]}[pooling]
        expected = torch.nn.functional.normalize(expected, dim=0)
        assert vector.shape == (runner.config.hidden_size,)
        assert ((vector - expected).norm() / expected.norm()).item() < 1e-3
    # Again, with every prompt in the radix cache and no generation beside: the vectors move
    # by rounding only (seen: up to 1.04e-4 for mean pooling on an AMX Xeon, on every kernel
    # build; a wrong prefix would be off by orders of magnitude more).
    again = embed(scheduler, chosen)
    for vector, cached in zip(vectors, again, strict=True):
        assert ((cached - vector).norm() / vector.norm()).item() < 2e-4, pooling


def test_embeddings_unnormalized_keep_their_length(runner, prompts, hf_last_hidden):
    scheduler = make_scheduler(runner, disable_embedding_normalization=True)
    [vector] = embed(scheduler, [prompts[4]])
    expected = hf_last_hidden(prompts[4])[-1]
    assert ((vector - expected).norm() / expected.norm()).item() < 1e-3
