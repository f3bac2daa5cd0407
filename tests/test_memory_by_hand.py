"""The analytic memory estimate and the lower bound that rules candidates out before a compile, against
values worked out by hand for the tiny transformer (each docstring shows the arithmetic). The model's own
figures (parameters, activations per example) are the inputs, read from the workload and pinned first."""

import dataclasses

import pytest

from migration.config.requests import PlanRequest
from migration.config.limits import state_bytes_per_param
from migration.planning.memory import MUST_KEEP, MemoryPredictor
from workloads import WORKLOADS, get_workload

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
    assert w.param_count(cfg) == P and state_bytes_per_param() == 16
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


def deeper(layers: int, gpus: int) -> MemoryPredictor:
    req = PlanRequest(workload="transformer", preset="tiny", model={"n_layers": layers}, target="h100-sxm", gpus=gpus,
                      compile_for_tpu=False)
    return MemoryPredictor(req, lambda *a, **k: None, estimate_because="worked by hand", workers=0)


def test_fsdp_gathers_every_block_without_remat_and_two_at_a_time_with_it():
    """The tiny transformer with 4 layers: 220,544 parameters, 55,136 a block. Under FSDP without remat all 4
    blocks' gathered bf16 copies stay live: 2 B x 4 x 55,136 = 441,088 B (over 2 GPUs as over 8: the gathered
    copy is whole); with remat 2 of them: 220,544 B. A tensor-parallel split of 2 halves each copy. Nothing is
    gathered where the state is whole on each GPU: replicated (with or without a tensor split) or FSDP on 1."""
    assert get_workload("transformer").param_count(get_workload("transformer").config("tiny", {"n_layers": 4})) == 220_544
    eight = deeper(4, 8)
    assert eight.gathered_weights("bf16", "none", "fsdp") == 441_088
    assert deeper(4, 2).gathered_weights("bf16", "none", "fsdp") == 441_088
    assert eight.gathered_weights("bf16", "full", "fsdp") == eight.gathered_weights("bf16", "dots", "fsdp") == 220_544
    assert eight.gathered_weights("fp32", "full", "fsdp") == 441_088  # 4 B
    assert eight.gathered_weights("bf16", "none", "fsdp+tp2") == 220_544
    assert eight.gathered_weights("bf16", "none", "replicated+tp2") == 0
    assert deeper(4, 1).gathered_weights("bf16", "none", "fsdp") == 0
    # the estimate adds them: state 16 x 220,544 / 8 = 441,088; batch 1 of 4 blocks x 106,496 x 2 B +
    # 24,576 x 4 B = 950,272; and 441,088 gathered
    assert eight.estimate("bf16", "none", 1, sharding="fsdp") == 441_088 + 950_272 + 441_088


def test_parameters_outside_whole_blocks_are_gathered_whole():
    """3 layers: 170,560 parameters over 3 blocks is 56,853 a block and 1 left outside them. With remat, 2
    blocks and the one outside: 2 B x (2 x 56,853 + 1) = 227,414 B; without, all: 2 x 170,560 = 341,120 B."""
    p = deeper(3, 8)
    assert p.gathered_weights("bf16", "full", "fsdp") == 227_414
    assert p.gathered_weights("bf16", "none", "fsdp") == 341_120


def test_the_estimate_record_in_fp32_under_fsdp():
    """8 GPUs, fp32, no remat, batch 4: state 16 x 120,576 / 8 = 241,152; activations 4 x (2 x 106,496 x 4 B
    + 24,576 x 4 B) = 3,801,088; gathered 4 B x 120,576 = 482,304: 4,524,544 B. The state the record
    reports is the 12 B a parameter the lower bound counts, shared: 180,864."""
    assert predictor(8).estimate_memory("fp32", "none", 4, 1, "fsdp") == {"peak_bytes": 4_524_544,
                                                                          "state_bytes": 180_864}


def test_a_model_without_named_activations_keeps_each_blocks_input():
    """The tiny MLP (101,770 parameters, one block of 256 activations, input 128, 814 fp32 logits) names
    none: a named policy saves nothing more than full remat, batch 4 in bf16: 16 x 101,770 + 4 x ((128 +
    256) x 2 + 814 x 4) = 1,628,320 + 16,096 = 1,644,416; the bound: 12 x 101,770 + 4 x 128 x 2 = 1,222,264."""
    req = PlanRequest(workload="mlp", preset="tiny", target="h100-sxm", gpus=1, compile_for_tpu=False)
    p = MemoryPredictor(req, lambda *a, **k: None, estimate_because="worked by hand", workers=0)
    assert p.estimate("bf16", "save_qkv", 4) == p.estimate("bf16", "full", 4) == 1_644_416
    assert p.lower_bound("bf16", "none", 4) == 1_222_264


def test_a_registered_model_naming_some_activations_counts_only_those(monkeypatch):
    """A team's decoder that tags only its query projection (4,096 elements a block): save_qkv keeps each of
    the 2 blocks' input and that, and one block recomputed: batch 2 in bf16, 16 x 120,576 + 2 x ((2 x (4,096
    + 4,096) + 106,496) x 2 B + 24,576 x 4 B) = 1,929,216 + 688,128 = 2,617,344; the bound keeps the same
    names per block: 12 x 120,576 + 2 x 2 x 8,192 x 2 B = 1,512,448."""
    base = type(get_workload("transformer"))

    class OnlyQueryNamed(base):
        name = "only-query-named"

        def activation_profile(self, cfg):
            prof = super().activation_profile(cfg)
            return dataclasses.replace(prof, named={"query_proj": prof.named["query_proj"]})

    monkeypatch.setitem(WORKLOADS, OnlyQueryNamed.name, OnlyQueryNamed())
    req = PlanRequest(workload=OnlyQueryNamed.name, preset="tiny", target="h100-sxm", gpus=1, compile_for_tpu=False)
    p = MemoryPredictor(req, lambda *a, **k: None, estimate_because="worked by hand", workers=0)
    assert p.estimate("bf16", "save_qkv", 2) == 2_617_344
    assert p.lower_bound("bf16", "save_qkv", 2) == 1_512_448
