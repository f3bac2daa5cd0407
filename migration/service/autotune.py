"""Autotune: the planner's fastest predicted fitting choices, measured on the target, fastest measured wins.

The planner ranks the choices that fit by a model of the step time (`migration/planning/search.py`). Where
the target device is at hand, that ranking can be checked: the top N choices that keep the
requested global batch exactly are each run for a few steps in a fresh worker, exactly as a real
run of the plan would be (`orchestrate.config_as_planned`, `orchestrate.measure_run`), and the one
with the lowest median step time (timed steps only, from the worker's own step events) is picked.
A candidate that runs out of memory or fails stays in the table with its status; nothing is dropped.

Autotune measures on the plan's target only: a plan for a catalog GPU needs that GPU here (at
least as many as the plan uses), a plan for target `local` needs the device it was made on. The
CPU backend can only be autotuned with a `local` plan made on a CPU, and its figures are CPU
timings. `check_target_here` refuses anything else with one line, before any worker starts; it
never imports JAX (NVML, or the driver's files, say which GPUs are here).
"""

from __future__ import annotations

import dataclasses
import glob
import statistics
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from migration.common import ConfigError, fmt_gib
from migration.config.requests import RunConfig
from migration.hardware import GPU_SPECS, gpu_spec_for_device_kind
from migration.service.history import History
from migration.service.orchestrate import Recorder, base_config, config_as_planned, measure_run
from migration.results import Decision, JsonExport, Plan, RunReport
from migration.running.worker_env import nvidia_gpus

TOP_MAX = 10  # the plan keeps its first 10 ranked choices


class AutotuneRefused(ValueError):
    """This machine cannot autotune the plan (not its target, an infeasible plan, nothing to
    compare); `str()` is one line saying why and what to do."""


@dataclasses.dataclass(frozen=True)
class AutotuneSettings:
    """How many ranked choices to measure and for how long each."""

    top: int = 3
    warmup_steps: int = 2  # steps run and not timed (the first steps of a fresh process are slower)
    timed_steps: int = 5  # the median of these is the measured step time
    timeout_s: float = 600.0  # per candidate
    memory_fraction: float | None = None  # per-device share for each run; None: the plan's

    def validated(self) -> "AutotuneSettings":
        if isinstance(self.top, bool) or not isinstance(self.top, int) or not 1 <= self.top <= TOP_MAX:
            raise ConfigError("top", f"must be an integer from 1 to {TOP_MAX} (the plan keeps {TOP_MAX} ranked choices); "
                                     f"got {self.top!r}")
        if isinstance(self.timed_steps, bool) or not isinstance(self.timed_steps, int) or self.timed_steps < 1:
            raise ConfigError("timed_steps", f"must be an integer of at least 1; got {self.timed_steps!r}")
        return self  # warm-up steps, timeout and memory share are checked with the run config


@dataclasses.dataclass
class AutotuneRow:
    """One measured candidate: what the planner predicted and what the run measured."""

    predicted_rank: int  # 1-based position in the plan's ranked choices
    sharding: str
    remat: str
    per_device_batch: int
    accumulation_steps: int
    global_batch: int
    predicted_step_s: float | None  # seconds from the target's peak; None where the plan ranks by relative cost
    relative_cost: float  # the planner's ranking key (seconds, or relative where there is no peak)
    status: str  # ok, failed or cancelled
    failure_kind: str | None  # oom, crashed, timeout, invalid, cancelled; None when ok
    message: str
    measured_step_ms: float | None  # median of the timed steps' step events
    measured_p90_ms: float | None
    timed_steps: int
    peak_memory_bytes: int | None
    peak_memory_source: str | None
    planned: bool  # this is the choice the plan made
    measured_rank: int | None = None  # 1 = fastest measured; None when it did not run to the end
    measured_over_predicted: float | None = None  # needs the prediction in seconds
    predicted_vs_best: float | None = None  # relative cost over the lowest among the measured candidates
    measured_vs_best: float | None = None  # measured step over the fastest measured

    @property
    def ok(self) -> bool:
        return self.status == "ok"



@dataclasses.dataclass
class AutotuneResult(JsonExport):
    """The measured candidates, fastest predicted first, and the verdict."""

    workload: str
    preset: str
    target: str
    target_name: str
    gpus: int
    requested_global_batch: int
    prediction: str  # how the planner predicted the step: "seconds" or "relative cost"
    backend: str | None  # where the timings were measured
    device_kind: str | None
    device_count: int | None
    measured_on: str  # the timing label, e.g. "CPU timings: ..."
    warmup_steps: int
    timed_steps: int
    rows: list[AutotuneRow]
    skipped: list[dict[str, Any]]  # ranked choices not measured, with why
    pick_rank: int | None  # predicted rank of the fastest measured candidate; None when none ran
    ranking_held: bool | None  # the predicted-first candidate measured fastest; None when none ran
    predicted_order: list[int]  # predicted ranks of the candidates that ran, as predicted
    measured_order: list[int]  # the same ranks, fastest measured first
    order_held: bool | None
    verdict: str
    reports: list[RunReport] = dataclasses.field(default_factory=list)  # one per row, same order

    @property
    def pick(self) -> AutotuneRow | None:
        return next((r for r in self.rows if r.predicted_rank == self.pick_rank), None)

    def table_rows(self) -> list[dict[str, Any]]:
        """Scalar columns per candidate, for CSV and tables; every row names the device measured."""
        out = []
        for r in self.rows:
            row = dataclasses.asdict(r)
            row["picked"] = r.predicted_rank == self.pick_rank
            row["measured_on"] = self.measured_on
            out.append(row)
        return out


# -- where ------------------------------------------------------------------------------------

def gpu_names_here() -> list[str]:
    """The NVIDIA GPUs of this machine by name: from NVML, else from the driver's files. Never
    touches CUDA (a server on a shared box must not claim GPU memory)."""
    names = [g["name"] for g in nvidia_gpus()]
    if names:
        return names
    for info in sorted(glob.glob("/proc/driver/nvidia/gpus/*/information")):
        try:
            for line in Path(info).read_text().splitlines():
                if line.startswith("Model:"):
                    names.append(line.split(":", 1)[1].strip())
        except OSError:
            continue
    return names


def _same_device(name: str, kind: str) -> bool:
    spec = gpu_spec_for_device_kind(name)
    return (spec is not None and spec is gpu_spec_for_device_kind(kind)) or name.strip().lower() == kind.strip().lower()


def check_target_here(plan: Plan, gpu_names: list[str] | None = None) -> str:
    """The platform the plan's candidates run on here ("cpu" or "gpu"), or AutotuneRefused when
    this machine is not the plan's target, the plan is infeasible or nothing keeps its global batch."""
    if not plan.ok:
        raise AutotuneRefused(f"the plan is {plan.status}: there is nothing to measure ({plan.message.split(';')[0]})")
    if plan.nodes > 1:
        raise AutotuneRefused(f"the plan spans {plan.nodes} nodes and autotune measures on one machine: plan for at "
                              f"most {plan.gpus_per_node} GPUs of one node")
    names = gpu_names_here() if gpu_names is None else gpu_names
    here = (f"{len(names)} GPU(s): {', '.join(sorted(set(names)))}" if names else "no NVIDIA GPU (CPU only)")
    if plan.target == "local":
        if plan.planned_on == "cpu":
            platform, wanted = "cpu", None
        else:
            wanted = plan.planned_device_kind or "an unknown device"
            platform = "gpu"
        where = f"target local, made on {'the CPU' if wanted is None else wanted}"
    elif plan.target in GPU_SPECS:
        wanted, platform = GPU_SPECS[plan.target].device_kinds[0], "gpu"
        where = f"{plan.gpus} x {plan.target_name}"
    else:
        raise AutotuneRefused(f"the plan's target {plan.target!r} is not a known GPU; make the plan again")
    if platform == "gpu":
        matching = [n for n in names if _same_device(n, wanted)]
        if len(matching) < plan.gpus:
            raise AutotuneRefused(
                f"autotune measures on the plan's target and this machine does not have it: the plan is for {where} "
                f"({plan.gpus} needed), this machine has {here}. Autotune on a machine with that GPU; the CPU can "
                "only be autotuned with a plan for target `local` made on it")
    if not candidates(plan, TOP_MAX)[0]:
        raise AutotuneRefused(f"no ranked choice of the plan keeps the requested global batch "
                              f"{plan.requested_global_batch} exactly: nothing to compare")
    return platform


# -- what -------------------------------------------------------------------------------------

def _table_peak(plan: Plan, c: dict[str, Any]) -> tuple[bool, int | None]:
    """(compiled with its accumulation?, predicted peak) from the planner's table."""
    for row in plan.table:
        if (row["sharding"], row["remat"], row["per_device_batch"], row["accumulation_steps"], row["precision"]) == \
                (c.get("sharding", "replicated"), c["remat"], c["per_device_batch"], c["accumulation_steps"],
                 plan.precision):
            return True, row["predicted_bytes"]
    return False, None


def candidates(plan: Plan, top: int) -> tuple[list[tuple[int, dict[str, Any]]], list[dict[str, Any]]]:
    """The first `top` distinct ranked choices that keep the requested global batch exactly and that
    the planner did not find over budget once compiled with their accumulation, as (rank, choice);
    and the ranked choices passed over before the last one taken, with why."""
    taken: list[tuple[int, dict[str, Any]]] = []
    skipped: list[dict[str, Any]] = []
    seen: set[tuple[str, str, int, int]] = set()
    for rank, c in enumerate(plan.ranked, start=1):
        if len(taken) == top:
            break
        key = (c.get("sharding", "replicated"), c["remat"], c["per_device_batch"], c["accumulation_steps"])
        compiled, peak = _table_peak(plan, c)
        why = None
        if key in seen:
            why = "the same configuration as a higher-ranked choice"
        elif not c["exact"] or c["global_batch"] != plan.requested_global_batch:
            why = f"changes the global batch to {c['global_batch']} (requested {plan.requested_global_batch})"
        elif compiled and (peak is None or peak > plan.budget_bytes):
            why = (f"does not fit once compiled with its {c['accumulation_steps']} accumulation step(s): "
                   f"{fmt_gib(peak, missing='over the limit')} against a budget of {fmt_gib(plan.budget_bytes)}")
        if why is None:
            seen.add(key)
            taken.append((rank, c))
        else:
            skipped.append({"predicted_rank": rank, **{k: c.get(k) for k in (
                "sharding", "remat", "per_device_batch", "accumulation_steps", "global_batch")}, "why": why})
    return taken, skipped


def candidate_plan(plan: Plan, c: dict[str, Any]) -> Plan:
    """The plan with one ranked choice in place of its own (its other decisions unchanged)."""
    _, peak = _table_peak(plan, c)
    same = (c.get("sharding", "replicated"), c["remat"], c["per_device_batch"], c["accumulation_steps"]) == \
        (plan.sharding, plan.remat, plan.per_device_batch, plan.accumulation_steps)
    return dataclasses.replace(
        plan, sharding=c.get("sharding", "replicated"), remat=c["remat"], per_device_batch=c["per_device_batch"],
        accumulation_steps=c["accumulation_steps"], global_batch=c["global_batch"], global_batch_exact=c["exact"],
        predicted_step_s=c["predicted_step_s"], predicted_peak_bytes=plan.predicted_peak_bytes if same else peak)


def autotuned_plan(plan: Plan, result: AutotuneResult) -> Plan:
    """The plan with the measured fastest choice in place of its own, and the measurement as the
    reason: what `run_plan` runs to use the pick. Raises AutotuneRefused when nothing ran."""
    pick = result.pick
    if pick is None:
        raise AutotuneRefused("no candidate ran to the end: there is no measured pick")
    tuned = candidate_plan(plan, plan.ranked[pick.predicted_rank - 1])
    why = f"autotune: {result.verdict}"
    decisions = [Decision(d.decision, getattr(tuned, d.decision), why)
                 if d.decision in ("sharding", "remat", "per_device_batch", "accumulation_steps") else d
                 for d in plan.decisions]
    return dataclasses.replace(tuned, decisions=decisions + [Decision("autotune", f"#{pick.predicted_rank}", why)])


# -- measuring --------------------------------------------------------------------------------

def start_autotune(plan: Plan, settings: AutotuneSettings = AutotuneSettings(), base: RunConfig | None = None,
                   history: History | Recorder | None = None) -> Iterator[dict[str, Any]]:
    """Check everything first (raises AutotuneRefused or ConfigError before any worker starts), then
    return the generator of events: "status" before each candidate, the runs' "progress" events
    (`orchestrate.measure_run`), "measured" with each finished AutotuneRow, and last
    {"event": "result", "result": AutotuneResult}. Closing it early kills the current worker.

    `base` carries the run settings (learning rate, seed, memory share, ...); the steps, the
    platform and the timeout come from `settings` and the plan."""
    settings = settings.validated()
    platform = check_target_here(plan)
    chosen, skipped = candidates(plan, settings.top)
    base = base if base is not None else base_config(plan)
    run_base = dataclasses.replace(
        base, steps=settings.warmup_steps + settings.timed_steps, warmup_steps=settings.warmup_steps,
        timeout_s=settings.timeout_s, platform=platform, visible_devices="" if platform == "cpu" else base.visible_devices,
        profile_steps=0, profile_dir="", step_style="jit",
        **({"memory_fraction": settings.memory_fraction} if settings.memory_fraction is not None else {}))
    config_as_planned(plan, run_base)  # the settings themselves are valid (raises ConfigError)
    recorder = Recorder(history) if isinstance(history, History) else history
    return _autotune(plan, settings, run_base, chosen, skipped, recorder)


def _autotune(plan: Plan, settings: AutotuneSettings, base: RunConfig, chosen: list[tuple[int, dict[str, Any]]],
              skipped: list[dict[str, Any]], recorder: Recorder | None) -> Iterator[dict[str, Any]]:
    rows: list[AutotuneRow] = []
    reports: list[RunReport] = []
    done: list[tuple[str, RunReport]] = []
    for i, (rank, c) in enumerate(chosen, start=1):
        name = f"autotune #{rank} ({c['per_device_batch']} x{c['accumulation_steps']}, {c['remat']}, " \
               f"{c.get('sharding', 'replicated')})"
        yield {"event": "status", "message": f"candidate {i} of {len(chosen)}: {name}"}
        unvalidated = dataclasses.replace(base, per_device_batch=c["per_device_batch"],
                                          accumulation_steps=c["accumulation_steps"], remat=c["remat"],
                                          sharding=c.get("sharding", "replicated"))
        try:
            cfg = config_as_planned(candidate_plan(plan, c), base)
        except ConfigError as exc:  # a choice this version cannot run (a plan file from elsewhere): its row says so
            report = RunReport.from_events(unvalidated, [], status="failed", failure_kind="invalid", message=str(exc))
        else:
            report = yield from measure_run(name, cfg, recorder)
        done.append((name, report))
        row = measured_row(plan, rank, c, report, settings.warmup_steps)
        rows.append(row)
        reports.append(report)
        yield {"event": "measured", "row": row, "report": report}
    yield {"event": "result", "result": summarise(plan, rows, reports, skipped, settings, base.platform)}


def run_autotune(plan: Plan, settings: AutotuneSettings = AutotuneSettings(), base: RunConfig | None = None,
                 history: History | Recorder | None = None,
                 on_event: Callable[[dict[str, Any]], None] | None = None) -> AutotuneResult:
    """`start_autotune` to the end; returns its result."""
    events = start_autotune(plan, settings, base, history)
    result = None
    try:
        for ev in events:
            if on_event is not None:
                on_event(ev)
            if ev["event"] == "result":
                result = ev["result"]
    finally:
        events.close()
    assert result is not None
    return result


def measured_row(plan: Plan, rank: int, c: dict[str, Any], report: RunReport, warmup_steps: int) -> AutotuneRow:
    """A candidate's row from its run: the median of the timed steps' step events (warm-up steps
    excluded) when the run finished, nothing measured when it did not."""
    timed = report.step_ms[warmup_steps:] if report.ok else []
    return AutotuneRow(
        predicted_rank=rank, sharding=c.get("sharding", "replicated"), remat=c["remat"],
        per_device_batch=c["per_device_batch"], accumulation_steps=c["accumulation_steps"],
        global_batch=c["global_batch"], predicted_step_s=c["predicted_step_s"], relative_cost=c["relative_cost"],
        status=report.status, failure_kind=report.failure_kind, message=report.message,
        measured_step_ms=statistics.median(timed) if timed else None,
        measured_p90_ms=report.step_ms_p90 if timed else None, timed_steps=len(timed),
        peak_memory_bytes=report.peak_memory_bytes, peak_memory_source=report.peak_memory_source,
        planned=(c.get("sharding", "replicated"), c["remat"], c["per_device_batch"], c["accumulation_steps"]) ==
                (plan.sharding, plan.remat, plan.per_device_batch, plan.accumulation_steps))


def summarise(plan: Plan, rows: list[AutotuneRow], reports: list[RunReport], skipped: list[dict[str, Any]],
              settings: AutotuneSettings, platform: str) -> AutotuneResult:
    """The verdict from the rows: the pick is the fastest measured (ties: the better predicted
    rank); the ranking held when the predicted-first candidate is the pick."""
    ran = [r for r in rows if r.ok and r.measured_step_ms is not None]
    by_time = sorted(ran, key=lambda r: (r.measured_step_ms, r.predicted_rank))
    for i, r in enumerate(by_time, start=1):
        r.measured_rank = i
        r.measured_vs_best = r.measured_step_ms / by_time[0].measured_step_ms
        if r.predicted_step_s:
            r.measured_over_predicted = r.measured_step_ms / 1e3 / r.predicted_step_s
    lowest = min((r.relative_cost for r in ran), default=None)
    for r in ran:
        r.predicted_vs_best = r.relative_cost / lowest if lowest else None
    first = rows[0] if rows else None
    pick = by_time[0] if by_time else None
    predicted_order = [r.predicted_rank for r in ran]
    measured_order = [r.predicted_rank for r in by_time]
    held = None if pick is None else pick is first
    backend, kind, count = _where_measured(reports, platform)
    label = _timing_label(backend, kind, count)
    return AutotuneResult(
        workload=plan.workload, preset=plan.preset, target=plan.target, target_name=plan.target_name, gpus=plan.gpus,
        requested_global_batch=plan.requested_global_batch,
        prediction="seconds" if any(r.predicted_step_s for r in rows) else "relative cost",
        backend=backend, device_kind=kind, device_count=count, measured_on=label,
        warmup_steps=settings.warmup_steps, timed_steps=settings.timed_steps, rows=rows, skipped=skipped,
        pick_rank=pick.predicted_rank if pick else None, ranking_held=held, predicted_order=predicted_order,
        measured_order=measured_order, order_held=None if pick is None else predicted_order == measured_order,
        verdict=_verdict(rows, by_time, label), reports=reports)


def _where_measured(reports: list[RunReport], platform: str) -> tuple[str | None, str | None, int | None]:
    for r in reports:
        if r.backend:
            return r.backend, r.device_kind, r.device_count
    return platform, None, None


def _timing_label(backend: str | None, kind: str | None, count: int | None) -> str:
    where = f"{kind or 'unknown device'} x{count or '?'}"
    if backend == "cpu":
        return f"CPU timings ({where}, CPU backend): they rank the choices on this CPU, not on a GPU"
    return f"measured on {where} ({backend} backend)"


def _verdict(rows: list[AutotuneRow], by_time: list[AutotuneRow], label: str) -> str:
    if not by_time:
        return f"no candidate ran to the end ({', '.join(f'#{r.predicted_rank} {r.failure_kind}' for r in rows)})"
    pick, first = by_time[0], rows[0]
    text = (f"pick #{pick.predicted_rank}: {pick.per_device_batch} per device x {pick.accumulation_steps} accumulation, "
            f"remat {pick.remat}, {pick.sharding} state, {pick.measured_step_ms:.2f} ms per step")
    if pick is first:
        text += "; the ranking held: the predicted-first choice measured fastest"
        if len(by_time) > 1:
            text += f" ({by_time[1].measured_vs_best - 1:.0%} ahead of the next)"
    elif first.ok:
        text += (f"; the ranking did not hold: the predicted-first (#{first.predicted_rank}) measured "
                 f"{first.measured_step_ms:.2f} ms, {first.measured_vs_best - 1:.0%} slower")
    else:
        text += f"; the ranking did not hold: the predicted-first (#{first.predicted_rank}) {first.failure_kind}"
    tied = [r.predicted_rank for r in rows if r.relative_cost == first.relative_cost]
    if len(tied) > 1:
        text += (f"; #{', #'.join(map(str, tied))} were tied in the prediction (the planner breaks ties by fewer "
                 "accumulation steps, then the smaller batch)")
    order = " < ".join(f"#{r.predicted_rank}" for r in by_time)
    return f"{text}; measured order {order}; {label}"
