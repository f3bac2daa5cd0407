"""Runs on a Ray cluster (migration/cluster/ray_cluster.py), against a real one-node cluster on loopback that
declares two GPUs (the node has none, so the workers run on JAX's CPU platform): runs land and
report, two go at once and a third waits with its queue position, a killed Ray worker is `crashed`,
Stop cancels, the history keeps every run, and the launched app streams a run's events from it.
Plans for catalog GPUs compile on the cluster's two CPUs, holding no GPU. Bad configuration is
refused at start-up with a message, never a hang."""

import dataclasses
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

try:
    import ray  # noqa: F401
except ImportError as exc:
    message = f"needs Ray ({exc}): pip install -r requirements-ray.txt (requirements-dev.txt includes it)"
    if os.environ.get("CI"):
        pytest.fail(f"CI runs the Ray cluster tests: {message}", pytrace=False)
    pytest.skip(message, allow_module_level=True)

from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.service.history import History  # noqa: E402
from migration.service.job import Limits, LimitError  # noqa: E402
from migration.service.jobs import JobService  # noqa: E402
from migration.service.orchestrate import RunOptions  # noqa: E402
from migration.cluster.executors import make_executor  # noqa: E402
from migration.running.runner import ExecutorError, plan as make_plan  # noqa: E402
from tests.server import ROOT, Server, free_port, job_is_stepping, value, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

RAY = str(Path(sys.executable).with_name("ray"))
# The test clusters run without Ray's token authentication, whatever token ~/.ray holds (a real
# cluster with tokens: RAY_AUTH_MODE=token and the token in the app's environment, as for any driver).
NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
LONG = RunConfig(steps=100_000, warmup_steps=1, timeout_s=600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A Ray head on loopback with 2 CPUs and 2 declared GPUs; its address. Stopped at the end
    (`ray stop --force`), whatever happened. Its temp folder is short: Ray's sockets live there."""
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    saved = {k: os.environ.get(k) for k in NO_AUTH}
    os.environ.update(NO_AUTH)  # this process is the executor's driver, and the app servers inherit it
    env = {**os.environ, "MIGRATION_CACHE_DIR": str(tmp_path_factory.mktemp("ray-node-cache"))}
    port = free_port()
    try:
        subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-gpus=2",
                        "--num-cpus=2", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                        f"--temp-dir={temp}", "--disable-usage-stats"],
                       check=True, env=env, capture_output=True, timeout=180)
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)
        for key, old in saved.items():
            if old is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = old


@pytest.fixture(scope="module")
def executor(cluster):
    ex = make_executor(cluster)
    yield ex
    ex.close()


@pytest.fixture(scope="module")
def local_plan():
    return make_plan(PlanRequest(workload="mlp", preset="tiny", global_batch=32, target="local",
                                 compile_for_tpu=False))


@pytest.fixture
def service(tmp_path, executor):
    s = JobService(History(tmp_path / "h.sqlite"), tmp_path / "exports", Limits(), gpu_host=False, executor=executor)
    yield s
    s.shutdown()


def wait(predicate, within_s=180):
    wait_until(predicate, within_s, poll_s=0.1)


stepping = job_is_stepping


def ray_run_workers(mode="run"):
    """(worker pid, its parent's pid) of the run (or plan) workers whose parent is a Ray actor process."""
    out = subprocess.run(["pgrep", "-f", "-x", rf".*-m migration\.running\.worker .*--mode {mode}.*"], check=False,
                         capture_output=True, text=True).stdout
    found = []
    for pid in map(int, out.split()):
        try:
            ppid = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                            if line.startswith("PPid:")))
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes().decode(errors="replace")
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
        if parent.startswith("ray::"):
            found.append((pid, ppid))
    return found


def gone(pid):
    try:
        state = next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                     if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def test_a_run_lands_on_the_cluster_and_reports_like_a_local_one(service, local_plan):
    job = service.submit_run("alice", local_plan, RunConfig(steps=6, warmup_steps=1), label="on ray")
    wait(lambda: job.finished)
    assert job.state == "done", job.error
    main = job.result.main
    assert main.status == "ok" and len(main.losses) == 6 and main.device_kind == "cpu", (main.message, main.stderr_tail)
    kinds = [e["worker_event"]["event"] for e in job.events_since(0) if e.get("event") == "progress"]
    # The worker's own events, streamed (steps are thinned to a few a second: they may all be skipped here).
    assert {"started", "compiled", "finished"} <= set(kinds), kinds
    entry = service.history.entries(ids=[job.id])[0]
    assert entry["status"] == "ok" and entry["label"] == "on ray" and len(entry["payload"]["losses"]) == 6
    assert ray_run_workers() == []  # its worker and actor are gone once it reported


def test_two_runs_go_at_once_on_two_gpus_a_third_waits_its_turn_and_stop_keeps_history(service, local_plan):
    assert service.executor.gpu_slots == 2
    jobs = [service.submit_run(user, local_plan, LONG, label=f"{user}'s") for user in ("alice", "bob", "carol")]
    first, second, third = jobs
    wait(lambda: stepping(first) and stepping(second))
    assert {j.id for j in service.running("gpu")} == {first.id, second.id}
    assert service.position(third) == 1 and third.state == "queued"
    workers = ray_run_workers()
    assert len(workers) == 2, workers  # each in a Ray actor's process, not a child of this one
    service.cancel(first.id, "alice")  # Stop: its worker and actor are killed, the third starts
    wait(lambda: first.finished)
    assert first.state == "cancelled"
    wait(lambda: sum(gone(w) and gone(a) for w, a in workers) == 1, 15)  # its worker and its actor, not the other
    wait(lambda: stepping(third))
    assert service.position(third) is None
    for job in (second, third):
        service.cancel(job.id, job.user)
    wait(lambda: second.finished and third.finished)
    wait(lambda: ray_run_workers() == [], 30)
    rows = {e["label"]: e for e in service.history.entries()}
    for job in jobs:  # nothing lost: each cancelled, with the curve it had
        assert rows[job.label]["status"] == "cancelled" and rows[job.label]["payload"]["losses"], job.label


def test_a_killed_ray_worker_makes_the_run_crashed_and_the_next_one_runs(service, local_plan):
    job = service.submit_run("alice", local_plan, LONG, label="killed")
    wait(lambda: stepping(job))
    [(worker, actor)] = ray_run_workers()
    os.kill(actor, signal.SIGKILL)  # the Ray worker process (the actor), from outside
    wait(lambda: job.finished, 60)
    main = job.result.main
    assert main.status == "failed" and main.failure_kind == "crashed", main.message
    assert "Ray worker process" in main.message and main.losses  # the partial curve is kept
    wait(lambda: gone(worker), 10)  # its worker followed it (the lifeline)
    entry = service.history.entries(ids=[job.id])[0]
    assert entry["status"] == "failed" and entry["payload"]["failure_kind"] == "crashed"
    after = service.submit_run("alice", local_plan, RunConfig(steps=3, warmup_steps=1))
    wait(lambda: after.finished)
    assert after.state == "done" and after.result.main.status == "ok"


def test_a_run_past_its_timeout_on_the_cluster_is_stopped_as_timeout(executor):
    """The run's time limit holds on the cluster too: its worker and actor are killed at the limit
    (here 10 s, the actor's placement and the worker's JAX import included), and the report says so."""
    t0 = time.monotonic()
    report = executor.start_run(RunConfig(workload="mlp", preset="tiny", steps=100_000, warmup_steps=1,
                                          timeout_s=10, platform="cpu")).wait()
    assert report.status == "failed" and report.failure_kind == "timeout" and "timeout_s=10" in report.message
    assert time.monotonic() - t0 < 60
    wait(lambda: ray_run_workers() == [], 30)


def test_plans_for_catalog_gpus_compile_on_the_clusters_cpus_holding_no_gpu(service, executor):
    """The cpu lane spans the cluster's CPUs (2): two plans compile at once, each in a worker under a
    Ray actor that holds one CPU and no GPU, and a third waits its turn; Stop kills a compiling plan's
    worker and actor; a plan made on the cluster is the plan made here; a plan for "local" (this
    machine) stays on this machine's own lane."""
    import ray

    assert executor.plan_slots == 2 and "plans for catalog GPUs compile on its CPUs (2 at once)" in executor.describe()
    quick = PlanRequest(workload="mlp", preset="tiny", global_batch=32, target="a100-40gb", compile_for_tpu=False)
    first = service.submit_plan("alice", PlanRequest(workload="transformer", preset="small", global_batch=64,
                                                     target="h100-sxm"), label="long")
    second = service.submit_plan("bob", quick, label="quick")
    third = service.submit_plan("carol", dataclasses.replace(quick, target="l4"), label="waits")
    here = service.submit_plan("dave", dataclasses.replace(quick, target="local"), label="here")
    assert (first.lane, third.lane, here.lane) == ("cpu", "cpu", "host-cpu")
    wait(lambda: len(ray_run_workers("plan")) == 2, 120)
    queued, running = service.position(third), {j.id for j in service.running("cpu")}
    if not second.finished:  # the quick plan can end before this look (its compiles take a few seconds)
        assert queued == 1 and running == {first.id, second.id}, (queued, running)
    free = ray.available_resources()
    assert free.get("GPU") == 2 and free.get("CPU", 0) == 0, free  # the plans hold the CPUs, no GPU
    service.cancel(first.id, "alice")  # Stop while it compiles: its worker and actor are killed
    wait(lambda: first.finished, 20)
    assert first.state == "cancelled"
    wait(lambda: second.finished and third.finished and here.finished, 300)
    wait(lambda: ray_run_workers("plan") == [], 30)
    for job in (second, third, here):
        assert job.state == "done" and job.result.status == "ok", (job.label, job.error)
    assert third.result.target == "l4" and here.result.target == "local"
    made_here = make_plan(quick)
    for field in ("per_device_batch", "accumulation_steps", "precision", "remat", "predicted_peak_bytes",
                  "max_batch_by_remat"):
        assert getattr(second.result, field) == getattr(made_here, field), field
    rows = {e["label"]: e["status"] for e in service.history.entries()}
    assert rows == {"long": "cancelled", "quick": "ok", "waits": "ok", "here": "ok"}, rows


def test_runs_the_cluster_cannot_hold_are_refused_before_anything_is_queued(service, local_plan, tmp_path):
    req = PlanRequest(workload="mlp", preset="tiny", global_batch=32, target="h100-sxm", gpus=4)
    with pytest.raises(LimitError, match="needs 4 GPUs and the Ray cluster has 2"):
        service.submit_run("alice", req, RunConfig(steps=3))
    with pytest.raises(LimitError, match="scaling runs"):  # they would ask for up to 8 GPUs
        service.submit_run("alice", local_plan, RunConfig(steps=3), RunOptions(scaling=True))
    with pytest.raises(LimitError, match="checkpoint folders are on this server's disk"):
        service.submit_run("alice", local_plan, RunConfig(steps=3, save_checkpoint=str(tmp_path / "ckpt")))
    assert service.history.entries() == []


def test_an_unreachable_cluster_is_a_clear_error_at_once():
    t0 = time.monotonic()
    with pytest.raises(ExecutorError, match=r"cannot be reached .*ray status"):
        make_executor(f"127.0.0.1:{free_port()}")
    with pytest.raises(ExecutorError, match="is not an address"):
        make_executor("no-port-here")
    assert time.monotonic() - t0 < 15


@pytest.mark.parametrize("cpus, gpus, refusal", [(1, 0, "has no GPUs: runs ask for GPUs"),
                                                  (0, 1, "declares no CPUs: plans for catalog GPUs ask for 1 CPU")],
                         ids=["no GPUs", "no CPUs"])
def test_a_cluster_without_gpus_or_cpus_is_refused_saying_so(cpus, gpus, refusal):
    # A real one-node cluster without that resource, started by a separate driver (this process keeps its own).
    script = ("import ray\n"
              f"ray.init(address='local', num_cpus={cpus}, num_gpus={gpus}, include_dashboard=False, "
              "log_to_driver=False)\n"
              "from migration.cluster.executors import make_executor\nfrom migration.running.runner import ExecutorError\n"
              "try:\n    make_executor('auto')\nexcept ExecutorError as exc:\n    print('refused:', exc)\n")
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, **NO_AUTH})
    assert f"refused: the Ray cluster at auto {refusal}" in done.stdout, done.stdout + done.stderr


def test_the_app_refuses_an_unreachable_cluster_at_start_up(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIGRATION_")}
    env.update(MIGRATION_RAY_ADDRESS=f"ray://127.0.0.1:{free_port()}", MIGRATION_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "app.py", "--port", str(free_port()), "--history-db",
                           str(tmp_path / "h.sqlite")], check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode != 0
    assert "cannot be reached" in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_app_streams_a_runs_events_from_the_cluster_and_queues_over_two_slots(tmp_path, cluster):
    form = ["mlp", "tiny", "tpu-v5e-8", 32, 0, "fp32", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
            0, 0, "preset", "auto", 8]
    app = Server(tmp_path, env={"MIGRATION_RAY_ADDRESS": cluster})
    try:
        assert "Ray cluster" in app.first_line()
        clients = [app.client, app.connect(), app.connect()]
        jobs = [c.submit(None, 100_000, 0.003, False, False, False, False, False, *form, f"app {i}", api_name="/run")
                for i, c in enumerate(clients)]

        def lines(job):
            return [str(value(o[0])) for o in job.outputs()]

        def stepping_in_app(job):
            return any("migrated: step" in line for line in lines(job))

        wait(lambda: sum(map(stepping_in_app, jobs)) == 2, 300)
        waiting = [j for j in jobs if not stepping_in_app(j)]
        assert len(waiting) == 1 and any("queued: position 1" in line for line in lines(waiting[0]))
        assert len(ray_run_workers()) == 2 and app.workers() == []  # on the cluster, none on the app's host
        for client in clients:
            client.submit(api_name="/stop").result(timeout=30)
        wait(lambda: ray_run_workers() == [], 60)
        def cancelled():
            return app.client.predict("mine", "run", "all", "cancelled", api_name="/history")["data"]

        # the two that ran (the queued one may have been stopped before it started); each is recorded as its job
        # ends, which can come a moment after its worker is gone on a loaded machine
        wait(lambda: len(cancelled()) >= 2, 60)
    finally:
        app.close()
