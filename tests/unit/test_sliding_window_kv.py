"""Sliding-window layers' K/V in slots of their own (Gemma): a tiny random-weight Gemma 3
(one layer with a window of 8 keys, one global) in-process, its window slots dropped as soon
as the scheduler may (--swa-cache-tokens 0) or kept, with chunked prefill, shared prefixes and
prefixes continued after their window slots are gone: the same greedy tokens as transformers,
and the scheduler's slot invariants after every step."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from sluice.config import ServerArgs
from sluice.messages import SamplingParams, TokenizedGenerateReqInput
from sluice.model.model_runner import ModelRunner
from sluice.scheduler.process import default_max_total_tokens
from sluice.scheduler.scheduler import Scheduler
from tests.tiny_lms import build_tiny_model, hf_greedy

NEW_TOKENS = 10
WINDOW = 8  # tests.tiny_lms.gemma3_config


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    torch.set_num_threads(2)
    folder = tmp_path_factory.mktemp("tiny-gemma3")
    model = build_tiny_model(folder, "gemma3")
    runners = {mode: ModelRunner(str(folder), torch.float32, quantization=mode) for mode in ("none", "q8_0")}
    return model, runners


def make_scheduler(runner: ModelRunner, **overrides) -> Scheduler:
    args = dataclasses.replace(ServerArgs(dtype="float32", debug_checks=True), **overrides)
    return Scheduler(args, runner, 4000)


def run(scheduler: Scheduler, prompts: list[list[int]]) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens and cached prompt tokens of each prompt, all submitted at once."""
    for i, ids in enumerate(prompts):
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        assert (
            scheduler.add_request(TokenizedGenerateReqInput(rid=f"r{i}", input_ids=ids, sampling_params=params)) is None
        )
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    cached: dict[str, int] = {}
    while not scheduler.is_idle:
        for out in scheduler.step():
            tokens[out.output.rid].extend(out.output.new_token_ids)
            cached[out.output.rid] = out.output.cached_tokens
        scheduler.check_integrity()
        window_slots_needed = sum(min(r.kv_len, WINDOW) for r in scheduler.running)
        held = scheduler.kv.window_slots_held()
        assert held <= window_slots_needed + scheduler.args.swa_cache_tokens + len(scheduler.running)
    return tokens, cached


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 131 + 7 * i) % 4000 + 2 for i in range(length)]


@pytest.mark.parametrize("quantization", ["none", "q8_0"])
def test_window_slots_dropped_early_give_the_same_tokens(tiny_gemma, quantization):
    model, runners = tiny_gemma
    runner = runners[quantization]
    shared = prompt(1, 30)
    prompts = [prompt(2, 45), shared + prompt(3, 5), shared + prompt(4, 12), prompt(5, 3)]
    kept, _ = run(make_scheduler(runner, swa_cache_tokens=4000), prompts)
    # Two requests at a time: 2 * 9 + 9 window slots for 4000 token slots.
    dropping = make_scheduler(
        runner, swa_cache_tokens=0, chunked_prefill_size=7, max_prefill_tokens=9, max_running_requests=2
    )
    assert dropping.k_buffers[0].shape[0] == 2 * (WINDOW + 1) + 9 + 1  # layer 0 slides; slot 0 pads
    assert dropping.k_buffers[1].shape[0] == 4000 + 1
    dropped, _ = run(dropping, prompts)
    assert dropped == kept
    if quantization == "none":
        assert kept == {f"r{i}": hf_greedy(model, ids, NEW_TOKENS) for i, ids in enumerate(prompts)}


def test_a_prefix_is_continued_only_where_its_window_is_kept(tiny_gemma):
    model, runners = tiny_gemma
    first = prompt(6, 40)
    longer = first + prompt(7, 6)
    keeping = make_scheduler(runners["none"], swa_cache_tokens=4000)
    run(keeping, [first])
    tokens, cached = run(keeping, [longer])
    assert cached["r0"] == len(first)
    assert tokens["r0"] == hf_greedy(model, longer, NEW_TOKENS)

    # Nothing kept outside running windows: the cached prefix has lost its window, so the
    # longer prompt is computed again, and the cache's tokens take its window slots.
    dropping = make_scheduler(runners["none"], swa_cache_tokens=0)
    run(dropping, [first])
    assert dropping.kv.window_slots_held() == 0
    assert dropping.kv.cached() > 0
    tokens, cached = run(dropping, [longer])
    assert cached["r0"] == 0
    assert tokens["r0"] == hf_greedy(model, longer, NEW_TOKENS)
    tokens, cached = run(dropping, [longer + prompt(8, 3)])
    assert tokens["r0"] == hf_greedy(model, longer + prompt(8, 3), NEW_TOKENS)


def test_the_kv_budget_counts_window_layers_for_the_tokens_they_can_hold():
    """--kv-cache-memory-gb: the sliding layers' slots are as many as can be held at once, and
    the rest of the budget goes to the other layers' tokens."""
    args = ServerArgs(kv_cache_memory_gb=1.0, max_running_requests=4, max_prefill_tokens=100, swa_cache_tokens=200)
    # Gemma-3-1B-like: 22 of 26 layers slide (window 512), 1,024 bytes a layer a token.
    window_slots = 4 * 513 + 100 + 200
    tokens = default_max_total_tokens(args, 26 * 1024, 1_000_000, window=512, window_bytes=22 * 1024)
    assert tokens == (1024**3 - window_slots * 22 * 1024) // (4 * 1024)
    assert default_max_total_tokens(args, 26 * 1024, 1_000_000) == 1024**3 // (26 * 1024)
    # A window as long as the context: counting every layer for every token gives more.
    assert default_max_total_tokens(args, 26 * 1024, 1_000_000, window=10**6, window_bytes=22 * 1024) == 1024**3 // (
        26 * 1024
    )
    # Every layer sliding: as many tokens as the running requests' contexts.
    assert default_max_total_tokens(args, 26 * 1024, 5_000, window=512, window_bytes=26 * 1024) == 4 * 5_000


def test_running_windows_over_the_budget_drop_nothing_the_budget_allows():
    """Held window slots above --swa-cache-tokens because running requests' windows are long
    is no excess: the cache's window slots stay."""
    from sluice.scheduler.kv_manager import KVManager
    from sluice.scheduler.req import Req

    kv = KVManager(1000, 4, 1000, False, window=WINDOW, window_cache_tokens=20)
    cached = kv.alloc_tokens(20)
    kv.tree_cache.insert(prompt(9, 20), cached)
    running = []
    for i in range(3):  # three running requests of 8 tokens: their windows are all they hold
        req = Req(rid=f"w{i}", prompt_ids=prompt(10 + i, 9), sampling_params=SamplingParams())
        assert kv.admit(req)
        kv.req_to_token[req.req_pool_idx, :8] = kv.alloc_tokens(8)
        req.kv_len = 8
        running.append(req)
    kv.trim_window_slots(running)
    assert kv.window_slots_held() == 20 + 3 * 8
