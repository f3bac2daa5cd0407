"""The TPU job a plan starts from, by hand: how it held its state (replicated while 16 bytes per parameter fit
90% of a device's HBM), which attention it ran (Pallas' splash kernel on whole 128-token blocks and heads of
a multiple of 128), its layout over several slices, the links its collectives cross, and the method line its
step time carries. No compile runs here (tests/test_tpu_source.py compiles with libtpu)."""

import pytest

from migration.config.requests import PlanRequest
from migration.hardware import TPU_SPECS, Links
from migration.planning import steptime
from migration.config.limits import state_bytes_per_param
from migration.planning.source import source_layout, source_sharding, tpu_links, tpu_model, tpu_step_method


def request(source: str = "tpu-v5e-8", **kw) -> PlanRequest:
    return PlanRequest(workload="transformer", preset="tiny", target="h100-sxm", gpus=8, source=source,
                       compile_for_tpu=False, **kw)


@pytest.mark.parametrize("source, edge", [
    # v5e: 16 GB per chip (one device each); 0.9 x 16e9 / 16 = 900,000,000 parameters
    ("tpu-v5e-8", 900_000_000),
    # v5p: 95 GiB per chip, one device (megacore); 0.9 x 102,005,473,280 / 16 = 5,737,807,872 parameters
    ("tpu-v5p-8", 5_737_807_872),
    # TPU7x: 192 GiB per chip, two devices: 96 GiB each; 0.9 x 96 x 2**30 / 16 = 5,798,205,849.6 -> 5,798,205,849
    ("tpu7x-8", 5_798_205_849),
])
def test_a_job_is_replicated_while_its_state_fits_ninety_percent_of_a_device(source, edge):
    assert state_bytes_per_param() == 16  # fp32 weights, gradients and two Adam moments
    assert source_sharding(request(source), edge) == "replicated"
    assert source_sharding(request(source), edge + 1) == "fsdp"


def test_a_stated_sharding_is_taken_as_given():
    assert source_sharding(request(source_sharding="fsdp"), 1_000) == "fsdp"
    assert source_sharding(request(source_sharding="replicated"), 10**12) == "replicated"


@pytest.mark.parametrize("model, attention", [
    ({"seq_len": 256, "d_model": 512, "n_heads": 4, "n_kv_heads": 4}, "splash"),  # 2 blocks of 128, heads of 128
    ({"seq_len": 384, "d_model": 1024, "n_heads": 4, "n_kv_heads": 4}, "splash"),  # heads of 256
    ({"seq_len": 255, "d_model": 512, "n_heads": 4, "n_kv_heads": 4}, "xla"),  # a partial block
    ({"seq_len": 256, "d_model": 512, "n_heads": 8, "n_kv_heads": 8}, "splash"),  # heads of 64: their whole width
    ({"seq_len": 256, "d_model": 512, "n_heads": 4, "n_kv_heads": 4, "attention": "xla"}, "xla"),  # the user's
    ({"seq_len": 256, "d_model": 512, "n_heads": 4, "n_kv_heads": 4, "attention": "cudnn"}, "splash"),  # a GPU's
])
def test_the_tpu_side_runs_splash_attention_where_the_shapes_suit_it(model, attention):
    got = tpu_model(request(model=model))
    assert got == {**{k: v for k, v in model.items() if k != "attention"}, "attention": attention}


def test_a_model_without_attention_is_unchanged():
    req = PlanRequest(workload="mlp", preset="tiny", target="h100-sxm", gpus=1, compile_for_tpu=False)
    assert tpu_model(req) == {}  # the MLP family has no attention (and no free dimensions)


def test_fsdp_over_several_slices_is_fsdp_inside_each_and_data_parallel_across():
    v5p = TPU_SPECS["tpu-v5p-512"]  # 256 chips, one device each
    assert v5p.devices == 256
    assert source_layout("fsdp", v5p, 2) == "hybrid:256"
    assert source_layout("fsdp", v5p, 1) == "fsdp"
    assert source_layout("replicated", v5p, 2) == "replicated"


def test_the_links_are_the_inter_chip_ones_and_between_slices_the_data_centre_network():
    v5e = TPU_SPECS["tpu-v5e-256"]
    # 400 GB/s bidirectional per chip -> 200e9 one way; DCN: 2 x 100 Gb/s per 8 chips = 3.125e9 B/s per chip
    assert tpu_links(v5e, 1) == 200e9
    assert tpu_links(v5e, 4) == Links(200e9, 3.125e9)
    ironwood = TPU_SPECS["tpu7x-256"]  # two devices per chip share its links
    assert tpu_links(ironwood, 1) == 1200e9 / 2 / 2
    assert tpu_links(ironwood, 2) == Links(300e9, 100e9 / 8 / 2)


STEP = steptime.StepPrediction(seconds=0.5, compute_s=0.4, matmul_s=0.3, memory_s=0.1, communication_s=0.2,
                               exposed_communication_s=0.1, flops=1.234e14, kernels=1234)


def test_the_tpu_method_line_states_the_calibration_the_links_and_the_expected_error():
    text = tpu_step_method(STEP, TPU_SPECS["tpu-v5e-8"])
    assert text == ("from the compiled TPU program: 1,234 kernels, 123 TFLOP per device, each at the longer of its "
                    "FLOPs at 90% of TPU v5e's bf16 peak and its HBM bytes at 90% of the bandwidth; collectives "
                    "200 ms over 400 GB/s of inter-chip links per device (100 ms not hidden); expected error about "
                    "±25% (bench/published_check.py --tpu)")


def test_the_method_line_over_several_slices_names_the_data_centre_network_or_says_it_is_not_timed():
    text = tpu_step_method(STEP, TPU_SPECS["tpu-v5e-8"], slices=2)
    assert "over 400 GB/s of inter-chip links per device and, between the 2 slices, 25 Gb/s of data-centre " \
           "network per chip (100 ms not hidden)" in text  # 3.125e9 B/s x 8 = 25 Gb/s
    text = tpu_step_method(STEP, TPU_SPECS["tpu-v5p-8"], slices=3)
    assert ", between the 3 slices, 50 Gb/s of data-centre network per chip" in text
    assert TPU_SPECS["tpu-v4-8"].dcn_bytes_per_s is None  # the v4 page states none
    assert TPU_SPECS["tpu-v4-8"].ici_bytes_per_s is None
    assert "; collectives not timed (no inter-chip bandwidth stated for this chip); expected error" in tpu_step_method(
        STEP, TPU_SPECS["tpu-v4-8"])
    assert "; expected error about ±25%" in tpu_step_method(STEP, TPU_SPECS["tpu-v4-8"], slices=2)
