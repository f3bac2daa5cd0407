"""The serving checklist (migration/grading/serving.py), graded from a real serving plan and a real
measured run on this machine (the CPU backend), and from the same evidence as if measured on the
target GPU, to show each verdict's edge: a pass only from the target at the plan's concurrency and
lengths, the user's code or the user's own weights; a warn from predictions, the CPU backend, this
product's own server or random weights; a fail from evidence."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from migration.codecheck import check_sources
from migration.config.serving import ServeRequest, ServeRunRequest
from migration.grading.serving import ITEMS, ServingEvidence, serving_checklist
from migration.hardware import GPU_SPECS
from migration.planning.serving import serve_plan
from migration.running.serving import serve_run
from tests.conftest import reused


@pytest.fixture(scope="module")
def evidence(tmp_path_factory):
    return reused("serving_checklist_evidence", make_evidence, tmp_path_factory)


def make_evidence(_folder):
    plan = serve_plan(ServeRequest("llama", "tiny", "l4", prompt_len=16, gen_len=16, precision="int8",
                                   memory_fraction=0.00001))
    run = serve_run(ServeRunRequest("llama", "tiny", precision="int8", requests=6, batches=(1, 2),
                                    prompt_range=(4, 16), gen_range=(2, 16)))
    return plan, run


def graded(**ev) -> dict[str, tuple[str, str]]:
    return {i.id: (i.status, i.evidence) for i in serving_checklist(ServingEvidence(**ev))}


def on_gpu(run: dict, kind: str = "NVIDIA L4", peak: int | None = None) -> dict:
    """The run's figures as if measured on `kind` (what a GPU run's result says of itself)."""
    gpu = copy.deepcopy(run) | {"backend": "gpu", "device_kind": kind}
    for row in gpu["rows"]:
        row["peak_memory_source"] = "measured: device memory_stats() (peak so far)"
        if peak is not None:
            row["peak_memory_bytes"] = peak
    return gpu


def test_nothing_given_is_not_checked_and_every_status_is_declared():
    got = graded()
    assert {s for s, _ in got.values()} == {"not checked"}
    assert set(got) == set(ITEMS)


def test_a_plan_and_a_cpu_run_warn_and_say_where(evidence):
    plan, run = evidence
    got = graded(plan=plan, run=run)
    assert got["kv_headroom"][0] == "warn" and "predicted for L4" in got["kv_headroom"][1]
    assert got["serve_recompiles"][0] == "warn" and "CPU backend" in got["serve_recompiles"][1]
    assert got["serve_host_sync"][0] == "warn" and "says nothing of yours" in got["serve_host_sync"][1]
    assert got["serve_logits"][0] == "warn" and "random weights" in got["serve_logits"][1]  # not the user's
    assert got["export"][0] == "not checked"


def test_measured_on_the_target_at_the_plans_concurrency_passes_and_elsewhere_warns(evidence):
    plan, run = evidence
    reached = on_gpu(run, peak=2 * 10**5)  # under the plan's 0.24 MB budget
    reached["rows"][-1]["batch"] = plan["largest_batch"]
    got = graded(plan=plan, run=reached)
    assert got["kv_headroom"][0] == "pass"
    assert got["serve_recompiles"][0] == "warn"  # this product's server's compiles: not the user's server
    below = graded(plan=plan, run=on_gpu(run, peak=2 * 10**5))  # batches 1 and 2 of the plan's concurrency
    assert below["kv_headroom"][0] == "warn" and "not reached (batch short)" in below["kv_headroom"][1]
    other = graded(plan=plan, run=on_gpu(run, kind="NVIDIA H100 80GB HBM3"))  # not the planned L4
    assert other["kv_headroom"][0] == "warn" and other["serve_recompiles"][0] == "warn"
    assert graded(run=on_gpu(run, peak=1))["kv_headroom"][0] == "warn"  # no plan: no concurrency to reach
    for key, value in (("precision", "bf16"), ("model", {"n_layers": 1}), ("kv_cache", "fp8"), ("preset", "1b")):
        elsewhere = copy.deepcopy(reached)  # the plan's concurrency and lengths, but another model's memory
        elsewhere["request"][key] = value
        got = graded(plan=plan, run=elsewhere)["kv_headroom"]
        assert got[0] == "warn" and f"another model than the plan's ({key} " in got[1], key


def test_evidence_against_the_item_fails(evidence):
    plan, run = evidence
    full = on_gpu(run, peak=GPU_SPECS["l4"].memory_bytes)  # the whole card: beyond the 90% budget
    assert graded(plan=plan, run=full)["kv_headroom"][0] == "fail"
    varying = check_sources([("serve.py", "import jax\nfrom torch.utils.data import DataLoader\n\n"
                                          "def batches(ds):\n    return DataLoader(ds, batch_size=8)\n")])
    assert graded(run=run, code=varying)["serve_recompiles"][0] == "fail"
    nothing = copy.deepcopy(plan) | {"largest_batch": 0}
    assert graded(plan=nothing)["kv_headroom"][0] == "fail"
    outside = copy.deepcopy(run)
    outside["logits_check"] |= {"within": False, "rms_ratio": 0.2}
    assert graded(run=outside)["serve_logits"][0] == "fail"


def test_the_users_weights_and_code_can_pass_and_fp32_needs_no_reference(evidence):
    _plan, run = evidence
    mine = copy.deepcopy(run) | {"weights": "checkpoint"}
    assert graded(run=mine)["serve_logits"][0] == "pass"
    fp32 = copy.deepcopy(run)
    fp32["request"]["precision"], fp32["logits_check"] = "fp32", None
    assert graded(run=fp32)["serve_logits"][0] == "n/a"
    clean = check_sources([("serve.py", "import jax\n\ndef serve(step, tokens):\n"
                                        "    for _ in range(8):\n        tokens = step(tokens)\n    return tokens\n")])
    assert graded(run=run, code=clean)["serve_host_sync"][0] == "pass"
    syncing = check_sources([("serve.py", "import jax\nimport numpy as np\n\ndef serve(step, state, tokens):\n"
                                          "    for _ in range(8):\n        state, logits = step(state, tokens)\n"
                                          "        print(float(logits.sum()))\n    return state\n")])
    assert graded(run=run, code=syncing)["serve_host_sync"][0] == "fail"


def test_an_export_passes_only_verified_on_the_users_weights():
    verified = {"transformers": "5.24.0", "max_abs_diff": 2e-6, "tolerance": 1e-4, "within": True}
    base = {"model": "llama/tiny", "out": "/tmp/x"}
    assert graded(export=base)["export"][0] == "warn"  # written, not loaded back
    assert graded(export=base | {"verified": verified})["export"][0] == "warn"  # random weights
    assert graded(export=base | {"verified": verified, "weights": "checkpoint"})["export"][0] == "pass"
    assert graded(export=base | {"verified": verified | {"within": False},
                                 "weights": "checkpoint"})["export"][0] == "fail"


def test_serving_items_grade_serving_code_never_a_training_scripts(evidence):
    """The serving items read only code given as serving code (or code whose kind was not said); the code
    check of a training script, however clean or however many host syncs it has, leaves them ungraded."""
    _plan, run = evidence
    syncing = check_sources([("serve.py", "import jax\n\ndef serve(step, state, tokens):\n"
                                          "    for _ in range(8):\n        state, logits = step(state, tokens)\n"
                                          "        print(float(logits.sum()))\n    return state\n")])
    clean = check_sources([("serve.py", "import jax\n\ndef serve(step, tokens):\n"
                                        "    for _ in range(8):\n        tokens = step(tokens)\n    return tokens\n")])
    for role in ("", "serving"):
        assert graded(run=run, code=dataclasses.replace(syncing, role=role))["serve_host_sync"][0] == "fail"
        assert graded(run=run, code=dataclasses.replace(clean, role=role))["serve_recompiles"][0] == "pass"
    for code in (syncing, clean):  # the same files, checked as the training job's
        training = graded(run=run, code=dataclasses.replace(code, role="training"))
        assert training["serve_host_sync"][0] == "warn" and "your serving loop was not checked" in training["serve_host_sync"][1]
        assert training["serve_recompiles"][0] == "warn"
    assert graded(code=dataclasses.replace(clean, role="training"))["serve_recompiles"][0] == "not checked"
