"""The page's tables and charts as people read them: every figure in its unit, no raw float, a compiled peak
never in a measured column, whole-step axes, bars from zero with room above the tallest, memory in the unit
of its largest value."""

import re

import pytest

from migration.common import GiB
from ui.frames import (HISTORY_COLUMNS, bar_limits, compare_frames, curve_frame, history_frame,
                       memory_chart_has_shape, memory_frame)
from ui.serve import plan_frame

# Headers under which a bare whole number is a count the header names; everywhere else a number carries its unit.
COUNT_HEADERS = {"id", "line", "col", "batch", "accum", "global", "devices", "global batch", "predicted #",
                 "measured #", "running sequences"}
BARE_NUMBER = re.compile(r"^-?[\d,]*\.?\d+$")
NUMBER = re.compile(r"\d[\d,]*\.\d+|\d+")


def unreadable(tables: list[dict]) -> list[str]:
    """The cells a person cannot read: a float of more than four significant digits anywhere, or a bare number
    under a header that names no unit or count."""
    bad = []
    for t in tables:
        for row in t["rows"]:
            for i, cell in enumerate(row):
                header = t["head"][i] if i < len(t["head"]) else ""
                for number in NUMBER.findall(cell):
                    if "." in number and len(number.replace(",", "").replace(".", "").lstrip("0")) > 4:
                        bad.append(f"{t['id']}/{header}: {cell!r} (a raw float)")
                if BARE_NUMBER.match(cell) and not (header in COUNT_HEADERS and "." not in cell):
                    bad.append(f"{t['id']}/{header}: {cell!r} (a number without its unit)")
    return bad


CPU = "cpu: XLA memory_analysis of the compiled step (CPU backend figure, not a GPU prediction)"
GPU = "measured: memory_stats() peak_bytes_in_use (max over devices)"


def entry(i: int, source: str, peak: int, predicted: int | None, **more) -> dict:
    return {"id": i, "kind": "run", "created_at": "2026-12-05T10:55:05.123", "workload": "transformer",
            "preset": "tiny", "status": "ok", "per_device_batch": 8, "devices": 1, "accumulation_steps": 1,
            "precision": "bf16", "remat": "none", "device_kind": "cpu", "samples_per_s": 499.89534547744233,
            "tokens_per_s": 31993.30211055631, "mfu": 0.0950123, "peak_memory_bytes": peak,
            "peak_memory_source": source, "predicted_peak_bytes": predicted, "compile_s": 4.1733,
            "payload": {"losses": [5.5, 5.2, 4.9]}, **more}


def test_the_history_reads_in_units_and_never_calls_a_compiled_peak_measured():
    cpu, gpu = entry(1, CPU, 64 * 2**20, None), entry(2, GPU, 3 * GiB, 2 * GiB)
    frame = history_frame([cpu, gpu])
    assert list(frame.columns) == HISTORY_COLUMNS
    rows = frame.set_index("id")
    assert rows.loc[1, "throughput"] == "32k tokens/s" and rows.loc[1, "MFU"] == "9.5%"
    assert rows.loc[1, "compile"] == "4.17 s" and rows.loc[1, "created"] == "2026-12-05 10:55"
    # the CPU run's peak is XLA's compiled figure: shown once, as the prediction, never as measured
    assert (rows.loc[1, "measured peak"], rows.loc[1, "predicted peak"]) == ("", "64 MiB")
    assert (rows.loc[2, "measured peak"], rows.loc[2, "predicted peak"]) == ("3 GiB", "2 GiB")
    shown = {"id": "history", "head": list(frame.columns), "rows": frame.astype(str).values.tolist()}
    assert unreadable([shown]) == []


def test_the_comparison_names_each_memory_bar_by_its_provenance_in_the_unit_that_fits():
    table, throughput, memory, losses = compare_frames([entry(1, CPU, 64 * 2**20, None),
                                                        entry(2, GPU, 96 * 2**20, 80 * 2**20)])
    assert list(throughput["run"]) == ["#1", "#2"]
    assert list(memory["bar"]) == ["#1 compiled", "#2 compiled", "#2 measured"]
    assert memory.attrs["unit"] == "MiB" and list(memory["peak"]) == [64.0, 80.0, 96.0]
    assert set(losses["step"]) == {"1", "2", "3"}  # a short run: whole steps as the axis's categories
    assert bar_limits(memory, "peak") == [0.0, pytest.approx(105.6)]  # from zero, a tenth above the tallest
    assert bar_limits(memory.iloc[0:0], "peak") == [0.0, 1.0]


def test_whole_steps_order_as_numbers_and_long_runs_keep_a_numeric_axis():
    short = curve_frame({"a": [1.0] * 12})
    assert sorted(short["step"]) == [str(i).rjust(2) for i in range(1, 13)]  # " 2" sorts before "10"
    assert [int(s) for s in sorted(short["step"])] == list(range(1, 13))
    long = curve_frame({"a": [1.0] * 100})
    assert long["step"].dtype == "int64"


def test_the_memory_chart_shows_only_with_two_batches_and_in_the_budgets_unit():
    one = memory_frame([{"per_device_batch": 8, "predicted_bytes": 30 * 2**20, "remat": "none"}], 57 * GiB)
    assert not memory_chart_has_shape(one) and one.attrs["unit"] == "GiB"
    two = memory_frame([{"per_device_batch": b, "predicted_bytes": b * 2**20, "remat": "none"} for b in (8, 16)], None)
    assert memory_chart_has_shape(two) and two.attrs["unit"] == "MiB" and list(two["predicted"]) == [8.0, 16.0]


def test_a_serving_plan_table_has_its_units_and_no_zero_gib():
    row = {"batch": 1, "kv_cache_bytes": 12 * 1024, "weights_bytes": 177 * 1024, "predicted_peak_bytes": 230 * 1024,
           "budget_bytes": 71.2 * GiB, "fits": True, "predicted_ttft_s": 6.08e-4, "predicted_tpot_s": 3.38e-4,
           "bandwidth_limit_tpot_s": 5.7e-8, "tokens_per_s_per_gpu": 2960.123, "requests_per_s": 185.4321,
           "decode_bytes_over_needed": 1.1234}
    frame = plan_frame({"rows": [row], "gpus": 1})
    first = frame.iloc[0]
    assert (first["KV cache"], first["weights"], first["TPOT bandwidth limit"]) == ("12 KiB", "177 KiB", "57 ns")
    assert (first["throughput"], first["requests"], first["decode bytes / needed"]) == (
        "2.96k tokens/s", "185 requests/s", "1.12×")
    shown = {"id": "serve", "head": list(frame.columns), "rows": frame.astype(str).values.tolist()}
    assert unreadable([shown]) == []
    assert unreadable([{"id": "raw", "head": ["throughput"], "rows": [["499.89534547744233"]]}])  # the check bites
