import math
import signal

import pytest
import torch

from sluice.messages import SamplingParams
from sluice.model.sampler import SamplingBatch, sample
from sluice.sampling import ClientError, validate_sampling_params

EOS = 3


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    output_ids: list[list[int]] | None = None,
    prompt_ids: list[list[int]] | None = None,
    top_logprobs_nums: list[int] | None = None,
):
    rows = len(params)
    batch = SamplingBatch.build(
        params,
        output_ids or [[] for _ in range(rows)],
        prompt_ids or [[] for _ in range(rows)],
        eos_token_ids=[EOS],
        vocab_size=logits.shape[1],
    )
    return sample(logits, batch, top_logprobs_nums or [0] * rows)


def frequencies(tokens: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab_size).double() / len(tokens)


@pytest.fixture(autouse=True)
def fixed_rng():
    torch.manual_seed(1234)


# ---------------------------------------------------------------- greedy and filters


def test_greedy_is_argmax_and_logits_are_left_unchanged():
    logits = torch.randn(8, 1000)
    before = logits.clone()
    out = run(logits, [SamplingParams(temperature=0.0)] * 8)
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert torch.equal(logits, before)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(8, 1000)
    out = run(logits, [SamplingParams(temperature=1.5, top_k=1)] * 8)
    assert out.next_token_ids == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_most_likely_token():
    logits = torch.randn(64, 1000)
    out = run(logits, [SamplingParams(temperature=1.0, top_p=1e-6)] * 64)
    assert out.next_token_ids == logits.argmax(-1).tolist()


def run_or_time_out(*args, **kwargs):
    """`run`, failing instead of hanging: a sampler that loops forever hangs the Scheduler."""

    def hung(signum, frame):
        raise TimeoutError("sampling did not end")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        return run(*args, **kwargs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("top_k", [-1, 50])
def test_top_p_too_small_for_float32_still_keeps_the_most_likely_token(top_k):
    # 5e-324 passes validation (> 0) but is 0 in float32: the rejection loop never ended.
    logits = torch.randn(4, 1000)
    out = run_or_time_out(logits, [SamplingParams(temperature=1.0, top_k=top_k, top_p=5e-324)] * 4)
    assert out.next_token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("top_p", [1.0, 0.5])
def test_a_temperature_too_large_for_float32_samples_uniformly_among_allowed_tokens(top_p):
    # 1e300 passes validation (finite) but is inf in float32: EOS, masked to -inf until
    # min_new_tokens, became NaN and the top_p loop never ended.
    params = SamplingParams(temperature=1e300, top_p=top_p, min_new_tokens=3, max_new_tokens=5)
    out = run_or_time_out(torch.randn(64, 50), [params] * 64)
    assert EOS not in out.next_token_ids and len(set(out.next_token_ids)) > 10


def test_nan_logits_end_the_top_p_loop():
    # Whatever made them NaN, sampling returns (an arbitrary token) instead of spinning.
    out = run_or_time_out(torch.full((2, 50), math.nan), [SamplingParams(temperature=1.0, top_p=0.5)] * 2)
    assert all(0 <= token < 50 for token in out.next_token_ids)


def test_greedy_rows_stay_argmax_in_a_batch_with_random_rows():
    logits = torch.randn(6, 500)
    params = [SamplingParams(temperature=0.0 if row % 2 else 1.0, top_p=0.9) for row in range(6)]
    out = run(logits, params)
    assert [out.next_token_ids[row] for row in (1, 3, 5)] == logits[[1, 3, 5]].argmax(-1).tolist()


def test_temperature_sampling_follows_softmax():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = probs.log().repeat(2000, 1)
    for temperature in (1.0, 2.0):
        out = run(logits, [SamplingParams(temperature=temperature)] * 2000)
        expected = torch.softmax(probs.log() / temperature, -1).double()
        assert torch.allclose(frequencies(out.next_token_ids, 4), expected, atol=0.04)


def test_top_k_samples_only_the_k_best_renormalised():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = probs.log().repeat(2000, 1)
    out = run(logits, [SamplingParams(temperature=1.0, top_k=2)] * 2000)
    expected = torch.tensor([0.4 / 0.7, 0.3 / 0.7, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(frequencies(out.next_token_ids, 4), expected, atol=0.04)


def test_min_p_drops_tokens_below_the_share_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(1000, 1)
    out = run(logits, [SamplingParams(temperature=1.0, min_p=0.5)] * 1000)
    assert set(out.next_token_ids) == {0, 1}


def nucleus(logits_row: torch.Tensor, top_p: float) -> set[int]:
    probs, token_ids = torch.softmax(logits_row.double(), -1).sort(descending=True)
    kept = (probs.cumsum(-1) - probs) < top_p
    return set(token_ids[kept].tolist())


def test_top_p_samples_the_renormalised_nucleus():
    # Mass before token 2 is 0.75 < 0.8, so the nucleus is {0, 1, 2}.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = probs.log().repeat(2000, 1)
    out = run(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 2000)
    expected = torch.tensor([0.5, 0.25, 0.15, 0.0], dtype=torch.float64) / 0.9
    assert torch.allclose(frequencies(out.next_token_ids, 4), expected, atol=0.04)


@pytest.mark.parametrize("slope", [0.5, 0.002], ids=["peaked", "flat"])
def test_top_p_samples_within_the_nucleus(slope):
    vocab_size = 2048
    row = -slope * torch.randperm(vocab_size).float()
    logits = row.repeat(400, 1)
    out = run(logits, [SamplingParams(temperature=1.0, top_p=0.8)] * 400)
    allowed = nucleus(row, 0.8)
    assert set(out.next_token_ids) <= allowed
    if slope < 0.01:  # a wide nucleus is sampled widely, not cut short
        assert len(set(out.next_token_ids)) > 200


def test_top_k_then_top_p_on_the_renormalised_top_k():
    # Within the top 3 the probabilities are 0.5/0.9, 0.25/0.9, 0.15/0.9; mass before
    # token 2 is 0.83 >= 0.8, so top_p keeps {0, 1}.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = probs.log().repeat(2000, 1)
    out = run(logits, [SamplingParams(temperature=1.0, top_k=3, top_p=0.8)] * 2000)
    expected = torch.tensor([2 / 3, 1 / 3, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(frequencies(out.next_token_ids, 4), expected, atol=0.04)


def test_top_k_and_top_p_rows_share_a_batch():
    vocab_size = 2048
    row = -0.002 * torch.randperm(vocab_size).float()
    logits = row.repeat(300, 1)
    params = [SamplingParams(temperature=1.0, top_k=5) if i % 3 == 0 else SamplingParams(top_p=0.8) for i in range(300)]
    out = run(logits, params)
    top5 = set(row.topk(5).indices.tolist())
    allowed = nucleus(row, 0.8)
    for i, token in enumerate(out.next_token_ids):
        assert token in (top5 if i % 3 == 0 else allowed)


# ---------------------------------------------------------------- seeds


def seeded_tokens(
    logits_steps: list[torch.Tensor], params: SamplingParams, others: list[SamplingParams], position: int
):
    """The tokens a seeded row gets over several steps when placed among `others`."""
    tokens: list[int] = []
    for logits_row in logits_steps:
        batch_params = [*others[:position], params, *others[position:]]
        logits = torch.randn(len(batch_params), logits_row.shape[0])
        logits[position] = logits_row
        outputs = [[7] * len(tokens) for _ in batch_params]
        tokens.append(run(logits, batch_params, output_ids=outputs).next_token_ids[position])
    return tokens


@pytest.mark.parametrize(
    "params",
    [SamplingParams(seed=42), SamplingParams(seed=42, top_p=0.9), SamplingParams(seed=42, top_k=20, min_p=0.05)],
    ids=["temperature", "top_p", "top_k_min_p"],
)
def test_seeded_row_ignores_batch_composition_and_position(params):
    steps = [torch.randn(1000) * 0.5 for _ in range(10)]
    alone = seeded_tokens(steps, params, [], 0)
    others = [SamplingParams(temperature=0.0), SamplingParams(top_k=100), SamplingParams(top_p=0.5), SamplingParams()]
    assert seeded_tokens(steps, params, others, 2) == alone
    assert seeded_tokens(steps, params, others, 4) == alone
    other_seed = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__}, "seed": 43})
    assert seeded_tokens(steps, other_seed, [], 0) != alone


# ---------------------------------------------------------------- penalties and min_new_tokens


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, 1.9, 0.0, -9.0], [-1.0, -1.2, -5.0, -9.0]])
    plain = run(logits, [SamplingParams(temperature=0.0)] * 2)
    assert plain.next_token_ids == [0, 0]
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5)] * 2
    # Token 0 seen in the prompt of row 0 and in the output of row 1.
    out = run(logits, params, output_ids=[[], [0]], prompt_ids=[[0], []])
    assert out.next_token_ids == [1, 1]


def test_repetition_penalty_applies_once_however_often_a_token_was_seen():
    logits = torch.tensor([[2.0, 1.5, 0.0, -9.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    assert run(logits, params, output_ids=[[0, 0]], prompt_ids=[[0, 0, 0]]).next_token_ids == [0]


def test_frequency_penalty_scales_with_the_count_in_the_output():
    logits = torch.tensor([[3.0, 2.5, 0.0, -9.0]] * 2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.3)] * 2
    # The prompt does not count.
    out = run(logits, params, output_ids=[[0], [0, 0]], prompt_ids=[[0, 0, 0], []])
    assert out.next_token_ids == [0, 1]


def test_presence_penalty_applies_once_whatever_the_count():
    logits = torch.tensor([[3.0, 2.5, 0.0, -9.0]] * 2)
    params = [
        SamplingParams(temperature=0.0, presence_penalty=0.4),
        SamplingParams(temperature=0.0, presence_penalty=0.6),
    ]
    out = run(logits, params, output_ids=[[0, 0, 0, 0], [0]])
    assert out.next_token_ids == [0, 1]


def test_penalties_touch_only_their_own_row():
    logits = torch.tensor([[3.0, 2.5, 0.0, -9.0]] * 2)
    params = [SamplingParams(temperature=0.0, frequency_penalty=2.0), SamplingParams(temperature=0.0)]
    out = run(logits, params, output_ids=[[0], [0]])
    assert out.next_token_ids == [1, 0]


def test_min_new_tokens_blocks_eos_and_stop_token_ids_until_reached():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])  # EOS == 3, then stop token 2
    params = [SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=[2])]
    assert run(logits, params, output_ids=[[]]).next_token_ids == [1]
    assert run(logits, params, output_ids=[[1]]).next_token_ids == [1]
    assert run(logits, params, output_ids=[[1, 1]]).next_token_ids == [EOS]


def test_ignore_eos_does_not_change_sampling():
    logits = torch.tensor([[0.0, 1.0, 5.0, 9.0]])
    assert run(logits, [SamplingParams(temperature=0.0, ignore_eos=True)]).next_token_ids == [EOS]


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_the_models_own_at_the_chosen_token():
    logits = torch.randn(4, 300)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5),
    ]
    out = run(logits, params, output_ids=[[], [], [], [1, 2, 3]])
    expected = torch.log_softmax(logits, -1)
    for row, (token, logprob) in enumerate(zip(out.next_token_ids, out.logprobs, strict=True)):
        assert logprob == pytest.approx(expected[row, token].item(), abs=1e-5)


def test_top_logprobs_are_sorted_and_match_log_softmax():
    logits = torch.randn(3, 300)
    out = run(logits, [SamplingParams(temperature=0.0)] * 3, top_logprobs_nums=[5, 0, 2])
    assert [len(t) for t in out.top_logprobs] == [5, 0, 2]
    expected = torch.log_softmax(logits, -1)
    for row, top in enumerate(out.top_logprobs):
        assert [t for t, _ in top] == expected[row].topk(len(top)).indices.tolist()
        assert [lp for _, lp in top] == pytest.approx(expected[row].topk(len(top)).values.tolist(), abs=1e-5)
        assert [lp for _, lp in top] == sorted((lp for _, lp in top), reverse=True)


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_new_tokens", -1),
        ("min_new_tokens", -1),
        ("min_new_tokens", 200),  # above max_new_tokens=128
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2**31),
        ("top_k", 2**100),  # more than msgpack can carry to the Scheduler
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", math.nan),
        ("repetition_penalty", 1e-45),  # 0 as a float32: the logits it divides become inf
        ("repetition_penalty", 1e39),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("seed", -1),
        ("seed", 2**63),
        ("stop", [""]),
        ("stop", ["x" * 257]),
        ("stop", ["s"] * 17),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1000]),  # vocab_size is 1000
    ],
)
def test_out_of_range_field_raises_client_error_naming_it(field, value):
    with pytest.raises(ClientError) as caught:
        validate_sampling_params(SamplingParams(**{field: value}), vocab_size=1000)
    assert caught.value.param == field
    assert caught.value.message.startswith(f"{field} must ")
    if not isinstance(value, list):
        assert caught.value.message.endswith(f", got {value}")


def test_message_states_the_allowed_range():
    with pytest.raises(ClientError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        validate_sampling_params(SamplingParams(top_p=1.5))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(top_k=0),
        SamplingParams(top_k=-1, top_p=1.0, temperature=0.0, seed=0, stop=["\n\n"], stop_token_ids=[999]),
        SamplingParams(max_new_tokens=0, min_new_tokens=0, min_p=1.0, frequency_penalty=-2, presence_penalty=2),
    ],
)
def test_in_range_params_pass(params):
    validate_sampling_params(params, vocab_size=1000)


def test_logit_bias_is_added_before_the_choice():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=0, logit_bias={0: -100.0}), SamplingParams(temperature=0, logit_bias={1: 2.5})]
    batch = SamplingBatch.build(params, [[], []], [[1], [1]], eos_token_ids=[], vocab_size=4)
    assert sample(logits, batch, [0, 0], with_logprobs=False).next_token_ids == [1, 1]
    # A forced token wins at any temperature; logits themselves are left unchanged.
    hot = [SamplingParams(temperature=1.0, seed=s, logit_bias={2: 100.0}) for s in range(2)]
    batch = SamplingBatch.build(hot, [[], []], [[1], [1]], eos_token_ids=[], vocab_size=4)
    assert sample(logits, batch, [0, 0]).next_token_ids == [2, 2]
    assert logits[0, 0] == 3.0


def test_a_grammar_keeps_only_its_tokens_and_wins_over_min_new_tokens():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0]])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, min_new_tokens=5)]
    batch = SamplingBatch.build(params, [[], []], [[1], [1]], eos_token_ids=[3], vocab_size=4)
    # Row 0 may only say 2; row 1's grammar allows only the EOS that min_new_tokens bans.
    batch.allowed = (torch.tensor([0, 1]), torch.tensor([[False, False, True, False], [False, False, False, True]]))
    assert sample(logits, batch, [0, 0]).next_token_ids == [2, 3]
