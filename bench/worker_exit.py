"""What a worker process costs after its result is sent: a run worker and a plan worker started as the product
starts them (`python -m migration.running.worker`, the request on stdin, events on a pipe), each timed from its
start to its result event and to its exit, with its CPU seconds (user + system).

Side by side, alternating: the worker as it ends now (`leave`: the threads' and `atexit` hooks, streams flushed,
no teardown of the loaded modules) and the same worker ended by the interpreter's own exit (`sys.exit(main())`,
as it ended before). Baseline: the interpreter's exit. The result reaches the parent at the same moment either
way; what differs is the time until the process is gone (the runner reaps it before it reports the outcome, and
a queue slot is free only then) and the CPU it burns meanwhile.

Measured twice: with nothing else running, and with `--busy` processes keeping the CPUs busy at the workers'
priority, as other users' jobs do on a shared box.

    python bench/worker_exit.py [--repeats 5] [--busy 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.worker import TERMINAL_EVENTS, WORKER_NICE  # noqa: E402

WORKERS = {
    "run": RunConfig(workload="mlp", preset="tiny", steps=3, warmup_steps=1).to_dict(),
    "plan": PlanRequest(workload="mlp", preset="tiny", global_batch=32, target="local",
                        compile_for_tpu=False).to_dict(),
}
ENDINGS = {
    "interpreter's exit": ["-c", "import sys; from migration.running.worker import main; sys.exit(main())"],
    "leave (now)": ["-m", "migration.running.worker"],
}


def one(mode: str, ending: str, env: dict[str, str]) -> tuple[float, float, float]:
    """(seconds to the result event, seconds to the exit, CPU seconds) of one worker."""
    read_fd, write_fd = os.pipe()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *ENDINGS[ending], "--events-fd", str(write_fd), "--mode", mode],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, pass_fds=(write_fd,), env=env, cwd=ROOT)
    os.close(write_fd)
    proc.stdin.write(json.dumps(WORKERS[mode]).encode())
    proc.stdin.close()
    result_s = None
    with os.fdopen(read_fd, "rb") as events:
        for line in events:
            event = json.loads(line)
            if event["event"] in TERMINAL_EVENTS:
                if event["event"] == "failed":
                    raise SystemExit(f"the {mode} worker failed: {event.get('message')}")
                result_s = time.monotonic() - t0
    proc.wait(timeout=300)
    exit_s = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or result_s is None:
        raise SystemExit(f"the {mode} worker ended with {proc.returncode} and no result")
    return result_s, exit_s, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def measure(repeats: int, env: dict[str, str]) -> dict[tuple[str, str], list[tuple[float, float, float]]]:
    figures: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    for r in range(repeats):
        for mode in WORKERS:
            for ending in ENDINGS:
                figures.setdefault((mode, ending), []).append(one(mode, ending, env))
                res, ex, cpu = figures[mode, ending][-1]
                print(f"repeat {r + 1}, {mode} worker, {ending}: result {res:.2f} s, exit {ex:.2f} s, {cpu:.2f} s CPU",
                      flush=True)
    return figures


def summary(figures: dict, title: str, label: str) -> tuple[dict, list[str]]:
    rows, notes = [], []
    for mode in WORKERS:
        base = figures[mode, "interpreter's exit"]
        base_exit = statistics.median(f[1] - f[0] for f in base)
        base_cpu = statistics.median(f[2] for f in base)
        for ending in ENDINGS:
            got = figures[mode, ending]
            after_result = statistics.median(f[1] - f[0] for f in got)
            cpu = statistics.median(f[2] for f in got)
            rows.append([mode, ending, f"{statistics.median(f[0] for f in got):.2f} s", f"{after_result:.2f} s",
                         f"{after_result / base_exit:.2f}x", f"{cpu:.2f} s", f"{cpu / base_cpu:.2f}x"])
        now = figures[mode, "leave (now)"]
        notes.append(f"{label}: a {mode} worker is gone {base_exit - statistics.median(f[1] - f[0] for f in now):.2f} s "
                     f"sooner after its result and uses {base_cpu - statistics.median(f[2] for f in now):.2f} s less CPU.")
    return record.table(title, ["worker", "ending", "start to result", "result to exit", "ratio", "CPU seconds",
                                "ratio"], rows), notes


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--busy", type=int, default=2, help="processes that keep the CPUs busy for the second "
                        "table, at the workers' priority (as other users' jobs do); 0: no second table")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    cache = tempfile.TemporaryDirectory(prefix="worker-exit-")  # the workers' service folder: compiles and all
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "MIGRATION_CACHE_DIR": cache.name,
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(ROOT)) if p)}
    env.pop("MIGRATION_COMPILE_CACHE_DIR", None)
    for mode in WORKERS:  # the compiles in JAX's persistent cache first, so both endings find them there
        one(mode, "leave (now)", env)
    tables, notes = [], []
    title = (f"A worker from its start to its result and its exit: median of {args.repeats} alternating runs, "
             "compiles found in JAX's persistent cache")
    for table, said in [summary(measure(args.repeats, env), title + ", nothing else running",
                                    "Nothing else running")]:
        tables.append(table)
        notes += said
    if args.busy:
        spinners = [subprocess.Popen([sys.executable, "-c", f"import os\nos.nice({WORKER_NICE})\nwhile True: pass"])
                    for _ in range(args.busy)]
        try:
            table, said = summary(measure(args.repeats, env),
                                  f"{title}, {args.busy} other processes at the workers' priority keeping the CPUs busy",
                                  f"{args.busy} other processes busy")
        finally:
            for spinner in spinners:
                spinner.kill()
                spinner.wait()
        tables.append(table)
        notes += said
    for table in tables:
        print(json.dumps(table, indent=1))
    print("\n".join(notes))
    record.write(args.json, "worker_exit", tables, notes)
    cache.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
