"""The Serve tab: a decoder model served on a GPU. Plan compiles the two programs a server runs (the
prefill of a batch's prompts and one decode step over the KV cache) for a catalog GPU without it, one
row per batch: memory against the budget, predicted time to first token and per output token beside the
bandwidth limit; Run measures a stream of requests on this machine at each batch size, labelled with the
backend it ran on. Both are jobs of the job service (queued, owned, stopped by Stop or `cancel_job`,
recorded in the History); the API's endpoints are /serve_plan and /serve_run.

The handlers turn the form into a checked request (`migration.config.serving`), follow the job, and
turn its result into the table, the two charts, the CSV and the serving checklist (graded by
`migration.grading.serving` from the result, the Code check tab's last check of the user's code and, for
a run, the session's last plan); nothing here plans, measures or grades.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import gradio as gr
import pandas as pd
from gradio.components import Component

from migration.codecheck import CodeCheck
from migration.common import ConfigError, fmt_bytes, fmt_count, fmt_number, fmt_seconds, experts_text, mix_text, model_name, private_dir, write_csv
from migration.config import forms
from migration.config.fields import FIELD
from migration.config.serving import (CHUNK, CHUNK_LIMITS, DECODER_WORKLOADS, KV_CACHES, MEMORY_FRACTION,
                                      SERVE_PRECISIONS, serve_request, serve_run_request)
from migration.grading.serving import ServingEvidence, serving_checklist
from migration.hardware import GPU_SPECS
from migration.results import memory_provenance
from migration.service.history import HistoryError
from migration.service.job import Job, LimitError
from ui.context import AppContext, refuse, said_beside, user_of
from ui.frames import checklist_html, whole_axis
from ui.tables import shaped, table
from ui.migrate import presets_of
from ui.streaming import cleared, follow, waiting_line
from workloads import WORKLOADS

DEFAULT_TARGET = "h100-sxm"
PLAN_DEFAULTS: dict[str, Any] = {"workload": "llama", "preset": "tiny", "target": DEFAULT_TARGET, "precision": "bf16",
                                 "prompt_len": 32, "gen_len": 16, "batches": "", "memory_fraction": MEMORY_FRACTION,
                                 "label": "", "checkpoint": "", "gpus": 1, "kv_cache": "auto", "chunk": CHUNK, "mix": "",
                                 **{name: FIELD[name].default for name in forms.MODEL_DIMENSIONS}}
RUN_DEFAULTS: dict[str, Any] = {"requests": 50, "run_batches": "1,4", "prompt_min": 4, "prompt_max": 32,
                                "gen_min": 4, "gen_max": 24, "temperature": 0.0, "seed": 0}
# The API's parameters, in order (the handlers' signatures name them).
PLAN_INPUTS = ("workload", "preset", "target", "precision", "prompt_len", "gen_len", "batches", "memory_fraction",
               "label", "checkpoint", "gpus", "kv_cache", "chunk", "mix", *forms.MODEL_DIMENSIONS)
RUN_INPUTS = ("workload", "preset", "precision", "requests", "run_batches", "prompt_min", "prompt_max", "gen_min",
              "gen_max", "temperature", "seed", "memory_fraction", "label", "checkpoint", "kv_cache",
              *forms.MODEL_DIMENSIONS)
OUTPUTS = ("status", "table", "latency", "throughput", "csv", "checklist")
X_TITLE = "running sequences (plan) or batch (run)"


@dataclasses.dataclass
class ServeTab:
    inputs: dict[str, Component]  # by parameter name
    buttons: dict[str, gr.Button]  # plan, run, stop
    outputs: dict[str, Component]  # OUTPUTS
    job_state: gr.State  # the id of this tab's job, for Stop
    plan_state: gr.State  # this session's last serving plan (a dict), which a run's checklist is graded against
    code_state: gr.State  # the Code check tab's last check of serving code (a dict): the checklist's code evidence


def serve_tab() -> ServeTab:
    with gr.Tab("Serve"):
        gr.Markdown("Serve a decoder (the `llama` and `transformer` families) on a GPU. **Plan serving** sizes an "
                    "engine that batches continuously with chunked prefill: it compiles a prefill chunk and the "
                    "decode step for the target GPU without it, and finds how many sequences its memory and step "
                    "budget hold; **Run serving here** measures a stream of requests on this machine's device.")
        d = PLAN_DEFAULTS | RUN_DEFAULTS
        inputs = {**_model_inputs(d), **_plan_inputs(d), **_run_inputs(d)}
        with gr.Row():
            buttons = {"plan": gr.Button("Plan serving", variant="primary"),
                       "run": gr.Button("Run serving here", variant="secondary"),
                       "stop": gr.Button("Stop", variant="stop")}
        return ServeTab(inputs, buttons, _outputs(), job_state=gr.State(None), plan_state=gr.State(None),
                        code_state=gr.State(None))


def _model_inputs(d: dict[str, Any]) -> dict[str, Component]:
    """The model served: workload, preset, precision, memory share, label, checkpoint, and the training
    form's dimension fields over the preset's."""
    inputs: dict[str, Component] = {}
    with gr.Row():
        inputs["workload"] = gr.Dropdown(list(DECODER_WORKLOADS), value=d["workload"], label="Decoder workload",
                                         allow_custom_value=True)
        inputs["preset"] = gr.Dropdown(list(WORKLOADS[d["workload"]].presets), value=d["preset"],
                                       label="Decoder preset", allow_custom_value=True)
        inputs["precision"] = gr.Dropdown(list(SERVE_PRECISIONS), value=d["precision"], label="Serving precision",
                                          allow_custom_value=True)
        inputs["memory_fraction"] = gr.Number(d["memory_fraction"], label="GPU memory share to serve in (0.05 to 1)")
        inputs["label"] = gr.Textbox(d["label"], label="Serving job label (shown in the History)", max_lines=1)
        inputs["checkpoint"] = gr.Textbox(d["checkpoint"], max_lines=1,
                                          label="Your checkpoint to serve (its name; of the model chosen here)")
    with gr.Row():  # the training form's model fields: any dimensions over the preset's
        for name in forms.MODEL_DIMENSIONS:
            f = FIELD[name]
            if f.kind == "choice":
                inputs[name] = gr.Dropdown(list(f.choices), value=f.default, label=f.label, allow_custom_value=True)
            else:
                inputs[name] = gr.Number(f.default, label=f"{f.label} (0: the preset's)")
    return inputs


def _plan_inputs(d: dict[str, Any]) -> dict[str, Component]:
    """What a serving plan is for: the GPU, how many, the cache, the lengths, the concurrencies, the budget."""
    inputs: dict[str, Component] = {}
    with gr.Row():
        inputs["target"] = gr.Dropdown(list(GPU_SPECS), value=d["target"], label="GPU to plan for",
                                       allow_custom_value=True)
        inputs["gpus"] = gr.Number(d["gpus"], label="GPUs (tensor-parallel in one node, 1-8)")
        inputs["kv_cache"] = gr.Dropdown(list(KV_CACHES), value=d["kv_cache"], allow_custom_value=True,
                                         label="KV cache (fp8: half the bytes, twice the sequences)")
        inputs["prompt_len"] = gr.Number(d["prompt_len"], label="Prompt length (tokens)")
        inputs["gen_len"] = gr.Number(d["gen_len"], label="Generation length (tokens)")
        inputs["batches"] = gr.Textbox(d["batches"], label="Concurrencies to plan (e.g. 1,8,32; empty: automatic)",
                                       max_lines=1, placeholder="automatic: 1, and a quarter, half and all of what fits")
        inputs["chunk"] = gr.Number(d["chunk"], label=f"Token budget a step ({CHUNK_LIMITS[0]}-{CHUNK_LIMITS[1]:,}: "
                                                      "decode tokens and prompt chunks)")
        inputs["mix"] = gr.Textbox(d["mix"], max_lines=1, label="Request mix (replaces the two lengths; e.g. "
                                                                "0.7*512:128, 0.3*4096:512)")
    return inputs


def _run_inputs(d: dict[str, Any]) -> dict[str, Component]:
    """The stream of requests a serving run measures here."""
    inputs: dict[str, Component] = {}
    with gr.Row():
        inputs["requests"] = gr.Number(d["requests"], label="Requests in the measured stream")
        inputs["run_batches"] = gr.Textbox(d["run_batches"], label="Batch sizes to measure (e.g. 1,4)", max_lines=1)
        inputs["prompt_min"] = gr.Number(d["prompt_min"], label="Shortest prompt")
        inputs["prompt_max"] = gr.Number(d["prompt_max"], label="Longest prompt")
        inputs["gen_min"] = gr.Number(d["gen_min"], label="Shortest generation")
        inputs["gen_max"] = gr.Number(d["gen_max"], label="Longest generation")
        inputs["temperature"] = gr.Number(d["temperature"], label="Temperature (0: greedy)")
        inputs["seed"] = gr.Number(d["seed"], label="Seed (weights and requests)")
    return inputs


def _outputs() -> dict[str, Component]:
    """What a serving plan or run shows: its status, its table, latency and throughput plots, CSV and checklist."""
    outputs: dict[str, Component] = {
        "status": gr.Markdown(label="Serving status", show_label=False),
        "table": table("Serving: one row per concurrency (planned) or batch size (measured)", PLAN_SHARES,
                       elem_id="serve-table"),
    }
    with gr.Row():
        outputs["latency"] = gr.LinePlot(x="batch", y="ms", color="series", x_title=X_TITLE,
                                         title="Latency by concurrency or batch size (ms)",
                                         height=300, visible=False, elem_id="serve-latency",
                                         label="Latency by batch size", show_label=False)
        outputs["throughput"] = gr.LinePlot(x="batch", y="tokens_per_s", color="series", height=300, x_title=X_TITLE,
                                            title="Throughput by concurrency or batch size (generated tokens/s)",
                                            visible=False,
                                            elem_id="serve-throughput", label="Throughput by batch size",
                                            show_label=False)
    outputs["csv"] = gr.File(label="Serving table (CSV)", visible=False)
    outputs["checklist"] = gr.HTML(visible=False, label="Serving checklist", show_label=False,
                                   elem_id="serve-checklist")
    return outputs


def wire_serve(tab: ServeTab, handlers: ServeHandlers, stop: Any) -> list[Any]:
    """The presets follow the workload; Plan, Run, and Stop (`stop`: the Migrate tab's, by this tab's job id;
    it also ends this tab's stream). The checklist is graded from the Code check tab's last check of serving
    code (`tab.code_state`; never of training code) and, for a run, this session's last plan. Returns the
    events whose end writes the history."""
    i, o, job, plan, code_state = tab.inputs, tab.outputs, tab.job_state, tab.plan_state, tab.code_state
    i["workload"].change(presets_of, i["workload"], i["preset"], api_visibility="private", queue=False)
    shown = [o[name] for name in OUTPUTS]
    plan_event = tab.buttons["plan"].click(handlers.do_serve_plan, [code_state, *(i[name] for name in PLAN_INPUTS)],
                                           [*shown, job, plan], api_name="serve_plan", concurrency_limit=None)
    run_event = tab.buttons["run"].click(handlers.do_serve_run, [plan, code_state, *(i[name] for name in RUN_INPUTS)],
                                         [*shown, job, plan], api_name="serve_run", concurrency_limit=None)
    tab.buttons["stop"].click(stop, job, o["status"], cancels=[plan_event, run_event], api_name="serve_stop",
                              queue=False, concurrency_limit=None)
    return [plan_event, run_event]


class ServeHandlers:
    """/serve_plan and /serve_run: each checks its form into a request, submits it to the job service and
    streams the job's progress, then its table, charts and CSV. Their streams' tuples follow `OUTPUTS`, then
    the tab's job id (and, for a plan, the plan, kept for a later run's checklist). The checklist grades the
    job's result with the Code check tab's last result (`code_state`) and, for a run, this session's plan
    (`plan_state`): both server-side state of the caller's own session, None from the API."""

    def __init__(self, context: AppContext):
        self.context = context

    async def do_serve_plan(self, code_state=None, workload=PLAN_DEFAULTS["workload"], preset=PLAN_DEFAULTS["preset"],
                            target=PLAN_DEFAULTS["target"], precision=PLAN_DEFAULTS["precision"],
                            prompt_len=PLAN_DEFAULTS["prompt_len"], gen_len=PLAN_DEFAULTS["gen_len"],
                            batches=PLAN_DEFAULTS["batches"], memory_fraction=PLAN_DEFAULTS["memory_fraction"],
                            label=PLAN_DEFAULTS["label"], checkpoint=PLAN_DEFAULTS["checkpoint"],
                            gpus=PLAN_DEFAULTS["gpus"], kv_cache=PLAN_DEFAULTS["kv_cache"],
                            chunk=PLAN_DEFAULTS["chunk"], mix=PLAN_DEFAULTS["mix"], n_layers=PLAN_DEFAULTS["n_layers"],
                            d_model=PLAN_DEFAULTS["d_model"], n_heads=PLAN_DEFAULTS["n_heads"],
                            n_kv_heads=PLAN_DEFAULTS["n_kv_heads"], d_ff=PLAN_DEFAULTS["d_ff"],
                            vocab_size=PLAN_DEFAULTS["vocab_size"], seq_len=PLAN_DEFAULTS["seq_len"],
                            embeddings=PLAN_DEFAULTS["embeddings"], request: gr.Request | None = None):
        service, user = self.context.service, user_of(request)
        try:
            mixed = isinstance(mix, str) and mix.strip() != ""  # a mix replaces the form's two lengths
            model = forms.model_dimensions(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                           d_ff=d_ff, vocab_size=vocab_size, seq_len=seq_len, embeddings=embeddings)
            req = serve_request(workload=workload, preset=preset, target=target, model=model,
                                prompt_len=None if mixed else prompt_len, gen_len=None if mixed else gen_len,
                                precision=precision, batches=batch_text(batches), gpus=gpus,
                                memory_fraction=memory_fraction, checkpoint=self._checkpoint(checkpoint, user),
                                kv_cache=kv_cache, chunk=chunk, mix=mix)
            label = forms.parse(FIELD["label"], label)
            job = await asyncio.to_thread(service.submit_serve_plan, user, req, label=label)
        except (ConfigError, LimitError, HistoryError) as exc:
            yield said_beside(exc, len(OUTPUTS) + 1)
            raise refuse(exc)
        async with contextlib.aclosing(self._stream(job, user, "serve-plan", "serving plan",
                                                    f"Compiling for {GPU_SPECS[req.target].name}",
                                                    code_state=code_state)) as updates:
            async for update in updates:
                yield update

    async def do_serve_run(self, plan_state=None, code_state=None, workload=PLAN_DEFAULTS["workload"], preset=PLAN_DEFAULTS["preset"],
                           precision=PLAN_DEFAULTS["precision"], requests=RUN_DEFAULTS["requests"],
                           run_batches=RUN_DEFAULTS["run_batches"], prompt_min=RUN_DEFAULTS["prompt_min"],
                           prompt_max=RUN_DEFAULTS["prompt_max"], gen_min=RUN_DEFAULTS["gen_min"],
                           gen_max=RUN_DEFAULTS["gen_max"], temperature=RUN_DEFAULTS["temperature"],
                           seed=RUN_DEFAULTS["seed"], memory_fraction=PLAN_DEFAULTS["memory_fraction"],
                           label=PLAN_DEFAULTS["label"], checkpoint=PLAN_DEFAULTS["checkpoint"],
                           kv_cache=PLAN_DEFAULTS["kv_cache"], n_layers=PLAN_DEFAULTS["n_layers"],
                           d_model=PLAN_DEFAULTS["d_model"], n_heads=PLAN_DEFAULTS["n_heads"],
                           n_kv_heads=PLAN_DEFAULTS["n_kv_heads"], d_ff=PLAN_DEFAULTS["d_ff"],
                           vocab_size=PLAN_DEFAULTS["vocab_size"], seq_len=PLAN_DEFAULTS["seq_len"],
                           embeddings=PLAN_DEFAULTS["embeddings"], request: gr.Request | None = None):
        service, user = self.context.service, user_of(request)
        try:
            model = forms.model_dimensions(n_layers=n_layers, d_model=d_model, n_heads=n_heads, n_kv_heads=n_kv_heads,
                                           d_ff=d_ff, vocab_size=vocab_size, seq_len=seq_len, embeddings=embeddings)
            req = serve_run_request(workload=workload, preset=preset, precision=precision, requests=requests, model=model,
                                    batches=batch_text(run_batches), prompt_min=prompt_min, prompt_max=prompt_max,
                                    gen_min=gen_min, gen_max=gen_max, temperature=temperature, seed=seed,
                                    checkpoint=self._checkpoint(checkpoint, user), kv_cache=kv_cache)
            label = forms.parse(FIELD["label"], label)
            job = await asyncio.to_thread(service.submit_serve_run, user, req, label=label,
                                          memory_fraction=memory_fraction)
        except (ConfigError, LimitError, HistoryError) as exc:
            yield said_beside(exc, len(OUTPUTS) + 1)
            raise refuse(exc)
        async with contextlib.aclosing(self._stream(job, user, "serve-run", "serving run",
                                                    "Serving on this machine", code_state=code_state,
                                                    plan=plan_state)) as updates:
            async for update in updates:
                yield update

    async def _stream(self, job: Job, user: str, kind: str, what: str, working: str, code_state: Any = None,
                      plan: Any = None):
        """A submitted serving job's updates to its end: its progress, then its table, charts, CSV and
        checklist (or why it ended without them); a finished plan also becomes the session's plan."""
        # Closed with this stream (Stop, a closed tab): following stops, and with it the job.
        async with contextlib.aclosing(self._follow(job, f"Your {what}", working)) as updates:
            async for update in updates:
                yield (*update, gr.skip())
        if job.state != "done" or job.result is None:
            yield (*self._ended(job, what), gr.skip())
            return
        r = job.result
        planned = kind == "serve-plan"
        shown = ((plan_headline, plan_frame, plan_latency, plan_throughput, plan_csv_rows) if planned else
                 (run_headline, run_frame, run_latency, run_throughput, run_csv_rows))
        code = CodeCheck.from_dict(code_state) if isinstance(code_state, dict) else None
        evidence = (ServingEvidence(plan=r, code=code) if planned else
                    ServingEvidence(plan=plan if isinstance(plan, dict) else None, run=r, code=code))
        checklist = checklist_html(serving_checklist(evidence), "Serving checklist")
        yield (*self._shown(job, user, kind, checklist, *(show(r) for show in shown)), r if planned else gr.skip())

    def _checkpoint(self, name: Any, user: str) -> str:
        """The folder of the user's checkpoint a form names, in their private checkpoint folder (never a
        path from the form: forms.checkpoint_name refuses those); "" for none."""
        return forms.checkpoint_folder(name, "checkpoint", private_dir(self.context.checkpoint_root /
                                                                       forms.user_folder(user)))

    async def _follow(self, job: Job, queued: str, working: str):
        """The job's progress as updates: its place in the queue, then a line a second while its worker works."""
        yield (f"{queued} is submitted (job #{job.id})…", *cleared(len(OUTPUTS) - 1), job.id)
        last = ""
        async with contextlib.aclosing(follow(self.context.service, job)) as events:
            async for ev in events:
                if ev["event"] == "waiting":
                    line = waiting_line(ev, queued)
                elif ev["event"] == "serving" and ev["worker_event"]["event"] == "heartbeat":
                    line = f"{working} (job #{job.id})… {ev['worker_event']['elapsed_s']:.0f} s"
                else:
                    continue
                if line != last:
                    last = line
                    yield (line, *[None] * (len(OUTPUTS) - 1), gr.skip())

    @staticmethod
    def _ended(job: Job, what: str) -> tuple[Any, ...]:
        """The last update of a job that ended without a result: stopped, or its error in one line."""
        if job.state in ("cancelled", "interrupted"):
            return (f"The {what} was stopped (job #{job.id}); the History records it as {job.state}.",
                    *[gr.skip()] * (len(OUTPUTS) - 1), None)
        raise gr.Error(f"The {what} failed (job #{job.id}): {job.error or 'it ended without a result'}",
                       print_exception=False)

    def _shown(self, job: Job, user: str, name: str, checklist: str, headline: str, table: pd.DataFrame,
               latency: pd.DataFrame, throughput: pd.DataFrame, csv_rows: list[dict[str, Any]]) -> tuple[Any, ...]:
        """The last update of a job with its result: the headline, the table, the charts, the CSV (written
        to the user's own exports folder, named by this server) and the checklist."""
        path = self.context.export_path(name, user)
        try:
            write_csv(csv_rows, path=path)
        except OSError as exc:
            raise gr.Error(f"The {name} CSV could not be written ({exc.strerror or type(exc).__name__})",
                           print_exception=False)
        warnings = "".join(f"\n\n⚠️ {w}" for w in job.warnings)
        return (f"{headline}{warnings}",
                shaped(table, PLAN_SHARES if list(table.columns) == PLAN_COLUMNS else RUN_SHARES),
                gr.update(value=latency, visible=not latency.empty),
                gr.update(value=throughput, visible=not throughput.empty),
                gr.update(value=str(path), visible=True), gr.update(value=checklist, visible=True), None)


def batch_text(value: Any) -> Any:
    """The batch sizes' text as typed, blank meaning the default; other values are left to the check."""
    return value.strip() if isinstance(value, str) else value


# -- the results as tables and charts ---------------------------------------------------------------

def ms(seconds: Any, digits: int = 3) -> float | None:
    return round(seconds * 1e3, digits) if isinstance(seconds, (int, float)) else None


def plan_headline(plan: dict[str, Any]) -> str:
    req = plan["request"]
    largest, budget = plan.get("largest_batch"), fmt_bytes(plan.get("budget_bytes"))
    limits = plan.get("concurrency_limits") or {}
    if not largest:
        fewest = plan.get("fewest_gpus_for_weights") or 0
        fits = (f"nothing fits in the budget of {budget}, not even one sequence; the weights alone need at least "
                f"{fewest} GPUs of this kind{' (more than one node of 8: not planned here)' if fewest > 8 else ''}")
    else:
        bound = {"kv_cache": "the KV cache's pages", "token_budget": "the step's token budget",
                 "search_limit": "the planner's limit"}.get(plan.get("bound_by"), plan.get("bound_by"))
        fits = (f"**{largest:,}** running sequences in {budget}, bound by {bound} (the KV cache holds "
                f"{fmt_count(limits.get('kv_cache', 0), 'sequences')}; the step's token budget "
                f"{fmt_count(limits.get('token_budget', 0), 'sequences')})")
    gpus = plan.get("gpus", 1)
    split = (f" Tensor-parallel over {gpus} GPUs ({plan.get('link')}): memory, KV cache and the limit are per GPU, "
             "the collectives are in TTFT and TPOT." if gpus > 1 else "")
    return (f"**Serving plan: {model_name(req['workload'], req['preset'], req.get('model'))} on {gpus} × {plan['target']}**, "
            f"{req['precision']}, {mix_text(plan.get('mix') or [[1.0, req['prompt_len'], req['gen_len']]])}, "
            f"{plan.get('attention')} attention: {fits}. Engine modelled: {plan.get('engine')}. Predicted from the "
            "programs compiled for the GPU without it (a prefill chunk, the decode step at each concurrency), not "
            "measured. TTFT: a prompt's chunks in the budget the decode tokens leave, no queue; TPOT: one engine step; "
            "the bandwidth limit: the weights read and the cached tokens read once, which no decode step beats." + split
            + (" " + experts_text(plan) if plan.get("mixture_of_experts") else ""))


def plan_frame(plan: dict[str, Any]) -> pd.DataFrame:
    """One row per concurrency planned, every figure in its unit (the CSV keeps bytes and seconds)."""
    gpus = plan.get("gpus", 1)
    rows = [{"running sequences": r["batch"], "KV cache": fmt_bytes(r["kv_cache_bytes"]),
             "weights": fmt_bytes(r["weights_bytes"]), "predicted peak": fmt_bytes(r["predicted_peak_bytes"]),
             "budget": fmt_bytes(r["budget_bytes"]), "fits": "yes" if r["fits"] else "NO",
             "TTFT": fmt_seconds(r["predicted_ttft_s"]), "TPOT": fmt_seconds(r["predicted_tpot_s"]),
             "TPOT bandwidth limit": fmt_seconds(r["bandwidth_limit_tpot_s"]),
             "throughput": fmt_count(r["tokens_per_s_per_gpu"] * gpus, "tokens/s"),
             "requests": fmt_count(r["requests_per_s"], "requests/s"),
             "decode bytes / needed": f"{fmt_number(r['decode_bytes_over_needed'])}×"} for r in plan["rows"]]
    return pd.DataFrame(rows, columns=PLAN_COLUMNS)


PLAN_COLUMNS = ["running sequences", "KV cache", "weights", "predicted peak", "budget", "fits", "TTFT", "TPOT",
                "TPOT bandwidth limit", "throughput", "requests", "decode bytes / needed"]
PLAN_SHARES = (9, 7, 7, 7, 7, 4, 7, 7, 9, 10, 9, 8)  # each column's share of the table's width


def plan_csv_rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows in bytes and seconds, with the GPU and the request's precision and lengths."""
    req = plan["request"]
    return [{"target": plan["target"], "gpus": plan.get("gpus", 1), "precision": req["precision"], "prompt_len": req["prompt_len"],
             "gen_len": req["gen_len"], **r} for r in plan["rows"]]


def series_frame(points: list[tuple[int, Any, str]], y: str) -> pd.DataFrame:
    """(batch, value, series) points as a chart's frame, typed even when empty; missing values left out."""
    rows = [{"batch": b, y: float(v), "series": s} for b, v, s in points if isinstance(v, (int, float))]
    return whole_axis(pd.DataFrame(rows, columns=["batch", y, "series"]).astype(
        {"batch": "int64", y: "float64", "series": "str"}), "batch")


def plan_latency(plan: dict[str, Any]) -> pd.DataFrame:
    return series_frame([(r["batch"], ms(r[key]), name) for r in plan["rows"] for key, name in
                         (("predicted_ttft_s", "TTFT (predicted)"), ("predicted_tpot_s", "TPOT (predicted)"),
                          ("bandwidth_limit_tpot_s", "TPOT bandwidth limit"))], "ms")


def plan_throughput(plan: dict[str, Any]) -> pd.DataFrame:
    return series_frame([(r["batch"], r["tokens_per_s_per_gpu"], f"predicted on {plan['target']}")
                         for r in plan["rows"]], "tokens_per_s")


def measured_on(result: dict[str, Any]) -> str:
    """Where a serving run was measured, saying so when those are CPU figures."""
    where = f"{result.get('device_kind')} ({result.get('backend')} backend)"
    return where + (": CPU figures, not a GPU's" if result.get("backend") == "cpu" else "")


def run_headline(result: dict[str, Any]) -> str:
    req = result["request"]
    rows = result.get("rows") or []
    recompiles = sum(r.get("recompiles") or 0 for r in rows)
    cpu = " **CPU backend: these are CPU figures, not a GPU's.**" if result.get("backend") == "cpu" else ""
    prompts, gens = req.get("prompt_range") or ("?", "?"), req.get("gen_range") or ("?", "?")
    generated = rows[0].get("generated_tokens") if rows else None
    return (f"**Serving run: {model_name(req['workload'], req['preset'], req.get('model'))}**, {req['precision']}, "
            f"{result.get('weights') or 'random'} weights, the same {req.get('requests')} requests at each batch size "
            f"({', '.join(str(r['batch']) for r in rows)}), measured on {measured_on(result)}; prompts {prompts[0]} "
            f"to {prompts[1]} tokens (padded to {result.get('buckets')}), generations {gens[0]} to {gens[1]} "
            f"({generated} tokens generated each time); compiles after the warm-up: {recompiles}."
            + logits_line(result.get("logits_check")) + kv_line(result.get("kv_cache_check")) + cpu)


def kv_line(check: Any) -> str:
    """An fp8 KV cache's generated tokens against the compute dtype's cache, when the run checked them."""
    if not isinstance(check, dict) or not isinstance(check.get("token_agreement"), (int, float)):
        return ""
    return (f" fp8 KV cache against {check.get('against')}: {check['token_agreement']:.1%} of "
            f"{check.get('tokens')} generated tokens agree (greedy, the same {check.get('sequences')} prompts).")


def logits_line(check: Any) -> str:
    """The serving precision's logits against float32's, when the run checked them."""
    if not isinstance(check, dict):
        return ""
    def pct(key: str, spec: str) -> str:
        return format(check[key], spec) if isinstance(check.get(key), (int, float)) else "n/a"

    verdict = "within" if check.get("within") else "**not within**"
    return (f" Logits in {check.get('precision')} against float32 on the same weights: RMS of the difference "
            f"{pct('rms_ratio', '.2%')} of float32's, {verdict} the tolerance of {pct('tolerance', '.0%')}; the top "
            f"token agrees at {pct('top1_agreement', '.1%')} of positions.")


def run_frame(result: dict[str, Any]) -> pd.DataFrame:
    """One row per batch size measured, every figure in its unit, and where it was measured."""
    where = measured_on(result)

    def peak(r: dict[str, Any]) -> str:
        source = r.get("peak_memory_source")
        return fmt_bytes(r.get("peak_memory_bytes")) + ("" if memory_provenance(source) == "measured" else
                                                        f" ({source})" if source else "")
    rows = [{"batch": r["batch"], "TTFT p50": fmt_seconds(r.get("ttft_p50_s")),
             "TTFT p90": fmt_seconds(r.get("ttft_p90_s")), "TPOT p50": fmt_seconds(r.get("tpot_p50_s")),
             "TPOT p90": fmt_seconds(r.get("tpot_p90_s")), "throughput": fmt_count(r.get("tokens_per_s"), "tokens/s"),
             "warm-up": fmt_seconds(r.get("warmup_s")), "programs compiled": fmt_number(r.get("programs_compiled")),
             "compiles after warm-up": fmt_number(r.get("recompiles")), "measured on": where, "peak memory": peak(r)}
            for r in result.get("rows") or []]
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


RUN_COLUMNS = ["batch", "TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", "throughput", "warm-up", "programs compiled",
               "compiles after warm-up", "measured on", "peak memory"]
RUN_SHARES = (8, 6, 6, 6, 6, 9, 6, 7, 7, 18, 14)


def run_csv_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The table's rows in seconds and bytes, with where they were measured."""
    return [{**r, "backend": result.get("backend"), "device_kind": result.get("device_kind"),
             "precision": result["request"].get("precision")} for r in result.get("rows") or []]


def run_latency(result: dict[str, Any]) -> pd.DataFrame:
    backend = result.get("backend")
    return series_frame([(r["batch"], ms(r.get(key)), f"{name} ({backend})") for r in result.get("rows") or []
                         for key, name in (("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"),
                                           ("tpot_p50_s", "TPOT p50"), ("tpot_p90_s", "TPOT p90"))], "ms")


def run_throughput(result: dict[str, Any]) -> pd.DataFrame:
    return series_frame([(r["batch"], r.get("tokens_per_s"), f"measured ({result.get('backend')} backend)")
                         for r in result.get("rows") or []], "tokens_per_s")
