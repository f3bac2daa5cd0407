"""Each grade's verdict at the edges of its rule, and the figures its evidence sentence reports:
the measured value and the limit it was compared with, read the way a user reads them."""

import copy
import dataclasses
import math

import pytest

from migration.common import fmt_bytes, fmt_count
from migration.grading import checklist, serving
from migration.grading.checklist import FAIL, NA, NOT_CHECKED, PASS, WARN, Evidence
from migration.grading.scaling import loss_tolerance
from migration.grading.serving import ServingEvidence
from migration.hardware import GPU_SPECS, TPU_SPECS
from tests import test_checklist, test_serving_checklist
from tests.test_checklist import CLEAN, NO_JAX, PMAP_ONLY, TARGET_KIND, TPU_ERA, code, gpus, infeasible, on_gpu
from tests.test_serving_checklist import on_gpu as serve_on_gpu

pytestmark = pytest.mark.slow
world = test_checklist.world  # the shared fixtures: a real plan and runs, a serving plan and run
evidence = test_serving_checklist.evidence


# -- batch ---------------------------------------------------------------------------------------

def test_batch_passes_at_the_budget_and_fails_one_byte_over(world):
    plan = world["plan"]
    budget = plan.budget_bytes
    for peak, status in ((budget - 1, PASS), (budget, PASS), (budget + 1, FAIL)):
        ran = on_gpu(world["run"], peak_memory_bytes=peak)
        status_, text, action = checklist.grade_batch(Evidence(plan, ran))
        assert status_ == status, (peak, text)
        assert f"measured peak {fmt_bytes(peak)} of a {fmt_bytes(budget)} budget" in text
        assert TARGET_KIND in text
    assert "over budget" in checklist.grade_batch(Evidence(plan, on_gpu(world["run"], peak_memory_bytes=budget + 1)))[2]


def test_batch_reports_the_plan_and_the_run_it_compares(world):
    plan, r = world["plan"], on_gpu(world["run"])
    status, text, action = checklist.grade_batch(Evidence(plan, r))
    assert status == PASS and action == "keep the planned batch and accumulation"
    assert (f"plan for {plan.target_name}: TPU {plan.source_per_core_batch} per core -> {plan.per_device_batch} per GPU "
            f"x {plan.gpus} x {plan.accumulation_steps} accumulation = {plan.global_batch} (requested "
            f"{plan.requested_global_batch}); predicted {fmt_bytes(plan.predicted_peak_bytes)} "
            f"({plan.prediction_method}) of a {fmt_bytes(plan.budget_bytes)} budget") in text
    assert (f"ran {r.per_device_batch} per device x {r.devices} x {r.accumulation_steps} = {r.global_batch}: "
            f"measured peak") in text


def test_batch_is_graded_against_the_budget_of_the_machine_it_ran_on(world):
    plan = world["plan"]
    smaller = dataclasses.replace(plan, budget_bytes=plan.budget_bytes // 2)
    ran = on_gpu(world["run"], peak_memory_bytes=plan.budget_bytes // 2)
    status, text, _ = checklist.grade_batch(Evidence(plan, ran, ran_plan=smaller))
    assert status == PASS and f"of a {fmt_bytes(plan.budget_bytes // 2)} budget; measured" in text
    over = on_gpu(world["run"], peak_memory_bytes=plan.budget_bytes // 2 + 1)
    assert checklist.grade_batch(Evidence(plan, over, ran_plan=smaller))[0] == FAIL


def test_batch_warns_when_the_global_batch_changed(world):
    plan = world["plan"]
    ran = on_gpu(world["run"], global_batch=plan.requested_global_batch + 1)
    status, text, action = checklist.grade_batch(Evidence(plan, ran))
    assert status == WARN and "the global batch changed" in text and "rescale the learning rate" in action


def test_batch_refit_on_target_warns_with_the_ran_configuration(world):
    plan, r = world["plan"], world["run"]
    for change in ({"accumulation_steps": r.accumulation_steps + 1}, {"per_device_batch": r.per_device_batch + 1}):
        status, text, action = checklist.grade_batch(Evidence(plan, on_gpu(r, **change)))
        assert status == WARN and "re-fitted on this machine" in text, change
        assert "planned memory share" in action


def test_batch_elsewhere_reports_the_peak_and_whether_it_was_refit(world):
    plan, r = world["plan"], world["run"]
    status, text, action = checklist.grade_batch(Evidence(plan, r))
    assert status == WARN
    assert (f"; the run here ({r.per_device_batch} per device x {r.accumulation_steps}, as planned) peaked at "
            f"{fmt_bytes(r.peak_memory_bytes)} ({r.peak_memory_source}); measured on the CPU backend") in text
    assert action == f"the fit is a compile for the target, not a measurement: run the plan on {plan.target_name} to confirm"
    refit = dataclasses.replace(r, accumulation_steps=r.accumulation_steps + 1)
    assert "re-fitted to this machine" in checklist.grade_batch(Evidence(plan, refit))[1]
    estimated = dataclasses.replace(plan, prediction_method="estimate")
    assert "the fit is an analytic estimate" in checklist.grade_batch(Evidence(estimated))[2]


def test_batch_quotes_the_failure_message_in_part(world):
    plan, r = world["plan"], world["run"]
    long = "x" * 150 + "y" * 100 + "z" * 100
    oom = dataclasses.replace(r, status="failed", failure_kind="oom", message=long)
    status, text, action = checklist.grade_batch(Evidence(plan, oom))
    assert status == FAIL and f"({long[:200]})" in text and "lower the per-device batch" in action
    assert (f"the run at {r.per_device_batch} per device x {r.accumulation_steps} ran out of memory") in text
    other = dataclasses.replace(r, status="failed", failure_kind="timeout", message=long)
    status, text, _ = checklist.grade_batch(Evidence(plan, other))
    assert status == WARN and f"; the run failed (timeout: {long[:160]})" in text
    assert checklist.grade_batch(Evidence(plan))[1].endswith("; not run yet")


def test_batch_fails_an_infeasible_plan_with_its_message(world):
    plan = infeasible(world["plan"])
    status, text, action = checklist.grade_batch(Evidence(plan))
    assert status == FAIL and text == plan.message and "choose a larger GPU" in action


# -- remat ---------------------------------------------------------------------------------------

def test_remat_passes_at_the_budget_and_warns_over_it(world):
    plan = world["plan"]
    budget = plan.budget_bytes
    for peak, status in ((budget, PASS), (budget + 1, WARN)):
        ran = on_gpu(world["run"], peak_memory_bytes=peak)
        assert checklist.grade_remat(Evidence(plan, ran))[0] == status, peak
    r = on_gpu(world["run"], peak_memory_bytes=budget)
    status, text, action = checklist.grade_remat(Evidence(plan, r))
    per_policy = ", ".join(f"{k} {v}" for k, v in plan.max_batch_by_remat.items())
    assert text.startswith(f"policy {plan.remat} ({plan.remat_chosen_by}); largest batch per policy: {per_policy} "
                           f"({plan.prediction_method}); the run under {r.remat} peaked at {fmt_bytes(budget)} of "
                           f"{fmt_bytes(budget)}, {r.step_ms_median:.1f} ms per step; measured on {TARGET_KIND}")
    assert "keep it" in action


def test_remat_warns_unless_the_planned_policy_ran_on_the_target(world):
    plan, r = world["plan"], world["run"]
    other = "full" if plan.remat != "full" else "none"
    for ev in (Evidence(plan, on_gpu(r, remat=other)), Evidence(plan, r),
               Evidence(plan, on_gpu(r, peak_memory_bytes=None)), Evidence(plan)):
        status, text, action = checklist.grade_remat(ev)
        assert status == WARN and text.endswith("; not yet measured on the target"), text
        assert action == f"run the plan on {plan.target_name} to confirm the choice"
    smaller = dataclasses.replace(plan, budget_bytes=plan.budget_bytes // 2)
    over = on_gpu(r, peak_memory_bytes=plan.budget_bytes // 2 + 1)
    assert checklist.grade_remat(Evidence(plan, over, ran_plan=smaller))[0] == WARN


def test_remat_warns_for_a_cpu_compile_and_says_why(world):
    plan = dataclasses.replace(world["plan"], prediction_method="compiled-local", planned_on="cpu")
    status, text, action = checklist.grade_remat(Evidence(plan, on_gpu(world["run"])))
    assert status == WARN and "a CPU-backend compile does not show remat savings" in text
    assert action == f"plan for {plan.target_name} instead"
    on_gpu_plan = dataclasses.replace(plan, planned_on="gpu")
    assert checklist.grade_remat(Evidence(on_gpu_plan, on_gpu(world["run"])))[0] == PASS
    override = dataclasses.replace(world["plan"], remat_chosen_by="override")
    assert "remat auto" in checklist.grade_remat(Evidence(override))[2]
    estimate = dataclasses.replace(world["plan"], prediction_method="estimate")
    assert "jax[cuda12]" in checklist.grade_remat(Evidence(estimate))[2]
    assert checklist.grade_remat(Evidence(infeasible(world["plan"])))[2] == "see the batch item"


# -- scaling -------------------------------------------------------------------------------------

def scaled(w, one, two, **more):
    return (on_gpu(w["run"], device_count=1, samples_per_s=one), on_gpu(w["two"], device_count=2, samples_per_s=two))


@pytest.mark.parametrize("two,status", [(158.0, WARN), (160.0, PASS), (162.0, PASS)])
def test_scaling_passes_from_80_percent_efficiency(world, two, status):
    runs = scaled(world, 100.0, two)
    got, text, action = checklist.grade_scaling(Evidence(gpus(world["plan"], 2), on_gpu(world["run"]),
                                                         scaling_runs=runs[::-1]))
    assert got == status, text
    eff = two / 2 / 100.0
    assert f"samples/s per device: 1 device(s) 100.0, 2 device(s) {two / 2:,.1f}" in text
    assert f"efficiency {eff:.0%} from 1 to 2" in text
    assert ("(under 80%)" in text) == (status == WARN)
    assert ("latency-hiding" in action) == (status == WARN)


def test_scaling_ignores_failed_or_empty_runs(world):
    one, two = scaled(world, 100.0, 190.0)
    plan = gpus(world["plan"], 2)
    for bad in (dataclasses.replace(two, status="failed"), dataclasses.replace(two, samples_per_s=0.0),
                dataclasses.replace(two, device_count=0)):
        status, text, action = checklist.grade_scaling(Evidence(plan, world["run"], scaling_runs=(one, bad)))
        assert status == NOT_CHECKED, bad
        assert text == f"runs of this configuration at only one device count ({world['run'].device_count}); " \
                       f"the plan uses 2 GPUs"
        assert action == "run the plan at 1 and 2 devices and compare samples/s per device"
    status, text, _ = checklist.grade_scaling(Evidence(gpus(world["plan"], 4, nodes=2), scaling_runs=(one,)))
    assert text == "runs of this configuration at only one device count; the plan uses 4 GPUs over 2 nodes"


def test_scaling_below_the_planned_count_warns_naming_it(world):
    runs = scaled(world, 100.0, 200.0)
    status, text, action = checklist.grade_scaling(Evidence(gpus(world["plan"], 4), scaling_runs=runs))
    assert status == WARN and "the plan uses 4 GPUs: the largest count not measured" in text
    assert action == "measure at 4 GPUs"
    status, text, action = checklist.grade_scaling(Evidence(gpus(world["plan"], 4, nodes=2), scaling_runs=runs))
    assert "4 GPUs over 2 nodes: the largest count and the links between nodes not measured" in text
    assert action == "measure at 4 GPUs on 2 nodes"


def test_scaling_warns_when_any_run_is_off_target(world):
    one, _ = scaled(world, 100.0, 200.0)
    cpu_two = dataclasses.replace(world["two"], device_count=2, samples_per_s=200.0)
    status, text, action = checklist.grade_scaling(Evidence(gpus(world["plan"], 2), scaling_runs=(one, cpu_two)))
    assert status == WARN and "share the host's cores" in text and action.startswith("measure on 2 x ")
    status, text, action = checklist.grade_scaling(Evidence(world["plan"]))
    assert status == NA and text == f"the plan runs on one {world['plan'].target_name}"


# -- benchmark -----------------------------------------------------------------------------------

@pytest.mark.parametrize("rate,status", [(89.0, WARN), (90.0, PASS), (91.0, PASS)])
def test_benchmark_passes_from_0_9_of_the_tpu_rate(world, rate, status):
    plan = world["plan"]
    step_ms = plan.requested_global_batch / 100.0 * 1e3  # 100 samples/s on the TPU
    got, text, action = checklist.grade_benchmark(Evidence(plan, on_gpu(world["run"], samples_per_s=rate),
                                                           tpu_step_ms=step_ms))
    assert got == status, text
    src = TPU_SPECS[plan.source]
    assert (f"migrated {fmt_count(rate, 'samples/s')} on {world['run'].device_count} device(s) (measured on {TARGET_KIND}"
            ) in text
    assert (f"vs your {src.name} job 100 samples/s ({step_ms:g} ms per step at a global batch of "
            f"{plan.requested_global_batch}, as you measured it): {rate / 100:.2f}x") in text
    assert ("(under 0.9x)" in text) == (status == WARN)
    assert (action == "keep the migrated setup") == (status == PASS)


def test_benchmark_on_part_of_the_gpus_extrapolates(world):
    plan = gpus(world["plan"], 4)
    step_ms = plan.requested_global_batch / 100.0 * 1e3
    r = on_gpu(world["run"], samples_per_s=50.0, device_count=2)
    status, text, action = checklist.grade_benchmark(Evidence(plan, r, tpu_step_ms=step_ms))
    assert status == WARN and "measured on 2 of the plan's 4 GPUs: at linear scaling 1.00x, an ESTIMATE" in text
    assert action == "run the plan on all 4 GPUs"
    r = on_gpu(world["run"], samples_per_s=100.0, device_count=4)
    assert checklist.grade_benchmark(Evidence(plan, r, tpu_step_ms=step_ms))[0] == PASS
    # a run without a reported device count counts the devices it was configured with (1 here)
    unreported = on_gpu(world["run"], samples_per_s=100.0, device_count=0)
    status, text, _ = checklist.grade_benchmark(Evidence(plan, unreported, tpu_step_ms=step_ms))
    assert status == WARN and "measured on 1 of the plan's 4 GPUs: at linear scaling 4.00x" in text


def test_benchmark_reports_the_tpu_style_run_and_the_plans_own_tpu_figure(world):
    plan, r = world["plan"], on_gpu(world["run"], samples_per_s=200.0, peak_tflops=100.0)
    tpu = on_gpu(world["ref"], samples_per_s=80.0)
    status, text, action = checklist.grade_benchmark(Evidence(plan, r, tpu_style_run=tpu))
    assert status == NOT_CHECKED
    assert "; the TPU-style setup run here: 80 samples/s (2.50x; the same device, not your TPU job)" in text
    assert "ESTIMATE" not in text and "peak-scaled" not in text  # no second estimate of the TPU job
    assert f"at a global batch of {plan.requested_global_batch}" in action
    failed = dataclasses.replace(tpu, status="failed", failure_kind="oom")
    assert "; the TPU-style setup run here failed (oom)" in checklist.grade_benchmark(Evidence(plan, r, tpu_style_run=failed))[1]
    # The TPU figure is the plan's: the step its before/after panel predicts, the one estimate reported
    tpu_side = {"step_s": 0.005, "global_batch": 256, "measured_step_s": None,
                "step_source": "predicted from the compiled TPU program"}
    predicted = dataclasses.replace(plan, comparison={"unit": "tokens", "tpu": tpu_side})
    status, text, _ = checklist.grade_benchmark(Evidence(predicted, r))
    assert status == NOT_CHECKED
    assert ("the plan predicts your TPU job at 51.2k samples/s (256 samples a 5 ms step, predicted from the "
            "compiled TPU program), a prediction, not your job's measurement") in text
    # A step the user measured and gave to the plan is the TPU figure, graded like the run form's
    measured = dataclasses.replace(plan, comparison={"unit": "tokens", "tpu": {**tpu_side, "measured_step_s": 0.5}})
    status, text, _ = checklist.grade_benchmark(Evidence(measured, r))
    assert status != NOT_CHECKED and "(500 ms per step at a global batch of" in text


# -- numerics ------------------------------------------------------------------------------------

def numerics(w, mine, ref, **ref_change):
    return checklist.grade_numerics(Evidence(w["plan"], on_gpu(w["run"], losses=mine),
                                             fp32_reference=on_gpu(w["ref"], losses=ref, **ref_change)))


@pytest.mark.parametrize("mine,ref,status", [
    ([5.0, 21.0], [5.0, 20.0], PASS),  # 5% apart: at the tolerance
    ([5.0, 21.02], [5.0, 20.0], WARN),
    ([5.0, 19.0], [5.0, 20.0], PASS),
    ([5.0, 18.98], [5.0, 20.0], WARN),
    ([5.0, -21.0], [5.0, -20.0], PASS),  # a negative loss: relative to its size
    ([5.0, 0.0], [5.0, 0.0], PASS),
])
def test_numerics_tolerance_is_five_percent_of_the_reference(world, mine, ref, status):
    got, text, action = numerics(world, mine, ref)
    assert got == status, text
    rel = abs(mine[-1] - ref[-1]) / max(abs(ref[-1]), 1e-12)
    assert text.startswith(f"loss after 2 steps: {world['run'].precision} {mine[-1]:.4f} vs fp32 {ref[-1]:.4f} "
                           f"({rel:.1%} apart; tolerance 5%); measured on {TARGET_KIND}")
    assert (action == "none") == (status == PASS)


def test_numerics_compares_at_the_last_common_step(world):
    status, text, _ = numerics(world, [5.0, 21.0, 99.0], [5.0, 20.0])
    assert status == PASS and "loss after 2 steps" in text and "21.0000 vs fp32 20.0000" in text
    assert numerics(world, [5.0, 21.0], [5.0, 20.0, 1.0])[0] == PASS


def test_numerics_accepts_an_fp32_reference_computed_in_fp32(world):
    assert numerics(world, [4.0, 3.0], [4.0, 3.0], fp32_matmul_precision="fp32")[0] == PASS
    assert numerics(world, [4.0, 3.0], [4.0, 3.0], fp32_matmul_precision=None)[0] == PASS
    status, text, action = numerics(world, [4.0, 3.0], [4.0, 3.0], fp32_matmul_precision="bf16")
    assert status == WARN and "computed its fp32 products as bf16, not fp32" in text and "highest" in action


def test_numerics_without_a_usable_reference_is_not_checked(world):
    w = world
    r = on_gpu(w["run"], losses=[4.0, 3.0])
    for ev in (Evidence(w["plan"], r, fp32_reference=dataclasses.replace(w["ref"], status="failed")),
               Evidence(w["plan"], r, fp32_reference=dataclasses.replace(w["ref"], losses=[])),
               Evidence(w["plan"], on_gpu(w["run"], losses=[]), fp32_reference=w["ref"]),
               Evidence(w["plan"], fp32_reference=w["ref"])):
        assert checklist.grade_numerics(ev)[0] == NOT_CHECKED
    status, text, action = numerics(w, [4.0, 3.0], [4.0, math.inf])
    assert status == NOT_CHECKED and "after 2 steps is inf" in text and "lower the learning rate" in action
    status, text, action = numerics(w, [4.0, math.inf], [4.0, 3.0])
    assert status == FAIL and f"{w['run'].precision} loss after 2 steps is inf; fp32 3.0000" in text
    assert "loss scaling" in action


def test_numerics_off_target_warns(world):
    w = world
    ev = Evidence(w["plan"], dataclasses.replace(w["run"], losses=[4.0, 3.0]),
                  fp32_reference=dataclasses.replace(w["ref"], losses=[4.0, 3.0]))
    status, text, action = checklist.grade_numerics(ev)
    assert status == WARN and "GPU kernels round differently" in text
    assert action == f"repeat the comparison on {w['plan'].target_name}"


# -- pmap ----------------------------------------------------------------------------------------

def pmap_grade(w, before_losses, **more):
    r = on_gpu(w["run"], losses=[4.0, 2.0], samples_per_s=more.pop("mine", 200.0))
    before = on_gpu(w["run"], losses=before_losses, samples_per_s=more.pop("theirs", 160.0))
    return checklist.grade_pmap(Evidence(w["plan"], r, pmap_run=before, code=more.pop("src", code(CLEAN))))


def test_pmap_fails_beyond_the_loss_tolerance(world):
    prec = world["run"].precision
    tol = loss_tolerance(prec)
    status, text, action = pmap_grade(world, [4.0, 2.0 * (1 + tol / 2)])
    assert status == PASS, text
    assert f"(tolerance {tol:.0e} for {prec})" in text
    status, text, action = pmap_grade(world, [4.0, 2.0 * (1 + tol * 2)])
    assert status == FAIL and "compare their gradients" in action
    assert f"largest relative loss difference {tol * 2:.1e} over 2 steps" in text


def test_pmap_reports_both_throughputs(world):
    status, text, action = pmap_grade(world, [4.0, 2.0])
    assert status == PASS and action == "retire the pmap step; keep jit with NamedSharding"
    r = world["run"]
    assert (f"jit with shardings vs pmap + lax.pmean on {r.device_count} {TARGET_KIND} device(s), same data: "
            f"largest relative loss difference 0.0e+00 over 2 steps; throughput 200.0 vs 160.0 samples/s (1.25x)") in text
    assert "no pmap-era calls" in text
    assert "throughput n/a" in pmap_grade(world, [4.0, 2.0], theirs=None)[1]
    assert "throughput n/a" in pmap_grade(world, [4.0, 2.0], mine=0.0)[1]


def test_pmap_code_and_device_decide_the_rest(world):
    status, text, action = pmap_grade(world, [4.0, 2.0], src=code(NO_JAX))
    assert status == WARN and "found no JAX in them for pmap-era calls" in text
    status, text, _ = pmap_grade(world, [4.0, 2.0], src=None)
    assert status == WARN and "your training code was not checked for pmap-era calls" in text
    assert pmap_grade(world, [4.0, 2.0], src=code(PMAP_ONLY))[0] == FAIL
    w = world
    r = on_gpu(w["run"], losses=[4.0, 2.0])
    cpu_before = dataclasses.replace(w["run"], losses=[4.0, 2.0])
    status, text, action = checklist.grade_pmap(Evidence(w["plan"], r, pmap_run=cpu_before, code=code(CLEAN)))
    assert status == WARN and action == f"compare the two steps' throughput on {w['plan'].target_name}"
    no_losses = dataclasses.replace(w["run"], losses=[])
    status, text, _ = checklist.grade_pmap(Evidence(w["plan"], r, pmap_run=no_losses))
    assert status == NOT_CHECKED and text == f"the pmap step {no_losses.status} (no losses)"
    assert checklist.grade_pmap(Evidence(w["plan"], on_gpu(w["run"], losses=[]), pmap_run=r))[0] == NOT_CHECKED
    assert checklist.grade_pmap(Evidence(w["plan"], pmap_run=r))[0] == NOT_CHECKED


def test_pmap_in_the_users_code_fails_the_item_with_its_lines_without_any_run(world):
    """The code check of the session found pmap: the item fails with the finding's line, with or without
    the pmap step run beside the migrated one; clean code leaves the runs to decide."""
    plan = world["plan"]
    status, text, action = checklist.grade_pmap(Evidence(plan, code=code(PMAP_ONLY)))
    assert status == FAIL and "your code still uses pmap: PMAP001 train.py:" in text
    assert "NamedSharding" in action
    assert checklist.grade_pmap(Evidence(plan, world["run"], code=code(PMAP_ONLY)))[0] == FAIL
    assert checklist.grade_pmap(Evidence(plan, world["run"], code=code(CLEAN)))[0] == NOT_CHECKED
    assert checklist.grade_pmap(Evidence(plan, world["run"], code=code(NO_JAX)))[0] == NOT_CHECKED


# -- deployment ----------------------------------------------------------------------------------

def test_deployment_fails_any_tpu_valued_setting(world):
    for value in ("TPU", "tpu,cpu"):
        src = f'import os\nos.environ["JAX_PLATFORMS"] = "{value}"\nimport jax\n'
        status, text, action = checklist.grade_deployment(Evidence(world["plan"], code=code(src)))
        assert status == FAIL and f"TPU-specific settings: JAX_PLATFORMS={value} line 2" in text, text
        assert "remove them" in action


def test_deployment_settings_without_jax_are_still_compared(world):
    src = 'import os\nos.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"\n'
    status, text, _ = checklist.grade_deployment(Evidence(world["plan"], code=code(src)))
    assert status != NOT_CHECKED and "against the plan's environment" in text
    jax_only = checklist.grade_deployment(Evidence(world["plan"], code=code("import jax\n")))
    assert jax_only[0] == WARN and "against the plan's environment" in jax_only[1]


def test_deployment_late_settings_name_the_line(world):
    src = 'import jax\nimport os\nos.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"\n'
    status, text, action = checklist.grade_deployment(Evidence(world["plan"], code=code(src)))
    assert status == FAIL and "set after `import jax`, so JAX ignores them: ENV001 train.py:3" in text
    assert "before the first import of jax" in action
    status, text, action = checklist.grade_deployment(Evidence(world["plan"], code=code(CLEAN)))
    assert status == PASS and action == "keep them in step with the plan"
    assert text.startswith("code check of 1 file(s) (train.py) against the plan's environment: ")
    assert "the deployment snippet" in checklist.grade_deployment(Evidence(world["plan"]))[2]


# -- serving: KV headroom ------------------------------------------------------------------------

def reaching(run: dict, plan: dict, peak: int) -> dict:
    """`run` as if measured on the plan's L4 at the plan's concurrency and lengths."""
    gpu = serve_on_gpu(run, peak=peak)
    gpu["rows"][-1]["batch"] = plan["largest_batch"]
    gpu["request"]["prompt_range"] = [1, max(c[1] for c in plan["mix"])]
    gpu["request"]["gen_range"] = [1, max(c[2] for c in plan["mix"])]
    return gpu


def test_kv_headroom_passes_at_the_budget_and_fails_one_byte_over(evidence):
    plan, run = evidence
    fraction = plan["request"]["memory_fraction"]
    budget = GPU_SPECS["l4"].memory_bytes * fraction
    for peak, status in ((math.floor(budget), PASS), (math.floor(budget) + 1, FAIL)):
        status_, text, action = serving.grade_kv_headroom(ServingEvidence(plan=plan, run=reaching(run, plan, peak)))
        assert status_ == status, (peak, budget)
        assert text.startswith(f"measured on NVIDIA L4 (the gpu backend): peak {fmt_bytes(peak)} at batch "
                               f"{plan['largest_batch']} (measured: device memory_stats() (peak so far)), requests up to 16 + 16 "
                               f"tokens, against {fmt_bytes(budget)} ({fraction:.0%} of L4)"), text
    assert text  # the pass said what it measured
    passed = serving.grade_kv_headroom(ServingEvidence(plan=plan, run=reaching(run, plan, 1)))[1]
    assert passed.endswith(f": the plan's {plan['largest_batch']} running sequences and lengths, measured")


def test_kv_headroom_warns_when_the_run_did_not_reach_the_plan(evidence):
    """A fit measured on the target below the plan's concurrency or lengths is not the plan's fit: each
    shortfall is named, and the action measures the plan's figures."""
    plan, run = evidence
    need = plan["largest_batch"]
    for change, short in ((lambda r: r["rows"][-1].update(batch=need - 1), "batch"),
                          (lambda r: r["request"].update(prompt_range=[1, 15]), "prompt"),
                          (lambda r: r["request"].update(gen_range=[1, 15]), "generation")):
        gpu = reaching(run, plan, 1)
        change(gpu)
        status, text, action = serving.grade_kv_headroom(ServingEvidence(plan=plan, run=gpu))
        assert status == WARN and f"the plan's {need} running sequences of up to 16 + 16 tokens were not reached " \
            f"({short} short)" in text, text
        assert action == f"measure the plan's concurrency and lengths on L4 (python -m migration serve-run --batches " \
            f"{need} --prompt-max 16 --gen-max 16)"


def test_kv_headroom_reads_the_largest_batch_row(evidence):
    plan, run = evidence
    gpu = serve_on_gpu(run, peak=10)
    top = max(gpu["rows"], key=lambda r: r["batch"])
    top["peak_memory_bytes"] = GPU_SPECS["l4"].memory_bytes  # only the largest batch is over
    gpu["rows"].reverse()
    status, text, _ = serving.grade_kv_headroom(ServingEvidence(plan=plan, run=gpu))
    assert status == FAIL and f"at batch {top['batch']}" in text


def test_kv_headroom_of_a_plan_file_without_a_fitting_row_warns(evidence):
    """A serving plan file (serve-run --plan) whose rows are all over the edge: no crash, a warn."""
    plan, _run = evidence
    over = {**plan, "rows": [{**r, "fits": False} for r in plan["rows"]]}
    status, text, action = serving.grade_kv_headroom(ServingEvidence(plan=over))
    batches = ", ".join(str(r["batch"]) for r in plan["rows"])
    assert status == WARN and f"{plan['largest_batch']} running sequences, but the plan's rows ({batches}) all " \
        f"exceed {fmt_bytes(plan['budget_bytes'])}" in text
    assert action == "plan again with serve-plan, without --batches"


def test_kv_headroom_without_a_plan_warns_and_fails_over_90_percent_of_the_card(evidence):
    """Measured on a GPU with no plan: a fit at the run's own batch is not a fit at the batch the server
    must hold, so at best a warn; over 90% of the card it fails."""
    _plan, run = evidence
    card = GPU_SPECS["l4"].memory_bytes
    for peak, status in ((int(card * 0.9), WARN), (int(card * 0.9) + 1, FAIL)):
        got, text, action = serving.grade_kv_headroom(ServingEvidence(run=serve_on_gpu(run, peak=peak)))
        assert got == status
        assert f"against {fmt_bytes(card * 0.9)} (90% of L4)" in text
    status, text, action = serving.grade_kv_headroom(ServingEvidence(run=serve_on_gpu(run, peak=1)))
    assert text.endswith("; no serving plan says how many sequences the server must hold")
    assert action.startswith("plan with serve-plan for L4")


def test_kv_headroom_prediction_names_the_concurrency(evidence):
    plan, run = evidence
    status, text, action = serving.grade_kv_headroom(ServingEvidence(plan=plan))
    row = max((r for r in plan["rows"] if r["fits"]), key=lambda r: r["batch"])
    assert status == WARN
    assert text.startswith(f"predicted for {plan['target']} (compiled without the device): {plan['largest_batch']} "
                           f"running sequences; at {row['batch']} peak {fmt_bytes(row['predicted_peak_bytes'])} "
                           f"of {fmt_bytes(row['budget_bytes'])}, KV cache {fmt_bytes(row['kv_cache_bytes'])}")
    assert action == (f"measure it on {plan['target']} (python -m migration serve-run --batches {plan['largest_batch']} "
                      "--prompt-max 16 --gen-max 16)")
    over = [r["batch"] for r in plan["rows"] if not r["fits"]]
    assert (f"; {', '.join(map(str, over))} do not fit" in text) == bool(over)
    assert "the run was" not in text
    status, text, _ = serving.grade_kv_headroom(ServingEvidence(plan=plan, run=run))
    assert text.endswith("; the run was measured on cpu (the CPU backend)")


def test_kv_headroom_prediction_lists_batches_that_do_not_fit_and_gpus(evidence):
    plan, _run = evidence
    changed = copy.deepcopy(plan)
    rows = changed["rows"]
    fitting = [r for r in rows if r["fits"]]
    extra = [dict(fitting[0], batch=1000, fits=False), dict(fitting[0], batch=2000, fits=False)]
    changed["rows"] = rows + extra
    changed["gpus"] = 2
    status, text, _ = serving.grade_kv_headroom(ServingEvidence(plan=changed))
    assert status == WARN and text.startswith(f"predicted for 2 x {plan['target']}, per GPU (compiled")
    assert "1000, 2000 do not fit" in text
    nothing = copy.deepcopy(plan) | {"largest_batch": 0}
    status, text, action = serving.grade_kv_headroom(ServingEvidence(plan=nothing))
    assert status == FAIL and text == (f"predicted for {plan['target']} (compiled without the device): not even one "
                                       f"sequence fits in {fmt_bytes(plan['budget_bytes'])}")
    assert "int8 weights" in action


def test_kv_headroom_run_elsewhere_without_a_plan_warns(evidence):
    _plan, run = evidence
    status, text, action = serving.grade_kv_headroom(ServingEvidence(run=run))
    assert status == WARN and text == "measured on cpu (the CPU backend), not on a GPU planned for"
    assert "serve-plan" in action
    status, text, action = serving.grade_kv_headroom(ServingEvidence())
    assert status == NOT_CHECKED and text == "no serving plan or run"


# -- serving: logits and export ------------------------------------------------------------------

def test_logits_sentence_reports_the_check(evidence):
    _plan, run = evidence
    check = run["logits_check"]
    status, text, action = serving.grade_logits(ServingEvidence(run=run))
    assert text.startswith(f"{check['precision']} logits vs fp32 on {run['weights']} weights, {check['tokens']} tokens: "
                           f"RMS difference {check['rms_ratio']:.2%} of the logits' RMS (tolerance "
                           f"{check['tolerance']:.0%}), top token agrees at {check['top1_agreement']:.1%}")
    assert status == WARN and "--checkpoint YOUR_CHECKPOINT" in action


def test_logits_without_a_check_name_the_precision(evidence):
    plan, run = evidence
    unchecked = copy.deepcopy(run) | {"logits_check": None}
    status, text, action = serving.grade_logits(ServingEvidence(run=unchecked))
    assert status == NOT_CHECKED and text == "no logits check of int8 against fp32"
    assert action == "run python -m migration serve-run --precision int8 --checkpoint YOUR_CHECKPOINT"
    status, text, _ = serving.grade_logits(ServingEvidence(plan=plan))
    assert text == f"no logits check of {plan['request']['precision']} against fp32"
    status, text, action = serving.grade_logits(ServingEvidence())
    assert text == "no logits check of the serving precision against fp32" and "--precision bf16" in action
    fp32_plan = copy.deepcopy(plan)
    fp32_plan["request"]["precision"] = "fp32"
    assert serving.grade_logits(ServingEvidence(plan=fp32_plan))[0] == NA


def test_export_sentence_reports_the_comparison():
    verified = {"transformers": "5.24.0", "max_abs_diff": 2.5e-6, "tolerance": 1e-4, "within": True}
    export = {"model": "llama/tiny", "out": "/tmp/x", "verified": verified, "weights": "checkpoint"}
    status, text, action = serving.grade_export(ServingEvidence(export=export))
    assert status == PASS and text == ("exported llama/tiny to /tmp/x; loaded with transformers 5.24.0: largest logit "
                                       "difference 2.5e-06 (tolerance 0.0001)")
    assert "vLLM" in action
    status, text, action = serving.grade_export(ServingEvidence(export={"verified": None}))
    assert status == WARN and text == "exported the model to a folder; not loaded back" and "--verify" in action
    status, text, action = serving.grade_export(ServingEvidence(export=export | {"weights": "random"}))
    assert status == WARN and text.endswith("; random weights, not your model's") and "export your checkpoint" in action
    status, text, action = serving.grade_export(ServingEvidence(export=export | {"verified": verified | {"within": False}}))
    assert status == FAIL and "do not serve this export" in action
    status, text, action = serving.grade_export(ServingEvidence())
    assert status == NOT_CHECKED and "export-hf --checkpoint" in action


# -- the code-check items ------------------------------------------------------------------------

TPU_ERA_LINES = "TPU001 train.py:4, REMOVED001 train.py:5"


def test_apis_lists_errors_and_at_most_eight_findings(world):
    from tests.test_checklist import TPU_ERA
    status, text, action = checklist.grade_apis(Evidence(world["plan"], code=code(TPU_ERA)))
    assert status == FAIL and f"code check of 1 file(s) (train.py): 2 TPU-only or removed API call(s): {TPU_ERA_LINES}" \
        == text and action == "apply each finding's replacement"
    many = "import jax\n" + "".join(f"s{i} = jax.pmap(f)\n" for i in range(10))
    status, text, _ = checklist.grade_apis(Evidence(world["plan"], code=code(many)))
    assert status == WARN and "10 outdated API use(s): " in text and text.endswith(" …")
    assert "train.py:9" in text and "train.py:10," not in text and "train.py:11" not in text
    eight = "import jax\n" + "".join(f"s{i} = jax.pmap(f)\n" for i in range(8))
    assert not checklist.grade_apis(Evidence(world["plan"], code=code(eight)))[1].endswith("…")
    status, text, action = checklist.grade_apis(Evidence(world["plan"], code=code(CLEAN)))
    assert status == PASS and text.endswith(f"({', '.join(checklist.API_RULES)})") and action == "nothing to replace"


def test_the_code_scope_names_up_to_four_files(world):
    from migration.codecheck import check_sources
    files = [(f"f{i}.py", "import jax\n") for i in range(5)]
    status, text, _ = checklist.grade_host_sync(Evidence(world["plan"], code=check_sources(files)))
    assert status == PASS and text == "code check of 5 file(s) (f0.py, f1.py, f2.py, f3.py): no host sync in the training loop"


def test_host_sync_counts_and_locates_the_syncs(world):
    from tests.test_checklist import TPU_ERA
    status, text, action = checklist.grade_host_sync(Evidence(world["plan"], code=code(TPU_ERA)))
    assert status == WARN and text == "code check of 1 file(s) (train.py): 1 host sync(s) in the step loop: SYNC001 train.py:9"
    assert "every N steps" in action
    status, text, action = checklist.grade_host_sync(Evidence(world["plan"], code=code(NO_JAX)))
    assert status == NOT_CHECKED and "none of them uses JAX" in text and "builds and runs your training step" in action
    status, text, action = checklist.grade_host_sync(Evidence(world["plan"]))
    assert (status, text) == (NOT_CHECKED, "your training code was not checked") and "python -m migration check" in action


def test_monitoring_lists_the_reads_and_the_runs_peak(world):
    from tests.test_checklist import TRACED
    r = world["run"]
    peak = f"; this run's peak {fmt_bytes(r.peak_memory_bytes)} ({r.peak_memory_source})"
    status, text, action = checklist.grade_monitoring(Evidence(world["plan"], r, code=code(CLEAN)))
    assert status == PASS and text == (f"code check of 1 file(s) (train.py): your code reads device memory or "
                                       f"utilisation: memory_stats train.py:19{peak}")
    assert "bytes_limit" in action
    status, text, action = checklist.grade_monitoring(Evidence(world["plan"], r, code=code(TRACED)))
    assert status == WARN and "(jax.profiler.start_trace train.py:3)" in text and text.endswith(peak)
    assert action == checklist.MONITOR_HINT
    status, text, _ = checklist.grade_monitoring(Evidence(world["plan"], code=code(NO_JAX)))
    assert status == NOT_CHECKED and text.endswith("(no import of jax, flax, optax, ...)")
    assert checklist.grade_monitoring(Evidence(world["plan"], r))[1] == "your training code was not checked" + peak


def test_recompilation_reports_the_count_and_where(world):
    r = world["run"]
    for n, status in ((0, PASS), (1, FAIL)):
        got, text, action = checklist.grade_recompilation(Evidence(world["plan"], on_gpu(r, recompilations=n),
                                                                   code=code(CLEAN)))
        assert got == status and text.startswith(f"{n} XLA compile(s) after the first step (jax.monitoring); "
                                                 f"measured on {TARGET_KIND} x{r.device_count} (gpu backend), JAX "
                                                 f"{r.jax_version}")
    status, text, action = checklist.grade_recompilation(Evidence(world["plan"], on_gpu(r), code=code(NO_JAX)))
    assert status == WARN and "none of them uses JAX, so for shapes that change between steps" in text
    status, text, action = checklist.grade_recompilation(Evidence(world["plan"], on_gpu(r)))
    assert status == WARN and "your training code was not checked for shapes" in text
    status, text, action = checklist.grade_recompilation(Evidence(world["plan"], r, code=code(CLEAN)))
    assert status == WARN and action == f"confirm on {world['plan'].target_name}"
    status, text, action = checklist.grade_recompilation(Evidence(world["plan"], on_gpu(r), code=code(CLEAN)))
    assert status == PASS and action == "none" and "no varying batch shapes or traced Python branches" in text


def test_profile_reports_time_per_step_by_op(world):
    r = on_gpu(world["run"])
    p = r.profile
    status, text, action = checklist.grade_profile(Evidence(world["plan"], r))
    ops = p["top_ops"][:5]
    top = ", ".join(f"{o['name']} {o['total_ms'] / max(1, p['steps']):.2f} ms/step" for o in ops)
    assert status == PASS and text.startswith(f"{p['steps']} step(s) traced ({p['path']}); time by op: {top}; measured")
    assert "Perfetto" in action
    status, text, action = checklist.grade_profile(Evidence(world["plan"], world["run"]))
    assert status == WARN and action == f"capture the profile on {world['plan'].target_name}"
    bare = dataclasses.replace(world["run"], profile=None)
    status, text, _ = checklist.grade_profile(Evidence(world["plan"], bare))
    assert text == (f"no profile was captured for this run; compile {bare.compile_s:.2f} s vs step "
                    f"{bare.step_ms_median:.2f} ms (median)")
    assert checklist.grade_profile(Evidence(world["plan"]))[1] == "no profile was captured for this run"


# -- serving: recompiles and host sync -----------------------------------------------------------

def test_serving_recompiles_report_each_batch_and_pass_only_from_the_users_code(evidence):
    plan, run = evidence
    rows = ", ".join(f"batch {r['batch']}: {r['recompiles']}" for r in run["rows"][:6])
    status, text, action = serving.grade_recompiles(ServingEvidence(plan=plan, run=serve_on_gpu(run)))
    assert status == WARN and text.startswith("this product's server, measured on NVIDIA L4")
    assert text.endswith(f"compiles after the warm-up: {rows}; says nothing of your server's") and "--code" in action
    lo, hi = run["request"]["prompt_range"]
    assert f"{run['rows'][0]['requests']} requests (prompts {lo}-{hi} tokens, buckets {run['buckets']})" in text
    from migration.codecheck import check_sources
    varying = check_sources([("serve.py", "import jax\nimport tensorflow as tf\n\ndef batches(ds):\n"
                                          "    return ds.batch(8)\n")])
    status, text, _ = serving.grade_recompiles(ServingEvidence(run=run, code=varying))
    assert status == FAIL and text.startswith("code check of 1 file(s): SHAPE001 serve.py:5"), text
    clean = check_sources([("serve.py", "import jax\n\ndef serve(step, tokens):\n    return step(tokens)\n")])
    status, text, _ = serving.grade_recompiles(ServingEvidence(run=run, code=clean))
    assert status == PASS and "no shapes that vary between calls" in text
    assert serving.grade_recompiles(ServingEvidence())[0] == NOT_CHECKED


def test_serving_host_sync_names_each_finding(evidence):
    _plan, run = evidence
    from migration.codecheck import check_sources
    src = ("import jax\n\ndef serve(step, state, tokens):\n    for _ in range(8):\n"
           "        state, logits = step(state, tokens)\n        print(float(logits.sum()))\n    return state\n")
    checked = check_sources([("serve.py", src)])
    found = [f for f in checked.findings if f.rule in ("SYNC001", "TIME001")]
    status, text, action = serving.grade_host_sync(ServingEvidence(code=checked))
    assert status == FAIL and text == "code check of 1 file(s): " + ", ".join(
        f"{f.rule} {f.file}:{f.line}" for f in found)
    assert "copy only each step's tokens" in action
    no_jax = check_sources([("serve.py", "x = 1\n")])
    status, text, _ = serving.grade_host_sync(ServingEvidence(code=no_jax))
    assert (status, text) == (NOT_CHECKED, "your serving loop was not checked")
    status, text, _ = serving.grade_host_sync(ServingEvidence(run=run, code=no_jax))
    assert status == WARN and "(its TPOT, measured on cpu (the CPU backend), includes that copy)" in text


# -- where a run was measured --------------------------------------------------------------------

def test_another_gpu_model_is_not_the_target(world):
    plan, r = world["plan"], world["run"]
    other = dataclasses.replace(on_gpu(r), device_kind="NVIDIA H100 80GB HBM3")
    status, text, _ = checklist.grade_recompilation(Evidence(plan, other, code=code(CLEAN)))
    assert status == WARN and f"measured on NVIDIA H100 80GB HBM3, not on the target {plan.target_name}" in text
    nameless = dataclasses.replace(on_gpu(r), device_kind="")
    assert checklist.grade_recompilation(Evidence(plan, nameless, code=code(CLEAN)))[0] == WARN
    local = dataclasses.replace(plan, target="local", planned_device_kind=TARGET_KIND)
    assert checklist.grade_recompilation(Evidence(local, on_gpu(r), code=code(CLEAN)))[0] == PASS
    elsewhere = dataclasses.replace(local, planned_device_kind="NVIDIA L4")
    assert checklist.grade_recompilation(Evidence(elsewhere, on_gpu(r), code=code(CLEAN)))[0] == WARN


def test_on_target_needs_a_gpu_run_of_the_targets_model(world):
    """Only a GPU-backend run whose device kind is the target's counts as measured on the target."""
    plan, r = world["plan"], world["run"]
    ev = Evidence(plan)
    assert ev.on_target(on_gpu(r)) and not ev.on_target(None)
    assert not ev.on_target(dataclasses.replace(on_gpu(r), backend="cpu"))  # the target's name, on the CPU
    assert not ev.on_target(dataclasses.replace(on_gpu(r), device_kind=None))
    local = Evidence(dataclasses.replace(plan, target="local", planned_device_kind="NVIDIA L4"))
    assert local.on_target(dataclasses.replace(on_gpu(r), device_kind="NVIDIA L4"))  # the planned local GPU
    assert not local.on_target(on_gpu(r))
    assert Evidence(plan).findings(("TPU001",)) == []  # no code check: no findings
    assert [f.rule for f in Evidence(plan, code=code(TPU_ERA)).findings(("TPU001",))] == ["TPU001"]


def test_scaling_efficiency_spans_the_smallest_to_the_largest_count(world):
    one, two = scaled(world, 100.0, 200.0)
    four = on_gpu(world["two"], device_count=4, samples_per_s=300.0)  # 75 per device: 75% of 1 device
    status, text, _ = checklist.grade_scaling(Evidence(gpus(world["plan"], 4), scaling_runs=(one, two, four)))
    assert status == WARN and "efficiency 75% from 1 to 4 (under 80%)" in text
    assert f"; measured on {TARGET_KIND} x1 (gpu backend)" in text


def test_numerics_compares_a_small_loss_relative_to_itself(world):
    assert numerics(world, [5.0, 0.02], [5.0, 0.01])[0] == WARN
    assert numerics(world, [5.0, 0.0104], [5.0, 0.01])[0] == PASS


def test_pmap_at_the_tolerance_is_not_a_failure(world):
    tol = loss_tolerance(world["run"].precision)
    base = 1 / tol
    r = on_gpu(world["run"], losses=[base], samples_per_s=200.0)
    before = on_gpu(world["run"], losses=[base + 1], samples_per_s=200.0)
    assert checklist.grade_pmap(Evidence(world["plan"], r, pmap_run=before, code=code(CLEAN)))[0] == PASS
    before = on_gpu(world["run"], losses=[base + 1.01], samples_per_s=200.0)
    assert checklist.grade_pmap(Evidence(world["plan"], r, pmap_run=before, code=code(CLEAN)))[0] == FAIL


def test_serving_rows_and_a_plan_without_a_gpu_count(evidence):
    plan, run = evidence
    many = copy.deepcopy(run)
    many["rows"] = [dict(run["rows"][0], batch=b, recompiles=b) for b in range(1, 8)]
    many["rows"][0]["requests"] = 99
    text = serving.grade_recompiles(ServingEvidence(run=many))[1]
    assert "99 requests" in text and text.endswith("batch 5: 5, batch 6: 6; says nothing of your server's")
    single = {k: v for k, v in plan.items() if k != "gpus"}
    text = serving.grade_kv_headroom(ServingEvidence(plan=single))[1]
    assert text.startswith(f"predicted for {plan['target']} (compiled without the device)")


@pytest.mark.parametrize("item, found, clean", [("apis", FAIL, PASS), ("host_sync", WARN, PASS), ("pmap", FAIL, NOT_CHECKED)])
def test_a_code_item_grades_the_finding_present_absent_and_never_a_servers_code(world, item, found, clean):
    """The session's code check moves its item: the finding present (with its line), absent, and the same code
    given as a server's, which says nothing of the training job (not checked)."""
    grade = checklist.ITEMS[item].grade
    r = world["run"]
    status, text, _ = grade(Evidence(world["plan"], r, code=code(TPU_ERA)))
    assert status == found and "train.py:" in text, text
    assert grade(Evidence(world["plan"], r, code=code(CLEAN)))[0] == clean
    for source in (TPU_ERA, CLEAN):
        serving = dataclasses.replace(code(source), role="serving")
        status, text, _ = grade(Evidence(world["plan"], r, code=serving))
        assert status == NOT_CHECKED and "train.py" not in text, text
