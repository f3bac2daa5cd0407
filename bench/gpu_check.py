"""GPU check: measured runs of the gpt2-small transformer on the local NVIDIA GPU, plus an OOM.

Runs without gradio, from the working tree. Prints one table row per run: measured peak memory
(memory_stats), the compiled prediction, step time, tokens/s and MFU against the datasheet peak.
The OOM row must say `oom`, and the run after it must succeed (the worker process isolates it).

    python bench/gpu_check.py [--steps 15]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from migration.config.requests import RunConfig  # noqa: E402
from migration.running.runner import run  # noqa: E402

from migration.common import GiB  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--platform", default="gpu")
    parser.add_argument("--preset", default="gpt2-small", help="a smaller preset tries the script on a CPU")
    args = parser.parse_args()
    base = dict(workload="transformer", preset=args.preset, precision="bf16", steps=args.steps,
                warmup_steps=min(3, args.steps - 1), platform=args.platform, timeout_s=240)
    cases = [
        (f"{args.preset} bf16 none b8", dict(per_device_batch=8, remat="none")),
        (f"{args.preset} bf16 full b8", dict(per_device_batch=8, remat="full")),
        (f"{args.preset} bf16 none b32", dict(per_device_batch=32, remat="none")),
        (f"{args.preset} bf16 full b32", dict(per_device_batch=32, remat="full")),
        (f"{args.preset} bf16 none b2048 (must OOM)",
         dict(per_device_batch=2048, remat="none", steps=2, warmup_steps=0)),  # migration: ignore[BATCH001] this run must run out of memory
        ("after the OOM: b8 full", dict(per_device_batch=8, remat="full")),
    ]
    header = f"{'run':<40} {'status':<8} {'peak GiB':>9} {'pred GiB':>9} {'compile s':>9} {'step ms':>8} {'p90 ms':>8} {'tokens/s':>10} {'MFU':>6}"
    print(header)
    print("-" * len(header))
    failures = 0
    for name, change in cases:
        t0 = time.time()
        r = run(RunConfig(**{**base, **change}))
        status = "ok" if r.ok else r.failure_kind
        fmt = lambda v, s: "-" if v is None else format(v, s)
        measured = r.peak_memory_bytes if r.backend == "gpu" else None  # a CPU run has no measured device peak
        print(f"{name:<40} {status:<8} {fmt(measured and measured / GiB, '9.2f')} "
              f"{fmt(r.predicted_peak_bytes and r.predicted_peak_bytes / GiB, '9.2f')} {fmt(r.compile_s, '9.1f')} "
              f"{fmt(r.step_ms_median, '8.1f')} {fmt(r.step_ms_p90, '8.1f')} {fmt(r.tokens_per_s, '10,.0f')} "
              f"{fmt(r.mfu and 100 * r.mfu, '5.1f')}%  [{time.time() - t0:.0f}s]", flush=True)
        expected_oom = "must OOM" in name
        if (expected_oom and r.failure_kind != "oom") or (not expected_oom and not r.ok):
            failures += 1
            print(f"  unexpected: {r.failure_kind}: {r.message}\n{r.stderr_tail[-1500:]}", flush=True)
        if r.ok and r.recompilations:
            failures += 1
            print(f"  unexpected: {r.recompilations} recompilations after the first step")
    first = r.device_kind if r.device_kind else "unknown device"
    print(f"\nmeasured on {first}, JAX {r.jax_version}; peak = memory_stats peak_bytes_in_use (shown only for runs "
          "on a GPU), pred = compiled memory_analysis; MFU against the datasheet dense bf16 peak")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
