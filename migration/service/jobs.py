"""The shared box's job service: who may queue what, in which order it runs, and a record of every
job that survives a stopped server.

Two lanes: `gpu` (runs, and plans for this machine's GPU, which compile on it) runs one job at a
time; `cpu` (plans compiled for a catalog GPU without the device) runs `plan_slots` at a time.
Each lane is first come, first served. With a Ray cluster as the executor (`cluster.executors.make_executor`),
the `gpu` lane holds as many GPUs as the cluster has and a run job takes as many as its plan's
devices, and the `cpu` lane's plans compile on the cluster's CPUs, as many at once as it has; what
needs this machine then has lanes of its own: `host-gpu` (plans for "local" on a GPU host,
autotune), one job at a time, and `host-cpu` (plans for "local" on a CPU host), `plan_slots`. Serving
jobs run on this machine: a serving plan (compiled for a catalog GPU without it) in its CPU lane, a
measured serving run in its GPU lane, each one worker with a run's limits (time, silence, memory share,
the lowest CPU priority). Every job is recorded in the history when it is submitted
(`queued`), marked `running`, and completed in place; a server that stops (`shutdown`) marks what
it interrupts, and a server that was killed has its leftovers marked by the next one (History
`interrupt_unfinished`). Jobs belong to the user who submitted them: only they can stop them, and
per-user limits bound what one user can queue. A job's events are kept in memory for whoever
watches it (the app streams them); watching is optional, cancelling is explicit.

No gradio here: the app is one client of this service, the load benchmark and the tests others.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from migration.service.autotune import AutotuneSettings, autotuned_plan, check_target_here, start_autotune
from migration.codecheck import CodeCheck
from migration.common import ConfigError, first_line, model_name
from migration.config.forms import number
from migration.config.limits import LIMITS
from migration.config.requests import PlanRequest, RunConfig, check_model, validate, validate_plan_request
from migration.config.serving import ServeRequest, ServeRunRequest, format_mix, serve_request, serve_run_request
from migration.service.history import History, HistoryError
from migration.service.orchestrate import Recorder, RunOptions, run_plan
from migration.results import Plan
from migration.running.runner import LocalExecutor, PlanError, WorkerProcess, start_code_check, start_plan
from migration.running.worker import SERVE_RESULT_EVENTS
from migration.running.worker_env import resolve_platform
from migration.service.job import (Job, LimitError, Limits, NotYourJob, pump, until_cancelled,
                                   user_exports)

INTERRUPTED = "interrupted: the server stopped before this job finished"
KEEP_FINISHED = 100  # finished jobs kept in memory for their watchers
KEEP_FINISHED_S = 600.0  # and for at most this long after they finish
BACKFILL_MAX = 3  # times a waiting job may be passed over by later, smaller jobs that fit before it starts
DAY_S = 24 * 3600.0

class JobService:
    def __init__(self, history: History, export_dir: str | Path, limits: Limits = Limits(), plan_slots: int = 2,
                 gpu_host: bool | None = None, executor: Any = None, task_slots: int = 2):
        self.history = history
        self.executor = executor or LocalExecutor()  # where runs execute (owned by the caller)
        self.export_dir = Path(export_dir)
        self.limits = limits
        self.gpu_host = resolve_platform("auto") == "gpu" if gpu_host is None else gpu_host
        self.recovered = history.interrupt_unfinished(INTERRUPTED)  # a killed server's leftovers
        remote = self.executor.remote
        self._slots = {"gpu": self.executor.gpu_slots, "cpu": self.executor.plan_slots if remote else plan_slots,
                       "host-gpu": 1, "host-cpu": plan_slots, "task": task_slots}
        self._host_gpu_lane = "host-gpu" if remote else "gpu"  # this machine's own GPU
        self._host_cpu_lane = "host-cpu" if remote else "cpu"  # this machine's CPUs
        self._pending: dict[str, list[Job]] = {lane: [] for lane in self._slots}
        self._running: dict[str, list[Job]] = {lane: [] for lane in self._slots}
        self._jobs: dict[int, Job] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._lock = threading.Condition()
        self._closed = False
        self._task_ids = 0  # tasks have no history entry: their ids count down from -1
        self._turns = itertools.count()
        self._served_at: dict[tuple[str, str], int] = {}  # (lane, user) -> when the user's last job started
        self._usage: dict[str, list[tuple[float, float]]] = {}  # user -> (when, seconds) of finished lane spans
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - DAY_S))
        for user, seconds in history.worker_seconds_since(since).items():  # an earlier server's jobs, today
            self._usage[user] = [(time.time(), seconds)]

    # -- submitting ----------------------------------------------------------------------------

    def submit_plan(self, user: str, req: PlanRequest, label: str = "") -> Job:
        req = validate_plan_request(dataclasses.replace(
            req, timeout_s=min(req.timeout_s, self.limits.max_run_s), silence_timeout_s=self.limits.silence_s))
        lane = self._plan_lane(req)
        summary = f"plan {model_name(req.workload, req.preset, req.model)} {req.source} → {req.gpus} × {req.target}"
        payload = {"config": {"global_batch": req.global_batch, "devices": req.gpus, "target": req.target},
                   "request": req.to_dict(), "message": "queued"}
        return self._submit("plan", user, label, lane, summary, req.workload, req.preset, payload,
                            lambda job: self._plan_job(job, req))

    def submit_run(self, user: str, source: Plan | PlanRequest, base: RunConfig, options: RunOptions = RunOptions(),
                   code: CodeCheck | None = None, label: str = "") -> Job:
        """Queue a plan's runs (`source` a Plan), or a plan then its runs (`source` a PlanRequest:
        the plan made on the way is recorded too)."""
        if base.steps > self.limits.max_steps:
            raise ConfigError("steps", f"must be a whole number from 1 to {self.limits.max_steps} (this server's "
                                       f"per-user limit); got {base.steps}")
        base = validate(dataclasses.replace(base, timeout_s=min(base.timeout_s, self.limits.max_run_s),
                                            silence_timeout_s=self.limits.silence_s))
        if isinstance(source, Plan):
            if not source.ok:
                raise PlanError("invalid", f"the plan is {source.status}: {source.message}")
            check_model(source)  # a registered workload and valid dimensions, whoever wrote the file
            workload, preset, target = source.workload, source.preset, source.target_name
            config = {"per_device_batch": source.per_device_batch, "devices": source.gpus,
                      "accumulation_steps": source.accumulation_steps, "global_batch": source.global_batch,
                      "precision": source.precision, "remat": source.remat}
        else:
            source = validate_plan_request(dataclasses.replace(
                source, timeout_s=min(source.timeout_s, self.limits.max_run_s),
                silence_timeout_s=self.limits.silence_s))
            workload, preset, target = source.workload, source.preset, source.target
            config = {"global_batch": source.global_batch, "devices": source.gpus}
        slots = self._run_slots(source.gpus)
        if self.executor.remote and options.scaling:
            raise LimitError("the scaling runs measure this machine's device counts; on the Ray cluster, run them "
                             "without the scaling option (the pmap before/after comparison works)")
        if self.executor.remote and (base.save_checkpoint or base.restore_checkpoint):
            raise LimitError("checkpoint folders are on this server's disk and a run on the Ray cluster runs on one of "
                             "its nodes: run without saving or restoring a checkpoint there (the CLI on a filesystem "
                             "every node shares can do both)")
        payload = {"config": {**config, "steps": base.steps}, "message": "queued", "target": target}
        summary = f"run {workload}/{preset} ({target}), {base.steps} steps"
        # A run still to be planned plans first in the plan lane (never holding the GPU while it compiles
        # for a catalog GPU), then moves to the GPU lane.
        lane = self._plan_lane(source) if isinstance(source, PlanRequest) else "gpu"
        return self._submit("run", user, label, lane, summary, workload, preset, payload,
                            lambda job: self._run_job(job, source, base, options, code),
                            slots=slots if lane == "gpu" else 1)

    def submit_serve_plan(self, user: str, req: ServeRequest, label: str = "") -> Job:
        """Queue a serving plan (`planning.serving.serve_plan`): a worker compiles the prefill and decode
        programs for the catalog GPU without it, in this machine's CPU lane. The request is checked again
        here (ConfigError naming the field), and again by the worker."""
        arguments = serve_plan_arguments(req)
        req = serve_request(**arguments)
        payload = {"config": {"precision": req.precision, "devices": req.gpus}, "target": req.target,
                   "request": arguments, "message": "queued"}
        summary = (f"serving plan {model_name(req.workload, req.preset, req.model)} on {req.gpus} x {req.target}, prompt "
                   f"{req.prompt_len} + generation {req.gen_len}")
        return self._submit("serve-plan", user, label, self._host_cpu_lane, summary, req.workload, req.preset,
                            payload, lambda job: self._serve_job(job, "serve-plan", {"request": arguments}))

    def submit_serve_run(self, user: str, req: ServeRunRequest, label: str = "",
                         memory_fraction: float = RunConfig.memory_fraction) -> Job:
        """Queue a measured serving run (`running.serving.serve_run`) in this machine's GPU lane, one job
        at a time like a training run, its worker holding at most `memory_fraction` of the device."""
        arguments = serve_run_arguments(req)
        req = serve_run_request(**arguments)
        fraction = number(memory_fraction, "memory_fraction", *LIMITS["memory_fraction"])
        payload = {"config": {"precision": req.precision, "devices": 1}, "request": arguments, "message": "queued"}
        summary = (f"serving run {req.workload}/{req.preset}, {req.requests} requests, batches "
                   f"{','.join(map(str, req.batches))}")
        return self._submit("serve-run", user, label, self._host_gpu_lane, summary, req.workload, req.preset, payload,
                            lambda job: self._serve_job(job, "serve-run",
                                                        {"request": arguments, "memory_fraction": fraction}))

    def _plan_lane(self, req: PlanRequest) -> str:
        """Where a plan compiles: deviceless for a catalog GPU (the CPU lane, here or on a cluster's
        CPUs); for "local", on this machine's own device."""
        if req.target != "local":
            return "cpu"
        return self._host_gpu_lane if self.gpu_host else self._host_cpu_lane

    def _run_slots(self, devices: int) -> int:
        """The gpu lane's slots a run of `devices` devices takes: one on this machine (its lane runs one
        job at a time), its GPUs on a cluster; refused when the cluster has fewer GPUs in all."""
        if not self.executor.remote:
            return 1
        if devices > self.executor.gpu_slots:
            raise LimitError(f"the run needs {devices} GPUs and the Ray cluster has {self.executor.gpu_slots} in all; "
                             f"plan for at most {self.executor.gpu_slots} GPUs")
        return devices

    def submit_autotune(self, user: str, plan: Plan, settings: AutotuneSettings, base: RunConfig,
                        label: str = "") -> Job:
        """Queue an autotune of `plan` on the GPU lane: its top ranked choices run one after the other,
        each recorded as a run; the job's entry ends as the plan with the measured pick. Refused at
        once (AutotuneRefused, ConfigError) when this machine is not the plan's target."""
        if not plan.ok:
            raise PlanError("invalid", f"the plan is {plan.status}: {plan.message}")
        check_model(plan)
        settings = dataclasses.replace(settings.validated(), timeout_s=min(settings.timeout_s, self.limits.max_run_s))
        if settings.warmup_steps + settings.timed_steps > self.limits.max_steps:
            raise ConfigError("timed_steps", f"warm-up plus timed steps must be at most {self.limits.max_steps} (this "
                                             f"server's per-user limit); got {settings.warmup_steps + settings.timed_steps}")
        check_target_here(plan)
        base = validate(dataclasses.replace(base, silence_timeout_s=self.limits.silence_s))
        payload = {"config": {"global_batch": plan.global_batch, "devices": plan.gpus, "top": settings.top},
                   "message": "queued", "target": plan.target_name}
        summary = f"autotune {model_name(plan.workload, plan.preset, plan.model)} ({plan.target_name}), top {settings.top}"
        return self._submit("plan", user, label, self._host_gpu_lane, summary, plan.workload, plan.preset, payload,
                            lambda job: self._autotune_job(job, plan, settings, base))

    def submit_code_check(self, user: str, sources: list[tuple[str, str]]) -> Job:
        """Queue the code check of untrusted source: a worker with memory and time limits (never this
        process); the job's result is the CodeCheck. A task: bounded per user, never recorded."""
        names = ", ".join(name for name, _ in sources[:3]) + (" …" if len(sources) > 3 else "")
        return self._submit_task("check", user, f"code check of {names}", lambda job: self._check_job(job, sources))

    def submit_probe(self, user: str) -> Job:
        """Queue an environment probe (a worker that starts JAX and reports what it sees)."""
        return self._submit_task("probe", user, "environment probe", self._probe_job)

    def _submit_task(self, kind: str, user: str, summary: str, work: Callable[[Job], None]) -> Job:
        with self._lock:
            self._refuse_past_limits(user, tasks=True)
            self._task_ids -= 1
            job = Job(self._task_ids, kind, user, "", "task", summary)
            job.recorded = False
            return self._enqueue(job, work)

    def _refuse_past_limits(self, user: str, tasks: bool) -> None:
        """LimitError when the service is stopping, or `user` (or everyone) has as many jobs, or tasks,
        waiting or running as allowed; under the lock."""
        if self._closed:
            raise LimitError("the server is stopping; submit again once it is back")
        active = [j for j in self._jobs.values() if not j.finished and j.recorded != tasks]
        per_user, in_all = ((self.limits.tasks_per_user, self.limits.task_queue) if tasks else
                            (self.limits.jobs_per_user, self.limits.queue_size))
        what = "code check(s) or probe(s)" if tasks else "job(s)"
        mine = sum(j.user == user for j in active)
        if mine >= per_user:
            raise LimitError(f"{user or 'you'} already ha{'s' if user else 've'} {mine} {what} waiting or running "
                             f"(limit {per_user} per user); wait for one to finish or stop one")
        if len(active) >= in_all:
            raise LimitError(f"the queue is full ({len(active)} {what} waiting or running, limit {in_all}); try "
                             "again later")

    @staticmethod
    def _task_worker(job: Job, worker: WorkerProcess, result_event: str, result: Callable[[dict[str, Any]], Any],
                     what: str) -> None:
        """A task's worker to its end (killed if the task is cancelled); its result event made into the
        job's result; a one-line error naming `what` when it ended without one."""
        for ev in until_cancelled(job, worker, worker.events(heartbeat_s=0.5)):
            if ev["event"] == result_event:
                job.result = result(ev)
        if job.result is None and not job.cancel_requested.is_set():
            _status, kind, message = worker.outcome or ("failed", "crashed", "")
            raise LimitError(message if kind == "invalid" else f"{what} stopped ({kind}): {message or 'no result'}")

    def _check_job(self, job: Job, sources: list[tuple[str, str]]) -> None:
        self._task_worker(job, start_code_check(sources), "checked", lambda ev: CodeCheck.from_dict(ev["result"]),
                          "the code check")

    def _probe_job(self, job: Job) -> None:
        cfg = validate(RunConfig(timeout_s=min(120.0, self.limits.max_run_s), silence_timeout_s=self.limits.silence_s))
        worker = WorkerProcess("probe-env", cfg.to_dict(), cfg.timeout_s, cfg.silence_timeout_s)
        self._task_worker(job, worker, "environment", lambda ev: {k: v for k, v in ev.items() if k not in ("event", "t")},
                          "the environment probe")

    def _submit(self, kind: str, user: str, label: str, lane: str, summary: str, workload: str, preset: str,
                payload: dict[str, Any], work: Callable[[Job], None], slots: int = 1) -> Job:
        with self._lock:
            self._refuse_past_limits(user, tasks=False)
            self._check_quotas(user)
            # Recorded before it is queued: a job the history cannot hold is refused, never run unrecorded.
            entry_id = self.history.open_entry(kind, workload, preset, payload, label=label, user=user)
            job = Job(entry_id, kind, user, label, lane, summary)
            job.slots = slots
            return self._enqueue(job, work)

    def _check_quotas(self, user: str) -> None:
        """The user's share of the box: worker time in the last 24 hours, and rows and bytes of history."""
        used = self.used_today(user)
        if used >= self.limits.user_day_s:
            raise LimitError(f"daily budget: your jobs used {used / 60:.0f} min of worker time in the last 24 hours "
                             f"(limit {self.limits.user_day_s / 60:.0f} min per user, --user-day-seconds); try again "
                             "later")
        rows, nbytes = self.history.usage(user)
        if rows >= self.limits.history_rows_per_user or nbytes >= self.limits.history_mb_per_user * 2**20:
            raise LimitError(f"history quota: you have {rows} entries, {nbytes / 2**20:.1f} MiB (limits "
                             f"{self.limits.history_rows_per_user} entries, {self.limits.history_mb_per_user:g} MiB "
                             "per user); ask the operator to prune old entries (python -m migration prune-history)")

    def _enqueue(self, job: Job, work: Callable[[Job], None]) -> Job:
        """Queue `job` in its lane and start its thread (which waits for its turn); under the lock."""
        self._jobs[job.id] = job
        self._pending[job.lane].append(job)
        thread = threading.Thread(target=self._execute, args=(job, work), name=f"job-{job.id}", daemon=True)
        self._threads[job.id] = thread
        self._forget_old()
        thread.start()
        return job

    # -- running -------------------------------------------------------------------------------

    def _execute(self, job: Job, work: Callable[[Job], None]) -> None:
        if not self._wait_turn(job):
            self._finish_unstarted(job)
            return
        job._end("running")
        job.push({"event": "started"})
        try:
            if job.recorded:
                self.history.set_status(job.id, "running")
            work(job)
        except (ConfigError, PlanError, LimitError) as exc:
            job.error = str(exc)
        except HistoryError as exc:
            job.error = str(exc)
        except Exception as exc:  # noqa: BLE001 - the service's boundary: a job never takes the server down
            traceback.print_exc(file=sys.stderr)
            job.error = f"internal error: {type(exc).__name__}: {first_line(exc)}"
        finally:
            state = ("interrupted" if job._stop_state == "interrupted" else "cancelled") \
                if job.cancel_requested.is_set() else ("failed" if job.error else "done")
            if state != "done" or job.error:
                self._record_end(job, state)
            with self._lock:
                self._leave_lane(job)
                self._lock.notify_all()
            job._end(state)

    def _may_start(self, job: Job) -> bool:
        """Whether `job` may take its lane's slots now: they are free, and every job ahead of it in the
        lane's order cannot start now (needs more slots than are free) and has been passed over fewer
        than `BACKFILL_MAX` times. So a small run fills GPUs a big one is waiting for, but a big run
        is passed over a bounded number of times before the lane drains for it."""
        order = self._queue_order(job.lane)
        free = self._slots[job.lane] - sum(j.slots for j in self._running[job.lane])
        if job.slots > free:
            return False
        ahead = order[:order.index(job)]
        return all(j.slots > free and j.passed_over < BACKFILL_MAX for j in ahead)

    def _wait_turn(self, job: Job) -> bool:
        """Wait until `job` may run in its lane, then take its slots; False when it was cancelled first."""
        with self._lock:
            while not job.cancel_requested.is_set() and not self._may_start(job):
                self._lock.wait(0.5)
            for earlier in self._queue_order(job.lane)[:self._queue_order(job.lane).index(job)]:
                earlier.passed_over += 1
            self._pending[job.lane].remove(job)
            self._lock.notify_all()
            if job.cancel_requested.is_set():
                return False
            self._running[job.lane].append(job)
            self._served_at[(job.lane, job.user)] = next(self._turns)
            job.lane_started_at = time.monotonic()
            return True

    def _leave_lane(self, job: Job) -> None:
        """Give back the job's slots, counting its time there against its own and its user's budget; under the lock."""
        if job in self._running[job.lane]:
            self._running[job.lane].remove(job)
            spent = time.monotonic() - (job.lane_started_at or time.monotonic())
            job.used_s += spent
            if job.recorded:  # tasks (code checks, probes) are bounded by their own limits
                self._usage.setdefault(job.user, []).append((time.time(), spent))

    def _change_lane(self, job: Job, lane: str, slots: int) -> bool:
        """Move a running job to another lane (a run planned in the plan lane, then run in the GPU
        lane): its slots here are freed at once, and it waits its turn there. False when cancelled."""
        with self._lock:
            self._leave_lane(job)
            job.lane, job.slots, job.passed_over = lane, slots, 0
            self._pending[lane].append(job)
            self._lock.notify_all()
        job._end("queued")  # its watchers show its place in the new lane's queue
        if not self._wait_turn(job):
            return False
        job._end("running")
        return True

    def used_today(self, user: str) -> float:
        """Seconds of worker time `user`'s jobs used in the last 24 hours (running jobs included)."""
        now_wall, now = time.time(), time.monotonic()
        with self._lock:
            spans = [(t, s) for t, s in self._usage.get(user, []) if now_wall - t < DAY_S]
            self._usage[user] = spans
            running = sum(now - (j.lane_started_at or now) for lane in self._running.values() for j in lane
                          if j.user == user and j.recorded)
        return sum(s for _, s in spans) + running

    def budget_line(self, user: str) -> str:
        """The user's worker time in the last 24 hours against the daily budget, for the page."""
        used = self.used_today(user)
        return (f"your worker time in the last 24 h: {used / 60:.0f} of {self.limits.user_day_s / 60:.0f} min; "
                f"each job may use {self.limits.job_budget_s / 60:.0f} min")

    def _finish_unstarted(self, job: Job) -> None:
        state = job._stop_state
        self._record_end(job, state)
        job._end(state)

    def _queue_order(self, lane: str) -> list[Job]:
        """The lane's waiting jobs in the order they start: round-robin between users (the user served
        longest ago first, a user never served before them all), each user's own jobs in the order
        submitted. One user's ten runs therefore never hold another user's one behind all of them."""
        per_user: dict[str, list[Job]] = {}  # in the order of each user's first waiting job
        for job in self._pending[lane]:
            per_user.setdefault(job.user, []).append(job)
        # a stable sort: users served alike (never, -1) keep the order in which they first asked
        order, users = [], sorted(per_user, key=lambda user: self._served_at.get((lane, user), -1))
        for depth in range(max((len(v) for v in per_user.values()), default=0)):
            order += [per_user[u][depth] for u in users if depth < len(per_user[u])]
        return order

    def _record_end(self, job: Job, state: str) -> None:
        """The entry's final status when the job ended without completing it (or was interrupted)."""
        status = {"cancelled": "cancelled", "interrupted": "interrupted", "failed": "failed"}.get(state)
        if status is None or not job.recorded:
            return
        message = {"cancelled": "cancelled: stopped on request", "interrupted": INTERRUPTED}.get(state, job.error)
        try:
            entry = self.history.entries(ids=[job.id], payload=False)
            if entry and (entry[0]["status"] in ("queued", "running") or state == "interrupted"):
                self.history.set_status(job.id, status, message)
        except HistoryError as exc:
            job.warnings.append(str(exc))

    def _plan_job(self, job: Job, req: PlanRequest) -> None:
        plan = self._plan(job, req)
        if plan is not None:
            self.history.complete(job.id, plan)
            job.result = plan

    def _plan(self, job: Job, req: PlanRequest) -> Plan | None:
        """Plan in a planner worker, streaming its events into the job; None when cancelled. A plan
        for a catalog GPU goes where the executor plans (a Ray cluster's CPUs); one for "local"
        describes this machine and is planned here."""
        handle = start_plan(req) if req.target == "local" else self.executor.start_plan(req)
        try:
            for ev in handle.events(heartbeat_s=0.5):
                job.push({"event": "planning", "worker_event": ev})
                if job.cancel_requested.is_set():
                    handle.cancel()
        finally:
            if handle.plan is None and handle.error is None:
                handle.cancel()
        if job.cancel_requested.is_set():
            return None
        if handle.plan is None:
            raise handle.error
        return handle.plan

    def _serve_job(self, job: Job, mode: str, payload: dict[str, Any]) -> None:
        """A serving worker to its end, its events streamed into the job ("serving", with the worker's
        event); its result kept as the job's and in its history entry; a failure recorded with its kind,
        message and the worker's output (the owner's alone), and made the job's error."""
        timeout_s = min(self.limits.max_run_s, self.limits.job_budget_s)
        worker = WorkerProcess(mode, payload, timeout_s, self.limits.silence_s)
        result = None
        for ev in until_cancelled(job, worker, worker.events(heartbeat_s=0.5)):
            if ev["event"] == SERVE_RESULT_EVENTS[mode]:
                result = ev["result"]
            else:
                job.push({"event": "serving", "worker_event": ev})
        if job.cancel_requested.is_set() and result is None:
            return  # recorded as cancelled (or interrupted) when the job ends
        ended = {"request": payload["request"], "wall_s": worker.wall_s, "started_at": worker.started_at}
        if result is None:
            _status, kind, message = worker.outcome or ("failed", "crashed", "")
            message = message or "the worker ended without a result"
            self.history.complete_serving(job.id, "failed", {**ended, "failure_kind": kind, "message": message,
                                                             "stderr_tail": worker.stderr_tail})
            job.error = message if kind == "invalid" else f"{kind}: {message}"
            return
        infeasible = mode == "serve-plan" and not result.get("largest_batch") and \
            not any(r.get("fits") for r in result.get("rows", []))
        self.history.complete_serving(job.id, "infeasible" if infeasible else "ok", {**ended, **result})
        job.result = result

    def _run_job(self, job: Job, source: Plan | PlanRequest, base: RunConfig, options: RunOptions,
                 code: CodeCheck | None) -> None:
        recorder = Recorder(self.history, user=job.user, label=job.label, entry_id=job.id)
        try:
            if isinstance(source, PlanRequest):
                plan = self._plan(job, source)
                if plan is None:
                    return
                recorder.plan(plan, "planned for this run")
                job.push({"event": "plan", "plan": plan})
                if not plan.ok:
                    raise PlanError("invalid", f"the plan is {plan.status}: {plan.message}")
                # Planned in the plan lane; the runs wait for the GPU lane like any other.
                if job.lane != "gpu" and not self._change_lane(job, "gpu", self._run_slots(plan.gpus)):
                    return
            else:
                plan = source
            pump(job, run_plan(plan, base, options, user_exports(self.export_dir, job.user), code=code,
                                history=recorder, start_run=self.executor.start_run), self.limits.job_budget_s)
        finally:
            job.warnings.extend(recorder.errors)

    def _autotune_job(self, job: Job, plan: Plan, settings: AutotuneSettings, base: RunConfig) -> None:
        recorder = Recorder(self.history, user=job.user, label=job.label)
        try:
            pump(job, start_autotune(plan, settings, base, history=recorder), self.limits.job_budget_s)
        finally:
            job.warnings.extend(recorder.errors)
        if job.result is None or job.cancel_requested.is_set():
            return
        if job.result.pick is None:
            raise PlanError("failed", "autotune: no candidate ran to the end, so there is no measured pick "
                                      "(each candidate's run is in the history with its failure)")
        self.history.complete(job.id, autotuned_plan(plan, job.result))

    # -- controlling ---------------------------------------------------------------------------

    def get(self, job_id: int, user: str) -> Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise LookupError(f"job {job_id}: not a current job of this server")
        if job.user != user:
            raise NotYourJob(f"job {job_id} belongs to another user; you can only see and stop your own jobs")
        return job

    def cancel(self, job_id: int, user: str) -> Job:
        """Stop a job of `user` (queued: removed; running: its worker killed). Others' jobs are refused."""
        job = self.get(job_id, user)
        job.cancel_requested.set()
        with self._lock:
            self._lock.notify_all()
        return job

    def position(self, job: Job) -> int | None:
        """1 for the next job to start in its lane; None once it runs."""
        with self._lock:
            order = self._queue_order(job.lane)
            return order.index(job) + 1 if job in order else None

    def running(self, lane: str = "gpu") -> list[Job]:
        with self._lock:
            return list(self._running[lane])

    def jobs(self, user: str | None = None) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if user is None or j.user == user]

    def shutdown(self, timeout_s: float = 10.0) -> list[int]:
        """Stop taking jobs, stop every queued and running one (their workers killed), and mark
        them interrupted. Returns the interrupted entries."""
        with self._lock:
            self._closed = True
            unfinished = [j for j in self._jobs.values() if not j.finished]
            for job in unfinished:
                job._stop_state = "interrupted"
                job.cancel_requested.set()
            self._lock.notify_all()
            threads = [self._threads[j.id] for j in unfinished if j.id in self._threads]
        deadline = time.monotonic() + timeout_s
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        try:
            self.history.interrupt_unfinished(INTERRUPTED)
        except HistoryError:
            pass
        return [j.id for j in unfinished]

    def _forget_old(self) -> None:
        """Finished jobs stay for their watchers a while (their results, for a page that reconnects),
        at most `KEEP_FINISHED` of them and `KEEP_FINISHED_S` seconds each."""
        now = time.monotonic()
        finished = sorted((j for j in self._jobs.values() if j.finished), key=lambda j: j.finished_at or 0.0)
        for i, job in enumerate(finished):
            if i < len(finished) - KEEP_FINISHED or now - (job.finished_at or now) > KEEP_FINISHED_S:
                self._jobs.pop(job.id, None)
                self._threads.pop(job.id, None)


def serve_plan_arguments(req: ServeRequest) -> dict[str, Any]:
    """A serving plan request as the keyword arguments of `config.serving.serve_request` (what a worker
    checks again)."""
    lengths = ({"mix": format_mix(req.mix)} if req.mix else {"prompt_len": req.prompt_len, "gen_len": req.gen_len})
    return {"workload": req.workload, "preset": req.preset, "target": req.target, **lengths,
            "precision": req.precision, "model": dict(req.model), "batches": list(req.batches), "gpus": req.gpus,
            "memory_fraction": req.memory_fraction, "checkpoint": req.checkpoint, "kv_cache": req.kv_cache,
            "chunk": req.chunk}


def serve_run_arguments(req: ServeRunRequest) -> dict[str, Any]:
    """A serving run request as the keyword arguments of `config.serving.serve_run_request` (a checkpoint's
    model comes back from the checkpoint it names)."""
    return {"workload": req.workload, "preset": req.preset, "precision": req.precision, "requests": req.requests,
            "batches": list(req.batches), "prompt_min": req.prompt_range[0], "prompt_max": req.prompt_range[1],
            "gen_min": req.gen_range[0], "gen_max": req.gen_range[1], "temperature": req.temperature,
            "seed": req.seed, "checkpoint": req.checkpoint, "kv_cache": req.kv_cache, "model": dict(req.model)}
