"""fp8 training: the per-tensor recipe's products and gradients against exact ones, the real train step
compiled without the device for Hopper (fp8 GEMMs on e4m3 and e5m2 operands) and Blackwell (cuDNN's
block-scaled GEMM), the program reader timing them on the fp8 peak, refusals where a GPU has no fp8 units,
and a CPU run (emulated, labelled) that trains."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
from migration.hardware import GPU_SPECS
from migration.planning.hlo_cost import read_program
from migration.planning.memory import compile_memory, deviceless_devices
from migration.planning.steptime import CALIBRATION, predict
from migration.step.fp8 import apply_fp8, block_scaled_dot_general, tensor_scaled_dot_general
from migration.step.train import TrainProgram, make_mesh

DN = (((2,), (0,)), ((), ()))


def exact(x, w):
    return jax.lax.dot_general(x, w, DN, preferred_element_type=jnp.float32)


def test_the_per_tensor_recipe_follows_the_exact_product_and_its_gradients():
    x = jax.random.normal(jax.random.key(0), (4, 16, 128), jnp.bfloat16)
    w = (0.02 * jax.random.normal(jax.random.key(1), (128, 96))).astype(jnp.bfloat16)
    y = tensor_scaled_dot_general(x, w, DN)
    assert y.dtype == jnp.bfloat16
    rel = lambda a, b: float(jnp.abs(a.astype(jnp.float32) - b).max() / jnp.abs(b).max())
    assert 0 < rel(y, exact(x, w)) < 0.1  # e4m3 keeps 3 mantissa bits: a few per cent, never exact
    loss = lambda f: lambda x, w: (f(x, w, DN).astype(jnp.float32) ** 2).sum()
    got = jax.grad(loss(tensor_scaled_dot_general), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda a, b, d: exact(a, b)), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        assert g.dtype == jnp.bfloat16 and g.shape == r.shape and rel(g, r) < 0.15  # e5m2 gradients: 2 bits
    zero = tensor_scaled_dot_general(jnp.zeros_like(x), w, DN)
    assert bool(jnp.all(zero == 0))  # an all-zero operand scales by 1, no 0/0


def _compiled_step(target: str, precision: str):
    program = TrainProgram.from_config(RunConfig(workload="llama", preset="tiny", per_device_batch=8, devices=1,
                                                 precision=precision, remat="none",
                                                 model={"attention": "cudnn", "d_model": 128, "n_heads": 4,
                                                        "n_kv_heads": 4, "d_ff": 256}))
    mesh = make_mesh(deviceless_devices(GPU_SPECS[target], 1, 1), "replicated")
    from migration.step.train import abstract_batch, abstract_state, jit_step

    text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile().as_text()
    return text, compile_memory(program, mesh, kernels=True)


def test_an_h100_step_in_fp8_runs_its_linear_products_on_fp8_operands_and_is_timed_on_the_fp8_peak():
    text, found = _compiled_step("h100-sxm", "fp8")
    assert "f8e4m3fn" in text and "f8e5m2" in text  # forward operands e4m3, gradients e5m2
    kernels = read_program(text)
    fp8 = sum(k.flops for k in kernels if k.unit == "fp8")
    bf16 = sum(k.flops for k in kernels if k.unit == "bf16")
    assert fp8 > bf16 > 0  # the Linear products in fp8; attention and the embedding's products stay bf16
    spec = GPU_SPECS["h100-sxm"]
    products = [dataclasses.replace(k, bytes=0.0) for k in kernels if k.unit == "fp8"]
    as_bf16 = [dataclasses.replace(k, unit="bf16") for k in products]
    cal = dataclasses.replace(CALIBRATION, launch_s=0.0)
    assert predict(products, spec, None, cal).matmul_s == pytest.approx(
        predict(as_bf16, spec, None, cal).matmul_s / 2, rel=0.01)  # the same FLOPs at twice the peak


def test_a_b200_step_in_mxfp8_runs_cudnns_block_scaled_gemm_and_it_is_counted():
    text, _ = _compiled_step("b200", "mxfp8")
    assert "__cudnn$blockScaledDot" in text and "f8e8m0fnu" in text
    scaled = [k for k in read_program(text) if k.unit == "fp8" and k.kind == "matmul"]
    assert scaled and all(k.flops > 0 for k in scaled)


def test_the_recipe_reaches_every_linear_of_a_model():
    program = TrainProgram.from_config(RunConfig(workload="llama", preset="tiny", precision="fp8"))
    model = program.workload.build(program.model_cfg, dtype=jnp.bfloat16, block_wrap=lambda f: f,
                                   rngs=__import__("flax").nnx.Rngs(0))
    assert apply_fp8(model, "fp8") >= 4  # attention's projections, the MLP's, the head
    assert block_scaled_dot_general is not tensor_scaled_dot_general


@pytest.mark.parametrize("target,precision,words", [
    ("a100-80gb", "fp8", "fp8 needs fp8 tensor cores (compute capability 8.9+"),
    ("v100-32gb", "fp8", "V100 SXM2 32GB has compute capability 7.0: use fp16"),
    ("h100-sxm", "mxfp8", "mxfp8 needs Blackwell's block-scaled fp8 tensor cores"),
    ("l4", "mxfp8", "use fp8 or bf16"),
])
def test_fp8_on_a_gpu_without_its_units_is_refused_naming_the_precision_and_the_target(target, precision, words):
    with pytest.raises(ConfigError) as info:
        validate_plan_request(PlanRequest(workload="llama", target=target, precision=precision))
    assert info.value.field == "precision" and words in str(info.value)
    assert GPU_SPECS[target].name in str(info.value)


def test_fp8_is_allowed_where_the_units_exist_and_mxfp8_is_not_run_on_the_cpu():
    for target, precision in [("l4", "fp8"), ("h100-sxm", "fp8"), ("b200", "mxfp8"), ("gb300", "fp8"),
                              ("rtx-pro-6000", "mxfp8")]:
        validate_plan_request(PlanRequest(workload="llama", target=target, precision=precision))
    validate_plan_request(PlanRequest(workload="llama", target="local", precision="fp8"))  # checked when planned
    with pytest.raises(ConfigError, match="Blackwell GPUs only"):
        validate(RunConfig(workload="llama", preset="tiny", precision="mxfp8", platform="cpu"))


def test_an_fp8_run_on_the_cpu_trains_and_says_it_is_emulated():
    from migration.running.measure import peak_flops_for

    program = TrainProgram.from_config(RunConfig(workload="mlp", preset="tiny", per_device_batch=32,
                                                 precision="fp8", learning_rate=3e-3))
    from migration.step.train import init_state_on, jit_step, make_data_mesh

    mesh = make_data_mesh(jax.devices()[:1])
    state = init_state_on(program, mesh)
    step = jit_step(program, mesh)
    losses = []
    for i in range(30):
        state, metrics = step(state, program.make_batch(0))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < 0.7 * losses[0]
    _, label = peak_flops_for("cpu", jax.devices()[0], "fp8", "fp32", 1)
    assert "emulated" in label


def _plan(**given):
    from migration.planning.planner import plan_migration

    req = validate_plan_request(PlanRequest(workload="llama", preset="tiny", compile_for_tpu=False, **given))
    return plan_migration(req, lambda *a, **k: None)


def test_allowed_fp8_is_taken_only_where_its_compiled_step_is_the_faster():
    """The planner compiles the chosen step in both precisions and keeps the faster, saying both figures:
    the estimate that picks the precision is the one the plan reports."""
    plan = _plan(target="h100-sxm", allow_fp8=True)
    fp8 = {d.decision: d for d in plan.decisions}["fp8"]
    steps = [float(x) for x in re.findall(r"in (?:fp8|bf16)[: ]+([0-9.]+) ms", fp8.reason)]
    assert len(steps) == 2, fp8.reason
    if fp8.value == "fp8":
        assert plan.precision == "fp8" and steps[0] <= steps[1]
    else:
        assert fp8.value == "not used" and plan.precision == "bf16" and steps[0] > steps[1] and "no faster" in fp8.reason
    assert "tensor cores" in fp8.reason


def test_allowed_fp8_on_a_gpu_without_its_units_keeps_bf16_and_says_why():
    plan = _plan(target="a100-80gb", allow_fp8=True)
    fp8 = {d.decision: d for d in plan.decisions}["fp8"]
    assert plan.precision == "bf16" and fp8.value == "not used" and "has no fp8 tensor cores" in fp8.reason
    assert "fp8" not in {d.decision for d in _plan(target="a100-80gb").decisions}  # not allowed: not mentioned


def test_an_fp8_run_is_graded_against_the_bf16_run_it_replaces_and_labelled_emulated_on_the_cpu(tmp_path):
    """Real CPU runs: the fp8 plan's runs with the fp32 reference asked for include a bf16 run of the same
    config; the numerics item compares the losses and, fp8 being emulated here, never passes on the CPU."""
    from migration.grading import checklist
    from migration.running.runner import run
    from migration.service.orchestrate import RunOptions, plan_runs

    plan = _plan(target="h100-sxm", precision="fp8", global_batch=32)
    cfg = RunConfig(workload="llama", preset="tiny", per_device_batch=32, precision="fp8", steps=8, warmup_steps=1,
                    platform="cpu", model={"attention": "xla"})
    runs = dict(plan_runs(plan, cfg, RunOptions(fp32_reference=True), tmp_path))
    assert runs["bf16 reference"].precision == "bf16" and runs["fp32 reference"].precision == "fp32"
    fp8, bf16 = run(runs["migrated"]), run(runs["bf16 reference"])
    assert fp8.ok and bf16.ok, (fp8.message, bf16.message)
    assert fp8.losses != bf16.losses  # the products really ran in fp8
    grade, text, _ = checklist.grade_numerics(checklist.Evidence(plan, fp8, bf16_reference=bf16))
    assert grade == checklist.WARN and "vs bf16" in text and "emulated on the CPU backend" in text
    grade, text, _ = checklist.grade_numerics(checklist.Evidence(plan, fp8))
    assert grade == checklist.NOT_CHECKED and "no bf16 run" in text
