"""Running a plan: which runs it makes, recording them, writing the exports, grading the checklist.

One home for what the app's Run button and `python -m migration run --plan` both do. `run_plan` is
a generator of progress events (dicts with an "event" key) ending with a `result` event that
carries a `MigrationResult`; closing the generator early (Stop, a closed browser tab, Ctrl-C)
kills the current worker and records that run as cancelled.

The runs a plan makes, each one definition in `plan_runs`:
- "migrated": the plan on this machine (re-fitted to its memory when made for another device);
- "fp32 reference": the same config in fp32, for the numerics item (when asked, and not fp32);
- "TPU-style": the unchanged TPU setup here: the per-core batch, the source precision, no remat,
  no accumulation (when asked).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from migration import checklist
from migration.codecheck import CodeCheck
from migration.config import RunConfig
from migration.history import History
from migration.report import Plan, RunReport, write_csv
from migration.runner import RunHandle, run_config_for_plan

PROGRESS_EVERY_S = 0.25


@dataclasses.dataclass(frozen=True)
class RunOptions:
    steps: int = 20
    learning_rate: float = 3e-3
    timeout_s: float = 3600.0
    fp32_reference: bool = False
    tpu_style: bool = False
    profile: bool = False


@dataclasses.dataclass
class MigrationResult:
    plan: Plan
    note: str
    local_plan: Plan | None
    runs: list[tuple[str, RunReport]]
    checklist: list[checklist.ChecklistItem]
    files: dict[str, str]  # report_csv, checklist_csv, deployment, trace (when captured)

    @property
    def main(self) -> RunReport:
        return self.runs[0][1]


def plan_runs(p: Plan, cfg: RunConfig, options: RunOptions, trace_dir: Path) -> list[tuple[str, RunConfig]]:
    """The runs a plan makes here, in order; `cfg` is the plan's config on this machine."""
    migrated = dataclasses.replace(cfg, profile_steps=3, profile_dir=str(trace_dir)) if options.profile else cfg
    runs = [("migrated", migrated)]
    if options.fp32_reference and cfg.precision != "fp32":
        runs.append(("fp32 reference", dataclasses.replace(cfg, precision="fp32")))
    if options.tpu_style:
        runs.append(("TPU-style", dataclasses.replace(
            cfg, per_device_batch=p.source_per_core_batch, accumulation_steps=1, precision=p.source_precision,
            remat="none")))
    return runs


def run_plan(p: Plan, options: RunOptions, export_dir: Path, *, code: CodeCheck | None = None,
             history: History | None = None) -> Iterator[dict[str, Any]]:
    """Progress events while the plan's runs go, then {"event": "result", "result": MigrationResult}.

    Raises ConfigError / PlanError before any run starts when the options or the plan are bad."""
    base = RunConfig(steps=options.steps, learning_rate=options.learning_rate,
                     warmup_steps=min(2, max(0, options.steps - 1)), timeout_s=options.timeout_s)
    here = run_config_for_plan(p, base)
    yield {"event": "note", "message": here.note}
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6}"
    export_dir.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, RunReport]] = []
    for name, cfg in plan_runs(p, here.config, options, export_dir / f"trace-{stamp}"):
        report = yield from _one_run(name, cfg, done, history)
        done.append((name, report))
    evidence = checklist.Evidence(
        plan=p, run=done[0][1], ran_plan=here.local_plan, code=code,
        fp32_reference=dict(done).get("fp32 reference"), tpu_style_run=dict(done).get("TPU-style"),
        scaling_runs=tuple(scaling_runs(history, done[0][1])) if history else ())
    items = checklist.evaluate(evidence)
    files = _write_exports(p, done, items, export_dir, stamp)
    yield {"event": "result", "result": MigrationResult(p, here.note, here.local_plan, done, items, files)}


def _one_run(name: str, cfg: RunConfig, done: list[tuple[str, RunReport]],
             history: History | None) -> Iterator[dict[str, Any]]:
    handle = RunHandle(cfg)
    try:
        last = 0.0
        for ev in handle.events(heartbeat_s=0.5):
            now = time.monotonic()
            if ev["event"] in ("heartbeat", "step") and now - last < PROGRESS_EVERY_S:
                continue
            last = now
            partial = RunReport.from_events(cfg, handle.events_so_far, status="running")
            yield {"event": "progress", "run": name, "steps": cfg.steps, "worker_event": ev,
                   "status": describe(name, cfg, ev), "partial": partial, "done": list(done)}
    finally:
        if handle.report is None:  # Stop, disconnect or error: never leave a worker behind,
            handle.cancel()        # and keep what it did in the history
            if history is not None:
                history.add_run(RunReport.from_events(
                    cfg, handle.events_so_far, status="cancelled", failure_kind="cancelled",
                    message="stopped before it finished"), label=name)
    if history is not None:
        history.add_run(handle.report, label=name)
    return handle.report


def describe(name: str, cfg: RunConfig, ev: dict[str, Any]) -> str:
    """One line of progress for a worker event."""
    kind = ev["event"]
    if kind == "started":
        return f"{name}: started on {ev['device_kind']} x{ev['device_count']} ({ev['backend']}); compiling…"
    if kind == "compiled":
        return f"{name}: compiled in {ev['compile_s']:.1f} s; running…"
    if kind == "step":
        return f"{name}: step {ev['index'] + 1} of {cfg.steps}, loss {ev['loss']:.4f}, {ev['step_ms']:.1f} ms"
    if kind == "heartbeat":
        return f"{name}: working… {ev['elapsed_s']:.0f} s"
    return f"{name}: {kind}"


def scaling_runs(history: History, main: RunReport) -> list[RunReport]:
    """Successful runs of the same configuration on the same device kind, at any device count."""
    same = []
    for e in history.entries(kind="run", workload=main.workload, status="ok"):
        if (e["preset"], e["precision"], e["remat"], e["per_device_batch"], e["device_kind"]) == \
                (main.preset, main.precision, main.remat, main.per_device_batch, main.device_kind):
            report = history.run_report(e["id"])
            if report is not None:
                same.append(report)
    return same


def _write_exports(p: Plan, done: list[tuple[str, RunReport]], items: list[checklist.ChecklistItem],
                   export_dir: Path, stamp: str) -> dict[str, str]:
    main = done[0][1]
    stem = f"{main.workload}-{main.preset}-{stamp}"
    files = {"report_csv": export_dir / f"report-{stem}.csv", "checklist_csv": export_dir / f"checklist-{stem}.csv",
             "deployment": export_dir / f"deploy-{stem}.sh"}
    write_csv([r for _, r in done], files["report_csv"])
    checklist.to_csv(items, files["checklist_csv"])
    files["deployment"].write_text(checklist.deployment_snippet(p))
    out = {k: str(v) for k, v in files.items()}
    if main.profile and main.profile.get("top_ops"):
        out["trace"] = main.profile["path"]
    return out
