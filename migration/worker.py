"""Worker process entry point: `python -m migration.worker --events-fd N [--mode run|probe-env|plan]`
(config JSON on stdin).

Sets JAX's environment from the config *before* JAX is first imported, runs one measured run (or,
with --probe-env, reports the environment), writes JSON-lines events to the given file descriptor
and exits. Exit code 0 on success, 1 on a failed run, 2 on an invalid config.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

from migration.common import first_line, is_oom, json_safe
from migration.config import ConfigError, PlanRequest, RunConfig, validate, validate_plan_request
from migration.worker_env import planner_environment, worker_environment



class EventWriter:
    """Writes JSON-lines events to a pipe. Step events are batched (flushed at least every
    `step_flush_s` and before any other event) so that a fast step loop does not wake the
    reading process once per step."""

    def __init__(self, fd: int, step_flush_s: float = 0.1):
        self.fd = fd
        self.t0 = time.time()
        self.step_flush_s = step_flush_s
        self._pending: list[bytes] = []
        self._last_flush = 0.0

    def __call__(self, kind: str, /, **fields: Any) -> None:
        now = time.time()
        event = {"event": kind, "t": round(now - self.t0, 6), **fields}
        self._pending.append((json.dumps(json_safe(event), allow_nan=False, default=str) + "\n").encode())
        if kind != "step" or now - self._last_flush >= self.step_flush_s:
            self.flush()

    def flush(self) -> None:
        data = b"".join(self._pending)
        self._pending.clear()
        self._last_flush = time.time()
        while data:
            data = data[os.write(self.fd, data):]


def classify_exception(exc: BaseException) -> tuple[str, str]:
    """(failure kind, one-paragraph message a user can act on)."""
    text = str(exc)
    first = first_line(exc, 500)
    stages = [n.removeprefix("stage: ") for n in getattr(exc, "__notes__", []) if n.startswith("stage: ")]
    where = f" while {stages[0]}" if stages else ""
    if isinstance(exc, ConfigError):
        return "invalid", text
    if is_oom(text) or isinstance(exc, MemoryError):
        return "oom", (
            f"out of memory{where}: {first[:400].rstrip('.')}. Lower the per-device batch (and raise accumulation "
            "steps to keep the global batch), choose a rematerialisation policy, or use bf16."
        )
    return "crashed", f"{type(exc).__name__}{where}: {first}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m migration.worker")
    parser.add_argument("--events-fd", type=int, required=True)
    parser.add_argument("--mode", choices=["run", "probe-env", "plan"], default="run")
    args = parser.parse_args(argv)
    emit = EventWriter(args.events_fd)
    payload = json.loads(sys.stdin.read() or "{}")
    try:
        cfg = PlanRequest(**payload) if args.mode == "plan" else RunConfig(**payload)
        # Set JAX's environment before the first `import jax` (validation below imports it).
        os.environ.update(planner_environment(cfg) if args.mode == "plan" else worker_environment(cfg))
    except (TypeError, ValueError) as exc:
        emit("failed", kind="invalid", message=f"config: {exc}")
        return 2
    try:
        validate_plan_request(cfg) if args.mode == "plan" else validate(cfg)
    except ConfigError as exc:
        emit("failed", kind="invalid", message=str(exc))
        return 2
    try:
        if args.mode == "probe-env":
            from migration.env_report import collect_environment

            emit("environment", **collect_environment())
        elif args.mode == "plan":
            from migration.planner import plan_migration

            emit("plan", plan=plan_migration(cfg, emit).to_dict())
        else:
            from migration.measure import measured_run

            measured_run(cfg, emit)
    except Exception as exc:  # the worker's one boundary: every failure becomes an event
        kind, message = classify_exception(exc)
        emit("failed", kind=kind, message=message, traceback=traceback.format_exc(limit=8)[-4000:])
        return 2 if kind == "invalid" else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
