"""GPU check for speed: gpt2-small and gpt2-medium in bf16 at the planned batch on the local GPU.

For each model: plan it for this machine (`--target local`), then run the planned batch with
- XLA attention vs cuDNN's fused attention (remat none; `none` falls back to the plan's policy if it
  does not fit),
- remat none, a middle policy (save_dot_except_mlp) and full (cuDNN attention),
printing tokens/s, MFU against the datasheet's dense bf16 peak, step time and measured peak memory.
Then autotune the medium plan's top 3 ranked choices and compare its pick with the planner's first.

MFU counts model FLOPs only: 6 x matmul parameters per token plus attention's 12 x layers x d_model x
seq per token (the full T x T products, causal masking not subtracted); recomputation by remat is
not counted, so MFU is comparable across policies. Target: 50% for gpt2-medium.

Runs without gradio, from the working tree, in under 8 minutes on an H200:

    python bench/gpu_check_mfu.py [--steps 8] [--models gpt2-small,gpt2-medium]

`--platform cpu --models tiny` tries the script on a machine without a GPU (CPU figures, labelled).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.service.autotune import AutotuneRefused, AutotuneSettings, run_autotune  # noqa: E402
from migration.common import GiB  # noqa: E402
from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.runner import PlanError, plan, run  # noqa: E402


def row(label: str, r) -> str:
    mfu = "n/a" if r.mfu is None else f"{100 * r.mfu:.1f}%"
    tokens = "n/a" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
    step = "n/a" if r.step_ms_median is None else f"{r.step_ms_median:.1f}"
    peak = "n/a" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / GiB:.2f}"
    tail = "" if r.ok else f" ({r.failure_kind}: {r.message[:160]})"
    return f"{label:<40} {tokens:>12} {mfu:>7} {step:>9} {peak:>9}  {r.status}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="gpt2-small,gpt2-medium")
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--platform", default="gpu")
    args = parser.parse_args()
    status = 0
    for preset in args.models.split(","):
        try:
            p = plan(PlanRequest(workload="transformer", preset=preset, global_batch=args.global_batch, target="local",
                                 precision="bf16" if args.platform == "gpu" else None, compile_for_tpu=False,
                                 timeout_s=1200))
        except PlanError as exc:
            print(f"{preset}: planning failed: {exc}")
            status = 1
            continue
        print(f"\n== transformer/{preset}: plan ({p.prediction_method}, {p.compiles} compiles, {p.search_seconds:.0f} s) "
              f"{p.status}: {p.per_device_batch} per device x {p.accumulation_steps}, {p.precision}, remat {p.remat}, "
              f"attention {p.model.get('attention')}, predicted {p.predicted_peak_bytes / GiB:.2f} of "
              f"{p.budget_bytes / GiB:.2f} GiB; predicted step {p.predicted_step_s}")
        if not p.ok:
            print(p.message)
            status = 1
            continue
        print(f"{'run':<40} {'tokens/s':>12} {'MFU':>7} {'step ms':>9} {'peak GiB':>9}  status")
        attention = p.model.get("attention", "xla")
        cases = [(f"attention xla, remat {p.remat}", "xla", p.remat)]
        if attention == "cudnn":
            cases.append((f"attention cudnn, remat {p.remat}", "cudnn", p.remat))
        cases += [(f"attention {attention}, remat {r}", attention, r)
                  for r in ("none", "save_dot_except_mlp", "full") if r != p.remat]
        last = None
        for label, attn, remat in cases:
            last = run(RunConfig(workload="transformer", preset=preset, model={**p.model, "attention": attn},
                                 per_device_batch=p.per_device_batch, accumulation_steps=1, precision=p.precision,
                                 remat=remat, steps=args.steps, warmup_steps=3, platform=args.platform,
                                 memory_fraction=p.memory_fraction, timeout_s=900))
            print(row(label, last), flush=True)
        if last is not None:
            print(f"measured on {last.device_kind} ({last.backend} backend), JAX {last.jax_version}; MFU against "
                  f"{last.peak_tflops_source}; one micro-batch per step (accumulation 1)")
        if preset == args.models.split(",")[-1]:
            try:
                result = run_autotune(p, AutotuneSettings(top=3, warmup_steps=2, timed_steps=4, timeout_s=900))
            except AutotuneRefused as exc:
                print(f"autotune refused: {exc}")
                continue
            print(f"autotune ({result.measured_on}): {result.verdict}")
    return status


if __name__ == "__main__":
    sys.exit(main())
