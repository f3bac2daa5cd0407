"""GPU check for fp8 training: bf16 against the GPU's fp8 policy on the same model, batch and steps.

1. Plan the Llama 3.2 1B layout for this machine (`--target local`) in bf16, then compile the chosen
   step in the GPU's fp8 policy too (`allow_fp8`: mxfp8 on Blackwell, fp8 on Ada and Hopper): the plan
   says which is predicted faster and by how much.
2. Run the chosen choice in bf16 and in the fp8 policy, side by side on the same data, and print each
   one's measured step (median) against its prediction, the measured fp8 / bf16 step ratio against the
   predicted one, and the final losses' gap (the numerics item's test: within 2%).

Runs without gradio, from the working tree, in a few minutes on an H100, H200 or B200:

    python bench/gpu_check_fp8.py [--steps 30] [--seq 2048] [--global-batch 32]

`--platform cpu --preset tiny` tries the script on a machine without a GPU (fp8 emulated there: the
ratio is not the GPU's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.runner import PlanError, plan, run  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--platform", default="gpu")
    args = parser.parse_args()
    model = {"seq_len": args.seq} if args.preset != "tiny" else {}
    try:
        p = plan(PlanRequest(workload="llama", preset=args.preset, model=model, global_batch=args.global_batch,
                             target="local", compile_for_tpu=False, allow_fp8=args.platform == "gpu",
                             precision=None if args.platform == "gpu" else "fp8", timeout_s=1800))
    except PlanError as exc:
        print(f"planning failed: {exc}")
        return 1
    fp8 = next((d for d in p.decisions if d.decision == "fp8"), None)
    print(f"plan: {p.status}, {p.precision}, {p.per_device_batch} per device x {p.accumulation_steps}, remat "
          f"{p.remat}, predicted step {p.predicted_step_s}; fp8: {fp8.reason if fp8 else 'forced (CPU try-out)'}")
    if not p.ok:
        return 1
    recipe = p.precision if p.precision in ("fp8", "mxfp8") else (p.step_time or {}).get("other_precision") or "fp8"
    if recipe not in ("fp8", "mxfp8"):
        recipe = "mxfp8" if "block-scaled" in (fp8.reason if fp8 else "") else "fp8"
    runs = {}
    for precision in ("bf16", recipe):
        runs[precision] = r = run(RunConfig(
            workload="llama", preset=args.preset, model=p.model, per_device_batch=p.per_device_batch,
            accumulation_steps=p.accumulation_steps, precision=precision, remat=p.remat, steps=args.steps,
            warmup_steps=min(3, args.steps - 1), platform=args.platform, memory_fraction=p.memory_fraction,
            timeout_s=1800))
        step = "n/a" if r.step_ms_median is None else f"{r.step_ms_median:.1f} ms"
        print(f"{precision:<6} measured step {step}, loss {r.losses[-1] if r.losses else 'n/a'}, {r.status}"
              + ("" if r.ok else f" ({r.failure_kind}: {r.message[:200]})"))
    a, b = runs["bf16"], runs[recipe]
    if not (a.ok and b.ok and a.step_ms_median and b.step_ms_median and a.losses and b.losses):
        return 1
    gap = abs(b.losses[-1] - a.losses[-1]) / abs(a.losses[-1])
    print(f"measured {recipe} / bf16 step: {b.step_ms_median / a.step_ms_median:.3f}; final loss gap {gap:.2%} "
          f"(numerics tolerance 2%); measured on {b.device_kind} ({b.backend} backend), JAX {b.jax_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
