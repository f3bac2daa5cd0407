"""Checklist decisions from evidence: statuses follow the figures, every item has evidence and an action."""

import dataclasses

from migration import checklist
from migration.codecheck import check_source
from migration.config import RunConfig
from migration.plan import Decision, Plan
from migration.report import RunReport

GiB = 2**30


def make_plan(**change) -> Plan:
    base = dict(
        status="ok", workload="transformer", preset="tiny", source="tpu-v5e-8", source_name="TPU v5e-8",
        source_devices=8, source_per_core_batch=32, source_precision="bf16", target="h100-sxm",
        target_name="H100 SXM5 80GB", gpus=1, memory_fraction=0.8, safety_margin=0.1, budget_bytes=50 * GiB,
        device_memory_bytes=80 * 10**9, per_device_batch=64, accumulation_steps=4, global_batch=256,
        requested_global_batch=256, global_batch_exact=True, precision="bf16", remat="dots",
        predicted_peak_bytes=40 * GiB, prediction_method="compiled-for-target", prediction_note="compiled",
        param_count=1000, compiles=5, cache_hits=0, search_seconds=10.0,
        max_batch_by_remat={"none": 32, "full": 128, "dots": 64}, candidates=[1, 2, 4, 8, 16, 32, 64, 128, 256],
        table=[{"per_device_batch": 64, "remat": "none", "accumulation_steps": 1, "predicted_bytes": 70 * GiB},
               {"per_device_batch": 64, "remat": "dots", "accumulation_steps": 1, "predicted_bytes": 40 * GiB}],
        rule_of_thumb_batch=64, rule_of_thumb_note="", tpu_setup_on_target={}, source_tpu_compile={},
        matmul_precision={"tpu": "bf16", "gpu": "bf16"},
        environment={"XLA_PYTHON_CLIENT_PREALLOCATE": {"value": "false", "why": "shared"}},
        decisions=[Decision("remat", "dots", "r")],
    )
    return Plan(**{**base, **change})


def make_run(**change) -> RunReport:
    r = RunReport.from_events(RunConfig(precision="bf16"), [
        {"event": "started", "backend": "gpu", "device_kind": "NVIDIA H100 80GB HBM3", "device_count": 1,
         "jax_version": "0.11.2", "env": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}},
        {"event": "step", "loss": 5.0, "step_ms": 10.0}, {"event": "step", "loss": 4.0, "step_ms": 10.0},
        {"event": "finished", "compile_s": 12.0, "step_ms_median": 10.0, "samples_per_s": 800.0,
         "achieved_tflops": 300.0, "peak_tflops": 989.0, "peak_memory_bytes": 41 * GiB, "recompilations": 0,
         "device_memory_limit_bytes": 64 * GiB},
    ], status="ok")
    return dataclasses.replace(r, **change)


def by_id(items):
    return {i.id: i for i in items}


def test_guides_eight_items_and_the_implied_checks_all_have_evidence_and_actions():
    items = checklist.evaluate(make_plan(), make_run())
    ids = [i.id for i in items]
    for expected in ("profile", "batch", "apis", "remat", "scaling", "benchmark", "monitoring", "deployment",
                     "recompilation", "host_sync", "preallocation", "numerics"):
        assert expected in ids
    for i in items:
        assert i.status in ("pass", "warn", "fail", "n/a", "not checked") and i.evidence and i.action


def test_batch_item_follows_measured_memory_against_the_budget():
    assert by_id(checklist.evaluate(make_plan(), make_run()))["batch"].status == "pass"
    over = make_run(peak_memory_bytes=60 * GiB)
    item = by_id(checklist.evaluate(make_plan(), over))["batch"]
    assert item.status == "fail" and "60.00 GiB" in item.evidence
    inexact = make_plan(global_batch_exact=False, global_batch=288)
    assert by_id(checklist.evaluate(inexact, make_run()))["batch"].status == "warn"


def test_remat_item_reports_the_memory_saved_at_the_same_batch():
    item = by_id(checklist.evaluate(make_plan(), make_run()))["remat"]
    assert "saves 30.00 GiB" in item.evidence and "dots" in item.evidence


def test_code_findings_decide_the_api_item_and_the_host_sync_item():
    findings = check_source("import jax\njax.clear_backends()\nfor b in data:\n    s = train_step(s, b)\n    print(float(s))\n")
    items = by_id(checklist.evaluate(make_plan(), make_run(), findings=findings))
    assert items["apis"].status == "fail" and "REMOVED002" in items["apis"].evidence
    assert items["host_sync"].status == "warn" and "SYNC001" in items["host_sync"].evidence
    assert by_id(checklist.evaluate(make_plan(), make_run(), findings=[]))["apis"].status == "pass"


def test_recompilation_and_preallocation_checks():
    items = by_id(checklist.evaluate(make_plan(), make_run(recompilations=2, env={"XLA_PYTHON_CLIENT_PREALLOCATE": "true"})))
    assert items["recompilation"].status == "fail" and items["preallocation"].status == "warn"


def test_numerics_against_an_fp32_reference():
    ref = make_run(losses=[5.0, 4.05], precision="fp32")
    assert by_id(checklist.evaluate(make_plan(), make_run(), fp32_reference=ref))["numerics"].status == "pass"
    far = make_run(losses=[5.0, 3.0], precision="fp32")
    assert by_id(checklist.evaluate(make_plan(), make_run(), fp32_reference=far))["numerics"].status == "warn"


def test_benchmark_is_a_labelled_estimate_without_a_local_tpu_style_run():
    item = by_id(checklist.evaluate(make_plan(), make_run()))["benchmark"]
    assert item.status == "warn" and "ESTIMATE" in item.evidence and "not a measurement" in item.evidence
    tpu = make_run(samples_per_s=400.0)
    item = by_id(checklist.evaluate(make_plan(), make_run(), tpu_style_run=tpu))["benchmark"]
    assert item.status == "pass" and "2.00x" in item.evidence


def test_scaling_needs_two_device_counts():
    runs = [make_run(device_count=1, samples_per_s=800.0), make_run(device_count=2, samples_per_s=1500.0)]
    item = by_id(checklist.evaluate(make_plan(), make_run(), scaling_runs=runs))["scaling"]
    assert item.status == "pass" and "2 device(s) 750.0" in item.evidence
    assert by_id(checklist.evaluate(make_plan(), make_run()))["scaling"].status == "not checked"


def test_csv_has_one_row_per_item_and_the_snippet_sets_the_environment(tmp_path):
    import pandas as pd

    items = checklist.evaluate(make_plan(), make_run())
    checklist.to_csv(items, tmp_path / "c.csv")
    frame = pd.read_csv(tmp_path / "c.csv")
    assert list(frame.columns) == ["id", "item", "status", "evidence", "action"] and len(frame) == len(items)
    snippet = checklist.deployment_snippet(make_plan())
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE='false'" in snippet and snippet.startswith("#!/usr/bin/env bash")


def test_an_infeasible_plan_fails_the_batch_item():
    items = by_id(checklist.evaluate(make_plan(status="infeasible", message="does not fit even at batch 1"), None))
    assert items["batch"].status == "fail" and items["remat"].status == "n/a"
