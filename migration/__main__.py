"""Command line: `python -m migration {run,env}`. Formats the backend's results; decides nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from migration.config import LIMITS, PLATFORMS, PRECISIONS, REMAT_NAMES, ConfigError, RunConfig

GiB = 2**30


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


_FLAGS = {"per_device_batch": "--batch", "accumulation_steps": "--accum", "warmup_steps": "--warmup",
          "learning_rate": "--lr", "timeout_s": "--timeout", "memory_fraction": "--mem-fraction",
          "visible_devices": "--gpus", "xla_flags": "--xla-flags"}


def _range(field: str) -> str:
    lo, hi = LIMITS[field]
    return f"{lo:g} to {hi:g}"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m migration", description="Explore TPU-to-GPU migration of JAX training jobs.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    env = sub.add_parser("env", help="backend, devices, versions, JAX/XLA variables, GPU memory used by others")
    env.add_argument("--json", metavar="PATH", help="also write the environment as JSON")
    env.add_argument("--platform", choices=PLATFORMS, default="auto")

    d = RunConfig()
    run = sub.add_parser("run", help="run one training config in a fresh worker and measure it")
    run.add_argument("--workload", default=d.workload, help="mlp, cnn or transformer")
    run.add_argument("--preset", default=d.preset, help="size preset of the workload (e.g. tiny, small)")
    run.add_argument("--batch", dest="per_device_batch", type=int, default=d.per_device_batch,
                     help=f"per-device micro-batch ({_range('per_device_batch')})")
    run.add_argument("--devices", type=int, default=d.devices, help="data-parallel devices (on CPU: XLA CPU devices)")
    run.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    run.add_argument("--remat", choices=REMAT_NAMES, default=d.remat, help="rematerialisation policy per block")
    run.add_argument("--accum", dest="accumulation_steps", type=int, default=d.accumulation_steps,
                     help="gradient-accumulation micro-batches per optimizer step")
    run.add_argument("--steps", type=int, default=d.steps)
    run.add_argument("--warmup", dest="warmup_steps", type=int, default=d.warmup_steps, help="steps excluded from timing")
    run.add_argument("--lr", dest="learning_rate", type=float, default=d.learning_rate)
    run.add_argument("--seed", type=int, default=d.seed)
    run.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s, help="seconds before the run is stopped")
    run.add_argument("--platform", choices=PLATFORMS, default=d.platform)
    run.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=d.memory_fraction,
                     help="XLA_PYTHON_CLIENT_MEM_FRACTION for the worker")
    run.add_argument("--preallocate", action="store_true", help="let JAX preallocate its GPU memory pool")
    run.add_argument("--xla-flags", default=d.xla_flags, help="extra XLA_FLAGS for the worker")
    run.add_argument("--gpus", dest="visible_devices", default=d.visible_devices, help="CUDA_VISIBLE_DEVICES, e.g. 0,1")
    run.add_argument("--json", metavar="PATH", help="write the report as JSON")
    run.add_argument("--csv", metavar="PATH", help="write the report as a one-row CSV")
    run.add_argument("--quiet", action="store_true", help="no per-step progress")
    return parser


def _fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.3f} GiB"


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_summary(r: Any) -> None:
    print(f"\n{r.workload}/{r.preset}  {r.precision}  remat={r.remat}  batch {r.per_device_batch} x "
          f"{r.devices} device(s) x {r.accumulation_steps} accum = global {r.global_batch}")
    if r.backend:
        print(f"measured on: {r.device_kind} x{r.device_count} ({r.backend} backend), JAX {r.jax_version}, host {r.host}")
    if r.backend == "cpu":
        print("note: CPU backend. These are CPU figures; no GPU was measured.")
    rows = [
        ("status", r.status if r.ok else f"{r.status} ({r.failure_kind})"),
        ("compile", _fmt(r.compile_s, ".2f", " s")),
        ("step time median / p90", f"{_fmt(r.step_ms_median, '.2f')} / {_fmt(r.step_ms_p90, '.2f')} ms"),
        ("samples/s", _fmt(r.samples_per_s, ",.1f")),
        ("tokens/s", _fmt(r.tokens_per_s, ",.0f")),
        ("achieved TFLOP/s", _fmt(r.achieved_tflops, ".3f")),
        ("MFU", _fmt(r.mfu * 100 if r.mfu is not None else None, ".1f", " %") + (f"  (peak: {r.peak_tflops_source})" if r.peak_tflops_source else "")),
        ("peak memory", f"{_fmt_bytes(r.peak_memory_bytes)}  ({r.peak_memory_source})"),
        ("predicted (compiled)", _fmt_bytes(r.predicted_peak_bytes)),
        ("process peak RSS", _fmt_bytes(r.process_peak_rss_bytes)),
        ("recompilations", _fmt(r.recompilations, "d")),
        ("fp32 matmul precision", r.fp32_matmul_precision or "n/a"),
        ("loss first -> last", f"{_fmt(r.loss_first, '.4f')} -> {_fmt(r.loss_last, '.4f')}"),
    ]
    if r.precision == "fp16":
        rows.append(("skipped steps / loss scale", f"{r.skipped_steps} / {_fmt(r.final_loss_scale, 'g')}"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def cmd_run(args: argparse.Namespace) -> int:
    from migration.report import write_csv
    from migration.runner import start_run

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    cfg = RunConfig(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        handle = start_run(cfg)
    except ConfigError as exc:
        flag = _FLAGS.get(exc.field)
        print(f"error: invalid config: {exc}" + (f" (flag {flag})" if flag else ""), file=sys.stderr)
        return 2

    def progress(ev: dict[str, Any]) -> None:
        if args.quiet:
            return
        kind = ev["event"]
        if kind == "started":
            print(f"started on {ev['device_kind']} x{ev['device_count']} ({ev['backend']}), JAX {ev['jax_version']}, "
                  f"{ev['param_count']:,} parameters", flush=True)
        elif kind == "compiled":
            print(f"compiled in {ev['compile_s']:.2f} s; predicted peak {_fmt_bytes(ev['predicted_peak_bytes'])} per device", flush=True)
        elif kind == "step":
            loss = ev["loss"]
            loss_s = f"{loss:.4f}" if isinstance(loss, float) else str(loss)
            print(f"step {ev['index'] + 1:>5}/{cfg.steps}  loss {loss_s}  {ev['step_ms']:.2f} ms"
                  + ("  (skipped: non-finite gradients)" if ev.get("skipped") else ""), flush=True)

    try:
        report = handle.wait(progress)
    except KeyboardInterrupt:
        handle.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    print_summary(report)
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv([report], args.csv)
        print(f"wrote {args.csv}")
    if not report.ok:
        print(f"error: run {report.failure_kind}: {report.message}", file=sys.stderr)
        if report.failure_kind == "crashed" and report.stderr_tail:
            print("--- worker stderr (tail) ---\n" + report.stderr_tail[-2000:], file=sys.stderr)
        return 1
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from migration.runner import probe_environment

    try:
        info = probe_environment(RunConfig(platform=args.platform, timeout_s=120))
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"backend: {info['backend']}  ({info['device_count']} device(s))")
    for dev in info["devices"]:
        print(f"  device {dev['id']}: {dev['kind']} [{dev['platform']}]")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    print("JAX/XLA environment of a worker:")
    for k, v in info["env"].items():
        print(f"  {k}={v}")
    if info["nvidia_gpus"]:
        print("NVIDIA GPUs (NVML):")
        for g in info["nvidia_gpus"]:
            print(f"  {g['index']}: {g['name']}  total {_fmt_bytes(g['total_bytes'])}, used {_fmt_bytes(g['used_bytes'])}, "
                  f"by other processes {_fmt_bytes(g['used_by_other_processes_bytes'])}")
    else:
        print("NVIDIA GPUs (NVML): none found")
    for w in info["warnings"]:
        print(f"warning: {w}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"run": cmd_run, "env": cmd_env}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
