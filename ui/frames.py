"""Typed results formatted for people: the plan as markdown, pandas frames for the page's tables and plots,
the checklist as HTML, and a run's headline. Pure functions of the backend's results; nothing here touches
a job, the history or the page."""

from __future__ import annotations

import html
import math
from typing import Any

import pandas as pd

from migration.codecheck import Finding
from migration.common import GiB, byte_unit, duration_unit, fmt_bytes, fmt_count, fmt_number, fmt_percent, fmt_seconds, model_name
from migration.figures import MEASURED, plan_figures, run_figures
from migration.grading import checklist
from migration.planning.compare import headline, price_sources, shown_rows
from migration.results import Plan, RunReport, memory_provenance
from migration.service.history import SERVING_KINDS
from migration.service.orchestrate import MigrationResult

PLOT_MAX_POINTS = 500  # points per run drawn in a loss plot


def plan_markdown(p: Plan) -> str:
    where = f"{p.nodes} nodes × {p.gpus_per_node}" if p.nodes > 1 else f"{p.gpus}"
    sj = p.source_job
    source_job = (f"The TPU job: {sj['devices']} devices of {fmt_bytes(sj['hbm_bytes_per_device'])}, "
                  f"state **{sj['sharding']}** "
                  f"({fmt_bytes(sj['state_bytes_per_device'])} per device: {sj['why']}).\n\n" if sj else "")
    head = (f"### {model_name(p.workload, p.preset, p.model)}: {p.source_name} → {where} × {p.target_name}\n"
            f"{p.param_count:,} parameters. " + source_job +
            f"Prediction: **{p.prediction_method}** — {p.prediction_note}.\n\n")
    figures = "".join(f"- {html.escape(f.label())}: **{f.text()}**" + (f" ({html.escape(f.how)})" if f.how else "")
                      + "\n" for f in plan_figures(p)) + "\n"
    if p.status != "ok":
        return head + figures + f"**Not feasible.** {p.message}"
    exact = "" if p.global_batch_exact else f" (**not** the requested {p.requested_global_batch})"
    src = p.source_tpu_compile
    kernel = f", {src['attention']} attention" if src.get("attention") else ""
    source_line = (f"On the source TPU ({src['device_kind']}{kernel}): {fmt_bytes(src['peak_bytes_per_chip'])} per device; "
                   f"the plan uses {fmt_bytes(p.predicted_peak_bytes)} per GPU."
                   + (f" TPU step predicted {fmt_seconds(src['predicted_step_s'])} ({src['step_method']})."
                      if src.get("predicted_step_s") else "") + "\n\n" if src.get("status") == "ok" else
                   f"Source TPU compile: {src.get('status')} — {src.get('reason', '')}"
                   + (f" Assumed TPU setup (the cheapest change that fits): {src['fitted']['setup']}, TPU step predicted "
                      f"{fmt_seconds(src['fitted']['predicted_step_s'])}." if src.get("fitted") else "")
                   + "\n\n" if src else "")
    env = "\n".join(f"export {k}={v['value']!r}  # {v['why']}" for k, v in p.environment.items())
    st = p.state
    state_line = (f"State per GPU ({st['sharding']}, shared by {st['shared_by']}): "
                  f"{fmt_bytes(st['compiled_state_bytes_per_gpu'])} "
                  f"compiled for parameters and AdamW moments, {fmt_bytes(st['state_with_gradients_bytes_per_gpu'])} with "
                  f"gradients, against 16 B/parameter / {st['shared_by']} = {fmt_bytes(st['arithmetic_bytes_per_gpu'])} "
                  f"({st['difference']:+.2%}).\n\n" if st.get("state_with_gradients_bytes_per_gpu") is not None else "")
    return (head + f"**Plan:** **{p.sharding}** state, {p.per_device_batch} per GPU × {p.gpus} GPU(s) × "
            f"{p.accumulation_steps} accumulation = "
            f"global batch {p.global_batch}{exact}, **{p.precision}**, remat **{p.remat}**. The table below ranks every "
            "choice that fits by predicted step time.\n\n"
            + figures + state_line +
            f"TPU-style setup on this target: {p.tpu_setup_on_target.get('summary', 'n/a')}.\n\n"
            f"Guide's rule of thumb: batch **{p.rule_of_thumb_batch}** vs the compiler's **{p.per_device_batch}** "
            f"— {p.rule_of_thumb_note}.\n\n" + source_line +
            f"Matmul precision — TPU: {p.matmul_precision['tpu']}; GPU: {p.matmul_precision['gpu']}.\n\n"
            f"Search: {p.compiles} compile(s), {p.cache_hits} cache hit(s), {p.search_seconds:.1f} s.\n\n"
            f"```bash\n{env}\n```")


def comparison_markdown(p: Plan) -> str:
    """The before/after panel's text: the headline (time and cost on each side), the side-by-side table, what
    the TPU compiler or the user's measurement says, and where each figure comes from."""
    c = p.comparison
    if not c:
        return ""
    rows = shown_rows(c)
    keys = list(rows[0])
    table = "\n".join(["| " + " | ".join(k or "figure" for k in keys) + " |", "|" + "---|" * len(keys),
                       *("| " + " | ".join(html.escape(r[k]).replace("|", "\\|") for k in keys) + " |" for r in rows)])
    notes = [c.get("tpu_fit"), (c.get("trust") or {}).get("text"), c.get("matching_note"), c.get("note"),
             *(f"Price of {line}" for line in price_sources(c))]
    return (f"### Before and after\n**{html.escape(headline(c))}**\n\n{table}\n\n"
            + "\n".join(f"- {html.escape(n)}" for n in notes if n))


def comparison_frames(p: Plan) -> tuple[pd.DataFrame, str, pd.DataFrame]:
    """The bar charts' data: time to train on each side (in one unit, named in the second value) and cost, the
    sides without a figure left out."""
    c = p.comparison or {}
    sides = [(f"{label}: {s['name']}" if label == "before" else f"{label}: {s['devices']} × {s['name']}", s)
             for label, s in (("before", c.get("tpu")), ("after", c.get("gpu"))) if s]
    times = [s["time_s"] for _, s in sides if s["time_s"] is not None]
    unit, scale = duration_unit(max(times)) if times else ("days", 86400.0)
    time = pd.DataFrame([{"side": name, "time": s["time_s"] / scale} for name, s in sides if s["time_s"] is not None],
                        columns=["side", "time"]).astype({"side": "str", "time": "float64"})
    cost = pd.DataFrame([{"side": name, "cost_usd": s["cost_usd"]} for name, s in sides if s["cost_usd"] is not None],
                        columns=["side", "cost_usd"]).astype({"side": "str", "cost_usd": "float64"})
    return time, unit, cost


RANKED_COLUMNS = {"state": "layout", "remat": "remat", "per_device_batch": "batch", "accumulation_steps": "accum",
                  "global_batch": "global", "device_fill": "fill", "predicted_step": "step", "how": "how",
                  "status": "status", "chosen": "plan"}


def ranked_frame(p: Plan) -> pd.DataFrame:
    """The ranked choices: those compiled and timed first, fastest first (the planner's choice rule), then
    the others by the estimate that ordered them; what became of each. Short headers, as the CLI's."""
    return pd.DataFrame(p.ranked_rows(), columns=list(RANKED_COLUMNS)).rename(columns=RANKED_COLUMNS)


def decisions_html(p: Plan) -> str:
    """Each decision, its value in units and its whole reason, wrapped to the page's width."""
    cards = "".join(
        f'<div class="dec-item" data-decision="{html.escape(d.decision)}" style="padding:4px 0;'
        f'border-bottom:1px solid #d0d7de"><strong>{html.escape(d.decision)}</strong>: '
        f'<code>{html.escape(d.shown())}</code>'
        f'<div style="white-space:normal;overflow-wrap:anywhere">{html.escape(d.reason)}</div></div>'
        for d in p.decisions)
    return f'<div class="decisions"><h3>Decisions with their reasons</h3>{cards}</div>'


def memory_frame(rows: list[dict[str, Any]], budget: int | None) -> pd.DataFrame:
    """Predicted GiB per batch and remat policy (single micro-batch compiles; candidates ruled out by
    the lower bound were not compiled and are not drawn), with the budget."""
    points = [{"per_device_batch": r["per_device_batch"], "predicted": r["predicted_bytes"],
               "series": f"remat {r['remat']}" + (f" ({r['sharding']})" if r.get("sharding", "replicated") != "replicated" else "")} for r in rows
              if r.get("predicted_bytes") is not None and r.get("accumulation_steps", 1) == 1
              and not r.get("lower_bound")]
    batches = sorted({r["per_device_batch"] for r in points}) or [1]
    if budget:
        points += [{"per_device_batch": b, "predicted": budget, "series": "budget"} for b in batches]
    frame = pd.DataFrame(points, columns=["per_device_batch", "predicted", "series"])
    return in_byte_unit(frame.astype({"per_device_batch": "int64", "predicted": "float64", "series": "str"}),
                        "predicted")


def bar_limits(frame: pd.DataFrame, column: str) -> list[float]:
    """A bar chart's value axis: from zero to a tenth above its tallest bar, so that no bar meets the top."""
    top = float(frame[column].max()) if len(frame) else 0.0
    return [0.0, 1.1 * top if top > 0 else 1.0]


def in_byte_unit(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """`frame` with its bytes `column` in the unit of its largest value, named in `frame.attrs["unit"]` (the
    chart's axis title): a 61.5 MiB peak on an axis of MiB, not 0.06 GiB."""
    unit, scale = byte_unit(frame[column].max() if len(frame) else GiB)
    frame[column] = frame[column] / scale
    frame.attrs["unit"] = unit
    return frame


def memory_chart_has_shape(frame: pd.DataFrame) -> bool:
    """Whether the memory chart shows how memory grows with the batch: two or more batches compiled. With one,
    it would be a lone point; the plan's text gives that figure against the budget."""
    return frame[frame["series"] != "budget"]["per_device_batch"].nunique() >= 2


def results_frame(r: RunReport, budget: int | None, budget_of: str = "") -> pd.DataFrame:
    """A run's report: what ran and where, then every figure labelled by its provenance (`migration.figures`:
    measured, compiled, set), in units scaled for reading."""
    rows = [
        ("status", r.status if r.ok else f"{r.status} ({r.failure_kind}): {r.message}"),
        ("ran", f"{r.per_device_batch} per device × {r.devices} device(s) × {r.accumulation_steps} accumulation = "
                f"global batch {r.global_batch}, {r.precision}, remat {r.remat}, {r.sharding} state, {r.step_style} "
                "step" + (f"; model {r.model}" if r.model else "")),
        ("where", f"{r.device_kind} ×{r.device_count}, {r.backend} backend, JAX {r.jax_version}, host {r.host}"),
        *((f.label(), f.shown()) for f in run_figures(r, budget, budget_of)),
        ("fp32 matmul precision", str(r.fp32_matmul_precision)),
    ]
    if r.checkpoint_restored:
        rows.append(("started from checkpoint", r.checkpoint_restored))
    if r.checkpoint_saved:
        rows.append(("checkpoint saved", f"{r.checkpoint_saved}, {fmt_bytes(r.checkpoint_saved_bytes)}"))
    return pd.DataFrame(rows, columns=["figure", "value"])


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
    return whole_axis(pd.DataFrame(rows, columns=["step", "loss", "run"]).astype(
        {"step": "int64", "loss": "float64", "run": "str"}), "step")


WHOLE_STEP_TICKS = 40  # up to this many steps a chart labels each step; beyond, a numeric axis ticks whole numbers


def whole_ticks(values: pd.Series) -> pd.Series:
    """Whole numbers as a chart's categories in numeric order: a short run's numeric axis would tick 1.0, 1.1,
    1.2 ... The chart orders categories as text, so each is padded on the left to one width (" 2" before "10")."""
    width = len(str(values.max()))
    return values.map(lambda v: str(v).rjust(width)).astype("str")


def before_after_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """The pmap and jit runs side by side (rows from `orchestrate.scaling_view`), every figure in its unit."""
    shown = [{"run": r["run"], "step": r["style"], "devices": r["devices"], "global batch": r["global_batch"],
              "throughput": fmt_count(r["samples_per_s"], "samples/s"),
              "tokens": fmt_count(r["tokens_per_s"], "tokens/s"),
              "step time (median)": fmt_seconds(None if r["step_ms_median"] is None else r["step_ms_median"] / 1e3),
              "scaling efficiency": fmt_percent(r["scaling_efficiency"]),
              "jit / pmap": "n/a" if r["jit_over_pmap"] is None else f"{fmt_number(r['jit_over_pmap'])}×",
              "same loss": {True: "yes", False: "NO", None: "n/a"}[r["losses_match"]],
              "measured on": f"{r['device_kind']} ({r['backend']} backend), JAX {r['jax_version']}"} for r in rows]
    return pd.DataFrame(shown, columns=["run", "step", "devices", "global batch", "throughput", "tokens",
                                        "step time (median)", "scaling efficiency", "jit / pmap", "same loss",
                                        "measured on"])


def autotune_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    """Autotune rows: predicted rank and step against the measured median, status, the pick."""
    def secs(ms: Any) -> str:
        return "" if ms is None else fmt_seconds(ms / 1e3)
    out = [{"predicted #": r["predicted_rank"], "state": r["sharding"], "remat": r["remat"],
            "batch": r["per_device_batch"], "accum": r["accumulation_steps"],
            "predicted step": "" if r["predicted_step_s"] is None else fmt_seconds(r["predicted_step_s"]),
            "measured step": secs(r["measured_step_ms"]), "measured #": r.get("measured_rank") or "",
            "peak memory": fmt_bytes(r["peak_memory_bytes"]), "status": r["status"] if r["status"] == "ok"
            else f"{r['status']} ({r['failure_kind']})", "pick": "✓" if r.get("picked") else ""} for r in rows]
    return pd.DataFrame(out)


def scaling_frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    points = [{"devices": r["devices"], "samples_per_s": r["samples_per_s"], "style": r["style"]} for r in rows
              if r["samples_per_s"] is not None]
    frame = pd.DataFrame(points, columns=["devices", "samples_per_s", "style"]).astype(
        {"devices": "int64", "samples_per_s": "float64", "style": "str"})
    return whole_axis(frame, "devices")


def whole_axis(frame: pd.DataFrame, column: str) -> pd.DataFrame:
    """`frame` with its whole-number x `column` as categories (`whole_ticks`) where a numeric axis would tick
    fractions (up to WHOLE_STEP_TICKS), else as it is."""
    if len(frame) and frame[column].max() <= WHOLE_STEP_TICKS:
        frame[column] = whole_ticks(frame[column])
    return frame


BADGE_COLOURS = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "not checked": "#57606a", "n/a": "#8c959f"}


def checklist_html(items: list[checklist.ChecklistItem], title: str = "Migration checklist") -> str:
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
    return f'<div class="checklist"><h3>{html.escape(title)}</h3><p>{summary}</p>{"".join(cards)}</div>'


def findings_frame(findings: list[Finding]) -> pd.DataFrame:
    return pd.DataFrame([f.to_dict() for f in findings],
                        columns=["file", "line", "col", "rule", "severity", "message", "replacement"])


HISTORY_COLUMNS = ["id", "created", "user", "label", "kind", "model", "status", "config", "device or target",
                   "throughput", "MFU", "measured peak", "predicted peak", "compile"]


def peaks(e: dict[str, Any]) -> tuple[int | None, int | None]:
    """A history entry's peak memory as measured on the device, and as compiled or predicted: a run on a
    backend that reports no peak (the CPU's) has only the compiled figure, shown once, as the prediction."""
    measured = e.get("peak_memory_bytes") if memory_provenance(e.get("peak_memory_source")) == MEASURED else None
    predicted = e.get("predicted_peak_bytes")
    if predicted is None and measured is None:
        predicted = e.get("peak_memory_bytes")
    return measured, predicted


def history_frame(entries: list[dict[str, Any]]) -> pd.DataFrame:
    """The history as people read it: one line per entry, the configuration in one column, every figure in
    its unit (the CSV export keeps the raw numbers)."""
    rows = []
    for e in entries:
        config = (f"{e.get('per_device_batch') or '?'}×{e.get('devices') or '?'}×{e.get('accumulation_steps') or '?'} "
                  f"{e.get('precision') or ''} {e.get('remat') or ''}").strip()
        if e["kind"] in SERVING_KINDS:  # the batch: a plan's largest that fits, a run's fastest measured
            config = f"serving batch {e.get('per_device_batch') or '?'}, {e.get('precision') or '?'}"
        rate = (fmt_count(e["tokens_per_s"], "tokens/s") if e.get("tokens_per_s") is not None else
                fmt_count(e.get("samples_per_s"), "samples/s", missing=""))
        if e["kind"] == "plan" and rate:
            rate += " (predicted)"
        rows.append({
            "id": e["id"], "created": str(e["created_at"]).replace("T", " ")[:16], "user": e.get("user") or "",
            "label": e.get("label") or "", "kind": e["kind"], "model": f"{e['workload']} / {e['preset']}",
            "status": e["status"], "config": config, "device or target": e.get("device_kind") or e.get("target") or "",
            "throughput": rate, "MFU": fmt_percent(e.get("mfu"), missing=""),
            "measured peak": fmt_bytes(peaks(e)[0], missing=""), "predicted peak": fmt_bytes(peaks(e)[1], missing=""),
            "compile": fmt_seconds(e.get("compile_s"), missing="")})
    return pd.DataFrame(rows, columns=HISTORY_COLUMNS)


def run_name(e: dict[str, Any]) -> str:
    return f"#{e['id']}"


def compare_frames(entries: list[dict[str, Any]]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Side-by-side table, throughput, peak memory (compiled beside measured, each bar named by its
    provenance: a CPU run has no measured peak) and loss curves. Runs are named by their id, which the
    table's first column shows with the rest of the configuration."""
    table = history_frame(entries)
    names = [run_name(e) for e in entries]
    throughput = pd.DataFrame({"run": names, "samples_per_s": [float(e.get("samples_per_s") or 0) for e in entries]})
    bars = []
    for n, e in zip(names, entries):
        measured, predicted = peaks(e)
        if predicted is not None:
            bars.append({"bar": f"{n} compiled", "peak": predicted, "series": "compiled (XLA memory analysis)"})
        if measured is not None:
            bars.append({"bar": f"{n} measured", "peak": measured, "series": "measured on the device"})
    memory = in_byte_unit(pd.DataFrame(bars, columns=["bar", "peak", "series"]).astype({"peak": "float64"}), "peak")
    losses = curve_frame({n: (e.get("payload") or {}).get("losses") or [] for n, e in zip(names, entries)})
    return table, throughput, memory, losses


def run_headline(result: MigrationResult, budget: int | None) -> str:
    main = result.main
    if main.ok:
        headline = "Run finished"
    elif main.failure_kind == "oom":
        predicted = main.predicted_peak_bytes or result.plan.predicted_peak_bytes
        headline = (f"Run failed: **does not fit** — out of memory at {main.per_device_batch} per device "
                    f"(predicted peak {fmt_bytes(predicted)} per device, budget {fmt_bytes(budget)}). Try a smaller per-device "
                    "batch with more accumulation steps (Plan does this for you), a remat policy, or bf16")
    else:
        headline = f"Run failed ({main.failure_kind}): {main.message}"
    cpu = " — **CPU backend: these are CPU figures, not GPU ones.**" if main.backend == "cpu" else ""
    return headline + cpu

