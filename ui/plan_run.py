"""The Migrate tab's handlers: Plan, Run, Autotune and Stop (and `cancel_job`, Stop by a job's id).

Plan, Run and Autotune submit a job to the job service and stream what it does to the page. A stream's
tuples follow the outputs of its event in `ui.migrate.wire_migrate`: the progress line first, the tab's
job id (for Stop) last. A result output is sent `None` while the job works: hidden and empty after the
first update (`cleared`), it stays so without Gradio rebuilding it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import gradio as gr

from migration.codecheck import CodeCheck
from migration.common import ConfigError, private_dir, read_upload, write_csv
from migration.config import forms
from migration.config.imported import form_request
from migration.config.requests import PlanRequest, RunConfig
from migration.planning.planfile import MAX_PLAN_BYTES, checked_plan, read_plan
from migration.results import Plan
from migration.running.runner import PlanError
from migration.service.autotune import AutotuneResult, AutotuneSettings
from migration.service.history import HistoryError
from migration.service.job import Job, LimitError, NotYourJob
from migration.service.orchestrate import MigrationResult, RunOptions, candidate_text
from migration.config.fields import FIELD
from migration.planning.compare import rows as comparison_rows
from ui.context import AppContext, refuse, said, said_beside, user_of
from ui.form import CONFIG_FILE, PLAN_FILE, takes_fields
from ui.frames import (autotune_frame, bar_limits, before_after_frame, checklist_html, comparison_frames, comparison_markdown,
                       curve_frame, decisions_html, loss_frame, memory_chart_has_shape, memory_frame, plan_markdown, ranked_frame, results_frame,
                       run_headline, scaling_frame)
from ui.streaming import cleared, follow, waiting_line

PLAN_RESULTS = 8  # /plan's result outputs: the before/after panel (text, two charts, CSV), the plan, its three tables
PLOT_EVERY_S = 1.0  # a plot that grows while a job works is redrawn at most this often
PROGRESS_EVERY_S = 0.5  # a job's progress line is sent to its page at most this often


class JobHandlers:
    """Plan, Run, Autotune and Stop for the Migrate tab. Plan, Run and Autotune take the form's fields
    (`ui.form.takes_fields`: the API names its parameters after them, with the field table's defaults) as one
    dict, after the tab's states and a saved plan file."""

    def __init__(self, context: AppContext):
        self.context = context

    @takes_fields("plan", trailing=(CONFIG_FILE,))
    async def do_plan(self, values: dict[str, Any], config_file: Any, request: gr.Request):
        service = self.context.service
        try:
            req = form_request(forms.of_fills(values, "plan"), config_file)
            label = forms.parse(FIELD["label"], values["label"])
            # Submitting writes the history: off the event loop, which serves every other page meanwhile.
            job = await asyncio.to_thread(service.submit_plan, user_of(request), req, label=label)
        except (ConfigError, LimitError, HistoryError) as exc:
            yield said_beside(exc, PLAN_RESULTS + 2)
            raise refuse(exc)
        yield (f"Planning (job #{job.id})…", *cleared(PLAN_RESULTS), gr.skip(), job.id)
        watch = PlanWatch()
        async with contextlib.aclosing(follow(service, job)) as events:
            async for ev in events:
                update = watch.update(ev)
                if update is not None:
                    yield update
        if job.state == "cancelled":
            yield ("Planning stopped.", *[gr.skip()] * (PLAN_RESULTS + 1), None)
            return
        if job.result is None:
            raise refuse(PlanError("failed", job.error or "the planner ended without a plan"))
        p: Plan = job.result
        yield ("", *self.comparison_updates(p, user_of(request)), gr.update(value=plan_markdown(p), visible=True),
               memory_update(memory_frame(p.table, p.budget_bytes)),
               gr.update(value=ranked_frame(p), visible=True), gr.update(value=decisions_html(p), visible=True),
               p.to_dict(), None)

    def comparison_updates(self, p: Plan, user: str) -> tuple[Any, ...]:
        """The before/after panel: its text, the time and cost charts (each where it has a bar), its CSV."""
        if not p.comparison:
            return (gr.update(visible=False),) * 4
        time_frame, unit, cost_frame = comparison_frames(p)
        path = self.context.export_path("comparison", user)
        write_csv(comparison_rows(p.comparison), path=path)
        order = list(dict.fromkeys([*time_frame["side"], *cost_frame["side"]]))  # before, then after
        return (gr.update(value=comparison_markdown(p), visible=True),
                gr.update(value=time_frame, visible=len(time_frame) > 0, y_title=unit, sort=order,
                          y_lim=bar_limits(time_frame, "time")),
                gr.update(value=cost_frame, visible=len(cost_frame) > 0, sort=order, y_lim=bar_limits(cost_frame, "cost_usd")),
                gr.update(value=str(path), visible=True))

    @takes_fields("run", leading=("plan_dict", "code_state", PLAN_FILE), trailing=(CONFIG_FILE,))
    async def do_run(self, plan_dict: Any, code_state: Any, plan_file: Any, values: dict[str, Any],
                     config_file: Any, request: gr.Request | None):
        user = user_of(request)
        try:
            job = await self._submit_run(user, plan_dict, code_state, plan_file, values, config_file)
        except (ConfigError, PlanError, LimitError, HistoryError, ValueError) as exc:
            yield said_beside(exc, 11)
            raise refuse(exc)
        watch = RunWatch(note=f"Run job #{job.id}: {self.context.service.budget_line(user)}.\n\n")
        yield (f"Run job #{job.id} submitted…", *cleared(10), job.id)
        async with contextlib.aclosing(follow(self.context.service, job)) as events:
            async for ev in events:
                update = watch.update(job, ev)
                if update is not None:
                    yield update
        if job.state == "cancelled":
            yield ("Run stopped; the partial run is in the history as cancelled.", *[gr.skip()] * 10, None)
            return
        yield run_results(job, watch.note)

    async def _submit_run(self, user: str, plan_dict: Any, code_state: Any, plan_file: Any,
                          values: dict[str, Any], config_file: Any = None) -> Job:
        """The run job, its every input checked first (ConfigError and the like otherwise): of the saved plan
        when one is given, else of the plan made in this tab for this form, else planned first in the job."""
        limits = self.context.settings.limits
        config, options = forms.run_values(**forms.of_fills(values, "run", "options"), max_steps=limits.max_steps)
        label = forms.parse(FIELD["label"], values["label"])
        req = form_request(forms.of_fills(values, "plan"), config_file)
        if plan_file:
            source: Plan | PlanRequest = read_plan_file(plan_file)
        elif plan_dict and same_job(plan_dict, req):
            source = checked_plan(plan_dict)
        else:
            source = req  # planned first, in the job, and recorded
        save_to, restore_from = forms.checkpoint_folders(
            values["save_checkpoint"], values["restore_checkpoint"],
            private_dir(self.context.checkpoint_root / forms.user_folder(user)))
        base = RunConfig(**config, memory_fraction=source.memory_fraction, warmup_steps=min(2, config["steps"] - 1),
                         timeout_s=limits.max_run_s, save_checkpoint=save_to, restore_checkpoint=restore_from)
        code = CodeCheck.from_dict(code_state) if code_state else None
        options["tpu_step_ms"] = req.tpu_step_ms or 0.0  # the form's measured TPU step: the benchmark item's
        return await asyncio.to_thread(self.context.service.submit_run, user, source, base, RunOptions(**options),
                                       code=code, label=label)

    @takes_fields("autotune", leading=("plan_dict", PLAN_FILE))
    async def do_autotune(self, plan_dict: Any, plan_file: Any, values: dict[str, Any], request: gr.Request | None):
        """Measure the plan's top ranked choices on this machine (the plan made in this tab, or a saved one)."""
        user = user_of(request)
        try:
            job = await self._submit_autotune(user, plan_dict, plan_file, values)
        except (ConfigError, PlanError, LimitError, HistoryError, ValueError) as exc:
            yield said_beside(exc, 3)
            raise refuse(exc)
        yield (f"Autotune job #{job.id} submitted…", *cleared(2), job.id)
        rows: list[dict[str, Any]] = []
        table: Any = None  # None until the first candidate is measured, then left as drawn
        async with contextlib.aclosing(follow(self.context.service, job)) as events:
            async for ev in events:
                kind = ev["event"]
                if kind == "waiting":
                    yield waiting_line(ev, "Your autotune"), table, None, gr.skip()
                elif kind in ("status", "progress"):
                    yield ev["message" if kind == "status" else "status"], table, None, gr.skip()
                elif kind == "measured":
                    rows.append(dataclasses.asdict(ev["row"]))
                    yield (f"Measured {len(rows)} candidate(s)…", gr.update(value=autotune_frame(rows), visible=True),
                           None, gr.skip())
                    table = gr.skip()
        if job.state == "cancelled":
            yield "Autotune stopped; the candidates measured so far are in the history.", gr.skip(), gr.skip(), None
            return
        yield self._autotune_results(job, user)

    async def _submit_autotune(self, user: str, plan_dict: Any, plan_file: Any, values: dict[str, Any]) -> Job:
        limits = self.context.settings.limits
        if plan_file:
            p = read_plan_file(plan_file)
        elif plan_dict:
            p = checked_plan(plan_dict)
        else:
            raise ConfigError("plan", "autotune measures a plan's ranked choices: press Plan first, or give a "
                                      "saved plan file (Advanced)")
        settings = forms.autotune_values(**forms.of_fills(values, "autotune"), max_steps=limits.max_steps)
        label = forms.parse(FIELD["label"], values["label"])
        base = RunConfig(memory_fraction=p.memory_fraction, timeout_s=limits.max_run_s)
        return await asyncio.to_thread(self.context.service.submit_autotune, user, p, AutotuneSettings(**settings),
                                       base, label=label)

    def _autotune_results(self, job: Job, user: str) -> tuple[Any, ...]:
        """The last update of an autotune that ended: the verdict, the table and its CSV."""
        result: AutotuneResult | None = job.result
        if result is None or job.error:
            raise gr.Error(f"Autotune did not finish: {job.error or 'unknown reason'}", print_exception=False)
        path = self.context.export_path("autotune", user)
        write_csv(result.table_rows(), path=path)
        warnings = "".join(f"\n\n⚠️ {w}" for w in job.warnings)
        return (f"**{result.measured_on}**\n\n{result.verdict}{warnings}",
                gr.update(value=autotune_frame(result.table_rows()), visible=True),
                gr.update(value=str(path), visible=True), None)

    def do_stop(self, job_id, request: gr.Request):
        """Stop this tab's job. Unqueued, so it never raises: every answer is a line beside the button."""
        if job_id is None:
            return "Nothing of yours is running in this tab: there is nothing to stop."
        try:
            job = self.context.service.get(int(job_id), user_of(request))
            if job.finished:
                return f"Job #{job.id} has already ended ({job.state}): there is nothing to stop."
            job = self.context.service.cancel(job.id, user_of(request))
        except (LookupError, NotYourJob, ValueError, TypeError) as exc:
            return said(exc)
        return f"Stopping job #{job.id}…"

    def do_cancel_job(self, job_id: str = "", request: gr.Request | None = None) -> str:
        """Stop one of your jobs by its id (API: `cancel_job`)."""
        try:
            job = self.context.service.cancel(
                forms.whole(job_id, "job_id", 1, 2**62, note=" (one job id from the History)"), user_of(request))
        except (ConfigError, LookupError, NotYourJob) as exc:
            raise refuse(exc)
        return f"Stopping job #{job.id} ({job.summary})."


@dataclasses.dataclass
class PlanWatch:
    """A plan job's events as /plan's updates: a line per compile, the memory plot redrawn at most every
    PLOT_EVERY_S, a heartbeat line when it changes. `update` gives None for an event that changes nothing."""

    rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    budget: int | None = None
    drawn_at: float = 0.0
    plot: Any = None  # the memory plot: None until drawn, then left as drawn between redraws
    heartbeat: str = ""

    def update(self, ev: dict[str, Any]) -> tuple[Any, ...] | None:
        if ev["event"] == "waiting":
            return self.line(waiting_line(ev, "Your plan"))
        if ev["event"] != "planning":
            return None
        wev = ev["worker_event"]
        if wev["event"] == "plan_started":
            self.budget = wev.get("budget_bytes")
        if wev["event"] == "candidate":
            self.rows.append(wev)
            line = (f"{'Ruled out' if wev.get('lower_bound') else 'Compiled'} batch {wev['per_device_batch']}, "
                    f"remat {wev['remat']}, ×{wev['accumulation_steps']}: {candidate_text(wev)} "
                    f"({len(self.rows)} candidate(s) so far)")
            now_plot = self.plot
            if time.monotonic() - self.drawn_at >= PLOT_EVERY_S:  # the final plan draws every candidate
                self.drawn_at = time.monotonic()
                frame = memory_frame(self.rows, self.budget)
                if memory_chart_has_shape(frame):
                    now_plot, self.plot = memory_update(frame), gr.skip()
            return self.line(line, now_plot)
        if wev["event"] == "heartbeat":
            text = f"Planning… {wev['elapsed_s']:.0f} s, {len(self.rows)} candidate(s) evaluated so far"
            if text != self.heartbeat:  # heartbeats come twice a second; the line changes once
                self.heartbeat = text
                return self.line(text)
        return None

    def line(self, text: str, plot: Any = None) -> tuple[Any, ...]:
        """A progress line, the memory plot as drawn (or `plot`, redrawn), every other result hidden."""
        return (text, *[None] * 5, self.plot if plot is None else plot, None, None, gr.skip(), gr.skip())


@dataclasses.dataclass
class RunWatch:
    """A run job's events as /run's updates: its status lines, a progress line at most every
    PROGRESS_EVERY_S, the loss plot redrawn at most every PLOT_EVERY_S from the losses received so far (only
    the new ones are read each time). `update` gives None for an event that changes nothing."""

    note: str  # the job's budget line, or the note the job sent; heads every progress line
    curves: dict[str, list[Any]] = dataclasses.field(default_factory=dict)  # run -> the losses this page has
    drawn_at: float = 0.0
    sent_at: float = 0.0
    plot: Any = None  # the live loss plot: None until drawn, then left as drawn between redraws
    planning_said: bool = False
    stepped: bool = False  # a step's progress line was sent: later ones wait their turn

    def line(self, text: str, loss_plot: Any = None) -> tuple[Any, ...]:
        return (text, None, self.plot if loss_plot is None else loss_plot, *[None] * 8, gr.skip())

    def update(self, job: Job, ev: dict[str, Any]) -> tuple[Any, ...] | None:
        kind = ev["event"]
        if kind == "waiting":
            return self.line(waiting_line(ev, "Your run"))
        if kind == "planning":
            if not self.planning_said and ev["worker_event"]["event"] in ("candidate", "heartbeat"):
                self.planning_said = True
                return self.line("Planning first (no plan was made for this form)…")
        elif kind == "status":
            return self.line(ev["message"])
        elif kind == "note":
            self.note = ev["message"] + ".\n\n"
        elif kind == "progress":
            return self._progress(job, ev)
        return None

    def _progress(self, job: Job, ev: dict[str, Any]) -> tuple[Any, ...] | None:
        for run in list(job.curves):  # the loss values not drawn yet: increments, never the whole curve again
            self.curves.setdefault(run, []).extend(job.curve(run, len(self.curves.get(run, []))))
        now = time.monotonic()
        first_step = ev.get("worker_event", {}).get("event") == "step" and not self.stepped
        if now - self.sent_at < PROGRESS_EVERY_S and not first_step:  # the first step's line is never held back
            return None
        self.sent_at = now
        self.stepped = self.stepped or first_step
        redraw = None
        if now - self.drawn_at >= PLOT_EVERY_S:
            losses = curve_frame(self.curves)
            if len(losses):  # an empty frame would fix the plot's colour scale with no series
                self.drawn_at = now
                redraw, self.plot = gr.update(value=losses, visible=True), gr.skip()
        return self.line(self.note + ev["status"], redraw)


def run_results(job: Job, note: str) -> tuple[Any, ...]:
    """The last update of a run job that ended: the headline and every result output, shown where it has
    something to show."""
    result: MigrationResult | None = job.result
    warnings = "".join(f"\n\n⚠️ {w}" for w in job.warnings)
    if result is None:
        raise gr.Error(f"The run could not start: {job.error or 'unknown reason'}{warnings}", print_exception=False)
    budget_plan = result.local_plan or result.plan
    budget = budget_plan.budget_bytes
    budget_of = budget_plan.target_name  # the device the budget bounds: this machine's (its re-fit plan) or the target
    files = result.files
    return (f"{note}{run_headline(result, budget)}{warnings}",
            gr.update(value=results_frame(result.main, budget, budget_of), visible=True),
            gr.update(value=loss_frame(result.runs), visible=True),
            gr.update(value=files["report_csv"], visible=True),
            gr.update(value=checklist_html(result.checklist), visible=True),
            gr.update(value=files["checklist_csv"], visible=True),
            gr.update(value=files["deployment"], visible=True),
            gr.update(value=files.get("trace"), visible=bool(files.get("trace"))),
            gr.update(value=before_after_frame(result.scaling), visible=bool(result.scaling)),
            gr.update(value=scaling_frame(result.scaling), visible=len({r["devices"] for r in result.scaling}) > 1),
            gr.update(value=files.get("scaling_csv"), visible=bool(files.get("scaling_csv"))), None)


def memory_update(frame: Any) -> Any:
    """The memory chart, drawn where it has a shape (two or more batches compiled), else hidden."""
    return gr.update(value=frame, visible=memory_chart_has_shape(frame), y_title=frame.attrs.get("unit", "GiB"))


def same_job(plan_dict: dict[str, Any], req: PlanRequest) -> bool:
    """Whether the plan in this tab was made for the form as it is now."""
    keys = ("workload", "preset", "source", "global_batch", "target", "gpus")
    planned_model = {k: v for k, v in plan_dict.get("model", {}).items() if k != "attention" or k in req.model}
    return (all(plan_dict.get("requested_global_batch" if k == "global_batch" else k, plan_dict.get(k))
                == getattr(req, k) for k in keys)
            and planned_model == req.model and req.sharding in (None, plan_dict.get("sharding")))


def read_plan_file(path: Any) -> Plan:
    """An uploaded plan, checked field by field with its environment rebuilt (`migration.planning.planfile`)."""
    return read_plan(read_upload(path, "plan_file", MAX_PLAN_BYTES,
                                 "a plan file (JSON from `python -m migration plan --json`)"))
