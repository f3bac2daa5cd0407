"""The planner's choices that follow from the target's compute capability and the precision, against the
datasheet: which fp8 recipe a target may take (per-tensor fp8 from 8.9, block-scaled MXFP8 from 10.0),
where cuDNN's fused attention is planned (8.0 and up, bf16 / fp16 / fp8, head size a multiple of 8 up to
128), what fp8 asked for by name is refused on, and which peak a plan's MFU is taken against (fp32
products as TF32 from 8.0). Each case sits on both sides of its boundary. No compile runs here."""

import dataclasses

import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest, check_fp8_target
from migration.hardware import GPU_SPECS
from migration.planning.memory import resolve_target
from migration.planning.capability import fp8_recipe, planned_model


def target(key: str, **model):
    return resolve_target(PlanRequest(workload="transformer", preset="tiny", model=model, target=key, gpus=1,
                                      compile_for_tpu=False))


def request(key: str, **model) -> PlanRequest:
    return PlanRequest(workload="transformer", preset="tiny", model=model, target=key, gpus=1, compile_for_tpu=False)


@pytest.mark.parametrize("key, cc, recipe", [
    ("v100-32gb", (7, 0), None), ("t4", (7, 5), None), ("a100-80gb", (8, 0), None), ("a10", (8, 6), None),
    ("l4", (8, 9), "fp8"), ("l40s", (8, 9), "fp8"), ("h100-sxm", (9, 0), "fp8"), ("h200", (9, 0), "fp8"),
    ("b200", (10, 0), "mxfp8"), ("gb200", (10, 0), "mxfp8"), ("b300", (10, 3), "mxfp8"),
    ("rtx-pro-6000", (12, 0), "mxfp8"),
])
def test_the_fp8_recipe_follows_the_compute_capability(key, cc, recipe):
    """fp8 tensor cores arrive with Ada (8.9) and Hopper (9.0), per-tensor scaled; Blackwell (10.x, 12.0)
    adds block-scaled MXFP8. Below 8.9 (Ampere 8.0 / 8.6, Turing 7.5, Volta 7.0) there is none."""
    t = target(key)
    assert t.compute_capability == cc == GPU_SPECS[key].compute_capability
    chosen, why = fp8_recipe(t)
    assert chosen == recipe
    assert f"compute capability {cc[0]}.{cc[1]}" in why
    assert ("no fp8 tensor cores" in why) == (recipe is None)


def test_a_cpu_backend_plan_takes_no_fp8():
    t = dataclasses.replace(target("h100-sxm"), platform="cpu", compute_capability=None)
    assert fp8_recipe(t) == (None, "allowed, but this plan is for the CPU backend, which has no fp8 units")
    t = dataclasses.replace(target("h100-sxm"), compute_capability=None)  # a GPU whose capability is unknown
    assert fp8_recipe(t)[0] is None


@pytest.mark.parametrize("precision, key, refused_with", [
    ("fp8", "a100-80gb", "use bf16"),  # 8.0: no fp8 units, bf16 is there
    ("fp8", "v100-32gb", "use fp16"),  # 7.0: no bf16 either
    ("fp8", "l4", None), ("fp8", "h100-sxm", None), ("fp8", "b200", None),
    ("mxfp8", "h100-sxm", "use fp8 or bf16"),  # 9.0: per-tensor fp8, not block-scaled
    ("mxfp8", "l40s", "use fp8 or bf16"),
    ("mxfp8", "a10", "use bf16"),
    ("mxfp8", "b200", None), ("mxfp8", "gb300", None),
    ("bf16", "v100-32gb", None),  # not an fp8 precision: not this check's to refuse
])
def test_fp8_asked_for_by_name_is_refused_below_its_capability(precision, key, refused_with):
    spec = GPU_SPECS[key]
    if refused_with is None:
        check_fp8_target(precision, spec)
        return
    with pytest.raises(ConfigError) as err:
        check_fp8_target(precision, spec)
    cc = spec.compute_capability
    assert f"{spec.name} has compute capability {cc[0]}.{cc[1]}: {refused_with}" in str(err.value)
    assert ("10.0+" in str(err.value)) == (precision == "mxfp8")


def test_a_device_without_a_capability_is_refused_fp8_with_what_it_is():
    with pytest.raises(ConfigError, match="no compute capability .not an NVIDIA GPU.: use bf16 or fp32"):
        check_fp8_target("fp8", None, "this machine: cpu", None)


@pytest.mark.parametrize("key, precision, fused", [
    ("a100-80gb", "bf16", True), ("a100-80gb", "fp16", True),  # 8.0 is the first capability with it
    ("a10", "bf16", True), ("h100-sxm", "fp8", True), ("b200", "mxfp8", True),
    ("t4", "fp16", False), ("v100-32gb", "fp16", False),  # 7.5 and 7.0: none
    ("h100-sxm", "fp32", False), ("a100-80gb", "fp32", False),  # fp32 compute: none on any GPU
])
def test_cudnn_attention_is_planned_from_capability_8_0_in_half_or_fp8(key, precision, fused):
    model, decision = planned_model(request(key), target(key), precision)
    assert decision.value == ("cudnn" if fused else "xla")
    assert model.get("attention") == ("cudnn" if fused else "xla")
    if fused and precision in ("fp8", "mxfp8"):
        assert "in bf16 with head size 16" in decision.reason  # attention itself runs in bf16 under an fp8 plan


@pytest.mark.parametrize("d_model, head_dim, fused", [
    (64, 16, True), (512, 128, True),  # 4 heads: 16 and 128 (the largest cuDNN takes) are fused
    (544, 136, False),  # a multiple of 8 beyond 128
    (60, 15, False),  # not a multiple of 8
])
def test_cudnn_attention_needs_a_head_size_that_is_a_multiple_of_8_up_to_128(d_model, head_dim, fused):
    model, decision = planned_model(request("h100-sxm", d_model=d_model), target("h100-sxm", d_model=d_model),
                                    "bf16")
    assert d_model // 4 == head_dim
    assert decision.value == ("cudnn" if fused else "xla")


def test_the_users_attention_override_is_kept_and_said():
    model, decision = planned_model(request("a100-80gb", attention="xla"), target("a100-80gb", attention="xla"),
                                    "bf16")
    assert model["attention"] == "xla" and decision.value == "xla"
    assert decision.reason.startswith("override") and "cuDNN's fused kernel would run here" in decision.reason
    model, decision = planned_model(request("t4", attention="xla"), target("t4", attention="xla"), "fp16")
    assert "would run here" not in decision.reason


@pytest.mark.parametrize("key, precision, tflops", [
    ("a100-80gb", "bf16", 312), ("a100-80gb", "fp16", 312),
    ("a100-80gb", "fp32", 156),  # 8.0: XLA runs fp32 products as TF32 by default
    ("v100-32gb", "fp32", 15.7),  # 7.0: no TF32, plain fp32
    ("v100-32gb", "bf16", None),  # no bf16 tensor cores: no peak to take MFU against
    ("h100-sxm", "fp8", 1979), ("h100-sxm", "fp32", 494.7),
    ("b200", "mxfp8", 4500), ("b200", "fp32", 1100),
])
def test_a_plans_peak_is_the_datasheets_for_the_unit_its_products_run_in(key, precision, tflops):
    peak = target(key).peak_flops(precision)
    assert peak == (None if tflops is None else pytest.approx(tflops * 1e12))


FUSED = ("{gpu} runs cuDNN's fused attention (jax.nn.dot_product_attention, implementation='cudnn') in {dtype} with "
         "head size 16: memory linear in the sequence (64), the scores are never stored. Planned without the GPU, the "
         "compile keeps cuDNN's call and its workspace in the peak; the kernel itself is chosen when the step first "
         "runs on the GPU")
UNFUSED = ("jax.nn.dot_product_attention with XLA's implementation, which stores the T x T scores per head: cuDNN's "
           "fused kernel needs an NVIDIA GPU of compute capability 8.0+, bf16 or fp16 compute and a head size that is "
           "a multiple of 8 up to 128 (here: {gpu}, {dtype}, head size 16)")
SPLASH = "your TPU code runs Pallas' splash attention (the TPU's fused kernel); on the GPU: "


@pytest.mark.parametrize("key, precision, model, value, reason", [
    ("h100-sxm", "bf16", {}, "cudnn", FUSED.format(gpu="H100 SXM5 80GB", dtype="bf16")),
    ("a100-80gb", "fp16", {}, "cudnn", FUSED.format(gpu="A100 SXM4 80GB", dtype="fp16")),
    ("h100-sxm", "fp8", {}, "cudnn", FUSED.format(gpu="H100 SXM5 80GB", dtype="bf16")),  # attention stays bf16
    ("v100-32gb", "fp16", {}, "xla", UNFUSED.format(gpu="V100 SXM2 32GB", dtype="fp16")),
    ("a100-80gb", "bf16", {"attention": "xla"}, "xla",
     "override: the attention your code runs: XLA's implementation, which stores the T x T scores per head; the plan "
     "compiles and times the step with it (cuDNN's fused kernel would run here: see the attention_saving decision)"),
    ("t4", "fp16", {"attention": "xla"}, "xla",
     "override: the attention your code runs: XLA's implementation, which stores the T x T scores per head; the plan "
     "compiles and times the step with it"),
    ("h100-sxm", "bf16", {"attention": "splash"}, "cudnn", SPLASH + FUSED.format(gpu="H100 SXM5 80GB", dtype="bf16")),
    ("v100-32gb", "fp16", {"attention": "splash"}, "xla", SPLASH + UNFUSED.format(gpu="V100 SXM2 32GB", dtype="fp16")),
])
def test_the_attention_decision_says_what_runs_and_why(key, precision, model, value, reason):
    """The decision the plan shows, word for word: the kernel, the dtype it runs in, what it needs. The TPU's
    splash kernel (Pallas) becomes its GPU counterpart where the GPU allows, XLA's attention elsewhere."""
    planned, decision = planned_model(request(key, **model), target(key, **model), precision)
    assert (decision.decision, decision.value, decision.reason) == ("attention", value, reason)
    assert planned == {"attention": value}  # the TPU kernel's name never reaches the GPU compile


def test_a_model_without_an_attention_choice_is_planned_as_asked():
    req = PlanRequest(workload="mlp", preset="tiny", target="h100-sxm", gpus=1, compile_for_tpu=False)
    planned, decision = planned_model(req, target("h100-sxm"), "bf16")
    assert planned == {} and decision is None and planned is not req.model


@pytest.mark.parametrize("precision, key, words", [
    ("fp8", "a100-80gb", "fp8 needs fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell); "
                         "A100 SXM4 80GB has compute capability 8.0: use bf16"),
    ("mxfp8", "h100-sxm", "mxfp8 needs Blackwell's block-scaled fp8 tensor cores (compute capability 10.0+); "
                          "H100 SXM5 80GB has compute capability 9.0: use fp8 or bf16"),
])
def test_an_fp8_refusal_names_the_field_the_need_and_the_way_out(precision, key, words):
    with pytest.raises(ConfigError) as err:
        check_fp8_target(precision, GPU_SPECS[key])
    assert err.value.field == "precision" and str(err.value).endswith(words)
