"""Planner cost: compiles and seconds of a real plan against a linear scan of the candidates.

Plans gpt2-small (global batch 256 from a TPU v5e-8) for an H100 SXM with a fresh compile cache,
then prints the compiles the search used against the number of candidate batch sizes a linear
scan would compile (every candidate, for each remat policy the search looked at), and the ratio.

    python bench/planner_cost.py [--preset gpt2-small] [--target h100-sxm] [--global-batch 256]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.config import PlanRequest  # noqa: E402
from migration.plan import batch_candidates  # noqa: E402
from migration.runner import plan  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="gpt2-small")
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--global-batch", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        os.environ["MIGRATION_CACHE_DIR"] = cache  # cold cache: every compile counts
        p = plan(PlanRequest(workload="transformer", preset=args.preset, target=args.target,
                             global_batch=args.global_batch, compile_for_tpu=False))
    compile_rows = [r for r in p.table if not r["cached"]]
    per_compile = sum(r["seconds"] for r in compile_rows) / max(1, len(compile_rows))
    all_candidates = batch_candidates(min(args.global_batch, 1024), "multiple8")
    policies = len(p.max_batch_by_remat)
    linear = len(all_candidates) * policies
    print(f"plan: {p.per_device_batch} per GPU x {p.accumulation_steps} accumulation, {p.precision}, remat {p.remat}; "
          f"{p.prediction_method}; predicted {p.predicted_peak_bytes / 2**30:.2f} of {p.budget_bytes / 2**30:.2f} GiB")
    print(f"{'':<34} {'compiles':>9} {'seconds':>9}")
    print(f"{'planner search (cold cache)':<34} {p.compiles:>9} {p.search_seconds:>9.1f}")
    print(f"{'linear scan (estimated)':<34} {linear:>9} {linear * per_compile:>9.1f}")
    print(f"ratio planner / linear scan: {p.compiles / linear:.3f} "
          f"({len(all_candidates)} multiple-of-8 candidates x {policies} remat policies looked at; "
          f"linear-scan seconds = candidates x the search's mean {per_compile:.1f} s per compile)")


if __name__ == "__main__":
    main()
