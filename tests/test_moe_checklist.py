"""A mixture-of-experts run measures what its router did (the share of token slots dropped past the experts'
capacity, the busiest expert's and the busiest GPU's load), and the checklist's MoE items grade from it: dropped
slots under the bound, the expert-parallel all-to-all inside the link domain and, dropless, evenly spread. A real deviceless plan for H100s and real CPU
runs of it (4 CPU devices, the plan's fsdp+ep4); a pass only as if the same run had been measured on the
target (`on_gpu`), never from the CPU figures or the plan alone."""

import dataclasses

import pytest

from migration.config.requests import PlanRequest, RunConfig
from migration.grading import checklist
from migration.grading.checklist import FAIL, NA, NOT_CHECKED, PASS, WARN, Evidence
from migration.planning.planner import plan_migration
from migration.running.runner import run
from tests.conftest import reused

H100 = "NVIDIA H100 80GB HBM3"  # the device kind of the h100-sxm catalog entry
ROOMY = {"dispatch": "capacity", "capacity_factor": 4.0}  # C = T x k / E x 4: room for every slot of tiny's 4 experts
TIGHT = {"dispatch": "capacity", "capacity_factor": 0.5}


def make_world(tmp):
    plan = plan_migration(PlanRequest(workload="moe", preset="tiny", model=ROOMY, target="h100-sxm", gpus=4,
                                      sharding="fsdp+ep4", global_batch=16, compile_for_tpu=False),
                          lambda *a, **k: None)
    assert plan.ok and plan.sharding == "fsdp+ep4", plan.message
    base = RunConfig(workload="moe", preset="tiny", model=ROOMY, per_device_batch=plan.per_device_batch,
                     accumulation_steps=plan.accumulation_steps, devices=4, sharding="fsdp+ep4", steps=6,
                     warmup_steps=1)
    roomy, tight, dropless = (run(dataclasses.replace(base, model=m)) for m in (ROOMY, TIGHT, {}))
    for r in (roomy, tight, dropless):
        assert r.ok, r.message + r.stderr_tail
    return {"plan": plan, "roomy": roomy, "tight": tight, "dropless": dropless}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return reused("moe_checklist_world", make_world, tmp_path_factory)


def on_gpu(r):
    return dataclasses.replace(r, backend="gpu", device_kind=H100)


def grade(item, **evidence):
    return checklist.ITEMS[item].grade(Evidence(**evidence))


def test_a_run_records_its_routers_dropped_share_and_load(world):
    roomy, tight = world["roomy"], world["tight"]
    assert roomy.router_dropped_mean == 0.0 and roomy.router_dropped_max == 0.0  # room for every slot
    assert 0.05 < tight.router_dropped_mean <= tight.router_dropped_max < 1.0


@pytest.mark.parametrize("model", [TIGHT, ROOMY], ids=["tight", "roomy"])
def test_the_runs_router_figures_are_the_routers_own_count_on_its_first_batch(model):
    """A one-step run's figures (out of the compiled step, through the run's events into its report) against the
    model itself on the same parameters and batch, in-process: the dropped share the capacity dispatch computes
    and the busiest expert's load (tests/test_moe.py checks a layer's load against its router's counted top-k
    choices)."""
    from migration.step.train import TrainProgram

    cfg = RunConfig(workload="moe", preset="tiny", model=model, per_device_batch=4, steps=1, warmup_steps=0)
    report = run(cfg)
    assert report.ok, report.message + report.stderr_tail
    program = TrainProgram.from_config(cfg)
    decoder = program.build_model(program.seed)
    tokens = program.make_batch(0)["tokens"][0]
    _, routing = decoder.hidden_and_router(tokens[:, :-1])
    assert report.router_dropped_mean == pytest.approx(float(routing.dropped), abs=1e-6)
    assert report.router_load_mean == pytest.approx(float(routing.load), rel=1e-6)
    assert report.router_load_mean == report.router_load_max and report.router_load_mean > 1.0  # one step


def test_dropped_slots_grade_from_the_run_against_the_bound(world):
    plan, roomy, tight = world["plan"], world["roomy"], world["tight"]
    status, evidence, _ = grade("moe_dropped", plan=plan, run=roomy)
    assert status == WARN and "0.00% of token slots dropped" in evidence and "CPU backend" in evidence
    assert grade("moe_dropped", plan=plan, run=on_gpu(roomy))[0] == PASS
    status, evidence, action = grade("moe_dropped", plan=plan, run=on_gpu(tight))
    assert status == FAIL and f"{tight.router_dropped_mean:.2%}" in evidence and "capacity_factor" in action
    assert grade("moe_dropped", plan=plan)[0] == NOT_CHECKED
    dropless = dataclasses.replace(plan, model={})
    assert grade("moe_dropped", plan=dropless)[0] == NA
    assert grade("moe_dropped", plan=dataclasses.replace(plan, workload="transformer"))[0] == NA


def test_a_dense_loop_over_the_experts_is_told_from_grouped_products_by_the_compiled_step(world):
    """The CPU compiler lowers the dropless path's ragged_dot as a loop over the experts, each multiplying every
    routed slot: its compiled products are what a loop costs (1 + the routed share x (n_experts - 1)), exactly;
    the capacity path's are what grouped products and the one-hot dispatch cost. Measured on the CPU, each warns
    (another compiler than the target's), saying which it saw."""
    from migration.grading.moe import moe_product_ratios
    from workloads import WORKLOADS

    plan, roomy = world["plan"], world["roomy"]
    ratio = roomy.compiled_matmul_flops / roomy.model_flops_per_device_step
    grouped, loop = moe_product_ratios(WORKLOADS["moe"].config("tiny", ROOMY), roomy.remat)
    assert abs(ratio - grouped) < 0.1 * grouped < abs(ratio - loop)
    status, evidence, _ = grade("moe_grouped_gemm", plan=plan, run=roomy)
    assert status == WARN and "dense loop" not in evidence.split(";")[-1] and f"{ratio:.2f}x" in evidence
    assert grade("moe_grouped_gemm", plan=plan, run=on_gpu(roomy))[0] == PASS
    dropless = run(RunConfig(workload="moe", preset="tiny", per_device_batch=2, steps=2, warmup_steps=0))
    assert dropless.ok, dropless.message
    loop = moe_product_ratios(WORKLOADS["moe"].config("tiny"), "none")[1]
    assert dropless.compiled_matmul_flops / dropless.model_flops_per_device_step == pytest.approx(loop, rel=0.02)
    dropless_plan = dataclasses.replace(plan, model={})
    status, evidence, _ = grade("moe_grouped_gemm", plan=dropless_plan, run=dropless)
    assert status == WARN and "this compiler made a dense loop" in evidence
    assert grade("moe_grouped_gemm", plan=dropless_plan, run=on_gpu(dropless))[0] == FAIL


def test_the_all_to_all_grades_from_the_layout_the_run_kept(world):
    plan, roomy = world["plan"], world["roomy"]
    status, evidence, _ = grade("moe_all_to_all", plan=plan, run=roomy)
    assert status == WARN and "fsdp+ep4" in evidence and "CPU backend" in evidence
    assert grade("moe_all_to_all", plan=plan, run=on_gpu(roomy))[0] == PASS
    assert grade("moe_all_to_all", plan=plan)[0] == NOT_CHECKED
    other = dataclasses.replace(on_gpu(roomy), sharding="fsdp")
    assert grade("moe_all_to_all", plan=plan, run=other)[0] == WARN
    wide = dataclasses.replace(plan, sharding="fsdp+ep16", gpus=32, nodes=4, gpus_per_node=8, domain_gpus=8)
    status, evidence, _ = grade("moe_all_to_all", plan=wide, run=on_gpu(roomy))
    assert status == WARN and "crosses the network" in evidence
    assert grade("moe_all_to_all", plan=dataclasses.replace(plan, sharding="fsdp"))[0] == NA


def test_a_dropless_expert_split_run_measures_the_busiest_gpus_share_and_grades_the_exchange_from_it(world):
    """The same plan's layout run dropless (slots sent by ragged all-to-all, in its gathered form on the CPU):
    nothing dropped, and the busiest GPU's share of the slots measured (tiny's 4 experts over 4 GPUs: one each,
    so the busiest GPU's share is the busiest expert's). The plan times the exchange at an even spread: a run
    whose busiest GPU held more than MOE_DEVICE_LOAD_BOUND of an even share warns; a capacity run does not
    (its buffers are fixed, the excess dropped)."""
    from migration.grading.moe import MOE_DEVICE_LOAD_BOUND

    plan, dropless, roomy = dataclasses.replace(world["plan"], model={}), world["dropless"], world["roomy"]
    assert dropless.router_dropped_mean == 0.0
    # one expert a GPU here, so the busiest GPU's share is the busiest expert's, a figure counted apart (the
    # bincount over experts) and checked by hand in tests/test_moe.py
    assert dropless.router_device_load_mean == pytest.approx(dropless.router_load_mean, rel=1e-5)
    assert dropless.router_device_load_max == pytest.approx(dropless.router_load_max, rel=1e-5)
    spread = dropless.router_device_load_mean
    status, evidence, _ = grade("moe_all_to_all", plan=plan, run=on_gpu(dropless))
    assert status == (PASS if spread <= MOE_DEVICE_LOAD_BOUND else WARN)
    assert f"the busiest GPU held {spread:.2f}x an even share" in evidence and "even spread" in evidence
    skewed = dataclasses.replace(on_gpu(dropless), router_device_load_mean=1.6, router_device_load_max=2.0)
    status, evidence, action = grade("moe_all_to_all", plan=plan, run=skewed)
    assert status == WARN and "1.60x" in evidence and "aux_loss" in action
    capacity_skewed = dataclasses.replace(on_gpu(roomy), router_device_load_mean=1.6, router_device_load_max=2.0)
    status, evidence, _ = grade("moe_all_to_all", plan=world["plan"], run=capacity_skewed)
    assert status == PASS and "fixed-size buffers" in evidence
    assert roomy.router_device_load_mean == pytest.approx(roomy.router_load_mean, rel=1e-5)
