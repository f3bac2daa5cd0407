"""End to end through the launched app, by api_name, with gradio_client (a real server, real workers)."""

import re
import time
from pathlib import Path

import pandas as pd
import pytest

gradio_client = pytest.importorskip("gradio_client")

from migration.common import fmt_count  # noqa: E402
from tests.server import ROOT, holds_within, value, wait_until  # noqa: E402

pytestmark = pytest.mark.slow

# Form values in the order of the app's inputs (after steps, learning rate, TPU comparison for /run).
FORM = ["transformer", "tiny", "tpu-v5e-8", 32, 0, "bf16", "h100-sxm", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0, 0, 0, "preset", "auto", 8]

MLP_FORM = ["mlp", *FORM[1:]]


@pytest.fixture(scope="module")
def app(app_server):
    """The app with no extra flags (shared with the browser test: see conftest)."""
    return app_server


def run_args(steps, *, compare=False, profile=False, fp32=False, pmap=False, scaling=False, label="",
             plan_file=None, form=FORM, save_checkpoint="", restore_checkpoint=""):
    return (plan_file, steps, 0.003, compare, profile, fp32, pmap, scaling, *form, label, save_checkpoint,
            restore_checkpoint)


def test_an_uploaded_config_plans_its_model_and_its_tpu_job(app):
    """A MaxText yaml uploaded beside the form: its model and its job (2 per device on the v5p-8's 4 devices,
    256 tokens) replace the form's defaults; the keys it does not model are listed with the decisions."""
    form = list(FORM)
    form[2], form[3], form[6] = "tpu-v5p-8", 256, "local"  # 256: the form's default global batch, so the file's
    config = ROOT / "tests" / "fixtures" / "configs" / "maxtext" / "tiny-decoder-v5p.yml"
    outputs = app.client.predict(*form, "", config_file=gradio_client.handle_file(str(config)), api_name="/plan")
    markdown, decisions = value(outputs[5]), value(outputs[8])
    assert "llama" in markdown and "global batch 8" in markdown.replace(",", ""), markdown
    assert 'data-decision="imported_config"' in decisions and "remat_policy=minimal" in decisions


def test_plan_streams_each_compile_then_the_plan(app):
    job = app.client.submit(*FORM, "", api_name="/plan")
    progress, comparison, time_plot, cost_plot, comparison_csv, markdown, memory, ranked, decisions = [
        value(o) for o in job.result(timeout=300)]
    lines = [str(value(o[0])) for o in job.outputs()]
    assert any(line.startswith("Compiled batch") and "GiB" in line for line in lines)  # streamed, per compile
    assert "compiled-for-target" in markdown and "Plan:" in markdown and "rule of thumb" in markdown
    # decisions: every reason whole, values in units (no raw seconds)
    names = re.findall(r'data-decision="([a-z_]+)"', decisions)
    assert names[:6] == ["precision", "attention", "sharding", "remat", "per_device_batch", "accumulation_steps"]
    step = re.search(r'data-decision="step_time".*?<code>([^<]+)</code>', decisions).group(1)
    assert re.fullmatch(r"[0-9.]+ (µs|ms|s)", step), step
    assert any(row[2] == "budget" for row in memory["data"])
    assert ranked["headers"][:4] == ["layout", "remat", "batch", "accum"]
    assert ranked["data"][0][-1] == "✔" and re.fullmatch(r"[0-9.]+ (µs|ms|s)", ranked["data"][0][6])
    assert not any(re.fullmatch(r"~?0\.0 ms", row[6]) for row in ranked["data"])  # a step in the unit that fits it
    # the before/after panel: both sides compiled (libtpu installed), time and cost charted, exported as CSV
    assert "Before and after" in comparison and "TPU v5e-8" in comparison and "H100" in comparison
    assert "predicted from the compiled TPU program" in comparison, comparison
    assert [row[0] for row in time_plot["data"]] == ["before: TPU v5e-8 (v5litepod-8)", "after: 1 × H100 SXM5 80GB"]
    assert len(cost_plot["data"]) == 2 and all(row[1] > 0 for row in cost_plot["data"])
    frame = pd.read_csv(value(comparison_csv))
    assert list(frame.columns) == ["metric", "tpu", "gpu", "unit"]
    rows = frame.set_index("metric")
    assert float(rows.loc["price", "gpu"]) == 11.0612 and float(rows.loc["price", "tpu"]) == 1.2


def test_run_streams_progress_then_results_and_exports_csv(app):
    job = app.client.submit(*run_args(8), api_name="/run")
    result = [value(o) for o in job.result(timeout=300)]
    outputs = job.outputs()
    assert len(outputs) >= 3  # progress updates arrived before the result
    assert any("step" in str(value(o[0])) for o in outputs[:-1])
    progress, results, losses, csv_path, report_html, items_csv, deploy, trace, before_after, scaling, scaling_csv = result
    assert "Run finished" in progress and "CPU backend" in progress
    metrics = {row[0].split(",")[0]: row[1] for row in results["data"]}
    assert metrics["status"] == "ok" and metrics["compiles after the first step"].startswith("0 (")
    # every figure's label says where it comes from: a CPU run's peak memory is compiled, never measured
    labels = [row[0] for row in results["data"]]
    assert "peak memory per device, compiled for cpu ×1 (cpu backend)" in labels
    assert not any(label.startswith("peak memory") and "measured" in label for label in labels)
    assert len(losses["data"]) == 8
    frame = pd.read_csv(csv_path)
    assert frame.loc[0, "status"] == "ok" and frame.loc[0, "per_device_batch"] == 32
    history = app.client.predict("mine", "run", "transformer", "ok", api_name="/history")
    newest = history["data"][0]
    cols = history["headers"]
    assert newest[cols.index("throughput")] == fmt_count(frame.loc[0, "tokens_per_s"], "tokens/s")
    items = pd.read_csv(items_csv, keep_default_na=False)  # "n/a" is a status, not a missing value
    statuses = dict(zip(items["id"], items["status"]))
    # No code was checked and the run was on the CPU: nothing passes on this tool's own settings.
    assert statuses["apis"] == "not checked" and statuses["recompilation"] == "warn"
    assert "pass" not in statuses.values()
    # The report shows the same items as the CSV, each with its badge, evidence and action.
    assert len(items) >= 12 and report_html.count('class="ck-item"') == len(items)
    for _, row in items.iterrows():
        assert f'data-id="{row["id"]}" data-status="{row["status"]}"' in report_html
    assert "Evidence:" in report_html and "Action:" in report_html
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in Path(deploy).read_text()
    assert trace is None and scaling_csv is None  # no pmap or scaling runs asked for


def test_before_and_after_side_by_side_and_scaling_in_the_app_and_csv(app):
    """The TPU-era pmap step beside the migrated jit step on the same devices and data, and both at
    1, 2, 4 and 8 CPU devices: the same losses, a throughput each, a chart and CSVs."""
    # The MLP: eight worker runs, each a fresh JAX import and compile (the transformer's pmap/jit
    # equality at several device counts is tests/test_before_after.py's).
    result = [value(o) for o in app.client.submit(*run_args(5, pmap=True, scaling=True, form=MLP_FORM),
                                                  api_name="/run").result(timeout=900)]
    progress, csv_path, items_csv, before_after, chart, scaling_csv = (result[i] for i in (0, 3, 5, 8, 9, 10))
    assert "Run finished" in progress
    table = pd.DataFrame(before_after["data"], columns=before_after["headers"])
    assert sorted(zip(table["devices"], table["step"])) == [(n, s) for n in (1, 2, 4, 8) for s in ("jit", "pmap")]
    assert set(table["same loss"]) == {"yes"}  # at every device count
    assert all("(cpu backend)" in m for m in table["measured on"])
    assert len(chart["data"]) == 8  # a point per run, coloured by step style
    rows = pd.read_csv(scaling_csv)
    assert set(rows["style"]) == {"jit", "pmap"} and rows["losses_match"].all()
    one = rows[rows["devices"] == 1].set_index("style")
    assert (one["scaling_efficiency"] == 1.0).all()
    assert (rows["samples_per_s"] > 0).all() and rows["jit_over_pmap"].notna().all()
    report = pd.read_csv(csv_path)  # the report CSV: a row per run, named, with the scaling columns
    assert {"migrated", "pmap (before)", "jit ×8", "pmap ×8"} <= set(report["run"])
    assert set(report.loc[report["run"].isin(["migrated", "pmap (before)"]), "step_style"]) == {"jit", "pmap"}
    items = dict(zip(*pd.read_csv(items_csv, keep_default_na=False)[["id", "status"]].T.values))
    assert items["pmap"] == "warn"  # equal losses, but CPU figures, not the target
    assert items["scaling"] == "n/a"  # the plan runs on one GPU: the runs at 1 to 8 CPU devices say nothing of it


def test_checklist_uses_the_code_check_profile_and_fp32_reference(app):
    source = (ROOT / "tests" / "fixtures" / "codecheck" / "tpu_era_train.py").read_text()
    # State is per session: the code check and the run must come from the same client session.
    summary, table, *_ = app.client.predict(source, None, api_name="/code_check")
    assert "error" in summary and any(row[3] == "REMOVED001" for row in value(table)["data"])
    result = [value(o) for o in app.client.submit(*run_args(6, profile=True, fp32=True), api_name="/run")
              .result(timeout=600)]
    items = {row["id"]: row for _, row in pd.read_csv(result[5]).iterrows()}
    # The user's TPU-era script decides the items about code, with its rules and lines as evidence.
    assert items["apis"]["status"] == "fail" and "REMOVED001" in items["apis"]["evidence"]
    assert "<pasted>:" in items["apis"]["evidence"]
    assert items["host_sync"]["status"] == "warn" and "SYNC001" in items["host_sync"]["evidence"]
    # Profile and numerics were measured on this CPU, not the target GPU: warn, saying where.
    assert items["profile"]["status"] == "warn" and "ms/step" in items["profile"]["evidence"]
    assert "CPU backend" in items["profile"]["evidence"]
    assert items["numerics"]["status"] == "warn" and "fp32" in items["numerics"]["evidence"]
    assert result[7] and result[7].endswith(".json.gz")


# Stop kills the run's worker within a second or two: the job's thread sees the request at the
# worker's next event (a heartbeat at least every half second) and kills its process group. The test
# waits for that on a loaded 2-core box, where the Stop request, the server's event loop and the kill
# queue for the CPU behind other tests' compiles: a margin of 13 s on top of 2 s. A worker that Stop
# never reaches runs its 100,000 steps for many minutes, so the wait still fails then.
STOP_BOUND_S = 2.0
LOADED_BOX_MARGIN_S = 13.0


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie not yet reaped)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return next(line.split()[1] for line in status.splitlines() if line.startswith("State:")) in ("Z", "X")




def labels(history: dict) -> list[str]:
    return [row[history["headers"].index("label")] for row in history["data"]]


def test_stop_kills_the_worker_and_keeps_history(app):
    job = app.client.submit(*run_args(100_000, label="stopped"), api_name="/run")
    # Stop is pressed once the run is running: its worker has reported a training step ("step 1 of
    # 100000"), after the run's plan and compile. Pressed before, it would race the run's start.
    stepping = re.compile(r"\bstep \d+ of 100000\b")
    assert holds_within(lambda: any(stepping.search(str(value(o[0]))) for o in job.outputs()), 300, 0.3), \
        "the run never reported a step"
    [worker] = app.workers("run")
    stop = app.client.submit(api_name="/stop")  # the Stop button: this session's job
    stopped_at = time.monotonic()
    killed = holds_within(lambda: gone(worker), STOP_BOUND_S + LOADED_BOX_MARGIN_S)
    assert killed, f"the worker still runs {time.monotonic() - stopped_at:.1f} s after Stop"
    assert str(value(stop.result(timeout=60))).startswith("Stopping job #")  # Stop found the run's job
    # The worker goes first; its record follows.
    wait_until(lambda: "stopped" in labels(app.client.predict("mine", "run", "all", "cancelled", api_name="/history")),
               30, poll_s=0.3)
    assert app.workers() == []
    # the next job starts cleanly
    result = app.client.submit(*run_args(3), api_name="/run").result(timeout=300)
    assert "Run finished" in value(result[0])


def test_two_clients_run_one_after_the_other_and_both_are_in_history(app):
    other = app.connect()
    before = len(app.client.predict("mine", "run", "all", "ok", api_name="/history")["data"])
    jobs = [c.submit(*run_args(6), api_name="/run") for c in (app.client, other)]
    for job in jobs:
        assert "Run finished" in value(job.result(timeout=600)[0])
    history = app.client.predict("mine", "run", "all", "ok", api_name="/history")
    assert len(history["data"]) == before + 2
    ids = [row[0] for row in history["data"][:2]]
    csv_path = value(app.client.predict(",".join(map(str, ids)), "mine", api_name="/export_csv"))
    frame = pd.read_csv(csv_path)
    assert len(frame) == 2
    # Serialised: the second run's worker started after the first one's ended. (Ordered by start,
    # not by id: the two submissions race, and a run planned first may start after a later id.)
    runs = frame.assign(start=pd.to_datetime(frame["started_at"])).sort_values("start")
    first_end = pd.Timestamp(runs.iloc[0]["started_at"]) + pd.Timedelta(seconds=runs.iloc[0]["wall_s"])
    assert pd.Timestamp(runs.iloc[1]["started_at"]) >= first_end - pd.Timedelta(seconds=1)


def test_compare_charts_and_whole_history_export(app):
    history = app.client.predict("mine", "run", "all", "ok", api_name="/history")
    ids = [row[0] for row in history["data"][:2]]
    table, throughput, memory, losses = [value(o) for o in
                                         app.client.predict(",".join(map(str, ids)), "mine", api_name="/compare")]
    assert len(table["data"]) == 2 and len(throughput["data"]) == 2
    # peak memory: a CPU run's is compiled, not measured, so each run has one bar, named so
    assert sorted(row[2] for row in memory["data"]) == ["compiled (XLA memory analysis)"] * 2
    assert {row[2] for row in losses["data"]} and len({row[2] for row in losses["data"]}) == 2
    frame = pd.read_csv(value(app.client.predict("mine", api_name="/export_history_csv")))
    assert {"run", "plan"} <= set(frame["kind"])
    assert "peak_memory_bytes" in frame.columns and "samples_per_s" in frame.columns and "user" in frame.columns
    plans = frame[frame["kind"] == "plan"]  # a plan's row carries the TPU job beside it
    assert (plans["gpu_cost_usd"] > 0).any() and (plans["tpu_time_s"] > 0).any() and "comparison_matching_gpus" in frame


def test_bad_input_gets_a_clear_message(app):
    bad = list(FORM)
    bad[3] = 256.5  # global batch: refused, never rounded
    with pytest.raises(Exception) as err:
        app.client.predict(*bad, "", api_name="/plan")
    assert "global_batch" in str(err.value) and "256.5" in str(err.value) and "Traceback" not in str(err.value)
    with pytest.raises(Exception) as err:
        app.client.predict(*run_args(0), api_name="/run")
    assert "steps" in str(err.value) and "Traceback" not in str(err.value)
    with pytest.raises(Exception) as err:
        app.client.predict("def broken(:\n", None, api_name="/code_check")
    assert "not valid Python" in str(err.value)


def test_autotune_measures_the_plans_top_choices_on_this_machine(app):
    """The Autotune button: refused with the reason without a plan and for a plan whose target this
    machine lacks; for a `local` plan made here, its top choices run in real workers, the table shows
    predicted against measured, one pick, a CSV, and each candidate is a labelled run in the history."""
    client = app.connect()  # its own session, so its own plan state
    with pytest.raises(Exception) as err:
        client.predict(None, 2, 2, "", api_name="/autotune")
    assert "press Plan first" in str(err.value) and "Traceback" not in str(err.value)

    client.submit(*FORM, "", api_name="/plan").result(timeout=300)  # an H100 plan, made without the GPU
    with pytest.raises(Exception) as err:
        client.predict(None, 2, 2, "", api_name="/autotune")
    assert "does not have it" in str(err.value) and "H100" in str(err.value)

    local = list(FORM)
    local[0:8] = ["mlp", "tiny", "tpu-v5e-8", 64, 0, "fp32", "local", 1]
    client.submit(*local, "", api_name="/plan").result(timeout=300)
    before = len(app.client.predict("mine", "run", "mlp", "all", api_name="/history")["data"])
    job = client.submit(None, 2, 2, "tuned", api_name="/autotune")
    verdict, table, csv_file = [value(o) for o in job.result(timeout=600)]
    assert "CPU timings" in verdict and "pick #" in verdict and "the ranking" in verdict, verdict
    rows = table["data"]
    headers = table["headers"]
    assert len(rows) == 2 and [r[headers.index("predicted #")] for r in rows] == [1, 2]
    assert all(r[headers.index("status")] == "ok" and re.fullmatch(r"[0-9.,]+ (µs|ms|s)", r[headers.index("measured step")])
               for r in rows)
    assert [r[headers.index("pick")] for r in rows].count("✓") == 1
    frame = pd.read_csv(csv_file)
    assert len(frame) == 2 and frame["measured_step_ms"].notna().all() and frame["picked"].sum() == 1
    history = app.client.predict("mine", "run", "mlp", "all", api_name="/history")
    assert len(history["data"]) == before + 2
    labels = [str(cell) for row in history["data"] for cell in row]
    assert sum("tuned" in c and "autotune #" in c for c in labels) == 2


def test_a_run_saves_a_checkpoint_by_name_and_a_later_run_starts_from_it(app):
    """Folder names, kept in the server's private checkpoint folder: one run saves, the next (in
    another session of the same user) continues from its step; paths and unknown names are refused."""
    local = list(FORM)
    local[0:8] = ["mlp", "tiny", "tpu-v5e-8", 64, 0, "fp32", "local", 1]
    name = f"ck-{time.monotonic_ns()}"
    saved = [value(o) for o in app.client.submit(*run_args(3, form=local, save_checkpoint=name), api_name="/run")
             .result(timeout=600)]
    assert "Run finished" in saved[0], saved[0]
    rows = {row[0]: row[1] for row in saved[1]["data"]}
    assert rows["checkpoint saved"].startswith("step 3 to ") and "/checkpoints/local-" in rows["checkpoint saved"]
    assert rows["checkpoint saved"].split(" (")[0].endswith(f"/{name}") and "started from checkpoint" not in rows
    other = app.connect()
    again = [value(o) for o in other.submit(*run_args(2, form=local, restore_checkpoint=name), api_name="/run")
             .result(timeout=600)]
    assert "Run finished" in again[0], again[0]
    rows = {row[0]: row[1] for row in again[1]["data"]}
    assert rows["started from checkpoint"].startswith("step 3 from ") and "onto 1 cpu device" in rows[
        "started from checkpoint"]
    for bad, says in (("/etc", "absolute paths are not allowed"), ("../up", "'..' is not allowed"),
                      ("nope", "no checkpoint named 'nope'; yours: ")):
        with pytest.raises(Exception) as err:
            other.predict(*run_args(2, form=local, restore_checkpoint=bad), api_name="/run")
        assert "restore_checkpoint" in str(err.value) and says in str(err.value) and "Traceback" not in str(err.value)
    assert name in str(err.value)  # the list of this user's checkpoints


def test_environment_tab_probes_in_a_worker(app):
    markdown, info = app.client.predict(api_name="/environment")
    assert info["backend"] == "cpu" and "never initialises" in markdown
