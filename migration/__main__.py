"""Command line: `python -m migration {run,env}`. Formats the backend's results; decides nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from migration.config import (
    GRANULARITIES,
    LIMITS,
    PLATFORMS,
    PRECISIONS,
    REMAT_NAMES,
    ConfigError,
    PlanRequest,
    RunConfig,
)

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
    run.add_argument("--plan", metavar="PLAN_JSON",
                     help="run a plan made by `plan` (its batch, accumulation, precision and remat replace those flags)")

    chk = sub.add_parser("check", help="read Python files (never run them) for TPU-specific or outdated JAX")
    chk.add_argument("files", nargs="+", metavar="FILE.py")
    chk.add_argument("--json", metavar="PATH", help="write the findings as JSON")
    chk.add_argument("--csv", metavar="PATH", help="write the findings as CSV, one row per finding")

    from migration.hardware import GPU_SPECS, TPU_SPECS

    p = PlanRequest()
    pl = sub.add_parser("plan", help="plan a TPU-style setup for a GPU: batch, precision, remat, accumulation, environment")
    pl.add_argument("--workload", default=p.workload)
    pl.add_argument("--preset", default=p.preset)
    pl.add_argument("--source", default=p.source, help=f"TPU source: {', '.join(TPU_SPECS)}")
    pl.add_argument("--global-batch", dest="global_batch", type=int, default=p.global_batch)
    pl.add_argument("--per-core-batch", dest="per_core_batch", type=int, default=None,
                    help="the TPU setup's per-core batch (default: global batch / TPU devices)")
    pl.add_argument("--source-precision", dest="source_precision", default=p.source_precision, choices=["bf16", "fp32"])
    pl.add_argument("--target", default=p.target, help=f"GPU target: local, {', '.join(GPU_SPECS)}")
    pl.add_argument("--gpus", type=int, default=p.gpus)
    pl.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=p.memory_fraction,
                    help="share of each GPU the job may use (default 0.8)")
    pl.add_argument("--safety-margin", dest="safety_margin", type=float, default=p.safety_margin,
                    help="share of that budget kept free (default 0.1)")
    pl.add_argument("--granularity", choices=GRANULARITIES, default=p.granularity,
                    help="per-device batch as a multiple of 8 or a power of two")
    pl.add_argument("--max-batch", dest="max_per_device_batch", type=int, default=p.max_per_device_batch)
    pl.add_argument("--precision", choices=PRECISIONS, default=None, help="override the precision decision")
    pl.add_argument("--remat", choices=REMAT_NAMES, default=None, help="override the remat decision")
    pl.add_argument("--accum", dest="accumulation_steps", type=int, default=None, help="override the accumulation steps")
    pl.add_argument("--no-tpu-compile", dest="compile_for_tpu", action="store_false",
                    help="do not try to compile the TPU-style setup for the source TPU")
    pl.add_argument("--timeout", dest="timeout_s", type=float, default=p.timeout_s)
    pl.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    pl.add_argument("--quiet", action="store_true", help="no progress lines")
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


def _config_from_plan(args: argparse.Namespace, cfg: RunConfig) -> RunConfig | None:
    from migration.plan import Plan
    from migration.runner import PlanError, run_config_for_plan

    try:
        saved = Plan.from_json(args.plan)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"error: --plan {args.plan}: not a readable plan ({exc})", file=sys.stderr)
        return None
    try:
        cfg, note = run_config_for_plan(saved, cfg)
    except (PlanError, ConfigError) as exc:
        print(f"error: --plan {args.plan}: {exc}", file=sys.stderr)
        return None
    print(f"note: {note}.")
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    from migration.report import write_csv
    from migration.runner import start_run

    fields = {f.name for f in dataclasses.fields(RunConfig)}
    cfg = RunConfig(**{k: v for k, v in vars(args).items() if k in fields})
    if args.plan:
        cfg = _config_from_plan(args, cfg)
        if cfg is None:
            return 2
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


def print_plan(plan: Any) -> None:
    print(f"\n{plan.workload}/{plan.preset}: {plan.source_name} (global batch {plan.requested_global_batch}, "
          f"{plan.source_per_core_batch} per core, {plan.source_precision}) -> {plan.gpus} x {plan.target_name}")
    print(f"memory budget per GPU: {_fmt_bytes(plan.budget_bytes)} ({plan.memory_fraction:.0%} of "
          f"{_fmt_bytes(plan.device_memory_bytes)}, minus a {plan.safety_margin:.0%} margin)")
    print(f"prediction: {plan.prediction_method} -- {plan.prediction_note}")
    if plan.status != "ok":
        print(f"\nNOT FEASIBLE: {plan.message}")
        return
    print(f"\nplan: {plan.per_device_batch} per GPU x {plan.gpus} GPU(s) x {plan.accumulation_steps} accumulation "
          f"= global batch {plan.global_batch}{'' if plan.global_batch_exact else ' (NOT the requested ' + str(plan.requested_global_batch) + ')'}, "
          f"{plan.precision}, remat {plan.remat}; predicted peak {_fmt_bytes(plan.predicted_peak_bytes)} per GPU")
    for d in plan.decisions:
        print(f"  {d.decision:<20} {str(d.value):<14} {d.reason}")
    print("largest batch per remat policy: " + ", ".join(f"{k} {v}" for k, v in plan.max_batch_by_remat.items()))
    print(f"the TPU-style setup on this target: {plan.tpu_setup_on_target.get('summary', 'n/a')}")
    src = plan.source_tpu_compile
    if src.get("status") == "ok":
        print(f"on the source TPU ({src['device_kind']}): {_fmt_bytes(src['peak_bytes_per_chip'])} per device "
              f"of {_fmt_bytes(src['hbm_bytes_per_device'])}; the plan uses {_fmt_bytes(plan.predicted_peak_bytes)} per GPU")
    elif src.get("status") == "does-not-fit":
        print(f"on the source TPU ({src['device_kind']}): the TPU compiler says this setup does not fit its "
              f"{_fmt_bytes(src['hbm_bytes_per_device'])} per device: {src['reason']}")
    else:
        print(f"source TPU compile: {src.get('status')} ({src.get('reason', '')})")
    print(f"rule of thumb (the guide): batch {plan.rule_of_thumb_batch} -- {plan.rule_of_thumb_note}")
    print(f"matmul precision: TPU {plan.matmul_precision['tpu']}; GPU {plan.matmul_precision['gpu']}")
    print("environment for the target:")
    for name, item in plan.environment.items():
        print(f"  {name}={item['value']}    # {item['why']}")
    print(f"search: {plan.compiles} compile(s), {plan.cache_hits} cache hit(s), {plan.search_seconds:.1f} s")


def cmd_plan(args: argparse.Namespace) -> int:
    from migration.runner import PlanError, start_plan

    fields = {f.name for f in dataclasses.fields(PlanRequest)}
    req = PlanRequest(**{k: v for k, v in vars(args).items() if k in fields})
    try:
        handle = start_plan(req)
    except ConfigError as exc:
        print(f"error: invalid plan request: {exc}", file=sys.stderr)
        return 2

    def progress(ev: dict[str, Any]) -> None:
        if args.quiet:
            return
        if ev["event"] == "plan_started":
            print(f"planning by {ev['method']}: budget {_fmt_bytes(ev['budget_bytes'])} per GPU", flush=True)
        elif ev["event"] == "candidate":
            fit = "-" if ev["predicted_bytes"] is None else _fmt_bytes(ev["predicted_bytes"])
            print(f"  batch {ev['per_device_batch']:>5} remat {ev['remat']:<13} x{ev['accumulation_steps']} accum: "
                  f"{fit}{' (cached)' if ev['cached'] else ''}  [{ev['seconds']:.1f} s]", flush=True)

    try:
        result = handle.wait(progress)
    except PlanError as exc:
        print(f"error: planning {exc.kind}: {exc}", file=sys.stderr)
        if exc.kind == "crashed" and exc.stderr_tail:
            print("--- planner stderr (tail) ---\n" + exc.stderr_tail[-2000:], file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        handle.cancel()
        return 130
    print_plan(result)
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}")
    return 0 if result.status == "ok" else 1


def cmd_check(args: argparse.Namespace) -> int:
    import csv

    from migration.codecheck import CodeCheckError, check_files, has_errors
    from migration.report import csv_cell

    try:
        findings = check_files(args.files)
    except (CodeCheckError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for f in findings:
        print(f"{f.file}:{f.line}:{f.col}: {f.severity} {f.rule} {f.message}\n    write instead: {f.replacement}")
    counts = {sev: sum(f.severity == sev for f in findings) for sev in ("error", "warning", "info")}
    if findings:
        print(f"\n{len(findings)} finding(s): " + ", ".join(f"{n} {sev}" for sev, n in counts.items() if n))
    else:
        print(f"no findings in {len(args.files)} file(s)")
    rows = [f.to_dict() for f in findings]
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=2)
    if args.csv:
        with open(args.csv, "w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=["file", "line", "col", "rule", "severity", "message", "replacement"],
                                    lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: csv_cell(v) for k, v in row.items()} for row in rows)
    return 1 if has_errors(findings) else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"run": cmd_run, "env": cmd_env, "plan": cmd_plan, "check": cmd_check}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
