"""Command line: `python -m migration {env,run,plan,check,autotune}`. Formats the backend's results; decides nothing."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sqlite3
import sys
from typing import Any

from migration.config import (
    GRANULARITIES,
    LIMITS,
    PLATFORMS,
    PRECISIONS,
    REMAT_NAMES,
    SHARDINGS,
    STEP_STYLES,
    ConfigError,
    PlanRequest,
    RunConfig,
)

from migration.common import fmt_gib, fmt_loss, fmt_model, write_csv


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


_FLAGS = {"per_device_batch": "--batch", "accumulation_steps": "--accum", "warmup_steps": "--warmup",
          "learning_rate": "--lr", "timeout_s": "--timeout", "memory_fraction": "--mem-fraction",
          "visible_devices": "--visible-devices", "xla_flags": "--xla-flags",
          "save_checkpoint": "--save-checkpoint", "restore_checkpoint": "--restore-checkpoint",
          "coordinator": "--coordinator", "num_processes": "--num-processes", "process_id": "--process-id"}


# Model dimension flags -> the workload config's fields (transformer families).
MODEL_FLAGS = {"layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "kv_heads": "n_kv_heads",
               "d_ff": "d_ff", "vocab": "vocab_size", "seq": "seq_len"}


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    from workloads.transformer import DIM_LIMITS

    group = parser.add_argument_group("model dimensions (override the preset's; transformer and llama)")
    for flag, field in MODEL_FLAGS.items():
        lo, hi = DIM_LIMITS[field]
        group.add_argument(f"--{flag.replace('_', '-')}", dest=f"dim_{flag}", type=int, default=None, metavar="N",
                           help=f"{field} ({lo} to {hi})")
    tied = group.add_mutually_exclusive_group()
    tied.add_argument("--tied", dest="dim_tied", action="store_const", const=True, default=None,
                      help="output projection shares the input embedding")
    tied.add_argument("--untied", dest="dim_tied", action="store_const", const=False,
                      help="a separate output projection")


def _add_distributed_flags(parser: argparse.ArgumentParser, d: RunConfig) -> None:
    group = parser.add_argument_group("one job across several processes, one per host or per GPU (jax.distributed; "
                                      "--devices is then the job's global device count)")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--coordinator", default=d.coordinator, metavar="HOST:PORT",
                       help="process 0's host and a free port there, the same for every process of the job")
    where.add_argument("--distributed", dest="coordinator", choices=["auto"],
                       help="auto: JAX detects the cluster (under srun, SLURM; under mpirun, Open MPI) and gives this "
                            "process its id, the process count and the coordinator (same as --coordinator auto)")
    group.add_argument("--num-processes", dest="num_processes", type=int, default=d.num_processes, metavar="N",
                       help=f"processes in the job ({_range('num_processes')}; with --coordinator HOST:PORT)")
    group.add_argument("--process-id", dest="process_id", type=int, default=d.process_id, metavar="I",
                       help="this process's id, 0 to N-1; process 0 runs at HOST and writes the reports")


PRESET_HELP = ("size preset of the workload (default tiny; with dimension flags, the family's full-size layout they "
               "change: llama 8b, transformer gpt2-small)")


def _model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dimension flags given, and the preset they apply to (`args.preset` is set when it was None).
    Flags equal to the preset's own value are dropped, so a plan names only what differs."""
    out = {field: getattr(args, f"dim_{flag}") for flag, field in MODEL_FLAGS.items()
           if getattr(args, f"dim_{flag}") is not None}
    if args.dim_tied is not None:
        out["tied_embeddings"] = args.dim_tied
    if args.preset is not None and not out:
        return out
    from workloads import WORKLOADS, resolve_workload

    try:
        workload = resolve_workload(args.workload)
    except (KeyError, ValueError):
        args.preset = args.preset or "tiny"  # validation names the unknown workload
        return out
    args.preset = args.preset or (workload.custom_base if out else "tiny")
    base = workload.presets.get(args.preset)
    if base is None or args.workload not in WORKLOADS:
        return out
    return {k: v for k, v in out.items() if getattr(base, k, object()) != v}


def _folder(text: str) -> str:
    """A folder flag as an absolute path (the worker starts in another directory); empty stays empty."""
    import os

    return os.path.abspath(text) if text else ""


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
    run.add_argument("--workload", default=d.workload,
                     help="a registered workload (mlp, cnn, transformer, llama, or a team's), or package.module:NAME")
    run.add_argument("--preset", default=None, help=PRESET_HELP)
    run.add_argument("--batch", dest="per_device_batch", type=int, default=d.per_device_batch,
                     help=f"per-device micro-batch ({_range('per_device_batch')})")
    run.add_argument("--devices", type=int, default=d.devices, help="data-parallel devices (on CPU: XLA CPU devices)")
    run.add_argument("--sharding", choices=SHARDINGS, default=d.sharding,
                     help="replicated state, or parameters, gradients and optimizer state sharded over the devices (fsdp)")
    run.add_argument("--step-style", dest="step_style", choices=STEP_STYLES, default=d.step_style,
                     help="jit: the migrated step; pmap: the TPU-era step (pmap + lax.pmean, replicated state)")
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
    run.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=None,
                     help=f"XLA_PYTHON_CLIENT_MEM_FRACTION for the worker (default {d.memory_fraction}; with --plan, "
                          "the plan's memory share)")
    run.add_argument("--preallocate", action="store_true", help="let JAX preallocate its GPU memory pool")
    run.add_argument("--xla-flags", default=d.xla_flags, help="extra XLA_FLAGS for the worker")
    run.add_argument("--visible-devices", dest="visible_devices", default=d.visible_devices,
                     help="CUDA_VISIBLE_DEVICES for the worker, e.g. 0,1 (the device count is --devices)")
    run.add_argument("--save-checkpoint", dest="save_checkpoint", type=_folder, default=None, metavar="DIR",
                     help="write the train state (parameters, optimizer state, step) to this folder after the last "
                          "step, with Orbax")
    run.add_argument("--restore-checkpoint", dest="restore_checkpoint", type=_folder, default=None, metavar="DIR",
                     help="start from the train state in this folder (saved on any device count or sharding; it "
                          "must be the same model)")
    _add_distributed_flags(run, d)
    _add_model_flags(run)
    run.add_argument("--json", metavar="PATH", help="write the report as JSON")
    run.add_argument("--csv", metavar="PATH", help="write the report as a one-row CSV")
    run.add_argument("--quiet", action="store_true", help="no per-step progress")
    run.add_argument("--plan", metavar="PLAN_JSON",
                     help="run a plan made by `plan` (its batch, accumulation, precision and remat replace those flags)")
    run.add_argument("--checklist", metavar="CSV", help="with --plan: grade the migration checklist and write it as CSV")
    run.add_argument("--code", nargs="+", metavar="FILE.py", help="with --plan: your training code, for the checklist")
    run.add_argument("--fp32-reference", action="store_true", help="with --plan: also run an fp32 reference (numerics)")
    run.add_argument("--tpu-style", action="store_true", help="with --plan: also run the unchanged TPU-style setup here")
    run.add_argument("--pmap-before", action="store_true",
                     help="with --plan: also run the TPU-era pmap step on the same devices and data (loss, throughput)")
    run.add_argument("--profile", action="store_true", help="with --plan: capture a profile of 3 extra steps")
    run.add_argument("--history-db", metavar="PATH", help="with --plan: record the runs in this history database")
    run.add_argument("--export-dir", metavar="DIR", default="runs/exports",
                     help="with --plan: where the report, checklist and deployment snippet are written")

    chk = sub.add_parser("check", help="read Python files (never run them) for TPU-specific or outdated JAX")
    chk.add_argument("files", nargs="+", metavar="FILE.py")
    chk.add_argument("--json", metavar="PATH", help="write the findings as JSON")
    chk.add_argument("--csv", metavar="PATH", help="write the findings as CSV, one row per finding")

    from migration.hardware import GPU_SPECS, TPU_SPECS

    p = PlanRequest()
    pl = sub.add_parser("plan", help="plan a TPU-style setup for a GPU: batch, precision, remat, accumulation, environment")
    pl.add_argument("--workload", default=p.workload,
                    help="a registered workload (mlp, cnn, transformer, llama, or a team's), or package.module:NAME")
    pl.add_argument("--preset", default=None, help=PRESET_HELP)
    pl.add_argument("--source", default=p.source, help=f"TPU source: {', '.join(TPU_SPECS)}")
    pl.add_argument("--global-batch", dest="global_batch", type=int, default=p.global_batch)
    pl.add_argument("--per-core-batch", dest="per_core_batch", type=int, default=None,
                    help="the TPU setup's per-core batch (default: global batch / TPU devices)")
    pl.add_argument("--source-precision", dest="source_precision", default=p.source_precision, choices=["bf16", "fp32"])
    pl.add_argument("--target", default=p.target, help=f"GPU target: local, {', '.join(GPU_SPECS)}")
    pl.add_argument("--gpus", type=int, default=p.gpus,
                    help="GPUs of the target in all (more than --gpus-per-node: several nodes)")
    pl.add_argument("--gpus-per-node", dest="gpus_per_node", type=int, default=p.gpus_per_node,
                    help=f"GPUs per node (default {p.gpus_per_node})")
    pl.add_argument("--sharding", choices=SHARDINGS, default=None,
                    help="override the state decision: replicated, or fsdp (sharded over the GPUs)")
    pl.add_argument("--source-sharding", dest="source_sharding", choices=SHARDINGS, default=None,
                    help="how the TPU job held its state (default: replicated if it fits a chip, else fsdp)")
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
    _add_model_flags(pl)
    pl.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    pl.add_argument("--quiet", action="store_true", help="no progress lines")

    from migration.autotune import TOP_MAX, AutotuneSettings

    a = AutotuneSettings()
    at = sub.add_parser("autotune", help="measure the plan's fastest predicted fitting choices on its target and pick "
                                         "the fastest measured")
    at.add_argument("--plan", metavar="PLAN_JSON", required=True, help="a plan made by `plan` for this machine's device")
    at.add_argument("--top", type=int, default=a.top, metavar="N",
                    help=f"ranked choices to measure, those that keep the global batch (default {a.top}, at most {TOP_MAX})")
    at.add_argument("--steps", dest="timed_steps", type=int, default=a.timed_steps, metavar="N",
                    help=f"timed steps per choice; the median is its step time (default {a.timed_steps})")
    at.add_argument("--warmup", dest="warmup_steps", type=int, default=a.warmup_steps, metavar="N",
                    help=f"untimed steps before them (default {a.warmup_steps})")
    at.add_argument("--timeout", dest="timeout_s", type=float, default=a.timeout_s, metavar="S",
                    help="seconds before one choice's run is stopped")
    at.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=None, metavar="F",
                    help="XLA_PYTHON_CLIENT_MEM_FRACTION for each run (default: the plan's memory share)")
    at.add_argument("--history-db", metavar="PATH", help="record the runs in this history database")
    at.add_argument("--json", metavar="PATH", help="write the result (rows, verdict, run reports) as JSON")
    at.add_argument("--csv", metavar="PATH", help="write the table as CSV, one row per choice")
    at.add_argument("--quiet", action="store_true", help="no per-step progress")
    au = sub.add_parser("add-user", help="add a user of the app (or change their password) in a users file of "
                                         "salted scrypt hashes, kept private (mode 0600)")
    au.add_argument("users_file", help="the file the app's --auth-file names (created if missing)")
    au.add_argument("user", help="1 to 64 letters, digits and . _ @ -")
    pr = sub.add_parser("prune-history", help="delete finished history entries older than some days (the "
                                              "operator's answer to a full per-user history quota)")
    pr.add_argument("--history-db", required=True, metavar="PATH")
    pr.add_argument("--older-than-days", type=float, required=True, metavar="DAYS")
    pr.add_argument("--user", default=None, help="only this user's entries (default: everyone's)")
    return parser


def _fmt_bytes(n: int | None) -> str:
    return fmt_gib(n, 3)


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def print_summary(r: Any) -> None:
    print(f"\n{r.workload}/{r.preset}{' (' + r.model + ')' if r.model else ''}  {r.precision}  remat={r.remat}  "
          f"batch {r.per_device_batch} x {r.devices} device(s) x {r.accumulation_steps} accum = global "
          f"{r.global_batch}  {r.sharding} state, {r.step_style} step")
    if r.backend:
        print(f"measured on: {r.device_kind} x{r.device_count} ({r.backend} backend), JAX {r.jax_version}, host {r.host}"
              + (f", process {r.process_index} of {r.process_count}" if (r.process_count or 1) > 1 else ""))
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
        ("loss first -> last", f"{fmt_loss(r.loss_first)} -> {fmt_loss(r.loss_last)}"),
    ]
    if r.precision == "fp16":
        rows.append(("skipped steps / loss scale", f"{r.skipped_steps} / {_fmt(r.final_loss_scale, 'g')}"))
    if r.checkpoint_restored:
        rows.append(("restored", r.checkpoint_restored))
    if r.checkpoint_saved:
        rows.append(("saved", f"{r.checkpoint_saved}, {r.checkpoint_saved_bytes:,} bytes"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:<{width}}  {value}")


def _progress_printer(quiet: bool, steps: int):
    from migration.orchestrate import describe

    def progress(ev: dict[str, Any]) -> None:
        if not quiet and ev["event"] in ("started", "compiled", "step"):
            print(describe("run", steps, ev), flush=True)
    return progress


def _write_report(args: argparse.Namespace, report: Any) -> None:
    from migration.report import write_csv as write_report_csv

    if report.process_index:  # another process of a multi-process job: the job's files are process 0's
        print(f"process {report.process_index} of {report.process_count}: process 0 writes the report files")
        return
    if args.json:
        report.to_json(args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_report_csv([report], args.csv)
        print(f"wrote {args.csv}")


def _report_failure(report: Any) -> int:
    if report.ok:
        return 0
    print(f"error: run {report.failure_kind}: {report.message}", file=sys.stderr)
    if report.failure_kind == "crashed" and report.stderr_tail:
        print("--- worker stderr (tail) ---\n" + report.stderr_tail[-2000:], file=sys.stderr)
    return 1


def cmd_run(args: argparse.Namespace) -> int:
    from migration.runner import start_run

    names = {f.name for f in dataclasses.fields(RunConfig)}
    model = _model_overrides(args)
    given = {k: v for k, v in vars(args).items() if k in names and v is not None}
    if model:
        given["model"] = model
    if args.plan:
        return cmd_run_plan(args, given)
    cfg = RunConfig(**given)
    plan_only = [flag for flag, on in (("--checklist", args.checklist), ("--code", args.code),
                                       ("--fp32-reference", args.fp32_reference), ("--tpu-style", args.tpu_style),
                                       ("--pmap-before", args.pmap_before),
                                       ("--profile", args.profile), ("--history-db", args.history_db)) if on]
    if plan_only:
        print(f"error: {plan_only[0]} needs --plan PLAN_JSON (the checklist grades a plan and its run)", file=sys.stderr)
        return 2
    try:
        handle = start_run(cfg)
    except ConfigError as exc:
        flag = _FLAGS.get(exc.field)
        print(f"error: invalid config: {exc}" + (f" (flag {flag})" if flag else ""), file=sys.stderr)
        return 2
    try:
        report = handle.wait(_progress_printer(args.quiet, cfg.steps))
    except KeyboardInterrupt:
        handle.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    print_summary(report)
    _write_report(args, report)
    return _report_failure(report)


def cmd_run_plan(args: argparse.Namespace, given: dict[str, Any]) -> int:
    """`run --plan`: the same runs, history, exports and checklist as the app's Run button. Run
    settings come from the flags; the memory share defaults to the plan's."""
    from pathlib import Path

    from migration.codecheck import CodeCheckError, check_paths
    from migration.history import History
    from migration.orchestrate import RunOptions, base_config, run_plan
    from migration.planfile import read_plan
    from migration.runner import PlanError

    try:
        saved = read_plan(Path(args.plan).read_bytes(), where="--plan")
    except (OSError, ValueError) as exc:
        print(f"error: --plan {args.plan}: not a readable plan ({exc})", file=sys.stderr)
        return 2
    try:
        code = check_paths(args.code) if args.code else None
    except (CodeCheckError, OSError) as exc:
        print(f"error: --code: {exc}", file=sys.stderr)
        return 2
    plan_fields = ("workload", "preset", "model", "per_device_batch", "accumulation_steps", "precision", "remat",
                   "devices", "sharding", "step_style")
    base = base_config(saved, **{k: v for k, v in given.items() if k not in plan_fields})
    options = RunOptions(fp32_reference=args.fp32_reference, tpu_style=args.tpu_style, profile=args.profile,
                         pmap_before=args.pmap_before)
    progress = _progress_printer(args.quiet, base.steps)
    result = None
    try:
        history = History(args.history_db) if args.history_db else None
        events = run_plan(saved, base, options, Path(args.export_dir), code=code, history=history)
        for ev in events:
            if ev["event"] == "note":
                print(f"note: {ev['message']}.")
            elif ev["event"] == "progress":
                progress(ev["worker_event"])
            elif ev["event"] == "result":
                result = ev["result"]
    except ConfigError as exc:
        flag = _FLAGS.get(exc.field)
        print(f"error: invalid config: {exc}" + (f" (flag {flag})" if flag else ""), file=sys.stderr)
        return 2
    except PlanError as exc:
        print(f"error: --plan {args.plan}: {exc}", file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as exc:
        print(f"error: could not record or export the runs: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        events.close()
        print("\ncancelled", file=sys.stderr)
        return 130
    for name, report in result.runs:
        print(f"\n== {name}")
        print_summary(report)
    _write_report(args, result.main)
    print_checklist(result.checklist)
    if args.checklist and not result.main.process_index:
        from migration.checklist import to_csv

        to_csv(result.checklist, args.checklist)
        print(f"wrote {args.checklist}")
    if result.files:
        print("exports: " + ", ".join(f"{k} {v}" for k, v in result.files.items()))
    return _report_failure(result.main)


def print_checklist(items: list[Any]) -> None:
    print("\nmigration checklist:")
    for it in items:
        print(f"  [{it.status:^11}] {it.item}\n      evidence: {it.evidence}\n      action:   {it.action}")


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
    where = (f"{plan.nodes} nodes x {plan.gpus_per_node}" if plan.nodes > 1 else f"{plan.gpus}")
    print(f"\n{plan.workload}/{plan.preset}{' (' + fmt_model(plan.model) + ')' if plan.model else ''}: "
          f"{plan.param_count:,} parameters")
    print(f"{plan.source_name} (global batch {plan.requested_global_batch}, {plan.source_per_core_batch} per core, "
          f"{plan.source_precision}) -> {where} x {plan.target_name}")
    if plan.source_job:
        sj = plan.source_job
        print(f"the TPU job: {sj['devices']} devices of {_fmt_bytes(sj['hbm_bytes_per_device'])}, state {sj['sharding']} "
              f"({_fmt_bytes(sj['state_bytes_per_device'])} per device: {sj['why']})")
    print(f"memory budget per GPU: {_fmt_bytes(plan.budget_bytes)} ({plan.memory_fraction:.0%} of "
          f"{_fmt_bytes(plan.device_memory_bytes)}, minus a {plan.safety_margin:.0%} margin; device memory: "
          f"{plan.budget_source})")
    print(f"prediction: {plan.prediction_method} -- {plan.prediction_note}")
    if plan.status != "ok":
        print(f"\nNOT FEASIBLE: {plan.message}")
        return
    print(f"\nplan: {plan.sharding} state, {plan.per_device_batch} per GPU x {plan.gpus} GPU(s) x "
          f"{plan.accumulation_steps} accumulation "
          f"= global batch {plan.global_batch}{'' if plan.global_batch_exact else ' (NOT the requested ' + str(plan.requested_global_batch) + ')'}, "
          f"{plan.precision}, remat {plan.remat}; predicted peak {_fmt_bytes(plan.predicted_peak_bytes)} per GPU")
    for d in plan.decisions:
        print(f"  {d.decision:<20} {str(d.value):<14} {d.reason}")
    for mode, found in (plan.max_batch_by_sharding or {plan.sharding: plan.max_batch_by_remat}).items():
        print(f"largest batch per remat policy searched ({mode} state): " + ", ".join(f"{k} {v}" for k, v in found.items()))
    st = plan.state
    if st.get("state_with_gradients_bytes_per_gpu") is not None:
        print(f"state per GPU: {_fmt_bytes(st['compiled_state_bytes_per_gpu'])} compiled (parameters + AdamW moments; "
              f"arithmetic 12 B/param / {st['shared_by']} = {_fmt_bytes(st['arithmetic_state_bytes_per_gpu'])}); with "
              f"gradients {_fmt_bytes(st['state_with_gradients_bytes_per_gpu'])} against 16 B/param / {st['shared_by']} = "
              f"{_fmt_bytes(st['arithmetic_bytes_per_gpu'])} ({st['difference']:+.2%})")
    print_ranked(plan)
    print(f"the TPU-style setup on this target: {plan.tpu_setup_on_target.get('summary', 'n/a')}")
    src = plan.source_tpu_compile
    if src.get("status") == "ok":
        print(f"on the source TPU ({src['device_kind']}): {_fmt_bytes(src['peak_bytes_per_chip'])} per device "
              f"of {_fmt_bytes(src['hbm_bytes_per_device'])}; the plan uses {_fmt_bytes(plan.predicted_peak_bytes)} per GPU")
    elif src.get("status") == "does-not-fit":
        print(f"on the source TPU ({src['device_kind']}): the TPU compiler says this setup does not fit its "
              f"{_fmt_bytes(src['hbm_bytes_per_device'])} per device: {src['reason']}")
    else:
        print(f"source TPU compile: {src.get('status')}" + (f" ({src['reason']})" if src.get("reason") else ""))
    print(f"rule of thumb (the guide): batch {plan.rule_of_thumb_batch} -- {plan.rule_of_thumb_note}")
    print(f"matmul precision: TPU {plan.matmul_precision['tpu']}; GPU {plan.matmul_precision['gpu']}")
    print("environment for the target:")
    for name, item in plan.environment.items():
        print(f"  {name}={item['value']}    # {item['why']}")
    print(f"search: {plan.compiles} compile(s) ({plan.parallel_compiles} in a compile worker beside the search), "
          f"{plan.cache_hits} cache hit(s), {plan.ruled_out_by_bound} ruled out "
          f"uncompiled by the lower bound, {plan.search_seconds:.1f} s")


def print_ranked(plan: Any) -> None:
    """The fitting choices, fastest first, with their predicted step time."""
    rows = plan.ranked_rows()
    if not rows:
        return
    print("choices that fit, fastest predicted step first (those that change the global batch last):")
    print(f"  {'state':<11} {'remat':<14} {'batch':>6} {'accum':>6} {'global':>7} {'fill':>6} {'step (predicted)':>17}")
    for r in rows:
        print(f"  {r['state']:<11} {r['remat']:<14} {r['per_device_batch']:>6} {r['accumulation_steps']:>6} "
              f"{r['global_batch']:>7} {r['device_fill']:>6} {r['predicted_step']:>17}{'  <- plan' if r['chosen'] else ''}")


def cmd_plan(args: argparse.Namespace) -> int:
    from migration.runner import PlanError, start_plan

    fields = {f.name for f in dataclasses.fields(PlanRequest)}
    model = _model_overrides(args)
    req = PlanRequest(**{k: v for k, v in vars(args).items() if k in fields}, model=model)
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
            if ev.get("lower_bound"):
                fit = f"at least {fit} (lower bound over the budget: not compiled)"
            print(f"  batch {ev['per_device_batch']:>5} remat {ev['remat']:<22} x{ev['accumulation_steps']} accum: "
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
    from migration.codecheck import CodeCheckError, check_files, has_errors

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
        write_csv(rows, ["file", "line", "col", "rule", "severity", "message", "replacement"], args.csv)
    return 1 if has_errors(findings) else 0


_SHOWN = ("started", "compiled", "step")  # worker events shown as progress
_AUTOTUNE_FLAGS = {"top": "--top", "timed_steps": "--steps", "warmup_steps": "--warmup", "timeout_s": "--timeout",
                   "memory_fraction": "--mem-fraction"}


def cmd_autotune(args: argparse.Namespace) -> int:
    from migration.autotune import AutotuneRefused, AutotuneSettings, start_autotune
    from pathlib import Path

    from migration.history import History
    from migration.planfile import read_plan

    try:
        saved = read_plan(Path(args.plan).read_bytes(), where="--plan")
    except (OSError, ValueError) as exc:
        print(f"error: --plan {args.plan}: not a readable plan ({exc})", file=sys.stderr)
        return 2
    settings = AutotuneSettings(top=args.top, warmup_steps=args.warmup_steps, timed_steps=args.timed_steps,
                                timeout_s=args.timeout_s, memory_fraction=args.memory_fraction)
    try:
        history = History(args.history_db) if args.history_db else None
        events = start_autotune(saved, settings, history=history)
    except AutotuneRefused as exc:
        print(f"error: cannot autotune {args.plan}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        flag = _AUTOTUNE_FLAGS.get(exc.field)
        print(f"error: invalid settings: {exc}" + (f" (flag {flag})" if flag else ""), file=sys.stderr)
        return 2
    except (OSError, sqlite3.Error) as exc:
        print(f"error: --history-db: {exc}", file=sys.stderr)
        return 2
    result = None
    try:
        for ev in events:
            if ev["event"] == "status":
                print(ev["message"], flush=True)
            elif ev["event"] == "progress" and not args.quiet and ev["worker_event"]["event"] in _SHOWN:
                print(f"  {ev['status']}", flush=True)
            elif ev["event"] == "measured" and not ev["row"].ok:
                print(f"  {ev['row'].status} ({ev['row'].failure_kind}): {ev['row'].message}", flush=True)
            elif ev["event"] == "result":
                result = ev["result"]
    except KeyboardInterrupt:
        events.close()
        print("\ncancelled", file=sys.stderr)
        return 130
    print_autotune(result)
    if args.json:
        result.to_json(args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(result.table_rows(), path=args.csv)
        print(f"wrote {args.csv}")
    return 0 if result.pick_rank is not None else 1


def print_autotune(result: Any) -> None:
    """The measured candidates beside their predictions, and the verdict."""
    print(f"\nautotune of {result.workload}/{result.preset} for {result.gpus} x {result.target_name}, global batch "
          f"{result.requested_global_batch}: {result.warmup_steps} warm-up + {result.timed_steps} timed step(s) each")
    print(f"timings: {result.measured_on}")
    if result.prediction != "seconds":
        print("predicted step: the planner's relative cost (no peak FLOP/s for this device), so measured/predicted is "
              "n/a; 'vs best' compares each to the best of the measured choices")
    head = (f"  {'pred':>4} {'state':<11} {'remat':<14} {'batch':>6} {'accum':>6} {'predicted':>14} {'measured':>11} "
            f"{'meas/pred':>9} {'pred vs best':>12} {'meas vs best':>12} {'peak memory':>12} {'meas':>4}  status")
    print(head)
    for r in result.rows:
        predicted = (f"{r.predicted_step_s * 1e3:.3g} ms" if r.predicted_step_s is not None
                     else f"{r.relative_cost:.3g} rel")
        status = "ok" if r.ok else f"{r.status} ({r.failure_kind})"
        memory = fmt_gib(r.peak_memory_bytes, 3)
        if r.peak_memory_source and not r.peak_memory_source.startswith("measured"):
            memory += "*"
        print(f"  {'#' + str(r.predicted_rank):>4} {r.sharding:<11} {r.remat:<14} {r.per_device_batch:>6} "
              f"{r.accumulation_steps:>6} {predicted:>14} {_fmt(r.measured_step_ms, '.2f', ' ms'):>11} "
              f"{_fmt(r.measured_over_predicted, '.3g'):>9} {_fmt(r.predicted_vs_best, '.2f', 'x'):>12} "
              f"{_fmt(r.measured_vs_best, '.2f', 'x'):>12} {memory:>12} "
              f"{'#' + str(r.measured_rank) if r.measured_rank else '-':>4}  {status}"
              f"{'  <- plan' if r.planned else ''}{'  <- pick' if r.predicted_rank == result.pick_rank else ''}")
    sources = {r.peak_memory_source for r in result.rows if r.peak_memory_source
               and not r.peak_memory_source.startswith("measured")}
    for source in sources:
        print(f"  * peak memory not measured: {source}")
    for s in result.skipped:
        print(f"  not measured: #{s['predicted_rank']} ({s['per_device_batch']} x{s['accumulation_steps']}, "
              f"{s['remat']}): {s['why']}")
    for r in result.rows:
        if not r.ok:
            print(f"  #{r.predicted_rank} {r.status}: {r.message}")
    print(f"verdict: {result.verdict}")
    if result.ranking_held is not None:
        print(f"ranking held: {'yes' if result.ranking_held else 'no'} (predicted order "
              f"{' '.join(f'#{n}' for n in result.predicted_order)}, measured order "
              f"{' '.join(f'#{n}' for n in result.measured_order)})")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "workload", None) and ":" in args.workload:
        from workloads import allow_references

        allow_references()  # `--workload package.module:NAME`: the command line may import a team's model
    return {"run": cmd_run, "env": cmd_env, "plan": cmd_plan, "check": cmd_check,
            "autotune": cmd_autotune, "add-user": cmd_add_user, "prune-history": cmd_prune_history}[args.command](args)


def cmd_prune_history(args: argparse.Namespace) -> int:
    from migration.history import History, HistoryError

    if not args.older_than_days >= 0:
        print("error: --older-than-days must be 0 or more", file=sys.stderr)
        return 2
    try:
        removed = History(args.history_db).prune(args.older_than_days, args.user)
    except HistoryError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"removed {removed} entr{'y' if removed == 1 else 'ies'} older than {args.older_than_days:g} days"
          + (f" of {args.user}" if args.user else ""))
    return 0


def cmd_add_user(args: argparse.Namespace) -> int:
    """The password from the terminal (asked twice), or the first line of standard input."""
    import getpass

    from migration.accounts import AccountsError, add_user

    if sys.stdin.isatty():
        password = getpass.getpass(f"password for {args.user}: ")
        if getpass.getpass("again: ") != password:
            print("error: the two passwords differ", file=sys.stderr)
            return 2
    else:
        password = sys.stdin.readline().rstrip("\n")
    try:
        add_user(args.users_file, args.user, password)
    except (AccountsError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.user} can sign in; {args.users_file} holds salted scrypt hashes (mode 0600)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
