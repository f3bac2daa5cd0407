"""The migration checklist, graded only from evidence about the user's migrated job.

The guide ends with eight items that teams tick by hand; four more follow from it. Each item is one
small function in `ITEMS` (id -> title, the statuses it can return, the function) of the evidence:
the plan, the run that actually happened (after any re-fit to this machine, with the plan for that
machine), the code check of the user's own code, and optional extra runs (an fp32 reference, the
TPU-style setup run here, runs at other device counts).

Grading rules, the same for every item:
- `pass` only when evidence about the user's job on the target shows it: a measurement on the
  target GPU, or the code check of the user's own code. This tool's own defaults never pass an item.
- `warn` when the evidence is only predicted, estimated, or measured on another device than the
  target (a CPU backend, another GPU model); the action says what would confirm it.
- `fail` when the evidence shows the item is not met.
- `not checked` when there is no evidence; the action says what to supply.
- `n/a` when the item does not apply (an fp32 run needs no fp32 reference).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from migration.common import fmt_bytes, fmt_count, fmt_loss, write_csv
from migration.figures import tpu_samples_per_s
from migration.grading import environment
from migration.grading.scaling import loss_tolerance, max_loss_rel_diff
from migration.config.limits import FP8_PRECISIONS
from migration.grading.evidence import (CHECK_CODE, FAIL, NA, NO_CODE, NOT_CHECKED, PASS, WARN, ChecklistItem, Evidence,
                                        Grade, ItemSpec, code_scope, device_count, elsewhere, where)
from migration.grading.moe import grade_moe_all_to_all, grade_moe_dropped, grade_moe_grouped_gemm, grade_moe_router
from migration.results import RunReport

NUMERICS_TOLERANCE = 0.05  # final loss within 5% of the fp32 reference over the same steps
FP8_TOLERANCE = 0.02  # an fp8 run's final loss within 2% of the bf16 run's over the same steps
SCALING_EFFICIENCY = 0.8  # per-device throughput at N devices against 1, for a pass
BENCHMARK_RATIO = 0.9  # migrated throughput against the user's measured TPU job, for a pass
PMAP_RULES = ("PMAP001", "PMAP002", "PMAP003")
API_RULES = ("TPU001", *PMAP_RULES, "REMOVED001", "REMOVED002", "TOPO001", "GCS001")
SHAPE_RULES = ("SHAPE001", "TRACE001")
MONITOR_HINT = "read memory_stats() (peak_bytes_in_use, bytes_limit) and NVML utilisation in the training job"


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _lines(findings: list, total: int = 0) -> str:
    """The first findings' places; an ellipsis when there are more (`total`: kept and counted ones)."""
    return ", ".join(f"{f.rule} {Path(f.file).name}:{f.line}" for f in findings[:8]) + \
        (" …" if max(len(findings), total) > 8 else "")


def no_jax_code(ev: Evidence, measured: str = "") -> Grade | None:
    """`not checked` when there is no code check, or none of its files uses JAX (a file without JAX
    says nothing about a JAX job); None when the code check can grade."""
    if ev.code is None:
        return NOT_CHECKED, NO_CODE + measured, CHECK_CODE
    if not ev.code.jax_files:
        return NOT_CHECKED, f"{code_scope(ev.code)}: none of them uses JAX (no import of jax, flax, optax, ...)" \
            + measured, "check the script that builds and runs your training step"
    return None


# -- the items ---------------------------------------------------------------------------------

def grade_profile(ev: Evidence) -> Grade:
    r = ev.run
    if not ev.ran or not r.profile or not r.profile.get("top_ops"):
        timing = f"; compile {r.compile_s:.2f} s vs step {r.step_ms_median:.2f} ms (median)" if ev.ran else ""
        return NOT_CHECKED, "no profile was captured for this run" + timing, \
            "run again with profiling on (a few steps under jax.profiler.trace)"
    p = r.profile
    top = ", ".join(f"{o['name']} {o['total_ms'] / max(1, p['steps']):.2f} ms/step" for o in p["top_ops"][:5])
    text = f"{p['steps']} step(s) traced ({p['path']}); time by op: {top}; {where(r)}"
    if ev.on_target(r):
        return PASS, text, "open the trace in Perfetto (ui.perfetto.dev) or XProf; attack the largest ops first"
    return WARN, f"{text}; {elsewhere(ev, r)}: bottlenecks on the GPU differ", \
        f"capture the profile on {ev.plan.target_name}"


def grade_batch(ev: Evidence) -> Grade:
    plan, r, bp = ev.plan, ev.run, ev.budget_plan
    if not plan.ok:
        return FAIL, plan.message, "choose a larger GPU, a smaller preset, or shard parameters and optimizer state"
    planned = (f"plan for {plan.target_name}: TPU {plan.source_per_core_batch} per core -> {plan.per_device_batch} per GPU "
               f"x {plan.gpus} x {plan.accumulation_steps} accumulation = {plan.global_batch} (requested "
               f"{plan.requested_global_batch}); predicted {fmt_bytes(plan.predicted_peak_bytes)} ({plan.prediction_method}) "
               f"of a {fmt_bytes(plan.budget_bytes)} budget")
    if r is not None and r.failure_kind == "oom":
        return FAIL, (f"{planned}; the run at {r.per_device_batch} per device x {r.accumulation_steps} ran out of memory "
                      f"({r.message[:200]})"), "lower the per-device batch (raise accumulation) or choose remat"
    if ev.ran and ev.on_target(r) and r.peak_memory_bytes is not None:
        refit = (r.per_device_batch, r.accumulation_steps) != (plan.per_device_batch, plan.accumulation_steps)
        ran = (f"ran {r.per_device_batch} per device x {r.devices} x {r.accumulation_steps} = {r.global_batch}: measured "
               f"peak {fmt_bytes(r.peak_memory_bytes)} of a {fmt_bytes(bp.budget_bytes)} budget; {where(r)}")
        if r.peak_memory_bytes > bp.budget_bytes:
            return FAIL, f"{planned}; {ran}", "lower the per-device batch or choose remat: the measured peak is over budget"
        if refit:
            return WARN, f"{planned}; {ran}; re-fitted on this machine, so the planned batch itself did not run", \
                "run the plan as made on a GPU with the planned memory share to confirm it"
        if r.global_batch != plan.requested_global_batch:
            return WARN, f"{planned}; {ran}; the global batch changed", "rescale the learning rate, or choose a divisible global batch"
        return PASS, f"{planned}; {ran}", "keep the planned batch and accumulation"
    if ev.ran and ev.on_target(r):  # on the target, but without a peak figure
        measured = f"; the run on {r.device_kind} reported no peak memory (memory_stats() gave none)"
    elif ev.ran:
        refit = (r.per_device_batch, r.accumulation_steps) != (plan.per_device_batch, plan.accumulation_steps)
        measured = (f"; the run here ({r.per_device_batch} per device x {r.accumulation_steps}, "
                    f"{'re-fitted to this machine' if refit else 'as planned'}) peaked at "
                    f"{fmt_bytes(r.peak_memory_bytes)} ({r.peak_memory_source}); {elsewhere(ev, r)}")
    elif r is not None:
        measured = f"; the run {r.status} ({r.failure_kind}: {r.message[:160]})"
    else:
        measured = "; not run yet"
    how = "an analytic estimate" if plan.prediction_method == "estimate" else "a compile for the target"
    return WARN, planned + measured, f"the fit is {how}, not a measurement: run the plan on {plan.target_name} to confirm"


def grade_apis(ev: Evidence) -> Grade:
    if (unchecked := no_jax_code(ev)) is not None:
        return unchecked
    found = ev.findings(API_RULES)
    errors = [f for f in found if f.severity == "error"]
    scope = code_scope(ev.code)
    if errors:
        n = ev.finding_count(API_RULES, "error")
        return FAIL, f"{scope}: {n} TPU-only or removed API call(s): {_lines(errors, n)}", "apply each finding's replacement"
    if found:
        n = ev.finding_count(API_RULES)
        return WARN, f"{scope}: {n} outdated API use(s): {_lines(found, n)}", "apply each finding's replacement"
    return PASS, f"{scope}: no TPU-only, pmap-era or removed APIs, fixed slice shapes or Cloud Storage paths " \
                 f"({', '.join(API_RULES)})", "nothing to replace"


def grade_remat(ev: Evidence) -> Grade:
    plan, r = ev.plan, ev.run
    if not plan.ok:
        return NA, "no remat policy makes the plan fit", "see the batch item"
    per_policy = ", ".join(f"{k} {v}" for k, v in plan.max_batch_by_remat.items())
    text = f"policy {plan.remat} ({plan.remat_chosen_by}); largest batch per policy: {per_policy} ({plan.prediction_method})"
    if plan.remat_chosen_by == "override":
        return WARN, text + "; set by override: the planner did not compare policies", \
            "plan again with remat auto to compare policies by predicted step time"
    if plan.prediction_method == "estimate":
        return WARN, text + "; chosen from an analytic estimate", \
            "install the CUDA plugin (jax[cuda12]) so the planner compiles for the target, or run on it"
    if plan.prediction_method == "compiled-local" and plan.planned_on == "cpu":
        return WARN, text + "; a CPU-backend compile does not show remat savings", f"plan for {plan.target_name} instead"
    if ev.ran and ev.on_target(r) and r.remat == plan.remat and r.peak_memory_bytes is not None \
            and r.peak_memory_bytes <= ev.budget_plan.budget_bytes:
        return PASS, (f"{text}; the run under {r.remat} peaked at {fmt_bytes(r.peak_memory_bytes)} of "
                      f"{fmt_bytes(ev.budget_plan.budget_bytes)}, {r.step_ms_median:.1f} ms per step; {where(r)}"), \
            "keep it; compare step time against the next policy in the plan's ranking"
    return WARN, text + "; not yet measured on the target", f"run the plan on {plan.target_name} to confirm the choice"


def grade_scaling(ev: Evidence) -> Grade:
    plan = ev.plan
    if plan.gpus == 1:
        return NA, f"the plan runs on one {plan.target_name}", "none"
    runs = [r for r in ev.scaling_runs if r.ok and r.device_count and r.samples_per_s]
    counts = sorted({r.device_count for r in runs})
    spans = f"{plan.gpus} GPUs" + (f" over {plan.nodes} nodes" if plan.nodes > 1 else "")
    if len(counts) < 2:
        shown = f" ({ev.run.device_count})" if ev.run is not None and ev.run.device_count else ""
        return NOT_CHECKED, f"runs of this configuration at only one device count{shown}; the plan uses {spans}", \
            f"run the plan at 1 and {plan.gpus} devices and compare samples/s per device"
    per_device = {r.device_count: r.samples_per_s / r.device_count for r in runs}
    text = "samples/s per device: " + ", ".join(f"{n} device(s) {per_device[n]:,.1f}" for n in counts) + f"; {where(runs[0])}"
    off = [r for r in runs if not ev.on_target(r)]
    if off:
        shared = ": XLA's CPU devices share the host's cores" if off[0].backend != "gpu" else ""
        return WARN, f"{text}; {elsewhere(ev, off[0])}{shared}", \
            f"measure on {plan.gpus} x {plan.target_name}"
    efficiency = per_device[counts[-1]] / per_device[counts[0]]
    text += f"; efficiency {efficiency:.0%} from {counts[0]} to {counts[-1]}"
    if counts[-1] < plan.gpus:
        links = " and the links between nodes" if plan.nodes > 1 else ""
        return WARN, f"{text}; the plan uses {spans}: the largest count{links} not measured", \
            f"measure at {plan.gpus} GPUs" + (f" on {plan.nodes} nodes" if plan.nodes > 1 else "")
    if efficiency >= SCALING_EFFICIENCY:
        return PASS, text, "scale out while per-device throughput holds"
    return WARN, f"{text} (under {SCALING_EFFICIENCY:.0%})", \
        "overlap the all-reduce (latency-hiding scheduler) or raise the per-device batch"


def grade_benchmark(ev: Evidence) -> Grade:
    plan, r, tpu = ev.plan, ev.run, ev.tpu_style_run
    if not ev.ran:
        return NOT_CHECKED, "no successful run of the plan", "run the plan"
    here = ""
    if tpu is not None and tpu.ok and tpu.samples_per_s:
        here = (f"; the TPU-style setup run here: {fmt_count(tpu.samples_per_s, 'samples/s')} "
                f"({r.samples_per_s / tpu.samples_per_s:.2f}x; the same device, not your TPU job)")
    elif tpu is not None:
        here = f"; the TPU-style setup run here {tpu.status} ({tpu.failure_kind or 'no throughput'})"
    migrated = f"migrated {fmt_count(r.samples_per_s, 'samples/s')} on {device_count(r)} device(s) ({where(r)})"
    measured_ms = ev.tpu_step_ms or plan.measured_tpu_step_ms
    if not measured_ms:
        predicted = tpu_samples_per_s(plan)  # the plan's own TPU figure, the one its before/after panel shows
        guess = (f"; the plan predicts your TPU job at {predicted.text()} ({predicted.how}), a prediction, not your "
                 "job's measurement" if predicted is not None else "")
        return NOT_CHECKED, f"no measured figure of your TPU job; {migrated}{here}{guess}", \
            (f"enter your TPU job's measured step time (ms per optimizer step at a global batch of "
             f"{plan.requested_global_batch}) and run again")
    tpu_rate = plan.requested_global_batch / (measured_ms / 1e3)
    ratio = r.samples_per_s / tpu_rate
    text = (f"{migrated} vs your {plan.source_name} job {fmt_count(tpu_rate, 'samples/s')} ({measured_ms:g} ms per step at a "
            f"global batch of {plan.requested_global_batch}, as you measured it): {ratio:.2f}x{here}")
    if not ev.on_target(r):
        return WARN, f"{text}; {elsewhere(ev, r)}", f"run the plan on {plan.gpus} x {plan.target_name}"
    if device_count(r) < plan.gpus:
        return WARN, (f"{text}; measured on {device_count(r)} of the plan's {plan.gpus} GPUs: at linear scaling "
                      f"{ratio * plan.gpus / device_count(r):.2f}x, an ESTIMATE"), \
            f"run the plan on all {plan.gpus} GPUs"
    if ratio >= BENCHMARK_RATIO:
        return PASS, text, "keep the migrated setup"
    return WARN, f"{text} (under {BENCHMARK_RATIO:.1f}x)", \
        "the migrated job is slower than your TPU job: check the ranking's next choice (remat, batch, sharding)"


def grade_monitoring(ev: Evidence) -> Grade:
    measured = (f"; this run's peak {fmt_bytes(ev.run.peak_memory_bytes)} ({ev.run.peak_memory_source})"
                if ev.ran else "")
    if (unchecked := no_jax_code(ev, measured)) is not None:
        return unchecked
    reads = [u for u in ev.code.monitoring if u.kind in ("memory", "utilisation")]
    traces = [u for u in ev.code.monitoring if u.kind == "trace"]
    if reads:
        listed = ", ".join(f"{u.call} {Path(u.file).name}:{u.line}" for u in reads[:6])
        return PASS, f"{code_scope(ev.code)}: your code reads device memory or utilisation: {listed}{measured}", \
            "keep it, and alert on bytes_in_use near bytes_limit"
    if traces:
        listed = ", ".join(f"{u.call} {Path(u.file).name}:{u.line}" for u in traces[:6])
        return WARN, (f"{code_scope(ev.code)}: your code captures profiler traces ({listed}) but reads no memory or "
                      f"utilisation figure a job can watch{measured}"), MONITOR_HINT
    return WARN, f"{code_scope(ev.code)}: no memory_stats(), NVML or nvidia-smi reads found{measured}", MONITOR_HINT


def _env_findings(checks: list[environment.EnvCheck]) -> str:
    return "; ".join(c.text() for c in checks)


def _env_grade(checks: list[environment.EnvCheck], scope: str, keep: str) -> Grade:
    """The grade of the compared settings: any unsafe fails, any other difference warns, all as
    planned passes."""
    verdict = environment.worst(checks)
    text = f"{scope}: {_env_findings(checks)}"
    if verdict == environment.UNSAFE:
        return FAIL, text, "set them to the plan's values (see the deployment snippet)"
    if verdict != environment.SAME:
        return WARN, text, "set them to the plan's values as literals, before importing jax or in the launcher"
    return PASS, text, keep


def grade_deployment(ev: Evidence) -> Grade:
    if ev.code is None:
        return NOT_CHECKED, NO_CODE, "download the deployment snippet and check your launcher with the code check"
    scope = code_scope(ev.code)
    late = ev.findings(("ENV001",))
    if late:
        return FAIL, f"{scope}: set after `import jax`, so JAX ignores them: {_lines(late)}", \
            "set them before the first import of jax, or in the launching shell (see the deployment snippet)"
    tpu_env = [s for s in ev.code.env_settings if s.value and "tpu" in s.value.lower()]
    if tpu_env:
        return FAIL, f"{scope}: TPU-specific settings: " + ", ".join(
            f"{s.name}={s.value} line {s.line}" for s in tpu_env), "remove them; use the deployment snippet's environment"
    if not ev.code.env_settings and not ev.code.jax_files:
        return NOT_CHECKED, f"{scope}: no JAX and no environment settings in them", \
            "check the launcher or training script that sets the job's environment"
    checks = environment.compare(ev.plan, ev.code.env_settings)
    grade = _env_grade(checks, f"{scope} against the plan's environment", "keep them in step with the plan")
    return _unless_code_says(ev, grade, "TPUENV001", "TPU-only variables that do nothing on GPUs",
                             "drop them; carry their tuning over as GPU flags in XLA_FLAGS")


def _unless_code_says(ev: Evidence, grade: Grade, rule: str, what: str, action: str) -> Grade:
    """`grade`, or a warning naming `rule`'s findings in the user's code when it would pass without them."""
    found = ev.findings((rule,))
    if grade[0] != PASS or not found:
        return grade
    return WARN, f"{grade[1]}; but {what}: {_lines(found)}", action


def grade_preallocation(ev: Evidence) -> Grade:
    if ev.code is None:
        return NOT_CHECKED, NO_CODE, CHECK_CODE
    settings = [s for s in ev.code.env_settings if s.name in environment.MEMORY_VARS]
    if not settings and not ev.code.jax_files:
        return NOT_CHECKED, f"{code_scope(ev.code)}: no JAX and no XLA_PYTHON_CLIENT_* settings in them", CHECK_CODE
    late = [s for s in settings if not s.before_import]
    if late:
        return FAIL, "set after `import jax` (ignored): " + ", ".join(f"{s.name} line {s.line}" for s in late), \
            "move them before the first import of jax"
    checks = environment.compare(ev.plan, settings, environment.MEMORY_VARS)
    return _env_grade(checks, code_scope(ev.code), "keep preallocation off on a shared GPU")


def grade_recompilation(ev: Evidence) -> Grade:
    if not ev.ran:
        return NOT_CHECKED, "no successful run", "run the plan"
    r = ev.run
    measured = f"{r.recompilations} XLA compile(s) after the first step (jax.monitoring); {where(r)}"
    if r.recompilations:
        return FAIL, measured, "fix shapes or dtypes that change between steps (weak types, the last batch)"
    if ev.code is None or not ev.code.jax_files:
        unchecked = NO_CODE if ev.code is None else f"{code_scope(ev.code)}: none of them uses JAX, so"
        return WARN, f"{measured}; {unchecked} for shapes that change between steps", CHECK_CODE
    found = ev.findings(SHAPE_RULES)
    if found:
        return WARN, f"{measured}; your code: {_lines(found)}", "drop or pad the last batch; use lax.cond for traced branches"
    clean = f"{measured}; {code_scope(ev.code)}: no varying batch shapes or traced Python branches"
    if not ev.on_target(r):
        return WARN, f"{clean}; {elsewhere(ev, r)}", f"confirm on {ev.plan.target_name}"
    return PASS, clean, "none"


def grade_host_sync(ev: Evidence) -> Grade:
    if (unchecked := no_jax_code(ev)) is not None:
        return unchecked
    found = ev.findings(("SYNC001",))
    if found:
        n = ev.finding_count(("SYNC001",))
        return WARN, f"{code_scope(ev.code)}: {n} host sync(s) in the step loop: {_lines(found, n)}", \
            "keep metrics on the device and fetch them every N steps"
    return PASS, f"{code_scope(ev.code)}: no host sync in the training loop", "none"


def grade_numerics(ev: Evidence) -> Grade:
    r, ref = ev.run, ev.fp32_reference
    if ev.ran and r.precision == "fp32":
        return NA, "the run is fp32", "none"
    if ev.ran and r.precision in FP8_PRECISIONS:
        return _grade_fp8(ev)
    if not ev.ran or ref is None or not ref.ok or not r.losses or not ref.losses:
        return NOT_CHECKED, "no fp32 reference run over the same steps", "run an fp32 reference over the same steps"
    compared = _final_losses(r, ref, "fp32", NUMERICS_TOLERANCE, "check loss scaling (fp16) or use bf16")
    if isinstance(compared, tuple) and len(compared) == 3:
        return compared
    text, rel = compared
    if ref.fp32_matmul_precision not in (None, "fp32"):
        return WARN, f"{text}; the reference computed its fp32 products as {ref.fp32_matmul_precision}, not fp32", \
            "run the fp32 reference at jax_default_matmul_precision='highest' (this tool's reference does)"
    if rel > NUMERICS_TOLERANCE:
        return WARN, text, "check loss scaling or use bf16; compare over more steps"
    if not ev.on_target(r):
        return WARN, f"{text}; {elsewhere(ev, r)}: GPU kernels round differently", \
            f"repeat the comparison on {ev.plan.target_name}"
    return _unless_code_says(ev, (PASS, text, "none"), "BF16OPT001",
                             "your code keeps optimizer state or accumulators in 16 bits, which this run does not",
                             "keep optimizer moments and accumulators in float32")


def _final_losses(r: RunReport, ref: RunReport, name: str, tolerance: float, fail_action: str,
                  note: str = "") -> Grade | tuple[str, float]:
    """The run's final loss against its `name` reference's over their common steps: a grade where either is
    not finite, else the comparison's text and relative gap."""
    n = min(len(r.losses), len(ref.losses))
    a, b = r.losses[n - 1], ref.losses[n - 1]
    if not _finite(b):
        return NOT_CHECKED, f"the {name} reference's loss after {n} steps is {fmt_loss(b)}: no reference to compare " \
            "with", f"lower the learning rate and run the {name} reference again"
    if not _finite(a):
        return FAIL, f"{r.precision} loss after {n} steps is {fmt_loss(a)}; {name} {fmt_loss(b)}; {where(r)}", fail_action
    rel = abs(a - b) / max(abs(b), 1e-12)
    return (f"loss after {n} steps: {r.precision} {a:.4f} vs {name} {b:.4f} ({rel:.1%} apart; tolerance "
            f"{tolerance:.0%}); {where(r)}{note}"), rel


def _grade_fp8(ev: Evidence) -> Grade:
    """An fp8 run against the bf16 run it replaces (same config, steps and data): the final losses within
    FP8_TOLERANCE; on the CPU backend fp8 is emulated, so a match there says nothing of the GPU's kernels."""
    r, ref = ev.run, ev.bf16_reference
    if ref is None or not ref.ok or not r.losses or not ref.losses:
        return NOT_CHECKED, f"no bf16 run beside the {r.precision} run over the same steps", \
            "run the plan with the fp32 reference, which for an fp8 plan also runs it in bf16"
    emulated = "; fp8 is emulated on the CPU backend (converted and computed wider)" if r.backend == "cpu" else ""
    compared = _final_losses(r, ref, "bf16", FP8_TOLERANCE, "use bf16, or keep the first and last layers out of fp8",
                             emulated)
    if isinstance(compared, tuple) and len(compared) == 3:
        return compared
    text, rel = compared
    if rel > FP8_TOLERANCE:
        return WARN, text, "compare over more steps; if the gap grows, use bf16"
    if not ev.on_target(r):
        return WARN, f"{text}; {elsewhere(ev, r)}: the GPU's fp8 kernels round differently", \
            f"repeat the comparison on {ev.plan.target_name}"
    return PASS, text, "none"


def grade_pmap(ev: Evidence) -> Grade:
    r, before = ev.run, ev.pmap_run
    pmap_calls = ev.findings(PMAP_RULES)
    if pmap_calls:  # whatever the runs show, the user's own code still uses pmap
        n = ev.finding_count(PMAP_RULES)
        return FAIL, f"{code_scope(ev.code)}: your code still uses pmap: {_lines(pmap_calls, n)}", \
            "replace pmap and its collectives with jit over a Mesh with NamedSharding (each finding's replacement)"
    if before is None:
        return NOT_CHECKED, "the TPU-era pmap step was not run beside the migrated step", \
            "run the plan with the pmap 'before' step (same devices, same data) to compare loss and throughput"
    if not (ev.ran and r.losses):
        ran = f"{r.status} ({r.failure_kind or 'no losses'})" if r is not None else "has not run"
        return NOT_CHECKED, f"the migrated step {ran}, so there is nothing to compare the pmap step with", \
            "run both steps again"
    if not (before.ok and before.losses):
        return NOT_CHECKED, f"the pmap step {before.status} ({before.failure_kind or 'no losses'})", \
            "run both steps again"
    worst = max_loss_rel_diff(before, r)
    ratio = r.samples_per_s / before.samples_per_s if r.samples_per_s and before.samples_per_s else None
    text = (f"jit with shardings vs pmap + lax.pmean on {device_count(r)} {r.device_kind} device(s), same data: "
            f"largest relative loss difference {worst:.1e} over {len(r.losses)} steps; throughput "
            + (f"{r.samples_per_s:,.1f} vs {before.samples_per_s:,.1f} samples/s ({ratio:.2f}x)" if ratio else "n/a")
            + f"; {where(r)}")
    text += f" (tolerance {loss_tolerance(r.precision):.0e} for {r.precision})"
    if worst > loss_tolerance(r.precision):
        return FAIL, text, "the migrated step does not compute what the pmap step did: compare their gradients"
    if ev.code is None or not ev.code.jax_files:
        unchecked = NO_CODE if ev.code is None else f"{code_scope(ev.code)} found no JAX in them"
        return WARN, f"{text}; this compares the tool's two steps: {unchecked} for pmap-era calls", CHECK_CODE
    text += f"; {code_scope(ev.code)}: no pmap-era calls"
    if not (ev.on_target(r) and ev.on_target(before)):
        return WARN, f"{text}; {elsewhere(ev, r)}", f"compare the two steps' throughput on {ev.plan.target_name}"
    return PASS, text, "retire the pmap step; keep jit with NamedSharding"


ITEMS: dict[str, ItemSpec] = {
    # The guide's eight items
    "profile": ItemSpec("Profile for memory and compute bottlenecks", (PASS, WARN, NOT_CHECKED), grade_profile),
    "batch": ItemSpec("Batch sizes adjusted for GPU memory", (PASS, WARN, FAIL), grade_batch),
    "apis": ItemSpec("Accelerator-specific APIs replaced", (PASS, WARN, FAIL, NOT_CHECKED), grade_apis),
    "remat": ItemSpec("Gradient checkpointing", (PASS, WARN, NA), grade_remat),
    "scaling": ItemSpec("Multi-GPU scaling tested", (PASS, WARN, NA, NOT_CHECKED), grade_scaling),
    "benchmark": ItemSpec("Benchmarked against the existing implementation", (PASS, WARN, NOT_CHECKED), grade_benchmark),
    "monitoring": ItemSpec("Monitoring of GPU memory and utilisation", (PASS, WARN, NOT_CHECKED), grade_monitoring),
    "deployment": ItemSpec("Deployment configuration updated", (PASS, WARN, FAIL, NOT_CHECKED), grade_deployment),
    # Checks the guide implies
    "recompilation": ItemSpec("No recompilation after warm-up", (PASS, WARN, FAIL, NOT_CHECKED), grade_recompilation),
    "host_sync": ItemSpec("No host synchronisation in the step loop", (PASS, WARN, NOT_CHECKED), grade_host_sync),
    "preallocation": ItemSpec("Memory preallocation on a shared GPU", (PASS, WARN, FAIL, NOT_CHECKED), grade_preallocation),
    "numerics": ItemSpec("Numerics of the chosen precision against fp32", (PASS, WARN, FAIL, NA, NOT_CHECKED),
                         grade_numerics),
    "pmap": ItemSpec("pmap replaced by jit with shardings, same results", (PASS, WARN, FAIL, NOT_CHECKED), grade_pmap),
    # A mixture-of-experts migration's
    "moe_dropped": ItemSpec("MoE token slots dropped under the bound", (PASS, WARN, FAIL, NA, NOT_CHECKED),
                            grade_moe_dropped),
    "moe_grouped_gemm": ItemSpec("MoE experts as grouped products, not a dense loop over experts",
                                 (PASS, WARN, FAIL, NA, NOT_CHECKED), grade_moe_grouped_gemm),
    "moe_all_to_all": ItemSpec("Expert-parallel all-to-all inside the NVLink domain", (PASS, WARN, NA, NOT_CHECKED),
                               grade_moe_all_to_all),
    "moe_router_fp32": ItemSpec("MoE router's softmax and top-k in float32", (PASS, WARN, FAIL, NA, NOT_CHECKED),
                                grade_moe_router),
}


class UndeclaredStatus(RuntimeError):
    """A grade returned a status its item does not declare: a bug in the grade, not in the evidence."""


def grade_items(specs: dict[str, ItemSpec], ev: Any) -> list[ChecklistItem]:
    """Each item of `specs` graded from `ev`, in order. A status outside the item's declared
    `statuses` raises `UndeclaredStatus` rather than reaching a report."""
    items = []
    for item_id, spec in specs.items():
        status, evidence, action = spec.grade(ev)
        if status not in spec.statuses:
            raise UndeclaredStatus(f"checklist item {item_id!r} graded {status!r}, which it does not declare "
                                   f"(its statuses: {', '.join(spec.statuses)})")
        items.append(ChecklistItem(item_id, spec.title, status, evidence, action))
    return items


def evaluate(ev: Evidence) -> list[ChecklistItem]:
    return grade_items(ITEMS, ev)


def to_csv(items: list[ChecklistItem], path: str | Path | None = None) -> str:
    """One row per item: id, item, status, evidence, action."""
    return write_csv([dataclasses.asdict(i) for i in items], ["id", "item", "status", "evidence", "action"], path)
