"""What a worker process pays before it does any work: the CPU seconds of a fresh Python process that imports
what a run worker imports (migration.running.worker, .measure, the workloads; JAX with them) and starts JAX's CPU
backend. Every run, plan and compile worker the product starts pays it, and so does every process the test suite
starts.

Side by side, alternating, three starts: as a worker started before (ml_dtypes 0.7.0, installed for the bench
alone with `pip install --no-deps --target` a temporary folder put first on the path, and Orbax imported at the
start, as migration/running/checkpoint.py did); the same with this environment's pinned ml_dtypes; and the worker
as it starts now (the pinned ml_dtypes, Orbax imported only when a checkpoint is saved or read). Baseline: the
first. ml_dtypes 0.7.0's extension registers its types' loops with NumPy one by one, and NumPy compares each new
loop with every one already registered, which is what made it slow here.

    python bench/import_cost.py [--vs 0.7.0] [--repeats 5] [--json PATH]
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
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402

STACK = ("import migration.running.worker, migration.running.measure, workloads, jax, ml_dtypes; jax.devices(); "
         "print(ml_dtypes.__version__)")


def child_cpu(path_first: str | None, orbax: bool) -> tuple[float, str]:
    """CPU seconds (user + system) of one fresh process importing the worker's stack (and Orbax with it), and its
    ml_dtypes version."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (path_first, str(ROOT)) if p)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    code = ("import orbax.checkpoint; " if orbax else "") + STACK
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return cpu, done.stdout.strip().splitlines()[-1]


def ml_dtypes_import_s(path_first: str | None) -> float:
    """Seconds of `import ml_dtypes` alone (Python's -X importtime, cumulative)."""
    env = {**os.environ, "PYTHONPATH": path_first or ""}
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", "import ml_dtypes"], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    line = [x for x in done.stderr.splitlines() if x.rstrip().endswith("| ml_dtypes")][-1]
    return int(line.split("|")[1]) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vs", default="0.7.0", help="the other ml_dtypes version (default 0.7.0)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as other:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", other,
                        f"ml_dtypes=={args.vs}"], check=True, timeout=600)
        starts = {"before": (other, True), "pinned ml_dtypes": (None, True), "now": (None, False)}
        runs: dict[str, list[float]] = {name: [] for name in starts}
        alone: dict[str, list[float]] = {name: [] for name in starts}
        versions: dict[str, str] = {}
        for r in range(args.repeats):
            for name, (path, orbax) in starts.items():
                cpu, versions[name] = child_cpu(path, orbax)
                runs[name].append(cpu)
                alone[name].append(ml_dtypes_import_s(path))
                print(f"repeat {r + 1}, {name} (ml_dtypes {versions[name]}): {cpu:.2f} s CPU", flush=True)
    assert versions["before"] == args.vs and versions["now"] != args.vs, versions
    base = statistics.median(runs["before"])
    rows = [[name, versions[name], "at the start" if starts[name][1] else "when a checkpoint is saved or read",
             f"{statistics.median(runs[name]):.2f} s", f"{statistics.median(runs[name]) / base:.2f}x",
             f"{statistics.median(alone[name]):.2f} s"] for name in starts]
    table = record.table(f"A fresh process importing a run worker's modules and starting JAX's CPU backend: median "
                         f"of {args.repeats} alternating runs",
                         ["start", "ml_dtypes", "Orbax imported", "CPU seconds (user + system)", "ratio",
                          "import ml_dtypes alone (wall)"], rows)
    now = statistics.median(runs["now"])
    notes = [f"A worker's start now takes {now / base:.2f}x the CPU it took ({base - now:.2f} s less a process). The "
             f"pinned ml_dtypes is this environment's (constraints.txt); {args.vs} was installed for the bench alone."]
    print(json.dumps(table, indent=1))
    print(notes[0])
    record.write(args.json, "import_cost", [table], notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
