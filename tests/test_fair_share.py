"""Fair sharing of the box: round-robin between users in a lane, backfill with a bound, budgets
per job and per user and day, history quotas, the token buckets the rate limits are made of."""

from __future__ import annotations

import threading
import time

import pytest

from migration.service.history import History
from migration.service.job import Limits, LimitError, TokenBuckets
from migration.service.jobs import BACKFILL_MAX, JobService
from migration.running.runner import LocalExecutor
from tests.server import wait_until


def test_code_checks_of_two_users_alternate_in_their_lane(tmp_path):
    """Real code-check workers, one lane slot: alice's two checks do not both go before bob's one."""
    service = JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", gpu_host=False, task_slots=1)
    source = [("train.py", "import jax\nx = jax.device_put_replicated(1, jax.devices())\n" * 2000)]
    a1 = service.submit_code_check("alice", source)
    a2 = service.submit_code_check("alice", source)
    b1 = service.submit_code_check("bob", source)
    assert service.position(b1) in (1, 2) and service.position(a2) in (2, 3)
    wait_until(lambda: a1.finished and a2.finished and b1.finished, 120)
    assert all(j.state == "done" and j.result.findings for j in (a1, a2, b1)), [j.error for j in (a1, a2, b1)]
    assert a1.lane_started_at < b1.lane_started_at < a2.lane_started_at


class SlotsOnly(LocalExecutor):
    """This machine's executor declaring a cluster's GPU slots: what the scheduler reads of a Ray executor."""

    remote = True
    gpu_slots = 2
    plan_slots = 2


def _hold(release: threading.Event):
    def work(job):
        release.wait(30)
    return work


def test_a_big_run_is_passed_over_a_bounded_number_of_times(tmp_path):
    service = JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", Limits(jobs_per_user=20),
                         gpu_host=False, executor=SlotsOnly())
    gates = [threading.Event() for _ in range(12)]
    first = service._submit("run", "carol", "", "gpu", "one GPU", "mlp", "tiny", {}, _hold(gates[0]), slots=1)
    wait_until(lambda: first.state == "running", 10)
    big = service._submit("run", "alice", "", "gpu", "two GPUs", "mlp", "tiny", {}, _hold(gates[1]), slots=2)
    small = [service._submit("run", "bob", "", "gpu", f"one GPU #{i}", "mlp", "tiny", {}, _hold(gates[2 + i]), slots=1)
             for i in range(BACKFILL_MAX + 2)]
    started = []
    for i in range(BACKFILL_MAX):  # each small run fills the free GPU the big one cannot use yet
        wait_until(lambda: small[i].state == "running", 10)
        started.append(small[i])
        gates[2 + i].set()
        wait_until(lambda: small[i].finished, 10)
    assert big.state == "queued" and big.passed_over == BACKFILL_MAX
    time.sleep(1.5)
    assert small[BACKFILL_MAX].state == "queued", "passed over enough: the lane drains for the big run"
    gates[0].set()  # carol's run ends: both GPUs free, the big run starts before the waiting small ones
    wait_until(lambda: big.state == "running", 10)
    assert small[BACKFILL_MAX].state == "queued"
    for g in gates:
        g.set()
    wait_until(lambda: all(j.finished for j in (big, *small)), 20)


def test_a_job_over_its_budget_is_stopped_and_a_user_over_the_day_is_refused(tmp_path):
    service = JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports",
                         Limits(job_budget_s=60, user_day_s=3), gpu_host=False)
    release = threading.Event()
    job = service._submit("run", "alice", "", "gpu", "hold", "mlp", "tiny", {}, _hold(release))
    wait_until(lambda: job.state == "running", 10)
    time.sleep(3.2)
    assert service.used_today("alice") >= 3 and "of 0 min" in service.budget_line("alice")
    with pytest.raises(LimitError, match="daily budget: your jobs used"):
        service._submit("run", "alice", "", "gpu", "more", "mlp", "tiny", {}, _hold(release))
    service._submit("run", "bob", "", "gpu", "bob's", "mlp", "tiny", {}, _hold(release))  # bob has his own day
    release.set()


def test_history_quota_refuses_a_user_past_it_and_prune_frees_room(tmp_path):
    history = History(tmp_path / "h.sqlite")
    service = JobService(history, tmp_path / "exports", Limits(history_rows_per_user=10, jobs_per_user=100),
                         gpu_host=False)
    def finish(job):
        history.set_status(job.id, "ok")

    for i in range(10):
        service._submit("run", "alice", "", "gpu", f"#{i}", "mlp", "tiny", {"x": i}, finish)
    with pytest.raises(LimitError, match="history quota: you have 10 entries"):
        service._submit("run", "alice", "", "gpu", "one more", "mlp", "tiny", {}, finish)
    wait_until(lambda: all(j.finished for j in service.jobs("alice")), 20)
    assert history.prune(0, "alice") == 10
    service._submit("run", "alice", "", "gpu", "after pruning", "mlp", "tiny", {}, finish)


def test_a_token_bucket_refuses_a_flood_and_refills():
    rate = TokenBuckets(per_s=10, burst=5)
    for _ in range(5):
        assert rate.take(("alice", "light")) == 0.0
    assert 0.0 < rate.take(("alice", "light")) <= 0.1  # the wait for the next token
    assert rate.take(("bob", "light")) == 0.0  # per user
    assert rate.take(("alice", "stop")) == 0.0  # and per lane
    time.sleep(0.25)
    assert rate.take(("alice", "light")) == 0.0
