"""The planner's pure arithmetic: candidates, the bracketed search, accumulation, rule of thumb."""

import random

import pytest

from migration.plan import batch_candidates, exact_candidates, keep_global_batch, largest_fitting, rule_of_thumb_batch


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


def test_accumulation_keeps_the_global_batch_exactly():
    cands = batch_candidates(256, "multiple8")
    acc = keep_global_batch(256, 1, 112, cands)
    assert (acc.per_device_batch, acc.accumulation_steps, acc.global_batch, acc.exact) == (64, 4, 256, True)
    acc = keep_global_batch(256, 2, 48, batch_candidates(128, "multiple8"))
    assert acc.per_device_batch * 2 * acc.accumulation_steps == 256 and acc.exact
    assert acc.per_device_batch == 32


def test_accumulation_says_so_when_the_global_batch_cannot_be_kept():
    acc = keep_global_batch(250, 1, 48, batch_candidates(250, "multiple8"))
    assert not acc.exact and acc.global_batch == 48 * 6 and "instead of 250" in acc.reason


def test_exact_candidates_only_when_they_leave_no_wide_gap():
    assert exact_candidates(batch_candidates(256, "multiple8"), 256, 1) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert exact_candidates(batch_candidates(250, "multiple8"), 250, 1) is None


def test_rule_of_thumb_is_the_guides_formula():
    # The guide's worked example: 42M parameters in float32, an 80 GB card's limit.
    batch, note = rule_of_thumb_batch(80e9 * 0.8, 42_000_000)
    assert batch == 64 and "capped" in note
    assert rule_of_thumb_batch(1e9, 1_000_000_000)[0] == 1
