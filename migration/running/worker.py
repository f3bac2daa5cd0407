"""Worker process entry point: `python -m migration.running.worker --events-fd N
[--mode run|probe-env|plan|check|serve-plan|serve-run] [--lifeline-fd N] [--silence-timeout-s S] [--memory-bytes N]`
(config JSON on stdin).

Sets JAX's environment from the config *before* JAX is first imported, runs one measured run (or,
with --probe-env, reports the environment), writes JSON-lines events to the given file descriptor
and exits. Exit code 0 on success, 1 on a failed run, 2 on an invalid config.

`--mode check` runs the code check on untrusted source ({"sources": [[name, text], ...]} on stdin)
without importing JAX, under an address-space limit (`--memory-bytes`, RLIMIT_AS) and a CPU-time
limit, so that no paste can hold the server's CPU or memory: its result is one `checked` event.

`--mode serve-plan` and `--mode serve-run` serve a decoder: {"request": {...}} on stdin, the keyword
arguments of `config.serving.serve_request` / `serve_run_request`, checked again here (whoever wrote the
payload), plus for a run {"memory_fraction": F}, its share of the device. A serving plan compiles for a
catalog GPU without the device (the planner's compile environment); a serving run measures on this
machine's first device in a training run's environment. Each ends with one result event, `serve_plan` or
`serve_run` ({"result": the plan's or the run's dict}), or `failed`.

It runs at the lowest CPU priority (nice 19), below the process that started it, sends {"event": "alive"}
every min(2 s, silence_timeout_s / 4) so that its parent can tell a long compile from a hang, and,
given --lifeline-fd (the read end of a pipe whose only write end the parent holds), kills its whole
process group as soon as that pipe reports end-of-file: the parent is gone (exited, crashed or was
killed), and no worker may outlive it.

Runs, and plans for this machine's devices, use JAX's persistent compilation cache in the service's
private cache folder (`enable_compile_cache`); a run's `compiled` and `finished` events say how many
executables it served (`compile_cache_hits`).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from migration.codecheck import FINDINGS_KEPT, CodeCheckError, check_sources
from migration.common import ConfigError, enable_compile_cache, first_line, is_oom, json_safe, leave
from migration.config.forms import number
from migration.config.limits import LIMITS
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
from migration.config.serving import serve_request, serve_run_request
from migration.running.worker_env import (compile_environment, planner_environment, with_serving_flags,
                                           worker_environment)

# Serving modes and the event that carries each one's result.
SERVE_RESULT_EVENTS = {"serve-plan": "serve_plan", "serve-run": "serve_run"}
# After one of these the parent reads no further events (the runner's TERMINAL_EVENTS).
TERMINAL_EVENTS = ("finished", "failed", "plan", "environment", "checked", *SERVE_RESULT_EVENTS.values())
WORKER_NICE = 19  # the lowest: the server that started it must stay responsive; a GPU job barely needs the CPU
# Recorded by jax._src.compiler once for every executable loaded from the persistent compilation cache.
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class EventWriter:
    """Writes JSON-lines events to a pipe; thread-safe (the heartbeat thread writes too). Step
    events are batched (flushed at least every `step_flush_s` and before any other event) so that a
    fast step loop does not wake the reading process once per step."""

    def __init__(self, fd: int, step_flush_s: float = 0.1):
        self.fd = fd
        self.t0 = time.time()
        self.step_flush_s = step_flush_s
        self._pending: list[bytes] = []
        self._last_flush = 0.0
        self._lock = threading.RLock()
        self._ended = False  # a terminal event was written: no heartbeat after it

    def __call__(self, kind: str, /, **fields: Any) -> None:
        with self._lock:
            now = time.time()
            event = {"event": kind, "t": round(now - self.t0, 6), **fields}
            self._pending.append((json.dumps(json_safe(event), allow_nan=False, default=str) + "\n").encode())
            if kind in TERMINAL_EVENTS:
                self._ended = True
            if kind != "step" or now - self._last_flush >= self.step_flush_s:
                self.flush()

    def alive(self) -> None:
        """The heartbeat: {"event": "alive"} (which also flushes pending step events), unless the
        worker has already written its terminal event."""
        with self._lock:
            if not self._ended:
                self("alive")

    def flush(self) -> None:
        with self._lock:
            data = b"".join(self._pending)
            self._pending.clear()
            self._last_flush = time.time()
            while data:
                data = data[os.write(self.fd, data):]


def start_heartbeat(emit: EventWriter, interval_s: float) -> threading.Thread:
    """A daemon thread that sends `alive` every `interval_s` until the events pipe breaks."""

    def beat() -> None:
        while True:
            time.sleep(interval_s)
            try:
                emit.alive()
            except OSError:  # the reader is gone; the lifeline (or the next event) ends the worker
                return

    thread = threading.Thread(target=beat, name="worker-heartbeat", daemon=True)
    thread.start()
    return thread


def kill_own_group() -> None:
    """SIGKILL this worker and everything it started (its process group, when it leads one)."""
    pgid = os.getpgid(0)
    if pgid == os.getpid():  # started by the runner, in its own session
        os.killpg(pgid, signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)  # started by hand: never take the caller's group down


def start_lifeline(fd: int) -> threading.Thread:
    """A daemon thread that blocks reading `fd` (the parent never writes to it); end-of-file means
    the parent's write end closed with the parent, so the worker kills its group at once."""
    os.set_inheritable(fd, False)  # the worker's own children need no copy

    def watch() -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        kill_own_group()

    thread = threading.Thread(target=watch, name="worker-lifeline", daemon=True)
    thread.start()
    return thread


def heartbeat_interval(silence_timeout_s: Any) -> float:
    """min(2 s, silence_timeout_s / 4); the default limit (120 s) when the value is not a number
    from 2 to 3600 (validation reports that to the parent)."""
    ok = isinstance(silence_timeout_s, (int, float)) and not isinstance(silence_timeout_s, bool)
    limit = float(silence_timeout_s) if ok and 2 <= silence_timeout_s <= 3600 else 120.0
    return min(2.0, limit / 4)


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


class CompileCacheHits:
    """Counts the executables JAX's persistent compilation cache served in this process."""

    def __init__(self) -> None:
        import jax  # reason: JAX reads its environment when imported: the worker sets it first

        self.count = 0
        jax.monitoring.register_event_listener(self._on_event)

    def _on_event(self, event: str, **_: Any) -> None:
        if event == CACHE_HIT_EVENT:
            self.count += 1


def start_compile_cache(mode: str, cfg: RunConfig | PlanRequest) -> CompileCacheHits | None:
    """JAX's persistent compilation cache for a run, and for a plan that compiles for this machine's
    devices (target "local"), with a counter of its hits; None where it stays off. A catalog target's
    compiles are deviceless: JAX writes them to the cache but its compile-only client cannot load
    them back, so there the cache would only fill the disk and warn at every compile."""
    if mode == "probe-env" or (mode == "plan" and cfg.target != "local"):
        return None
    try:
        if enable_compile_cache() is None:
            return None
    except OSError:  # no cache folder can be made: compile as without the cache
        return None
    return CompileCacheHits()


def with_cache_hits(emit: Callable[..., None], hits: CompileCacheHits | None) -> Callable[..., None]:
    """`emit`, adding the persistent-cache hits so far to the `compiled` and `finished` events (left
    out where the cache is off)."""

    def emit_with_hits(kind: str, /, **fields: Any) -> None:
        if hits is not None and kind in ("compiled", "finished"):
            fields["compile_cache_hits"] = hits.count
        emit(kind, **fields)

    return emit_with_hits


WORKER_CPUS_VARIABLE = "MIGRATION_WORKER_CPUS"  # set by the app's --worker-cpus


def pin_to_worker_cpus(spec: str) -> None:
    """Run on the CPUs the operator set aside for workers ("1", "2-15", "1,3"), leaving the server's
    own cores free; nothing when unset or when none of them exists here."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (hi.isdigit() or not hi):
            cpus |= set(range(int(lo), int(hi or lo) + 1))
    # Not intersected with this process's own affinity: that is the server's, which a worker inherits
    # (and which --worker-cpus exists to leave). The kernel refuses CPUs outside the machine's cpuset.
    usable = {c for c in cpus if c < (os.cpu_count() or 1)}
    if usable:
        try:
            os.sched_setaffinity(0, usable)
        except OSError:
            pass  # none of them is this process's to use: it stays where it was


def limit_resources(memory_bytes: int | None, cpu_seconds: int | None) -> None:
    """Hard limits for a worker that reads untrusted input: past them an allocation fails
    (MemoryError) or the kernel ends the process (SIGXCPU, then SIGKILL)."""
    if memory_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    if cpu_seconds:
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + 1))


def check_code(payload: Any, emit: EventWriter) -> int:
    """The code check of {"sources": [[name, text], ...]}: one `checked` event, or `failed` (invalid:
    what is wrong with the source; oom: over the memory limit)."""
    try:
        sources = payload["sources"]
        if not (isinstance(sources, list) and all(isinstance(s, list) and len(s) == 2 for s in sources)):
            raise TypeError("sources must be a list of [name, text] pairs")
        checked = check_sources([(str(name), text) for name, text in sources])
        emit("checked", result=checked.capped(FINDINGS_KEPT).to_dict())  # the server keeps no more than this
    except (CodeCheckError, TypeError, KeyError) as exc:
        emit("failed", kind="invalid", message=first_line(exc, 400))
        return 2
    except MemoryError:
        emit("failed", kind="oom", message="the code check ran out of its memory limit; check fewer or smaller files")
        return 1
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m migration.running.worker")
    parser.add_argument("--events-fd", type=int, required=True)
    parser.add_argument("--mode", choices=["run", "probe-env", "plan", "check", *SERVE_RESULT_EVENTS], default="run")
    parser.add_argument("--lifeline-fd", type=int, default=None,
                        help="read end of a pipe held open by the parent; end-of-file kills the worker")
    parser.add_argument("--silence-timeout-s", type=float, default=None,
                        help="the parent's silence limit (default: the config's silence_timeout_s)")
    parser.add_argument("--memory-bytes", type=int, default=None,
                        help="address-space limit of this process (RLIMIT_AS), for untrusted input")
    parser.add_argument("--cpu-seconds", type=int, default=None, help="CPU-time limit of this process (RLIMIT_CPU)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The worker: limits, lifeline and heartbeat first, then the payload (stdin) in its mode; every
    outcome is an event on the events pipe."""
    args = parse_args(argv)
    try:
        os.nice(WORKER_NICE)  # before any thread starts: threads inherit it (Linux nice is per thread)
    except OSError:
        pass
    limit_resources(args.memory_bytes, args.cpu_seconds)
    pin_to_worker_cpus(os.environ.get(WORKER_CPUS_VARIABLE, ""))
    if args.lifeline_fd is not None:
        start_lifeline(args.lifeline_fd)
    emit = EventWriter(args.events_fd)
    payload = json.loads(sys.stdin.read() or "{}")
    silence = args.silence_timeout_s if args.silence_timeout_s is not None else \
        (payload.get("silence_timeout_s", 120.0) if isinstance(payload, dict) else 120.0)
    start_heartbeat(emit, heartbeat_interval(silence))
    if args.mode == "check":
        return check_code(payload, emit)
    if args.mode in SERVE_RESULT_EVENTS:
        return serve(args.mode, payload, emit)
    try:
        cfg = PlanRequest(**payload) if args.mode == "plan" else RunConfig(**payload)
        # Set JAX's environment before the first `import jax` (validation below imports it).
        os.environ.update(planner_environment(cfg) if args.mode == "plan" else worker_environment(cfg))
    except (TypeError, ValueError) as exc:
        emit("failed", kind="invalid", message=f"config: {exc}")
        return 2
    # reason: workloads import JAX: only once the worker's environment is set
    from workloads import WorkloadError, allow_references

    allow_references()  # the parent validated the name; a command-line reference is imported here too
    try:
        validate_plan_request(cfg) if args.mode == "plan" else validate(cfg)
    except (ConfigError, WorkloadError) as exc:
        emit("failed", kind="invalid", message=str(exc))
        return 2
    hits = start_compile_cache(args.mode, cfg)
    try:
        run_mode(args.mode, cfg, emit, hits)
    except Exception as exc:  # the worker's one boundary: every failure becomes an event
        kind, message = classify_exception(exc)
        emit("failed", kind=kind, message=message, traceback=traceback.format_exc(limit=8)[-4000:])
        return 2 if kind == "invalid" else 1
    return 0


def run_mode(mode: str, cfg: Any, emit: EventWriter, hits: Any) -> None:
    """A validated request in its mode: the environment probe, a plan, or a measured run."""
    if mode == "probe-env":
        # reason: these import JAX: only once the worker's environment is set, and only what the mode needs
        from migration.running.env_report import collect_environment

        emit("environment", **collect_environment())
    elif mode == "plan":
        from migration.planning.planner import plan_migration  # reason: imports JAX (see above)

        emit("plan", plan=plan_migration(cfg, emit).to_dict())
    else:
        # reason: these import JAX (see above)
        from migration.running import multiprocess
        from migration.running.measure import measured_run, stage

        with stage(f"joining the multi-process job (coordinator {cfg.coordinator})"):
            multiprocess.join(cfg)  # before anything starts JAX's backend; nothing for a one-process run
        measured_run(cfg, with_cache_hits(emit, hits))
        multiprocess.leave(cfg)


def serve_environment(mode: str, payload: dict[str, Any]) -> dict[str, str]:
    """JAX's environment of a serving mode, decided before JAX is imported: a plan compiles deviceless
    on the CPU backend for the catalog GPU it names; a run gets a one-device training run's environment
    (platform, memory share without preallocation, XLA flags) with the payload's memory share, checked;
    both with the serving programs' XLA flags (worker_env.SERVING_XLA_FLAGS)."""
    if mode == "serve-plan":
        return with_serving_flags(compile_environment(platform="cpu"))
    return with_serving_flags(worker_environment(RunConfig(devices=1, memory_fraction=run_fraction(payload))))


def run_fraction(payload: dict[str, Any]) -> float:
    """A serving run's share of the device, checked."""
    return number(payload.get("memory_fraction", RunConfig.memory_fraction), "memory_fraction",
                  *LIMITS["memory_fraction"])


def serve(mode: str, payload: Any, emit: EventWriter) -> int:
    """A serving plan or run from {"request": keyword arguments}: the environment set, the request
    checked (`invalid` naming the field), then one result event; a failure is a `failed` event."""
    try:
        if not isinstance(payload, dict) or not isinstance(payload.get("request"), dict):
            raise TypeError("the payload must be {\"request\": {...}}")
        os.environ.update(serve_environment(mode, payload))
        check = serve_request if mode == "serve-plan" else serve_run_request
        req = check(**payload["request"])  # the workloads (and JAX) are imported here, once the environment is set
        if mode == "serve-run":
            from migration.running.serving import check_memory  # reason: imports JAX, once the environment is set

            check_memory(req, run_fraction(payload))
    except ConfigError as exc:
        emit("failed", kind="invalid", message=str(exc))
        return 2
    except TypeError as exc:  # a missing or unknown argument: no request this worker knows
        emit("failed", kind="invalid", message=f"request: {first_line(exc, 300)}")
        return 2
    try:
        if mode == "serve-plan":
            from migration.planning.serving import serve_plan  # reason: imports JAX, once the environment is set

            result = serve_plan(req)
        else:
            from migration.running.serving import serve_run  # reason: imports JAX, once the environment is set

            result = serve_run(req)
    except Exception as exc:  # the worker's one boundary: every failure becomes an event
        kind, message = classify_exception(exc)
        if kind == "oom":
            message = (f"out of memory: {first_line(exc, 400).rstrip('.')}. Serve smaller batches, shorter prompts "
                       "or generations, or a lower precision")
        emit("failed", kind=kind, message=message, traceback=traceback.format_exc(limit=8)[-4000:])
        return 2 if kind == "invalid" else 1
    emit(SERVE_RESULT_EVENTS[mode], result=result)
    return 0


if __name__ == "__main__":
    leave(main())
