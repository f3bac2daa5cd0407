"""Every figure a report shows carries its provenance, and its label is made from it: a compiled number is
never labelled measured. The formatters give every number its unit, scaled, in at most four significant
digits."""

import dataclasses
import math
import re

import pytest
from hypothesis import given, strategies as st

from migration.common import GiB, fmt_bytes, fmt_count, fmt_number, fmt_percent, fmt_seconds
from migration.figures import (COMPILED, MEASURED, PREDICTED, PROVENANCE_WORDS, SETTING, YOURS, Figure, plan_figures,
                               run_figures, tpu_samples_per_s)
from tests.test_checklist import world  # noqa: F401  (a real plan and real CPU runs of it)

SIGNIFICANT = re.compile(r"\d[\d,]*\.?\d*")


def significant_digits(text: str) -> int:
    """The significant digits of the longest number in `text` ("20,766" has five: a whole number)."""
    digits = [n.replace(",", "").lstrip("0.").replace(".", "") for n in SIGNIFICANT.findall(text)]
    return max((len(d) for d in digits if "," not in d), default=0)


def assert_labelled_by_provenance(figures: list[Figure]) -> None:
    for f in figures:
        label = f.label()
        assert PROVENANCE_WORDS[f.provenance] in label, label
        for provenance, word in PROVENANCE_WORDS.items():  # no other provenance's word
            if provenance != f.provenance:
                assert f", {word}" not in label, (label, f.provenance)
        assert ("measured" in label) == (f.provenance == MEASURED), label


def test_a_cpu_runs_peak_is_compiled_shown_once_and_never_labelled_measured(world):
    r = world["run"]
    assert r.backend == "cpu" and not r.peak_memory_source.startswith("measured")
    figures = run_figures(r, 17 * GiB, "this machine (cpu)")
    assert_labelled_by_provenance(figures)
    peaks = [f for f in figures if "peak memory" in f.name]
    assert len(peaks) == 1 and peaks[0].provenance == COMPILED  # not measured beside an identical "predicted"
    assert peaks[0].label().startswith("peak memory per device, compiled for cpu")
    budget = next(f for f in figures if f.key == "memory_budget")
    assert budget.provenance == SETTING and budget.label().endswith("for this machine (cpu)")
    assert {f.key: f.provenance for f in figures}["samples_per_s"] == MEASURED
    assert r.csv_row()["peak_memory_provenance"] == COMPILED  # the CSV carries it beside the figure


def test_a_gpu_runs_measured_peak_is_measured_and_its_compiled_figure_compiled(world):
    r = dataclasses.replace(world["run"], backend="gpu", device_kind="NVIDIA A100-SXM4-40GB",
                            peak_memory_bytes=3 * GiB, predicted_peak_bytes=2 * GiB,
                            peak_memory_source="measured: memory_stats() peak_bytes_in_use (max over devices)")
    figures = {f.key: f for f in run_figures(r)}
    assert_labelled_by_provenance(list(figures.values()))
    assert figures["peak_memory"].provenance == MEASURED and figures["peak_memory"].text() == "3 GiB"
    assert figures["predicted_peak_memory"].provenance == COMPILED
    assert "memory_budget" not in figures  # no budget given, none shown
    assert r.csv_row()["peak_memory_provenance"] == MEASURED


def test_every_figure_of_a_plan_is_labelled_by_its_provenance(world):
    plan = world["plan"]
    figures = plan_figures(plan)
    assert_labelled_by_provenance(figures)
    keys = {f.key: f for f in figures}
    assert keys["predicted_peak_memory"].provenance == COMPILED  # compiled for the target
    assert keys["predicted_step"].provenance == PREDICTED
    assert keys["memory_budget"].provenance == SETTING and plan.target_name in keys["memory_budget"].label()
    estimated = dataclasses.replace(plan, prediction_method="estimate")
    assert {f.key: f for f in plan_figures(estimated)}["predicted_peak_memory"].provenance == PREDICTED
    # The TPU side: predicted from its compile, or yours where you measured the step
    side = {"step_s": 0.004, "global_batch": 64, "measured_step_s": None, "throughput_per_s": 16_000.0,
            "step_source": "predicted from the compiled TPU program"}
    for measured, provenance in ((None, PREDICTED), (0.004, YOURS)):
        p = dataclasses.replace(plan, comparison={"unit": "examples", "tpu": {**side, "measured_step_s": measured},
                                                  "gpu": {}})
        figures = plan_figures(p)
        assert_labelled_by_provenance(figures)
        assert {f.key: f.provenance for f in figures}["tpu_step"] == provenance
        assert tpu_samples_per_s(p).provenance == provenance and tpu_samples_per_s(p).text() == "16k samples/s"


def test_a_figure_refuses_an_unknown_provenance_or_unit():
    with pytest.raises(ValueError):
        Figure("x", "x", 1, "bytes", "guessed")
    with pytest.raises(ValueError):
        Figure("x", "x", 1, "furlongs", MEASURED)


@pytest.mark.parametrize("value, text", [(0, "0 B"), (512, "512 B"), (1536, "1.5 KiB"), (0.209 * GiB, "214 MiB"),
                                         (56.96 * GiB, "57 GiB"), (0.006 * GiB, "6.14 MiB"), (None, "n/a")])
def test_bytes_read_in_the_unit_that_fits(value, text):
    assert fmt_bytes(value) == text


@pytest.mark.parametrize("value, unit, text", [(950, "samples/s", "950 samples/s"), (324.5, "samples/s", "324 samples/s"),
                                               (5.28e6, "tokens/s", "5.28M tokens/s"), (1e12, "tokens", "1T tokens"),
                                               (6_221_391, "sequences", "6.22M sequences")])
def test_counts_read_with_their_unit(value, unit, text):
    assert fmt_count(value, unit) == text


@given(st.floats(min_value=1e-9, max_value=1e15, allow_nan=False))
def test_no_formatter_shows_more_than_four_significant_digits_or_a_number_without_its_unit(x):
    for text, unit in ((fmt_bytes(x), "B"), (fmt_count(x, "tokens/s"), "tokens/s"), (fmt_seconds(x), "s"),
                       (fmt_percent(x / 1e15), "%")):
        assert text.endswith(unit), text
        assert significant_digits(text) <= 4 or "," in text, text
    assert "e" not in fmt_number(x) or x < 1e-3
    assert not math.isnan(float(fmt_number(123.456)))
