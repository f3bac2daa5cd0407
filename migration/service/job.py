"""One job of the shared box and its bounds: the `Job` record its watchers read (state, events, loss
curves, result), the per-user limits and the token buckets every rate limit is made of, and how a job's work events
are pumped into it. `migration/service/jobs.py` queues and runs jobs.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from migration.common import private_dir
from migration.config.forms import user_folder
from migration.results import Plan
from migration.running.runner import WorkerProcess
from migration.service.orchestrate import MigrationResult


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-user limits of a shared box (all configurable at start-up)."""

    jobs_per_user: int = 4  # jobs one user may have waiting or running at once
    max_steps: int = 100_000  # steps of one run
    max_run_s: float = 3600.0  # wall-clock limit of each worker of a job
    silence_s: float = 120.0  # a worker silent this long is hung: killed, reported as timeout
    queue_size: int = 64  # jobs waiting or running, all users together
    tasks_per_user: int = 2  # code checks and environment probes one user may have waiting or running
    task_queue: int = 16  # code checks and probes waiting or running, all users together
    job_budget_s: float = 3 * 3600.0  # wall-clock of one job's workers together (a run job starts up to ~10)
    user_day_s: float = 12 * 3600.0  # worker time of one user's jobs in any 24 hours
    history_rows_per_user: int = 10_000  # entries one user may hold in the history
    history_mb_per_user: float = 256.0  # and their size


class TokenBuckets:
    """Token buckets by key: each holds at most `burst` tokens and refills at `per_s` a second. `take` takes
    one token from every key named, or none when any is empty (then it says how long to wait). Bounded:
    past `max_keys` the full buckets are forgotten (a full bucket carries no information)."""

    def __init__(self, per_s: float, burst: int, max_keys: int = 50_000):
        self.per_s, self.burst, self.max_keys = per_s, burst, max_keys
        self._levels: dict[Any, tuple[float, float]] = {}  # key -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, *keys: Any) -> float:
        """0.0: a token taken from each key; else the seconds until every key has one (nothing taken)."""
        now = time.monotonic()
        with self._lock:
            levels = [self._level(key, now) for key in keys]
            short = max((1.0 - level for level in levels), default=0.0)
            if short > 0.0:
                return short / self.per_s if self.per_s > 0 else float("inf")
            for key, level in zip(keys, levels):
                self._levels[key] = (level - 1.0, now)
            if len(self._levels) > self.max_keys:
                self._levels = {k: v for k, v in self._levels.items() if self._level(k, now) < self.burst}
                if len(self._levels) > self.max_keys:  # every bucket in use: forget them all (lenient, bounded)
                    self._levels.clear()
            return 0.0

    def give_back(self, *keys: Any) -> None:
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._levels[key] = (min(float(self.burst), self._level(key, now) + 1.0), now)

    def level(self, key: Any) -> float:
        with self._lock:
            return self._level(key, time.monotonic())

    def _level(self, key: Any, now: float) -> float:
        tokens, at = self._levels.get(key, (float(self.burst), now))
        return min(float(self.burst), tokens + (now - at) * self.per_s)


def retry_text(wait_s: float) -> str:
    """A wait for a person: whole seconds, at least one."""
    return "a while" if wait_s == float("inf") else f"{max(1, math.ceil(wait_s))} s"


class LimitError(ValueError):
    """A submission refused by a limit; `str()` is one line saying which and what to do."""


class NotYourJob(PermissionError):
    pass


class Job:
    """One submitted plan or run: its owner, its state and the events it has produced so far."""

    def __init__(self, entry_id: int, kind: str, user: str, label: str, lane: str, summary: str):
        self.id = entry_id  # its history entry
        self.kind = kind
        self.user = user
        self.label = label
        self.lane = lane
        self.summary = summary
        self.state = "queued"  # running, done, failed, cancelled, interrupted
        self.result: MigrationResult | Plan | None = None
        self.error: str | None = None  # one line when it could not run
        self.warnings: list[str] = []  # e.g. a history that could not be written
        self.submitted_at = time.monotonic()
        self.slots = 1  # of its lane's slots (a run on a Ray cluster: its GPUs)
        self.recorded = True  # a history entry (plans, runs, autotunes); tasks (code checks, probes) have none
        self.passed_over = 0  # times a later job started before it in its lane (backfill), bounded
        self.used_s = 0.0  # wall-clock seconds it has held lanes (its workers' time)
        self.lane_started_at: float | None = None
        self.cancel_requested = threading.Event()
        self._stop_state = "cancelled"
        self._events: list[dict[str, Any]] = []
        self._next_seq = 0
        self.curves: dict[str, list[Any]] = {}  # run name -> loss per step, filled by progress events
        self.finished_at: float | None = None
        self._cond = threading.Condition()

    @property
    def finished(self) -> bool:
        return self.state in ("done", "failed", "cancelled", "interrupted")

    def push(self, event: dict[str, Any]) -> None:
        """Keep `event` for the job's watchers, numbered (`seq`). Memory stays bounded however long the
        job runs: a step or heartbeat event replaces the one before it when that was one too (watchers
        only need the latest), and a progress event's new loss values go to the job's curves, kept once."""
        with self._cond:
            if event.get("event") == "progress" and "losses" in event:
                curve = self.curves.setdefault(event["run"], [])
                del curve[event["first_step"]:]
                curve.extend(event["losses"])
                event = {k: v for k, v in event.items() if k not in ("losses", "first_step")}
            if self._events and is_frequent(event) and is_frequent(self._events[-1]) \
                    and self._events[-1]["event"] == event["event"]:
                self._events.pop()
            self._events.append({**event, "seq": self._next_seq})
            self._next_seq += 1
            self._cond.notify_all()

    def events_since(self, cursor: int, timeout: float = 0.0) -> list[dict[str, Any]]:
        """Events numbered `cursor` or later (a watcher's cursor is the last `seq` it read plus one),
        waiting up to `timeout` for one when there are none."""
        with self._cond:
            if self._next_seq <= cursor and timeout > 0 and not self.finished:
                self._cond.wait(timeout)
            start = len(self._events)
            while start > 0 and self._events[start - 1]["seq"] >= cursor:
                start -= 1
            return self._events[start:]

    def curve(self, run: str, start: int = 0) -> list[Any]:
        """The loss values of `run` from step `start` on (a watcher asks for what it has not drawn yet)."""
        with self._cond:
            return list(self.curves.get(run, [])[start:])

    def _end(self, state: str) -> None:
        with self._cond:
            self.state = state
            if self.finished:
                self.finished_at = time.monotonic()
                self.curves.clear()  # the result holds the final reports: the curves were for watching
            self._cond.notify_all()


def user_exports(export_dir: Path, user: str) -> Path:
    """`user`'s own folder of exports (reports, checklists, snippets, traces), private to the service."""
    return private_dir(Path(export_dir) / user_folder(user))


def until_cancelled(job: Job, worker: WorkerProcess, events: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """A task worker's events until they end; a cancelled job kills the worker (its events then end)."""
    for ev in events:
        if job.cancel_requested.is_set():
            worker.cancel()
        yield ev


def is_frequent(event: dict[str, Any]) -> bool:
    """Events that come several times a second and supersede each other: steps and heartbeats."""
    inner = event.get("worker_event")
    return isinstance(inner, dict) and inner.get("event") in ("step", "heartbeat")


def pump(job: Job, events: Iterator[dict[str, Any]], budget_s: float | None = None) -> None:
    """A job's work events into the job (the "result" event's result kept), until they end, the job
    is stopped, or its workers together used `budget_s` seconds (then the job fails saying so);
    closing the events stops the work (kills its worker; a run is recorded as cancelled)."""
    try:
        for ev in events:
            if ev["event"] == "result":
                job.result = ev["result"]
            job.push(ev)
            if job.cancel_requested.is_set():
                break
            if budget_s is not None and job.used_s + time.monotonic() - (job.lane_started_at or 0.0) > budget_s:
                raise LimitError(f"job budget: the job's workers used {budget_s:g} s of wall-clock time together "
                                 "(this server's limit per job, --job-budget-seconds); it was stopped")
    finally:
        events.close()
