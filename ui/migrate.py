"""The Migrate tab: the form, its buttons, the outputs of a plan, a run and an autotune, and their events.

`form_inputs` builds every input of the form and returns them by name, in the order of the API's inputs:
first those of /plan, then the rest of /run's, then those only /autotune reads. The names are the
parameters of the handlers (`ui.plan_run`) and the fields of `migration.config.fields`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import gradio as gr
from gradio.components import Component

from migration.config.fields import EMBEDDINGS
from migration.config.limits import PRECISIONS, REMAT_NAMES, SHARDINGS
from migration.hardware import GPU_SPECS, TPU_SPECS
from ui.plan_run import JobHandlers
from workloads import WORKLOADS

# The plan request's fields, in the order of /plan's inputs and of the form part of /run's.
FORM_FIELDS = ("workload", "preset", "source", "global_batch", "per_core_batch", "source_precision", "target", "gpus",
               "memory_fraction", "granularity", "remat", "precision", "accumulation", "n_layers", "d_model", "n_heads",
               "n_kv_heads", "d_ff", "vocab_size", "seq_len", "embeddings", "sharding", "gpus_per_node")
PLAN_INPUTS = (*FORM_FIELDS, "label")
RUN_INPUTS = ("plan_file", "steps", "learning_rate", "compare_tpu", "profile", "fp32_reference", "pmap_before",
              "scaling", *FORM_FIELDS, "label", "save_checkpoint", "restore_checkpoint")  # after the two states
AUTOTUNE_INPUTS = ("plan_file", "autotune_top", "autotune_steps", "label")  # after the plan state
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
    """The form's inputs by name in `INPUT_ORDER`, and the buttons that share the label's row."""
    built = _job_rows(default_target)
    with gr.Accordion("Your model's dimensions, sharding and nodes (0: the preset's)", open=False):
        built |= _model_rows()
    with gr.Accordion("Advanced", open=False):
        built |= _advanced_rows()
    with gr.Row():
        built["label"] = gr.Textbox("", label="Label (shown in the History)", max_lines=1, scale=2)
        buttons = {"plan": gr.Button("Plan", variant="primary"),
                   "run": gr.Button("Run on this machine", variant="secondary"),
                   "autotune": gr.Button("Autotune on this machine", variant="secondary"),
                   "stop": gr.Button("Stop", variant="stop")}
    return {name: built[name] for name in INPUT_ORDER}, buttons


def _job_rows(default_target: str) -> dict[str, Component]:
    """The TPU job and the GPUs it moves to."""
    with gr.Row():
        c = {"workload": gr.Dropdown(list(WORKLOADS), value="transformer", label="Workload", allow_custom_value=True),
             "preset": gr.Dropdown(list(WORKLOADS["transformer"].presets), value="tiny", label="Preset",
                                   allow_custom_value=True),
             "source": gr.Dropdown(list(TPU_SPECS), value="tpu-v5e-8", label="TPU source", allow_custom_value=True),
             "source_precision": gr.Dropdown(["bf16", "fp32"], value="bf16", label="TPU precision",
                                             allow_custom_value=True)}
    with gr.Row():
        c |= {"global_batch": gr.Number(256, label="Global batch"),
              "per_core_batch": gr.Number(0, label="Per-core batch (0: global / cores)"),
              "target": gr.Dropdown(["local", *GPU_SPECS], value=default_target, label="Target GPU",
                                    allow_custom_value=True),
              "gpus": gr.Number(1, label="GPUs"),
              "memory_fraction": gr.Number(0.8, label="GPU memory share (0.05 to 1)", step=0.05),
              "steps": gr.Number(20, label="Steps")}
    return c


def _model_rows() -> dict[str, Component]:
    """The model's dimensions (0: the preset's), the state's sharding and the GPUs per node."""
    with gr.Row():
        c = {"n_layers": gr.Number(0, label="Layers"),
             "d_model": gr.Number(0, label="d_model"),
             "n_heads": gr.Number(0, label="Heads"),
             "n_kv_heads": gr.Number(0, label="KV heads (grouped-query when fewer)"),
             "d_ff": gr.Number(0, label="d_ff (MLP hidden)")}
    with gr.Row():
        c |= {"vocab_size": gr.Number(0, label="Vocabulary"),
              "seq_len": gr.Number(0, label="Sequence length"),
              "embeddings": gr.Dropdown(list(EMBEDDINGS), value="preset", label="Embeddings",
                                        allow_custom_value=True),
              "sharding": gr.Dropdown(["auto", *SHARDINGS], value="auto",
                                      label="State (auto: replicated while it fits, else FSDP)",
                                      allow_custom_value=True),
              "gpus_per_node": gr.Number(8, label="GPUs per node (GPUs above it: several nodes)")}
    return c


def _advanced_rows() -> dict[str, Component]:
    """The planner's choices made by hand, what a run measures besides, a saved plan, checkpoints, autotune."""
    with gr.Row():
        c = {"remat": gr.Dropdown(["auto", *REMAT_NAMES], value="auto", label="Remat policy", allow_custom_value=True),
             "precision": gr.Dropdown(["auto", *PRECISIONS], value="auto", label="Precision", allow_custom_value=True),
             "accumulation": gr.Number(0, label="Accumulation steps (0: auto)"),
             "granularity": gr.Dropdown(["multiple8", "pow2"], value="multiple8", label="Batch sizes",
                                        allow_custom_value=True),
             "learning_rate": gr.Number(3e-3, label="Learning rate")}
    with gr.Row():
        c |= {"compare_tpu": gr.Checkbox(False, label="Also run the TPU-style setup here (loss comparison)"),
              "profile": gr.Checkbox(False, label="Capture a profile (3 extra steps under jax.profiler.trace)"),
              "fp32_reference": gr.Checkbox(False, label="Also run an fp32 reference (numerics check)"),
              "pmap_before": gr.Checkbox(False, label="Also run the TPU-era pmap step (before vs after: same loss, "
                                                      "throughput of each)"),
              "scaling": gr.Checkbox(False, label="Also measure scaling: both steps at 1, 2, 4, 8 devices"),
              "plan_file": gr.File(label="…or run a saved plan (JSON from `python -m migration plan --json`)",
                                   file_types=[".json"], type="filepath")}
    with gr.Row():
        c |= {"save_checkpoint": gr.Textbox("", label="Save a checkpoint after the run (folder)", max_lines=1,
                                            placeholder="a name, like run-1"),
              "restore_checkpoint": gr.Textbox("", label="Start from a checkpoint (folder)", max_lines=1,
                                               placeholder="the name it was saved under")}
    with gr.Row():
        c |= {"autotune_top": gr.Number(3, label="Autotune: ranked choices to measure (1 to 10)"),
              "autotune_steps": gr.Number(5, label="Autotune: timed steps each (after 2 warm-up steps)")}
    return c


def result_outputs() -> dict[str, Component]:
    """What a plan, a run and an autotune show, hidden until they have something to show."""
    o = {"progress": gr.Markdown(label="Progress", show_label=False),
         "plan": gr.Markdown(visible=False, label="Plan", show_label=False),
         "memory_plot": gr.ScatterPlot(x="per_device_batch", y="predicted_GiB", color="series", visible=False,
                                       title="Predicted peak memory per GPU for each batch compiled, and the budget",
                                       height=300, label="Predicted peak memory per GPU", show_label=False),
         "ranked": gr.Dataframe(label="Choices that fit, fastest predicted step first", wrap=True, visible=False),
         "autotune_table": gr.Dataframe(label="Autotune: the top choices measured here", wrap=True, visible=False,
                                        elem_id="autotune-table"),
         "autotune_file": gr.File(label="Autotune CSV", visible=False),
         "decisions": gr.Dataframe(label="Decisions with their reasons", wrap=True, visible=False),
         "results": gr.Dataframe(label="Results", wrap=True, visible=False),
         "loss_plot": gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300, visible=False,
                                  label="Loss", show_label=False),
         "before_after": gr.Dataframe(label="Before (pmap) and after (jit with shardings), side by side", wrap=True,
                                      visible=False, elem_id="before-after"),
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


def wire_migrate(tab: MigrateTab, handlers: JobHandlers) -> None:
    """The tab's events: the presets follow the workload; Plan, Run, Autotune and Stop; and `cancel_job`,
    an API endpoint without a button."""
    i, o, job = tab.inputs, tab.outputs, tab.job_state
    i["workload"].change(presets_of, i["workload"], i["preset"], api_visibility="private")
    plan_event = tab.buttons["plan"].click(
        handlers.do_plan, [i[name] for name in PLAN_INPUTS],
        [o["progress"], o["plan"], o["memory_plot"], o["ranked"], o["decisions"], tab.plan_state, job],
        api_name="plan", concurrency_limit=None)
    run_event = tab.buttons["run"].click(
        handlers.do_run, [tab.plan_state, tab.code_state, *(i[name] for name in RUN_INPUTS)],
        [o["progress"], o["results"], o["loss_plot"], o["report_file"], o["checklist"], o["checklist_file"],
         o["deploy_file"], o["trace_file"], o["before_after"], o["scaling_plot"], o["scaling_file"], job],
        api_name="run", concurrency_limit=None)
    autotune_event = tab.buttons["autotune"].click(
        handlers.do_autotune, [tab.plan_state, *(i[name] for name in AUTOTUNE_INPUTS)],
        [o["progress"], o["autotune_table"], o["autotune_file"], job], api_name="autotune", concurrency_limit=None)
    tab.buttons["stop"].click(handlers.do_stop, job, o["progress"], cancels=[run_event, plan_event, autotune_event],
                              api_name="stop")
    gr.api(handlers.do_cancel_job, api_name="cancel_job")
