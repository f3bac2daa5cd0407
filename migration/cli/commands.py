"""The command line's commands: `python -m migration {env,run,plan,check,autotune,add-user,prune-history}`.
Each turns its flags into the backend's requests and prints the results (`migration/cli/output.py`);
none decides anything the app would decide differently."""

from __future__ import annotations

import argparse
import dataclasses
import getpass
import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from migration.cli.output import (
    fmt_bytes,
    plan_progress,
    print_autotune,
    print_checklist,
    print_export,
    print_plan,
    print_serve_plan,
    print_serve_run,
    print_summary,
    progress_printer,
    report_failure,
    write_report,
)
from migration.cli.parser import FLAGS, MODEL_FIELDS, build_parser, given_fields, model_overrides
from migration.codecheck import CodeCheckError, check_files, check_paths, has_errors
from migration.common import ConfigError, model_name, write_csv
from migration.config import forms
from migration.config.fields import AUTO, DIMENSIONS, FIELD, flags_of
from migration.config.requests import PlanRequest, RunConfig
from migration.config.serving import MEMORY_FRACTION, serve_request, serve_run_request
from migration.grading.checklist import to_csv
from migration.grading.serving import ServingEvidence, serving_checklist
from migration.planning.compare import rows as comparison_rows
from migration.planning.planfile import read_plan
from migration.prices import fmt_prices, parse_prices, read_prices_file
from migration.results import Plan
from migration.running.runner import PlanError, probe_environment, start_plan, start_run
from migration.running.worker_env import compile_environment, resolve_platform, with_serving_flags
from migration.service.accounts import AccountsError, add_user
from migration.service.autotune import AutotuneRefused, AutotuneSettings, start_autotune
from migration.service.history import History, HistoryError
from migration.service.orchestrate import RunOptions, base_config, run_plan


def cmd_run(args: argparse.Namespace) -> int:
    """`run`: one config in a fresh worker (or, with --plan, the plan's runs: `cmd_run_plan`)."""
    names = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        model = model_overrides(args)
        config, options = forms.run_values(**given_fields(args, "run", ("run", "options")))
        if args.tpu_step_ms is not None:  # the TPU job's, as a plan takes it: with --plan, the benchmark item's
            options["tpu_step_ms"] = forms.parse(FIELD["tpu_step_ms"], args.tpu_step_ms)
    except ConfigError as exc:
        print(f"error: invalid config: {exc}" + (f" (flag {FLAGS[exc.field]})" if exc.field in FLAGS else ""),
              file=sys.stderr)
        return 2
    given = {k: v for k, v in vars(args).items() if k in names and v is not None} | config
    if model:
        given["model"] = model
    if args.plan:
        return cmd_run_plan(args, given, RunOptions(**options))
    cfg = RunConfig(**given)
    plan_only = [flag for flag, on in (("--checklist", args.checklist), ("--code", args.code),
                                       ("--history-db", args.history_db),
                                       *((FLAGS[name], on) for name, on in options.items())) if on]
    if plan_only:
        print(f"error: {plan_only[0]} needs --plan PLAN_JSON (the checklist grades a plan and its run)", file=sys.stderr)
        return 2
    try:
        handle = start_run(cfg)
    except ConfigError as exc:
        flag = FLAGS.get(exc.field)
        print(f"error: invalid config: {exc}" + (f" (flag {flag})" if flag else ""), file=sys.stderr)
        return 2
    try:
        report = handle.wait(progress_printer(args.quiet, cfg.steps))
    except KeyboardInterrupt:
        handle.cancel()
        print("\ncancelled", file=sys.stderr)
        return 130
    print_summary(report)
    write_report(args, report)
    return report_failure(report)


def plan_flag(path: str) -> Plan | None:
    """The plan file --plan names, checked; None (saying why) when it is not a readable plan."""
    try:
        return read_plan(Path(path).read_bytes(), where="--plan")
    except (OSError, ValueError) as exc:
        print(f"error: --plan {path}: not a readable plan ({exc})", file=sys.stderr)
        return None


def cmd_run_plan(args: argparse.Namespace, given: dict[str, Any], options: RunOptions) -> int:
    """`run --plan`: the same runs, history, exports and checklist as the app's Run button. Run
    settings come from the flags; the memory share defaults to the plan's."""
    saved = plan_flag(args.plan)
    if saved is None:
        return 2
    try:
        code = dataclasses.replace(check_paths(args.code), role="training") if args.code else None
    except (CodeCheckError, OSError) as exc:
        print(f"error: --code: {exc}", file=sys.stderr)
        return 2
    plan_fields = ("workload", "preset", "model", "per_device_batch", "accumulation_steps", "precision", "remat",
                   "devices", "sharding", "step_style")
    base = base_config(saved, **{k: v for k, v in given.items() if k not in plan_fields})
    progress = progress_printer(args.quiet, base.steps)
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
        flag = FLAGS.get(exc.field)
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
    write_report(args, result.main)
    print_checklist(result.checklist)
    if args.checklist and not result.main.process_index:
        to_csv(result.checklist, args.checklist)
        print(f"wrote {args.checklist}")
    if result.files:
        print("exports: " + ", ".join(f"{k} {v}" for k, v in result.files.items()))
    return report_failure(result.main)


def cmd_env(args: argparse.Namespace) -> int:
    """`env`: what a worker sees (backend, devices, versions, environment, GPU memory)."""
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
            print(f"  {g['index']}: {g['name']}  total {fmt_bytes(g['total_bytes'])}, used {fmt_bytes(g['used_bytes'])}, "
                  f"by other processes {fmt_bytes(g['used_by_other_processes_bytes'])}")
    else:
        print("NVIDIA GPUs (NVML): none found")
    for w in info["warnings"]:
        print(f"warning: {w}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=2)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """`plan`: the planner in a worker, its progress as it searches, the plan."""
    try:
        handle = start_plan(plan_request(args))
    except ConfigError as exc:
        print(f"error: invalid plan request: {exc}", file=sys.stderr)
        return 2
    except (CodeCheckError, OSError) as exc:
        print(f"error: --code: {exc}", file=sys.stderr)
        return 2

    try:
        result = handle.wait(None if args.quiet else plan_progress)
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
    if args.csv:
        write_csv(comparison_rows(result.comparison), path=args.csv)
        print(f"wrote {args.csv}")
    return 0 if result.status == "ok" else 1


def plan_request(args: argparse.Namespace) -> PlanRequest:
    """The plan flags given (the others: the form's defaults), checked like the form's values; a
    workload may also be a reference (package.module:NAME)."""
    imported = None
    if getattr(args, "config_from", None):
        # reason: reading a config imports the workloads and JAX with them, about a second: only a command
        # given a file pays it (`--help`, `check`, `env` and the account commands never do)
        from migration.config.imported import read_config_path, with_imported

        imported = read_config_path(args.config_from)
    if imported is not None:
        named = {"workload"} if args.workload is not None else set()
        named |= {"preset"} if args.preset is not None else set()
        args.workload = args.workload or imported.workload
        args.preset = args.preset or imported.preset
        flag_model = {name: forms.parse(FIELD[name], getattr(args, name)) for name in DIMENSIONS
                      if getattr(args, name) is not None}
        flag_model = {name: value for name, value in flag_model.items() if value}
        if args.embeddings not in (None, "preset"):
            flag_model["tied_embeddings"] = args.embeddings == "tied"
    model = model_overrides(args)
    given = given_fields(args, "plan", ("plan",))
    given.update({name: value for name, value in model.items() if name in DIMENSIONS})
    if "tied_embeddings" in model:
        given["embeddings"] = "tied" if model["tied_embeddings"] else "untied"
    if getattr(args, "code", None) and given.get("attention", AUTO) == AUTO:
        found = next((f for f in check_paths(args.code).findings if f.rule == "ATTN001"), None)
        if found is not None:
            given["attention"] = "xla"
            print(f"the code check found attention that stores the scores at {found.file}:{found.line} (ATTN001): "
                  "planning with XLA's attention (--attention cudnn to plan the fused kernel instead)")
    if args.prices_file:  # the file's prices, then --price's over them
        given["prices"] = fmt_prices({**read_prices_file(args.prices_file),
                                      **parse_prices(given.get("prices", ""), "prices")})
    extra = {k: v for k, v in model.items() if k not in DIMENSIONS and k != "tied_embeddings"}  # --dim's
    req = forms.plan_request(registered_only=False, extra_model=extra, **{**given, "preset": args.preset})
    if imported is not None:
        req = with_imported(req, imported, (set(given) - {"workload", "preset"}) | named, flag_model)
    return dataclasses.replace(req, compile_for_tpu=args.compile_for_tpu)


def cmd_check(args: argparse.Namespace) -> int:
    """`check`: the code check of the files named (read, never run)."""
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


SHOWN = ("started", "compiled", "step")  # worker events shown as progress
AUTOTUNE_FLAGS = {"warmup_steps": "--warmup", "timeout_s": "--timeout", "memory_fraction": "--mem-fraction",
                  **{f.target: f.cli_flag for f in flags_of("autotune")}}


def cmd_autotune(args: argparse.Namespace) -> int:
    """`autotune`: measure a plan's top ranked choices here and pick the fastest measured."""
    saved = plan_flag(args.plan)
    if saved is None:
        return 2
    try:
        chosen = {FIELD[name].target: forms.parse(FIELD[name], value)
                  for name, value in given_fields(args, "autotune", ("autotune",)).items()}
        settings = AutotuneSettings(**chosen, warmup_steps=args.warmup_steps, timeout_s=args.timeout_s,
                                    memory_fraction=args.memory_fraction)
        history = History(args.history_db) if args.history_db else None
        events = start_autotune(saved, settings, history=history)
    except AutotuneRefused as exc:
        print(f"error: cannot autotune {args.plan}: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        flag = AUTOTUNE_FLAGS.get(exc.field)
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
            elif ev["event"] == "progress" and not args.quiet and ev["worker_event"]["event"] in SHOWN:
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


def cmd_prune_history(args: argparse.Namespace) -> int:
    """`prune-history`: delete finished entries older than some days."""
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


def checked(what: str, build: Any) -> Any:
    """`build()`, or None after printing its ConfigError as one line."""
    try:
        return build()
    except ConfigError as exc:
        print(f"error: invalid {what}: {exc}", file=sys.stderr)
        return None


def write_json(path: str | None, data: Any) -> bool:
    """Write `data` as JSON to `path` (when given); False, with a one-line error, when it cannot be written."""
    if path:
        try:
            Path(path).write_text(json.dumps(data, indent=2, default=str))
        except OSError as exc:
            print(f"error: {path}: could not be written ({exc.strerror or type(exc).__name__})", file=sys.stderr)
            return False
        print(f"wrote {path}")
    return True


def served_model(args: argparse.Namespace) -> dict[str, Any]:
    """The workload, preset and model dimension flags of a serving command: a checkpoint names its own
    model (a workload or preset beside it must agree, config.serving checks; dimension flags are
    refused), else llama unless --workload says otherwise, with the dimensions given (the training
    commands' flags) over the preset's."""
    if args.checkpoint:
        given = [FIELD[name].cli_flag for name in MODEL_FIELDS if getattr(args, name, None) not in (None, "", "preset")]
        if given:
            raise ConfigError("checkpoint", f"{', '.join(given)} cannot be given with --checkpoint: the checkpoint "
                                            "names its model's dimensions")
        return {"workload": args.workload, "preset": args.preset}
    args.workload = args.workload or "llama"
    model = model_overrides(args)  # the dimension flags given; with no preset, on the family's custom base
    return {"workload": args.workload, "preset": args.preset if args.preset is not None else "", "model": model}


def serving_code(paths: list[str] | None) -> Any:
    """The code check of the user's serving code (read, never run), None without --code, or False
    after printing why the files could not be read."""
    if not paths:
        return None
    try:
        return dataclasses.replace(check_paths(paths), role="serving")
    except (CodeCheckError, OSError) as exc:
        print(f"error: --code: {exc}", file=sys.stderr)
        return False


def serving_checklist_out(ev: ServingEvidence, path: str | None) -> bool:
    """Print the serving checklist graded from `ev`; write it as CSV to `path` when given (False when
    that fails, said in one line)."""
    items = serving_checklist(ev)
    print_checklist(items, "serving checklist")
    if not path:
        return True
    try:
        to_csv(items, path)
    except OSError as exc:
        print(f"error: {path}: could not be written ({exc.strerror or type(exc).__name__})", file=sys.stderr)
        return False
    print(f"wrote {path}")
    return True


def read_serve_plan(path: str) -> dict[str, Any]:
    """A serving plan written by serve-plan --json, or ConfigError("plan", ...)."""
    try:
        plan = json.loads(Path(path).read_text())
        if not (isinstance(plan, dict) and {"rows", "largest_batch", "target", "request"} <= set(plan)):
            raise ValueError("not a serving plan (rows, largest_batch, target, request)")
    except (OSError, ValueError) as exc:
        raise ConfigError("plan", f"{path} is not a serving plan written by serve-plan --json ({exc})") from None
    return plan


def cmd_serve_plan(args: argparse.Namespace) -> int:
    """`serve-plan`: the serving plan, compiled here for the target without the device."""
    # JAX reads its platform and XLA flags once, at import: a deviceless compile's before anything imports it
    os.environ.update(with_serving_flags(compile_environment()))
    req = checked("serving request", lambda: serve_request(
        **served_model(args), target=args.target, prompt_len=args.prompt_len, gen_len=args.gen_len,
        precision=args.precision, batches=args.batches, gpus=args.gpus, memory_fraction=args.memory_fraction,
        checkpoint=args.checkpoint, kv_cache=args.kv_cache, chunk=args.chunk, mix=args.mix))
    if req is None:
        return 2
    code = serving_code(args.code)
    if code is False:
        return 2
    from migration.planning.serving import serve_plan  # reason: imports JAX, once the environment is set

    plan = serve_plan(req)
    print_serve_plan(plan)
    written = serving_checklist_out(ServingEvidence(plan=plan, code=code), args.checklist)
    written = write_json(args.json, plan) and written
    if args.csv:
        try:
            write_csv(plan["rows"], path=args.csv)
            print(f"wrote {args.csv}")
        except OSError as exc:
            print(f"error: {args.csv}: could not be written ({exc.strerror or type(exc).__name__})", file=sys.stderr)
            written = False
    return 2 if not written else 0 if plan["largest_batch"] else 1


def cmd_serve_run(args: argparse.Namespace) -> int:
    """`serve-run`: a measured stream of requests on this machine's first device."""
    # the platform this machine has, named before anything imports JAX (no CUDA probe without a GPU)
    os.environ.setdefault("JAX_PLATFORMS", "cuda" if resolve_platform("auto") == "gpu" else "cpu")
    os.environ.update(with_serving_flags(dict(os.environ)))
    plan = checked("serving plan", lambda: read_serve_plan(args.plan)) if args.plan else None
    if args.plan and plan is None:
        return 2
    req = checked("serving run", lambda: serve_run_request(
        **served_model(args), precision=args.precision, requests=args.requests, batches=args.batches,
        prompt_min=args.prompt_min, prompt_max=args.prompt_max, gen_min=args.gen_min, gen_max=args.gen_max,
        temperature=args.temperature, seed=args.seed, checkpoint=args.checkpoint, kv_cache=args.kv_cache))
    if req is None:
        return 2
    code = serving_code(args.code)
    if code is False:
        return 2
    planned = plan and (plan["request"]["workload"], plan["request"]["preset"], plan["request"]["model"])
    if planned and planned != (req.workload, req.preset, req.model):
        print(f"error: plan: {args.plan} is a plan for {model_name(*planned)}, the run serves "
              f"{model_name(req.workload, req.preset, req.model)}; grade a run against its own model's plan",
              file=sys.stderr)
        return 2
    from migration.running.serving import check_memory, serve_run  # reason: imports JAX, only for this command

    if checked("serving run", lambda: check_memory(req, MEMORY_FRACTION) or True) is None:
        return 2
    result = serve_run(req)
    print_serve_run(result)
    if not (serving_checklist_out(ServingEvidence(plan=plan, run=result, code=code), args.checklist)
            and write_json(args.json, result)):
        return 2
    within = result["logits_check"] is None or result["logits_check"]["within"]
    return 0 if result["recompiles"] == 0 and within else 1


def cmd_export_hf(args: argparse.Namespace) -> int:
    """`export-hf`: a llama-family checkpoint as a Hugging Face model folder, converted on the host."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the arrays are read and converted on the host: no device started
    try:
        # reason: imports JAX, Orbax and safetensors, only for this command
        from migration.running.export import export_checkpoint
    except ImportError as exc:
        package = (exc.name or "safetensors").split(".")[0]
        print(f"error: export-hf needs the {package} package: pip install -r requirements-export.txt", file=sys.stderr)
        return 2
    try:
        summary = checked("export", lambda: export_checkpoint(args.checkpoint, args.out, args.dtype,
                                                              verify=args.verify))
    except ImportError as exc:  # --verify without transformers
        print(f"error: export-hf --verify needs the {(exc.name or 'transformers').split('.')[0]} package: pip install "
              "-r requirements-export.txt", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {args.out}: could not be written ({exc.strerror or type(exc).__name__})", file=sys.stderr)
        return 1
    if summary is None:
        return 2
    print_export(summary)
    ok = write_json(args.json, summary) and serving_checklist_out(ServingEvidence(export=summary), None)
    return 2 if not ok else 1 if summary.get("verified", {}).get("within") is False else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "workload", None) and ":" in args.workload:
        # reason: the workloads import JAX; only a command that names a model reference needs them
        from workloads import allow_references

        allow_references()  # `--workload package.module:NAME`: the command line may import a team's model
    return {"run": cmd_run, "env": cmd_env, "plan": cmd_plan, "check": cmd_check,
            "autotune": cmd_autotune, "add-user": cmd_add_user, "prune-history": cmd_prune_history,
            "serve-plan": cmd_serve_plan, "serve-run": cmd_serve_run,
            "export-hf": cmd_export_hf}[args.command](args)
