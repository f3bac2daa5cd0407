"""Gradio app: plan, run, watch, compare and export TPU-to-GPU migrations on a shared GPU box.

A thin shell over the backend (`migration/`): it turns form values into `PlanRequest` /
`RunConfig`, starts planner and run workers through `migration.runner`, and formats the typed
results. The server process never initialises a JAX backend (it would claim 75% of a shared GPU);
every plan and run happens in a worker process.

    python app.py --host 127.0.0.1 --port 7860 [--root-path /migrate] [--auth-file users.txt]
                  [--history-db runs/history.sqlite] [--queue-size 32]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import gradio as gr
import pandas as pd

from migration import checklist
from migration.codecheck import CodeCheck, CodeCheckError, Finding, check_sources
from migration.common import GiB, first_line, fmt_gib
from migration.config import PRECISIONS, REMAT_NAMES, ConfigError, PlanRequest, RunConfig
from migration.hardware import GPU_SPECS, TPU_SPECS
from migration.history import SUMMARY_COLUMNS, History
from migration.orchestrate import RunOptions, base_config, run_plan
from migration.report import Plan, RunReport
from migration.runner import PlanError, plan as make_plan, probe_environment
from migration.worker_env import nvidia_gpus
from workloads import WORKLOADS

EXPORT_DIR = Path(tempfile.gettempdir()) / "tpu-gpu-migration-exports"


def _gib(n: Any) -> str:
    return fmt_gib(n, 3)


def host_banner() -> str:
    gpus = nvidia_gpus()
    if not gpus:
        return ("**This host has no NVIDIA GPU.** Runs execute on JAX's CPU backend and are labelled as CPU "
                "figures; GPU targets are planned by compiling for them without the device.")
    names = ", ".join(f"{g['name']} ({g['total_bytes'] / GiB:.0f} GiB)" for g in gpus)
    return f"GPU host: {names}. One GPU job runs at a time; others wait in the queue and see their position."


# -- form -> backend configs ----------------------------------------------------------------------

def plan_request(workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                 memory_fraction, granularity, remat, precision, accumulation) -> PlanRequest:
    def whole(value: Any, field: str) -> int:
        if value is None or float(value) != int(value):
            raise ConfigError(field, f"must be a whole number; got {value!r}")
        return int(value)

    return PlanRequest(
        workload=workload, preset=preset, source=source, global_batch=whole(global_batch, "global_batch"),
        per_core_batch=whole(per_core_batch, "per_core_batch") or None, source_precision=source_precision,
        target=target, gpus=whole(gpus, "gpus"), memory_fraction=float(memory_fraction), granularity=granularity,
        remat=None if remat == "auto" else remat, precision=None if precision == "auto" else precision,
        accumulation_steps=whole(accumulation, "accumulation_steps") or None,
    )


# -- formatting ---------------------------------------------------------------------------------

def plan_markdown(p: Plan) -> str:
    head = (f"### {p.workload}/{p.preset}: {p.source_name} → {p.gpus} × {p.target_name}\n"
            f"Prediction: **{p.prediction_method}** — {p.prediction_note}. Budget per GPU {_gib(p.budget_bytes)} "
            f"({p.memory_fraction:.0%} of {_gib(p.device_memory_bytes)} minus a {p.safety_margin:.0%} margin; device "
            f"memory: {p.budget_source}).\n\n")
    if p.status != "ok":
        return head + f"**Not feasible.** {p.message}"
    exact = "" if p.global_batch_exact else f" (**not** the requested {p.requested_global_batch})"
    src = p.source_tpu_compile
    source_line = (f"On the source TPU ({src['device_kind']}): {_gib(src['peak_bytes_per_chip'])} per device; "
                   f"the plan uses {_gib(p.predicted_peak_bytes)} per GPU.\n\n" if src.get("status") == "ok" else
                   f"Source TPU compile: {src.get('status')} — {src.get('reason', '')}\n\n")
    env = "\n".join(f"export {k}={v['value']!r}  # {v['why']}" for k, v in p.environment.items())
    return (head + f"**Plan:** {p.per_device_batch} per GPU × {p.gpus} GPU(s) × {p.accumulation_steps} accumulation = "
            f"global batch {p.global_batch}{exact}, **{p.precision}**, remat **{p.remat}**; predicted peak "
            f"{_gib(p.predicted_peak_bytes)} per GPU"
            + (f", predicted step {p.predicted_step_s * 1e3:.1f} ms" if p.predicted_step_s else "")
            + ". The table below ranks every choice that fits by predicted step time.\n\n"
            f"TPU-style setup on this target: {p.tpu_setup_on_target.get('summary', 'n/a')}.\n\n"
            f"Guide's rule of thumb: batch **{p.rule_of_thumb_batch}** vs the compiler's **{p.per_device_batch}** "
            f"— {p.rule_of_thumb_note}.\n\n" + source_line +
            f"Matmul precision — TPU: {p.matmul_precision['tpu']}; GPU: {p.matmul_precision['gpu']}.\n\n"
            f"Search: {p.compiles} compile(s), {p.cache_hits} cache hit(s), {p.search_seconds:.1f} s.\n\n"
            f"```bash\n{env}\n```")


def ranked_frame(p: Plan) -> pd.DataFrame:
    """The fitting choices, fastest predicted step first (the planner's choice rule)."""
    return pd.DataFrame(p.ranked_rows(), columns=["remat", "per_device_batch", "accumulation_steps", "global_batch",
                                                  "device_fill", "predicted_step", "chosen"])


def plan_frames(p: Plan) -> tuple[pd.DataFrame, pd.DataFrame]:
    decisions = pd.DataFrame([{"decision": d.decision, "value": str(d.value), "reason": d.reason} for d in p.decisions])
    rows = [{"per_device_batch": r["per_device_batch"], "predicted_GiB": r["predicted_bytes"] / GiB,
             "series": f"remat {r['remat']}"} for r in p.table if r["predicted_bytes"] is not None
            and r["accumulation_steps"] == 1]
    batches = sorted({r["per_device_batch"] for r in rows}) or [p.per_device_batch or 1]
    rows += [{"per_device_batch": b, "predicted_GiB": p.budget_bytes / GiB, "series": "budget"} for b in batches]
    memory = pd.DataFrame(rows, columns=["per_device_batch", "predicted_GiB", "series"])
    return decisions, memory.astype({"per_device_batch": "int64", "predicted_GiB": "float64", "series": "str"})


def results_frame(r: RunReport, budget: int | None) -> pd.DataFrame:
    rows = [
        ("status", r.status if r.ok else f"{r.status} ({r.failure_kind}): {r.message}"),
        ("measured on", f"{r.device_kind} ×{r.device_count}, {r.backend} backend, JAX {r.jax_version}, host {r.host}"),
        ("peak memory, measured", f"{_gib(r.peak_memory_bytes)} — {r.peak_memory_source}"),
        ("peak memory, predicted (compiled)", _gib(r.predicted_peak_bytes)),
        ("memory budget (plan)", _gib(budget)),
        ("step time median / p90", f"{r.step_ms_median or 0:.2f} / {r.step_ms_p90 or 0:.2f} ms"),
        ("samples/s", f"{r.samples_per_s or 0:,.1f}"),
        ("tokens/s", "n/a" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"),
        ("MFU", "n/a" if r.mfu is None else f"{100 * r.mfu:.1f} % of {r.peak_tflops_source}"),
        ("compile time", f"{r.compile_s or 0:.2f} s"),
        ("recompilations after the first step", str(r.recompilations)),
        ("fp32 matmul precision", str(r.fp32_matmul_precision)),
        ("config", f"{r.per_device_batch} per device × {r.devices} × {r.accumulation_steps} accum = {r.global_batch}, "
                   f"{r.precision}, remat {r.remat}"),
    ]
    return pd.DataFrame(rows, columns=["metric", "value"])


def loss_frame(reports: list[tuple[str, RunReport]]) -> pd.DataFrame:
    rows = [{"step": i + 1, "loss": loss, "run": name} for name, r in reports for i, loss in enumerate(r.losses)
            if isinstance(loss, (int, float))]
    # Typed even when empty: a plot fixes its axis types from the first frame it is sent.
    return pd.DataFrame(rows, columns=["step", "loss", "run"]).astype({"step": "int64", "loss": "float64", "run": "str"})


def checklist_frame(items: list[checklist.ChecklistItem]) -> pd.DataFrame:
    return pd.DataFrame([dataclasses.asdict(i) for i in items], columns=["id", "item", "status", "evidence", "action"])


def findings_frame(findings: list[Finding]) -> pd.DataFrame:
    return pd.DataFrame([f.to_dict() for f in findings],
                        columns=["file", "line", "col", "rule", "severity", "message", "replacement"])


def export_path(name: str) -> Path:
    EXPORT_DIR.mkdir(parents=True, exist_ok=True)
    return EXPORT_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{time.monotonic_ns() % 10**6}.csv"


def history_frame(entries: list[dict[str, Any]]) -> pd.DataFrame:
    columns = [c for c in SUMMARY_COLUMNS]
    frame = pd.DataFrame([{c: e.get(c) for c in columns} for e in entries], columns=columns)
    for col in ("peak_memory_bytes", "predicted_peak_bytes"):
        frame[col.replace("_bytes", "_GiB")] = frame.pop(col).astype(float) / GiB
    return frame


def parse_ids(text: str) -> list[int]:
    text = (text or "").replace(" ", "")
    if not text:
        return []
    try:
        return [int(part) for part in text.split(",") if part]
    except ValueError:
        raise gr.Error(f"ids must be comma-separated numbers from the History table, like 3,5; got {text!r}")


# -- the app ------------------------------------------------------------------------------------

def build_demo(history_path: str | Path = "runs/history.sqlite") -> gr.Blocks:
    history = History(history_path)
    default_target = "local" if nvidia_gpus() else "h100-sxm"

    def do_plan(*form):
        try:
            req = plan_request(*form)
            result = make_plan(req)
        except ConfigError as exc:
            raise gr.Error(f"Invalid input: {exc}")
        except PlanError as exc:
            raise gr.Error(f"Planning failed ({exc.kind}): {exc}")
        history.add_plan(result)
        decisions, memory = plan_frames(result)
        return plan_markdown(result), decisions, ranked_frame(result), memory, result.to_dict()

    def do_run(plan_dict, code_state, steps, learning_rate, compare_tpu, profile, fp32_reference, *form):
        """Generator: progress while the plan is fitted here and its workers run; closing it (Stop,
        disconnect) kills the current worker and records the run as cancelled."""
        note, result = "", None
        try:
            p = Plan.from_dict(plan_dict) if plan_dict else make_plan(plan_request(*form))
            steps = int(steps)
            base = base_config(p, steps=steps, learning_rate=float(learning_rate), timeout_s=3600,
                               warmup_steps=min(2, max(0, steps - 1)))
            options = RunOptions(fp32_reference=bool(fp32_reference), tpu_style=bool(compare_tpu), profile=bool(profile))
            code = CodeCheck.from_dict(code_state) if code_state else None
            events = run_plan(p, base, options, EXPORT_DIR, code=code, history=history)
            try:
                for ev in events:
                    if ev["event"] == "status":
                        yield (ev["message"], *[gr.skip()] * 7)
                    elif ev["event"] == "note":
                        note = ev["message"] + ".\n\n"
                    elif ev["event"] == "progress":
                        losses = loss_frame(ev["done"] + [(ev["run"], ev["partial"])])
                        # An empty frame would fix the plot's colour scale with no series: skip it.
                        yield (note + ev["status"], gr.skip(), losses if len(losses) else gr.skip(), *[gr.skip()] * 5)
                    elif ev["event"] == "result":
                        result = ev["result"]
            finally:
                events.close()  # Stop or disconnect: kills the worker and records the run as cancelled
        except (ConfigError, ValueError, TypeError) as exc:
            raise gr.Error(f"Invalid input: {exc} (steps: a whole number from 1; learning rate: a positive number)")
        except PlanError as exc:
            raise gr.Error(f"Cannot run this plan here: {exc}")
        except (OSError, sqlite3.Error) as exc:
            raise gr.Error(f"The run could not be recorded or exported: {first_line(exc)}")
        main = result.main
        headline = "finished" if main.ok else f"failed ({main.failure_kind}): {main.message}"
        cpu_note = " — **CPU backend: these are CPU figures, not GPU ones.**" if main.backend == "cpu" else ""
        budget = (result.local_plan or result.plan).budget_bytes
        yield (f"{note}Run {headline}{cpu_note}", results_frame(main, budget), loss_frame(result.runs),
               result.files["report_csv"], checklist_frame(result.checklist), result.files["checklist_csv"],
               result.files["deployment"], result.files.get("trace"))

    def do_code_check(text, files):
        sources: list[tuple[str, str]] = []
        try:
            if text and text.strip():
                sources.append(("<pasted>", text))
            for f in files or []:
                path = Path(f if isinstance(f, str) else f.name)
                if path.suffix != ".py":
                    raise CodeCheckError(f"{path.name}: only .py files are checked")
                sources.append((path.name, path.read_text(encoding="utf-8", errors="replace")))
            if not sources:
                raise CodeCheckError("Paste Python source or upload .py files to check")
            result = check_sources(sources)
        except CodeCheckError as exc:
            raise gr.Error(str(exc))
        findings = list(result.findings)
        errors = sum(f.severity == "error" for f in findings)
        summary = (f"{len(findings)} finding(s), {errors} error(s) in {len(result.files)} file(s). "
                   if findings else "No findings: nothing TPU-specific or outdated was found. ")
        summary += "The Migrate tab's checklist grades the items about your code from this check."
        return summary, findings_frame(findings), result.to_dict()

    def do_history(kind, workload, status):
        return history_frame(history.entries(kind=None if kind == "all" else kind,
                                             workload=None if workload == "all" else workload,
                                             status=None if status == "all" else status))

    def do_compare(ids_text):
        ids = parse_ids(ids_text)
        if len(ids) < 2:
            raise gr.Error("Select two or more run ids to compare, like 3,5")
        entries = [e for e in history.entries(kind="run", ids=ids)]
        if len(entries) < 2:
            raise gr.Error(f"Found {len(entries)} run(s) among ids {ids}; compare needs two or more runs")
        frame = history_frame(entries)
        frame["config"] = [f"#{e['id']} {e['preset']} b{e['per_device_batch']}x{e['accumulation_steps']} "
                           f"{e['precision']} {e['remat']}" for e in entries]
        return frame, frame[["config", "samples_per_s"]], frame[["config", "peak_memory_GiB"]]

    def do_export(ids_text):
        ids = parse_ids(ids_text) or None
        path = export_path("history" if ids is None else "selection")
        history.to_csv(ids=ids, path=path)
        return str(path)

    def do_environment():
        try:
            info = probe_environment(RunConfig(timeout_s=120))
        except RuntimeError as exc:
            raise gr.Error(f"The environment probe failed: {exc}")
        warnings = list(info["warnings"]) + [
            "The server process never initialises JAX's GPU backend: JAX would preallocate 75% of each GPU "
            "for it. Plans and runs happen in worker processes with XLA_PYTHON_CLIENT_PREALLOCATE=false."]
        lines = [f"**Backend:** {info['backend']} ({info['device_count']} device(s): "
                 + ", ".join(d["kind"] for d in info["devices"]) + ")",
                 "**Versions:** " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()),
                 "**JAX/XLA environment of a worker:** " + ", ".join(f"`{k}={v}`" for k, v in info["env"].items())]
        for g in info["nvidia_gpus"]:
            lines.append(f"**GPU {g['index']}** {g['name']}: {_gib(g['used_bytes'])} used of {_gib(g['total_bytes'])}, "
                         f"{_gib(g['used_by_other_processes_bytes'])} by other processes")
        lines += [f"⚠️ {w}" for w in warnings]
        return "\n\n".join(lines), info

    with gr.Blocks(title="TPU → GPU migration explorer") as demo:
        gr.Markdown("# TPU → GPU migration explorer")
        gr.Markdown(host_banner())
        with gr.Tab("Migrate"):
            with gr.Row():
                workload = gr.Dropdown(list(WORKLOADS), value="transformer", label="Workload")
                preset = gr.Dropdown(list(WORKLOADS["transformer"].presets), value="tiny", label="Preset")
                source = gr.Dropdown(list(TPU_SPECS), value="tpu-v5e-8", label="TPU source")
                source_precision = gr.Dropdown(["bf16", "fp32"], value="bf16", label="TPU precision")
            with gr.Row():
                global_batch = gr.Number(256, precision=0, label="Global batch")
                per_core_batch = gr.Number(0, precision=0, label="Per-core batch (0: global / cores)")
                target = gr.Dropdown(["local", *GPU_SPECS], value=default_target, label="Target GPU")
                gpus = gr.Number(1, precision=0, label="GPUs")
                memory_fraction = gr.Slider(0.05, 1.0, value=0.8, step=0.05, label="GPU memory share")
                steps = gr.Number(20, precision=0, label="Steps")
            with gr.Accordion("Advanced", open=False):
                with gr.Row():
                    remat = gr.Dropdown(["auto", *REMAT_NAMES], value="auto", label="Remat policy")
                    precision = gr.Dropdown(["auto", *PRECISIONS], value="auto", label="Precision")
                    accumulation = gr.Number(0, precision=0, label="Accumulation steps (0: auto)")
                    granularity = gr.Dropdown(["multiple8", "pow2"], value="multiple8", label="Batch sizes")
                    learning_rate = gr.Number(3e-3, label="Learning rate")
                    compare_tpu = gr.Checkbox(False, label="Also run the TPU-style setup here (loss comparison)")
                    profile = gr.Checkbox(False, label="Capture a profile (3 extra steps under jax.profiler.trace)")
                    fp32_reference = gr.Checkbox(False, label="Also run an fp32 reference (numerics check)")
            with gr.Row():
                plan_btn = gr.Button("Plan", variant="primary")
                run_btn = gr.Button("Run on this machine", variant="secondary")
                stop_btn = gr.Button("Stop", variant="stop")
            plan_md = gr.Markdown()
            decisions = gr.Dataframe(label="Decisions", wrap=True)
            ranked_table = gr.Dataframe(label="Choices that fit, fastest predicted step first", wrap=True)
            memory_plot = gr.ScatterPlot(x="per_device_batch", y="predicted_GiB", color="series",
                                         title="Predicted peak memory per GPU for each batch the search compiled, "
                                               "and the budget", height=300)
            progress_md = gr.Markdown()
            results = gr.Dataframe(label="Results", wrap=True)
            loss_plot = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300)
            report_file = gr.File(label="CSV of this report")
            checklist_table = gr.Dataframe(label="Migration checklist (status, evidence, action)", wrap=True)
            with gr.Row():
                checklist_file = gr.File(label="Checklist CSV (one row per item)")
                deploy_file = gr.File(label="Deployment snippet (environment + start command)")
                trace_file = gr.File(label="Profile trace (Perfetto / TensorBoard)")
            plan_state = gr.State(None)
            code_state = gr.State(None)
        with gr.Tab("History"):
            with gr.Row():
                f_kind = gr.Dropdown(["all", "run", "plan"], value="all", label="Kind")
                f_workload = gr.Dropdown(["all", *WORKLOADS], value="all", label="Workload")
                f_status = gr.Dropdown(["all", "ok", "failed", "cancelled", "infeasible"], value="all", label="Status")
                refresh_btn = gr.Button("Refresh")
            history_table = gr.Dataframe(label="Runs and plans", wrap=True)
            with gr.Row():
                ids = gr.Textbox(label="Ids to compare or export (e.g. 3,5)")
                compare_btn = gr.Button("Compare")
                export_sel_btn = gr.Button("Export selection (CSV)")
                export_all_btn = gr.Button("Export whole history (CSV)")
            compare_table = gr.Dataframe(label="Side by side", wrap=True)
            with gr.Row():
                throughput_plot = gr.BarPlot(x="config", y="samples_per_s", title="Throughput (samples/s)", height=280)
                memory_bar = gr.BarPlot(x="config", y="peak_memory_GiB", title="Peak memory (GiB)", height=280)
            export_file = gr.File(label="CSV export")
        with gr.Tab("Code check"):
            gr.Markdown("Reads Python source with `ast`; nothing is ever run. Up to 1 MB per file.")
            code_text = gr.Code(language="python", label="Paste a training script")
            code_files = gr.File(label="…or upload .py files", file_count="multiple", file_types=[".py"])
            code_btn = gr.Button("Check", variant="primary")
            code_summary = gr.Markdown()
            code_table = gr.Dataframe(label="Findings", wrap=True)
        with gr.Tab("Environment"):
            env_btn = gr.Button("Probe the environment (in a worker)")
            env_md = gr.Markdown()
            env_json = gr.JSON(label="Details")

        form = [workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                memory_fraction, granularity, remat, precision, accumulation]
        workload.change(lambda w: gr.Dropdown(choices=list(WORKLOADS[w].presets), value="tiny"), workload, preset,
                        api_visibility="private")
        plan_btn.click(do_plan, form, [plan_md, decisions, ranked_table, memory_plot, plan_state], api_name="plan",
                       concurrency_id="plan", concurrency_limit=2)
        run_event = run_btn.click(do_run, [plan_state, code_state, steps, learning_rate, compare_tpu, profile,
                                           fp32_reference, *form],
                                  [progress_md, results, loss_plot, report_file, checklist_table, checklist_file,
                                   deploy_file, trace_file], api_name="run",
                                  concurrency_id="gpu", concurrency_limit=1)
        code_btn.click(do_code_check, [code_text, code_files], [code_summary, code_table, code_state],
                       api_name="code_check")
        stop_btn.click(None, None, None, cancels=[run_event], api_name="stop")
        filters = [f_kind, f_workload, f_status]
        refresh_btn.click(do_history, filters, history_table, api_name="history")
        compare_btn.click(do_compare, ids, [compare_table, throughput_plot, memory_bar], api_name="compare")
        export_sel_btn.click(do_export, ids, export_file, api_name="export_csv")
        export_all_btn.click(lambda: do_export(""), None, export_file, api_name="export_history_csv")
        env_btn.click(do_environment, None, [env_md, env_json], api_name="environment")
        demo.load(do_history, filters, history_table, api_visibility="private")
    return demo


def read_auth(path: str | None, env_value: str | None) -> list[tuple[str, str]] | None:
    """Users as `user:password` lines in a file, or comma-separated in MIGRATION_AUTH."""
    pairs = []
    if path:
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise SystemExit(f"auth: cannot read the users file {path!r} ({exc.strerror}); expected user:password lines")
        pairs += [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    if env_value:
        pairs += [p.strip() for p in env_value.split(",") if p.strip()]
    users = []
    for pair in pairs:
        user, sep, password = pair.partition(":")
        if not sep or not user or not password:
            raise SystemExit(f"auth: expected user:password, got an entry for {user or '(empty user)'!r}")
        users.append((user, password))
    return users or None


def main() -> None:
    env = os.environ.get
    parser = argparse.ArgumentParser(description="TPU -> GPU migration explorer (Gradio app)")
    parser.add_argument("--host", default=env("MIGRATION_HOST", "127.0.0.1"),
                        help="address to listen on; a shared box sets 0.0.0.0 explicitly")
    parser.add_argument("--port", type=int, default=int(env("MIGRATION_PORT", "7860")))
    parser.add_argument("--root-path", default=env("MIGRATION_ROOT_PATH", ""), help="path prefix behind a reverse proxy")
    parser.add_argument("--auth-file", default=env("MIGRATION_AUTH_FILE"), help="file of user:password lines")
    parser.add_argument("--history-db", default=env("MIGRATION_HISTORY_DB", "runs/history.sqlite"))
    parser.add_argument("--queue-size", type=int, default=int(env("MIGRATION_QUEUE_SIZE", "32")),
                        help="jobs that may wait in the queue")
    args = parser.parse_args()
    demo = build_demo(args.history_db)
    demo.queue(max_size=args.queue_size, default_concurrency_limit=4)
    demo.launch(server_name=args.host, server_port=args.port, root_path=args.root_path or None,
                auth=read_auth(args.auth_file, env("MIGRATION_AUTH")), enable_monitoring=False, ssr_mode=False,
                show_error=True, share=False, run_history=False)


if __name__ == "__main__":
    main()
