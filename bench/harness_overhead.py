"""Harness overhead: the runner's measured steps/s against a minimal hand-written jit loop.

Both run the same model, batch and precision in fresh processes with the same JAX environment,
alternating (runner, minimal, runner, minimal, ...) so that drift on a shared machine hits both;
the best of the repeats of each is compared. Target: ratio >= 0.97 on the CPU for the tiny and
small transformer presets.

    python bench/harness_overhead.py [--repeats 3] [--platform cpu]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from migration.config.requests import RunConfig  # noqa: E402
from migration.running.worker_env import worker_environment  # noqa: E402
from migration.running.runner import run  # noqa: E402

CASES = [  # (workload, preset, batch, precision, steps, warmup)
    ("transformer", "tiny", 8, "fp32", 200, 10),
    ("transformer", "small", 2, "fp32", 12, 2),
]


def minimal_steps_per_s(cfg: RunConfig, steps: int, warmup: int) -> float:
    env = worker_environment(cfg)
    args = [sys.executable, str(ROOT / "bench" / "minimal_loop.py"), cfg.workload, cfg.preset,
            str(cfg.per_device_batch), cfg.precision, str(steps), str(warmup)]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(out.stdout.strip().splitlines()[-1])["steps_per_s"]


def runner_steps_per_s(cfg: RunConfig) -> float:
    report = run(cfg)
    if not report.ok:
        raise SystemExit(f"runner failed: {report.failure_kind}: {report.message}\n{report.stderr_tail}")
    return report.samples_per_s / report.global_batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--platform", default="cpu", choices=["cpu", "gpu", "auto"])
    parser.add_argument("--only", default="", help="run only cases whose preset contains this text")
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/harness_overhead.json)")
    args = parser.parse_args()
    rows = []
    print(f"{'case':<28} {'runner steps/s':>15} {'minimal steps/s':>16} {'ratio':>7}")
    for workload, preset, batch, precision, steps, warmup in CASES:
        if args.only and args.only not in preset:
            continue
        cfg = RunConfig(workload=workload, preset=preset, per_device_batch=batch, precision=precision,
                        steps=steps + warmup, warmup_steps=warmup, platform=args.platform, timeout_s=3600)
        runner, minimal = [], []
        for _ in range(args.repeats):
            runner.append(runner_steps_per_s(cfg))
            minimal.append(minimal_steps_per_s(cfg, steps, warmup))
        ratio = max(runner) / max(minimal)
        name = f"{workload}/{preset} b{batch} {precision}"
        print(f"{name:<28} {max(runner):>15.2f} {max(minimal):>16.2f} {ratio:>7.3f}", flush=True)
        rows.append([name, f"{max(runner):.2f}", f"{max(minimal):.2f}", f"{ratio:.3f}"])
    print(f"(best of {args.repeats} alternating repeats each; platform {args.platform}; target ratio >= 0.97)")
    record.write(args.json, "harness_overhead", [record.table(
        f"The runner against a minimal jax.jit loop of the same model, best of {args.repeats} alternating repeats, "
        f"platform {args.platform} (target ratio >= 0.97)",
        ["case", "runner steps/s", "minimal steps/s", "ratio"], rows)])


if __name__ == "__main__":
    main()
