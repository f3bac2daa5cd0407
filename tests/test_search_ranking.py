"""The search module's functions on hand-built inputs: expected figures follow the documented formulas."""

import pytest

from hypothesis import given, settings, strategies as st

from migration.planning.search import (
    ELEMENTWISE_SHARE,
    MiB,
    RECOMPUTE_FACTOR,
    REMAT_ORDER,
    Choice,
    Communication,
    StepCostModel,
    _interpolated,
    batch_candidates,
    describe_choice,
    exact_candidates,
    largest_fitting,
    rank_choices,
    recompute_factors,
    rule_of_thumb_batch,
)

# ---------------------------------------------------------------- recompute factors

PARTS = {"attention": 1.0, "attention_proj": 2.0, "mlp": 4.0, "embed": 8.0}
STEP = 64.0
BLOCK = 1.0 + 2.0 + 4.0 + 8.0
E = ELEMENTWISE_SHARE


def test_recompute_factors_per_policy():
    got = recompute_factors(PARTS, STEP)
    assert set(got) == set(REMAT_ORDER)
    assert got == pytest.approx({
        "none": 1.0,
        "dots": 1.0 + E,
        "dots_no_batch": 1.0 + 1.0 / STEP + E,
        "save_dot_except_mlp": 1.0 + 4.0 / STEP + E,
        "save_qkv": 1.0 + (1.0 + 2.0 + 4.0) / STEP + E,
        "offload_dot_except_mlp": 1.0 + 4.0 / STEP + E,
        "full": 1.0 + BLOCK / STEP + E,
    })


def test_fused_attention_makes_every_policy_but_none_rerun_attention():
    got = recompute_factors(PARTS, STEP, fused_attention=True)
    assert got == pytest.approx({
        "none": 1.0,
        "dots": 1.0 + 1.0 / STEP + E,
        "dots_no_batch": 1.0 + 1.0 / STEP + E,
        "save_dot_except_mlp": 1.0 + (1.0 + 4.0) / STEP + E,
        "save_qkv": 1.0 + (1.0 + 2.0 + 4.0) / STEP + E,
        "offload_dot_except_mlp": 1.0 + (1.0 + 4.0) / STEP + E,
        "full": 1.0 + BLOCK / STEP + E,  # the block already includes attention: not counted twice
    })


def test_convolutional_models_recompute_the_whole_block_under_the_dot_policies():
    got = recompute_factors(PARTS, STEP, convolutional=True)
    plain = recompute_factors(PARTS, STEP)
    assert got["dots"] == pytest.approx(1.0 + BLOCK / STEP + E)
    assert got["dots_no_batch"] == pytest.approx(1.0 + BLOCK / STEP + E)
    for name in ("none", "save_dot_except_mlp", "save_qkv", "offload_dot_except_mlp", "full"):
        assert got[name] == pytest.approx(plain[name])
    both = recompute_factors(PARTS, STEP, fused_attention=True, convolutional=True)
    assert both["dots"] == pytest.approx(1.0 + BLOCK / STEP + E)
    assert both["none"] == 1.0


def test_parts_a_model_does_not_name_cost_nothing():
    got = recompute_factors({"block": 3.0}, 9.0)
    assert got["dots_no_batch"] == pytest.approx(1.0 + E)
    assert got["save_qkv"] == pytest.approx(1.0 + E)
    assert got["full"] == pytest.approx(1.0 + 3.0 / 9.0 + E)


def test_elementwise_work_is_the_fixed_share_even_where_a_model_names_it():
    got = recompute_factors({"mlp": 4.0, "elementwise": 2.0}, 16.0)
    assert got["dots"] == pytest.approx(1.0 + E)
    assert got["save_dot_except_mlp"] == pytest.approx(1.0 + 4.0 / 16.0 + E)
    assert got["full"] == pytest.approx(1.0 + 6.0 / 16.0 + E)  # the whole block, elementwise included


def test_the_default_factor_is_a_block_that_is_a_third_of_the_step():
    assert RECOMPUTE_FACTOR["full"] == pytest.approx(1.0 + 1.0 / 3.0 + E)
    assert RECOMPUTE_FACTOR["none"] == 1.0


# ---------------------------------------------------------------- candidates

def test_exact_candidates_keep_the_global_batch_on_every_gpu():
    assert exact_candidates([1, 2, 4, 8, 16, 24, 32], 64, 2) == [1, 2, 4, 8, 16, 32]
    assert exact_candidates([1, 2, 4], 8, 2) == [1, 2, 4]
    assert exact_candidates([1, 2, 4], 8, 4) is None  # 4 x 4 GPUs does not divide 8
    assert exact_candidates([3], 6, 2) == [3]


def test_exact_candidates_allow_a_gap_of_exactly_two_but_not_wider():
    assert exact_candidates([1, 2, 4, 8, 16, 24, 32, 40, 48], 48, 1) == [1, 2, 4, 8, 16, 24, 48]
    assert exact_candidates([1, 2, 5], 10, 1) is None
    assert exact_candidates([1, 2, 4, 8, 16, 24, 32, 40, 48, 56], 112, 1) is None  # 16 -> 56


def test_exact_candidates_must_reach_the_largest_candidate():
    assert exact_candidates([1, 2, 4, 8], 4, 1) is None
    assert exact_candidates([2, 4], 7, 1) is None
    assert exact_candidates([], 8, 1) is None


@pytest.mark.parametrize("limit, expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (7, [1, 2, 4, 7]), (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 9]), (16, [1, 2, 4, 8, 16]), (17, [1, 2, 4, 8, 16, 17]),
])
def test_multiple8_candidates(limit, expected):
    assert batch_candidates(limit, "multiple8") == expected


@pytest.mark.parametrize("limit, expected", [
    (1, [1]), (2, [1, 2]), (3, [1, 2, 3]), (4, [1, 2, 4]), (8, [1, 2, 4, 8]), (12, [1, 2, 4, 8, 12]),
    (24, [1, 2, 4, 8, 16, 24]), (1024, [2**k for k in range(11)]),
])
def test_pow2_candidates(limit, expected):
    assert batch_candidates(limit, "pow2") == expected


def test_a_zero_limit_offers_nothing_above_it_whatever_the_granularity():
    assert batch_candidates(0, "pow2") == batch_candidates(0, "multiple8")
    assert all(c <= 0 for c in batch_candidates(0, "pow2"))


@settings(max_examples=60, deadline=None)
@given(limit=st.integers(1, 2000), granularity=st.sampled_from(["multiple8", "pow2"]))
def test_candidates_are_ascending_and_end_at_the_limit(limit, granularity):
    out = batch_candidates(limit, granularity)
    assert out == sorted(set(out)) and out[-1] == limit and out[0] == 1
    if granularity == "pow2":
        assert all(c == limit or c & (c - 1) == 0 for c in out)
        assert {2**k for k in range(limit.bit_length()) if 2**k <= limit} <= set(out)
    else:
        assert all(c in (1, 2, 4, limit) or c % 8 == 0 for c in out)
        assert set(range(8, limit + 1, 8)) <= set(out)


# ---------------------------------------------------------------- largest fitting

def recorder(fn):
    calls = []

    def measure(b):
        calls.append(b)
        return fn(b)
    return measure, calls


def test_no_candidates_fit_nothing_and_measure_nothing():
    measure, calls = recorder(float)
    assert largest_fitting([], measure, 10.0) == 0
    assert calls == []


@pytest.mark.parametrize("budget, expected", [(5.0, 5), (5.5, 5), (4.9, 0)])
def test_a_single_candidate_is_measured_once(budget, expected):
    measure, calls = recorder(float)
    assert largest_fitting([5], measure, budget) == expected
    assert calls == [5]


def test_when_everything_fits_only_the_top_is_measured():
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8, 16], measure, 16.0) == 16  # measure == budget fits
    assert calls == [16]


def test_when_nothing_fits_the_top_and_bottom_are_measured():
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8, 16], measure, 0.5) == 0
    assert calls == [16, 1]
    measure, calls = recorder(lambda b: None)
    assert largest_fitting([1, 2, 4, 8, 16], measure, 1e9) == 0
    assert calls == [16, 1]


def test_a_linear_measure_is_found_by_interpolation_in_four_probes():
    measure, calls = recorder(lambda b: 10.0 + b)
    assert largest_fitting(list(range(1, 101)), measure, 67.5) == 57
    assert calls == [100, 1, 57, 58]


def test_unmeasurable_ends_fall_back_to_the_midpoint():
    measure, calls = recorder(lambda b: None if b > 60 else float(b))
    assert largest_fitting(list(range(1, 101)), measure, 1e9) == 60
    assert calls == [100, 1, 50, 75, 62, 56, 59, 60, 61]


def test_only_the_bottom_fits():
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8, 16], measure, 1.5) == 1
    assert calls[:2] == [16, 1] and len(calls) == len(set(calls)) <= 5


def test_a_known_fit_is_not_measured_again():
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8], measure, 3.0, known_fit=2) == 2
    assert calls == [8, 4]  # the bracket's bottom was never measured: midpoint
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8], measure, 100.0, known_fit=8) == 8
    assert calls == []
    assert largest_fitting([1, 2, 4, 8], measure, 100.0, known_fit=9) == 8
    assert calls == []
    assert largest_fitting([1, 2, 4, 8], measure, 100.0, known_fit=3) == 8
    assert calls == [8]


def test_a_known_fit_between_candidates_counts_the_one_below():
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8, 16], measure, 5.0, known_fit=5) == 4
    assert calls == [16, 8]


@pytest.mark.parametrize("budget, first_guess, known_fit, expected, probes", [
    (10.0, 8, 0, 8, [8, 16]),          # the guess fits and the next does not
    (10.0, 9, 0, 8, [8, 16]),          # a guess between candidates means the one below
    (100.0, 32, 0, 32, [32]),          # the guess is the top and fits
    (100.0, 1000, 0, 32, [32]),        # a guess above the top is the top
    (100.0, 16, 0, 32, [16, 32]),      # the guess and the top both fit
    (20.0, 8, 0, 16, [8, 16, 32]),     # the guess and the next fit: on to the top
    (10.0, 0, 0, 8, [1, 2, 32, 8, 16]),  # a guess below every candidate is the bottom
    (10.0, 2, 4, 8, [8, 16]),          # a guess at or below a known fit moves just above it
    (5.0, 16, 0, 4, [16, 1, 4, 8]),    # the guess does not fit: it closes the bracket
    (0.5, 16, 0, 0, [16, 1]),
])
def test_a_first_guess_replaces_the_first_probe(budget, first_guess, known_fit, expected, probes):
    measure, calls = recorder(float)
    assert largest_fitting([1, 2, 4, 8, 16, 32], measure, budget, known_fit=known_fit,
                           first_guess=first_guess) == expected
    assert calls == probes


def test_once_the_guess_and_the_next_fit_the_search_goes_on_from_the_next():
    # b^2 against 100 on 1..32: guess 3 (9) and 4 (16) fit, the top (1024) does not; each later probe is
    # where the line from the last fit to 32 meets 100, or the next candidate up when that is below it
    measure, calls = recorder(lambda b: float(b * b))
    assert largest_fitting(list(range(1, 33)), measure, 100.0, first_guess=3) == 10
    # 4 + 84 x 28 / 1008 = 6.3 -> 6; 6 + 64 x 26 / 988 = 7.7 -> 7; 7 + 51 x 25 / 975 = 8.3 -> 8;
    # 8 + 36 x 24 / 960 = 8.9 -> 9; 9 + 19 x 23 / 943 = 9.5 -> 10; then 11 does not fit
    assert calls == [3, 4, 32, 6, 7, 8, 9, 10, 11]


@st.composite
def searches(draw):
    candidates = sorted(draw(st.sets(st.integers(1, 300), min_size=1, max_size=40)))
    fixed = draw(st.floats(0, 100))
    slope = draw(st.floats(0.01, 10))
    curve = draw(st.floats(0, 0.05))
    hard = draw(st.one_of(st.none(), st.integers(0, 320)))  # above it a compile fails outright
    budget = draw(st.floats(0, 2000))

    def value(b):
        return None if hard is not None and b > hard else fixed + slope * b + curve * b * b

    fitting = [c for c in candidates if value(c) is not None and value(c) <= budget]
    answer = max(fitting, default=0)
    known_fit = draw(st.integers(0, answer))
    first_guess = draw(st.one_of(st.none(), st.integers(0, 320)))
    return candidates, value, budget, answer, known_fit, first_guess


@settings(max_examples=200, deadline=None)
@given(searches())
def test_the_search_finds_the_largest_fitting_candidate_with_at_most_one_probe_each(case):
    candidates, value, budget, answer, known_fit, first_guess = case
    measure, calls = recorder(value)
    assert largest_fitting(candidates, measure, budget, known_fit=known_fit, first_guess=first_guess) == answer
    assert len(calls) == len(set(calls)) <= len(candidates)
    assert all(c > known_fit for c in calls)


def test_interpolation_aims_where_the_line_meets_the_budget():
    candidates = [10, 20, 30, 40, 50, 60]
    values = {10: 100.0, 60: 600.0}
    assert _interpolated(candidates, values, 0, 5, 350.0) == 2  # boundary 35: the largest at or below, 30
    assert _interpolated(candidates, values, 0, 5, 300.0) == 2  # exactly on a candidate
    assert _interpolated(candidates, values, 0, 5, 299.0) == 1
    assert _interpolated(candidates, values, 0, 5, 105.0) == 1  # below the first inside: lo + 1
    assert _interpolated(candidates, values, 0, 5, 590.0) == 4  # never the measured top
    assert _interpolated(candidates, {10: 100.0, 60: 1100.0}, 0, 5, 350.0) == 1  # boundary 22.5


def test_interpolation_uses_the_lower_end_as_its_origin():
    candidates = [10, 20, 30, 40, 50, 60]
    # lo = 20 measured 150, hi = 60 measured 350: 5 per example from 20; budget 250 -> boundary 40
    assert _interpolated(candidates, {20: 150.0, 60: 350.0}, 1, 5, 250.0) == 3
    assert _interpolated(candidates, {20: 150.0, 60: 350.0}, 1, 5, 249.0) == 2


def test_interpolation_takes_the_midpoint_without_a_usable_line():
    candidates = [10, 20, 30, 40, 50, 60, 70]
    assert _interpolated(candidates, {70: 700.0}, 0, 6, 350.0) == 3  # bottom unmeasured
    assert _interpolated(candidates, {10: 100.0}, 0, 6, 350.0) == 3  # top unmeasured
    assert _interpolated(candidates, {10: 100.0, 70: None}, 0, 6, 350.0) == 3
    assert _interpolated(candidates, {10: 100.0, 70: 100.0}, 0, 6, 350.0) == 3  # flat
    assert _interpolated(candidates, {10: 100.0, 70: 50.0}, 0, 6, 350.0) == 3  # falling
    assert _interpolated(candidates, {20: 100.0}, 1, 6, 350.0) == 3
    assert _interpolated(candidates, {10: 100.0}, 0, 5, 350.0) == 2


# ---------------------------------------------------------------- rule of thumb

def params_for(model_mb):
    return int(model_mb * MiB / 4)


@pytest.mark.parametrize("memory_mb, model_mb, expected", [
    (100.0, 10.0, 60),     # (80 - 20) / 1 = 60
    (105.0, 10.0, 64),     # (84 - 20) / 1 = 64: exactly the cap
    (106.25, 10.0, 64),    # 65: capped
    (103.75, 10.0, 63),    # 63
    (26.25, 10.0, 1),      # (21 - 20) / 1 = 1
    (25.0, 10.0, 1),       # 0: at least 1
    (10.0, 10.0, 1),       # negative: at least 1
    (30.0, 10.0, 4),       # 4
])
def test_rule_of_thumb_caps_to_one_through_sixty_four(memory_mb, model_mb, expected):
    batch, note = rule_of_thumb_batch(memory_mb * MiB, params_for(model_mb))
    assert batch == expected
    assert f"= {int((memory_mb * 0.8 - 2 * model_mb) / (model_mb * 0.1))}, capped to 1..64 -> {expected};" in note


def test_rule_of_thumb_divides_by_a_tenth_of_the_model():
    # (0.8 x 100 - 2 x 20) / (0.1 x 20) = 40 / 2 = 20
    batch, note = rule_of_thumb_batch(100 * MiB, params_for(20.0))
    assert batch == 20 and "(0.1 x 20.0 MB) = 20, capped" in note


def test_rule_of_thumb_truncates_the_quotient():
    # (0.8 x 29.5 - 20) / 1 = 3.6 -> 3
    assert rule_of_thumb_batch(29.5 * MiB, params_for(10.0))[0] == 3


def test_rule_of_thumb_note_shows_the_arithmetic():
    batch, note = rule_of_thumb_batch(2000 * MiB, params_for(10.0))
    # (1600 - 20) / 1 = 1580
    assert batch == 64
    assert note == ("guide's formula: (0.8 x 2,000 MB - 2 x 10.0 MB) / (0.1 x 10.0 MB) = 1580, capped to 1..64 -> 64;"
                    " it ignores sequence length, activations, precision and remat")
    batch, note = rule_of_thumb_batch(30 * MiB, params_for(10.0))
    assert batch == 4 and "= 4, capped to 1..64 -> 4;" in note and "(0.8 x 30 MB" in note


def test_rule_of_thumb_without_parameters_is_the_cap():
    batch, note = rule_of_thumb_batch(1000 * MiB, 0)
    assert batch == 64 and "= 64, capped" in note


# ---------------------------------------------------------------- communication

P = 1000


@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_one_device_sends_nothing(sharding):
    comm = Communication(P, 1, 2, 1e9)
    assert comm.bytes_per_micro_batch(sharding) == 0.0
    assert comm.seconds(sharding, 4) == 0.0


def test_replicated_state_all_reduces_float32_gradients():
    comm = Communication(P, 4, 2, 100.0)
    assert comm.bytes_per_micro_batch("replicated") == pytest.approx(2 * (3 / 4) * P * 4)
    assert comm.bytes_per_micro_batch("replicated", "none") == pytest.approx(2 * (3 / 4) * P * 4)
    assert comm.seconds("replicated", 3) == pytest.approx(3 * 2 * (3 / 4) * P * 4 / 100.0)


def test_fsdp_gathers_twice_or_three_times_in_the_compute_dtype():
    comm = Communication(P, 4, 2, 100.0)
    assert comm.bytes_per_micro_batch("fsdp", "none") == pytest.approx(2 * (3 / 4) * P * 2)
    assert comm.bytes_per_micro_batch("fsdp", "dots") == pytest.approx(3 * (3 / 4) * P * 2)
    assert comm.bytes_per_micro_batch("fsdp") == pytest.approx(3 * (3 / 4) * P * 2)  # default: full remat
    assert comm.seconds("fsdp", 5) == pytest.approx(5 * 3 * (3 / 4) * P * 2 / 100.0)
    assert comm.seconds("fsdp", 5, "none") == pytest.approx(5 * 2 * (3 / 4) * P * 2 / 100.0)
    two = Communication(P, 2, 4, 100.0)
    assert two.bytes_per_micro_batch("fsdp", "full") == pytest.approx(3 * (1 / 2) * P * 4)


@pytest.mark.parametrize("link", [None, 0.0])
def test_an_unknown_link_costs_no_time(link):
    comm = Communication(P, 4, 2, link)
    assert comm.seconds("replicated", 3) == 0.0
    assert comm.seconds("fsdp", 3, "none") == 0.0


# ---------------------------------------------------------------- step cost model

def test_fill_is_rows_over_the_rows_that_fill_the_gpu():
    model = StepCostModel(1.0, rows_per_example=3, fill_rows=24, peak_flops=1.0)
    assert model.fill(1) == pytest.approx(3 / 24)
    assert model.fill(4) == pytest.approx(12 / 24)
    assert model.fill(8) == 1.0
    assert model.fill(100) == 1.0


def test_fill_counts_wide_matmuls_as_several_tiles_and_narrow_ones_as_one():
    wide = StepCostModel(1.0, rows_per_example=3, fill_rows=24, peak_flops=1.0, matmul_width=256)
    assert wide.fill(2) == pytest.approx(2 * 3 * 2 / 24)
    narrow = StepCostModel(1.0, rows_per_example=3, fill_rows=24, peak_flops=1.0, matmul_width=64)
    assert narrow.fill(2) == pytest.approx(2 * 3 / 24)
    odd = StepCostModel(1.0, rows_per_example=1, fill_rows=100, peak_flops=1.0, matmul_width=192)
    assert odd.fill(10) == pytest.approx(10 * 1.5 / 100)


def test_fill_with_no_rows_to_fill_is_full():
    assert StepCostModel(1.0, rows_per_example=1, fill_rows=0, peak_flops=1.0).fill(1) == 1.0


RECOMPUTE = {"none": 1.0, "full": 1.5, "offload_dot_except_mlp": 1.25}


def test_compute_seconds_is_work_over_peak_times_fill():
    model = StepCostModel(1e9, rows_per_example=1, fill_rows=8, peak_flops=4e12, recompute=RECOMPUTE)
    assert model.compute_seconds("none", 2, 3) == pytest.approx(3 * 1e9 * 2 * 1.0 / (4e12 * (2 / 8)))
    assert model.compute_seconds("full", 8, 1) == pytest.approx(1e9 * 8 * 1.5 / 4e12)
    assert model.compute_seconds("full", 16, 2) == pytest.approx(2 * 1e9 * 16 * 1.5 / 4e12)


def test_without_a_peak_the_cost_is_relative():
    model = StepCostModel(10.0, rows_per_example=1, fill_rows=8, peak_flops=None, recompute=RECOMPUTE)
    assert model.compute_seconds("full", 4, 2) == pytest.approx(2 * 10.0 * 4 * 1.5 / (1.0 * (4 / 8)))


def test_the_default_recompute_factors_are_the_module_defaults():
    model = StepCostModel(3.0, rows_per_example=8, fill_rows=8, peak_flops=1.0)
    assert model.compute_seconds("none", 1, 1) == pytest.approx(3.0)
    assert model.compute_seconds("full", 1, 1) == pytest.approx(3.0 * (1 + 1 / 3 + E))


HOST = 1e6
OFFLOAD = 500.0


def offload_model(peak=1.0, host=HOST, communication=None):
    return StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=peak, recompute=RECOMPUTE,
                         offload_bytes_per_example=OFFLOAD, host_link_bytes_per_s=host, communication=communication)


def test_offloading_copies_out_and_back_in():
    model = offload_model()
    assert model.offload_seconds("offload_dot_except_mlp", 6) == pytest.approx(2 * 6 * OFFLOAD / HOST)
    assert model.offload_seconds("full", 6) == 0.0
    assert model.offload_seconds("none", 6) == 0.0


def test_offloading_costs_nothing_without_a_host_link_or_a_peak():
    assert offload_model(host=None).offload_seconds("offload_dot_except_mlp", 6) == 0.0
    assert offload_model(peak=None).offload_seconds("offload_dot_except_mlp", 6) == 0.0


def test_communication_needs_a_peak_and_a_link_model():
    comm = Communication(P, 4, 2, 100.0)
    with_peak = StepCostModel(1.0, 1, 1, peak_flops=1.0, communication=comm)
    assert with_peak.comm_seconds("fsdp", 2, "none") == pytest.approx(2 * 2 * (3 / 4) * P * 2 / 100.0)
    assert with_peak.comm_seconds("fsdp", 2) == pytest.approx(2 * 3 * (3 / 4) * P * 2 / 100.0)
    assert with_peak.comm_seconds("replicated", 2) == pytest.approx(2 * 2 * (3 / 4) * P * 4 / 100.0)
    assert StepCostModel(1.0, 1, 1, peak_flops=None, communication=comm).comm_seconds("fsdp", 2) == 0.0
    assert StepCostModel(1.0, 1, 1, peak_flops=1.0).comm_seconds("fsdp", 2) == 0.0


def test_step_seconds_is_the_longest_of_compute_communication_and_host_copies():
    # compute: acc x batch x factor / fill (1 FLOP per example at 1 FLOP/s, always full)
    comm = Communication(P, 2, 2, 1000.0)  # replicated: 2 x 1/2 x 1000 x 4 = 4000 bytes = 4 s per micro-batch
    model = offload_model(communication=comm)
    assert model.step_seconds("none", 100, 1) == pytest.approx(100.0)  # compute 100 > comm 4
    assert model.step_seconds("none", 2, 3) == pytest.approx(3 * 4.0)  # compute 6 < comm 12
    # fsdp with none: 2 x 1/2 x 1000 x 2 = 2000 bytes = 2 s per micro-batch
    assert model.step_seconds("none", 2, 3, "fsdp") == pytest.approx(6.0)
    assert model.step_seconds("none", 1, 3, "fsdp") == pytest.approx(6.0)
    assert model.step_seconds("none", 1, 3) == pytest.approx(12.0)  # replicated by default
    # fsdp with full remat: 3 transfers, 3 s per micro-batch
    assert model.step_seconds("full", 1, 2, "fsdp") == pytest.approx(6.0)
    # host copies of 2 x 4 x 3 examples x 500 bytes at 1 MB/s = 12 ms; make them dominate with big examples
    big = StepCostModel(1.0, 1, 1, peak_flops=1.0, recompute=RECOMPUTE, offload_bytes_per_example=1e8,
                        host_link_bytes_per_s=1e6)
    assert big.step_seconds("offload_dot_except_mlp", 4, 3) == pytest.approx(2 * 4 * 3 * 1e8 / 1e6)
    assert big.step_seconds("full", 4, 3) == pytest.approx(3 * 4 * 1.5)


def test_best_possible_uses_the_largest_allowed_micro_batch():
    # 1 FLOP per example at 2 FLOP/s; fill = batch / 8
    comm = Communication(P, 2, 2, 1000.0)  # replicated: 4 s per micro-batch; fsdp/none: 2 s
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=8, peak_flops=2.0, recompute=RECOMPUTE,
                          communication=comm)
    # 12 examples, micro-batches of at most 4: fill 1/2, 3 micro-batches
    assert model.best_possible("none", 12, max_batch=4) == pytest.approx(max(12 * 1.0 / (2.0 * 0.5), 3 * 4.0))
    assert model.best_possible("full", 12, max_batch=4) == pytest.approx(max(12 * 1.5 / (2.0 * 0.5), 3 * 4.0))
    assert model.best_possible("none", 12, "fsdp", max_batch=4) == pytest.approx(12.0)  # compute 12 > comm 6
    # without a limit: one micro-batch of 12, full fill
    assert model.best_possible("none", 12) == pytest.approx(max(12 / 2.0, 4.0))
    assert model.best_possible("none", 12, max_batch=100) == pytest.approx(max(12 / 2.0, 4.0))
    # 5 examples by at most 2: 3 micro-batches (rounded up), fill 2/8
    assert model.best_possible("none", 5, max_batch=2) == pytest.approx(max(5 / (2.0 * 0.25), 3 * 4.0))
    assert model.best_possible("none", 5, "fsdp", max_batch=2) == pytest.approx(max(5 / (2.0 * 0.25), 3 * 2.0))


def test_best_possible_with_fsdp_and_no_remat_counts_two_gathers():
    comm = Communication(P, 2, 2, 100.0)  # fsdp: 2 x 1/2 x 1000 x 2 = 2000 bytes = 20 s (none), 30 s otherwise
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute=RECOMPUTE,
                          communication=comm)
    assert model.best_possible("none", 6, "fsdp", max_batch=2) == pytest.approx(3 * 20.0)
    assert model.best_possible("full", 6, "fsdp", max_batch=2) == pytest.approx(3 * 30.0)


def test_best_possible_without_a_peak_is_relative():
    model = StepCostModel(3.0, rows_per_example=1, fill_rows=8, peak_flops=None, recompute=RECOMPUTE)
    assert model.best_possible("full", 12, max_batch=4) == pytest.approx(3.0 * 12 * 1.5 / (1.0 * (4 / 8)))


def test_best_possible_counts_host_copies_of_every_example():
    big = StepCostModel(1.0, 1, 1, peak_flops=1.0, recompute=RECOMPUTE, offload_bytes_per_example=1e8,
                        host_link_bytes_per_s=1e6)
    assert big.best_possible("offload_dot_except_mlp", 12, max_batch=4) == pytest.approx(2 * 12 * 1e8 / 1e6)
    assert big.best_possible("full", 12, max_batch=4) == pytest.approx(12 * 1.5)


@settings(max_examples=100, deadline=None)
@given(examples=st.integers(1, 64), max_batch=st.integers(1, 64), rows=st.integers(1, 64),
       remat=st.sampled_from(sorted(RECOMPUTE)), sharding=st.sampled_from(["replicated", "fsdp"]))
def test_best_possible_is_a_lower_bound_on_every_way_to_split_the_examples(examples, max_batch, rows, remat, sharding):
    model = StepCostModel(1e9, rows, 512, 1e12, recompute=RECOMPUTE, communication=Communication(10**6, 4, 2, 1e9),
                          offload_bytes_per_example=1e5, host_link_bytes_per_s=1e9)
    bound = model.best_possible(remat, examples, sharding, max_batch=max_batch)
    for b in range(1, min(examples, max_batch) + 1):
        if examples % b == 0:
            assert model.step_seconds(remat, b, examples // b, sharding) >= bound * (1 - 1e-12)


# ---------------------------------------------------------------- choices

def test_a_choice_as_a_dict_names_every_field():
    comm = Communication(P, 4, 2, 100.0)
    model = StepCostModel(1e9, rows_per_example=1, fill_rows=8, peak_flops=4e12, recompute=RECOMPUTE,
                          communication=comm)
    c = Choice("none", 2, 3, 24, True, 7.5, 2 / 7, "fsdp")
    assert c.to_dict(model) == {
        "sharding": "fsdp", "remat": "none", "per_device_batch": 2, "accumulation_steps": 3, "global_batch": 24,
        "exact": True, "fill": 0.286, "predicted_step_s": 7.5,
        "compute_s": pytest.approx(3 * 1e9 * 2 * 1.0 / (4e12 * (2 / 8))),
        "communication_s": pytest.approx(3 * 2 * (3 / 4) * P * 2 / 100.0),  # fsdp, none: two transfers
        "relative_cost": 7.5,
    }
    d = Choice("full", 8, 1, 8, False, 1.25, 1.0).to_dict(model)
    assert d["sharding"] == "replicated" and d["exact"] is False and d["fill"] == 1.0
    assert d["compute_s"] == pytest.approx(1e9 * 8 * 1.5 / 4e12)
    assert d["communication_s"] == pytest.approx(2 * (3 / 4) * P * 4 / 100.0)


def test_a_choice_without_a_peak_has_only_a_relative_cost():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=8, peak_flops=None, recompute=RECOMPUTE)
    d = Choice("full", 4, 2, 8, True, 3.25, 0.5).to_dict(model)
    assert d == {"sharding": "replicated", "remat": "full", "per_device_batch": 4, "accumulation_steps": 2,
                 "global_batch": 8, "exact": True, "fill": 0.5, "predicted_step_s": None, "compute_s": None,
                 "communication_s": None, "relative_cost": 3.25}


def test_describing_an_exact_choice():
    c = Choice("none", 8, 4, 64, True, 1.0, 1.0)
    assert describe_choice(c, 64, 2) == "8 per device x 2 GPU(s) x 4 accumulation step(s) = 64, the TPU global batch exactly"


def test_describing_an_inexact_choice_gives_the_change_and_the_remedy():
    c = Choice("none", 8, 2, 16, False, 1.0, 1.0)
    assert describe_choice(c, 12, 1) == (
        "8 per device x 1 GPU(s) x 2 accumulation step(s) = 16 instead of 12 (+33.3%): no allowed per-device batch"
        " divides it; scale the learning rate accordingly or choose a global batch divisible by the GPU count x 8")
    smaller = Choice("none", 4, 1, 8, False, 1.0, 1.0)
    assert "= 8 instead of 10 (-20.0%): no allowed" in describe_choice(smaller, 10, 2)


# ---------------------------------------------------------------- ranking

# 1 FLOP per example at 1 FLOP/s; fill = batch / 4: cost = steps x batch x factor / fill
UNIT = StepCostModel(1.0, rows_per_example=1, fill_rows=4, peak_flops=1.0, recompute={"none": 1.0, "full": 1.5})


def summary(ranked):
    return [(c.sharding, c.remat, c.per_device_batch, c.accumulation_steps, c.global_batch, c.exact, c.step_cost)
            for c in ranked]


def test_exact_choices_fastest_first_then_fewer_accumulation_steps():
    ranked = rank_choices({"none": 4, "full": 16}, [1, 2, 4, 8, 16], 16, 1, UNIT)
    # none: b=1 16 x 1 / (1/4) = 64, b=2 8 x 2 / (1/2) = 32, b=4 4 x 4 = 16
    # full: b=1 96, b=2 48, b=4/8/16 24
    assert summary(ranked) == [
        ("replicated", "none", 4, 4, 16, True, 16.0),
        ("replicated", "full", 16, 1, 16, True, 24.0),
        ("replicated", "full", 8, 2, 16, True, 24.0),
        ("replicated", "full", 4, 4, 16, True, 24.0),
        ("replicated", "none", 2, 8, 16, True, 32.0),
        ("replicated", "full", 2, 8, 16, True, 48.0),
        ("replicated", "none", 1, 16, 16, True, 64.0),
        ("replicated", "full", 1, 16, 16, True, 96.0),
    ]
    assert [c.fill for c in ranked[:3]] == [1.0, 1.0, 1.0] and ranked[-1].fill == 0.25


def test_the_global_batch_is_split_over_the_gpus():
    ranked = rank_choices({"none": 8}, [1, 2, 4, 8], 16, 2, UNIT)
    # b x 2 GPUs x steps = 16: b=8 1 step (8), b=4 2 steps (8), b=2 4 steps (2 x 4 x 2 = 16), b=1 8 steps (32)
    assert summary(ranked) == [
        ("replicated", "none", 8, 1, 16, True, 8.0),
        ("replicated", "none", 4, 2, 16, True, 8.0),
        ("replicated", "none", 2, 4, 16, True, 16.0),
        ("replicated", "none", 1, 8, 16, True, 32.0),
    ]


def test_a_policy_whose_maximum_is_zero_offers_nothing():
    assert rank_choices({"none": 0}, [1, 2, 4], 8, 1, UNIT) == []
    assert summary(rank_choices({"none": 0, "full": 1}, [1, 2, 4], 8, 1, UNIT)) == [
        ("replicated", "full", 1, 8, 8, True, 8 * 1.5 * 4)]


def test_on_equal_cost_replicated_state_comes_first():
    ranked = rank_choices({("fsdp", "none"): 4, "none": 4}, [4], 8, 1, UNIT)
    assert summary(ranked) == [("replicated", "none", 4, 2, 8, True, 8.0), ("fsdp", "none", 4, 2, 8, True, 8.0)]
    ranked = rank_choices({("fsdp", "none"): 4, ("replicated", "none"): 4}, [4], 8, 1, UNIT)
    assert [c.sharding for c in ranked] == ["replicated", "fsdp"]


def test_faster_sharding_wins_over_replicated():
    comm = Communication(P, 2, 2, 1000.0)  # replicated 4 s per micro-batch, fsdp/none 2 s
    model = StepCostModel(1.0, 1, 1, peak_flops=1.0, recompute={"none": 1.0}, communication=comm)
    ranked = rank_choices({"none": 1, ("fsdp", "none"): 1}, [1], 4, 1, model)
    assert summary(ranked) == [("fsdp", "none", 1, 4, 4, True, 8.0), ("replicated", "none", 1, 4, 4, True, 16.0)]


def test_at_most_max_accumulation_steps():
    ranked = rank_choices({"none": 4, "full": 16}, [1, 2, 4, 8, 16], 16, 1, UNIT, max_accumulation=4)
    assert [(c.remat, c.per_device_batch, c.accumulation_steps) for c in ranked] == [
        ("none", 4, 4), ("full", 16, 1), ("full", 8, 2), ("full", 4, 4)]


def test_an_accumulation_override_keeps_exact_choices_with_those_steps_and_faster_alternatives():
    ranked = rank_choices({"none": 4, "full": 16}, [1, 2, 4, 8, 16], 16, 1, UNIT, accumulation=2)
    # exact: only full at 8 (24). Alternatives at 2 steps: none's best per example is 4 (global 8, cost 8);
    # full's is 4 (global 8, cost 12) or 16 (global 32, same per example, farther): both faster than 24.
    assert summary(ranked) == [
        ("replicated", "full", 8, 2, 16, True, 24.0),
        ("replicated", "none", 4, 2, 8, False, 8.0),
        ("replicated", "full", 4, 2, 8, False, 12.0),
    ]


def test_without_an_exact_choice_the_least_time_per_example_rounds_the_batch_up():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=16, peak_flops=1.0, recompute={"none": 1.0})
    # 12 per device: 8 x 2 (cost 2 x 8 / (1/2) = 32) or 16 x 1 (16): both give 16, 16 is faster
    assert summary(rank_choices({"none": 16}, [8, 16], 12, 1, model)) == [
        ("replicated", "none", 16, 1, 16, False, 16.0)]
    assert rank_choices({"none": 16}, [8, 16], 12, 1, model)[0].fill == 1.0


def test_at_most_1024_accumulation_steps_by_default():
    assert [c.accumulation_steps for c in rank_choices({"none": 1}, [1], 1024, 1, UNIT)] == [1024]
    assert rank_choices({"none": 1}, [1], 1025, 1, UNIT) == []


def test_accumulation_steps_are_whole_numbers():
    ranked = rank_choices({"none": 4}, [2, 4], 16, 2, UNIT)
    assert [(c.per_device_batch, c.accumulation_steps) for c in ranked] == [(4, 2), (2, 4)]
    assert all(type(c.accumulation_steps) is int for c in ranked)
    assert describe_choice(ranked[0], 16, 2) == (
        "4 per device x 2 GPU(s) x 2 accumulation step(s) = 16, the TPU global batch exactly")


def test_alternatives_round_up_over_every_gpu():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=8, peak_flops=1.0, recompute={"none": 1.0})
    # global 20 on 2 GPUs: 8 x 2 x 2 = 32 (cost 2 x 8 = 16), 4 x 2 x 3 = 24 (3 x 4 / (1/2) = 24):
    # 0.5 s per example against 1
    ranked = rank_choices({"none": 8}, [4, 8], 20, 2, model)
    assert summary(ranked) == [("replicated", "none", 8, 2, 32, False, 16.0)]


def test_alternatives_keep_their_sharding_and_its_communication():
    comm = Communication(P, 2, 2, 1000.0)  # fsdp/none: 2 s per micro-batch; replicated: 4 s
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute={"none": 1.0},
                          communication=comm)
    # global 3 on candidate 2 only: 2 x 2 = 4 examples, 2 micro-batches: compute 4 s, fsdp 4 s, replicated 8 s
    ranked = rank_choices({("fsdp", "none"): 2}, [2], 3, 1, model)
    assert summary(ranked) == [("fsdp", "none", 2, 2, 4, False, 4.0)]


def test_an_accumulation_override_can_round_down_and_the_closest_batch_wins():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute={"none": 1.0, "full": 1.0})
    # 2 steps: 4 x 2 = 8 (8 below 16) or 10 x 2 = 20 (4 above), the same time per example
    assert summary(rank_choices({"none": 10}, [4, 10], 16, 1, model, accumulation=2)) == [
        ("replicated", "none", 10, 2, 20, False, 20.0)]
    # full can only use 4: its 8 is farther than none's 20 and comes after it
    ranked = rank_choices({"full": 4, "none": 10}, [4, 10], 16, 1, model, accumulation=2)
    assert [(c.remat, c.global_batch) for c in ranked] == [("none", 20), ("full", 8)]


def test_an_accumulation_override_offers_a_smaller_faster_batch_on_several_gpus():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute={"none": 1.0})
    # global 16 on 2 GPUs with 2 steps: 4 x 2 x 2 keeps it (8 s); 2 x 2 x 2 = 8 halves it in 4 s
    ranked = rank_choices({"none": 4}, [2, 4], 16, 2, model, accumulation=2)
    assert summary(ranked) == [("replicated", "none", 4, 2, 16, True, 8.0), ("replicated", "none", 2, 2, 8, False, 4.0)]


def test_alternatives_too_many_steps_are_left_out():
    assert rank_choices({"none": 8}, [1, 8], 100, 1, UNIT, max_accumulation=10) == []
    ranked = rank_choices({"none": 8}, [1, 8], 100, 1, UNIT, max_accumulation=13)
    assert summary(ranked) == [("replicated", "none", 8, 13, 104, False, 13 * 8.0)]


def test_an_alternative_as_fast_as_the_fastest_exact_choice_is_not_shown():
    # fill = 3 x batch / 16: exact 4 x 3 costs 3 x 4 / (12/16) = 16; 8 x 2 = 16 (+4) costs 16 / 1 = 16
    tie = StepCostModel(1.0, rows_per_example=3, fill_rows=16, peak_flops=1.0, recompute={"none": 1.0})
    assert summary(rank_choices({"none": 8}, [4, 8], 12, 1, tie)) == [("replicated", "none", 4, 3, 12, True, 16.0)]
    # with a fill of 12/17 the exact choice costs 17: the alternative is faster and shown after it
    faster = StepCostModel(1.0, rows_per_example=3, fill_rows=17, peak_flops=1.0, recompute={"none": 1.0})
    ranked = rank_choices({"none": 8}, [4, 8], 12, 1, faster)
    assert [(c.per_device_batch, c.accumulation_steps, c.global_batch, c.exact) for c in ranked] == [
        (4, 3, 12, True), (8, 2, 16, False)]
    assert ranked[0].step_cost == pytest.approx(17.0) and ranked[1].step_cost == pytest.approx(16.0)


def test_alternatives_closest_to_the_global_batch_first():
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=16, peak_flops=1.0, recompute={"none": 1.0, "full": 1.5})
    # global 20 on candidates 8, 16, 24 (none divides it): none picks 16 x 2 = 32 (32 s, 1 per example) over
    # 8 x 3 = 24 (48 s); full can only use 8: 8 x 3 = 24 (72 s). The closer global batch comes first.
    ranked = rank_choices({"none": 16, "full": 8}, [8, 16, 24], 20, 1, model)
    assert summary(ranked) == [
        ("replicated", "full", 8, 3, 24, False, 72.0),
        ("replicated", "none", 16, 2, 32, False, 32.0),
    ]


def test_equally_close_alternatives_fewer_steps_first():
    # global 6 on candidates 4, 8; fill = batch / 8. a: 4 x 2 = 8 (2 x 4 / (1/2) = 16);
    # b (factor 2): 8 x 1 = 8 (16) beats 4 x 2 (32 for the same 8 examples).
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=8, peak_flops=1.0, recompute={"a": 1.0, "b": 2.0})
    ranked = rank_choices({"a": 4, "b": 8}, [4, 8], 6, 1, model)
    assert summary(ranked) == [
        ("replicated", "b", 8, 1, 8, False, 16.0),
        ("replicated", "a", 4, 2, 8, False, 16.0),
    ]


def test_equal_time_per_example_prefers_the_closer_global_batch():
    # fill always 1: every choice costs 1 s per example; global 20 -> 8 x 3 = 24 or 16 x 2 = 32 or 24 x 1 = 24
    model = StepCostModel(1.0, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute={"none": 1.0})
    ranked = rank_choices({"none": 24}, [16, 24], 20, 1, model)
    assert summary(ranked) == [("replicated", "none", 24, 1, 24, False, 24.0)]


def test_time_per_example_is_compared_to_nine_significant_digits():
    # 0.1 x 3 is 0.30000000000000004: with the noise rounded off, the closer global batch wins
    model = StepCostModel(0.1, rows_per_example=1, fill_rows=1, peak_flops=1.0, recompute={"none": 1.0})
    ranked = rank_choices({"none": 10}, [3, 10], 5, 1, model)
    # 3 x 2 = 6 (0.1 x 3 x 2 / 6), 10 x 1 = 10 (0.1 x 10 / 10): the same per example; 6 is closer to 5
    assert [(c.per_device_batch, c.global_batch) for c in ranked] == [(3, 6)]
