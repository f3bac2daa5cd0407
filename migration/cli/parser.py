"""The command line's flags. Those of the Migrate form's fields (`migration/config/fields.py`) are
built from that table and checked by the same code as the form (`migration/config/forms.py`): they
are read as text and default to "not given" (None), so a command knows what was given. The flags of
settings the form does not have (a run's devices and sharding, the multi-process job, output files)
are written here."""

from __future__ import annotations

import argparse
import os
import re
from typing import Any

from migration import version
from migration.common import ConfigError
from migration.config import forms
from migration.config.fields import DIMENSIONS, FIELD, FIELDS, Field, flags_of
from migration.config.limits import LIMITS, PLATFORMS, PRECISIONS, REMAT_NAMES, STEP_STYLES
from migration.config.requests import RunConfig
from migration.config.serving import CHUNK, CHUNK_LIMITS, DECODER_WORKLOADS, KV_CACHES, MEMORY_FRACTION, SERVE_PRECISIONS
from migration.hardware import GPU_SPECS, TPU_SPECS
from migration.service.autotune import AutotuneSettings

PROG = "python -m migration"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


# Config fields -> the flag that sets them, for messages that name a bad field.
FLAGS = {"per_device_batch": "--batch", "accumulation_steps": "--accum", "warmup_steps": "--warmup",
         "timeout_s": "--timeout", "memory_fraction": "--mem-fraction", "visible_devices": "--visible-devices",
         "xla_flags": "--xla-flags", "save_checkpoint": "--save-checkpoint",
         "restore_checkpoint": "--restore-checkpoint", "coordinator": "--coordinator",
         "num_processes": "--num-processes", "process_id": "--process-id",
         **{f.target: f.cli_flag for f in FIELDS if "run" in f.commands}}
# Model dimension flags -> the workload config's fields (transformer families).
MODEL_FLAGS = {FIELD[name].cli_flag[2:].replace("-", "_"): name for name in DIMENSIONS}
MODEL_FIELDS = (*DIMENSIONS, "embeddings")
CHOICES_LISTED = 8  # a flag with more choices (the catalogs) lists them in its help, not its usage


def field_help(f: Field) -> str:
    """The flag's help: the field's, its range or choices where known without the workloads, its default."""
    extra = []
    if f.kind in ("int", "float") and not callable(f.limits):
        lo, hi = f.bounds()
        extra.append((f"{int(lo)} to {int(hi)}" if f.kind == "int" else f"{lo:g} to {hi:g}")
                     + (f", 0: {f.zero}" if f.zero else ""))
    if f.kind != "bool" and f.default not in ("", None) and "default" not in f.help \
            and not (f.zero and f.default == 0):
        extra.append(f"default {f.default}")
    return f"{f.help or f.label}" + (f" ({'; '.join(extra)})" if extra else "")


def add_field_flags(parser: argparse.ArgumentParser, command: str, only: tuple[str, ...] | None = None) -> None:
    """`command`'s flags of the form's fields (the model's in their own group); `only`: those fields."""
    model = parser.add_argument_group("model dimensions (override the preset's; transformer and llama)")
    if only is None or "n_layers" in only:
        model.add_argument("--dim", dest="dim", action="append", default=None, metavar="NAME=VALUE",
                           help="any other dimension of the workload's config, repeatable (e.g. --dim n_experts=16 "
                                "--dim dispatch=capacity --dim capacity_factor=1.25 for moe); the workload checks "
                                "the name and the value")
    for f in flags_of(command):
        if only is not None and f.name not in only:
            continue
        where = model if f.name in MODEL_FIELDS else parser
        options: dict[str, Any] = dict(dest=f.name, default=None, help=field_help(f))
        if f.kind == "bool":
            where.add_argument(f.cli_flag, action="store_const", const=True, **options)
            continue
        if f.kind == "choice" and not callable(f.choices) and len(f.choices) <= CHOICES_LISTED:
            options["choices"] = f.choices
        else:
            options["metavar"] = {"int": "N", "float": "X", "layout": "LAYOUT"}.get(f.kind, "NAME")
        where.add_argument(f.cli_flag, **options)
        if f.name == "embeddings":
            model.add_argument("--tied", dest="embeddings", action="store_const", const="tied",
                               help="the same as --embeddings tied")
            model.add_argument("--untied", dest="embeddings", action="store_const", const="untied",
                               help="the same as --embeddings untied")


def given_fields(args: argparse.Namespace, command: str, fills: tuple[str, ...]) -> dict[str, Any]:
    """The raw values of the form's fields given on the command line (not None), by field name."""
    return {f.name: getattr(args, f.name) for f in flags_of(command)
            if f.fills in fills and f.name not in MODEL_FIELDS and getattr(args, f.name) is not None}


def dimension_values(items: list[str]) -> dict[str, Any]:
    """`--dim NAME=VALUE` items as config overrides: a whole number, a decimal, true/false or a word."""
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = str(item).partition("=")
        name, text = name.strip(), text.strip()
        if not sep or not name.isidentifier() or not text or len(text) > 100:
            raise ConfigError("model", f"--dim takes NAME=VALUE (a config field, a value of at most 100 characters), "
                                       f"e.g. --dim n_experts=16; got {item[:60]!r}")
        if re.fullmatch(r"[+-]?\d+", text):
            value: Any = int(text)
        elif re.fullmatch(r"[+-]?(\d+\.\d*|\.\d+|\d+)(e[+-]?\d+)?", text, re.IGNORECASE):
            value = float(text)
        elif text.lower() in ("true", "false"):
            value = text.lower() == "true"
        else:
            value = text
        out[name] = value
    return out


def model_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The dimension flags given, checked, and the preset they apply to (`args.preset` is set when it
    was None). Flags equal to the preset's own value are dropped, so a plan names only what differs."""
    out = {name: forms.parse(FIELD[name], getattr(args, name)) for name in DIMENSIONS
           if getattr(args, name) is not None}
    out = {name: value for name, value in out.items() if value}  # 0: the preset's
    if args.embeddings not in (None, "preset"):
        out["tied_embeddings"] = args.embeddings == "tied"
    out.update(dimension_values(getattr(args, "dim", None) or []))
    if args.preset is not None and not out:
        return out
    # reason: the workloads import JAX (not its backend); only commands that name a model need them
    from workloads import WORKLOADS, resolve_workload

    try:
        workload = resolve_workload(args.workload or FIELD["workload"].default)
    except (KeyError, ValueError):
        args.preset = args.preset or "tiny"  # validation names the unknown workload
        return out
    args.preset = args.preset or (workload.custom_base if out else "tiny" if "tiny" in workload.presets
                                  else workload.default_preset)
    base = workload.presets.get(args.preset)
    if base is None or args.workload not in (None, *WORKLOADS):
        return out
    return {k: v for k, v in out.items() if getattr(base, k, object()) != v}


def folder(text: str) -> str:
    """A folder flag as an absolute path (the worker starts in another directory); empty stays empty."""
    return os.path.abspath(text) if text else ""


def value_range(field: str) -> str:
    lo, hi = LIMITS[field]
    return f"{lo:g} to {hi:g}"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog=PROG, description="Explore TPU-to-GPU migration of JAX training jobs.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    env = sub.add_parser("env", help="backend, devices, versions, JAX/XLA variables, GPU memory used by others")
    env.add_argument("--json", metavar="PATH", help="also write the environment as JSON")
    env.add_argument("--platform", choices=PLATFORMS, default="auto")
    add_run_flags(sub.add_parser("run", help="run one training config in a fresh worker and measure it"))
    chk = sub.add_parser("check", help="read Python files (never run them) for TPU-specific or outdated JAX")
    chk.add_argument("files", nargs="+", metavar="FILE.py")
    chk.add_argument("--json", metavar="PATH", help="write the findings as JSON")
    chk.add_argument("--csv", metavar="PATH", help="write the findings as CSV, one row per finding")
    add_plan_flags(sub.add_parser("plan", help="plan a TPU-style setup for a GPU: batch, precision, remat, "
                                               "accumulation, environment"))
    add_autotune_flags(sub.add_parser("autotune", help="measure the plan's fastest predicted fitting choices on "
                                                       "its target and pick the fastest measured"))
    add_serve_plan_flags(sub.add_parser("serve-plan", help="plan serving a decoder model on a GPU without it: "
                                                           "memory, largest batch, time to first token and per token"))
    add_serve_run_flags(sub.add_parser("serve-run", help="measure serving here: a stream of mixed-length requests "
                                                         "(TTFT, TPOT, tokens/s, recompiles)"))
    add_export_flags(sub.add_parser("export-hf", help="write a llama-family checkpoint as a Hugging Face model folder "
                                                      "(config.json, safetensors) that transformers loads"))
    add_admin_commands(sub)
    return parser


def add_run_flags(run: argparse.ArgumentParser) -> None:
    d = RunConfig()
    run.add_argument("--batch", dest="per_device_batch", type=int, default=d.per_device_batch,
                     help=f"per-device micro-batch ({value_range('per_device_batch')})")
    run.add_argument("--devices", type=int, default=d.devices, help="data-parallel devices (on CPU: XLA CPU devices)")
    run.add_argument("--sharding", metavar="LAYOUT", default=d.sharding,
                     help="the layout: replicated, fsdp (over the devices), hybrid:G (FSDP over groups of G devices, "
                          "data parallelism across them), each optionally +tpT (tensor parallelism over T devices)")
    run.add_argument("--step-style", dest="step_style", choices=STEP_STYLES, default=d.step_style,
                     help="jit: the migrated step; pmap: the TPU-era step (pmap + lax.pmean, replicated state)")
    run.add_argument("--precision", choices=PRECISIONS, default=d.precision)
    run.add_argument("--remat", choices=REMAT_NAMES, default=d.remat, help="rematerialisation policy per block")
    run.add_argument("--accum", dest="accumulation_steps", type=int, default=d.accumulation_steps,
                     help="gradient-accumulation micro-batches per optimizer step")
    run.add_argument("--warmup", dest="warmup_steps", type=int, default=d.warmup_steps,
                     help="steps excluded from timing")
    run.add_argument("--timeout", dest="timeout_s", type=float, default=d.timeout_s,
                     help="seconds before the run is stopped")
    run.add_argument("--platform", choices=PLATFORMS, default=d.platform)
    run.add_argument("--mem-fraction", dest="memory_fraction", type=float, default=None,
                     help=f"XLA_PYTHON_CLIENT_MEM_FRACTION for the worker (default {d.memory_fraction}; with --plan, "
                          "the plan's memory share)")
    run.add_argument("--preallocate", action="store_true", help="let JAX preallocate its GPU memory pool")
    run.add_argument("--xla-flags", default=d.xla_flags, help="extra XLA_FLAGS for the worker")
    run.add_argument("--visible-devices", dest="visible_devices", default=d.visible_devices,
                     help="CUDA_VISIBLE_DEVICES for the worker, e.g. 0,1 (the device count is --devices)")
    run.add_argument("--save-checkpoint", dest="save_checkpoint", type=folder, default=None, metavar="DIR",
                     help="write the train state (parameters, optimizer state, step) to this folder after the last "
                          "step, with Orbax")
    run.add_argument("--restore-checkpoint", dest="restore_checkpoint", type=folder, default=None, metavar="DIR",
                     help="start from the train state in this folder (saved on any device count or sharding; it "
                          "must be the same model)")
    add_distributed_flags(run, d)
    add_field_flags(run, "run")
    run.add_argument("--json", metavar="PATH", help="write the report as JSON")
    run.add_argument("--csv", metavar="PATH", help="write the report as a one-row CSV")
    run.add_argument("--quiet", action="store_true", help="no per-step progress")
    run.add_argument("--plan", metavar="PLAN_JSON",
                     help="run a plan made by `plan` (its batch, accumulation, precision and remat replace those flags)")
    run.add_argument("--checklist", metavar="CSV", help="with --plan: grade the migration checklist and write it as CSV")
    run.add_argument("--code", nargs="+", metavar="FILE.py", help="with --plan: your training code, for the checklist")
    run.add_argument("--history-db", metavar="PATH", help="with --plan: record the runs in this history database")
    run.add_argument("--export-dir", metavar="DIR", default="runs/exports",
                     help="with --plan: where the report, checklist and deployment snippet are written")


def add_distributed_flags(parser: argparse.ArgumentParser, d: RunConfig) -> None:
    group = parser.add_argument_group("one job across several processes, one per host or per GPU (jax.distributed; "
                                      "--devices is then the job's global device count)")
    where = group.add_mutually_exclusive_group()
    where.add_argument("--coordinator", default=d.coordinator, metavar="HOST:PORT",
                       help="process 0's host and a free port there, the same for every process of the job")
    where.add_argument("--distributed", dest="coordinator", choices=["auto"],
                       help="auto: JAX detects the cluster (under srun, SLURM; under mpirun, Open MPI) and gives this "
                            "process its id, the process count and the coordinator (same as --coordinator auto)")
    group.add_argument("--num-processes", dest="num_processes", type=int, default=d.num_processes, metavar="N",
                       help=f"processes in the job ({value_range('num_processes')}; with --coordinator HOST:PORT)")
    group.add_argument("--process-id", dest="process_id", type=int, default=d.process_id, metavar="I",
                       help="this process's id, 0 to N-1; process 0 runs at HOST and writes the reports")


def add_plan_flags(pl: argparse.ArgumentParser) -> None:
    add_field_flags(pl, "plan")
    pl.add_argument("--no-tpu-compile", dest="compile_for_tpu", action="store_false",
                    help=f"do not try to compile the TPU-style setup for the source TPU ({', '.join(TPU_SPECS)})")
    pl.add_argument("--config-from", metavar="PATH",
                    help="plan the model (and, from a MaxText config, the TPU job: per_device_batch_size, "
                         "max_target_length, dtype, ici/dcn parallelism) of a MaxText yaml or a Hugging Face "
                         "config.json, read as data; flags given beside it win, keys it does not model are listed")
    pl.add_argument("--json", metavar="PATH", help="write the plan as JSON")
    pl.add_argument("--csv", metavar="PATH", help="write the TPU job and the plan side by side as CSV (metric, tpu, "
                                                  "gpu, unit)")
    pl.add_argument("--prices-file", metavar="PATH",
                    help="your prices: JSON {\"tpu-v5p\": 4.2, ...} or one key=dollars per line (--price overrides)")
    pl.add_argument("--code", nargs="+", metavar="FILE.py",
                    help="your training code, read (never run) by the code check: where it finds attention that "
                         "stores the scores (ATTN001) and --attention is not given, the plan uses XLA's attention")
    pl.add_argument("--quiet", action="store_true", help="no progress lines")


def add_autotune_flags(at: argparse.ArgumentParser) -> None:
    a = AutotuneSettings()
    at.add_argument("--plan", metavar="PLAN_JSON", required=True, help="a plan made by `plan` for this machine's device")
    add_field_flags(at, "autotune")
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


SERVING_CODE_HELP = ("your serving code, read (never run) by the code check for the checklist: host copies in the "
                     "decode loop (SYNC001, TIME001), shapes that recompile (SHAPE001, TRACE001)")


def add_serve_plan_flags(sp: argparse.ArgumentParser) -> None:
    sp.add_argument("--workload", choices=DECODER_WORKLOADS, help="a decoder family (default llama; moe: the "
                                                                  "mixture-of-experts decoder)")
    sp.add_argument("--preset", help="its size preset (llama: tiny, 1b, 3b, 8b; transformer: tiny, small, gpt2-small "
                                     "... gpt2-xl; moe: tiny, mixtral-8x7b, deepseek-v3, qwen3-30b-a3b, ...); needed "
                                     "unless --checkpoint names the model")
    sp.add_argument("--checkpoint", type=folder, default="", metavar="DIR",
                    help="plan the model of this training checkpoint (written by run --save-checkpoint)")
    add_field_flags(sp, "plan", MODEL_FIELDS)  # the training form's model dimensions
    sp.add_argument("--target", default="h100-sxm", metavar="GPU", help=f"the GPU: {', '.join(GPU_SPECS)}")
    sp.add_argument("--gpus", default=1, metavar="N", help="GPUs of one node the model is split over (tensor parallelism; 1 to 8, dividing its heads and MLP width; an MoE model's routed experts split whole where their number divides)")
    sp.add_argument("--precision", default="bf16", choices=SERVE_PRECISIONS, help="weights, cache and compute")
    sp.add_argument("--kv-cache", dest="kv_cache", default="auto", choices=KV_CACHES,
                    help="the KV cache's storage: auto (the precision's dtype) or fp8 (e4m3, unit scale: half of "
                         "bf16's bytes, twice the sequences in the same memory)")
    sp.add_argument("--prompt-len", dest="prompt_len", metavar="N", help="prompt tokens (or --mix)")
    sp.add_argument("--gen-len", dest="gen_len", metavar="N", help="generated tokens per request (or --mix)")
    sp.add_argument("--mix", default="", metavar="MIX",
                    help="a request mix instead of --prompt-len/--gen-len: classes [share*]prompt:generated, e.g. "
                         "0.7*512:128,0.3*4096:512")
    sp.add_argument("--chunk", default=CHUNK, metavar="N",
                    help=f"the engine's token budget a step: decode tokens and prompt chunks (default {CHUNK:,}, "
                         f"{CHUNK_LIMITS[0]} to {CHUNK_LIMITS[1]:,})")
    sp.add_argument("--batches", default="", metavar="LIST",
                    help="concurrencies (running sequences) to tabulate, e.g. 1,8,32 (default: 1 and a quarter, half "
                         "and all of the concurrency the memory and the step budget allow)")
    sp.add_argument("--mem-fraction", dest="memory_fraction", default=MEMORY_FRACTION, metavar="F",
                    help=f"share of the GPU's memory the server may use (default {MEMORY_FRACTION})")
    sp.add_argument("--json", metavar="PATH", help="write the plan as JSON (one row per batch)")
    sp.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    sp.add_argument("--checklist", metavar="PATH", help="write the serving checklist as CSV")
    sp.add_argument("--code", nargs="+", metavar="FILE.py", help=SERVING_CODE_HELP)


def add_serve_run_flags(sr: argparse.ArgumentParser) -> None:
    sr.add_argument("--workload", choices=DECODER_WORKLOADS, help="a decoder family (default llama)")
    sr.add_argument("--preset", help="its size preset (llama tiny, transformer gpt2-small, ...); needed unless "
                                     "--checkpoint names the model")
    sr.add_argument("--checkpoint", type=folder, default="", metavar="DIR",
                    help="serve this training checkpoint's parameters (written by run --save-checkpoint); "
                         "default: random ones")
    add_field_flags(sr, "run", MODEL_FIELDS)
    sr.add_argument("--precision", default="fp32", choices=SERVE_PRECISIONS, help="default fp32 (the CPU's)")
    sr.add_argument("--kv-cache", dest="kv_cache", default="auto", choices=KV_CACHES,
                    help="the KV cache's storage: auto (the precision's dtype) or fp8 (e4m3; the run also serves its "
                         "first 4 requests with both caches and reports how many generated tokens agree)")
    sr.add_argument("--batches", default="4", metavar="LIST",
                    help="batch sizes (requests served together), each measured in turn, e.g. 1,4,8 (default 4)")
    for name, default, what in (("requests", 50, "requests in the stream"),
                                ("prompt-min", 4, "shortest prompt"), ("prompt-max", 32, "longest prompt"),
                                ("gen-min", 4, "fewest tokens generated"), ("gen-max", 24, "most tokens generated"),
                                ("seed", 0, "the model's and the stream's seed")):
        sr.add_argument(f"--{name}", dest=name.replace("-", "_"), default=default, metavar="N",
                        help=f"{what} (default {default})")
    sr.add_argument("--temperature", default=0.0, metavar="T", help="sampling temperature (default 0: greedy)")
    sr.add_argument("--plan", metavar="PLAN_JSON", help="a serving plan (serve-plan --json) to grade the run against")
    sr.add_argument("--json", metavar="PATH", help="write the result as JSON")
    sr.add_argument("--checklist", metavar="PATH", help="write the serving checklist as CSV")
    sr.add_argument("--code", nargs="+", metavar="FILE.py", help=SERVING_CODE_HELP)


def add_admin_commands(sub: Any) -> None:
    au = sub.add_parser("add-user", help="add a user of the app (or change their password) in a users file of "
                                         "salted scrypt hashes, kept private (mode 0600)")
    au.add_argument("users_file", help="the file the app's --auth-file names (created if missing)")
    au.add_argument("user", help="1 to 64 letters, digits and . _ @ -")
    pr = sub.add_parser("prune-history", help="delete finished history entries older than some days (the "
                                              "operator's answer to a full per-user history quota)")
    pr.add_argument("--history-db", required=True, metavar="PATH")
    pr.add_argument("--older-than-days", type=float, required=True, metavar="DAYS")
    pr.add_argument("--user", default=None, help="only this user's entries (default: everyone's)")


def add_export_flags(ex: argparse.ArgumentParser) -> None:
    ex.add_argument("--checkpoint", required=True, type=folder, metavar="DIR",
                    help="a checkpoint folder written by run --save-checkpoint, of a llama-family model")
    ex.add_argument("--out", required=True, type=folder, metavar="DIR",
                    help="the folder to write: new, empty, or an earlier export (replaced)")
    ex.add_argument("--dtype", default="bf16", metavar="DTYPE",
                    help="the tensors' dtype: bf16, fp16 or fp32 (default bf16; parameters are trained in fp32)")
    ex.add_argument("--verify", action="store_true",
                    help="load the export with transformers on the CPU and compare its logits with this model's "
                         "(needs requirements-export.txt)")
    ex.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
