"""Persistent compilation cache: time to the first step of a fresh worker, without and with it.

Two real worker runs of the same job, one after the other, each a fresh process, both with the
same new (empty) cache folder: the first compiles everything and fills JAX's persistent
compilation cache, the second loads the executables from it. From the worker's own events it
prints, for each run, the train step's compile (`compiled`: trace, lower and compile or load), the
first step, their sum (time to first step), the time from `started` to the first step (parameter
initialisation and data included, whose compiles are cached too) and the cache hits the run
reported; then the ratio second / first of the time to first step (with --repeats, each pair gets
its own new cache folder and the best of each position is compared). The cache saves compiles, not
the first step's arithmetic, which both runs do alike: the default batch of 1 keeps that small.
Target: ratio <= 0.5 on the CPU for the small transformer preset.

    python bench/compile_cache.py [--preset small] [--batch 1] [--steps 3] [--repeats 1] [--platform cpu]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import record  # noqa: E402
from migration.config.requests import RunConfig  # noqa: E402
from migration.results import RunReport  # noqa: E402
from migration.running.runner import start_run  # noqa: E402


def timed_run(cfg: RunConfig) -> tuple[RunReport, float]:
    """The run's report and the seconds from its `started` event to its first `step` event."""
    handle = start_run(cfg)
    times: dict[str, float] = {}
    for event in handle.events():
        times.setdefault(event["event"], event.get("t", 0.0))
    report = handle.report
    if not report.ok:
        raise SystemExit(f"run failed: {report.failure_kind}: {report.message}\n{report.stderr_tail}")
    return report, times["step"] - times["started"]


def row(name: str, report: RunReport, started_to_step_s: float) -> dict[str, Any]:
    first_step_s = report.step_ms[0] / 1e3
    return {"name": name, "compile_s": report.compile_s, "first_step_s": first_step_s,
            "to_first_step_s": report.compile_s + first_step_s, "started_to_step_s": started_to_step_s,
            "hits": report.compile_cache_hits, "wall_s": report.wall_s}


def cache_pair(cfg: RunConfig) -> list[dict[str, Any]]:
    """A first and a second run with one new cache folder (the workers inherit the variable)."""
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MIGRATION_CACHE_DIR"] = tmp
        rows = [row(name, *timed_run(cfg)) for name in ("first (empty cache)", "second (same cache)")]
        entries = sorted(p.name.split("-")[0] for p in (Path(tmp) / "xla").glob("*-cache"))
    print(f"cache entries written: {len(entries)} ({', '.join(entries)})", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, each with its own new cache")
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "auto"])
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/compile_cache.json)")
    args = parser.parse_args()
    cfg = RunConfig(workload=args.workload, preset=args.preset, per_device_batch=args.batch, steps=args.steps,
                    warmup_steps=1, platform=args.platform, timeout_s=3600, silence_timeout_s=600)
    print(f"{args.workload}/{args.preset} b{args.batch} on {args.platform}, {args.steps} steps, "
          f"{args.repeats} pair(s) of fresh worker processes", flush=True)
    pairs = [cache_pair(cfg) for _ in range(args.repeats)]
    print(f"{'run':<22} {'compile s':>10} {'1st step s':>11} {'to 1st step s':>14} {'started->step s':>16} "
          f"{'cache hits':>11} {'wall s':>8}")
    for r in (r for pair in pairs for r in pair):
        print(f"{r['name']:<22} {r['compile_s']:>10.2f} {r['first_step_s']:>11.2f} {r['to_first_step_s']:>14.2f} "
              f"{r['started_to_step_s']:>16.2f} {r['hits']!s:>11} {r['wall_s']:>8.1f}")
    first = min(pair[0]["to_first_step_s"] for pair in pairs)
    second = min(pair[1]["to_first_step_s"] for pair in pairs)
    started = (min(pair[1]["started_to_step_s"] for pair in pairs)
               / min(pair[0]["started_to_step_s"] for pair in pairs))
    ratio = second / first
    print(f"ratio second / first, time to first step: {ratio:.3f} (started->step: {started:.3f}); target <= 0.5")
    record.write(args.json, "compile_cache", [record.table(
        f"{args.workload}/{args.preset}, batch {args.batch}, {args.steps} steps on {args.platform}: pairs of fresh worker "
        "processes, the first with an empty persistent compile cache, the second with the cache it left",
        ["run", "compile s", "1st step s", "to 1st step s", "started to step s", "cache hits", "wall s"],
        [[r["name"], f"{r['compile_s']:.2f}", f"{r['first_step_s']:.2f}", f"{r['to_first_step_s']:.2f}",
          f"{r['started_to_step_s']:.2f}", str(r["hits"]), f"{r['wall_s']:.1f}"] for pair in pairs for r in pair])],
        [f"Ratio second / first, time to the first step (best of {args.repeats}): **{ratio:.3f}** (target <= 0.5)."])
    hits_ok = all(pair[0]["hits"] == 0 and (pair[1]["hits"] or 0) > 0 for pair in pairs)
    return 0 if ratio <= 0.5 and hits_ok else 1


if __name__ == "__main__":
    sys.exit(main())
