"""The migration checklist, decided from evidence the product gathered.

The guide ends with eight checklist items that teams tick by hand. Here each item gets a status
(pass, warn, fail, n/a, not checked), the evidence (figures with units and where they came from)
and the action to take, from a plan, the run of that plan, and optionally the code check's
findings, a profile summary, an fp32 reference run, the TPU-style setup run locally and runs at
other device counts.
"""

from __future__ import annotations

import csv
import dataclasses
import io
from pathlib import Path
from typing import Any

from migration.codecheck import Finding
from migration.hardware import TPU_SPECS
from migration.plan import Plan
from migration.report import RunReport, csv_cell

PASS, WARN, FAIL, NA, NOT_CHECKED = "pass", "warn", "fail", "n/a", "not checked"
GiB = 2**30
NUMERICS_TOLERANCE = 0.05  # final loss within 5% of the fp32 reference over the same steps


@dataclasses.dataclass(frozen=True)
class ChecklistItem:
    id: str
    item: str
    status: str
    evidence: str
    action: str


def _gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / GiB:.2f} GiB"


def _where(r: RunReport) -> str:
    return f"measured on {r.device_kind} x{r.device_count} ({r.backend}), JAX {r.jax_version}"


def evaluate(
    plan: Plan,
    run: RunReport | None = None,
    *,
    findings: list[Finding] | None = None,
    profile: dict[str, Any] | None = None,
    fp32_reference: RunReport | None = None,
    tpu_style_run: RunReport | None = None,
    scaling_runs: list[RunReport] | None = None,
    deployment_file: str | None = None,
) -> list[ChecklistItem]:
    items: list[ChecklistItem] = []
    add = lambda *a: items.append(ChecklistItem(*a))
    ran = run is not None and run.ok

    # 1. Profile for memory and compute bottlenecks
    if profile and ran:
        top = ", ".join(f"{o['name']} {o['total_ms'] / max(1, profile['steps']):.2f} ms/step"
                        for o in profile.get("top_ops", [])[:5])
        add("profile", "Profile for memory and compute bottlenecks", PASS,
            f"{profile['steps']} step(s) traced ({profile['path']}); compile {run.compile_s:.2f} s vs step "
            f"{run.step_ms_median:.2f} ms (median); time by op: {top or 'n/a'}; {_where(run)}",
            "open the trace in Perfetto (ui.perfetto.dev) or TensorBoard/XProf; attack the largest ops first")
    else:
        add("profile", "Profile for memory and compute bottlenecks", NOT_CHECKED,
            "no profile was captured for this run" + (f"; compile {run.compile_s:.2f} s vs step {run.step_ms_median:.2f} ms"
                                                     if ran else ""),
            "run again with profiling on (a few steps under jax.profiler.trace)")

    # 2. Batch sizes adjusted for GPU memory
    if plan.status != "ok":
        add("batch", "Batch sizes adjusted for GPU memory", FAIL, plan.message,
            "choose a larger GPU, a smaller preset, or shard parameters and optimizer state")
    else:
        measured = run.peak_memory_bytes if ran and run.backend == "gpu" else None
        peak = measured if measured is not None else plan.predicted_peak_bytes
        margin = plan.budget_bytes - peak if peak is not None else None
        status = PASS if margin is not None and margin >= 0 and plan.global_batch_exact else \
            (WARN if margin is not None and margin >= 0 else FAIL)
        add("batch", "Batch sizes adjusted for GPU memory", status,
            f"TPU {plan.source_per_core_batch} per core -> GPU {plan.per_device_batch} per device x {plan.gpus} x "
            f"{plan.accumulation_steps} accumulation = {plan.global_batch} (requested {plan.requested_global_batch}); "
            f"predicted {_gib(plan.predicted_peak_bytes)} ({plan.prediction_method})"
            + (f", measured {_gib(measured)}" if measured is not None else
               (f", measured on {run.backend}: {_gib(run.peak_memory_bytes)} (not a GPU figure)" if ran else ""))
            + f" of a {_gib(plan.budget_bytes)} budget; margin {_gib(margin)}",
            "keep the planned batch and accumulation" if status == PASS else
            "the global batch changed: rescale the learning rate" if status == WARN else
            "lower the per-device batch or choose remat")

    # 3. Accelerator-specific APIs replaced
    if findings is None:
        add("apis", "Accelerator-specific APIs replaced", NOT_CHECKED, "no code was checked",
            "paste or upload the training script in the Code check tab (or run python -m migration check)")
    else:
        errors = [f for f in findings if f.severity == "error"]
        warnings = [f for f in findings if f.severity == "warning"]
        status = FAIL if errors else (WARN if warnings else PASS)
        listed = "; ".join(f"{f.rule} line {f.line}" for f in (errors + warnings)[:8])
        add("apis", "Accelerator-specific APIs replaced", status,
            f"code check: {len(errors)} error(s), {len(warnings)} warning(s)" + (f" ({listed})" if listed else ""),
            "apply each finding's replacement" if findings else "nothing to replace")

    # 4. Gradient checkpointing
    if plan.status == "ok":
        rows = {(r["remat"], r["per_device_batch"]): r["predicted_bytes"] for r in plan.table
                if r["accumulation_steps"] == 1 and r["predicted_bytes"] is not None}
        same_batch = {remat: rows.get((remat, plan.per_device_batch)) for remat in ("none", plan.remat)}
        saved = (same_batch["none"] - same_batch[plan.remat]) if all(same_batch.values()) and plan.remat != "none" else None
        add("remat", "Gradient checkpointing", PASS,
            f"policy {plan.remat} chosen by compiles; largest batch per policy: "
            + ", ".join(f"{k} {v}" for k, v in plan.max_batch_by_remat.items())
            + (f"; saves {_gib(saved)} per GPU at batch {plan.per_device_batch} vs none" if saved else "")
            + ("; no recompute needed: the batch fits without it" if plan.remat == "none" else
               "; extra compute: the recomputed part of each block's forward pass (model FLOPs and MFU exclude it)"),
            "none needed" if plan.remat == "none" else f"keep remat {plan.remat}; compare step time against none at "
                                                        f"batch {plan.max_batch_by_remat.get('none', 0) or 1}")
    else:
        add("remat", "Gradient checkpointing", NA, "the plan is not feasible even with full remat", "see the batch item")

    # 5. Multi-GPU scaling
    counts = sorted({r.device_count for r in (scaling_runs or []) if r.ok and r.device_count})
    if len(counts) >= 2:
        per_device = {r.device_count: r.samples_per_s / r.device_count for r in scaling_runs if r.ok}
        base = per_device[counts[0]]
        add("scaling", "Multi-GPU scaling tested", PASS if per_device[counts[-1]] >= 0.8 * base else WARN,
            "samples/s per device: " + ", ".join(f"{n} device(s) {per_device[n]:,.1f}" for n in counts)
            + f" ({_where(scaling_runs[0])})", "scale out while per-device throughput holds")
    else:
        add("scaling", "Multi-GPU scaling tested", NOT_CHECKED,
            "runs at only one device count" + (f" ({run.device_count})" if run else ""),
            "run the plan at 1 and N devices and compare samples/s per device")

    # 6. Benchmarked against the existing implementation
    if ran and tpu_style_run is not None and tpu_style_run.ok:
        ratio = run.samples_per_s / tpu_style_run.samples_per_s
        add("benchmark", "Benchmarked against the existing implementation", PASS,
            f"migrated {run.samples_per_s:,.1f} samples/s vs TPU-style setup {tpu_style_run.samples_per_s:,.1f} "
            f"samples/s run here ({ratio:.2f}x); {_where(run)}", "keep the migrated setup" if ratio >= 0.9 else
            "the migrated setup is slower here: check the remat and batch choices")
    elif ran and run.achieved_tflops:
        src = TPU_SPECS[plan.source]
        tpu_peak = src.bf16_tflops_per_device * src.devices
        estimate = run.samples_per_s * tpu_peak / run.peak_tflops if run.peak_tflops else None
        add("benchmark", "Benchmarked against the existing implementation", WARN,
            f"migrated {run.samples_per_s:,.1f} samples/s ({_where(run)}); {src.name} peak-scaled ESTIMATE "
            + (f"{estimate:,.0f} samples/s" if estimate else "n/a")
            + f" (the same MFU on {tpu_peak:.0f} bf16 TFLOP/s; not a measurement)",
            "compare with the job's real TPU throughput, or run the TPU-style setup here too")
    else:
        add("benchmark", "Benchmarked against the existing implementation", NOT_CHECKED, "no successful run",
            "run the plan")

    # 7. Monitoring of GPU utilisation and memory
    if ran and run.backend == "gpu":
        add("monitoring", "Monitoring of GPU memory and utilisation", PASS,
            f"peak memory read from memory_stats(): {_gib(run.peak_memory_bytes)} of {_gib(run.device_memory_limit_bytes)} "
            f"limit; GPU memory used by other processes read through NVML (Environment tab)",
            "keep reading memory_stats() and NVML in production monitoring")
    else:
        add("monitoring", "Monitoring of GPU memory and utilisation", NOT_CHECKED if not ran else WARN,
            "no GPU on this host: memory figures are CPU figures" if ran else "no successful run",
            "run on the GPU box to read memory_stats() and NVML")

    # 8. Deployment configuration
    env = "; ".join(f"{k}={v['value']}" for k, v in plan.environment.items())
    add("deployment", "Deployment configuration updated", PASS if deployment_file else WARN,
        f"environment for the target: {env}" + (f"; shell snippet: {deployment_file}" if deployment_file else ""),
        "download the snippet and start the job with it" if deployment_file else "write the environment block")

    # Checks the guide implies
    if ran:
        add("recompilation", "No recompilation after warm-up", PASS if run.recompilations == 0 else FAIL,
            f"{run.recompilations} XLA compile(s) after the first step (jax.monitoring); {_where(run)}",
            "none" if run.recompilations == 0 else "fix shapes/dtypes that change between steps (weak types, last batch)")
    else:
        add("recompilation", "No recompilation after warm-up", NOT_CHECKED, "no successful run", "run the plan")
    sync_findings = [f for f in (findings or []) if f.rule == "SYNC001"]
    add("host_sync", "No host synchronisation in the step loop",
        WARN if sync_findings else (PASS if ran else NOT_CHECKED),
        ("this tool's step loop dispatches one step ahead and reads metrics after; " if ran else "")
        + (f"your code: {len(sync_findings)} SYNC001 finding(s) at line(s) "
           + ", ".join(str(f.line) for f in sync_findings) if sync_findings else
           ("your code: no host sync found" if findings is not None else "your code: not checked")),
        "fetch metrics every N steps" if sync_findings else "none")
    prealloc = (run.env or {}).get("XLA_PYTHON_CLIENT_PREALLOCATE") if run else None
    add("preallocation", "Memory preallocation on a shared GPU",
        PASS if prealloc == "false" else (WARN if prealloc else NOT_CHECKED),
        f"XLA_PYTHON_CLIENT_PREALLOCATE={prealloc}, XLA_PYTHON_CLIENT_MEM_FRACTION="
        f"{(run.env or {}).get('XLA_PYTHON_CLIENT_MEM_FRACTION') if run else 'n/a'} in the run's worker",
        "keep preallocation off on a shared GPU" if prealloc == "false" else
        "set XLA_PYTHON_CLIENT_PREALLOCATE=false so the job does not take 75% of the card at start-up")
    if ran and fp32_reference is not None and fp32_reference.ok and run.losses and fp32_reference.losses:
        n = min(len(run.losses), len(fp32_reference.losses))
        a, b = run.losses[n - 1], fp32_reference.losses[n - 1]
        rel = abs(a - b) / max(abs(b), 1e-12)
        add("numerics", f"Numerics of {run.precision} against fp32", PASS if rel <= NUMERICS_TOLERANCE else WARN,
            f"loss after {n} steps: {run.precision} {a:.4f} vs fp32 {b:.4f} ({rel:.1%} apart; tolerance "
            f"{NUMERICS_TOLERANCE:.0%}); {_where(run)}",
            "none" if rel <= NUMERICS_TOLERANCE else "check loss scaling / use bf16; compare over more steps")
    else:
        add("numerics", "Numerics of the chosen precision against fp32", NOT_CHECKED if not (ran and run.precision == "fp32") else NA,
            "no fp32 reference run" if not (ran and run.precision == "fp32") else "the run is fp32",
            "run an fp32 reference over the same steps")
    return items


def to_csv(items: list[ChecklistItem], path: str | Path | None = None) -> str:
    """One row per item: id, item, status, evidence, action."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["id", "item", "status", "evidence", "action"], lineterminator="\n")
    writer.writeheader()
    for it in items:
        writer.writerow({k: csv_cell(v) for k, v in dataclasses.asdict(it).items()})
    if path is not None:
        Path(path).write_text(buf.getvalue())
    return buf.getvalue()


def deployment_snippet(plan: Plan, command: str = "python -m migration run --plan plan.json") -> str:
    """A shell snippet that sets the target's environment and starts the job."""
    lines = ["#!/usr/bin/env bash", f"# Environment for {plan.workload}/{plan.preset} on {plan.gpus} x {plan.target_name}:",
             f"# {plan.per_device_batch} per GPU x {plan.accumulation_steps} accumulation = global batch "
             f"{plan.global_batch}, {plan.precision}, remat {plan.remat}.", "set -euo pipefail"]
    for name, item in plan.environment.items():
        lines.append(f"# {item['why']}")
        lines.append(f"export {name}={_shell_quote(item['value'])}")
    lines.append(command)
    return "\n".join(lines) + "\n"


def _shell_quote(value: str) -> str:
    return "'" + value.replace("'", "'\"'\"'") + "'"
