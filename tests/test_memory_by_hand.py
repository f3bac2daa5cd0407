"""The analytic memory estimate and the lower bound that rules candidates out before a compile, against
values worked out by hand for the tiny transformer (each docstring shows the arithmetic). The model's own
figures (parameters, activations per example) are the inputs, read from the workload and pinned first."""

import pytest

from migration.config.requests import PlanRequest
from migration.planning.memory import MUST_KEEP, STATE_BYTES_PER_PARAM, MemoryPredictor
from workloads import get_workload

P = 120_576  # the tiny transformer's parameters; the planner's per-block figure is P over its 2 blocks, 60,288
PER_BLOCK, BLOCK_INPUT, BLOCKS, HEAD_FP32 = 106_496, 4_096, 2, 24_576  # activation elements per example
NAMED = {"query_proj": 4096, "kv_proj": 8192, "attention_out": 4096, "attention_proj": 4096, "mlp_hidden": 16384,
         "mlp_out": 4096}


def predictor(gpus: int = 1) -> MemoryPredictor:
    req = PlanRequest(workload="transformer", preset="tiny", target="h100-sxm", gpus=gpus, compile_for_tpu=False)
    return MemoryPredictor(req, lambda *a, **k: None, estimate_because="worked by hand", workers=0)


def test_the_inputs_are_the_tiny_transformers():
    w = get_workload("transformer")
    cfg = w.config("tiny", {})
    prof = w.activation_profile(cfg)
    assert w.param_count(cfg) == P and STATE_BYTES_PER_PARAM == 16
    assert (prof.per_block, prof.block_input, prof.n_blocks, prof.head_fp32, prof.named) == (
        PER_BLOCK, BLOCK_INPUT, BLOCKS, HEAD_FP32, NAMED)


@pytest.mark.parametrize("precision, elem", [("bf16", 2), ("fp16", 2), ("fp32", 4)])
def test_without_remat_every_blocks_activations_are_kept_in_the_compute_dtype(precision, elem):
    """16 B x 120,576 = 1,929,216 B of float32 state (parameters, gradients, two AdamW moments); per example
    2 blocks x 106,496 elements x 2 B (bf16; 4 B in fp32) + the head's 24,576 fp32 logits x 4 B; batch 4:
    bf16 1,929,216 + 4 x (425,984 + 98,304) = 4,026,368."""
    expected = 16 * P + 4 * (BLOCKS * PER_BLOCK * elem + HEAD_FP32 * 4)
    assert predictor().estimate(precision, "none", 4) == expected
    if precision == "bf16":
        assert expected == 4_026_368


def test_accumulating_gradients_adds_a_float32_accumulator():
    """Accumulation > 1 keeps a 4 B per parameter gradient sum: + 482,304 B."""
    p = predictor()
    assert p.estimate("bf16", "none", 4, accum=2) - p.estimate("bf16", "none", 4, accum=1) == 4 * P


@pytest.mark.parametrize("remat, kept", [
    ("dots", 0.6 * BLOCKS * PER_BLOCK),
    ("dots_no_batch", 0.45 * BLOCKS * PER_BLOCK),
    ("full", BLOCKS * BLOCK_INPUT + PER_BLOCK),  # each block's input, and one block recomputed at a time
    ("save_qkv", BLOCKS * (BLOCK_INPUT + 4096 + 8192) + PER_BLOCK),  # + the names the policy saves
    ("offload_dot_except_mlp", BLOCKS * BLOCK_INPUT + PER_BLOCK),  # offloaded names leave the device
])
def test_each_remat_policy_keeps_what_it_saves(remat, kept):
    assert predictor().estimate("bf16", remat, 8) == int(16 * P + 8 * (kept * 2 + HEAD_FP32 * 4))


def test_fsdp_shards_the_state_and_gathers_weights_in_the_compute_dtype():
    """8 GPUs under FSDP: state 16 x 120,576 / 8 = 241,152 B; without remat every block's gathered weights
    stay live for the backward pass, in bf16: 2 B x 2 x 60,288 = 241,152 B; with full remat two blocks
    (the one computing and the next arriving), here the same 2; in fp32 4 B each."""
    p = predictor(gpus=8)
    activations = 4 * (BLOCKS * PER_BLOCK * 2 + HEAD_FP32 * 4)
    assert p.gathered_weights("bf16", "none", "fsdp") == 2 * 2 * 60_288
    assert p.gathered_weights("fp32", "none", "fsdp") == 4 * 2 * 60_288
    assert p.estimate("bf16", "none", 4, sharding="fsdp") == 16 * P // 8 + activations + 2 * 2 * 60_288
    assert p.gathered_weights("bf16", "none", "replicated") == 0
    assert p.estimate_memory("bf16", "none", 4, 1, "fsdp")["state_bytes"] == 12 * P // 8


@pytest.mark.parametrize("remat", ["none", "dots", "full", "save_qkv"])
def test_the_lower_bound_is_twelve_bytes_per_parameter_and_the_activations_the_policy_must_keep(remat):
    """12 B per parameter (float32 parameters and two moments; gradients may go straight into the update):
    1,446,912 B; per example each block's input and the names the policy cannot recompute, e.g. none:
    2 x (4,096 + 4,096 + 8,192 + 4,096 + 16,384) = 73,728 elements x 2 B; batch 16: 1,446,912 + 2,359,296."""
    must = sum(NAMED[n] for n in MUST_KEEP.get(remat, ()))
    expected = 12 * P + 16 * BLOCKS * (BLOCK_INPUT + must) * 2
    assert predictor().lower_bound("bf16", remat, 16) == expected
    if remat == "none":
        assert expected == 1_446_912 + 2_359_296
    # the bound never exceeds the estimate it rules candidates out for
    assert expected <= predictor().estimate("bf16", remat, 16)


def test_the_lower_bound_shares_the_state_under_fsdp_and_doubles_activations_in_fp32():
    p = predictor(gpus=4)
    assert p.lower_bound("bf16", "full", 2, sharding="fsdp") == 12 * P // 4 + 2 * BLOCKS * BLOCK_INPUT * 2
    assert p.lower_bound("fp32", "full", 2) == 12 * P + 2 * BLOCKS * BLOCK_INPUT * 4
