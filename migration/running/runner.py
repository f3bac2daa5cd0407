"""Runs each measured run in a fresh worker process and streams its events back.

Why a process per run: JAX reads its memory and device settings only before it initialises, never
returns its GPU memory pool, and an out-of-memory error or a crash must not take the caller (a
shared server) down. Cancel = kill the worker's process group and reap it. Every wait is bounded
by the config's `timeout_s`, so no run hangs, and a worker that sends nothing (not even its
`alive` heartbeat) for `silence_timeout_s` is stopped as hung.

No worker outlives the process that started it: each worker gets the read end of a "lifeline" pipe
whose only write end this process holds (non-inheritable, so no other child gets a copy). When this
process ends in any way (exit, crash, SIGTERM, SIGKILL) the kernel closes that end, the worker reads
end-of-file and kills its own process group.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from migration.common import PROJECT_ROOT
from migration.config.requests import (PlanRequest, RunConfig, check_attention, check_model, check_precision_platform,
                                       validate, validate_plan_request)
from migration.results import Plan
from migration.results import RunReport
from migration.running.worker import TERMINAL_EVENTS
from migration.running.worker_env import resolve_platform, without_secrets

STDERR_TAIL_CHARS = 4000
Outcome = tuple[str, str | None, str]  # (status, failure kind, message) of a finished worker
CANCELLED: Outcome = ("cancelled", "cancelled", "cancelled: stopped on request")
_LIVE_WORKERS: weakref.WeakSet[WorkerProcess] = weakref.WeakSet()  # started, not reaped yet


def timeout_outcome(timeout_s: float) -> Outcome:
    return ("failed", "timeout", f"timeout: the job took longer than timeout_s={timeout_s:g} s and was stopped")


def silence_outcome(limit_s: float) -> Outcome:
    return ("failed", "timeout", (f"timeout: the worker sent nothing for {limit_s:g} s (silence limit "
                                  f"silence_timeout_s={limit_s:g}); it was stopped as hung"))


def crashed_outcome(why: str) -> Outcome:
    return ("failed", "crashed", f"crashed: {why}; the events received so far are kept. See the stderr tail for details.")


def terminal_outcome(event: dict[str, Any]) -> Outcome | None:
    """The outcome a worker's event settles (a terminal event), else None."""
    if event["event"] not in TERMINAL_EVENTS:
        return None
    return ("failed", event.get("kind", "crashed"), event.get("message", "")) if event["event"] == "failed" \
        else ("ok", None, "")


def final_outcome(outcome: Outcome | None, cancelled: bool, crash_why: Callable[[], str]) -> Outcome:
    """A stopped worker's outcome: cancelled when stopped on request before its result; crashed
    (`crash_why()` says how) when it ended without a terminal event."""
    if cancelled and (outcome is None or outcome[0] != "ok"):
        return CANCELLED
    return outcome if outcome is not None else crashed_outcome(crash_why())


def run_report(cfg: RunConfig, events: list[dict[str, Any]], outcome: Outcome, stderr_tail: str, started_at: str,
               wall_s: float | None) -> RunReport:
    """A run's report from its worker's events and outcome (whichever executor ran it)."""
    status, kind, message = outcome
    if kind == "cancelled":
        message = "cancelled: the run was stopped on request"
    return RunReport.from_events(cfg, events, status=status, failure_kind=kind, message=message,
                                 stderr_tail=stderr_tail, started_at=started_at, wall_s=wall_s)


@atexit.register
def _stop_workers_at_exit() -> None:
    """This process is exiting normally: stop its workers now, while the interpreter still works (an
    unfinished `events()` iterator is only closed during interpreter teardown, too late to rely on).
    Their lifelines would stop them a moment later anyway, when the process is gone."""
    for worker in list(_LIVE_WORKERS):
        worker._kill()
        worker._close_lifeline()


class EventSource:
    """What a run's handle shares, wherever its worker runs (here, or on a Ray node): the events
    received so far, and a cancel that any thread may call (its `_kill` stops the worker)."""

    _events: list[dict[str, Any]]
    _cancelled: threading.Event

    @property
    def events_so_far(self) -> list[dict[str, Any]]:
        return list(self._events)

    def cancel(self) -> None:
        """Stop the worker now (safe from another thread). The events iterator then ends."""
        self._cancelled.set()
        self._kill()

    def _kill(self) -> None:
        raise NotImplementedError


class RunWaiter:
    """`wait()` for a run's handle, local or on a cluster: its events to the end, then its report."""

    report: RunReport | None
    events: Callable[..., Iterator[dict[str, Any]]]

    def wait(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> RunReport:
        for event in self.events():
            if on_event is not None:
                on_event(event)
        assert self.report is not None
        return self.report


class WorkerProcess(EventSource):
    """A started worker. Iterate `events()` to completion; then `outcome` holds
    (status, failure kind, message) and `stderr_tail` the end of its output."""

    def __init__(self, mode: str, payload: dict[str, Any], timeout_s: float,
                 silence_timeout_s: float | None = None, memory_bytes: int | None = None):
        self.timeout_s = timeout_s
        self.silence_timeout_s = float(silence_timeout_s if silence_timeout_s is not None
                                       else payload.get("silence_timeout_s", 120.0))
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        self._events: list[dict[str, Any]] = []
        self._cancelled = threading.Event()
        self._stderr = tempfile.TemporaryFile()
        self.outcome: Outcome | None = None
        self.stderr_tail = ""
        self.wall_s: float | None = None
        read_fd, write_fd = os.pipe()
        # os.pipe() fds are non-inheritable and Popen passes only pass_fds: the lifeline's write end
        # stays in this process alone, so it closes exactly when this process ends (or _reap closes it).
        lifeline_read, self._lifeline = os.pipe()
        self._lifeline_lock = threading.Lock()  # closed from _reap or at exit, never twice
        env = without_secrets(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH", ""), str(PROJECT_ROOT)) if p)
        args = [sys.executable, "-m", "migration.running.worker", "--events-fd", str(write_fd), "--mode", mode,
                "--lifeline-fd", str(lifeline_read), "--silence-timeout-s", repr(self.silence_timeout_s)]
        if memory_bytes:  # untrusted input: the kernel bounds its memory and CPU time
            args += ["--memory-bytes", str(memory_bytes), "--cpu-seconds", str(max(1, int(timeout_s)))]
        try:
            self._proc = subprocess.Popen(
                args,
                stdin=subprocess.PIPE,
                stdout=self._stderr,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd, lifeline_read),
                env=env,
                cwd=str(PROJECT_ROOT),
                start_new_session=True,  # its own process group: cancel kills the whole tree
            )
        except BaseException:
            os.close(read_fd)
            self._close_lifeline()
            raise
        finally:
            os.close(write_fd)
            os.close(lifeline_read)
        self._fd = read_fd
        _LIVE_WORKERS.add(self)
        self._proc.stdin.write(json.dumps(payload).encode())
        self._proc.stdin.close()

    @property
    def pid(self) -> int:
        return self._proc.pid

    def _kill(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        """Yield events as the worker writes them; ends with the worker. With `heartbeat_s`, also
        yield {"event": "heartbeat", "elapsed_s": ...} whenever no event came for that long (lets a
        UI show time passing and react to a cancel during a long compile). The worker's own `alive`
        heartbeats only prove it is not hung: they are neither yielded nor kept.

        Closing this iterator before the worker's last event (the caller stopped reading) kills it."""
        buf = b""
        outcome: Outcome | None = None
        last_bytes = last_yield = time.monotonic()
        try:
            while outcome is None:
                now = time.monotonic()
                remaining = self._deadline - now
                if remaining <= 0:
                    self._kill()
                    outcome = timeout_outcome(self.timeout_s)
                    break
                if heartbeat_s and now - last_yield >= heartbeat_s:
                    last_yield = now
                    yield {"event": "heartbeat", "elapsed_s": now - self._t0}
                    continue
                wait = min(remaining, last_bytes + self.silence_timeout_s - now,
                           last_yield + heartbeat_s - now if heartbeat_s else 0.5)
                ready, _, _ = select.select([self._fd], [], [], max(0.0, wait))
                if not ready:
                    # Judged only right after a select that found nothing to read, so a caller that
                    # was slow to ask for the next event never makes a busy worker look silent.
                    if time.monotonic() - last_bytes >= self.silence_timeout_s:
                        self._kill()
                        outcome = silence_outcome(self.silence_timeout_s)
                        break
                    continue
                chunk = os.read(self._fd, 65536)
                if not chunk:  # the worker closed its end: it exited (or was killed)
                    break
                last_bytes = time.monotonic()
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    if event["event"] == "alive":
                        continue
                    self._events.append(event)
                    yield event
                    last_yield = time.monotonic()
                    outcome = terminal_outcome(event) or outcome
        except BaseException:  # closed early (GeneratorExit) or failed: nobody reads its events any more
            if outcome is None:
                self._kill()
            raise
        finally:
            os.close(self._fd)
            self._reap()
        self.outcome = final_outcome(outcome, self._cancelled.is_set(), self._crash_reason)
        self.stderr_tail = self._read_stderr_tail()
        self.wall_s = time.monotonic() - self._t0

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
            self._proc.wait()
        finally:
            self._close_lifeline()
            _LIVE_WORKERS.discard(self)

    def _close_lifeline(self) -> None:
        with self._lifeline_lock:
            fd, self._lifeline = self._lifeline, -1
        if fd >= 0:
            os.close(fd)

    def _crash_reason(self) -> str:
        code = self._proc.returncode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = f"the worker was killed by {name}"
            if name == "SIGKILL":
                why += " (by a user, or by the system when the host ran out of memory)"
            return why
        return f"the worker exited with code {code} before reporting a result"

    def _read_stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - STDERR_TAIL_CHARS * 4))
        text = self._stderr.read().decode(errors="replace")
        self._stderr.close()
        return text[-STDERR_TAIL_CHARS:]


class RunHandle(RunWaiter, WorkerProcess):
    """A measured run in its worker; after `events()` (or `wait()`), `report` is set."""

    def __init__(self, cfg: RunConfig):
        self.config = cfg
        self.report: RunReport | None = None
        super().__init__("run", cfg.to_dict(), cfg.timeout_s, cfg.silence_timeout_s)

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        yield from super().events(heartbeat_s)
        self.report = run_report(self.config, self._events, self.outcome, self.stderr_tail, self.started_at,
                                 self.wall_s)


class PlanError(RuntimeError):
    def __init__(self, kind: str, message: str, stderr_tail: str = ""):
        self.kind = kind
        self.stderr_tail = stderr_tail
        super().__init__(message)


class PlanWaiter:
    """What a planner's handle shares, wherever its worker runs (here, or on a Ray node): once its
    events have ended, `plan` is set, or `error` on failure; `wait()` returns the plan or raises."""

    plan: Plan | None
    error: PlanError | None
    outcome: Outcome | None
    stderr_tail: str
    _events: list[dict[str, Any]]
    events: Callable[..., Iterator[dict[str, Any]]]

    def _take_plan(self) -> None:
        """Called when the worker's events have ended."""
        status, kind, message = self.outcome
        for event in self._events:
            if event["event"] == "plan":
                self.plan = Plan.from_dict(event["plan"])
        if self.plan is None:
            self.error = PlanError(kind or "crashed", message or "the planner ended without a plan", self.stderr_tail)

    def wait(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> Plan:
        for event in self.events():
            if on_event is not None:
                on_event(event)
        if self.plan is None:
            raise self.error
        return self.plan


class PlanHandle(PlanWaiter, WorkerProcess):
    """A planner worker on this machine; after `events()` (or `wait()`), `plan` is set, or `error`."""

    def __init__(self, req: PlanRequest):
        self.request = req
        self.plan: Plan | None = None
        self.error: PlanError | None = None
        super().__init__("plan", req.to_dict(), req.timeout_s, req.silence_timeout_s)

    def events(self, heartbeat_s: float | None = None) -> Iterator[dict[str, Any]]:
        yield from super().events(heartbeat_s)
        self._take_plan()


def start_run(cfg: RunConfig) -> RunHandle:
    """Validate (raises ConfigError before any process starts), then start the worker. The platform
    "auto" is resolved here (NVML), so a fused-attention model is refused on a machine without a GPU."""
    platform = resolve_platform(cfg.platform)
    check_attention(cfg, check_model(validate(cfg)), platform)
    check_precision_platform(cfg, platform)
    return RunHandle(cfg)


def run(cfg: RunConfig, on_event: Callable[[dict[str, Any]], None] | None = None) -> RunReport:
    return start_run(cfg).wait(on_event)


def probe_environment(cfg: RunConfig | None = None) -> dict[str, Any]:
    """What a worker with this config's environment sees (backend, devices, versions, GPUs)."""
    cfg = validate(cfg or RunConfig(timeout_s=120))
    worker = WorkerProcess("probe-env", cfg.to_dict(), cfg.timeout_s, cfg.silence_timeout_s)
    found = [e for e in worker.events() if e["event"] == "environment"]
    if found:
        return {k: v for k, v in found[0].items() if k not in ("event", "t")}
    status, kind, message = worker.outcome
    raise RuntimeError(f"environment probe failed ({kind}): {message}\n{worker.stderr_tail}")


CHECK_MEMORY_BYTES = 1 << 30  # the code check's address space: a 1 MB file's syntax tree takes about 0.1 GiB
CHECK_TIMEOUT_S = 60.0


def start_code_check(sources: list[tuple[str, str]], timeout_s: float = CHECK_TIMEOUT_S,
                     memory_bytes: int = CHECK_MEMORY_BYTES) -> WorkerProcess:
    """The code check of untrusted source in a worker under memory and time limits; its events end
    with `checked` ({"result": CodeCheck as a dict}) or `failed`."""
    return WorkerProcess("check", {"sources": [list(s) for s in sources]}, timeout_s,
                         silence_timeout_s=timeout_s, memory_bytes=memory_bytes)


def start_plan(req: PlanRequest) -> PlanHandle:
    """Validate (raises ConfigError before any process starts), then start the planner worker."""
    return PlanHandle(validate_plan_request(req))


def plan(req: PlanRequest, on_event: Callable[[dict[str, Any]], None] | None = None) -> Plan:
    return start_plan(req).wait(on_event)


# -- executors: where a run's worker process runs ------------------------------------------------


class ExecutorError(RuntimeError):
    """An executor that cannot be used as configured (unreachable, no GPUs); `str()` says what to fix."""


class LocalExecutor:
    """Runs each worker as a child process of this one (the default: nothing to install or start)."""

    remote = False
    gpu_slots = 1  # runs at once: this machine's GPU lane runs one job at a time

    def start_run(self, cfg: RunConfig) -> RunHandle:
        return RunHandle(cfg)

    def start_plan(self, req: PlanRequest) -> PlanHandle:
        return start_plan(req)

    def describe(self) -> str:
        return "runs execute on this machine, one at a time"

    def close(self) -> None:
        pass
