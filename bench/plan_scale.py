"""A plan at the TPU job's real scale, cold: `python -m migration plan` from slices of one host to
multislice jobs, each in a fresh process with an empty cache of compiled figures and no store, as a new
user's first plan. For each: the wall time of the whole command (process start included), the TPU side's
compile, the GPU search's compiles (how many, and their seconds together), whether the TPU side compiled in a
process beside the search, and the per-chip and total figures the before/after table gives on both sides (they
must exist on both).

The goal is a cold plan in under 60 s. The machine's speed drifts, so each time is also given at the
reference speed the suite's budget is judged at (tests/budget.py: Python's parse of the code check's frozen
corpus, timed right after the plans).

    python bench/plan_scale.py [--workload llama --preset 8b] [--only 2xv5p-1024] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from tests.budget import REFERENCE_PARSE_S, machine_factor, parse_seconds  # noqa: E402

# (TPU source as Google Cloud names it, GPUs of the target, global batch): the TPU job at 2 sequences per
# chip, planned onto H100s at the count that keeps the global batch at 4 per GPU or so.
JOBS = (("v5p-8", 8, 8), ("v5p-1024", 256, 1024), ("2xv5p-1024", 512, 2048), ("2xv6e-256", 128, 1024),
        ("tpu7x-128", 128, 256))
GOAL_S = 60.0


def plan_once(args: argparse.Namespace, source: str, gpus: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        env = {k: v for k, v in os.environ.items() if k != "MIGRATION_COMPILE_STORE"}
        env["MIGRATION_CACHE_DIR"] = str(Path(tmp) / "cache")
        cmd = [sys.executable, "-m", "migration", "plan", "--workload", args.workload, "--preset", args.preset,
               "--source", source, "--target", args.target, "--gpus", str(gpus), "--global-batch", str(batch),
               "--json", str(out), "--quiet"]
        t0 = time.perf_counter()
        done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        wall = time.perf_counter() - t0
        if done.returncode != 0 or not out.exists():
            return {"source": source, "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
        plan = json.loads(out.read_text(encoding="utf-8"))
    src = plan["source_tpu_compile"]
    fitted = src.get("fitted") or {}
    tpu, gpu = plan["comparison"]["tpu"], plan["comparison"]["gpu"]
    return {"source": source, "gpus": gpus, "global_batch": batch, "wall_s": wall, "status": plan["status"],
            "tpu_status": src.get("status"), "tpu_compile_s": src.get("compile_s") or fitted.get("compile_s"),
            "gpu_compiles": plan["compiles"], "search_s": plan["search_seconds"],
            "gpu_compile_s": sum(row.get("seconds") or 0.0 for row in plan["table"]),
            "tpu_chips": tpu.get("chips"), "tpu_per_chip": tpu.get("throughput_per_chip_per_s"),
            "tpu_total": tpu.get("throughput_per_s"), "gpu_per_chip": gpu.get("throughput_per_chip_per_s"),
            "gpu_total": gpu.get("throughput_per_s")}


def fmt_rate(x: float | None) -> str:
    return "missing" if x is None else f"{x / 1e6:,.2f}M" if x >= 1e6 else f"{x / 1e3:,.1f}k"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="llama")
    parser.add_argument("--preset", default="8b")
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--only", help="one TPU source of the list (e.g. 2xv5p-1024)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/plan_scale.json)")
    args = parser.parse_args()
    jobs = [j for j in JOBS if not args.only or j[0] == args.only]
    if not jobs:
        parser.error(f"--only: one of {', '.join(j[0] for j in JOBS)}")
    found = []
    for source, gpus, batch in jobs:
        one = plan_once(args, source, gpus, batch)
        print(json.dumps(one), flush=True)
        found.append(one)
    parse = parse_seconds()  # the machine's speed, after the plans (as tests/budget.py times it)
    factor = machine_factor(parse)
    rows = []
    for f in found:
        if "error" in f:
            rows.append([f["source"], "failed: " + " ".join(f["error"])] + [""] * 9)
            continue
        rows.append([f["source"], f"{f['gpus']} x {args.target}", f"{f['wall_s']:.1f}", f"{f['wall_s'] / factor:.1f}",
                     "n/a" if f["tpu_compile_s"] is None else f"{f['tpu_compile_s']:.1f}",
                     f"{f['gpu_compiles']}", f"{f['gpu_compile_s']:.1f}", f"{f['tpu_status']}",
                     f"{fmt_rate(f['tpu_per_chip'])} / {fmt_rate(f['tpu_total'])}",
                     f"{fmt_rate(f['gpu_per_chip'])} / {fmt_rate(f['gpu_total'])}",
                     "met" if f["wall_s"] / factor < GOAL_S else "not met"])
    table = record.table(
        f"Cold plans of {args.workload}/{args.preset} (fresh process, empty cache, no store), 2 sequences per TPU chip",
        ["TPU source", "GPU target", "wall s", "wall s at reference speed", "TPU compile s", "GPU compiles",
         "GPU compile s", "TPU side", "TPU tokens/s per chip / total", "GPU tokens/s per GPU / total", f"under {GOAL_S:.0f} s"], rows)
    notes = [f"This machine parsed the yardstick in {parse:.2f} s against {REFERENCE_PARSE_S} s: {factor:.2f}x slower "
             "than the reference speed; times at the reference speed are the wall times divided by that.",
             f"The TPU side compiled beside the GPU search: {os.environ.get('MIGRATION_TPU_COMPILE_BESIDE') or 'as the cores allow (2 or more)'}."]
    for n in notes:
        print(n)
    print(json.dumps(table, indent=1))
    record.write(args.json, "plan_scale", [table], notes, parse_s=round(parse, 3), factor=round(factor, 2))
    return 0 if all("error" not in f for f in found) else 1


if __name__ == "__main__":
    sys.exit(main())
