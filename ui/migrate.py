"""The Migrate tab: the form, its buttons, the outputs of a plan, a run and an autotune, and their events.

`form_inputs` builds every input of the form from the field table (`migration.config.fields`, through
`ui.form`) and returns them by name, in the order of the API's inputs: first those of /plan, then the
rest of /run's, then those only /autotune reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gradio as gr
from gradio.components import Component

from migration.config.fields import FIELDS
from ui.form import CONFIG_FILE, PLAN_FILE, component, endpoint_inputs, form_rows
from ui.plan_run import JobHandlers
from ui.tables import table
from workloads import WORKLOADS

AUTOTUNE_SHARES = (5, 8, 8, 5, 5, 7, 7, 5, 8, 12, 3)  # ui.frames.autotune_frame's columns
BEFORE_AFTER_SHARES = (8, 5, 5, 5, 9, 9, 7, 7, 5, 5, 20)  # ui.frames.before_after_frame's
PLAN_INPUTS = (*endpoint_inputs("plan"), CONFIG_FILE)
RUN_INPUTS = (*endpoint_inputs("run", leading=(PLAN_FILE,)), CONFIG_FILE)  # after the two states
AUTOTUNE_INPUTS = endpoint_inputs("autotune", leading=(PLAN_FILE,))  # after the plan state
INPUT_ORDER = tuple(dict.fromkeys((*PLAN_INPUTS, *RUN_INPUTS, *AUTOTUNE_INPUTS)))


@dataclasses.dataclass
class MigrateTab:
    inputs: dict[str, Component]  # form_inputs()
    buttons: dict[str, gr.Button]  # plan, run, autotune, stop
    outputs: dict[str, Component]  # result_outputs()
    plan_state: gr.State  # the plan made in this tab (a dict), for Run and Autotune
    code_state: gr.State  # the Code check tab's last result (a dict), for the checklist
    job_state: gr.State  # the id of this tab's job, for Stop


def migrate_tab(default_target: str) -> MigrateTab:
    with gr.Tab("Migrate"):
        inputs, buttons = form_inputs(default_target)
        outputs = result_outputs()
        return MigrateTab(inputs, buttons, outputs, plan_state=gr.State(None), code_state=gr.State(None),
                          job_state=gr.State(None))


def form_inputs(default_target: str) -> tuple[dict[str, Component], dict[str, gr.Button]]:
    """The form's inputs by name in `INPUT_ORDER` (built from the field table, `ui.form`), and the buttons
    that share the label's row."""
    built = form_rows({"target": default_target})
    with gr.Row():
        built |= {f.name: component(f, {}) for f in FIELDS if f.section == "job"}
        buttons = {"plan": gr.Button("Plan", variant="primary"),
                   "run": gr.Button("Run on this machine", variant="secondary"),
                   "autotune": gr.Button("Autotune on this machine", variant="secondary"),
                   "stop": gr.Button("Stop", variant="stop")}
    return {name: built[name] for name in INPUT_ORDER}, buttons


def result_outputs() -> dict[str, Component]:
    """What a plan, a run and an autotune show, hidden until they have something to show."""
    o = {"progress": gr.Markdown(label="Progress", show_label=False, elem_id="progress"),
         "comparison": gr.Markdown(visible=False, label="Before and after", show_label=False,
                                   elem_id="before-after-plan")}
    with gr.Row():  # the panel's two charts, beside each other under its table
        o |= {"time_plot": gr.BarPlot(x="side", y="time", visible=False, height=260, y_lim=[0, None],
                                      title="Time to train (predicted unless measured)", elem_id="time-plot",
                                      x_title="", label="Time to train", show_label=False),
              "cost_plot": gr.BarPlot(x="side", y="cost_usd", visible=False, height=260, y_lim=[0, None],
                                      title="Cost to train ($)", y_title="$", x_title="", elem_id="cost-plot",
                                      label="Cost to train", show_label=False)}
    o |= {"comparison_file": gr.File(label="Before and after (CSV)", visible=False),
         "plan": gr.Markdown(visible=False, label="Plan", show_label=False),
         "memory_plot": gr.LinePlot(x="per_device_batch", y="predicted", color="series", visible=False,
                                    title="Peak memory per GPU, compiled for the target, for each batch, and the budget",
                                    x_axis_format="d", x_title="per-device batch", y_title="GiB", y_lim=[0, None],
                                    height=300, label="Predicted peak memory per GPU", show_label=False,
                                    elem_id="memory-plot"),
         "ranked": table("Choices that fit, fastest predicted step first", (10, 12, 7, 7, 7, 6, 9, 9, 28, 5),
                         elem_id="ranked-table"),
         "autotune_table": table("Autotune: the top choices measured here", AUTOTUNE_SHARES, elem_id="autotune-table"),
         "autotune_file": gr.File(label="Autotune CSV", visible=False),
         "decisions": gr.HTML(visible=False, label="Decisions with their reasons", show_label=False),
         "results": table("Results", (4, 6), elem_id="results-table"),
         "loss_plot": gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300, visible=False, x_label_angle=0,
                                  label="Loss", show_label=False),
         "before_after": table("Before (pmap) and after (jit with shardings), side by side", BEFORE_AFTER_SHARES,
                               elem_id="before-after"),
         "scaling_plot": gr.LinePlot(x="devices", y="samples_per_s", color="style", height=300, visible=False,
                                     title="Throughput by device count (weak scaling: per-device batch kept)",
                                     elem_id="scaling-plot", label="Throughput by device count", show_label=False),
         "scaling_file": gr.File(label="Scaling CSV", visible=False),
         "checklist": gr.HTML(visible=False, label="Migration checklist", show_label=False)}
    with gr.Row():
        o |= {"report_file": gr.File(label="CSV of this report", visible=False),
              "checklist_file": gr.File(label="Checklist CSV (one row per item)", visible=False),
              "deploy_file": gr.File(label="Deployment snippet (environment + start command)", visible=False),
              "trace_file": gr.File(label="Profile trace (Perfetto / TensorBoard)", visible=False)}
    return o


def presets_of(w: Any) -> Any:
    """The Preset dropdown for workload `w`: its presets, tiny chosen where it has one."""
    presets = list(WORKLOADS[w].presets) if w in WORKLOADS else []
    return gr.Dropdown(choices=presets, value="tiny" if "tiny" in presets else (presets or [None])[0])


def wire_migrate(tab: MigrateTab, handlers: JobHandlers) -> list[Any]:
    """The tab's events: the presets follow the workload; Plan, Run, Autotune and Stop; and `cancel_job`,
    an API endpoint without a button. Returns the events whose end writes the history (plan, run, autotune)."""
    i, o, job = tab.inputs, tab.outputs, tab.job_state
    i["workload"].change(presets_of, i["workload"], i["preset"], api_visibility="private", queue=False)
    plan_event = tab.buttons["plan"].click(
        handlers.do_plan, [i[name] for name in PLAN_INPUTS],
        [o["progress"], o["comparison"], o["time_plot"], o["cost_plot"], o["comparison_file"], o["plan"],
         o["memory_plot"], o["ranked"], o["decisions"], tab.plan_state, job],
        api_name="plan", concurrency_limit=None)
    run_event = tab.buttons["run"].click(
        handlers.do_run, [tab.plan_state, tab.code_state, *(i[name] for name in RUN_INPUTS)],
        [o["progress"], o["results"], o["loss_plot"], o["report_file"], o["checklist"], o["checklist_file"],
         o["deploy_file"], o["trace_file"], o["before_after"], o["scaling_plot"], o["scaling_file"], job],
        api_name="run", concurrency_limit=None)
    autotune_event = tab.buttons["autotune"].click(
        handlers.do_autotune, [tab.plan_state, *(i[name] for name in AUTOTUNE_INPUTS)],
        [o["progress"], o["autotune_table"], o["autotune_file"], job], api_name="autotune", concurrency_limit=None)
    # Stop and cancel_job: unqueued from the page, and without a concurrency limit from a client's queue,
    # so that no backlog of anyone's holds them (the gateway's stop lane bounds each user: `ui.lanes`)
    tab.buttons["stop"].click(handlers.do_stop, job, o["progress"], cancels=[run_event, plan_event, autotune_event],
                              api_name="stop", queue=False, concurrency_limit=None)
    gr.api(handlers.do_cancel_job, api_name="cancel_job", concurrency_limit=None)
    return [plan_event, run_event, autotune_event]
