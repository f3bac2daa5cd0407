"""Gradio app: plan, run, watch, compare and export TPU-to-GPU migrations on a shared GPU box.

A thin shell over the backend (`migration/`): form values go through `migration.forms` (every
field checked, refusals name the field), jobs go to `migration.jobs.JobService` (queue, owners,
per-user limits, records that survive a restart), and typed results are formatted here. The server
process never initialises a JAX backend (it would claim 75% of a shared GPU); every plan and run
happens in a worker process.

    python app.py --host 127.0.0.1 --port 7860 [--root-path /migrate] [--auth-file users.txt]
                  [--history-db runs/history.sqlite] [--jobs-per-user 4] [--max-steps 10000] ...
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import gc
import html
import http.cookies
import json
import math
import os
import re
import secrets
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from migration.common import GiB, cache_dir, first_line, fmt_gib, fmt_model, private_dir, remove_older_than, write_csv

# Gradio keeps uploaded and served files in its temp folder: make it private to the service user
# before gradio is imported (it reads the variable then).
os.environ.setdefault("GRADIO_TEMP_DIR", str(cache_dir() / "gradio"))

import gradio as gr  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
import pandas as pd  # noqa: E402

from migration import checklist, forms  # noqa: E402
from migration.accounts import USER_NAME, AccountsError, Authenticator, hash_password, read_users  # noqa: E402
from migration.codecheck import MAX_FILES, CodeCheck, CodeCheckError, Finding, check_pasted, read_upload  # noqa: E402
from migration.config import LIMITS, PRECISIONS, REMAT_NAMES, SHARDINGS, ConfigError, PlanRequest, RunConfig  # noqa: E402
from migration.hardware import GPU_SPECS, TPU_SPECS  # noqa: E402
from migration.history import EXPORT_MAX_ROWS, History, HistoryError  # noqa: E402
from migration.autotune import AutotuneResult, AutotuneSettings  # noqa: E402
from migration.jobs import Job, JobService, Limits, LimitError, NotYourJob, RateLimiter, user_exports  # noqa: E402
from migration.orchestrate import MigrationResult, RunOptions, candidate_text  # noqa: E402
from migration.planfile import MAX_PLAN_BYTES, checked_plan, read_plan  # noqa: E402
from migration.report import Plan, RunReport  # noqa: E402
from migration.runner import ExecutorError, PlanError, make_executor  # noqa: E402
from migration.worker import WORKER_CPUS_VARIABLE  # noqa: E402
from migration.worker_env import nvidia_gpus  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

POLL_S = 0.25  # how often a watcher looks for a job's new events
COMPARE_MAX = 16  # runs side by side in one comparison
PLOT_MAX_POINTS = 500  # points per run drawn in a loss plot
FINDINGS_SHOWN = 1000  # rows of the code check's table
PLOT_EVERY_S = 1.0  # a plot that grows while a job works is redrawn at most this often
PROGRESS_EVERY_S = 0.5  # a job's progress line is sent to its page at most this often
WAITING_REFRESH_S = 30.0  # a queued job's line is re-sent this often when its position has not changed
EXPORTS_MARKER = ".tpu-gpu-migration-exports"  # marks a folder as this app's exports (old files get deleted)
HISTORY_STATUSES = ("ok", "failed", "cancelled", "infeasible", "interrupted", "queued", "running")


@dataclasses.dataclass(frozen=True)
class Settings:
    history_db: str = "runs/history.sqlite"
    export_dir: str = ""  # default: a private folder under the cache directory
    limits: Limits = Limits()
    multi_user: bool = False  # auth configured: every job has an owner
    export_max_age_s: float = 7 * 24 * 3600
    history_max_mb: float | None = None
    ray_address: str = ""  # a Ray cluster for the runs and catalog plans (MIGRATION_RAY_ADDRESS); empty: this machine
    admins: tuple[str, ...] = ()  # users who may see, compare and export everyone's history
    team_history: bool = False  # the operator declared the history visible to every signed-in user


def _gib(n: Any) -> str:
    return fmt_gib(n, 3)


def host_banner(settings: Settings) -> str:
    gpus = nvidia_gpus()
    users = ((f"Signed-in users each see and stop their own jobs. History: {history_visibility(settings)}.")
             if settings.multi_user else
             "**Single-user mode** (no auth configured): everyone who can reach this page shares one identity, "
             "one history and one Stop.")
    if not gpus:
        return ("**This host has no NVIDIA GPU.** Runs execute on JAX's CPU backend and are labelled as CPU "
                "figures; GPU targets are planned by compiling for them without the device. " + users)
    names = ", ".join(f"{g['name']} ({g['total_bytes'] / GiB:.0f} GiB)" for g in gpus)
    return f"GPU host: {names}. One GPU job runs at a time; others wait in the queue and see their position. {users}"


def history_visibility(settings: Settings) -> str:
    """Who sees whose history on this server, in one line (the banner and the start-up line say it)."""
    if not settings.multi_user:
        return "one shared history (single user)"
    if settings.team_history:
        return "team-visible: every signed-in user may list everyone's runs (declared with --team-history)"
    if settings.admins:
        return f"each user sees their own; admins ({', '.join(settings.admins)}) may see everyone's"
    return "each user sees only their own"


# -- formatting ---------------------------------------------------------------------------------

def plan_markdown(p: Plan) -> str:
    where = f"{p.nodes} nodes × {p.gpus_per_node}" if p.nodes > 1 else f"{p.gpus}"
    dims = f" ({fmt_model(p.model)})" if p.model else ""
    sj = p.source_job
    source_job = (f"The TPU job: {sj['devices']} devices of {_gib(sj['hbm_bytes_per_device'])}, state **{sj['sharding']}** "
                  f"({_gib(sj['state_bytes_per_device'])} per device: {sj['why']}).\n\n" if sj else "")
    head = (f"### {p.workload}/{p.preset}{dims}: {p.source_name} → {where} × {p.target_name}\n"
            f"{p.param_count:,} parameters. " + source_job +
            f"Prediction: **{p.prediction_method}** — {p.prediction_note}. Budget per GPU {_gib(p.budget_bytes)} "
            f"({p.memory_fraction:.0%} of {_gib(p.device_memory_bytes)} minus a {p.safety_margin:.0%} margin; device "
            f"memory: {p.budget_source}).\n\n")
    if p.status != "ok":
        return head + f"**Not feasible.** {p.message}"
    exact = "" if p.global_batch_exact else f" (**not** the requested {p.requested_global_batch})"
    src = p.source_tpu_compile
    source_line = (f"On the source TPU ({src['device_kind']}): {_gib(src['peak_bytes_per_chip'])} per device; "
                   f"the plan uses {_gib(p.predicted_peak_bytes)} per GPU.\n\n" if src.get("status") == "ok" else
                   f"Source TPU compile: {src.get('status')} — {src.get('reason', '')}\n\n" if src else "")
    env = "\n".join(f"export {k}={v['value']!r}  # {v['why']}" for k, v in p.environment.items())
    st = p.state
    state_line = (f"State per GPU ({st['sharding']}, shared by {st['shared_by']}): {_gib(st['compiled_state_bytes_per_gpu'])} "
                  f"compiled for parameters and AdamW moments, {_gib(st['state_with_gradients_bytes_per_gpu'])} with "
                  f"gradients, against 16 B/parameter / {st['shared_by']} = {_gib(st['arithmetic_bytes_per_gpu'])} "
                  f"({st['difference']:+.2%}).\n\n" if st.get("state_with_gradients_bytes_per_gpu") is not None else "")
    return (head + f"**Plan:** **{p.sharding}** state, {p.per_device_batch} per GPU × {p.gpus} GPU(s) × "
            f"{p.accumulation_steps} accumulation = "
            f"global batch {p.global_batch}{exact}, **{p.precision}**, remat **{p.remat}**; predicted peak "
            f"{_gib(p.predicted_peak_bytes)} per GPU"
            + (f", predicted step {p.predicted_step_s * 1e3:.1f} ms" if p.predicted_step_s else "")
            + ". The table below ranks every choice that fits by predicted step time.\n\n" + state_line +
            f"TPU-style setup on this target: {p.tpu_setup_on_target.get('summary', 'n/a')}.\n\n"
            f"Guide's rule of thumb: batch **{p.rule_of_thumb_batch}** vs the compiler's **{p.per_device_batch}** "
            f"— {p.rule_of_thumb_note}.\n\n" + source_line +
            f"Matmul precision — TPU: {p.matmul_precision['tpu']}; GPU: {p.matmul_precision['gpu']}.\n\n"
            f"Search: {p.compiles} compile(s), {p.cache_hits} cache hit(s), {p.search_seconds:.1f} s.\n\n"
            f"```bash\n{env}\n```")


def ranked_frame(p: Plan) -> pd.DataFrame:
    """The fitting choices, fastest predicted step first (the planner's choice rule)."""
    return pd.DataFrame(p.ranked_rows(), columns=["remat", "per_device_batch", "accumulation_steps", "global_batch",
                                                  "device_fill", "predicted_step", "state", "chosen"])


def decisions_frame(p: Plan) -> pd.DataFrame:
    return pd.DataFrame([{"decision": d.decision, "value": str(d.value), "reason": d.reason} for d in p.decisions],
                        columns=["decision", "value", "reason"])


def memory_frame(rows: list[dict[str, Any]], budget: int | None) -> pd.DataFrame:
    """Predicted GiB per batch and remat policy (single micro-batch compiles; candidates ruled out by
    the lower bound were not compiled and are not drawn), with the budget."""
    points = [{"per_device_batch": r["per_device_batch"], "predicted_GiB": r["predicted_bytes"] / GiB,
               "series": f"remat {r['remat']}" + (" (fsdp)" if r.get("sharding") == "fsdp" else "")} for r in rows
              if r.get("predicted_bytes") is not None and r.get("accumulation_steps", 1) == 1 and not r.get("lower_bound")]
    batches = sorted({r["per_device_batch"] for r in points}) or [1]
    if budget:
        points += [{"per_device_batch": b, "predicted_GiB": budget / GiB, "series": "budget"} for b in batches]
    frame = pd.DataFrame(points, columns=["per_device_batch", "predicted_GiB", "series"])
    return frame.astype({"per_device_batch": "int64", "predicted_GiB": "float64", "series": "str"})


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
                   f"{r.precision}, remat {r.remat}, {r.sharding} state, {r.step_style} step"
                   + (f"; model {r.model}" if r.model else "")),
    ]
    if r.checkpoint_restored:
        rows.append(("started from checkpoint", r.checkpoint_restored))
    if r.checkpoint_saved:
        rows.append(("checkpoint saved", f"{r.checkpoint_saved}, {r.checkpoint_saved_bytes:,} bytes"))
    return pd.DataFrame(rows, columns=["metric", "value"])


def loss_frame(reports: list[tuple[str, RunReport]]) -> pd.DataFrame:
    return curve_frame({name: r.losses for name, r in reports})


def curve_frame(curves: dict[str, list[Any]], max_points: int = PLOT_MAX_POINTS) -> pd.DataFrame:
    """Loss per step for each run, at most `max_points` per run (every k-th step and the last), so
    the plot's data stays small however long the run."""
    rows = []
    for name, losses in curves.items():
        stride = max(1, -(-len(losses) // max_points))
        picked = range(0, len(losses), stride)
        for i in [*picked, *([len(losses) - 1] if losses and (len(losses) - 1) % stride else [])]:
            if isinstance(losses[i], (int, float)) and math.isfinite(losses[i]):
                rows.append({"step": i + 1, "loss": losses[i], "run": name})
    # Typed even when empty: a plot fixes its axis types from the first frame it is sent.
    return pd.DataFrame(rows, columns=["step", "loss", "run"]).astype({"step": "int64", "loss": "float64", "run": "str"})


def before_after_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The pmap and jit runs side by side (rows from `orchestrate.scaling_view`), figures as text."""
    def pct(x):
        return "n/a" if x is None else f"{x:.0%}"

    def num(x, spec):
        return "n/a" if x is None else format(x, spec)

    shown = [{"run": r["run"], "step": r["style"], "devices": r["devices"], "global batch": r["global_batch"],
              "samples/s": num(r["samples_per_s"], ",.1f"), "tokens/s": num(r["tokens_per_s"], ",.0f"),
              "step ms (median)": num(r["step_ms_median"], ".2f"), "scaling efficiency": pct(r["scaling_efficiency"]),
              "jit / pmap": num(r["jit_over_pmap"], ".2f"),
              "same loss": {True: "yes", False: "NO", None: "n/a"}[r["losses_match"]],
              "measured on": f"{r['device_kind']} ({r['backend']} backend), JAX {r['jax_version']}"} for r in rows]
    return pd.DataFrame(shown, columns=["run", "step", "devices", "global batch", "samples/s", "tokens/s",
                                        "step ms (median)", "scaling efficiency", "jit / pmap", "same loss",
                                        "measured on"])


def autotune_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Autotune rows: predicted rank and step against the measured median, status, the pick."""
    def ms(x):
        return "" if x is None else f"{x:.1f}"
    out = [{"predicted #": r["predicted_rank"], "state": r["sharding"], "remat": r["remat"],
            "batch": r["per_device_batch"], "accum": r["accumulation_steps"],
            "predicted ms": ms(None if r["predicted_step_s"] is None else 1e3 * r["predicted_step_s"]),
            "measured ms": ms(r["measured_step_ms"]), "measured #": r.get("measured_rank") or "",
            "peak GiB": _gib(r["peak_memory_bytes"]), "status": r["status"] if r["status"] == "ok"
            else f"{r['status']} ({r['failure_kind']})", "pick": "✓" if r.get("picked") else ""} for r in rows]
    return pd.DataFrame(out)


def scaling_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    points = [{"devices": r["devices"], "samples_per_s": r["samples_per_s"], "style": r["style"]} for r in rows
              if r["samples_per_s"] is not None]
    return pd.DataFrame(points, columns=["devices", "samples_per_s", "style"]).astype(
        {"devices": "int64", "samples_per_s": "float64", "style": "str"})


BADGE_COLOURS = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "not checked": "#57606a", "n/a": "#8c959f"}


def checklist_html(items: list[checklist.ChecklistItem]) -> str:
    """The checklist as a report: a status badge, the item, its evidence and the action, wrapped
    to the page's width (never a table to scroll sideways)."""
    counts = {s: sum(i.status == s for i in items) for s in BADGE_COLOURS}
    summary = " · ".join(f"{n} {s}" for s, n in counts.items() if n)
    cards = []
    for i in items:
        colour = BADGE_COLOURS.get(i.status, "#57606a")
        cards.append(
            f'<div class="ck-item" data-id="{html.escape(i.id)}" data-status="{html.escape(i.status)}" '
            f'style="border-left:4px solid {colour};padding:6px 10px;margin:6px 0">'
            f'<span class="ck-badge" style="background:{colour};color:#fff;border-radius:10px;padding:1px 8px;'
            f'font-size:0.85em;margin-right:8px">{html.escape(i.status)}</span>'
            f'<strong>{html.escape(i.item)}</strong>'
            f'<div style="white-space:normal;overflow-wrap:anywhere"><em>Evidence:</em> {html.escape(i.evidence)}</div>'
            f'<div style="white-space:normal;overflow-wrap:anywhere"><em>Action:</em> {html.escape(i.action)}</div>'
            "</div>")
    return f'<div class="checklist"><h3>Migration checklist</h3><p>{summary}</p>{"".join(cards)}</div>'


def findings_frame(findings: list[Finding]) -> pd.DataFrame:
    return pd.DataFrame([f.to_dict() for f in findings],
                        columns=["file", "line", "col", "rule", "severity", "message", "replacement"])


HISTORY_COLUMNS = ["id", "created_at", "user", "label", "kind", "model", "status", "config", "device_kind",
                   "samples_per_s", "mfu_%", "peak_GiB", "predicted_GiB", "compile_s"]


def history_frame(entries: list[dict[str, Any]]) -> pd.DataFrame:
    """The history as people read it: one line per entry, the configuration in one column."""
    rows = []
    for e in entries:
        config = (f"{e.get('per_device_batch') or '?'}×{e.get('devices') or '?'}×{e.get('accumulation_steps') or '?'} "
                  f"{e.get('precision') or ''} {e.get('remat') or ''}").strip()
        rows.append({
            "id": e["id"], "created_at": e["created_at"], "user": e.get("user") or "", "label": e.get("label") or "",
            "kind": e["kind"], "model": f"{e['workload']}/{e['preset']}", "status": e["status"], "config": config,
            "device_kind": e.get("device_kind") or e.get("target") or "",
            "samples_per_s": e.get("samples_per_s"), "mfu_%": None if e.get("mfu") is None else 100 * e["mfu"],
            "peak_GiB": None if e.get("peak_memory_bytes") is None else e["peak_memory_bytes"] / GiB,
            "predicted_GiB": None if e.get("predicted_peak_bytes") is None else e["predicted_peak_bytes"] / GiB,
            "compile_s": e.get("compile_s")})
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


def compare_frames(entries: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Side-by-side table, throughput, peak memory (predicted beside measured) and loss curves."""
    table = history_frame(entries)
    names = [f"#{e['id']} {e['preset']} b{e.get('per_device_batch')}×{e.get('accumulation_steps')} {e.get('precision')}"
             for e in entries]
    throughput = pd.DataFrame({"run": names, "samples_per_s": [float(e.get("samples_per_s") or 0) for e in entries]})
    memory = pd.DataFrame(
        [{"bar": f"{n} · {what}", "GiB": float(e.get(key) or 0) / GiB, "series": what}
         for n, e in zip(names, entries) for what, key in (("predicted", "predicted_peak_bytes"),
                                                          ("measured", "peak_memory_bytes"))],
        columns=["bar", "GiB", "series"])
    losses = curve_frame({n: e["payload"].get("losses") or [] for n, e in zip(names, entries)})
    return table, throughput, memory, losses


def parse_ids(text: str) -> list[int]:
    parts = [p for p in (text or "").replace(" ", "").replace("#", "").split(",") if p]
    if not all(p.isdigit() and len(p) < 12 for p in parts):
        raise ConfigError("ids", f"must be run ids from the History table separated by commas, like 3,5; got {text!r}")
    return [int(p) for p in parts]


def user_of(request: gr.Request | None) -> str:
    return (getattr(request, "username", None) or "") if request is not None else ""


def refuse(exc: BaseException) -> gr.Error:
    """One line for a person: what was wrong and what is allowed (never a traceback)."""
    if isinstance(exc, ConfigError):
        text = f"Invalid input — {exc}"
    elif isinstance(exc, PlanError):
        text = f"Planning failed ({exc.kind}): {first_line(exc, 400)}"
    else:
        text = first_line(exc, 400)
    return gr.Error(text, print_exception=False)


def run_headline(result: MigrationResult, budget: int | None) -> str:
    main = result.main
    if main.ok:
        headline = "Run finished"
    elif main.failure_kind == "oom":
        predicted = main.predicted_peak_bytes or result.plan.predicted_peak_bytes
        headline = (f"Run failed: **does not fit** — out of memory at {main.per_device_batch} per device "
                    f"(predicted peak {_gib(predicted)} per device, budget {_gib(budget)}). Try a smaller per-device "
                    "batch with more accumulation steps (Plan does this for you), a remat policy, or bf16")
    else:
        headline = f"Run failed ({main.failure_kind}): {main.message}"
    cpu = " — **CPU backend: these are CPU figures, not GPU ones.**" if main.backend == "cpu" else ""
    return headline + cpu


# -- the app ------------------------------------------------------------------------------------

def build_demo(settings: Settings | None = None) -> gr.Blocks:
    settings = settings or Settings()
    private_dir(os.environ["GRADIO_TEMP_DIR"])
    export_dir = private_dir(settings.export_dir or cache_dir() / "exports")
    remove_older_than(export_dir, settings.export_max_age_s, keep=(EXPORTS_MARKER,))
    checkpoint_root = private_dir(cache_dir() / "checkpoints")  # one folder per user; never cleaned up by age
    history = History(settings.history_db,
                      max_bytes=int(settings.history_max_mb * 2**20) if settings.history_max_mb else None)
    service = JobService(history, export_dir, settings.limits, executor=make_executor(settings.ray_address))
    default_target = "local" if nvidia_gpus() else "h100-sxm"
    rate = RateLimiter()  # per user and light endpoint: one user's flood is refused, never queued

    def remove_old_exports() -> None:
        """Every tenth of the age limit (a minute at most), whether or not anyone exports."""
        while True:
            time.sleep(min(60.0, settings.export_max_age_s / 10))
            remove_older_than(export_dir, settings.export_max_age_s, keep=(EXPORTS_MARKER,))

    threading.Thread(target=remove_old_exports, name="remove-old-exports", daemon=True).start()

    def export_path(name: str, user: str) -> Path:
        """A new export file in `user`'s own folder, named unguessably (`secrets`)."""
        return user_exports(export_dir, user) / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_urlsafe(12)}.csv"

    async def follow(job: Job) -> AsyncIterator[dict[str, Any]]:
        """A job's events as they come, with `waiting` events (queue position) while it is queued.
        Closing this (Stop, a closed tab, a dropped connection) stops the job."""
        cursor, last_position, last_wait = 0, None, 0.0
        try:
            while True:
                events = job.events_since(cursor)
                if events:
                    cursor = events[-1]["seq"] + 1
                for ev in events:
                    yield ev
                if job.finished and not job.events_since(cursor):
                    return
                if job.state == "queued":
                    position, now = service.position(job), time.monotonic()
                    if position != last_position or now - last_wait > WAITING_REFRESH_S:
                        last_position, last_wait = position, now
                        ahead = ", ".join(j.summary for j in service.running(job.lane)) or "nothing yet"
                        yield {"event": "waiting", "position": position, "running": ahead}
                await asyncio.sleep(POLL_S if job.state != "queued" else 2 * POLL_S)
        finally:
            if not job.finished:
                service.cancel(job.id, job.user)

    def waiting_line(ev: dict[str, Any], what: str) -> str:
        return f"⏳ {what} is queued: position {ev['position']} (running now: {ev['running']})."

    def cleared(n: int) -> list[dict[str, Any]]:
        """`n` result outputs hidden and emptied: a job's first streamed update. Its later updates send
        them `None` (still hidden and empty) rather than `gr.skip()`, for which Gradio rebuilds the
        component and its API schema on every update: 8.5 against 1.7 ms of the event loop per update
        of a run's 12 outputs, times every open page."""
        return [gr.update(value=None, visible=False)] * n

    async def do_plan(workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                      memory_fraction, granularity, remat, precision, accumulation, n_layers, d_model, n_heads,
                      n_kv_heads, d_ff, vocab_size, seq_len, embeddings, sharding, gpus_per_node, label,
                      request: gr.Request):
        form = (workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                memory_fraction, granularity, remat, precision, accumulation, n_layers, d_model, n_heads, n_kv_heads,
                d_ff, vocab_size, seq_len, embeddings, sharding, gpus_per_node)
        try:
            req = forms.plan_request(*form)
            label = forms.label_text(label)
            # Submitting writes the history: off the event loop, which serves every other page meanwhile.
            job = await asyncio.to_thread(service.submit_plan, user_of(request), req, label=label)
        except (ConfigError, LimitError, HistoryError) as exc:
            raise refuse(exc)
        rows: list[dict[str, Any]] = []
        budget = None
        drawn_at = 0.0
        plot: Any = None  # the memory plot: None until drawn, then left as drawn between redraws
        heartbeat = ""
        yield (f"Planning (job #{job.id})…", *cleared(4), gr.skip(), job.id)
        async with contextlib.aclosing(follow(job)) as events:
            async for ev in events:
                if ev["event"] == "waiting":
                    yield (waiting_line(ev, "Your plan"), None, plot, None, None, gr.skip(), gr.skip())
                elif ev["event"] == "planning":
                    wev = ev["worker_event"]
                    if wev["event"] == "plan_started":
                        budget = wev.get("budget_bytes")
                    if wev["event"] == "candidate":
                        rows.append(wev)
                        line = (f"{'Ruled out' if wev.get('lower_bound') else 'Compiled'} batch {wev['per_device_batch']}, "
                                f"remat {wev['remat']}, ×{wev['accumulation_steps']}: {candidate_text(wev)} "
                                f"({len(rows)} candidate(s) so far)")
                        now_plot = plot
                        if time.monotonic() - drawn_at >= PLOT_EVERY_S:  # the final plan draws every candidate
                            drawn_at = time.monotonic()
                            now_plot, plot = gr.update(value=memory_frame(rows, budget), visible=True), gr.skip()
                        yield (line, None, now_plot, None, None, gr.skip(), gr.skip())
                    elif wev["event"] == "heartbeat":
                        text = f"Planning… {wev['elapsed_s']:.0f} s, {len(rows)} compile(s) so far"
                        if text != heartbeat:  # heartbeats come twice a second; the line changes once
                            heartbeat = text
                            yield (text, None, plot, None, None, gr.skip(), gr.skip())
        if job.state == "cancelled":
            yield ("Planning stopped.", *[gr.skip()] * 5, None)
            return
        if job.result is None:
            raise refuse(PlanError("failed", job.error or "the planner ended without a plan"))
        p: Plan = job.result
        yield ("", gr.update(value=plan_markdown(p), visible=True),
               gr.update(value=memory_frame(p.table, p.budget_bytes), visible=True),
               gr.update(value=ranked_frame(p), visible=True), gr.update(value=decisions_frame(p), visible=True),
               p.to_dict(), None)

    async def do_run(plan_dict, code_state, plan_file, steps, learning_rate, compare_tpu, profile, fp32_reference,
                     pmap_before, scaling, workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                     memory_fraction, granularity, remat, precision, accumulation, n_layers, d_model, n_heads,
                     n_kv_heads, d_ff, vocab_size, seq_len, embeddings, sharding, gpus_per_node, label,
                     save_checkpoint, restore_checkpoint, request: gr.Request):
        form = (workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                memory_fraction, granularity, remat, precision, accumulation, n_layers, d_model, n_heads, n_kv_heads,
                d_ff, vocab_size, seq_len, embeddings, sharding, gpus_per_node)
        user = user_of(request)
        try:
            steps, learning_rate, label = forms.run_settings(steps, learning_rate, label,
                                                             max_steps=settings.limits.max_steps)
            req = forms.plan_request(*form)
            if plan_file:
                source: Plan | PlanRequest = read_plan_file(plan_file)
            elif plan_dict and same_job(plan_dict, req):
                source = checked_plan(plan_dict)
            else:
                source = req  # planned first, in the job, and recorded
            save_to, restore_from = forms.checkpoint_folders(
                save_checkpoint, restore_checkpoint, private_dir(checkpoint_root / forms.user_folder(user)))
            base = RunConfig(memory_fraction=source.memory_fraction, steps=steps, learning_rate=learning_rate,
                             warmup_steps=min(2, steps - 1), timeout_s=settings.limits.max_run_s,
                             save_checkpoint=save_to, restore_checkpoint=restore_from)
            options = RunOptions(fp32_reference=bool(fp32_reference), tpu_style=bool(compare_tpu), profile=bool(profile),
                                 pmap_before=bool(pmap_before), scaling=bool(scaling))
            code = CodeCheck.from_dict(code_state) if code_state else None
            job = await asyncio.to_thread(service.submit_run, user, source, base, options, code=code, label=label)
        except (ConfigError, PlanError, LimitError, HistoryError, ValueError) as exc:
            raise refuse(exc)
        note = f"Run job #{job.id}: {service.budget_line(user)}.\n\n"
        curves: dict[str, list[Any]] = {}  # run -> the losses this page has received
        drawn_at = sent_at = 0.0
        plot: Any = None  # the live loss plot: None until drawn, then left as drawn between redraws
        planning_said = False

        def line(text: str, loss_plot: Any = None) -> tuple[Any, ...]:
            return (text, None, plot if loss_plot is None else loss_plot, *[None] * 8, gr.skip())

        yield (f"Run job #{job.id} submitted…", *cleared(10), job.id)
        async with contextlib.aclosing(follow(job)) as events:
            async for ev in events:
                kind = ev["event"]
                if kind == "waiting":
                    yield line(waiting_line(ev, "Your run"))
                elif kind == "planning":
                    if not planning_said and ev["worker_event"]["event"] in ("candidate", "heartbeat"):
                        planning_said = True
                        yield line("Planning first (no plan was made for this form)…")
                elif kind == "status":
                    yield line(ev["message"])
                elif kind == "note":
                    note = ev["message"] + ".\n\n"
                elif kind == "progress":
                    for run in list(job.curves):  # the loss values not drawn yet: increments, never the whole curve again
                        curves.setdefault(run, []).extend(job.curve(run, len(curves.get(run, []))))
                    now = time.monotonic()
                    if now - sent_at < PROGRESS_EVERY_S:
                        continue
                    sent_at = now
                    redraw = None
                    if now - drawn_at >= PLOT_EVERY_S:
                        losses = curve_frame(curves)
                        if len(losses):  # an empty frame would fix the plot's colour scale with no series
                            drawn_at = now
                            redraw, plot = gr.update(value=losses, visible=True), gr.skip()
                    yield line(note + ev["status"], redraw)
        if job.state == "cancelled":
            yield ("Run stopped; the partial run is in the history as cancelled.", *[gr.skip()] * 10, None)
            return
        result: MigrationResult | None = job.result
        warnings = "".join(f"\n\n⚠️ {w}" for w in job.warnings)
        if result is None:
            raise gr.Error(f"The run could not start: {job.error or 'unknown reason'}{warnings}", print_exception=False)
        budget = (result.local_plan or result.plan).budget_bytes
        files = result.files
        yield (f"{note}{run_headline(result, budget)}{warnings}",
               gr.update(value=results_frame(result.main, budget), visible=True),
               gr.update(value=loss_frame(result.runs), visible=True),
               gr.update(value=files["report_csv"], visible=True),
               gr.update(value=checklist_html(result.checklist), visible=True),
               gr.update(value=files["checklist_csv"], visible=True),
               gr.update(value=files["deployment"], visible=True),
               gr.update(value=files.get("trace"), visible=bool(files.get("trace"))),
               gr.update(value=before_after_frame(result.scaling), visible=bool(result.scaling)),
               gr.update(value=scaling_frame(result.scaling), visible=len({r["devices"] for r in result.scaling}) > 1),
               gr.update(value=files.get("scaling_csv"), visible=bool(files.get("scaling_csv"))), None)

    async def do_autotune(plan_dict, plan_file, top, timed_steps, label, request: gr.Request):
        """Measure the plan's top ranked choices on this machine (the plan made in this tab, or a saved one)."""
        user = user_of(request)
        try:
            if plan_file:
                p = read_plan_file(plan_file)
            elif plan_dict:
                p = checked_plan(plan_dict)
            else:
                raise ConfigError("plan", "autotune measures a plan's ranked choices: press Plan first, or give a "
                                          "saved plan file (Advanced)")
            top_n = forms.whole(top, "autotune_top", 1, 10)
            timed = forms.whole(timed_steps, "autotune_steps", 1, max(1, settings.limits.max_steps - 2))
            label = forms.label_text(label)
            base = RunConfig(memory_fraction=p.memory_fraction, timeout_s=settings.limits.max_run_s)
            job = await asyncio.to_thread(service.submit_autotune, user, p, AutotuneSettings(top=top_n, timed_steps=timed),
                                          base, label=label)
        except (ConfigError, PlanError, LimitError, HistoryError, ValueError) as exc:
            raise refuse(exc)
        yield (f"Autotune job #{job.id} submitted…", *cleared(2), job.id)
        rows: list[dict[str, Any]] = []
        table: Any = None  # None until the first candidate is measured, then left as drawn
        async with contextlib.aclosing(follow(job)) as events:
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
        result: AutotuneResult | None = job.result
        if result is None or job.error:
            raise gr.Error(f"Autotune did not finish: {job.error or 'unknown reason'}", print_exception=False)
        path = export_path("autotune", user)
        write_csv(result.table_rows(), path=path)
        warnings = "".join(f"\n\n⚠️ {w}" for w in job.warnings)
        yield (f"**{result.measured_on}**\n\n{result.verdict}{warnings}",
               gr.update(value=autotune_frame(result.table_rows()), visible=True),
               gr.update(value=str(path), visible=True), None)

    def do_stop(job_id, request: gr.Request):
        if job_id is None:
            return "Nothing of yours is running in this tab."
        try:
            job = service.cancel(int(job_id), user_of(request))
        except (LookupError, NotYourJob) as exc:
            raise refuse(exc)
        return f"Stopping job #{job.id}…"

    def do_cancel_job(job_id: str, request: gr.Request) -> str:
        """Stop one of your jobs by its id (API: `cancel_job`)."""
        try:
            job = service.cancel(forms.whole(job_id, "job_id", 1, 2**62, note=" (one job id from the History)"),
                                 user_of(request))
        except (ConfigError, LookupError, NotYourJob) as exc:
            raise refuse(exc)
        return f"Stopping job #{job.id} ({job.summary})."

    async def finished(job: Job) -> Job:
        """`job` once it has ended; a client that goes away (Stop, a closed tab) stops it."""
        try:
            while not job.finished:
                await asyncio.sleep(POLL_S / 2)
        finally:
            if not job.finished:
                service.cancel(job.id, job.user)
        return job

    async def do_code_check(text, files, request: gr.Request):
        try:
            sources = await asyncio.to_thread(code_sources, text, files)  # reads up to 20 files
            job = await finished(service.submit_code_check(user_of(request), sources))
        except (CodeCheckError, LimitError) as exc:
            raise gr.Error(str(exc), print_exception=False)
        if job.result is None:
            raise gr.Error(job.error or "the code check stopped without a result", print_exception=False)
        result: CodeCheck = job.result
        findings = list(result.findings)
        shown = findings[:FINDINGS_SHOWN]  # the table a page can hold; the checklist reads them all
        errors = sum(f.severity == "error" for f in findings)
        summary = (f"{len(findings)} finding(s), {errors} error(s) in {len(result.files)} file(s). "
                   if findings else "No findings: nothing TPU-specific or outdated was found. ")
        if len(shown) < len(findings):
            summary += f"The table shows the first {len(shown):,} (by file and line). "
        summary += "The Migrate tab's checklist grades the items about your code from this check."
        return summary, gr.update(value=findings_frame(shown), visible=bool(findings)), result.to_dict()

    def scope_user(scope: str, request: gr.Request | None) -> str | None:
        """Whose entries a request may read: its user's; everyone's (None) on a single-user box, for
        an admin, or on a team-visible history; anyone else asking for everyone's is refused."""
        forms.choice(scope, "scope", ("mine", "everyone"))
        user = user_of(request)
        if not settings.multi_user:
            return None
        if scope == "mine":
            return user
        if settings.team_history or user in settings.admins:
            return None
        raise ConfigError("scope", "everyone's history is open only to the admins this server names (--admins) or "
                                   "on a team-visible history (--team-history); use mine")

    def do_history(scope, kind, workload, status, request: gr.Request):
        try:
            rate.take(user_of(request), "history")
            user = scope_user(scope, request)
            for field, value, allowed in (("kind", kind, ("all", "run", "plan")),
                                          ("workload", workload, ("all", *WORKLOADS)),
                                          ("status", status, ("all", *HISTORY_STATUSES))):
                forms.choice(value, field, allowed)
            entries = history.entries(kind=None if kind == "all" else kind,
                                      workload=None if workload == "all" else workload,
                                      status=None if status == "all" else status, user=user, payload=False)
        except (ConfigError, HistoryError, LimitError) as exc:
            raise refuse(exc)
        return history_frame(entries)

    def do_select(ids_text, evt: gr.SelectData):
        """Clicking a row of the History table adds its id to the selection (again: removes it)."""
        row = evt.row_value if evt.row_value is not None else []
        if not row:
            return gr.skip()
        try:
            chosen = parse_ids(ids_text)
        except ConfigError:
            chosen = []
        entry_id = int(row[0])
        chosen = [i for i in chosen if i != entry_id] if entry_id in chosen else [*chosen, entry_id]
        return ",".join(map(str, chosen))

    def do_compare(ids_text, scope, request: gr.Request):
        try:
            rate.take(user_of(request), "compare")
            ids = parse_ids(ids_text)
            if len(ids) > COMPARE_MAX:
                raise ConfigError("ids", f"compare at most {COMPARE_MAX} runs at once; got {len(ids)}")
            entries = history.entries(kind="run", ids=ids, user=scope_user(scope, request)) if ids else []
        except (ConfigError, HistoryError, LimitError) as exc:
            raise refuse(exc)
        if len(entries) < 2:
            raise gr.Error(f"Select two or more runs to compare (click their rows in the table); "
                           f"found {len(entries)} run(s) among {ids or 'the selection'}", print_exception=False)
        table, throughput, memory, losses = compare_frames(list(reversed(entries)))
        return tuple(gr.update(value=v, visible=True) for v in (table, throughput, memory, losses))

    def do_export(ids_text, scope, request: gr.Request):
        try:
            rate.take(user_of(request), "export")
            ids = parse_ids(ids_text) or None
            if ids is not None and len(ids) > EXPORT_MAX_ROWS:
                raise ConfigError("ids", f"export at most {EXPORT_MAX_ROWS} entries at once; got {len(ids)}")
            path = export_path("history" if ids is None else "selection", user_of(request))
            history.to_csv(ids=ids, path=path, user=scope_user(scope, request), viewer=user_of(request))
        except (ConfigError, HistoryError, OSError, LimitError) as exc:
            raise refuse(exc)
        return gr.update(value=str(path), visible=True)

    def do_export_all(scope, request: gr.Request):
        return do_export("", scope, request)

    async def do_environment(request: gr.Request):
        try:
            job = await finished(service.submit_probe(user_of(request)))
        except LimitError as exc:
            raise refuse(exc)
        if job.result is None:
            raise gr.Error(f"The environment probe failed: {first_line(job.error or 'no result', 300)}",
                           print_exception=False)
        info = job.result
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

    with gr.Blocks(title="TPU → GPU migration explorer", delete_cache=(3600, int(settings.export_max_age_s))) as demo:
        gr.Markdown("# TPU → GPU migration explorer")
        gr.Markdown(host_banner(settings) + (f"\n\n**Ray cluster:** {service.executor.describe()}; the others wait in the "
                                             "queue and see their position." if service.executor.remote else "")
                    + (f"\n\n{len(service.recovered)} job(s) that a previous server left "
                                             "unfinished are marked interrupted in the History."
                                             if service.recovered else ""))
        with gr.Tab("Migrate"):
            with gr.Row():
                workload = gr.Dropdown(list(WORKLOADS), value="transformer", label="Workload", allow_custom_value=True)
                preset = gr.Dropdown(list(WORKLOADS["transformer"].presets), value="tiny", label="Preset",
                                     allow_custom_value=True)
                source = gr.Dropdown(list(TPU_SPECS), value="tpu-v5e-8", label="TPU source", allow_custom_value=True)
                source_precision = gr.Dropdown(["bf16", "fp32"], value="bf16", label="TPU precision",
                                               allow_custom_value=True)
            with gr.Row():
                global_batch = gr.Number(256, label="Global batch")
                per_core_batch = gr.Number(0, label="Per-core batch (0: global / cores)")
                target = gr.Dropdown(["local", *GPU_SPECS], value=default_target, label="Target GPU",
                                     allow_custom_value=True)
                gpus = gr.Number(1, label="GPUs")
                memory_fraction = gr.Number(0.8, label="GPU memory share (0.05 to 1)", step=0.05)
                steps = gr.Number(20, label="Steps")
            with gr.Accordion("Your model's dimensions, sharding and nodes (0: the preset's)", open=False):
                with gr.Row():
                    n_layers = gr.Number(0, label="Layers")
                    d_model = gr.Number(0, label="d_model")
                    n_heads = gr.Number(0, label="Heads")
                    n_kv_heads = gr.Number(0, label="KV heads (grouped-query when fewer)")
                    d_ff = gr.Number(0, label="d_ff (MLP hidden)")
                with gr.Row():
                    vocab_size = gr.Number(0, label="Vocabulary")
                    seq_len = gr.Number(0, label="Sequence length")
                    embeddings = gr.Dropdown(list(forms.EMBEDDINGS), value="preset", label="Embeddings",
                                             allow_custom_value=True)
                    sharding = gr.Dropdown(["auto", *SHARDINGS], value="auto",
                                           label="State (auto: replicated while it fits, else FSDP)",
                                           allow_custom_value=True)
                    gpus_per_node = gr.Number(8, label="GPUs per node (GPUs above it: several nodes)")
            with gr.Accordion("Advanced", open=False):
                with gr.Row():
                    remat = gr.Dropdown(["auto", *REMAT_NAMES], value="auto", label="Remat policy",
                                        allow_custom_value=True)
                    precision = gr.Dropdown(["auto", *PRECISIONS], value="auto", label="Precision",
                                            allow_custom_value=True)
                    accumulation = gr.Number(0, label="Accumulation steps (0: auto)")
                    granularity = gr.Dropdown(["multiple8", "pow2"], value="multiple8", label="Batch sizes",
                                              allow_custom_value=True)
                    learning_rate = gr.Number(3e-3, label="Learning rate")
                with gr.Row():
                    compare_tpu = gr.Checkbox(False, label="Also run the TPU-style setup here (loss comparison)")
                    profile = gr.Checkbox(False, label="Capture a profile (3 extra steps under jax.profiler.trace)")
                    fp32_reference = gr.Checkbox(False, label="Also run an fp32 reference (numerics check)")
                    pmap_before = gr.Checkbox(False, label="Also run the TPU-era pmap step (before vs after: same loss, "
                                                           "throughput of each)")
                    scaling = gr.Checkbox(False, label="Also measure scaling: both steps at 1, 2, 4, 8 devices")
                    plan_file = gr.File(label="…or run a saved plan (JSON from `python -m migration plan --json`)",
                                        file_types=[".json"], type="filepath")
                with gr.Row():
                    save_checkpoint = gr.Textbox("", label="Save a checkpoint after the run (folder)", max_lines=1,
                                                 placeholder="a name, like run-1")
                    restore_checkpoint = gr.Textbox("", label="Start from a checkpoint (folder)", max_lines=1,
                                                    placeholder="the name it was saved under")
                with gr.Row():
                    autotune_top = gr.Number(3, label="Autotune: ranked choices to measure (1 to 10)")
                    autotune_steps = gr.Number(5, label="Autotune: timed steps each (after 2 warm-up steps)")
            with gr.Row():
                label = gr.Textbox(label="Label (shown in the History)", max_lines=1, scale=2)
                plan_btn = gr.Button("Plan", variant="primary")
                run_btn = gr.Button("Run on this machine", variant="secondary")
                autotune_btn = gr.Button("Autotune on this machine", variant="secondary")
                stop_btn = gr.Button("Stop", variant="stop")
            progress_md = gr.Markdown()
            plan_md = gr.Markdown(visible=False)
            memory_plot = gr.ScatterPlot(x="per_device_batch", y="predicted_GiB", color="series", visible=False,
                                         title="Predicted peak memory per GPU for each batch compiled, and the budget",
                                         height=300)
            ranked_table = gr.Dataframe(label="Choices that fit, fastest predicted step first", wrap=True,
                                        visible=False)
            autotune_table = gr.Dataframe(label="Autotune: the top choices measured here", wrap=True, visible=False,
                                          elem_id="autotune-table")
            autotune_file = gr.File(label="Autotune CSV", visible=False)
            decisions = gr.Dataframe(label="Decisions with their reasons", wrap=True, visible=False)
            results = gr.Dataframe(label="Results", wrap=True, visible=False)
            loss_plot = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=300, visible=False)
            before_after = gr.Dataframe(label="Before (pmap) and after (jit with shardings), side by side", wrap=True,
                                        visible=False, elem_id="before-after")
            scaling_plot = gr.LinePlot(x="devices", y="samples_per_s", color="style", height=300, visible=False,
                                       title="Throughput by device count (weak scaling: per-device batch kept)",
                                       elem_id="scaling-plot")
            scaling_file = gr.File(label="Scaling CSV", visible=False)
            checklist_view = gr.HTML(visible=False)
            with gr.Row():
                report_file = gr.File(label="CSV of this report", visible=False)
                checklist_file = gr.File(label="Checklist CSV (one row per item)", visible=False)
                deploy_file = gr.File(label="Deployment snippet (environment + start command)", visible=False)
                trace_file = gr.File(label="Profile trace (Perfetto / TensorBoard)", visible=False)
            plan_state = gr.State(None)
            code_state = gr.State(None)
            job_state = gr.State(None)
        with gr.Tab("History"):
            with gr.Row():
                scope = gr.Dropdown(["mine", "everyone"], value="mine", label="Whose", allow_custom_value=True,
                                    info=None if settings.multi_user else "single-user box: one shared history")
                f_kind = gr.Dropdown(["all", "run", "plan"], value="all", label="Kind", allow_custom_value=True)
                f_workload = gr.Dropdown(["all", *WORKLOADS], value="all", label="Workload", allow_custom_value=True)
                f_status = gr.Dropdown(["all", *HISTORY_STATUSES], value="all", label="Status", allow_custom_value=True)
                refresh_btn = gr.Button("Refresh")
            history_table = gr.Dataframe(headers=HISTORY_COLUMNS, label="Runs and plans: click rows to select them",
                                         wrap=True, interactive=False, elem_id="history-table")
            with gr.Row():
                ids = gr.Textbox(label="Selected ids (click rows above, or type: 3,5)", scale=2)
                compare_btn = gr.Button("Compare selected")
                export_sel_btn = gr.Button("Export selected (CSV)")
                export_all_btn = gr.Button("Export all shown (CSV)")
            export_file = gr.File(label="CSV export", visible=False)
            compare_table = gr.Dataframe(label="Side by side", wrap=True, visible=False, elem_id="compare-table")
            with gr.Row():
                throughput_plot = gr.BarPlot(x="run", y="samples_per_s", title="Throughput (samples/s)", height=280,
                                             visible=False, elem_id="compare-throughput")
                memory_bar = gr.BarPlot(x="bar", y="GiB", color="series", title="Peak memory: predicted and measured",
                                        height=280, visible=False, elem_id="compare-memory")
            compare_loss = gr.LinePlot(x="step", y="loss", color="run", title="Loss", height=280, visible=False,
                                       elem_id="compare-loss")
        with gr.Tab("Code check"):
            gr.Markdown("Reads Python source with `ast`; nothing is ever run. Up to 1 MB per file, UTF-8.")
            code_text = gr.Code(language="python", label="Paste a training script")
            code_files = gr.File(label="…or upload .py files", file_count="multiple", file_types=[".py"])
            code_btn = gr.Button("Check", variant="primary")
            code_summary = gr.Markdown()
            code_table = gr.Dataframe(label="Findings", wrap=True, visible=False)
        with gr.Tab("Environment"):
            env_btn = gr.Button("Probe the environment (in a worker)")
            env_md = gr.Markdown()
            env_json = gr.JSON(label="Details")

        form = [workload, preset, source, global_batch, per_core_batch, source_precision, target, gpus,
                memory_fraction, granularity, remat, precision, accumulation, n_layers, d_model, n_heads, n_kv_heads,
                d_ff, vocab_size, seq_len, embeddings, sharding, gpus_per_node]

        def presets_of(w):
            presets = list(WORKLOADS[w].presets) if w in WORKLOADS else []
            return gr.Dropdown(choices=presets, value="tiny" if "tiny" in presets else (presets or [None])[0])

        workload.change(presets_of, workload, preset, api_visibility="private")
        plan_event = plan_btn.click(do_plan, [*form, label],
                                    [progress_md, plan_md, memory_plot, ranked_table, decisions, plan_state, job_state],
                                    api_name="plan", concurrency_limit=None)
        run_event = run_btn.click(do_run, [plan_state, code_state, plan_file, steps, learning_rate, compare_tpu,
                                           profile, fp32_reference, pmap_before, scaling, *form, label,
                                           save_checkpoint, restore_checkpoint],
                                  [progress_md, results, loss_plot, report_file, checklist_view, checklist_file,
                                   deploy_file, trace_file, before_after, scaling_plot, scaling_file, job_state],
                                  api_name="run", concurrency_limit=None)
        autotune_event = autotune_btn.click(do_autotune, [plan_state, plan_file, autotune_top, autotune_steps, label],
                                            [progress_md, autotune_table, autotune_file, job_state],
                                            api_name="autotune", concurrency_limit=None)
        stop_btn.click(do_stop, job_state, progress_md, cancels=[run_event, plan_event, autotune_event], api_name="stop")
        gr.api(do_cancel_job, api_name="cancel_job")
        code_btn.click(do_code_check, [code_text, code_files], [code_summary, code_table, code_state],
                       api_name="code_check", concurrency_limit=None)
        filters = [scope, f_kind, f_workload, f_status]
        refresh_btn.click(do_history, filters, history_table, api_name="history", queue=False)
        history_table.select(do_select, ids, ids, api_visibility="private")
        compare_btn.click(do_compare, [ids, scope], [compare_table, throughput_plot, memory_bar, compare_loss],
                          api_name="compare", queue=False)
        export_sel_btn.click(do_export, [ids, scope], export_file, api_name="export_csv", queue=False)
        export_all_btn.click(do_export_all, scope, export_file, api_name="export_history_csv", queue=False)
        env_btn.click(do_environment, None, [env_md, env_json], api_name="environment", concurrency_limit=None)
        demo.load(do_history, filters, history_table, api_visibility="private")
    demo.service = service  # type: ignore[attr-defined]  # for start-up and shutdown
    return demo


def code_sources(text: Any, files: Any) -> list[tuple[str, str]]:
    """(name, text) of the pasted source and the uploaded files, each within the per-file limit and
    at most `MAX_FILES` of them; CodeCheckError otherwise (reading a file costs I/O, never a parse)."""
    sources: list[tuple[str, str]] = []
    if isinstance(text, str) and text.strip():
        sources.append(("<pasted>", check_pasted(text)))
    elif text is not None and not isinstance(text, str):
        raise CodeCheckError(f"the pasted code must be text; got {type(text).__name__}")
    files = files or []
    if not isinstance(files, list) or len(files) > MAX_FILES:
        raise CodeCheckError(f"upload at most {MAX_FILES} .py files at once; got "
                             f"{len(files) if isinstance(files, list) else type(files).__name__}")
    for f in files:
        path = f if isinstance(f, str) else getattr(f, "name", None)
        if not isinstance(path, str):
            raise CodeCheckError("each upload must be a .py file")
        sources.append(read_upload(path))
    if not sources:
        raise CodeCheckError("Paste Python source or upload .py files to check")
    return sources


def same_job(plan_dict: dict[str, Any], req: PlanRequest) -> bool:
    """Whether the plan in this tab was made for the form as it is now."""
    keys = ("workload", "preset", "source", "global_batch", "target", "gpus")
    planned_model = {k: v for k, v in plan_dict.get("model", {}).items() if k != "attention" or k in req.model}
    return (all(plan_dict.get(k if k != "global_batch" else "requested_global_batch", plan_dict.get(k)) == getattr(req, k)
                for k in keys)
            and planned_model == req.model and req.sharding in (None, plan_dict.get("sharding")))


def read_plan_file(path: Any) -> Plan:
    """An uploaded plan, checked field by field with its environment rebuilt (`migration.planfile`)."""
    if not isinstance(path, str):
        raise ConfigError("plan_file", "must be a plan file (JSON from `python -m migration plan --json`)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except OSError as exc:
        raise ConfigError("plan_file", f"could not be read ({exc.strerror or type(exc).__name__}); upload it again")
    return read_plan(data)


class LoginPageWithoutApi:
    """ASGI middleware for servers with auth: Gradio's login page embeds the description of every
    endpoint (names, parameters, choices) for anyone; this serves it without that description."""

    CONFIG = re.compile(rb"window\.gradio_config = (.*?);</script>", re.S)
    API_INFO = re.compile(rb"window\.gradio_api_info = .*?;</script>", re.S)

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "GET" or not scope["path"].endswith("/"):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def capture(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = self.strip(b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, capture)

    def strip(self, body: bytes) -> bytes:
        found = self.CONFIG.search(body)
        if not found:
            return body
        try:
            config = json.loads(found.group(1))
        except ValueError:
            return body
        if config.get("auth_required") and not config.get("components"):  # the login page
            return self.API_INFO.sub(b"window.gradio_api_info = null;</script>", body)
        return body


TOKEN_COOKIE = "migration-token"
TOKEN_HEADER = b"x-migration-token"
TOKEN_FREE_PATHS = ("/gradio_api/startup-events",)  # Gradio calls it on itself while it launches
GUARDED_WITHOUT_LOGIN = ("cancel", "heartbeat", "stream", "reset")  # Gradio routes that check no login
# Gradio routes that name a session (in the path, the query or a JSON body): its user's alone.
SESSION_ROUTES = (*GUARDED_WITHOUT_LOGIN, "queue", "run", "api", "deep_link", "component_server")


@dataclasses.dataclass
class WebPolicy:
    """What the web layer lets in: the hosts this server answers as (a DNS-rebinding page names
    another), the origins allowed to call it (same origin, or the public URL behind a proxy), the
    access token of a server without auth, and where exports live (served to their owner only)."""

    hosts: frozenset[str]
    public_origins: frozenset[str] = frozenset()
    token: str = ""  # without auth: the secret in the printed URL
    export_dir: Path | None = None
    auth: bool = False


class WebGuard:
    """ASGI middleware in front of Gradio: refuses requests for another Host (DNS rebinding) and
    cross-origin requests (a page elsewhere calling the API with the user's cookies), makes the session
    cookies SameSite=Lax, asks for the server's token when there is no auth, ties Gradio's cancel,
    heartbeat and stream routes to the signed-in user who opened the session, and serves a file of the
    exports folder only to the user whose folder holds it."""

    def __init__(self, app: Any, policy: WebPolicy):
        self.app = app
        self.policy = policy
        self.session_owner: dict[str, str] = {}  # Gradio session hash -> the user who joined with it

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        refusal = self._refusal(scope, headers)
        if refusal is None and self.policy.token and not scope.get("path", "").endswith(TOKEN_FREE_PATHS):
            refusal, send = self._token_check(scope, headers, send)
        if refusal is None:
            refusal, receive = await self._session_check(scope, headers, receive)
        if refusal is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
                return
            status, text = refusal
            body = text.encode()
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, self._lax_cookies(send))

    def _refusal(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> tuple[int, str] | None:
        host = headers.get(b"host", b"").decode("latin-1")
        name = urllib.parse.urlsplit(f"//{host}").hostname or ""
        if name.lower() not in self.policy.hosts:
            return 403, (f"this server does not answer as {name or 'an empty host'!r}; open it by the address it "
                         "printed (or add the name with --allowed-hosts)")
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if urllib.parse.urlsplit(text).netloc.lower() != host.lower() and text not in self.policy.public_origins:
                return 403, "cross-origin request refused: only this server's own pages (or --public-url) may call it"
        return None

    def _user(self, scope: dict[str, Any], headers: dict[bytes, bytes]) -> str | None:
        """The signed-in user of a request (Gradio's session cookie); "" without auth; None: nobody."""
        if not self.policy.auth:
            return ""
        app = scope.get("app")
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except http.cookies.CookieError:
            return None
        tokens = getattr(app, "tokens", {})
        for key in (f"access-token-{getattr(app, 'cookie_id', '')}", f"access-token-unsecure-{getattr(app, 'cookie_id', '')}"):
            if key in cookies and cookies[key].value in tokens:
                return tokens[cookies[key].value]
        return None

    def _token_check(self, scope: dict[str, Any], headers: dict[bytes, bytes], send: Any) -> tuple[Any, Any]:
        """Without auth: the request must carry the server's token (in the URL once, then a cookie; or a
        header for API clients). A URL with the right token sets the cookie."""
        token = self.policy.token
        cookies = http.cookies.SimpleCookie()
        try:
            cookies.load(headers.get(b"cookie", b"").decode("latin-1"))
        except http.cookies.CookieError:
            pass
        given = [headers.get(TOKEN_HEADER, b"").decode("latin-1"),
                 cookies[TOKEN_COOKIE].value if TOKEN_COOKIE in cookies else ""]
        query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("token", [])
        if any(secrets.compare_digest(g, token) for g in given if g):
            return None, send
        if any(secrets.compare_digest(q, token) for q in query if q):
            async def with_cookie(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    cookie = f"{TOKEN_COOKIE}={token}; Path=/; HttpOnly; SameSite=Strict".encode()
                    message = {**message, "headers": [*message.get("headers", []), (b"set-cookie", cookie)]}
                await send(message)
            return None, with_cookie
        return (401, "this server needs its access token: open the URL it printed at start-up "
                     "(http://HOST:PORT/?token=...), or send the token in the X-Migration-Token header"), send

    async def _session_check(self, scope: dict[str, Any], headers: dict[bytes, bytes],
                             receive: Any) -> tuple[tuple[int, str] | None, Any]:
        path = scope.get("path", "")
        route = path.split("/gradio_api/", 1)[1] if "/gradio_api/" in path else ""
        head = route.split("/", 1)[0]
        if route.startswith("file=") and self.policy.export_dir is not None:
            return self._file_check(scope, headers, urllib.parse.unquote(route[len("file="):])), receive
        if head not in SESSION_ROUTES:
            return None, receive
        user = self._user(scope, headers)
        if user is None:
            return (401, "sign in first"), receive
        session = route.split("/")[1] if head in ("heartbeat", "stream") and "/" in route else None
        session = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1")).get("session_hash", [session])[0]
        if scope.get("method") == "POST" and b"json" in headers.get(b"content-type", b"json"):
            body, receive = await _read_body(receive)
            try:
                session = json.loads(body or b"{}").get("session_hash", session)
            except (ValueError, AttributeError):
                pass
        if isinstance(session, str) and session:
            owner = self.session_owner.setdefault(session, user)
            if len(self.session_owner) > 100_000:  # bounded: the oldest sessions are forgotten first
                for key in list(self.session_owner)[:50_000]:
                    del self.session_owner[key]
            if owner != user:
                return (403, "that session belongs to another user"), receive
        return None, receive

    def _file_check(self, scope: dict[str, Any], headers: dict[bytes, bytes], wanted: str) -> tuple[int, str] | None:
        try:
            relative = Path(os.path.realpath(wanted)).relative_to(os.path.realpath(self.policy.export_dir))
        except ValueError:
            return None  # not an export (Gradio's own cache of served files checks itself)
        user = self._user(scope, headers)
        if user is None:
            return 401, "sign in first"
        if not relative.parts or relative.parts[0] != forms.user_folder(user):
            return 404, "no such file of yours"
        return None

    @staticmethod
    def _lax_cookies(send: Any) -> Any:
        async def rewrite(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    (k, re.sub(rb"(?i)samesite=none", b"SameSite=Lax", v) if k.lower() == b"set-cookie" else v)
                    for k, v in message.get("headers", [])]}
            await send(message)
        return rewrite


async def _read_body(receive: Any) -> tuple[bytes, Any]:
    """The whole request body, and a `receive` that replays it to the app."""
    chunks, more = [], True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
        if sum(map(len, chunks)) > 16 << 20:  # past any legitimate call: the app then refuses the body
            break
    body = b"".join(chunks)
    sent = [False]

    async def replay() -> dict[str, Any]:
        if not sent[0]:
            sent[0] = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return body, replay


def read_auth(path: str | None, env_value: str | None) -> Authenticator | None:
    """The users: a private file of hashed passwords (`python -m migration add-user FILE NAME`), and/or
    `user:password` pairs in MIGRATION_AUTH (hashed here, in memory). None: no auth."""
    users: dict[str, str] = {}
    try:
        if path:
            users.update(read_users(path))
        for pair in (p.strip() for p in (env_value or "").split(",") if p.strip()):
            user, sep, password = pair.partition(":")
            if not sep or not USER_NAME.fullmatch(user) or not password:
                raise AccountsError(f"MIGRATION_AUTH: expected user:password pairs, got an entry for "
                                    f"{user[:64] or '(empty user)'!r}")
            users[user] = hash_password(password)
    except AccountsError as exc:
        raise SystemExit(f"auth: {exc}")
    return Authenticator(users) if users else None


def existing_export_dir(path: str) -> str:
    """An --export-dir the app may own: new, empty, or already marked as this app's (the folder's old
    files are deleted by age, so a folder of someone's own files is refused)."""
    if not path:
        return path
    folder = Path(path)
    if folder.is_dir() and any(folder.iterdir()) and not (folder / EXPORTS_MARKER).is_file():
        raise SystemExit(f"error: --export-dir {path}: the folder holds files and is not this app's exports folder "
                         f"(no {EXPORTS_MARKER}); its old files would be deleted, so name an empty or new folder")
    return path


def bounded(kind: type, lo: float, hi: float) -> Any:
    """An argparse type: a `kind` number from lo to hi (flags and their MIGRATION_* variables alike)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'a whole number' if kind is int else 'a number'} "
                                             f"from {lo:g} to {hi:g}; got {text!r}")
        if not lo <= value <= hi:  # NaN fails this too
            raise argparse.ArgumentTypeError(f"must be from {lo:g} to {hi:g}; got {text!r}")
        return value
    return parse


def main() -> None:
    env = os.environ.get
    d = Limits()
    parser = argparse.ArgumentParser(description="TPU -> GPU migration explorer (Gradio app)")
    parser.add_argument("--host", default=env("MIGRATION_HOST", "127.0.0.1"),
                        help="address to listen on (default loopback); 0.0.0.0 serves every interface: use with auth")
    parser.add_argument("--port", type=bounded(int, 1, 65535), default=env("MIGRATION_PORT", "7860"))
    parser.add_argument("--root-path", default=env("MIGRATION_ROOT_PATH", ""), help="path prefix behind a reverse proxy")
    parser.add_argument("--auth-file", default=env("MIGRATION_AUTH_FILE"), help="file of user:password lines")
    parser.add_argument("--history-db", default=env("MIGRATION_HISTORY_DB", "runs/history.sqlite"))
    parser.add_argument("--history-max-mb", type=bounded(float, 0, 10**7), default=env("MIGRATION_HISTORY_MAX_MB", "0"),
                        help="cap on the history's size (0: none); past it new records are refused, old ones kept")
    parser.add_argument("--export-dir", default=env("MIGRATION_EXPORT_DIR", ""),
                        help="where CSV exports and traces are written (default: private folder in the cache)")
    parser.add_argument("--export-max-age-hours", type=bounded(float, 1e-4, 10**6),
                        default=env("MIGRATION_EXPORT_MAX_AGE_HOURS", "168"))
    parser.add_argument("--jobs-per-user", type=bounded(int, 1, 10_000),
                        default=env("MIGRATION_JOBS_PER_USER", str(d.jobs_per_user)))
    parser.add_argument("--max-steps", type=bounded(int, 1, int(LIMITS["steps"][1])),
                        default=env("MIGRATION_MAX_STEPS", str(d.max_steps)))
    parser.add_argument("--max-run-seconds", type=bounded(float, 10, LIMITS["timeout_s"][1]),
                        default=env("MIGRATION_MAX_RUN_SECONDS", str(d.max_run_s)))
    parser.add_argument("--silence-seconds", type=bounded(float, *LIMITS["silence_timeout_s"]),
                        default=env("MIGRATION_SILENCE_SECONDS", str(d.silence_s)),
                        help="a worker silent this long (no heartbeat) is killed and reported as timeout")
    parser.add_argument("--queue-size", type=bounded(int, 1, 100_000), default=env("MIGRATION_QUEUE_SIZE", str(d.queue_size)),
                        help="jobs waiting or running, all users together")
    parser.add_argument("--job-budget-seconds", type=bounded(float, 60, 7 * 24 * 3600),
                        default=env("MIGRATION_JOB_BUDGET_SECONDS", str(d.job_budget_s)),
                        help="wall-clock of one job's workers together (a run job may start several)")
    parser.add_argument("--user-day-seconds", type=bounded(float, 60, 10**7),
                        default=env("MIGRATION_USER_DAY_SECONDS", str(d.user_day_s)),
                        help="worker time of one user's jobs in any 24 hours")
    parser.add_argument("--history-rows-per-user", type=bounded(int, 10, 10**8),
                        default=env("MIGRATION_HISTORY_ROWS_PER_USER", str(d.history_rows_per_user)))
    parser.add_argument("--history-mb-per-user", type=bounded(float, 1, 10**7),
                        default=env("MIGRATION_HISTORY_MB_PER_USER", str(d.history_mb_per_user)))
    parser.add_argument("--worker-cpus", default=env(WORKER_CPUS_VARIABLE, ""),
                        help="CPUs the workers run on (e.g. 2-15), keeping the others for the server; default: all")
    parser.add_argument("--admins", default=env("MIGRATION_ADMINS", ""),
                        help="comma-separated users who may see, compare and export everyone's history")
    parser.add_argument("--team-history", action="store_true", default=env("MIGRATION_TEAM_HISTORY", "") == "1",
                        help="declare the history visible to every signed-in user (default: each sees their own)")
    parser.add_argument("--public-url", default=env("MIGRATION_PUBLIC_URL", ""),
                        help="the URL users open behind a reverse proxy (https://host/path): its origin may call the "
                             "API and its host is answered")
    parser.add_argument("--allowed-hosts", default=env("MIGRATION_ALLOWED_HOSTS", ""),
                        help="comma-separated extra host names this server answers as (default: the address it "
                             "listens on, this machine's names, and --public-url's host)")
    parser.add_argument("--ray-address", default=env("MIGRATION_RAY_ADDRESS", ""),
                        help="run the runs, and plans for catalog GPUs, on this Ray cluster (host:port, "
                             "ray://host:port or auto); default: here")
    args = parser.parse_args()
    os.umask(0o077)  # every file the server and its workers create (history, runs, exports, checkpoints) is private
    for existing in Path(args.history_db).parent.glob(Path(args.history_db).name + "*"):  # a history an earlier
        os.chmod(existing, 0o600)  # version left readable (with its -wal and -shm) is tightened too
    users = read_auth(args.auth_file, env("MIGRATION_AUTH"))
    admins = tuple(sorted({a.strip() for a in args.admins.split(",") if a.strip()}))
    if (admins or args.team_history) and users is None:
        raise SystemExit("error: --admins and --team-history need users (--auth-file or MIGRATION_AUTH)")
    unknown = [a for a in admins if users is not None and a not in users.users]
    if unknown:
        raise SystemExit(f"error: --admins names {', '.join(unknown)}, who are not users of this server")
    public = urllib.parse.urlsplit(args.public_url) if args.public_url else None
    if public is not None and (public.scheme not in ("http", "https") or not public.hostname):
        raise SystemExit(f"error: --public-url must be http(s)://host[:port][/path]; got {args.public_url!r}")
    existing_export_dir(args.export_dir)
    limits = Limits(jobs_per_user=args.jobs_per_user, max_steps=args.max_steps, max_run_s=args.max_run_seconds,
                    silence_s=args.silence_seconds, queue_size=args.queue_size, job_budget_s=args.job_budget_seconds,
                    user_day_s=args.user_day_seconds, history_rows_per_user=args.history_rows_per_user,
                    history_mb_per_user=args.history_mb_per_user)
    if args.worker_cpus:
        if not re.fullmatch(r"[0-9]{1,4}(-[0-9]{1,4})?(,[0-9]{1,4}(-[0-9]{1,4})?){0,63}", args.worker_cpus):
            raise SystemExit(f"error: --worker-cpus must be CPU numbers and ranges like 2-15 or 1,3; got {args.worker_cpus!r}")
        os.environ[WORKER_CPUS_VARIABLE] = args.worker_cpus  # read by each worker at its start
    settings = Settings(history_db=args.history_db, export_dir=args.export_dir, limits=limits,
                        multi_user=users is not None, export_max_age_s=args.export_max_age_hours * 3600,
                        history_max_mb=args.history_max_mb or None, ray_address=args.ray_address, admins=admins,
                        team_history=bool(args.team_history))
    try:
        demo = build_demo(settings)
    except ExecutorError as exc:
        raise SystemExit(f"error: {exc}")
    service: JobService = demo.service  # type: ignore[attr-defined]

    def stop(signum: int, _frame: Any) -> None:
        interrupted = service.shutdown()
        print(f"stopped by {signal.Signals(signum).name}: {len(interrupted)} job(s) marked interrupted", flush=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    where = ("loopback only" if args.host in ("127.0.0.1", "localhost", "::1") else
             "ALL interfaces" if args.host in ("0.0.0.0", "::") else f"interface {args.host}")
    token = "" if users is not None else (env("MIGRATION_TOKEN") or secrets.token_urlsafe(24))
    export_dir = private_dir(settings.export_dir or cache_dir() / "exports")
    (export_dir / EXPORTS_MARKER).write_text("exports of the TPU -> GPU migration explorer; old files are deleted\n")
    policy = WebPolicy(hosts=allowed_hosts(args.host, public, args.allowed_hosts),
                       public_origins=frozenset({f"{public.scheme}://{public.netloc}"} if public else ()),
                       token=token, export_dir=export_dir, auth=users is not None)
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
    url = f"http://{shown_host}:{args.port}{args.root_path or '/'}" + (f"?token={token}" if token else "")
    print(f"serving on {where}{f' ({args.host})' if shown_host != args.host else ''}: {url} — "
          + (f"auth on ({len(users)} user(s)); history: {history_visibility(settings)}" if users else
             "no auth: single-user mode, open the URL with its token")
          + f"; history {args.history_db}; exports {export_dir}"
          + (f"; {service.executor.describe()}" if service.executor.remote else ""), flush=True)
    if users is None and where != "loopback only":
        print("warning: serving beyond loopback without auth: anyone with the URL's token can run jobs",
              file=sys.stderr, flush=True)
    demo.queue(max_size=max(64, 4 * limits.queue_size), default_concurrency_limit=4)
    middleware = [Middleware(WebGuard, policy=policy)] + ([Middleware(LoginPageWithoutApi)] if users else [])
    demo.launch(server_name=args.host, server_port=args.port, root_path=args.root_path or None,
                auth=users.check if users else None,
                enable_monitoring=False, ssr_mode=False, show_error=True, share=False, run_history=False,
                max_threads=64, allowed_paths=[str(export_dir)], max_file_size="5mb", quiet=True,
                app_kwargs={"middleware": middleware}, prevent_thread_lock=True)
    # Everything built so far (Gradio, pandas, the page's components) lives as long as the server:
    # out of the collector's sight, so that a full collection under load walks only what came after
    # (it walked all of it in 0.7 s, every page and call waiting, in the load benchmark).
    gc.freeze()
    demo.block_thread()


def allowed_hosts(host: str, public: urllib.parse.SplitResult | None, extra: str) -> frozenset[str]:
    """The host names this server answers as: loopback names, the listening address, this machine's
    names (when it listens beyond loopback), --public-url's host and --allowed-hosts."""
    names = {"127.0.0.1", "localhost", "::1", "[::1]", host.lower()}
    if host not in ("127.0.0.1", "localhost", "::1"):
        names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        with contextlib.suppress(OSError):
            names |= {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    if public is not None and public.hostname:
        names.add(public.hostname.lower())
    names |= {h.strip().lower() for h in extra.split(",") if h.strip()}
    return frozenset(names)


if __name__ == "__main__":
    main()
