"""Autotune: the planner's top ranked choices measured in real workers on the CPU, the verdict, the
refusal when this machine is not the plan's target, and failed candidates kept as rows."""

import csv
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from migration.service.autotune import (
    AutotuneRefused,
    AutotuneSettings,
    autotuned_plan,
    candidates,
    check_target_here,
    measured_row,
    run_autotune,
    start_autotune,
    summarise,
)
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig
from migration.planning.planner import plan_migration
from migration.service.orchestrate import RunOptions, base_config, run_plan
from migration.results import Plan, RunReport

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = AutotuneSettings(top=3, warmup_steps=1, timed_steps=3)


def stub_plan(**fields) -> Plan:
    """A plan with only the fields autotune reads filled in (for the tests that start no worker)."""
    required = {f.name: None for f in dataclasses.fields(Plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    ranked = [choice(64, 1, cost=1.0), choice(32, 2, cost=2.0), choice(16, 4, cost=4.0)]
    base = dict(status="ok", workload="mlp", preset="tiny", target="local", target_name="this machine: cpu (cpu)",
                gpus=1, requested_global_batch=64, global_batch=64, global_batch_exact=True, precision="bf16",
                remat="none", per_device_batch=64, accumulation_steps=1, predicted_step_s=None,
                predicted_peak_bytes=1000, budget_bytes=10**9, memory_fraction=0.8, decisions=[], ranked=ranked,
                table=[], planned_on="cpu", planned_device_kind="cpu", model={})
    return Plan(**{**required, **base, **fields})


def choice(batch, accum, cost, remat="none", exact=True, seconds=None):
    return {"sharding": "replicated", "remat": remat, "per_device_batch": batch, "accumulation_steps": accum,
            "global_batch": batch * accum, "exact": exact, "fill": 1.0, "predicted_step_s": seconds,
            "relative_cost": cost}


def report(cfg_batch, accum, step_ms, status="ok", kind=None, message=""):
    cfg = RunConfig(workload="mlp", per_device_batch=cfg_batch, accumulation_steps=accum, steps=len(step_ms) or 3,
                    warmup_steps=1)
    events = [{"event": "started", "backend": "cpu", "device_kind": "cpu", "device_count": 1}]
    events += [{"event": "step", "index": i, "loss": 1.0, "step_ms": ms} for i, ms in enumerate(step_ms)]
    return RunReport.from_events(cfg, events, status=status, failure_kind=kind, message=message)


def verdict_of(plan, reports):
    rows = [measured_row(plan, rank, c, r, warmup_steps=1)
            for (rank, c), r in zip(candidates(plan, len(reports))[0], reports)]
    return summarise(plan, rows, reports, [], SETTINGS, "cpu")


# -- without workers ----------------------------------------------------------------------------

def test_a_failed_candidate_is_a_row_and_never_the_pick():
    plan = stub_plan()
    oom = report(64, 1, [], status="failed", kind="oom", message="out of memory while running step 1")
    result = verdict_of(plan, [oom, report(32, 2, [9.0, 5.0, 6.0, 7.0]), report(16, 4, [9.0, 4.0, 4.5, 5.0])])
    assert [r.predicted_rank for r in result.rows] == [1, 2, 3]
    failed = result.rows[0]
    assert (failed.status, failed.failure_kind, failed.measured_step_ms, failed.measured_rank) == ("failed", "oom", None, None)
    assert result.pick_rank == 3 and result.pick.measured_step_ms == 4.5  # median of the timed steps, warm-up excluded
    assert result.ranking_held is False and "predicted-first (#1) oom" in result.verdict
    assert result.measured_order == [3, 2] and result.predicted_order == [2, 3] and result.order_held is False
    assert "CPU timings" in result.measured_on and "CPU timings" in result.verdict
    assert [row["status"] for row in result.table_rows()] == ["failed", "ok", "ok"]


def test_ranking_held_when_the_predicted_first_measures_fastest():
    plan = stub_plan(ranked=[choice(64, 1, 1e-3, seconds=1e-3), choice(32, 2, 2e-3, seconds=2e-3),
                             choice(16, 4, 4e-3, seconds=4e-3)])
    result = verdict_of(plan, [report(64, 1, [9.0, 2.0, 2.0, 2.0]), report(32, 2, [9.0, 3.0, 3.0, 3.0]),
                               report(16, 4, [9.0, 5.0, 5.0, 5.0])])
    assert result.pick_rank == 1 and result.ranking_held is True and result.order_held is True
    assert result.prediction == "seconds"
    assert result.rows[0].measured_over_predicted == pytest.approx(2.0)  # 2 ms measured over 1 ms predicted
    assert [r.measured_vs_best for r in result.rows] == pytest.approx([1.0, 1.5, 2.5])
    tuned = autotuned_plan(plan, result)
    assert (tuned.per_device_batch, tuned.accumulation_steps) == (64, 1) and tuned.decisions[-1].decision == "autotune"


def test_candidates_keep_the_global_batch_and_skip_what_the_planner_found_over_budget():
    over = {"sharding": "replicated", "remat": "none", "per_device_batch": 64, "accumulation_steps": 1,
            "precision": "bf16", "predicted_bytes": 2 * 10**9}
    plan = stub_plan(ranked=[choice(64, 1, 1.0), choice(48, 2, 1.5, exact=False), choice(32, 2, 2.0),
                             choice(32, 2, 2.0), choice(16, 4, 4.0, remat="full"), choice(8, 8, 8.0)],
                     table=[over])
    taken, skipped = candidates(plan, 3)
    assert [rank for rank, _ in taken] == [3, 5, 6]
    assert [s["predicted_rank"] for s in skipped] == [1, 2, 4]
    assert "does not fit" in skipped[0]["why"] and "global batch to 96" in skipped[1]["why"]
    assert "same configuration" in skipped[2]["why"]


def test_refuses_a_gpu_target_this_machine_does_not_have():
    plan = stub_plan(target="h100-sxm", target_name="H100 SXM5 80GB", planned_device_kind=None)
    with pytest.raises(AutotuneRefused) as refused:
        check_target_here(plan)  # this machine: no NVIDIA GPU
    text = str(refused.value)
    assert "\n" not in text and "H100 SXM5 80GB" in text and "CPU only" in text and "target `local`" in text
    with pytest.raises(AutotuneRefused):
        check_target_here(plan, gpu_names=["NVIDIA A100-SXM4-80GB"])
    assert check_target_here(plan, gpu_names=["NVIDIA H100 80GB HBM3"]) == "gpu"
    with pytest.raises(AutotuneRefused):  # a local plan made on a GPU, here on a CPU
        check_target_here(stub_plan(planned_on="gpu", planned_device_kind="NVIDIA H200"), gpu_names=[])
    assert check_target_here(stub_plan()) == "cpu"


def test_refuses_before_any_worker_starts():
    with pytest.raises(AutotuneRefused, match="infeasible"):
        start_autotune(stub_plan(status="infeasible", message="does not fit even at batch 1"))
    with pytest.raises(AutotuneRefused, match="keeps the requested global batch"):
        start_autotune(stub_plan(ranked=[choice(48, 2, 1.0, exact=False)]))
    with pytest.raises(ConfigError, match="top"):
        start_autotune(stub_plan(), AutotuneSettings(top=0))


def test_cli_refuses_a_catalog_gpu_plan_in_one_line(tmp_path):
    path = tmp_path / "h100.json"
    plan_migration(PlanRequest(workload="mlp", preset="tiny", target="h100-sxm", global_batch=64, compile_for_tpu=False),
                   lambda *a, **k: None).to_json(path)  # a real plan: the CLI checks every field before the target
    proc = subprocess.run([sys.executable, "-m", "migration", "autotune", "--plan", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: cannot autotune")
    assert "Traceback" not in proc.stderr and "H100 SXM5 80GB" in proc.stderr


# -- real worker runs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def local_plan():
    """The mlp tiny for this machine (the CPU); global batch 64 leaves 64x1, 32x2, 16x4, ... exact."""
    plan = plan_migration(PlanRequest(workload="mlp", preset="tiny", target="local", global_batch=64,
                                      compile_for_tpu=False), lambda *a, **k: None)
    assert plan.ok and plan.planned_on == "cpu"
    assert len(candidates(plan, 3)[0]) == 3
    return plan


@pytest.fixture(scope="module")
def cli_run(local_plan, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("autotune")
    local_plan.to_json(tmp / "plan.json")
    proc = subprocess.run([sys.executable, "-m", "migration", "autotune", "--plan", str(tmp / "plan.json"),
                           "--top", "3", "--warmup", "1", "--steps", "3", "--json", str(tmp / "out.json"),
                           "--csv", str(tmp / "out.csv")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(tmp / "out.csv") as f:
        rows = list(csv.DictReader(f))
    return proc.stdout, json.loads((tmp / "out.json").read_text()), rows


@pytest.mark.slow
def test_autotune_measures_the_top_three_on_the_cpu(local_plan, cli_run):
    stdout, result, csv_rows = cli_run
    rows = result["rows"]
    assert [r["predicted_rank"] for r in rows] == [1, 2, 3]
    assert all(r["status"] == "ok" and r["measured_step_ms"] > 0 and r["timed_steps"] == 3 for r in rows)
    assert all(r["global_batch"] == 64 for r in rows)
    assert len({(r["per_device_batch"], r["accumulation_steps"], r["remat"], r["sharding"]) for r in rows}) == 3
    for row, rep in zip(rows, result["reports"]):  # the median of the worker's own timed step events
        assert row["measured_step_ms"] == pytest.approx(rep["step_ms_median"])
        assert len(rep["step_ms"]) == 4 and rep["warmup_steps"] == 1
    fastest = min(rows, key=lambda r: r["measured_step_ms"])
    assert result["pick_rank"] == fastest["predicted_rank"]
    assert result["ranking_held"] == (fastest["predicted_rank"] == 1) == (rows[0]["measured_rank"] == 1)
    assert result["measured_order"] == [r["predicted_rank"] for r in sorted(rows, key=lambda r: r["measured_step_ms"])]
    assert result["order_held"] == (result["measured_order"] == [1, 2, 3])
    assert result["backend"] == "cpu" and result["measured_on"].startswith("CPU timings")
    assert "timings: CPU timings" in stdout and "verdict: pick #" in stdout and "ranking held: " in stdout
    assert [int(r["predicted_rank"]) for r in csv_rows] == [1, 2, 3]
    assert all(r["measured_on"].startswith("CPU timings") for r in csv_rows)
    assert [r["picked"] for r in csv_rows].count("True") == 1


@pytest.mark.slow
def test_the_api_measures_on_the_cpu_and_the_pick_runs_as_a_plan(tmp_path):
    """Two of the planner's choices for the mlp tiny at global batch 1024, the slower put first: 512
    accumulation steps of 2 (measured here 26-80 ms a step on 2 busy cores) against one step of 1024
    (4-13 ms). The pick is the fastest by the workers' own step times, not the predicted first, and
    the tuned plan runs through `run_plan` with the picked settings."""
    made = plan_migration(PlanRequest(workload="mlp", preset="tiny", target="local", global_batch=1024,
                                      compile_for_tpu=False), lambda *a, **k: None)
    assert made.ok and made.planned_on == "cpu"
    fast, slow = made.ranked[0], made.ranked[-1]
    assert (fast["per_device_batch"], fast["accumulation_steps"]) == (made.per_device_batch,
                                                                      made.accumulation_steps) == (1024, 1)
    assert (slow["per_device_batch"], slow["accumulation_steps"], slow["global_batch"]) == (2, 512, 1024)
    plan = dataclasses.replace(made, ranked=[slow, fast])
    events = []
    result = run_autotune(plan, AutotuneSettings(top=2, warmup_steps=1, timed_steps=3), on_event=events.append)
    assert events[0]["event"] == "status" and events[-1]["event"] == "result"
    assert any(e["event"] == "progress" for e in events) and any(e["event"] == "measured" for e in events)
    assert [r.predicted_rank for r in result.rows] == [1, 2] and all(r.ok for r in result.rows)
    assert [(r.per_device_batch, r.accumulation_steps) for r in result.rows] == [(2, 512), (1024, 1)]
    assert [r.planned for r in result.rows] == [False, True]
    assert result.backend == "cpu" and [rep.backend for rep in result.reports] == ["cpu", "cpu"]
    # The measured figures, from the workers' step events (the warm-up step left out), decide the pick.
    assert all(len(rep.step_ms) == 4 for rep in result.reports)
    timed = [statistics.median(rep.step_ms[1:]) for rep in result.reports]
    assert [r.measured_step_ms for r in result.rows] == pytest.approx(timed)
    assert timed[1] < timed[0], timed  # one step of 1024 beats 512 steps of 2
    fastest = result.rows[1]
    assert result.pick_rank == 2 and result.pick is fastest
    assert result.ranking_held is False and result.measured_order == [2, 1] and result.order_held is False
    assert result.verdict.startswith("pick #2: 1024 per device x 1 accumulation")
    assert "the ranking did not hold" in result.verdict
    tuned = autotuned_plan(plan, result)
    assert (tuned.per_device_batch, tuned.accumulation_steps, tuned.remat, tuned.sharding) == \
        (fastest.per_device_batch, fastest.accumulation_steps, fastest.remat, fastest.sharding)
    assert tuned.decisions[-1].decision == "autotune" and tuned.decisions[-1].value == "#2"
    # The tuned plan runs as a plan: its migrated run uses the picked choice.
    ran = [ev["result"] for ev in run_plan(tuned, base_config(tuned, steps=2, warmup_steps=1, platform="cpu"),
                                           RunOptions(), tmp_path) if ev["event"] == "result"]
    (migrated,) = ran
    main = migrated.main
    assert [name for name, _ in migrated.runs] == ["migrated"] and main.ok, main.message
    assert main.backend == "cpu" and len(main.step_ms) == 2
    assert (main.per_device_batch, main.accumulation_steps, main.remat, main.sharding, main.global_batch) == \
        (fastest.per_device_batch, fastest.accumulation_steps, fastest.remat, fastest.sharding, 1024)
