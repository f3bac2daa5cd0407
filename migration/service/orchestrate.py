"""Running a plan: which runs it makes, recording them, writing the exports, grading the checklist.

One home for what the app's Run button and `python -m migration run --plan` both do. `run_plan` is
a generator of progress events (dicts with an "event" key) ending with a `result` event that
carries a `MigrationResult`; closing the generator early (Stop, a closed browser tab, Ctrl-C)
kills the current worker and records that run as cancelled.

The runs a plan makes, each one definition in `plan_runs`:
- "migrated": the plan on this machine (re-fitted to its memory when made for another device);
- "fp32 reference": the same config in fp32, for the numerics item (when asked, and not fp32); and for an
  fp8 run a "bf16 reference" too;
- "TPU-style": the unchanged TPU setup here: the per-core batch, the source precision, no remat,
  no accumulation (when asked).
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from migration.grading import checklist

from migration.planning import deployment

from migration.config import distributed
from migration.codecheck import CodeCheck
from migration.common import ConfigError, first_line, fmt_gib, fmt_loss, write_csv as write_csv_rows
from migration.config.limits import FP8_PRECISIONS
from migration.config.requests import PlanRequest, RunConfig, validate
from migration.service.history import History, HistoryError
from migration.results import Plan, RunReport
from migration.running.runner import PlanError, RunHandle, start_plan
from migration.grading.scaling import scaling_rows
from migration.running.worker_env import nvidia_gpus, resolve_platform

PROGRESS_EVERY_S = 0.25


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """The extra runs and captures asked for beside the migrated run."""

    fp32_reference: bool = False
    tpu_style: bool = False
    profile: bool = False
    pmap_before: bool = False  # the TPU-era pmap step on the same devices and data: same loss, its throughput
    scaling: bool = False  # both steps at 1, 2, 4, 8 devices (as many as this machine has), per-device batch kept
    tpu_step_ms: float = 0.0  # the user's measured TPU step time at the requested global batch (0: not given)


@dataclasses.dataclass(frozen=True)
class PlanOnThisMachine:
    """A plan's run config here, how it relates to the plan, and the plan for this machine (its
    budget is the one the run is graded against) when the plan was made for another device."""

    config: RunConfig
    note: str
    local_plan: Plan | None
    refitted: bool


@dataclasses.dataclass
class MigrationResult:
    plan: Plan
    note: str
    local_plan: Plan | None
    runs: list[tuple[str, RunReport]]
    checklist: list[checklist.ChecklistItem]
    files: dict[str, str]  # report_csv, checklist_csv, deployment, trace (when captured), scaling_csv
    scaling: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # before/after rows (scaling_rows)

    @property
    def main(self) -> RunReport:
        return self.runs[0][1]


@dataclasses.dataclass
class Recorder:
    """Where a plan's runs are recorded, for whom. With `entry_id` (a submitted job's entry, opened
    when it was queued) the migrated run completes that entry; the other runs and the plans made on
    the way get entries of their own. A history that cannot be written never stops the runs: the
    failure is kept in `errors` (one line each) for the caller to show."""

    history: History
    user: str = ""
    label: str = ""
    entry_id: int | None = None
    errors: list[str] = dataclasses.field(default_factory=list)

    def run(self, name: str, report: RunReport) -> None:
        if report.process_index:  # another process of a multi-process job: process 0 records the job
            return
        if name == "migrated" and self.entry_id is not None:
            self._safely(self.history.complete, self.entry_id, report)
        else:
            self._safely(self.history.add_run, report, label=self._label(name), user=self.user)

    def plan(self, plan: Plan, name: str) -> None:
        self._safely(self.history.add_plan, plan, label=self._label(name), user=self.user)

    def _label(self, name: str) -> str:
        return f"{self.label} · {name}" if self.label else name

    def _safely(self, write: Any, *args: Any, **kwargs: Any) -> None:
        try:
            write(*args, **kwargs)
        except HistoryError as exc:
            self.errors.append(str(exc))


def base_config(p: Plan, **fields: Any) -> RunConfig:
    """The run settings a plan's runs share (steps, learning rate, platform, ...); the memory share
    defaults to the plan's own, so the run is capped as the budget assumed."""
    return RunConfig(**{"memory_fraction": p.memory_fraction, **fields})


SCALING_DEVICES = (1, 2, 4, 8)


def local_device_count(cfg: RunConfig) -> int:
    """Devices a run here can use: the GPUs NVML sees, or on the CPU backend as many XLA devices as
    the scaling table asks for (they share the host's cores)."""
    if resolve_platform(cfg.platform) == "cpu":
        return max(SCALING_DEVICES)
    return len(nvidia_gpus()) or 1


def plan_runs(p: Plan, cfg: RunConfig, options: RunOptions, trace_dir: Path) -> list[tuple[str, RunConfig]]:
    """The runs a plan makes here, in order; `cfg` is the plan's config on this machine."""
    migrated = dataclasses.replace(cfg, profile_steps=3, profile_dir=str(trace_dir)) if options.profile else cfg
    runs = [("migrated", migrated)]
    if options.fp32_reference and cfg.precision != "fp32":
        # fp32 products in fp32: the platform's default would run them as TF32 on compute capability 8.0+
        runs.append(("fp32 reference", dataclasses.replace(cfg, precision="fp32", matmul_precision="highest")))
        if cfg.precision in FP8_PRECISIONS:  # fp8 is judged against the bf16 it replaces, too
            runs.append(("bf16 reference", dataclasses.replace(cfg, precision="bf16")))
    if options.pmap_before or options.scaling:
        runs.append(("pmap (before)", dataclasses.replace(cfg, step_style="pmap", sharding="replicated")))
    if options.scaling:
        for n in (n for n in SCALING_DEVICES if n != cfg.devices and n <= local_device_count(cfg)):
            runs.append((f"jit ×{n}", dataclasses.replace(cfg, devices=n, visible_devices="")))
            runs.append((f"pmap ×{n}", dataclasses.replace(cfg, devices=n, visible_devices="", step_style="pmap",
                                                           sharding="replicated")))
    if options.tpu_style:
        runs.append(("TPU-style", dataclasses.replace(
            cfg, per_device_batch=p.source_per_core_batch, accumulation_steps=1, precision=p.source_precision,
            remat="none")))
    # Only the migrated run writes the checkpoint; the comparison runs start where it starts.
    return runs[:1] + [(name, dataclasses.replace(extra, save_checkpoint="")) for name, extra in runs[1:]]


def run_plan(p: Plan, base: RunConfig, options: RunOptions, export_dir: Path, *, code: CodeCheck | None = None,
             history: History | Recorder | None = None,
             start_run: Callable[[RunConfig], RunHandle] = RunHandle) -> Iterator[dict[str, Any]]:
    """Events while the plan is fitted to this machine and its runs go ("status", "note",
    "progress"), then {"event": "result", "result": MigrationResult}. `start_run` starts each run
    (an executor's: a worker here by default, or on a Ray cluster).

    Raises ConfigError or PlanError (before any run starts) when the settings or the plan are bad
    or the plan cannot fit this machine."""
    recorder = Recorder(history) if isinstance(history, History) else history
    if distributed.is_multiprocess(base) and (options.pmap_before or options.scaling):
        raise ConfigError("coordinator", "a multi-process job runs the plan's jit step only: the pmap step and the "
                                         "scaling runs measure one host; run them without --coordinator")
    here = yield from on_this_machine(p, base)
    if here.local_plan is not None and recorder is not None:
        recorder.plan(here.local_plan, "re-fit to this machine")
    yield {"event": "note", "message": here.note}
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_urlsafe(12)}"  # unguessable: served to its owner only
    export_dir.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, RunReport]] = []
    for name, cfg in plan_runs(p, here.config, options, export_dir / f"trace-{stamp}"):
        report = yield from measure_run(name, cfg, recorder, start_run)
        done.append((name, report))
    evidence = checklist.Evidence(
        plan=p, run=done[0][1], ran_plan=here.local_plan, code=code,
        fp32_reference=dict(done).get("fp32 reference"), bf16_reference=dict(done).get("bf16 reference"),
        tpu_style_run=dict(done).get("TPU-style"),
        pmap_run=dict(done).get("pmap (before)"), tpu_step_ms=options.tpu_step_ms or p.measured_tpu_step_ms,
        scaling_runs=tuple(_recorded_scaling_runs(recorder, done[0][1])))
    items = checklist.evaluate(evidence)
    scaling = scaling_view(done)
    # Of a multi-process job, process 0 writes the exports (every process measured the same job).
    files = {} if done[0][1].process_index else _write_exports(p, done, items, export_dir, stamp, scaling)
    yield {"event": "result", "result": MigrationResult(p, here.note, here.local_plan, done, items, files, scaling)}


def on_this_machine(saved: Plan, base: RunConfig) -> Iterator[dict[str, Any]]:
    """The plan's run config here (returned). A plan made for another device is re-fitted to this
    machine's memory by a local plan with the same global batch, precision and remat, in a planner
    worker that closing this generator stops; raises PlanError when it cannot fit."""
    if not saved.ok:
        raise PlanError("invalid", f"the plan is {saved.status}: {saved.message}")
    if distributed.is_multiprocess(base):
        # Each process sees only its own devices, so no local plan can re-fit the job: it runs as made
        # (validated with the plan's global device count).
        return PlanOnThisMachine(config_as_planned(saved, base), f"runs the plan as made ({saved.target_name}) as "
                                 f"one job of several processes (coordinator {base.coordinator})", None, False)
    validate(base)
    if saved.nodes > 1:
        raise PlanError("invalid", f"the plan spans {saved.nodes} nodes of {saved.gpus_per_node} GPUs and this process "
                                   f"is one: {distributed.LAUNCH_HINT}, e.g. --num-processes {saved.nodes} with one "
                                   "process per node (the plan's deployment script has the sbatch and Kubernetes forms)"
                                   f"; or plan for at most {saved.gpus_per_node} GPUs to run it here")
    batch, accum = saved.per_device_batch, saved.accumulation_steps
    note, local, refitted = f"runs the plan as made ({saved.target_name})", None, False
    if saved.target != "local":
        # The local plan chooses its own attention kernel (the fused one exists on NVIDIA GPUs only).
        local = yield from _local_plan(PlanRequest(
            workload=saved.workload, preset=saved.preset, source=saved.source, global_batch=saved.global_batch,
            model={k: v for k, v in saved.model.items() if k != "attention"}, sharding=saved.sharding,
            per_core_batch=_consistent_per_core(saved), target="local", gpus=saved.gpus,
            memory_fraction=base.memory_fraction, safety_margin=saved.safety_margin, precision=saved.precision,
            remat=saved.remat, compile_for_tpu=False, max_per_device_batch=saved.per_device_batch))
        if not local.ok:
            raise PlanError("invalid", f"the plan does not fit this machine: {local.message}")
        refitted = (local.per_device_batch, local.accumulation_steps) != (batch, accum)
        if refitted:
            note = (f"the plan was made for {saved.target_name}; on {local.target_name} its per-device batch {batch} "
                    f"(x{accum} accumulation) does not fit the local budget, so it runs at {local.per_device_batch} "
                    f"x{local.accumulation_steps} accumulation (global batch {local.global_batch}, found by "
                    f"{local.prediction_method})")
            batch, accum = local.per_device_batch, local.accumulation_steps
        else:
            note = (f"the plan was made for {saved.target_name}; it also fits {local.target_name} as planned "
                    f"({local.prediction_method}). Figures measured here are this machine's, not the target's")
    as_run = dataclasses.replace(saved, per_device_batch=batch, accumulation_steps=accum,
                                 model=dict(local.model if local is not None else saved.model))
    return PlanOnThisMachine(config_as_planned(as_run, base), note, local, refitted)


def config_as_planned(p: Plan, base: RunConfig) -> RunConfig:
    """The run config of a plan exactly as made (its model, per-device batch, accumulation, precision,
    remat, GPUs, sharding and XLA flags) with `base`'s run settings (steps, platform, memory share,
    flags of its own, ...); raises ConfigError."""
    planned_flags = deployment.environment_of(p).get("XLA_FLAGS", {}).get("value", "")  # rebuilt, never read
    return validate(dataclasses.replace(
        base, workload=p.workload, preset=p.preset, model=dict(p.model), per_device_batch=p.per_device_batch,
        accumulation_steps=p.accumulation_steps, precision=p.precision, remat=p.remat, devices=p.gpus,
        sharding=p.sharding, mu_dtype=p.mu_dtype, xla_flags=" ".join(f for f in (base.xla_flags, planned_flags) if f)))


def _consistent_per_core(saved: Plan) -> int | None:
    """The plan's per-core batch when it still multiplies out to its global batch (a plan whose
    global batch changed, or was not a multiple of the cores, leaves it to the default)."""
    per_core = saved.source_per_core_batch
    return per_core if per_core * saved.source_devices == saved.global_batch else None


def _local_plan(req: PlanRequest) -> Iterator[dict[str, Any]]:
    handle = start_plan(req)
    try:
        for ev in handle.events(heartbeat_s=0.5):
            if ev["event"] in ("heartbeat", "candidate"):
                yield {"event": "status", "message": f"fitting the plan to this machine: {_plan_progress(ev)}"}
    finally:
        if handle.plan is None and handle.error is None:  # closed early (Stop, disconnect)
            handle.cancel()
    if handle.plan is None:
        raise handle.error
    return handle.plan


def candidate_text(ev: dict[str, Any]) -> str:
    """A planner candidate's figure: its compiled peak, or the lower bound that ruled it out uncompiled."""
    if ev.get("lower_bound"):
        return f"at least {fmt_gib(ev['predicted_bytes'])} (analytic lower bound, over the budget: not compiled)"
    return fmt_gib(ev["predicted_bytes"], missing="does not fit")


def _plan_progress(ev: dict[str, Any]) -> str:
    if ev["event"] == "candidate":
        return f"batch {ev['per_device_batch']} remat {ev['remat']} x{ev['accumulation_steps']}: {candidate_text(ev)}"
    return f"{ev['elapsed_s']:.0f} s"


def measure_run(name: str, cfg: RunConfig, recorder: Recorder | None,
                start_run: Callable[[RunConfig], RunHandle] = RunHandle) -> Iterator[dict[str, Any]]:
    """One run in a fresh worker: "progress" events (a line of status, the worker's event, and the
    losses of the steps since the last progress event from `first_step` on), then its RunReport
    (returned), recorded when there is a recorder. Closing the generator early kills the worker
    and records the run as cancelled."""
    handle = start_run(cfg)
    try:
        last, first_step, losses, stepped = 0.0, 0, [], False
        for ev in handle.events(heartbeat_s=0.5):
            if ev["event"] == "step":
                first_step = first_step if losses else ev["index"]
                losses.append(ev["loss"])
            now = time.monotonic()
            # The first step is always told (the run has started stepping); later ones at most every
            # PROGRESS_EVERY_S, as heartbeats.
            held = ev["event"] == "heartbeat" or (ev["event"] == "step" and stepped)
            if held and now - last < PROGRESS_EVERY_S:
                continue
            stepped = stepped or ev["event"] == "step"
            last = now
            # The loss values since the last progress event: a watcher draws the curve in increments.
            yield {"event": "progress", "run": name, "steps": cfg.steps, "worker_event": ev,
                   "status": describe(name, cfg.steps, ev), "losses": losses, "first_step": first_step}
            losses = []
    except GeneratorExit:  # Stop or disconnect: never leave a worker behind, keep what it did
        _record_unfinished(handle, cfg, name, recorder, "cancelled", "stopped before it finished")
        raise
    except Exception as exc:  # noqa: BLE001 - recorded with its cause, then re-raised unchanged
        _record_unfinished(handle, cfg, name, recorder, "crashed", f"the run's progress could not be read: "
                                                                   f"{type(exc).__name__}: {first_line(exc)}")
        raise
    if recorder is not None:
        recorder.run(name, handle.report)
    return handle.report


def _record_unfinished(handle: RunHandle, cfg: RunConfig, name: str, recorder: Recorder | None, kind: str,
                       message: str) -> None:
    handle.cancel()
    if recorder is not None:
        status = "cancelled" if kind == "cancelled" else "failed"
        recorder.run(name, RunReport.from_events(cfg, handle.events_so_far, status=status, failure_kind=kind,
                                                 message=message))


def describe(name: str, steps: int, ev: dict[str, Any]) -> str:
    """One line of progress for a worker event."""
    kind = ev["event"]
    if kind == "started":
        return (f"{name}: started on {ev['device_kind']} x{ev['device_count']} ({ev['backend']}), JAX "
                f"{ev['jax_version']}, {ev['param_count']:,} parameters; compiling…")
    if kind == "compiled":
        return (f"{name}: compiled in {ev['compile_s']:.1f} s, predicted peak "
                f"{fmt_gib(ev['predicted_peak_bytes'], 3)} per device; running…")
    if kind == "step":
        return (f"{name}: step {ev['index'] + 1} of {steps}, loss {fmt_loss(ev['loss'])}, {ev['step_ms']:.1f} ms"
                + (" (skipped: non-finite gradients)" if ev.get("skipped") else ""))
    if kind == "heartbeat":
        return f"{name}: working… {ev['elapsed_s']:.0f} s"
    return f"{name}: {kind}"


def _recorded_scaling_runs(recorder: Recorder | None, main: RunReport) -> list[RunReport]:
    if recorder is None:
        return []
    try:
        return scaling_runs(recorder.history, main)
    except HistoryError as exc:
        recorder.errors.append(str(exc))
        return []


def scaling_runs(history: History, main: RunReport) -> list[RunReport]:
    """Successful runs of the same configuration on the same device kind, at any device count."""
    same = []
    for e in history.entries(kind="run", workload=main.workload, status="ok", payload=False):
        if (e["preset"], e["precision"], e["remat"], e["per_device_batch"], e["device_kind"]) == \
                (main.preset, main.precision, main.remat, main.per_device_batch, main.device_kind):
            report = history.run_report(e["id"])
            if report is not None and (report.model, report.sharding, getattr(report, "step_style", "jit")) == \
                    (main.model, main.sharding, getattr(main, "step_style", "jit")):
                same.append(report)
    return same


def _is_scaling_run(name: str) -> bool:
    return name in ("migrated", "pmap (before)") or name.startswith(("jit ×", "pmap ×"))


def scaling_view(done: list[tuple[str, RunReport]]) -> list[dict[str, Any]]:
    """The before (pmap) and after (jit) runs side by side with their scaling figures
    (`migration.grading.scaling.scaling_rows`), fewest devices first; empty without a pmap run."""
    named = sorted(((n, r) for n, r in done if _is_scaling_run(n)), key=lambda nr: (nr[1].devices, nr[1].step_style))
    if not any(r.step_style == "pmap" for _, r in named):
        return []
    return [{"run": n, **row} for (n, _), row in zip(named, scaling_rows([r for _, r in named]))]


SCALING_COLUMNS = ("scaling_efficiency", "jit_over_pmap", "losses_match", "max_loss_rel_diff")


def _write_exports(p: Plan, done: list[tuple[str, RunReport]], items: list[checklist.ChecklistItem],
                   export_dir: Path, stamp: str, scaling: list[dict[str, Any]]) -> dict[str, str]:
    main = done[0][1]
    stem = f"{main.workload}-{main.preset}-{stamp}"
    files = {"report_csv": export_dir / f"report-{stem}.csv", "checklist_csv": export_dir / f"checklist-{stem}.csv",
             "deployment": export_dir / f"deploy-{stem}.sh"}
    by_run = {row["run"]: row for row in scaling}
    write_csv_rows([{"run": name, **r.csv_row(), **{k: by_run.get(name, {}).get(k) for k in SCALING_COLUMNS}}
                    for name, r in done], path=files["report_csv"])
    if scaling:
        files["scaling_csv"] = export_dir / f"scaling-{stem}.csv"
        write_csv_rows(scaling, path=files["scaling_csv"])
    checklist.to_csv(items, files["checklist_csv"])
    files["deployment"].write_text(deployment.deployment_snippet(p))
    out = {k: str(v) for k, v in files.items()}
    if main.profile and main.profile.get("top_ops"):
        out["trace"] = main.profile["path"]
    return out
