"""Serving jobs in the job service, without the app: a serving plan (the CPU lane) and a measured serving
run (the GPU lane) in real workers, recorded in the history with their kinds; a stopped run ends cancelled
with no worker left; the per-user limits and quotas; a restart that interrupts what a killed server left."""

from __future__ import annotations

import io
import os
import subprocess

import pandas as pd
import pytest

from migration.config.serving import serve_request, serve_run_request
from migration.hardware import GPU_SPECS
from migration.service.history import History
from migration.service.job import LimitError, Limits, NotYourJob
from migration.service.jobs import INTERRUPTED, JobService
from tests.server import wait_until

# Small enough to take seconds: two batch sizes of the tiny models, short prompts and generations.
PLAN = dict(workload="llama", preset="tiny", target="l4", prompt_len=16, gen_len=8, precision="bf16", batches="1,2")
RUN = dict(workload="transformer", preset="tiny", precision="fp32", requests=4, batches="1,2", prompt_min=4,
           prompt_max=8, gen_min=2, gen_max=4)


def make_service(tmp_path, **limits) -> JobService:
    return JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", Limits(**limits), gpu_host=False)


def serving_workers() -> list[int]:
    """This process's serving workers still alive."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "migration.running.worker .*--mode serve-"],
                         check=False, capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.slow
def test_a_serving_plan_and_run_complete_in_their_lanes_and_are_recorded_with_their_kinds(tmp_path):
    service = make_service(tmp_path)
    plan = service.submit_serve_plan("alice", serve_request(**PLAN), label="plan for an L4")
    run = service.submit_serve_run("alice", serve_run_request(**RUN), label="measured here")
    assert (plan.kind, plan.lane, run.kind, run.lane) == ("serve-plan", "cpu", "serve-run", "gpu")
    wait_until(lambda: plan.finished and run.finished, 300, poll_s=0.2)
    assert (plan.state, run.state) == ("done", "done"), (plan.error, run.error)
    assert {1, 2} <= {row["batch"] for row in plan.result["rows"]} and plan.result["target"] == GPU_SPECS["l4"].name
    assert [row["batch"] for row in run.result["rows"]] == [1, 2] and run.result["backend"] == "cpu"

    entries = {e["kind"]: e for e in service.history.entries(user="alice")}
    assert set(entries) == {"serve-plan", "serve-run"}
    planned, measured = entries["serve-plan"], entries["serve-run"]
    assert (planned["status"], planned["label"], planned["device_kind"]) == ("ok", "plan for an L4",
                                                                             GPU_SPECS["l4"].name)
    assert planned["payload"]["rows"] == plan.result["rows"] and planned["predicted_peak_bytes"] > 0
    assert planned["payload"]["request"]["batches"] == [1, 2] and planned["payload"]["wall_s"] > 0
    assert (measured["status"], measured["backend"], measured["recompilations"]) == ("ok", "cpu", 0)
    assert measured["tokens_per_s"] > 0 and measured["peak_memory_bytes"] > 0
    assert measured["payload"]["rows"] == run.result["rows"]

    # The CSV export holds both kinds; their worker time counts against the day's budget, across a restart too.
    frame = pd.read_csv(io.StringIO(service.history.to_csv(user="alice")))
    assert sorted(frame["kind"]) == ["serve-plan", "serve-run"] and frame["largest_batch"].notna().any()
    assert service.used_today("alice") > 0
    assert History(tmp_path / "h.sqlite").worker_seconds_since("2000-01-01 00:00:00")["alice"] > 0
    assert serving_workers() == []


@pytest.mark.slow
def test_a_stopped_serving_run_ends_cancelled_and_the_limits_apply(tmp_path):
    service = make_service(tmp_path, jobs_per_user=1)
    long = serve_run_request(**RUN | dict(requests=1000, batches="1", prompt_max=16, gen_min=40, gen_max=48))
    job = service.submit_serve_run("alice", long, label="long stream")
    with pytest.raises(LimitError, match="limit 1 per user"):
        service.submit_serve_run("alice", serve_run_request(**RUN))
    with pytest.raises(LimitError, match="limit 1 per user"):
        service.submit_serve_plan("alice", serve_request(**PLAN))
    queued = service.submit_serve_run("bob", serve_run_request(**RUN), label="bob's")
    wait_until(lambda: any(e["event"] == "serving" for e in job.events_since(0)), 120)
    assert service.position(queued) == 1  # the GPU lane runs one job at a time
    with pytest.raises(NotYourJob):
        service.cancel(job.id, "bob")
    [worker] = serving_workers()  # the run's; bob's waits for the lane
    # A cancel kills the worker at its next event (a heartbeat at least every half second): about a
    # second. The wait allows 14 s more for a loaded 2-core box; a run that ended by itself meanwhile
    # is "done", not "cancelled", and fails below.
    service.cancel(job.id, "alice")
    wait_until(lambda: job.finished and worker not in serving_workers(), 1 + 14)
    assert job.state == "cancelled"
    entry = service.history.entries(ids=[job.id])[0]
    assert (entry["kind"], entry["status"]) == ("serve-run", "cancelled")
    assert entry["payload"]["message"] == "cancelled: stopped on request"
    service.cancel(queued.id, "bob")  # bob's: it may have started by now; either way it ends cancelled
    wait_until(lambda: queued.finished, 30)
    assert queued.state == "cancelled"
    assert service.history.entries(ids=[queued.id])[0]["status"] == "cancelled"


def test_quotas_refuse_before_anything_is_recorded_and_a_restart_interrupts_what_was_left(tmp_path):
    """No worker starts here: the quick test loop runs it."""
    history = History(tmp_path / "h.sqlite")
    done = history.open_entry("serve-run", "transformer", "tiny", {"config": {}}, user="alice")
    history.complete_serving(done, "ok", {"request": {}, "rows": [], "wall_s": 120.0})
    left = history.open_entry("serve-plan", "llama", "tiny", {"config": {}}, user="bob")  # a killed server's
    service = JobService(history, tmp_path / "exports", Limits(user_day_s=60, history_rows_per_user=10),
                         gpu_host=False)
    assert service.recovered == [left]
    entry = history.entries(ids=[left])[0]
    assert (entry["status"], entry["payload"]["message"]) == ("interrupted", INTERRUPTED)
    with pytest.raises(LimitError, match="daily budget"):  # alice's 120 s of serving today, against 60 s
        service.submit_serve_run("alice", serve_run_request(**RUN))
    for _ in range(9):
        history.open_entry("serve-plan", "llama", "tiny", {"config": {}}, user="bob")
    with pytest.raises(LimitError, match="history quota"):
        service.submit_serve_plan("bob", serve_request(**PLAN))
    assert len(history.entries()) == 11  # nothing recorded for the refused ones
    assert serving_workers() == []
