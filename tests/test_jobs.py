"""The job service without the app: owners, per-user limits, first come first served, cancelling
queued and running jobs, and a shutdown that leaves no worker and marks what it stopped."""


import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig
from migration.service.history import History
from migration.service.job import Limits, LimitError, NotYourJob
from migration.service.jobs import JobService
from migration.running.runner import plan as make_plan
from tests.server import job_is_stepping, wait_until

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_plan():
    return make_plan(PlanRequest(workload="mlp", preset="tiny", global_batch=32, target="local",
                                 compile_for_tpu=False))


def wait(predicate, within_s=120):
    wait_until(predicate, within_s)


started_steps = job_is_stepping


def test_owners_limits_queue_order_cancel_and_shutdown(tmp_path, local_plan):
    history = History(tmp_path / "h.sqlite")
    service = JobService(history, tmp_path / "exports", Limits(jobs_per_user=1, max_steps=100_000), gpu_host=False)
    long = RunConfig(steps=100_000, timeout_s=600)
    alice = service.submit_run("alice", local_plan, long, label="alice's")
    with pytest.raises(LimitError, match="limit 1 per user"):
        service.submit_run("alice", local_plan, RunConfig(steps=3, warmup_steps=1))
    bob = service.submit_run("bob", local_plan, RunConfig(steps=3, warmup_steps=1), label="bob's")
    wait(lambda: started_steps(alice))
    assert service.position(bob) == 1 and service.position(alice) is None  # first come, first served
    with pytest.raises(NotYourJob, match="belongs to another user"):
        service.cancel(alice.id, "bob")
    service.cancel(bob.id, "bob")  # queued: leaves the queue without ever starting a worker
    wait(lambda: bob.finished)
    assert bob.state == "cancelled" and not any(e.get("event") == "started" for e in bob.events_since(0))
    statuses = {e["label"]: e["status"] for e in history.entries(payload=False)}
    assert statuses["bob's"] == "cancelled" and statuses["alice's"] == "running"
    assert service.shutdown() == [alice.id]
    assert alice.state == "interrupted"
    entry = history.entries(ids=[alice.id])[0]
    assert entry["status"] == "interrupted" and entry["payload"]["losses"]  # the partial curve is kept
    with pytest.raises(LimitError, match="stopping"):
        service.submit_run("carol", local_plan, RunConfig(steps=3, warmup_steps=1))


def test_steps_over_the_servers_limit_are_refused_naming_it(tmp_path, local_plan):
    service = JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", Limits(max_steps=50), gpu_host=False)
    with pytest.raises(ConfigError, match=r"steps: must be a whole number from 1 to 50 \(this server's per-user"):
        service.submit_run("alice", local_plan, RunConfig(steps=51))
    assert service.history.entries() == []  # refused before anything was recorded or started
