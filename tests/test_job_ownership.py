"""Who owns a job and what the queue does with it, in-process and without workers: each job's work
is a function of the test (it waits on an event, fails, or finishes), so that the service's own
rules are what is checked: only the owner sees and stops a job, per-user and total limits, the
order a lane starts its jobs in, what the history records for each ending, and a shutdown."""

from __future__ import annotations

import os
import sqlite3
import threading
import time

import pytest

from migration.common import ConfigError
from migration.service import jobs as jobs_module
from migration.service.history import History, HistoryError
from migration.service.job import (Job, Limits, LimitError, NotYourJob, TokenBuckets, pump, retry_text, until_cancelled,
                                   user_exports)
from migration.service.jobs import INTERRUPTED, JobService
from migration.running.runner import LocalExecutor
from migration.running.worker_env import resolve_platform
from tests.server import wait_until

# How long a test waits for a job to start or end (each takes milliseconds here). Under bench/mutation.py
# a mutant that never lets a job start fails at this bound, so the bench shortens it.
WITHIN_S = float(os.environ.get("MIGRATION_TEST_WAIT_S", "10"))


class Gate:
    """Work that holds its lane until released, and says when it started."""

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()

    def __call__(self, job):
        self.started.set()
        self.release.wait(30)


def service_for(tmp_path, **limits) -> JobService:
    return JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", Limits(**limits), gpu_host=False)


def submit(service, user, work, label="", lane="gpu", slots=1) -> Job:
    return service._submit("run", user, label, lane, f"{user}'s {label}", "mlp", "tiny", {"config": {}}, work,
                           slots=slots)


def status_of(service, job) -> tuple[str, str | None]:
    entry = service.history.entries(ids=[job.id])[0]
    return entry["status"], entry["payload"].get("message")


def test_only_the_owner_sees_and_stops_a_job(tmp_path):
    service = service_for(tmp_path)
    gate = Gate()
    job = submit(service, "alice", gate, "alice's")
    assert service.get(job.id, "alice") is job
    with pytest.raises(NotYourJob, match=f"job {job.id} belongs to another user; you can only see and stop your own"):
        service.get(job.id, "bob")
    with pytest.raises(NotYourJob):
        service.cancel(job.id, "bob")
    assert not job.cancel_requested.is_set()
    with pytest.raises(NotYourJob):
        service.cancel(job.id, "")  # no name is not everyone's name
    with pytest.raises(LookupError, match=f"job {job.id + 1}: not a current job of this server"):
        service.get(job.id + 1, "alice")
    assert service.jobs("alice") == [job] and service.jobs("bob") == [] and service.jobs() == [job]
    gate.started.wait(WITHIN_S)
    assert service.cancel(job.id, "alice") is job and job.cancel_requested.is_set()
    gate.release.set()
    wait_until(lambda: job.finished, WITHIN_S)
    assert job.state == "cancelled" and status_of(service, job) == ("cancelled", "cancelled: stopped on request")


def test_per_user_and_total_limits_count_what_waits_or_runs(tmp_path):
    service = service_for(tmp_path, jobs_per_user=2, queue_size=3, tasks_per_user=1, task_queue=2)
    gate = Gate()
    a1, a2 = submit(service, "alice", gate), submit(service, "alice", gate)
    with pytest.raises(LimitError, match=r"^alice already has 2 job\(s\) waiting or running \(limit 2 per user\); "
                                         r"wait for one to finish or stop one$"):
        submit(service, "alice", gate)
    b1 = submit(service, "bob", gate)
    with pytest.raises(LimitError, match=r"^the queue is full \(3 job\(s\) waiting or running, limit 3\); try "
                                         r"again later$"):
        submit(service, "carol", gate)
    # tasks (code checks, probes) have limits of their own: full job queues do not refuse them
    t1 = service._submit_task("check", "alice", "a check", gate)
    assert t1.id < 0 and not t1.recorded
    with pytest.raises(LimitError, match=r"^alice already has 1 code check\(s\) or probe\(s\) waiting or running "
                                         r"\(limit 1 per user\)"):
        service._submit_task("check", "alice", "another", gate)
    t2 = service._submit_task("probe", "", "a probe", gate)
    with pytest.raises(LimitError, match=r"^you already have 1 code check\(s\) or probe\(s\)"):
        service._submit_task("probe", "", "another", gate)
    with pytest.raises(LimitError, match=r"^the queue is full \(2 code check\(s\) or probe\(s\) waiting or running, "
                                         r"limit 2\)"):
        service._submit_task("check", "carol", "a third", gate)
    assert len(service.history.entries()) == 3  # a refused job is never recorded; tasks never are
    service.cancel(a2.id, "alice")  # a queued job that ends frees its owner's room
    wait_until(lambda: a2.finished, WITHIN_S)
    submit(service, "alice", gate)
    gate.release.set()
    wait_until(lambda: all(j.finished for j in service.jobs()), WITHIN_S)
    assert {j.state for j in (a1, b1, t1, t2)} == {"done"}
    submit(service, "carol", gate)  # the queue has room again


def test_a_lane_takes_turns_between_users_and_runs_each_users_jobs_in_order(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gates = {}

    def job(user, label):
        gates[label] = Gate()
        return submit(service, user, gates[label], label)

    carol = job("carol", "c1")
    gates["c1"].started.wait(WITHIN_S)
    a1, a2, a3 = job("alice", "a1"), job("alice", "a2"), job("alice", "a3")
    b1, b2 = job("bob", "b1"), job("bob", "b2")
    c2 = job("carol", "c2")
    # carol was served (her running job); alice and bob never were: by first submission, then carol
    order = [a1, b1, c2, a2, b2, a3]
    assert [service.position(j) for j in order] == [1, 2, 3, 4, 5, 6]
    assert service.position(carol) is None and service.running("gpu") == [carol] and service.running("cpu") == []
    started = []
    for j in [carol, *order]:
        gates[j.label].started.wait(WITHIN_S)
        started.append(j)
        assert service.running("gpu") == [j]
        gates[j.label].release.set()
        wait_until(lambda: j.finished, WITHIN_S)
    assert started == [carol, *order]
    # now bob was served before alice (b2 before a3): waiting behind dave, bob's job goes first
    hold = job("dave", "d1")
    gates["d1"].started.wait(WITHIN_S)
    a4, b3 = job("alice", "a4"), job("bob", "b3")
    assert service.position(b3) == 1 and service.position(a4) == 2
    for g in gates.values():
        g.release.set()
    wait_until(lambda: hold.finished and b3.finished and a4.finished, WITHIN_S)
    assert hold.lane_started_at < b3.lane_started_at < a4.lane_started_at


def test_lanes_are_separate_and_a_lane_runs_as_many_jobs_as_it_has_slots(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    cpu = [Gate() for _ in range(3)]
    plans = [submit(service, "alice", g, f"p{i}", lane="cpu") for i, g in enumerate(cpu)]
    gpu = Gate()
    run = submit(service, "bob", gpu, "r", lane="gpu")
    cpu[0].started.wait(WITHIN_S), cpu[1].started.wait(WITHIN_S), gpu.started.wait(WITHIN_S)
    assert service.running("cpu") == plans[:2] and service.position(plans[2]) == 1  # two plan slots
    assert service.running("gpu") == [run]
    cpu[0].release.set()
    assert cpu[2].started.wait(WITHIN_S)
    for g in (*cpu, gpu):
        g.release.set()
    wait_until(lambda: all(j.finished for j in service.jobs()), WITHIN_S)


def test_each_ending_is_recorded_with_its_reason(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)

    def refused(job):
        raise ConfigError("steps", "must be a whole number from 1 to 50")

    def broken(job):
        raise RuntimeError("boom\nsecond line")

    def fine(job):
        service.history.set_status(job.id, "ok")

    def history_full(job):
        raise HistoryError("the history could not record the run: disk full")

    ended = {name: submit(service, "alice", work, name) for name, work in
             (("refused", refused), ("broken", broken), ("fine", fine), ("history_full", history_full))}
    wait_until(lambda: all(j.finished for j in ended.values()), WITHIN_S)
    assert {n: j.state for n, j in ended.items()} == {"refused": "failed", "broken": "failed", "fine": "done",
                                                       "history_full": "failed"}
    assert ended["refused"].error == "steps: must be a whole number from 1 to 50"
    assert ended["broken"].error == "internal error: RuntimeError: boom"
    assert ended["fine"].error is None
    assert ended["history_full"].error == "the history could not record the run: disk full"
    assert status_of(service, ended["refused"]) == ("failed", "steps: must be a whole number from 1 to 50")
    assert status_of(service, ended["broken"]) == ("failed", "internal error: RuntimeError: boom")
    assert status_of(service, ended["fine"])[0] == "ok"  # the work's own record stands
    events = [e["event"] for e in ended["fine"].events_since(0)]
    assert events == ["started"]
    assert all(j.used_s >= 0 and j.lane_started_at is not None for j in ended.values())


def test_a_queued_job_cancelled_never_starts(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    first, second = Gate(), Gate()
    running = submit(service, "alice", first, "running")
    first.started.wait(WITHIN_S)
    queued = submit(service, "alice", second, "queued")
    assert service.position(queued) == 1
    service.cancel(queued.id, "alice")
    wait_until(lambda: queued.finished, WITHIN_S)
    assert queued.state == "cancelled" and not second.started.is_set() and queued.lane_started_at is None
    assert queued.events_since(0) == [] and service.position(queued) is None
    assert status_of(service, queued) == ("cancelled", "cancelled: stopped on request")
    assert status_of(service, running)[0] == "running"
    first.release.set()
    wait_until(lambda: running.finished, WITHIN_S)
    assert running.state == "done"


def test_shutdown_interrupts_what_runs_and_waits_and_refuses_more(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gate = Gate()

    def until_stopped(job):
        gate.started.set()
        job.cancel_requested.wait(30)

    running = submit(service, "alice", until_stopped, "running")
    gate.started.wait(WITHIN_S)
    queued = submit(service, "bob", Gate(), "queued")
    done = submit(service, "carol", lambda job: service.history.set_status(job.id, "ok"), "done", lane="cpu")
    wait_until(lambda: done.finished, WITHIN_S)
    assert sorted(service.shutdown(timeout_s=10)) == sorted([running.id, queued.id])
    assert running.state == queued.state == "interrupted" and done.state == "done"
    assert status_of(service, running) == ("interrupted", INTERRUPTED)
    assert status_of(service, queued) == ("interrupted", INTERRUPTED)
    with pytest.raises(LimitError, match="^the server is stopping; submit again once it is back$"):
        submit(service, "dave", Gate())
    # the next server marks a killed server's leftovers: none here
    assert JobService(service.history, tmp_path / "exports", gpu_host=False).recovered == []


def test_a_new_server_marks_a_killed_servers_leftovers(tmp_path):
    history = History(tmp_path / "h.sqlite")
    left = history.open_entry("run", "mlp", "tiny", {}, user="alice")
    service = JobService(history, tmp_path / "exports", gpu_host=False)
    assert service.recovered == [left]
    assert history.entries(ids=[left])[0]["payload"]["message"] == INTERRUPTED


def test_finished_jobs_are_forgotten_after_the_newest_ones_or_a_while(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs_module, "KEEP_FINISHED", 2)
    service = service_for(tmp_path, jobs_per_user=10)
    done = []
    for i in range(3):
        done.append(submit(service, "alice", lambda job: None, f"#{i}"))
        wait_until(lambda: done[-1].finished, WITHIN_S)
    gate = Gate()
    open_job = submit(service, "alice", gate, "open")  # forgetting happens as jobs are submitted
    assert [j.label for j in service.jobs("alice")] == ["#1", "#2", "open"]  # the oldest finished one went
    with pytest.raises(LookupError):
        service.get(done[0].id, "alice")
    monkeypatch.setattr(jobs_module, "KEEP_FINISHED_S", 0.0)
    wait_until(lambda: done[-1].finished_at is not None, WITHIN_S)
    later = submit(service, "bob", gate, "later")
    assert service.jobs() == [open_job, later]  # an unfinished job is never forgotten
    gate.release.set()


def test_worker_time_counts_against_the_owner_and_not_for_tasks(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gate, task_gate = Gate(), Gate()
    job = submit(service, "alice", gate)
    task = service._submit_task("check", "alice", "a check", task_gate)
    gate.started.wait(WITHIN_S), task_gate.started.wait(WITHIN_S)
    wait_until(lambda: service.used_today("alice") > 0.2, WITHIN_S)
    assert service.used_today("bob") == 0.0
    gate.release.set()
    wait_until(lambda: job.finished, WITHIN_S)
    held = job.used_s
    assert held > 0.2 and service.used_today("alice") == pytest.approx(held, abs=1e-6)  # the task is not counted
    task_gate.release.set()
    wait_until(lambda: task.finished, WITHIN_S)
    assert service.used_today("alice") == pytest.approx(held, abs=1e-6) and task.used_s > 0.2
    assert service.budget_line("alice") == ("your worker time in the last 24 h: 0 of 720 min; "
                                            "each job may use 180 min")


def test_a_job_moved_to_another_lane_frees_its_slot_and_waits_its_turn(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gpu = Gate()
    holder = submit(service, "bob", gpu, "holder", lane="gpu")
    gpu.started.wait(WITHIN_S)
    moved_to, states = threading.Event(), []

    def plan_then_run(job):
        states.append(service._change_lane(job, "gpu", 1))
        moved_to.set()

    mover = submit(service, "alice", plan_then_run, "mover", lane="cpu")
    wait_until(lambda: mover.lane == "gpu" and mover.state == "queued", WITHIN_S)
    assert service.running("cpu") == [] and service.position(mover) == 1 and not moved_to.is_set()
    gpu.release.set()
    assert moved_to.wait(WITHIN_S) and states == [True]
    wait_until(lambda: mover.finished, WITHIN_S)
    assert mover.state == "done" and holder.state == "done"


def test_pump_keeps_the_result_and_stops_on_cancel_or_budget():
    closed = []

    def events(items):
        try:
            yield from items
        finally:
            closed.append(True)

    job = Job(1, "run", "alice", "", "gpu", "")
    pump(job, events([{"event": "started"}, {"event": "result", "result": "the report"}, {"event": "after"}]))
    assert job.result == "the report" and [e["event"] for e in job.events_since(0)] == ["started", "result", "after"]
    assert closed == [True]
    job = Job(2, "run", "alice", "", "gpu", "")
    job.cancel_requested.set()
    pump(job, events([{"event": "a"}, {"event": "b"}]))
    assert [e["event"] for e in job.events_since(0)] == ["a"] and closed == [True, True]
    job = Job(3, "run", "alice", "", "gpu", "")
    job.lane_started_at = None
    job.used_s = 5.0
    with pytest.raises(LimitError, match=r"^job budget: the job's workers used 4 s of wall-clock time together"):
        pump(job, events([{"event": "a"}, {"event": "b"}]), budget_s=4.0)
    assert len(closed) == 3


def test_a_cancelled_task_kills_its_worker():
    class Worker:
        cancelled = 0

        def cancel(self):
            self.cancelled += 1

    job, worker = Job(-1, "check", "alice", "", "task", ""), Worker()
    seen = []
    for ev in until_cancelled(job, worker, iter([1, 2, 3])):
        seen.append(ev)
        if ev == 2:
            job.cancel_requested.set()
    assert seen == [1, 2, 3] and worker.cancelled == 1


def test_job_events_keep_the_latest_step_and_the_curves(tmp_path):
    job = Job(1, "run", "alice", "", "gpu", "")
    job.push({"event": "started"})
    for i in range(3):
        job.push({"event": "worker", "worker_event": {"event": "step", "step": i}})
    job.push({"event": "progress", "run": "migrated", "first_step": 0, "losses": [3.0, 2.5]})
    job.push({"event": "progress", "run": "migrated", "first_step": 1, "losses": [2.4, 2.2]})
    events = job.events_since(0)
    assert [e["seq"] for e in events] == [0, 3, 4, 5]  # the steps replaced each other: the last one kept
    assert events[1]["worker_event"]["step"] == 2 and "losses" not in events[2]
    assert job.curve("migrated") == [3.0, 2.4, 2.2] and job.curve("migrated", 2) == [2.2] and job.curve("other") == []
    assert job.events_since(4) == events[2:] and job.events_since(5) == [events[3]] and job.events_since(6) == []
    job._end("done")
    assert job.finished and job.finished_at is not None and job.curves == {}


def test_each_user_has_a_private_exports_folder(tmp_path):
    alice, bob = user_exports(tmp_path, "alice"), user_exports(tmp_path, "bob")
    assert alice != bob and alice.parent == bob.parent == tmp_path and alice.is_dir()
    assert alice.stat().st_mode & 0o777 == 0o700
    assert user_exports(tmp_path, "alice") == alice


def test_jobs_and_tasks_carry_what_they_were_submitted_with(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gate = Gate()
    job = service._submit("plan", "alice", "mine", "cpu", "plan mlp", "mlp", "tiny", {"config": {}}, gate)
    assert (job.kind, job.user, job.label, job.lane, job.summary) == ("plan", "alice", "mine", "cpu", "plan mlp")
    entry = service.history.entries(ids=[job.id])[0]
    assert (entry["kind"], entry["label"], entry["user"], entry["workload"]) == ("plan", "mine", "alice", "mlp")
    t1 = service._submit_task("check", "alice", "a check", gate)
    t2 = service._submit_task("probe", "bob", "a probe", gate)
    assert (t1.id, t2.id) == (-1, -2)  # tasks count down from -1: never an entry's id
    assert (t1.kind, t1.label, t1.lane, t1.summary) == ("check", "", "task", "a check")
    gate.release.set()
    wait_until(lambda: all(j.finished for j in (job, t1, t2)), WITHIN_S)


def test_a_moved_job_counts_both_lanes_and_a_cancelled_move_says_so(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gpu = Gate()
    submit(service, "bob", gpu, "holder", lane="gpu")
    gpu.started.wait(WITHIN_S)
    seen = []

    def plan_then_run(job):
        time.sleep(0.3)  # in the plan lane
        job.passed_over = 2
        moved = service._change_lane(job, "gpu", 1)
        seen.append((moved, job.state))
        time.sleep(0.3)  # in the run lane

    mover = submit(service, "alice", plan_then_run, "mover", lane="cpu")
    wait_until(lambda: mover.lane == "gpu" and mover.state == "queued", WITHIN_S)
    assert mover.passed_over == 0 and 0.3 <= mover.used_s < 5  # the plan lane's time, counted once it left
    gpu.release.set()
    wait_until(lambda: mover.finished, WITHIN_S)
    assert seen == [(True, "running")] and mover.used_s >= 0.6  # both lanes' time
    # cancelled while waiting in the new lane: the move says so and the job ends cancelled
    gpu2 = Gate()
    submit(service, "bob", gpu2, "holder 2", lane="gpu")
    gpu2.started.wait(WITHIN_S)
    stopped = []
    other = submit(service, "alice", lambda job: stopped.append(service._change_lane(job, "gpu", 1)), "moved",
                   lane="cpu")
    wait_until(lambda: other.lane == "gpu" and other.state == "queued", WITHIN_S)
    service.cancel(other.id, "alice")
    wait_until(lambda: other.finished, WITHIN_S)
    assert stopped == [False] and other.state == "cancelled"
    gpu2.release.set()


def test_the_budget_line_reads_the_users_own_minutes(tmp_path):
    service = service_for(tmp_path)
    service._usage["alice"] = [(time.time(), 3600.0)]
    assert service.budget_line("alice") == ("your worker time in the last 24 h: 60 of 720 min; "
                                            "each job may use 180 min")
    assert service.budget_line("bob").startswith("your worker time in the last 24 h: 0 of 720 min")
    service._usage["alice"].append((time.time() - 25 * 3600, 7200.0))  # older than a day: not counted
    assert service.used_today("alice") == 3600.0


def test_an_entry_the_job_completed_is_kept_unless_the_server_stops(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)

    def complete_then_wait(job):
        service.history.set_status(job.id, "ok")
        job.cancel_requested.wait(30)

    cancelled = submit(service, "alice", complete_then_wait, "cancelled after", lane="cpu")
    wait_until(lambda: status_of(service, cancelled)[0] == "ok", WITHIN_S)
    service.cancel(cancelled.id, "alice")
    wait_until(lambda: cancelled.finished, WITHIN_S)
    assert cancelled.state == "cancelled" and status_of(service, cancelled)[0] == "ok"
    interrupted = submit(service, "alice", complete_then_wait, "interrupted after", lane="cpu")
    wait_until(lambda: status_of(service, interrupted)[0] == "ok", WITHIN_S)
    service.shutdown(timeout_s=10)
    assert status_of(service, interrupted) == ("interrupted", INTERRUPTED)


def test_a_cancel_marks_the_jobs_own_entry_not_the_newest(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    gate = Gate()
    older = submit(service, "alice", gate, "older", lane="gpu")
    gate.started.wait(WITHIN_S)
    newer = submit(service, "alice", lambda job: service.history.set_status(job.id, "ok"), "newer", lane="cpu")
    wait_until(lambda: newer.finished, WITHIN_S)
    service.cancel(older.id, "alice")
    gate.release.set()
    wait_until(lambda: older.finished, WITHIN_S)
    assert status_of(service, older)[0] == "cancelled" and status_of(service, newer)[0] == "ok"


def test_a_history_that_cannot_record_the_end_leaves_a_warning(tmp_path, monkeypatch):
    service = service_for(tmp_path)
    gate = Gate()
    job = submit(service, "alice", gate)
    gate.started.wait(WITHIN_S)

    def full(*args, **kwargs):
        raise HistoryError("could not record entry: database or disk is full")

    monkeypatch.setattr(service.history, "set_status", full)
    service.cancel(job.id, "alice")
    gate.release.set()
    wait_until(lambda: job.finished, WITHIN_S)
    assert job.state == "cancelled" and job.warnings == ["could not record entry: database or disk is full"]


def test_shutdown_waits_at_most_its_timeout_and_marks_what_is_still_running(tmp_path):
    service = service_for(tmp_path, jobs_per_user=10)
    started = [threading.Event(), threading.Event()]

    def stuck(i):
        def work(job):
            started[i].set()
            time.sleep(4)  # ignores the stop
        return work

    stuck_jobs = [submit(service, "alice", stuck(0), "gpu", lane="gpu"), submit(service, "bob", stuck(1), "cpu",
                                                                                lane="cpu")]
    assert started[0].wait(WITHIN_S) and started[1].wait(WITHIN_S)
    begin = time.monotonic()
    service.shutdown(timeout_s=0.3)
    took = time.monotonic() - begin
    assert took < 1.5, took  # 0.3 s in all, with a margin; not a second per thread, nor until the work ends
    assert [status_of(service, j) for j in stuck_jobs] == [("interrupted", INTERRUPTED)] * 2


def test_a_token_bucket_allows_exactly_its_burst_and_stays_bounded():
    rate = TokenBuckets(per_s=0.0, burst=2)  # no refill: exactly two
    assert rate.take("alice") == rate.take("alice") == 0.0
    assert rate.take("alice") == float("inf") and rate.take("bob") == 0.0  # a key each
    assert retry_text(float("inf")) == "a while" and retry_text(0.2) == "1 s" and retry_text(2.5) == "3 s"
    many = TokenBuckets(per_s=0.0, burst=20, max_keys=50_000)  # no bucket is full again: all are dropped at once
    for i in range(50_000):
        many.take(f"user{i}")
    assert len(many._levels) == 50_000
    many.take("one more")
    assert len(many._levels) == 0


def test_a_watcher_waits_for_new_events_only_while_the_job_runs():
    job = Job(1, "run", "alice", "", "gpu", "")
    job.push({"event": "started"})

    def timed(cursor, timeout):
        begin = time.monotonic()
        got = job.events_since(cursor, timeout)
        return got, time.monotonic() - begin

    got, took = timed(0, 5.0)  # something new: no wait
    assert [e["event"] for e in got] == ["started"] and took < 1.0
    got, took = timed(1, 0.0)  # nothing new, no timeout: no wait
    assert got == [] and took < 1.0
    threading.Timer(1.5, lambda: job.push({"event": "late"})).start()
    got, took = timed(1, 0.3)  # nothing new: waits its timeout, not for the late event
    assert got == [] and 0.25 <= took < 1.2, took
    threading.Timer(0.2, lambda: job.push({"event": "soon"})).start()
    got, took = timed(1, 5.0)  # woken by the next event
    assert [e["event"] for e in got] in (["late"], ["soon"], ["late", "soon"]) and took < 2.5
    wait_until(lambda: len(job.events_since(0)) == 3, WITHIN_S)
    job._end("done")
    got, took = timed(3, 5.0)  # a finished job has nothing more: no wait
    assert got == [] and took < 1.0


def test_heartbeats_replace_each_other_like_steps():
    job = Job(1, "run", "alice", "", "gpu", "")
    for i in range(3):
        job.push({"event": "worker", "worker_event": {"event": "heartbeat", "t": i}})
    job.push({"event": "worker", "worker_event": {"event": "compiled"}})
    assert [e["worker_event"].get("t") for e in job.events_since(0)] == [2, None]


def test_pump_counts_the_time_since_the_job_took_its_lane():
    job = Job(1, "run", "alice", "", "gpu", "")
    job.lane_started_at, job.used_s = time.monotonic(), 1.0
    pump(job, (e for e in [{"event": "a"}, {"event": "b"}]), budget_s=60.0)  # 1 s used of 60: runs on
    assert len(job.events_since(0)) == 2
    job.used_s = 61.0
    with pytest.raises(LimitError) as stopped:
        pump(job, (e for e in [{"event": "c"}]), budget_s=60.0)
    assert str(stopped.value) == ("job budget: the job's workers used 60 s of wall-clock time together (this "
                                  "server's limit per job, --job-budget-seconds); it was stopped")


def test_the_daily_budget_and_the_history_quota_refuse_at_their_limits(tmp_path):
    service = service_for(tmp_path, user_day_s=3600.0, history_mb_per_user=0.25)
    service._usage["alice"] = [(time.time(), 3600.0)]  # exactly her day
    with pytest.raises(LimitError) as refused:
        submit(service, "alice", Gate())
    assert str(refused.value) == ("daily budget: your jobs used 60 min of worker time in the last 24 hours (limit "
                                  "60 min per user, --user-day-seconds); try again later")
    quota = int(0.25 * 2**20)  # 262,144 bytes of payloads per user
    service.history.open_entry("run", "mlp", "tiny", {"x": "a" * (quota - 10)}, user="bob")  # one byte under
    gate = Gate()
    allowed = submit(service, "bob", gate)  # and now over
    with pytest.raises(LimitError) as refused:
        submit(service, "bob", gate)
    assert str(refused.value) == ("history quota: you have 2 entries, 0.3 MiB (limits 10000 entries, 0.25 MiB per "
                                  "user); ask the operator to prune old entries (python -m migration prune-history)")
    service.history.open_entry("run", "mlp", "tiny", {"x": "a" * (quota - 9)}, user="carol")  # exactly the quota
    assert service.history.usage("carol") == (1, quota)
    with pytest.raises(LimitError, match="^history quota: you have 1 entries"):
        submit(service, "carol", gate)
    gate.release.set()
    wait_until(lambda: allowed.finished, WITHIN_S)


def test_each_job_runs_in_a_named_daemon_thread_and_running_defaults_to_the_gpu_lane(tmp_path):
    service = service_for(tmp_path)
    gate = Gate()
    job = submit(service, "alice", gate)
    gate.started.wait(WITHIN_S)
    thread = service._threads[job.id]
    assert thread.name == f"job-{job.id}" and thread.daemon  # a stuck job never holds the server's exit
    assert service.running() == [job]
    gate.release.set()
    wait_until(lambda: job.finished, WITHIN_S)


def test_two_keys_are_taken_together_or_not_at_all_and_a_token_comes_back():
    rate = TokenBuckets(per_s=0.0, burst=1)
    assert rate.take("address", "name") == 0.0
    assert rate.take("address", "other name") == float("inf")  # the address is empty: nothing taken
    assert rate.level("other name") == 1.0
    rate.give_back("address")
    assert rate.take("address", "other name") == 0.0


def test_a_watcher_without_a_timeout_does_not_wait():
    job = Job(1, "run", "alice", "", "gpu", "")
    begin = time.monotonic()
    assert job.events_since(0) == [] and time.monotonic() - begin < 0.5


class RemoteSlots(LocalExecutor):
    """What the scheduler reads of a cluster executor (cluster.executors): remote, its GPU and plan slots."""

    remote = True
    gpu_slots = 2
    plan_slots = 3


def test_the_lanes_and_their_slots_follow_the_executor(tmp_path, monkeypatch):
    history = History(tmp_path / "h.sqlite")
    here = JobService(history, tmp_path / "exports")
    assert here.gpu_host is (resolve_platform("auto") == "gpu")  # this machine's own platform
    # on a GPU host ("auto" resolves to gpu): the service knows it has one
    monkeypatch.setattr(jobs_module, "resolve_platform", lambda asked: "gpu" if asked == "auto" else "cpu")
    assert JobService(history, tmp_path / "exports").gpu_host is True
    monkeypatch.undo()
    assert JobService(history, tmp_path / "exports", gpu_host=True).gpu_host is True
    assert here.export_dir == tmp_path / "exports"
    assert (here._host_gpu_lane, here._host_cpu_lane) == ("gpu", "cpu")
    assert here._slots == {"gpu": 1, "cpu": 2, "host-gpu": 1, "host-cpu": 2, "task": 2}
    cluster = JobService(history, tmp_path / "exports", gpu_host=False, executor=RemoteSlots(), plan_slots=4)
    assert (cluster._host_gpu_lane, cluster._host_cpu_lane) == ("host-gpu", "host-cpu")
    assert cluster._slots == {"gpu": 2, "cpu": 3, "host-gpu": 1, "host-cpu": 4, "task": 2}
    gates = [Gate() for _ in range(3)]
    first, second = (submit(cluster, "alice", g, f"#{i}", lane="host-gpu") for i, g in enumerate(gates[:2]))
    gates[0].started.wait(WITHIN_S)
    assert cluster.running("host-gpu") == [first] and cluster.position(second) == 1  # this machine's one GPU
    tasks = [cluster._submit_task("check", user, "a check", gates[2]) for user in ("alice", "bob", "carol")]
    wait_until(lambda: len(cluster.running("task")) == 2, WITHIN_S)
    assert cluster.position(tasks[2]) == 1  # two tasks at once by default
    for g in gates:
        g.release.set()
    wait_until(lambda: all(j.finished for j in cluster.jobs()), WITHIN_S)


def test_the_oldest_finished_job_is_forgotten_first_with_its_thread(tmp_path, monkeypatch):
    monkeypatch.setattr(jobs_module, "KEEP_FINISHED", 1)
    service = service_for(tmp_path, jobs_per_user=10)
    first_gate, second_gate = Gate(), Gate()
    first = submit(service, "alice", first_gate, "first", lane="cpu")
    second = submit(service, "alice", second_gate, "second", lane="cpu")
    second_gate.release.set()  # the later job finishes first
    wait_until(lambda: second.finished, WITHIN_S)
    first_gate.release.set()
    wait_until(lambda: first.finished, WITHIN_S)
    third_gate = Gate()
    third = submit(service, "alice", third_gate, "third", lane="cpu")
    assert service.jobs() == [first, third]  # the job that finished longest ago went
    assert second.id not in service._threads and first.id in service._threads
    third_gate.release.set()
    wait_until(lambda: third.finished, WITHIN_S)


def test_a_new_server_counts_the_last_24_hours_of_an_earlier_ones_work(tmp_path):
    history = History(tmp_path / "h.sqlite")
    recent = history.open_entry("run", "mlp", "tiny", {"wall_s": 600.0}, user="alice")
    plan = history.open_entry("plan", "mlp", "tiny", {"search_seconds": 30.0}, user="alice")
    old = history.open_entry("run", "mlp", "tiny", {"wall_s": 1000.0}, user="alice")
    bob = history.open_entry("run", "mlp", "tiny", {"wall_s": 5.0}, user="bob")
    with sqlite3.connect(history.path) as db:  # when they ran: an hour ago, and two days ago
        for entry_id, hours in ((recent, 1), (plan, 2), (old, 48), (bob, 1)):
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - hours * 3600))
            db.execute("UPDATE entries SET created_at = ? WHERE id = ?", (at, entry_id))
    service = JobService(history, tmp_path / "exports", gpu_host=False)
    assert service.used_today("alice") == 630.0 and service.used_today("bob") == 5.0
    assert service.used_today("carol") == 0.0


def test_a_new_job_waits_with_nothing_yet():
    before = time.monotonic()
    job = Job(7, "run", "alice", "mine", "gpu", "a run")
    assert (job.state, job.finished, job.result, job.error, job.finished_at) == ("queued", False, None, None, None)
    assert job.slots == 1 and job.passed_over == 0 and job.used_s == 0.0 and job.recorded
    assert before <= job.submitted_at <= time.monotonic()


def test_only_progress_events_feed_the_curves():
    job = Job(1, "run", "alice", "", "gpu", "")
    job.push({"event": "progress", "run": "migrated", "first_step": 0, "losses": [3.0]})
    job.push({"event": "report", "losses": [9.0]})  # a report that carries losses is kept as it is
    events = job.events_since(0)
    assert events[0] == {"event": "progress", "run": "migrated", "seq": 0}  # its losses went to the curve
    assert events[1] == {"event": "report", "losses": [9.0], "seq": 1} and job.curve("migrated") == [3.0]
