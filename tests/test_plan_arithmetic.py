"""The planner's pure arithmetic: candidates, the bracketed search, the step-time ranking, rule of thumb."""

import random

import pytest

from hypothesis import given, settings, strategies as st

from migration.planning.search import (
    RECOMPUTE_FACTOR,
    REMAT_ORDER,
    StepCostModel,
    batch_candidates,
    describe_choice,
    exact_candidates,
    largest_fitting,
    rank_choices,
    rule_of_thumb_batch,
)


def test_candidates_by_granularity():
    assert batch_candidates(40, "multiple8") == [1, 2, 4, 8, 16, 24, 32, 40]
    assert batch_candidates(40, "pow2") == [1, 2, 4, 8, 16, 32, 40]  # the needed batch is always a candidate
    assert batch_candidates(3, "multiple8") == [1, 2, 3]


@pytest.mark.parametrize("seed", range(25))
def test_search_finds_the_boundary_and_probes_few_candidates(seed):
    rng = random.Random(seed)
    candidates = batch_candidates(rng.choice([64, 256, 1000]), rng.choice(["multiple8", "pow2"]))
    fixed, per_example, curve = rng.uniform(1, 50), rng.uniform(0.1, 2), rng.uniform(0, 0.01)
    probes = []

    def measure(b):
        probes.append(b)
        return fixed + per_example * b + curve * b * b  # monotone, not quite affine

    budget = rng.uniform(0.5 * fixed, fixed + per_example * candidates[-1] * 1.2)
    found = largest_fitting(candidates, measure, budget)
    fits = [c for c in candidates if measure(c) <= budget]
    assert found == (max(fits) if fits else 0)
    assert len(set(probes[: -len(candidates)])) <= 2 + len(candidates).bit_length() + 2


def test_search_respects_a_known_fit_and_a_first_guess():
    candidates = list(range(1, 101))
    probes = []
    measure = lambda b: probes.append(b) or float(b)
    assert largest_fitting(candidates, measure, 57.5, known_fit=40, first_guess=57) == 57
    assert min(probes) > 40 and len(probes) <= 3


def test_search_returns_zero_when_nothing_fits_and_none_means_no_fit():
    assert largest_fitting([1, 2, 4], lambda b: None, 10) == 0
    assert largest_fitting([1, 2, 4], lambda b: 100.0, 10) == 0


# transformer/small-like: 512 tokens per example, an A100's 108 SMs x 128 rows to fill it
A100_LIKE = StepCostModel(flops_per_example=1.0e11, rows_per_example=512, fill_rows=108 * 128, peak_flops=312e12)


def test_no_remat_with_accumulation_beats_full_remat_without():
    """The issue's case: none fits 64 per GPU, full fits 256; 64 x 4 without recompute is faster."""
    ranked = rank_choices({"none": 64, "full": 256}, batch_candidates(256, "multiple8"), 256, 1, A100_LIKE)
    best = ranked[0]
    assert (best.remat, best.per_device_batch, best.accumulation_steps) == ("none", 64, 4)
    full = next(c for c in ranked if c.remat == "full" and c.per_device_batch == 256)
    assert full.step_cost == pytest.approx(best.step_cost * RECOMPUTE_FACTOR["full"])
    assert all(c.exact and c.per_device_batch * c.accumulation_steps == 256 for c in ranked)


def test_micro_batches_too_small_to_fill_the_gpu_are_penalised():
    # none fits only 2 per GPU (1,024 rows of 13,824): full remat at 64 is faster despite recompute.
    ranked = rank_choices({"none": 2, "full": 64}, batch_candidates(64, "multiple8"), 64, 1, A100_LIKE)
    assert ranked[0].remat == "full" and ranked[0].per_device_batch >= 27
    small = next(c for c in ranked if c.remat == "none" and c.per_device_batch == 2)
    assert small.fill == pytest.approx(1024 / 13824) and small.step_cost > ranked[0].step_cost


def test_ties_go_to_fewer_accumulation_steps():
    ranked = rank_choices({"none": 256}, batch_candidates(256, "multiple8"), 256, 1, A100_LIKE)
    assert (ranked[0].per_device_batch, ranked[0].accumulation_steps) == (256, 1)


def test_an_exact_choice_wins_and_a_faster_inexact_one_is_shown_as_an_alternative():
    # 250 = 2 x 125: exact but tiny micro-batches; 32 x 8 = 256 changes the global batch but fills the GPU.
    ranked = rank_choices({"none": 48}, batch_candidates(250, "multiple8"), 250, 1, A100_LIKE)
    assert ranked[0].exact and ranked[0].per_device_batch * ranked[0].accumulation_steps == 250
    alternative = [c for c in ranked if not c.exact]
    assert [(c.per_device_batch, c.accumulation_steps) for c in alternative] == [(32, 8)]
    assert alternative[0].step_cost < ranked[0].step_cost


def test_without_any_exact_choice_the_fastest_per_example_and_closest_comes_first():
    # 251 is prime: only batch 1 keeps it, and with max_accumulation 64 not even that. 4 x 63 = 252
    # is closer but fills 15% of the GPU; 32 x 8 = 256 fills it.
    ranked = rank_choices({"none": 48}, [1, 2, 4, 8, 16, 24, 32, 40, 48], 251, 1, A100_LIKE, max_accumulation=64)
    assert ranked and not any(c.exact for c in ranked)
    assert (ranked[0].per_device_batch, ranked[0].global_batch) == (32, 256)
    assert "instead of 251" in describe_choice(ranked[0], 251, 1)


def test_an_accumulation_override_fixes_the_steps():
    ranked = rank_choices({"none": 64, "full": 256}, batch_candidates(256, "multiple8"), 256, 1, A100_LIKE,
                          accumulation=2)
    assert {c.accumulation_steps for c in ranked} == {2} and ranked[0].remat == "full"


@settings(max_examples=200, deadline=None)
@given(maxima=st.lists(st.integers(0, 300), min_size=1, max_size=4), global_batch=st.integers(1, 4096),
       gpus=st.integers(1, 8), rows=st.integers(1, 4096))
def test_ranking_is_sorted_and_within_each_policys_fit(maxima, global_batch, gpus, rows):
    max_batch = dict(zip(REMAT_ORDER, maxima))
    model = StepCostModel(1e9, rows, 132 * 128, 989e12)
    candidates = batch_candidates(max(1, -(-global_batch // gpus)), "multiple8")
    ranked = rank_choices(max_batch, candidates, global_batch, gpus, model)
    costs = [c.step_cost for c in ranked if c.exact]
    assert costs == sorted(costs)
    assert all(c.exact for c in ranked[:len(costs)])  # exact choices first
    for c in ranked:
        assert c.per_device_batch >= 1 and c.per_device_batch <= max_batch[c.remat]
        assert c.global_batch == c.per_device_batch * gpus * c.accumulation_steps
        assert c.exact == (c.global_batch == global_batch)


def test_exact_candidates_only_when_they_leave_no_wide_gap():
    assert exact_candidates(batch_candidates(256, "multiple8"), 256, 1) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert exact_candidates(batch_candidates(250, "multiple8"), 250, 1) is None


def test_rule_of_thumb_is_the_guides_formula():
    # The guide's worked example: 42M parameters in float32, an 80 GB card's limit.
    batch, note = rule_of_thumb_batch(80e9 * 0.8, 42_000_000)
    assert batch == 64 and "capped" in note
    assert rule_of_thumb_batch(1e9, 1_000_000_000)[0] == 1
