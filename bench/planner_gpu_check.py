"""Planner GPU check: plan gpt2-small and gpt2-medium for the local NVIDIA GPU, run each plan and
compare predicted with measured peak memory (target: within 10%) and predicted with measured step
time (the compiled program's roofline, planning/steptime.py; its expected error is printed). Beside the on-device
prediction it prints the deviceless prediction for the catalog H200 (the CPU machine's method),
made here for the same configuration.

It refuses to report predicted-vs-measured without a GPU measurement: on a machine without a GPU
(or when a run did not execute on the GPU backend) it says so and exits with status 2, because a
CPU figure compared with a CPU compile checks nothing about GPU planning.

    python bench/planner_gpu_check.py [--steps 10] [--catalog h200]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.runner import plan, run  # noqa: E402

from migration.common import GiB  # noqa: E402


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.1f} ms"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--catalog", default="h200")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--presets", default="gpt2-small,gpt2-medium")
    args = parser.parse_args()
    from migration.running.worker_env import nvidia_gpus

    if not nvidia_gpus():
        print("refused: no NVIDIA GPU here (NVML found none), so nothing can be measured on a GPU; "
              "predicted-vs-measured is only reported for runs on a GPU")
        return 2
    print(f"{'preset':<12} {'plan':<26} {'pred local':>10} {'pred deviceless':>15} {'measured':>9} {'meas/pred':>9} "
          f"{'step pred local':>15} {'step pred deviceless':>20} {'step measured':>13}")
    bad = 0
    for preset in args.presets.split(","):
        local = plan(PlanRequest(workload="transformer", preset=preset, target="local", global_batch=args.global_batch,
                                 compile_for_tpu=False))
        deviceless = plan(PlanRequest(workload="transformer", preset=preset, target=args.catalog,
                                      global_batch=args.global_batch, compile_for_tpu=False,
                                      precision=local.precision, remat=local.remat,
                                      accumulation_steps=local.accumulation_steps))
        report = run(RunConfig(workload="transformer", preset=preset, per_device_batch=local.per_device_batch,
                               accumulation_steps=local.accumulation_steps, precision=local.precision,
                               remat=local.remat, steps=args.steps, warmup_steps=2, platform="gpu", timeout_s=300))
        if report.backend != "gpu":
            print(f"refused: the {preset} run executed on the {report.backend} backend ({report.status}: "
                  f"{report.message}); no GPU figure to compare")
            return 2
        desc = f"b{local.per_device_batch} x{local.accumulation_steps} {local.precision} {local.remat}"
        measured = report.peak_memory_bytes if report.ok else None
        ratio = measured / local.predicted_peak_bytes if measured else None
        print(f"{preset:<12} {desc:<26} {local.predicted_peak_bytes / GiB:>10.2f} "
              f"{deviceless.predicted_peak_bytes / GiB:>15.2f} "
              f"{(measured or 0) / GiB:>9.2f} {ratio if ratio else float('nan'):>9.3f} "
              f"{_ms(local.predicted_step_s):>15} {_ms(deviceless.predicted_step_s):>20} "
              f"{_ms(report.step_ms_median / 1e3 if report.ok else None):>13}  "
              f"({local.prediction_method} / {deviceless.prediction_method}; run {report.status})", flush=True)
        if not report.ok or abs(ratio - 1) > 0.10:
            bad += 1
            print(f"  outside 10% or failed: {report.failure_kind} {report.message}")
    print("pred = compiled memory_analysis per GPU; measured = memory_stats peak_bytes_in_use (includes the data pool)")
    print(f"step pred = the plan's predicted_step_s ({local.step_time.get('source')}: expected error "
          f"{local.step_time.get('expected_error')}); step measured = the run's median step")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
