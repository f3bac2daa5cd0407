"""Runs each measured run in a fresh worker process and streams its events back.

Why a process per run: JAX reads its memory and device settings only before it initialises, never
returns its GPU memory pool, and an out-of-memory error or a crash must not take the caller (a
shared server) down. Cancel = kill the worker's process group and reap it. Every wait is bounded
by the config's `timeout_s`, so no run hangs.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from migration.config import RunConfig, validate
from migration.report import RunReport

PROJECT_ROOT = Path(__file__).resolve().parent.parent
STDERR_TAIL_CHARS = 4000
TERMINAL_EVENTS = ("finished", "failed")


class RunHandle:
    """A started worker. Iterate `events()` to completion, then read `report`."""

    def __init__(self, cfg: RunConfig, *, probe_env: bool = False):
        self.config = cfg
        self.started_at = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self._t0 = time.monotonic()
        self._deadline = self._t0 + cfg.timeout_s
        self._events: list[dict[str, Any]] = []
        self._cancelled = threading.Event()
        self._stderr = tempfile.TemporaryFile()
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROJECT_ROOT), env.get("PYTHONPATH", "")) if p)
        args = [sys.executable, "-m", "migration.worker", "--events-fd", str(write_fd)]
        try:
            self._proc = subprocess.Popen(
                args + (["--probe-env"] if probe_env else []),
                stdin=subprocess.PIPE,
                stdout=self._stderr,
                stderr=subprocess.STDOUT,
                pass_fds=(write_fd,),
                env=env,
                cwd=str(PROJECT_ROOT),
                start_new_session=True,  # its own process group: cancel kills the whole tree
            )
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._proc.stdin.write(json.dumps(cfg.to_dict()).encode())
        self._proc.stdin.close()
        self.report: RunReport | None = None

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def events_so_far(self) -> list[dict[str, Any]]:
        return list(self._events)

    def cancel(self) -> None:
        """Stop the run now (safe from another thread). The events iterator then ends."""
        self._cancelled.set()
        self._kill()

    def _kill(self) -> None:
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def events(self) -> Iterator[dict[str, Any]]:
        """Yield events as the worker writes them; ends with the run (report is then set)."""
        buf = b""
        outcome: tuple[str, str | None, str] | None = None
        try:
            while outcome is None:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    self._kill()
                    outcome = ("failed", "timeout",
                               f"timeout: the run took longer than timeout_s={self.config.timeout_s:g} s and was stopped")
                    break
                ready, _, _ = select.select([self._fd], [], [], min(remaining, 0.5))
                if not ready:
                    continue
                chunk = os.read(self._fd, 65536)
                if not chunk:  # the worker closed its end: it exited (or was killed)
                    break
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    self._events.append(event)
                    yield event
                    if event["event"] == "finished":
                        outcome = ("ok", None, "")
                    elif event["event"] == "failed":
                        outcome = ("failed", event.get("kind", "crashed"), event.get("message", ""))
                    elif event["event"] == "environment":
                        outcome = ("ok", None, "")
        finally:
            os.close(self._fd)
            self._reap()
        if self._cancelled.is_set() and (outcome is None or outcome[0] != "ok"):
            outcome = ("cancelled", "cancelled", "cancelled: the run was stopped on request")
        if outcome is None:
            outcome = ("failed", "crashed", self._crash_message())
        status, kind, message = outcome
        self.report = RunReport.from_events(
            self.config, self._events, status=status, failure_kind=kind, message=message,
            stderr_tail=self._stderr_tail(), started_at=self.started_at,
            wall_s=time.monotonic() - self._t0,
        )

    def wait(self, on_event: Callable[[dict[str, Any]], None] | None = None) -> RunReport:
        for event in self.events():
            if on_event is not None:
                on_event(event)
        assert self.report is not None
        return self.report

    def _reap(self) -> None:
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._kill()
            self._proc.wait()

    def _crash_message(self) -> str:
        code = self._proc.returncode
        if code is not None and code < 0:
            name = signal.Signals(-code).name
            why = f"the worker was killed by {name}"
            if name == "SIGKILL":
                why += " (by a user, or by the system when the host ran out of memory)"
        else:
            why = f"the worker exited with code {code} before reporting a result"
        return f"crashed: {why}; the events received so far are kept. See the stderr tail for details."

    def _stderr_tail(self) -> str:
        self._stderr.seek(0, os.SEEK_END)
        size = self._stderr.tell()
        self._stderr.seek(max(0, size - STDERR_TAIL_CHARS * 4))
        text = self._stderr.read().decode(errors="replace")
        self._stderr.close()
        return text[-STDERR_TAIL_CHARS:]


def start_run(cfg: RunConfig) -> RunHandle:
    """Validate (raises ConfigError before any process starts), then start the worker."""
    return RunHandle(validate(cfg))


def run(cfg: RunConfig, on_event: Callable[[dict[str, Any]], None] | None = None) -> RunReport:
    return start_run(cfg).wait(on_event)


def probe_environment(cfg: RunConfig | None = None) -> dict[str, Any]:
    """What a worker with this config's environment sees (backend, devices, versions, GPUs)."""
    cfg = validate(cfg or RunConfig(timeout_s=120))
    handle = RunHandle(cfg, probe_env=True)
    report = handle.wait()
    for event in handle.events_so_far:
        if event["event"] == "environment":
            return {k: v for k, v in event.items() if k not in ("event", "t")}
    raise RuntimeError(f"environment probe failed ({report.failure_kind}): {report.message}\n{report.stderr_tail}")
