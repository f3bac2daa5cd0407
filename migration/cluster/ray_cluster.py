"""Runs on a Ray cluster: the executor a team uses when one box is not enough (MIGRATION_RAY_ADDRESS).

Each run becomes a Ray actor that asks for as many GPUs as the run has devices; each plan for a
catalog GPU (which compiles deviceless, on the CPU backend) becomes an actor that asks for one CPU
and no GPU, so plans go to the cluster's CPUs and never hold a GPU. The actor starts the same worker
process a local run or plan uses (`runner.WorkerProcess`: `python -m migration.running.worker`, the same
payload, lifeline, timeouts and kill) on its node, and keeps the events it sends; the driver (the
app, or the CLI) polls them. So the events, the failure kinds, the reports and the plans are the
local executor's, and only the transport differs.

- Where: the project's code packages (and nothing else of its folder) travel to the cluster as the
  Ray job's `working_dir`; each node needs the project's requirements installed in the Python it
  runs Ray with.
- Devices: Ray sets CUDA_VISIBLE_DEVICES to the GPUs it gave the actor, and the worker keeps it
  (the run's own `visible_devices` is dropped). A node without NVIDIA GPUs (a test cluster that
  declares GPUs with `ray start --num-gpus`) runs the worker on JAX's CPU platform, as a local run
  on a CPU-only machine does.
- Stopping: cancel stops the worker's process group on its node, then kills the actor, which
  frees its GPUs. An actor that dies (killed, or its node lost) makes the run `crashed`; its worker
  dies with it (its lifeline was the actor). A run that is not scheduled, or whose actor stops
  answering, is stopped at its `timeout_s` or silence limit like a local one.

`ray` is imported only here, and this module only when a Ray address is configured.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError

from migration.common import PROJECT_ROOT, first_line
from migration.config.requests import PlanRequest, RunConfig, validate_plan_request
from migration.results import Plan, RunReport
from migration.running.runner import (EventSource, ExecutorError, Outcome, PlanError, PlanWaiter, RunWaiter, WorkerProcess,
                              crashed_outcome, final_outcome, run_report, silence_outcome, terminal_outcome,
                              timeout_outcome)
from migration.running.worker_env import resolve_platform

CONNECT_TIMEOUT_S = 5.0  # to reach the cluster's address before Ray itself tries (it retries for minutes)
POLL_WAIT_S = 0.5  # the node holds a poll this long for new events
REPLY_GRACE_S = 5.0  # beyond the silence limit, for a poll reply to cross the network
KILL_WAIT_S = 5.0  # for the node to stop the worker before its actor is killed
PLAN_CPUS = 1  # a plan's actor: one of the cluster's CPUs (compiles are mostly one thread), no GPU
# Not shipped to the cluster, besides what Ray leaves out itself (.git, .venv, what .gitignore names).
CODE_PACKAGES = ("migration", "workloads")  # all a node needs of the project: the worker's code


def code_only_copy() -> str:
    """A temporary folder holding the project's code packages alone: the Ray job's working_dir. Nothing
    else of the project root travels (a users file, the history, runs, exports, a virtual environment)."""
    dest = tempfile.mkdtemp(prefix="migration-code-")
    for package in CODE_PACKAGES:
        shutil.copytree(PROJECT_ROOT / package, os.path.join(dest, package),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=4)
class WorkerOnNode:
    """On a Ray node: one run's (or plan's) worker process and the events it has sent so far."""

    def __init__(self, mode: str, payload: dict[str, Any], timeout_s: float, silence_timeout_s: float):
        if mode == "plan" or resolve_platform(payload.get("platform", "auto")) == "cpu":
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)  # Ray's GPU ids mean nothing on the CPU platform
        self._worker = WorkerProcess(mode, payload, timeout_s, silence_timeout_s)
        self._events: list[dict[str, Any]] = []
        self._ended: dict[str, Any] | None = None
        self._cond = threading.Condition()
        threading.Thread(target=self._read, name="run-events", daemon=True).start()

    def _read(self) -> None:
        worker = self._worker
        try:
            for event in worker.events():
                with self._cond:
                    self._events.append(event)
                    self._cond.notify_all()
        finally:
            outcome = worker.outcome or crashed_outcome("the worker's events could not be read on its node")
            with self._cond:
                self._ended = {"outcome": outcome, "stderr_tail": worker.stderr_tail, "wall_s": worker.wall_s}
                self._cond.notify_all()

    def where(self) -> dict[str, Any]:
        return {"node": ray.util.get_node_ip_address(), "pid": os.getpid(), "worker_pid": self._worker.pid}

    def poll(self, cursor: int, wait_s: float) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """The events after the first `cursor` (waiting up to `wait_s` for one), and the worker's end
        (outcome, stderr tail, wall time) once it has ended and every event was sent."""
        with self._cond:
            if len(self._events) <= cursor and self._ended is None:
                self._cond.wait(wait_s)
            events = self._events[cursor:]
            return events, self._ended

    def cancel(self) -> None:
        self._worker.cancel()


class RayWorkerHandle(EventSource):
    """A worker on the cluster, used as a local `runner.WorkerProcess` is: iterate `events()` to
    completion; then `outcome` and `stderr_tail` are set. `cancel()` is safe from any thread."""

    def __init__(self, mode: str, payload: dict[str, Any], timeout_s: float, silence_timeout_s: float,
                 num_gpus: int, num_cpus: int):
        self.timeout_s = timeout_s
        self.silence_timeout_s = float(silence_timeout_s)
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        self._events: list[dict[str, Any]] = []
        self._cancelled = threading.Event()
        self._placed = threading.Event()  # the actor exists and its worker started
        self.where: dict[str, Any] | None = None  # node, actor pid, worker pid (once placed)
        self.outcome: Outcome | None = None
        self.stderr_tail = ""
        self.wall_s: float | None = None
        self._actor = WorkerOnNode.options(num_gpus=num_gpus, num_cpus=num_cpus).remote(
            mode, payload, timeout_s, self.silence_timeout_s)

    def _kill(self) -> None:
        if self._placed.is_set():  # stop the worker's process group first, then its actor
            try:
                ray.get(self._actor.cancel.remote(), timeout=KILL_WAIT_S)
            except RayError:
                pass
        ray.kill(self._actor, no_restart=True)

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        """As `runner.WorkerProcess.events`: the worker's events as they arrive, with `heartbeat`
        events when none came for `heartbeat_s`; closing it early kills the run."""
        outcome: Outcome | None = None
        ended: dict[str, Any] | None = None
        crash_why = "the Ray actor running it ended without a result"
        placing = self._actor.where.remote()
        pending = None  # the poll in flight
        last_reply = last_yield = time.monotonic()
        try:
            while ended is None and not self._cancelled.is_set():
                now = time.monotonic()
                if now >= self._deadline:
                    self._kill()
                    outcome = timeout_outcome(self.timeout_s)
                    break
                if heartbeat_s and now - last_yield >= heartbeat_s and outcome is None:
                    last_yield = now
                    yield {"event": "heartbeat", "elapsed_s": now - self._t0}
                    continue
                if not self._placed.is_set():
                    pending = placing  # waiting for the cluster to place the actor: only the deadline applies
                elif pending is None:
                    pending = self._actor.poll.remote(len(self._events), POLL_WAIT_S)
                wait = min(self._deadline - now, last_yield + heartbeat_s - now if heartbeat_s else POLL_WAIT_S)
                ready, _ = ray.wait([pending], timeout=max(0.0, wait) + (POLL_WAIT_S if self._placed.is_set() else 0))
                if not ready:
                    if self._silent_since(last_reply):
                        self._kill()
                        outcome = silence_outcome(self.silence_timeout_s)
                        break
                    continue
                reply, pending = pending, None
                try:
                    answer = ray.get(reply, timeout=REPLY_GRACE_S)
                except GetTimeoutError:
                    continue
                except RayError as exc:
                    where = f" on node {self.where['node']}" if self.where else ""
                    crash_why = f"the Ray worker process running it{where} died ({first_line(exc, 200)})"
                    break
                last_reply = time.monotonic()
                if reply is placing:
                    self.where = answer
                    self._placed.set()
                    continue
                new_events, ended = answer
                for event in new_events:
                    self._events.append(event)
                    yield event
                    last_yield = time.monotonic()
                    outcome = terminal_outcome(event) or outcome  # no heartbeats after it; the node's end follows
        except BaseException:  # closed early (GeneratorExit) or failed: nobody reads its events any more
            if ended is None:
                self._kill()
            raise
        finally:
            ray.kill(self._actor, no_restart=True)  # its work is over: give its GPUs back
        self._settle(outcome, ended, crash_why)

    def _silent_since(self, last_reply: float) -> bool:
        """Whether the placed worker's node has not answered for longer than the silence limit allows."""
        return self._placed.is_set() and time.monotonic() - last_reply >= self.silence_timeout_s + REPLY_GRACE_S

    def _settle(self, outcome: Outcome | None, ended: dict[str, Any] | None, crash_why: str) -> None:
        """The handle's outcome once its events ended: the node's word when it had one."""
        if ended is not None:
            outcome, self.stderr_tail = tuple(ended["outcome"]), ended["stderr_tail"]
        self.outcome = final_outcome(outcome, self._cancelled.is_set(), lambda: crash_why)
        self.wall_s = time.monotonic() - self._t0


class RayRunHandle(RunWaiter, RayWorkerHandle):
    """A run on the cluster, used as a `runner.RunHandle` is: after `events()` (or `wait()`),
    `report` is set."""

    def __init__(self, cfg: RunConfig):
        self.config = dataclasses.replace(cfg, visible_devices="")  # the GPUs are Ray's choice
        self.report: RunReport | None = None
        # No CPU reserved: the worker's host work is light, and a run waits for GPUs only.
        super().__init__("run", self.config.to_dict(), cfg.timeout_s, cfg.silence_timeout_s,
                         num_gpus=cfg.devices, num_cpus=0)

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        yield from super().events(heartbeat_s)
        self.report = run_report(self.config, self._events, self.outcome, self.stderr_tail, self.started_at,
                                 self.wall_s)


class RayPlanHandle(PlanWaiter, RayWorkerHandle):
    """A plan for a catalog GPU compiled on one of the cluster's CPUs, used as a `runner.PlanHandle`
    is: after `events()` (or `wait()`), `plan` is set, or `error`."""

    def __init__(self, req: PlanRequest):
        self.request = req
        self.plan: Plan | None = None
        self.error: PlanError | None = None
        super().__init__("plan", req.to_dict(), req.timeout_s, req.silence_timeout_s, num_gpus=0, num_cpus=PLAN_CPUS)

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        yield from super().events(heartbeat_s)
        self._take_plan()


def _check_reachable(address: str) -> None:
    """A host:port address (plain or ray://) must accept a connection within CONNECT_TIMEOUT_S;
    Ray itself would retry for minutes before it gives up."""
    if address == "auto":
        return
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ExecutorError(f"MIGRATION_RAY_ADDRESS={address!r} is not an address: expected host:port (the head's "
                            "GCS, e.g. 10.0.0.5:6379), ray://host:port (Ray Client, e.g. ray://10.0.0.5:10001) or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise ExecutorError(f"the Ray cluster at {address} cannot be reached ({exc.strerror or first_line(exc)}): "
                            "check the address and that the head node runs (ray status on the head)") from None


class RayExecutor:
    """Runs each worker on the Ray cluster; `gpu_slots` is the cluster's GPU count, so as many runs
    of one device go at once as it has GPUs, and `plan_slots` its CPUs over PLAN_CPUS, the plans for
    catalog GPUs at once."""

    remote = True

    def __init__(self, address: str, gpu_slots: int, plan_slots: int):
        self.address = address
        self.gpu_slots = gpu_slots
        self.plan_slots = plan_slots

    @classmethod
    def connect(cls, address: str) -> RayExecutor:
        """Join the cluster (or reuse this process's connection to it). Raises ExecutorError, saying
        what to fix, when it cannot be reached or has no GPUs."""
        address = address.strip()
        _check_reachable(address)
        if not ray.is_initialized():
            try:
                ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
                         runtime_env={"working_dir": code_only_copy()})
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ExecutorError(f"cannot join the Ray cluster at {address}: {first_line(exc)}") from None
        resources = ray.cluster_resources()
        gpus, cpus = int(resources.get("GPU", 0)), int(resources.get("CPU", 0))
        if gpus < 1:
            ray.shutdown()
            raise ExecutorError(f"the Ray cluster at {address} has no GPUs: runs ask for GPUs, so none would ever "
                                "start. Add GPU nodes (or, on a CPU-only test cluster, start the head with "
                                "--num-gpus=N), or unset MIGRATION_RAY_ADDRESS to run on this machine")
        if cpus < PLAN_CPUS:
            ray.shutdown()
            raise ExecutorError(f"the Ray cluster at {address} declares no CPUs: plans for catalog GPUs ask for "
                                f"{PLAN_CPUS} CPU each, so none would ever start. Start its nodes without "
                                "--num-cpus=0, or unset MIGRATION_RAY_ADDRESS to run on this machine")
        return cls(address, gpus, cpus // PLAN_CPUS)

    def start_run(self, cfg: RunConfig) -> RayRunHandle:
        return RayRunHandle(cfg)

    def start_plan(self, req: PlanRequest) -> RayPlanHandle:
        """A plan for a catalog GPU on the cluster's CPUs (a plan for "this machine" stays here:
        `runner.start_plan`). Validates first, as the local one does."""
        req = validate_plan_request(req)
        if req.target == "local":
            raise ValueError('a plan for "local" describes this machine: plan it here (runner.start_plan)')
        return RayPlanHandle(req)

    def describe(self) -> str:
        n = self.gpu_slots
        return (f"runs execute on the Ray cluster at {self.address} ({n} GPUs: {n} one-device runs at once); "
                f"plans for catalog GPUs compile on its CPUs ({self.plan_slots} at once)")

    def close(self) -> None:
        ray.shutdown()
