"""Faults a shared box survives, each tried against the running app (a real server, real workers,
real signals): out of memory, a worker killed or hung, Stop and a dropped connection, the server
stopped or killed with jobs queued and running, a full history."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from migration.config.requests import RunConfig
from migration.service.history import History, HistoryError
from migration.results import RunReport
from tests.server import ROOT, Server, holds_within, value

pytestmark = pytest.mark.slow

# Target "local": the plan is a quick compile for this machine, so the tests spend their time on faults.
FORM = ["transformer", "tiny", "tpu-v5e-8", 32, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0, 0, 0, "preset", "auto", 8]


def run_args(steps, label="", plan_file=None):
    return (plan_file, steps, 0.003, False, False, False, False, False, *FORM, label)


def gone(pid):
    """The process no longer runs (absent, or a zombie not yet reaped by whoever adopted it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:")) in ("Z", "X")




STEP_LINE = re.compile(r"\bstep \d+ of \d+")  # a worker's step event, as describe() words it


def wait_for_steps(job, within_s=180):
    """Until the job's progress shows a finished step. Not any line with "step" in it: the budget note heading
    each line ("... steps") and the queue line come before the first step."""
    assert holds_within(lambda: any(STEP_LINE.search(str(value(o[0]))) for o in job.outputs()), within_s, 0.2), \
        "the run never reported a step"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The cache folder of this module's servers that run jobs: a run with no plan plans first, and
    the compiles of that plan are made once for the module."""
    return tmp_path_factory.mktemp("faults-cache")


@pytest.fixture(scope="module")
def app(tmp_path_factory, cache):
    a = Server(tmp_path_factory.mktemp("faults"), "--silence-seconds", "3", cache=cache)
    yield a
    a.close()


@pytest.fixture(autouse=True)
def one_fault_at_a_time(request):
    """Each test starts on a server with no run worker left by the one before: a test that failed half-way (its
    queued run still going) would otherwise hand the next test that run's worker to kill or stop."""
    yield
    if "app" in request.fixturenames:
        a = request.getfixturevalue("app")
        if not holds_within(lambda: not a.workers("run"), 60, 0.5):
            for pid in a.workers("run"):
                os.kill(pid, signal.SIGKILL)


def test_out_of_memory_says_does_not_fit_and_the_next_job_runs(app, tmp_path):
    # A plan saved for this machine, edited to a per-device batch no host can hold (~9 TB of logits: the
    # tiny model's two layers, with a 32k vocabulary over 1,024 tokens). Its global batch is replaced
    # below: planned at 8 with the policy given, one compile finds it.
    plan_path = tmp_path / "plan.json"
    subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "transformer", "--preset", "tiny",
                    "--vocab", "32768", "--seq", "1024", "--remat", "none", "--no-tpu-compile",
                    "--global-batch", "8", "--target", "local", "--json", str(plan_path)], cwd=ROOT, check=True,
                   capture_output=True, env={**os.environ, "MIGRATION_CACHE_DIR": str(tmp_path / "cache")})
    plan = json.loads(plan_path.read_text())
    plan.update(per_device_batch=65536, global_batch=65536, accumulation_steps=1)
    plan_path.write_text(json.dumps(plan))
    from gradio_client import handle_file

    result = app.client.submit(*run_args(2, plan_file=handle_file(str(plan_path))), api_name="/run").result(timeout=600)
    headline = value(result[0])
    assert "does not fit" in headline and "out of memory at 65536 per device" in headline
    assert "predicted peak" in headline and "GiB" in headline and "accumulation" in headline  # what to try
    # The server keeps serving, and the next job runs.
    assert app.client.predict("mine", "run", "all", "failed", api_name="/history")["data"]
    assert "Run finished" in value(app.client.submit(*run_args(3), api_name="/run").result(timeout=300)[0])


def test_a_worker_killed_from_outside_is_crashed_with_its_partial_curve_and_the_queue_moves_on(app):
    other = app.connect()
    victim = app.client.submit(*run_args(100_000, label="victim"), api_name="/run")
    wait_for_steps(victim)
    queued = other.submit(*run_args(3, label="next in line"), api_name="/run")
    assert holds_within(lambda: any("position 1" in str(value(o[0])) for o in queued.outputs()), 30, 0.2), \
        "the second run shows its queue position while it waits"
    os.kill(app.wait_for_worker(), signal.SIGKILL)
    progress, results, losses, *_ = [value(o) for o in victim.result(timeout=120)]
    assert "Run failed (crashed)" in progress and "SIGKILL" in progress
    seen = [str(value(o[0]))[-160:] for o in victim.outputs()]
    assert len(losses["data"]) >= 1, seen  # the partial loss curve is kept
    assert "Run finished" in value(queued.result(timeout=300)[0])
    history = app.client.predict("mine", "run", "all", "all", api_name="/history")
    by_label = {row[history["headers"].index("label")]: row for row in history["data"]}
    assert by_label["victim"][history["headers"].index("status")] == "failed"


def test_a_silent_worker_is_killed_and_reported_as_timeout(app):
    job = app.client.submit(*run_args(100_000), api_name="/run")
    wait_for_steps(job)
    worker = app.wait_for_worker()
    os.kill(worker, signal.SIGSTOP)  # hung: no steps, no heartbeat
    stopped_at = time.monotonic()
    progress = value(job.result(timeout=60)[0])
    assert "Run failed (timeout)" in progress and "sent nothing" in progress
    # Killed after its 3 s of silence (--silence-seconds 3), not at the run's time limit (an hour):
    # 12 s to spare for the kill and the result's way to the client on a loaded 2-core box.
    assert time.monotonic() - stopped_at < 3 + 12 and holds_within(lambda: gone(worker), 5)


# The documented bound (docs/hosting.md): a run's worker is killed within two seconds of its tab or connection going.
# The test waits for that on a loaded 2-core box, where the server's event loop, the job's thread and
# the kill queue for the CPU behind other tests' compiles, so it allows a margin of 13 s on top. A
# worker the server never stops runs its 100,000 steps for many minutes: the wait still fails then.
DISCONNECT_BOUND_S = 2.0
LOADED_BOX_MARGIN_S = 13.0


def run_status(app, label):
    """The history status of the run labelled `label` (None until it is recorded)."""
    history = app.client.predict("mine", "run", "all", "all", api_name="/history")
    cols = history["headers"]
    return next((row[cols.index("status")] for row in history["data"] if row[cols.index("label")] == label), None)


def test_a_dropped_connection_stops_the_worker_and_the_next_job_starts(app, tmp_path):
    # A client in its own process, killed like a closed browser: its connection drops with it.
    script = tmp_path / "client.py"
    script.write_text(
        "import sys, time\nfrom gradio_client import Client\n"
        f"c = Client({app.url!r}, verbose=False, headers={app.headers!r})\n"
        f"job = c.submit(*{list(run_args(100_000, label='dropped'))!r}, api_name='/run')\n"
        "while not any('step' in str(o[0]) for o in job.outputs()):\n    time.sleep(0.2)\n"
        "print('stepping', flush=True)\ntime.sleep(600)\n")
    client = subprocess.Popen([sys.executable, str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout.readline().strip() == "stepping"
        worker = app.wait_for_worker()
        client.kill()
        dropped_at = time.monotonic()
        stopped = holds_within(lambda: gone(worker), DISCONNECT_BOUND_S + LOADED_BOX_MARGIN_S)
        assert stopped, f"the worker still runs {time.monotonic() - dropped_at:.1f} s after its connection dropped"
    finally:
        client.kill()
        client.wait()
    # Stopped by the server because its connection went: the run's record ends cancelled.
    assert holds_within(lambda: run_status(app, "dropped") not in (None, "queued", "running"), 30, 0.5), \
        f"the run's record is still {run_status(app, 'dropped')!r}"
    assert run_status(app, "dropped") == "cancelled"
    assert "Run finished" in value(app.client.submit(*run_args(3), api_name="/run").result(timeout=300)[0])


@pytest.fixture(scope="module")
def restarted(tmp_path_factory, cache):
    """The app of the stopped-server cases, started by the first case. Each case stops it its own way
    and starts it again on the same history; the next case goes on from that restart (a start fewer
    per case). The labels say which case a record belongs to."""
    holder = {"tmp": tmp_path_factory.mktemp("restarted"), "cache": cache, "app": None, "finished": []}
    yield holder
    if holder["app"] is not None:
        holder["app"].close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_server_leaves_no_worker_and_the_restart_keeps_every_record(restarted, sig):
    if restarted["app"] is None:
        restarted["app"] = Server(restarted["tmp"], cache=restarted["cache"])
    app = restarted["app"]
    if app.proc.poll() is not None:  # an earlier case failed before its restart
        app.start()
    label = {what: f"{what} ({sig.name})" for what in ("finished", "running", "queued")}
    try:
        if not restarted["finished"]:  # a finished run's record, kept through every later stop and restart
            assert "Run finished" in value(app.client.submit(*run_args(3, label=label["finished"]), api_name="/run")
                                           .result(timeout=300)[0])
            restarted["finished"].append(label["finished"])
        # No plan in this session: the run plans first, in its job; then a second run waits behind it.
        running = app.client.submit(*run_args(100_000, label=label["running"]), api_name="/run")
        wait_for_steps(running)
        queued = app.connect().submit(*run_args(3, label=label["queued"]), api_name="/run")
        assert holds_within(lambda: any("queued" in str(value(o[0])) for o in queued.outputs()), 30, 0.2)
        worker = app.wait_for_worker()
        os.killpg(app.proc.pid, sig)
        # SIGTERM: the server stops its jobs, waiting up to 10 s for them, then exits; SIGKILL: at
        # once. 20 s to spare on a loaded 2-core box (TimeoutExpired past them).
        app.proc.wait(timeout=10 + 20)
        # Its worker ends with it (its lifeline pipe closes); else it would run its 100,000 steps.
        assert holds_within(lambda: gone(worker), 10), "a worker outlived its server"
    finally:
        app.close()
    app.start()  # same history; left running for the next case (the fixture stops the last one)
    history = app.client.predict("mine", "all", "all", "all", api_name="/history")
    cols = history["headers"]
    rows = [dict(zip(cols, row)) for row in history["data"]]
    status = {(r["kind"], r["label"]): r["status"] for r in rows}
    assert restarted["finished"] and all(status[("run", done)] == "ok" for done in restarted["finished"])
    assert status[("run", label["running"])] == "interrupted" and status[("run", label["queued"])] == "interrupted"
    assert status[("plan", f"{label['running']} · planned for this run")] == "ok"  # the plan made on the way
    csv = pd.read_csv(value(app.client.predict("mine", api_name="/export_history_csv")))
    message = csv.loc[csv["label"] == label["running"], "message"].iloc[0]
    assert "interrupted" in message and "server stopped" in message


def test_a_full_history_is_a_clear_error_and_nothing_stored_is_damaged(tmp_path):
    db = tmp_path / "history.sqlite"
    cap_mb = 0.25
    history = History(db, max_bytes=int(cap_mb * 2**20))
    stored = 0
    for size in (30_000, 3_000, 300, 0):  # until not even a small record fits
        filler = RunReport.from_events(RunConfig(), [], status="failed", failure_kind="crashed", message="x" * size)
        with pytest.raises(HistoryError, match="full"):
            while True:
                history.add_run(filler, label="filler")
                stored += 1
    with pytest.raises(HistoryError, match="full"):  # then entries smaller than any job the app records
        while True:
            entry = history.open_entry("run", "transformer", "tiny", {"config": {}, "message": "x"}, label="f")
            stored += 1
            history.set_status(entry, "failed", "x")  # same size as "queued": never the write that fails
    assert stored >= 3
    app = Server(tmp_path, "--history-max-mb", str(cap_mb), db=db)
    try:
        with pytest.raises(Exception) as err:
            app.client.predict(*run_args(3), api_name="/run")
        text = str(err.value)
        assert "history" in text and "full" in text and "Traceback" not in text
        assert app.workers() == []  # refused before any worker started: a job is never run unrecorded
        # The app keeps serving, and what was stored is intact.
        assert len(app.client.predict("mine", "run", "all", "all", api_name="/history")["data"]) == stored
    finally:
        app.close()
    assert History(db).integrity() == "ok"
    assert len(History(db).entries(kind="run", payload=False)) == stored
