"""Sampling: parameter validation, penalties, temperature, top-k / top-p / min-p filters and token choice."""

import math

import pytest
import torch

from generate.engine.sampling import BLOCK, SamplingParams, apply_penalties, argmax_rows, sample_row, uniform
from helpers import choose, filter_logits

V = 20


def random_logits(rows: int = 6, vocab: int = V, seed: int = 0, scale: float = 2.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=g) * scale


def uniforms(seeds: list[int] | range, position: int = 0) -> list[float]:
    """Each seed's uniform number at ``position``: what the engine hands ``choose`` for its rows."""
    return [uniform(s, position) for s in seeds]


# --- brute-force references (float64, one row at a time) ---------------------------------------------


def allowed_set(row: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens the filters keep, computed from their definitions, applied in the documented order."""
    scaled = row.double() / params.temperature
    keep = list(range(row.numel()))
    if params.top_k > 0:
        keep = sorted(keep, key=lambda i: -scaled[i].item())[: params.top_k]
    if params.top_p < 1.0:
        probs = torch.softmax(scaled[keep], dim=0).tolist()
        ranked = sorted(zip(probs, keep, strict=True), key=lambda pair: (-pair[0], pair[1]))  # ties: lower id
        total, prefix = 0.0, []
        for p, i in ranked:  # the smallest prefix whose probability sum reaches top_p
            prefix.append(i)
            total += p
            if total >= params.top_p:
                break
        keep = prefix
    if params.min_p > 0.0:
        probs = torch.softmax(scaled[keep], dim=0)
        top = probs.max().item()
        keep = [i for i, p in zip(keep, probs.tolist(), strict=True) if p >= params.min_p * top]
    return set(keep)


def finite_set(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


# --- SamplingParams validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("min_p", 1.0),
        ("min_p", -0.1),
        ("min_p", math.inf),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("presence_penalty", 3.0),
        ("presence_penalty", -3.0),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -3.0),
        ("frequency_penalty", False),
        ("temperature", "1.0"),
        ("temperature", 10**400),  # an int no float holds: refused, not an OverflowError
    ],
)
def test_out_of_range_parameter_raises_naming_it(name, value):
    expected = rf"^{name}=.* is (out of range|not a finite number); {name} must be "
    with pytest.raises(ValueError, match=expected):
        SamplingParams(**{name: value})


def test_infinity_is_said_to_be_not_finite_and_a_huge_value_is_shortened():
    with pytest.raises(ValueError, match=r"^temperature=inf is not a finite number; temperature must be >="):
        SamplingParams(temperature=math.inf)
    with pytest.raises(ValueError, match=r"^temperature=10000000000000000000\.\.\.\(401 characters\) is not"):
        SamplingParams(temperature=10**400)


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-40, 1e-30])
def test_a_tiny_temperature_samples_the_most_likely_token(temperature):
    # Below fp32's smallest normal number the temperature would round to 0 (0/0 at the top logit); such
    # rows are divided in float64. The limit of a temperature going to 0 is the argmax (ties shared).
    torch.manual_seed(0)
    logits = torch.randn(3, 50)
    logits[2, 7] = logits[2].max() + 1e-3  # a clear winner by a hair
    params = SamplingParams(temperature=temperature)
    assert torch.equal(choose(logits, params, uniforms(range(3))), logits.argmax(-1))
    token, logprob, _ = sample_row(logits[0], params, uniform(0, 0), logprobs=True)
    assert token == int(logits[0].argmax()) and math.isfinite(logprob)


def test_a_token_chosen_for_many_rows_at_once_is_recorded_as_if_chosen_here():
    # The engine takes plain greedy rows' argmax for all rows in one call and hands each row its token.
    torch.manual_seed(1)
    logits = torch.randn(4, 30)
    logits[1, 3] = logits[1, 9] = logits[1].max() + 1.0  # a tie: both ways give the first index
    greedy = SamplingParams(temperature=0)
    batched = logits.argmax(-1).tolist()
    for i in range(4):
        alone = sample_row(logits[i], greedy, 0.5, logprobs=True, top=2)
        seen, counts = torch.zeros(30, dtype=torch.bool), torch.zeros(30, dtype=torch.int32)
        given = sample_row(logits[i], greedy, 0.5, seen, counts, token=batched[i], logprobs=True, top=2)
        assert given == alone and given[0] == batched[i]
        assert seen.nonzero().flatten().tolist() == [batched[i]] and int(counts.sum()) == 1
    assert batched[1] == 3


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"temperature": 0},
        {"temperature": 2.5, "top_k": 1, "top_p": 1.0, "min_p": 0.0},
        {"top_p": 1e-9, "min_p": 0.999},
        {"repetition_penalty": 1e-3, "presence_penalty": -2, "frequency_penalty": 2},
    ],
)
def test_in_range_parameters_are_accepted(kwargs):
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_greedy_and_penalized_flags():
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.1).penalized
    assert SamplingParams(presence_penalty=0.5).penalized
    assert SamplingParams(frequency_penalty=-0.5).penalized


# --- filters --------------------------------------------------------------------------------------------

FILTER_SETTINGS = [
    SamplingParams(top_k=1),
    SamplingParams(top_k=3),
    SamplingParams(top_k=19),
    SamplingParams(top_p=0.3),
    SamplingParams(top_p=0.5),
    SamplingParams(top_p=0.9),
    SamplingParams(min_p=0.05),
    SamplingParams(min_p=0.2),
    SamplingParams(min_p=0.6),
    SamplingParams(temperature=0.5, top_p=0.8),
    SamplingParams(temperature=2.0, top_p=0.8),
    SamplingParams(top_k=8, top_p=0.7),
    SamplingParams(top_k=10, min_p=0.1),
    SamplingParams(top_p=0.95, min_p=0.1),
    SamplingParams(temperature=1.5, top_k=12, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", FILTER_SETTINGS, ids=repr)
def test_filter_keeps_exactly_the_brute_force_set(params):
    logits = random_logits(rows=8, seed=1)
    out = filter_logits(logits, params)
    for r in range(logits.shape[0]):
        expected = allowed_set(logits[r], params)
        assert finite_set(out[r]) == expected
        # The survivors keep their logits, shifted so the top one is 0 and divided by the temperature.
        kept = sorted(expected)
        torch.testing.assert_close(out[r, kept], (logits[r, kept] - logits[r].max()) / params.temperature)


@pytest.mark.parametrize("params", FILTER_SETTINGS, ids=repr)
def test_sampled_tokens_stay_in_the_allowed_set(params):
    logits = random_logits(rows=4, seed=2)
    allowed = [allowed_set(logits[r], params) for r in range(logits.shape[0])]
    drawn = [set() for _ in allowed]
    for position in range(500):
        for r, token in enumerate(choose(logits, params, uniforms([10, 11, 12, 13], position)).tolist()):
            drawn[r].add(token)
    for r in range(logits.shape[0]):
        assert drawn[r] <= allowed[r]
        assert drawn[r]  # something was drawn


def test_tiny_top_p_keeps_the_most_likely_token_only():
    logits = random_logits(rows=5, seed=3)
    out = filter_logits(logits, SamplingParams(top_p=1e-9))
    for r in range(logits.shape[0]):
        assert finite_set(out[r]) == {int(logits[r].argmax())}
    draws = choose(logits, SamplingParams(top_p=1e-9), uniforms(range(5)))
    assert draws.tolist() == logits.argmax(-1).tolist()


def test_extreme_settings_keep_at_least_one_token():
    # A near-zero temperature makes the softmax one-hot; min_p close to 1 keeps only the maximum.
    logits = random_logits(rows=5, seed=4)
    for params in (SamplingParams(min_p=0.999), SamplingParams(temperature=1e-4, top_p=0.01, min_p=0.99)):
        out = filter_logits(logits, params)
        assert torch.isfinite(out).sum(-1).tolist() == [1] * 5
        assert out.argmax(-1).tolist() == logits.argmax(-1).tolist()


def test_disabled_filters_keep_everything():
    logits = random_logits(rows=3, seed=5)
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # the only change: top logit moved to 0
    out = filter_logits(logits, SamplingParams(top_k=0, top_p=1.0, min_p=0.0))
    torch.testing.assert_close(out, shifted)
    # top_k equal to (or above) the vocabulary size is no filter either.
    torch.testing.assert_close(filter_logits(logits, SamplingParams(top_k=V)), shifted)
    torch.testing.assert_close(filter_logits(logits, SamplingParams(top_k=V + 5)), shifted)


# --- temperature ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.25, 0.5, 1.0, 3.0])
def test_filter_divides_by_the_temperature(temperature):
    logits = random_logits(rows=3, seed=6)
    out = filter_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(out, (logits - logits.max(dim=-1, keepdim=True).values) / temperature)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1e-40), SamplingParams(repetition_penalty=1e-300),
     SamplingParams(repetition_penalty=1e300), SamplingParams(temperature=1e-30, repetition_penalty=1e-30)],
    ids=repr,
)  # fmt: skip
def test_extreme_but_valid_values_still_give_a_valid_choice(params):
    # Tiny temperatures or penalties overflow naive logit arithmetic to inf - inf = NaN; the choice must stay
    # defined: a tiny temperature is (near) greedy, and a huge penalty removes or boosts the seen tokens.
    logits = random_logits(rows=3, seed=8)
    seen = torch.zeros_like(logits, dtype=torch.bool)
    seen[:, :5] = True
    counts = torch.zeros_like(logits, dtype=torch.int32)
    processed = apply_penalties(logits, seen, counts, params)
    assert not processed.isnan().any()
    assert torch.isfinite(filter_logits(processed, params)).any(dim=-1).all()
    chosen = choose(processed, params, uniforms(range(3)))
    if params.repetition_penalty == 1.0:
        assert torch.equal(chosen, logits.argmax(-1))
    assert ((chosen >= 0) & (chosen < logits.shape[-1])).all()


def test_lower_temperature_is_sharper():
    logits = random_logits(rows=4, seed=7)

    def top_prob_and_entropy(t):
        probs = torch.softmax(filter_logits(logits, SamplingParams(temperature=t)), -1)
        entropy = -(probs * probs.log()).sum(-1)
        return probs.max(-1).values, entropy

    previous_top, previous_entropy = top_prob_and_entropy(4.0)
    for t in (2.0, 1.0, 0.5, 0.1):
        top, entropy = top_prob_and_entropy(t)
        assert (top > previous_top).all()
        assert (entropy < previous_entropy).all()
        previous_top, previous_entropy = top, entropy


def test_greedy_picks_the_argmax_without_uniform_numbers():
    logits = random_logits(rows=7, seed=8)
    assert choose(logits, SamplingParams(temperature=0), []).tolist() == logits.argmax(-1).tolist()
    # The filters do not matter when greedy.
    greedy_filtered = SamplingParams(temperature=0, top_k=2, top_p=0.1, min_p=0.5)
    assert choose(logits, greedy_filtered, []).tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize("vocab", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17, 50257])
def test_the_two_pass_argmax_is_torchs_first_index_ties_nan_and_infinities_included(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = torch.randn(9, vocab, generator=gen)
    rows[1] = 0.0  # every id ties: the first
    rows[2, vocab // 2 :] = rows[2].max() + 1  # a tie spanning blocks: its first id
    rows[3] = -math.inf
    rows[4, -1] = math.inf
    rows[5, vocab // 3], rows[5, -1] = math.nan, math.nan  # NaN counts as the maximum: its first
    rows[6] = torch.randint(0, 3, (vocab,), generator=gen).float()  # many ties in many blocks
    rows[7, -1] = rows[7].max() + 1  # in the last, part-padded block
    rows[8] = rows[8].round(decimals=1)
    padded = torch.full((9, -(-vocab // BLOCK) * BLOCK), -math.inf)
    padded[:, :vocab] = rows
    assert argmax_rows(padded).tolist() == rows.argmax(-1).tolist()


def test_very_low_temperature_sampling_is_the_argmax():
    logits = random_logits(rows=6, seed=9)
    draws = choose(logits, SamplingParams(temperature=1e-3), uniforms(range(6)))
    assert draws.tolist() == logits.argmax(-1).tolist()


# --- penalties ------------------------------------------------------------------------------------------


def penalty_inputs():
    logits = torch.tensor([[2.0, -1.5, 0.0, 0.5, -3.0, 1.0], [-0.5, 4.0, 1.5, -2.0, 0.0, 0.25]])
    seen = torch.tensor([[True, True, True, False, False, True], [False, True, False, True, True, False]])
    counts = torch.tensor([[2, 0, 1, 0, 0, 3], [0, 1, 0, 4, 2, 0]], dtype=torch.int32)
    return logits, seen, counts


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits, seen, counts = penalty_inputs()
    out = apply_penalties(logits, seen, counts, SamplingParams(repetition_penalty=2.0))
    expected = logits.clone()
    for r in range(2):
        for v in range(logits.shape[1]):
            if seen[r, v]:
                x = logits[r, v].item()
                expected[r, v] = x / 2.0 if x > 0 else x * 2.0
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    # Spot checks: seen positive 2.0 -> 1.0, seen negative -1.5 -> -3.0, unseen 0.5 unchanged.
    assert out[0, 0].item() == 1.0
    assert out[0, 1].item() == -3.0
    assert out[0, 3].item() == 0.5
    assert out[1, 1].item() == 2.0  # seen 4.0
    assert out[1, 0].item() == -0.5  # unseen negative


def test_repetition_penalty_below_one_rewards_seen_tokens():
    logits, seen, counts = penalty_inputs()
    out = apply_penalties(logits, seen, counts, SamplingParams(repetition_penalty=0.5))
    assert out[0, 0].item() == 4.0
    assert out[0, 1].item() == -0.75
    assert torch.equal(out[~seen], logits[~seen])


def test_presence_penalty_subtracts_once_for_any_count():
    logits, seen, counts = penalty_inputs()
    out = apply_penalties(logits, seen, counts, SamplingParams(presence_penalty=0.75))
    expected = logits - 0.75 * (counts > 0).float()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out[0, 5].item() == 1.0 - 0.75  # count 3: subtracted once, not three times
    assert out[0, 1].item() == -1.5  # seen (in the prompt) but count 0: untouched


def test_frequency_penalty_subtracts_count_times_penalty():
    logits, seen, counts = penalty_inputs()
    out = apply_penalties(logits, seen, counts, SamplingParams(frequency_penalty=0.5))
    expected = logits - 0.5 * counts.float()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert out[1, 3].item() == -2.0 - 4 * 0.5


def test_negative_presence_and_frequency_penalties_raise_logits():
    logits, seen, counts = penalty_inputs()
    out = apply_penalties(logits, seen, counts, SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5))
    torch.testing.assert_close(out, logits + (counts > 0).float() + 0.5 * counts.float(), rtol=0, atol=0)


def test_all_penalties_compose_in_the_documented_order():
    logits, seen, counts = penalty_inputs()
    params = SamplingParams(repetition_penalty=1.5, presence_penalty=0.25, frequency_penalty=0.125)
    out = apply_penalties(logits, seen, counts, params)
    expected = torch.empty_like(logits)
    for r in range(2):
        for v in range(logits.shape[1]):
            x = logits[r, v].item()
            if seen[r, v]:
                x = x / 1.5 if x > 0 else x * 1.5
            c = int(counts[r, v])
            x = x - 0.25 * (c > 0) - 0.125 * c
            expected[r, v] = x
    torch.testing.assert_close(out, expected)


def test_no_penalty_returns_the_logits_unchanged():
    logits, seen, counts = penalty_inputs()
    assert apply_penalties(logits, seen, counts, SamplingParams()) is logits


# --- per-row seeds and positions -------------------------------------------------------------------------


def test_a_rows_draws_depend_only_on_its_own_seed_and_position():
    params = SamplingParams(temperature=1.0)
    row = random_logits(rows=1, seed=20, scale=0.5)  # flat: many plausible tokens
    others = [random_logits(rows=2, seed=21, scale=0.5), random_logits(rows=3, seed=22, scale=3.0)]

    def draws(batch, where, seeds, n=40):
        return [choose(batch, params, uniforms(seeds, position))[where].item() for position in range(n)]

    alone = draws(row, 0, [123])
    first = draws(torch.cat([row, others[0]]), 0, [123, 7, 8])
    middle = draws(torch.cat([others[1][:1], row, others[1][1:]]), 1, [99, 123, 5, 6])
    last = draws(torch.cat([others[1], row]), 3, [1, 2, 3, 123])
    assert alone == first == middle == last
    assert len(set(alone)) > 3  # really sampled, not a constant
    assert draws(row, 0, [124]) != alone  # and another seed gives other draws


def test_the_uniform_number_is_a_fixed_function_of_seed_and_position_and_looks_uniform():
    assert uniform(7, 3) == uniform(7, 3) and uniform(0, 0) != uniform(0, 1) != uniform(1, 0)
    assert uniform(2**64 - 1, 10**6) < 1.0  # the largest seed
    # Over positions of one seed and over consecutive seeds at one position (a request's n choices use seed,
    # seed + 1, ...): 20 equal bins, a chi-square with 19 degrees of freedom (1e-6 tail: 57).
    for values in ([uniform(5, p) for p in range(20_000)], [uniform(s, 9) for s in range(20_000)]):
        assert min(values) >= 0.0 and max(values) < 1.0
        counts = torch.bincount((torch.tensor(values) * 20).long(), minlength=20).double()
        assert chi2(counts, torch.full((20,), 0.05, dtype=torch.float64)) < 57.0


def test_rows_with_equal_logits_and_seeds_draw_the_same_tokens():
    row = random_logits(rows=1, seed=30, scale=0.5)
    batch = row.expand(3, -1).contiguous()
    drawn = torch.stack([choose(batch, SamplingParams(), uniforms([5, 5, 6], p)) for p in range(30)])
    assert torch.equal(drawn[:, 0], drawn[:, 1])
    assert not torch.equal(drawn[:, 0], drawn[:, 2])


# --- the sampled distribution is exactly the filtered softmax ------------------------------------------

# Above the chi-square's 1e-6 tail for the <= 25 degrees of freedom here. The seeds are fixed, so a pass or
# fail is the same every run; a right sampler fails it with odds below one in a million.
CHI2_BOUND = 60.0


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize(
    ("params", "vocab", "scale"),
    [
        (SamplingParams(temperature=1.0), 12, 1.0),
        (SamplingParams(temperature=0.7, top_k=6), 12, 1.0),
        (SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02), 16, 1.0),
        (SamplingParams(temperature=0.6, top_k=9, top_p=0.8, min_p=0.05), 40, 1.0),  # top-p over top-k's
        # a large vocabulary (not a whole number of blocks) with a small nucleus
        (SamplingParams(temperature=0.8, top_p=0.9), 50_000, 5.0),
    ],
    ids=repr,
)
def test_draws_follow_the_filtered_softmax(params, vocab, scale):
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * scale
    allowed = sorted(allowed_set(logits, params))
    assert 2 <= len(allowed) <= 26
    probs = torch.softmax(logits.double()[allowed] / params.temperature, dim=0)
    n = 6_000  # one seed's tokens at n positions
    tokens = torch.tensor([sample_row(logits, params, uniform(4, position))[0] for position in range(n)])
    assert set(tokens.tolist()) <= set(allowed)
    counts = torch.tensor([float((tokens == t).sum()) for t in allowed], dtype=torch.float64)
    assert chi2(counts, probs) < CHI2_BOUND
    unfiltered = torch.softmax(logits.double()[allowed], dim=0)  # the test can fail: a wrong distribution
    assert params.temperature == 1.0 or chi2(counts, unfiltered) > CHI2_BOUND


def test_rejected_draws_are_drawn_again_until_one_lies_in_the_nucleus():
    # 12 likely tokens hold 40% of a 50,000-token vocabulary's mass and the nucleus half of it: most first
    # draws land outside it (among thousands of tied unlikely tokens) and are drawn again.
    g = torch.Generator().manual_seed(8)
    logits = torch.zeros(50_000)
    logits[torch.randperm(50_000, generator=g)[:12]] = 8.0 + 0.5 * torch.randn(12, generator=g)
    params = SamplingParams(top_p=0.2)
    allowed = sorted(allowed_set(logits, params))
    assert 2 <= len(allowed) <= 11
    tokens = torch.tensor([sample_row(logits, params, uniform(6, position))[0] for position in range(3000)])
    assert set(tokens.tolist()) <= set(allowed)
    counts = torch.tensor([float((tokens == t).sum()) for t in allowed], dtype=torch.float64)
    assert chi2(counts, torch.softmax(logits.double()[allowed], dim=0)) < CHI2_BOUND


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.99])
def test_every_token_drawn_passes_the_full_nucleus_check(top_p):
    # A likely token is kept without adding up the mass before it: each drawn token must pass that check
    # all the same, computed as the sampler computes it (float32, the tokens more likely, then ties before).
    params, kept_early = SamplingParams(temperature=0.8, top_p=top_p), 0
    for scale in (2.0, 4.0, 8.0):
        logits = torch.randn(50_257, generator=torch.Generator().manual_seed(int(scale))) * scale
        probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
        for position in range(150):
            token = sample_row(logits, params, uniform(4, position))[0]
            p = probs[token]
            mass = torch.dot(probs, (probs > p).to(probs.dtype)) + (probs[:token] == p).sum() * p
            assert mass < top_p or mass == 0, (scale, position, token, float(p), float(mass))
            kept_early += float(p) > 1 - top_p + (len(probs) + 3) * 2.0**-22
    assert kept_early > 50  # (the early keep was taken: the check is not vacuous)


def test_ties_at_the_nucleus_edge_keep_the_lower_ids():
    logits = torch.full((20,), -30.0)
    logits[3:7] = 0.0  # four tokens of probability ~1/4: top-p 0.4 keeps two of them
    params = SamplingParams(top_p=0.4)
    assert allowed_set(logits, params) == finite_set(filter_logits(logits[None], params)[0]) == {3, 4}
    assert {sample_row(logits, params, uniform(1, position))[0] for position in range(400)} == {3, 4}


def test_a_tiny_top_p_over_a_flat_large_vocabulary_draws_the_most_likely_token():
    logits = torch.randn(50_257, generator=torch.Generator().manual_seed(9)) * 0.1
    for position in range(5):  # (about log2(50,257) rejections each)
        assert sample_row(logits, SamplingParams(top_p=1e-9), uniform(3, position))[0] == int(logits.argmax())


@pytest.mark.parametrize("scale", [0.1, 1.0, 4.0, 12.0])  # flat (the whole vocabulary sorted) to peaked
@pytest.mark.parametrize("top_p", [1e-300, 0.3, 0.9, 0.999])
def test_top_p_keeps_the_full_sorts_set_over_a_large_vocabulary(scale, top_p):
    logits = torch.randn(3, 50_257, generator=torch.Generator().manual_seed(5)) * scale
    probs = torch.softmax(logits, dim=-1)
    values, order = probs.sort(dim=-1, descending=True)
    drop = (values.cumsum(-1) - values) >= top_p
    drop[:, 0] = False
    expected = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf")) - logits.amax(-1, True)
    assert torch.equal(filter_logits(logits, SamplingParams(top_p=top_p)), expected)
