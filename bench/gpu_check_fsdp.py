"""GPU check for models at real size: the Llama 3.2 1B layout on the local GPU.

1. Plan it for this machine (`--target local`): the largest per-device batch the compiler finds
   for the budget, with its remat policy and the fused attention kernel.
2. Run that plan twice, with the state replicated and with FSDP over the one device (the same
   program in principle: the same peak memory is expected), and print measured peak memory
   (memory_stats) against the plan's prediction, tokens/s and MFU against the datasheet peak.

Runs without gradio, from the working tree, in a few minutes on an H200:

    python bench/gpu_check_fsdp.py [--steps 10] [--seq 2048] [--global-batch 64]

`--platform cpu --preset tiny` tries the script on a machine without a GPU (CPU figures, labelled).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.common import GiB  # noqa: E402
from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.runner import PlanError, plan, run  # noqa: E402


def gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--platform", default="gpu")
    args = parser.parse_args()
    model = {"seq_len": args.seq} if args.preset != "tiny" else {}
    try:
        p = plan(PlanRequest(workload="llama", preset=args.preset, model=model, source="tpu-v5p-8",
                             global_batch=args.global_batch, target="local", compile_for_tpu=False, timeout_s=1800))
    except PlanError as exc:
        print(f"planning failed: {exc}")
        return 1
    print(f"plan ({p.prediction_method}, {p.search_seconds:.0f} s, {p.compiles} compiles): {p.status}, "
          f"{p.per_device_batch} per device x {p.accumulation_steps} accumulation, {p.precision}, remat {p.remat}, "
          f"attention {p.model.get('attention')}, predicted peak {gib(p.predicted_peak_bytes)} GiB of a "
          f"{gib(p.budget_bytes)} GiB budget on {p.target_name}")
    if not p.ok:
        print(p.message)
        return 1
    print(f"{'state':<11} {'peak GiB (measured)':>20} {'predicted GiB':>14} {'tokens/s':>12} {'MFU':>7} "
          f"{'step ms':>9}  status")
    status = 0
    for sharding in ("replicated", "fsdp"):
        r = run(RunConfig(workload="llama", preset=args.preset, model=p.model, per_device_batch=p.per_device_batch,
                          accumulation_steps=p.accumulation_steps, precision=p.precision, remat=p.remat,
                          sharding=sharding, steps=args.steps, warmup_steps=min(3, args.steps - 1),
                          platform=args.platform, memory_fraction=p.memory_fraction, timeout_s=1800))
        mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
        tokens = "n/a" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        step = "n/a" if r.step_ms_median is None else f"{r.step_ms_median:.1f}"
        print(f"{sharding:<11} {gib(r.peak_memory_bytes):>20} {gib(p.predicted_peak_bytes):>14} {tokens:>12} "
              f"{mfu:>7} {step:>9}  {r.status}{'' if r.ok else ' (' + str(r.failure_kind) + ': ' + r.message[:200] + ')'}")
        status |= 0 if r.ok else 1
    print(f"measured on {r.device_kind} ({r.backend} backend), JAX {r.jax_version}; peak: {r.peak_memory_source}; "
          f"MFU against {r.peak_tflops_source}")
    return status


if __name__ == "__main__":
    sys.exit(main())
