"""Planner cost, like for like: the planner's search against a linear scan of the same candidates,
and the planner with its compile workers against the planner without them.

Everything runs in this one process with the planner worker's environment (deviceless compiles
for the target, XLA's own rematerialisation off), each side with its own cold compile cache:

- planner: `plan_migration` as `python -m migration plan` runs it (bracketed search per policy,
  policies it can rule out by predicted step time skipped, candidates whose analytic lower bound
  exceeds the budget not compiled, independent probes compiled meanwhile in compile workers when
  the cores allow, the chosen choice compiled with its accumulation);
- planner, one process: the same with no compile worker (MIGRATION_COMPILE_WORKERS=0);
- linear scan: for the same remat policies the planner searched and the same candidate batches,
  compile every candidate from the smallest up (above the batch the previous policy reached, as
  the planner does) until one does not fit, then compile the same chosen choice with its
  accumulation (a plan is not accepted unverified on either side).

It prints compiles and seconds of each, their ratios, a warm re-plan (the planner's cache of
figures), and checks that every side found the same largest batch for every policy.

    python bench/planner_cost.py [--preset gpt2-small] [--target h100-sxm] [--global-batch 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import record  # noqa: E402
from migration.config.requests import PlanRequest, validate_plan_request  # noqa: E402
from migration.running.worker_env import planner_environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="transformer")
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=None,
                        help="compile workers for the first planner run (default: as the cores allow, at least 1)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/planner_cost.json)")
    args = parser.parse_args()
    req = PlanRequest(workload=args.workload, preset=args.preset, target=args.target, global_batch=args.global_batch,
                      compile_for_tpu=False)
    os.environ.update(planner_environment(req))  # before JAX is first imported, as in a planner worker
    validate_plan_request(req)  # imports the workloads, and with them JAX

    from migration.planning.compile_cache import CompileCache
    from migration.planning.memory import MemoryPredictor, compile_workers
    from migration.planning.planner import plan_migration

    quiet = lambda *a, **k: None  # noqa: E731
    auto = compile_workers()
    workers = args.workers if args.workers is not None else max(1, auto)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MIGRATION_CACHE_DIR"] = str(Path(tmp) / "planner")
        os.environ["MIGRATION_COMPILE_WORKERS"] = str(workers)
        t0 = time.perf_counter()
        p = plan_migration(req, quiet)
        planner_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        warm = plan_migration(req, quiet)
        warm_s = time.perf_counter() - t0

        os.environ["MIGRATION_CACHE_DIR"] = str(Path(tmp) / "serial")
        os.environ["MIGRATION_COMPILE_WORKERS"] = "0"
        t0 = time.perf_counter()
        serial = plan_migration(req, quiet)
        serial_s = time.perf_counter() - t0
        del os.environ["MIGRATION_COMPILE_WORKERS"]

        scan = MemoryPredictor(req, quiet, cache=CompileCache(Path(tmp) / "linear" / "cache.json"), model=p.model)
        t0 = time.perf_counter()
        linear_max: dict[str, int] = {}
        known = 0  # like the planner, a policy that keeps less starts above the previous policy's fit
        for remat in p.max_batch_by_remat:
            linear_max[remat] = known
            for b in (c for c in p.candidates if c > known):
                peak = scan.predict(p.precision, remat, b)
                if peak is None or peak > p.budget_bytes:
                    break
                linear_max[remat] = b
            known = max(known, linear_max[remat])
        scan.predict(p.precision, p.remat, p.per_device_batch, p.accumulation_steps)
        linear_s = time.perf_counter() - t0

    print(f"{args.workload}/{args.preset}, global batch {args.global_batch}, for {p.target_name} "
          f"({p.prediction_method}); policies searched: {', '.join(p.max_batch_by_remat)}; "
          f"{len(p.candidates)} candidate batches {p.candidates[0]}..{p.candidates[-1]}")
    print(f"plan: {p.per_device_batch} per GPU x {p.accumulation_steps} accumulation, {p.precision}, remat {p.remat}; "
          f"predicted {p.predicted_peak_bytes / 2**30:.2f} of {p.budget_bytes / 2**30:.2f} GiB")
    print(f"{'':<40} {'compiles':>9} {'seconds':>9}")
    print(f"{'planner (cold cache)':<44} {p.compiles:>9} {planner_s:>9.1f}   "
          f"({p.parallel_compiles} in {workers} compile worker(s), {p.ruled_out_by_bound} ruled out by the bound; "
          f"this machine's default: {auto})")
    print(f"{'planner, no compile worker (cold cache)':<44} {serial.compiles:>9} {serial_s:>9.1f}")
    print(f"{'planner again (warm cache)':<44} {warm.compiles:>9} {warm_s:>9.1f}")
    print(f"{'linear scan, same policies (cold cache)':<44} {scan.compiles:>9} {linear_s:>9.1f}")
    print(f"ratio planner / linear scan: compiles {p.compiles / scan.compiles:.3f}, seconds {planner_s / linear_s:.3f}; "
          f"planner with / without compile workers: seconds {planner_s / serial_s:.3f}")
    record.write(args.json, "planner_cost", [record.table(
        f"{args.workload}/{args.preset}, global batch {args.global_batch} -> {p.target_name}: plan {p.per_device_batch} per "
        f"GPU x {p.accumulation_steps}, remat {p.remat}, {p.predicted_peak_bytes / 2**30:.2f} of "
        f"{p.budget_bytes / 2**30:.2f} GiB",
        ["", "compiles", "seconds"],
        [[f"planner, {workers} compile worker(s) (cold; {p.ruled_out_by_bound} ruled out by the lower bound)",
          f"{p.compiles} ({p.parallel_compiles} in the workers)", f"{planner_s:.1f}"],
         ["planner, no compile worker (cold)", str(serial.compiles), f"{serial_s:.1f}"],
         ["planner again (warm cache)", str(warm.compiles), f"{warm_s:.1f}"],
         ["linear scan, same policies (cold)", str(scan.compiles), f"{linear_s:.1f}"]])])
    same = linear_max == p.max_batch_by_remat == serial.max_batch_by_remat == warm.max_batch_by_remat
    print("largest batch per policy, planner: " + ", ".join(f"{k} {v}" for k, v in p.max_batch_by_remat.items())
          + "; linear scan: " + ", ".join(f"{k} {v}" for k, v in linear_max.items())
          + ("  (same)" if same else "  (DIFFERENT)"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
