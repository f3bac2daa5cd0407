"""A run's figures and the comparison's MFU against values worked out by hand (each docstring shows the
arithmetic): the timed window leaves the warm-up out, a step with gradient accumulation does the work of
every micro-batch (global batch = per-device batch x devices x accumulation), the peak MFU is taken
against is the datasheet's for the unit the products run in, times the devices, and a TPU or GPU side's
MFU is its model FLOPs over its step, chips and peak. The devices here are descriptions of GPUs (kind,
process, memory statistics), as a run reads them; no GPU is needed."""

import dataclasses

import pytest

from migration.config.requests import RunConfig
from migration.prices import Price
from migration.planning.compare import _side
from migration.running.measure import _figures, _Timed, device_memory_stats, peak_flops_for, percentile
from migration.step.train import TrainProgram

F = 50_331_648  # the tiny transformer's model FLOPs per example (workloads' own figure, pinned below)


@dataclasses.dataclass
class Gpu:
    """What a run reads of a device: its kind, its process, its allocator's statistics."""
    device_kind: str = "NVIDIA H100 80GB HBM3"
    process_index: int = 0
    stats: dict | None = None

    def memory_stats(self):
        return self.stats


def run_figures(accumulation: int, precision: str = "bf16", devices: int = 2, fp32_matmul: str = "tf32"):
    cfg = RunConfig(per_device_batch=4, devices=devices, accumulation_steps=accumulation, precision=precision,
                    steps=3, warmup_steps=2)
    program = TrainProgram.from_config(cfg)
    # two warm-up steps (slow: compiling), then three timed steps of 0.1 s
    timed = _Timed(step_s=[2.0, 1.0, 0.1, 0.1, 0.1], losses=[], skipped=0, last_metrics={}, recompilations=0)
    gpus = [Gpu(stats={"peak_bytes_in_use": 7_000 + i, "bytes_limit": 80_000 - i}) for i in range(devices)]
    return program, _figures(cfg, program, "gpu", gpus, fp32_matmul, timed, predicted=123)


def test_the_model_flops_are_the_workloads():
    program, _ = run_figures(1)
    assert program.workload.flops_per_example(program.model_cfg) == F
    assert program.workload.tokens_per_example(program.model_cfg) == 64


@pytest.mark.parametrize("accumulation", [1, 4])
def test_mfu_counts_every_micro_batch_of_an_accumulated_step(accumulation):
    """4 per device x 2 GPUs x accumulation a = 8a examples an optimizer step, each F FLOPs. Three timed
    steps of 0.1 s (the warm-up's 3 s left out): achieved 8a x F x 3 / 0.3 s = 8a x F x 10 FLOP/s against
    2 x 989 TFLOP/s of H100 bf16. a = 4: 16,106,127,360 FLOP/s, MFU 8.143e-6, 320 examples/s."""
    program, fig = run_figures(accumulation)
    assert program.global_batch == 8 * accumulation
    achieved = 8 * accumulation * F * 10
    assert fig["achieved_tflops"] == pytest.approx(achieved / 1e12, rel=1e-13, abs=0)  # TFLOP/s: 1e12, exactly
    assert fig["peak_tflops"] == pytest.approx(2 * 989, rel=1e-13)
    assert fig["mfu"] == pytest.approx(achieved / (2 * 989e12))
    assert fig["samples_per_s"] == pytest.approx(80 * accumulation)
    assert fig["tokens_per_s"] == pytest.approx(80 * accumulation * 64)
    assert fig["model_flops_per_step"] == 8 * accumulation * F
    if accumulation == 4:
        assert fig["mfu"] == pytest.approx(8.1427e-6, rel=1e-4)


def test_the_window_leaves_the_warm_up_out():
    """Median, mean and 90th percentile of the three 0.1 s steps: 100 ms each."""
    _, fig = run_figures(1)
    assert fig["timed_steps"] == 3
    assert fig["step_ms_median"] == pytest.approx(100) and fig["step_ms_mean"] == pytest.approx(100)
    assert fig["step_ms_p90"] == pytest.approx(100)


def test_the_peak_memory_is_the_largest_devices_and_the_limit_the_smallest():
    _, fig = run_figures(1)
    assert fig["peak_memory_bytes"] == 7_001 and fig["device_memory_limit_bytes"] == 79_999
    assert fig["peak_memory_source"].startswith("measured")


def test_without_allocator_statistics_the_compiled_figure_is_given_and_labelled():
    assert device_memory_stats([Gpu(stats=None), Gpu(stats={})]) == (None, None)
    cfg = RunConfig(per_device_batch=4, devices=1, steps=1, warmup_steps=0)
    timed = _Timed(step_s=[0.5], losses=[], skipped=0, last_metrics={}, recompilations=0)
    fig = _figures(cfg, TrainProgram.from_config(cfg), "gpu", [Gpu()], "tf32", timed, predicted=123)
    assert fig["peak_memory_bytes"] == 123
    assert fig["peak_memory_source"] == ("cpu: XLA memory_analysis of the compiled step (CPU backend figure, "
                                         "not a GPU prediction)")


def test_the_90th_percentile_interpolates():
    """Of 1 .. 10: rank 0.9 x 9 = 8.1 -> 9 + 0.1 x (10 - 9) = 9.1."""
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)


@pytest.mark.parametrize("kind, precision, fp32_matmul, devices, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", "tf32", 2, 2 * 989),
    ("NVIDIA H100 80GB HBM3", "fp16", "tf32", 1, 989),
    ("NVIDIA H100 80GB HBM3", "fp32", "tf32", 1, 494.7),  # fp32 products as TF32 (the default on 8.0+)
    ("NVIDIA H100 80GB HBM3", "fp32", "fp32", 4, 4 * 67),  # ... or at "highest": fp32 units
    ("NVIDIA H100 80GB HBM3", "fp8", "tf32", 8, 8 * 1979),
    ("NVIDIA A100-SXM4-80GB", "bf16", "tf32", 8, 8 * 312),
    ("Tesla V100-SXM2-32GB", "fp16", "fp32", 1, 125),
])
def test_the_peak_is_the_datasheets_for_the_unit_the_products_run_in(kind, precision, fp32_matmul, devices, tflops):
    peak, label = peak_flops_for("gpu", Gpu(kind), precision, fp32_matmul, devices)
    assert peak == pytest.approx(tflops * 1e12)
    assert label.startswith("datasheet dense peak") and f"x {devices}" in label


def test_no_peak_where_the_gpu_lacks_the_unit_or_is_not_in_the_catalog():
    peak, label = peak_flops_for("gpu", Gpu("Tesla V100-SXM2-32GB"), "bf16", "fp32", 1)
    assert peak is None and "has no bf16 tensor cores" in label
    peak, label = peak_flops_for("gpu", Gpu("NVIDIA A100-SXM4-80GB"), "fp8", "tf32", 1)
    assert peak is None and "has no fp8 tensor cores" in label
    peak, label = peak_flops_for("gpu", Gpu("NVIDIA Mystery 9000"), "bf16", "tf32", 1)
    assert peak is None and "unknown GPU 'NVIDIA Mystery 9000'" in label


PRICE = Price(key="h100-sxm", usd_per_hour=2.0, source="yours", as_of="2026-12")


def test_a_sides_mfu_throughput_time_and_cost_by_hand():
    """A GPU side of 16 chips, global batch 256 of 2,048 tokens, a 2 s step, 1e14 FLOPs an example (about an 8B
    model's 6 x 8e9 x 2,048), 989 TFLOP/s a chip: MFU 1e14 x 256 / (2 x 16 x 989e12) = 0.8089; 262,144 tokens/s, 16,384 a chip; 1e9 tokens take
    3,814.7 s; at $2 a GPU-hour: 3,814.7 / 3,600 x 16 x 2 = $33.91."""
    side = _side(name="16 x H100", devices=16, chips=16, step_s=2.0, step_source="predicted", error=0.25,
                 global_batch=256, per_example=2048, flops_per_example=1e14, peak_per_chip=989e12, train=1e9,
                 price=PRICE, extra={})
    assert side["mfu"] == pytest.approx(1e14 * 256 / (2 * 16 * 989e12))
    assert side["mfu"] == pytest.approx(0.80889, rel=1e-4)
    assert side["throughput_per_s"] == pytest.approx(262_144) and side["throughput_per_chip_per_s"] == pytest.approx(16_384)
    assert side["time_s"] == pytest.approx(1e9 / 262_144)
    assert side["cost_usd"] == pytest.approx(1e9 / 262_144 / 3600 * 16 * 2.0)
    assert side["cost_usd"] == pytest.approx(33.91, abs=0.01)


def test_a_side_without_a_step_time_or_a_peak_says_nothing_it_cannot_know():
    side = _side(name="x", devices=8, chips=8, step_s=None, step_source="none", error=None, global_batch=64,
                 per_example=None, flops_per_example=1e9, peak_per_chip=1e12, train=1e6, price=PRICE, extra={})
    assert (side["mfu"], side["throughput_per_s"], side["time_s"], side["cost_usd"]) == (None, None, None, None)
    side = _side(name="x", devices=8, chips=8, step_s=1.0, step_source="p", error=None, global_batch=64,
                 per_example=None, flops_per_example=1e9, peak_per_chip=None, train=1e6, price=None, extra={})
    assert side["mfu"] is None and side["cost_usd"] is None and side["throughput_per_s"] == 64


def test_a_sides_record_has_every_figure_under_its_name():
    side = _side(name="16 x H100", devices=16, chips=16, step_s=2.0, step_source="predicted", error=0.25,
                 global_batch=256, per_example=2048, flops_per_example=1e14, peak_per_chip=989e12, train=1e9,
                 price=PRICE, extra={"fits": True})
    throughput = 256 * 2048 / 2.0
    assert side == {
        "name": "16 x H100", "devices": 16, "chips": 16, "global_batch": 256, "step_s": 2.0, "step_source": "predicted",
        "expected_error": 0.25, "per_step": 256 * 2048, "throughput_per_s": throughput,
        "throughput_per_chip_per_s": throughput / 16, "mfu": pytest.approx(1e14 * 256 / (2 * 16 * 989e12)),
        "time_s": 1e9 / throughput, "price": PRICE.to_dict(), "cost_usd": pytest.approx(1e9 / throughput / 3600 * 32),
        "fits": True}
    assert _side(name="x", devices=1, chips=1, step_s=1.0, step_source="p", error=None, global_batch=1,
                 per_example=None, flops_per_example=1.0, peak_per_chip=1.0, train=1.0, price=None, extra={})["price"] is None


def test_an_fp16_runs_figures_carry_its_loss_scale_skips_and_recompilations():
    """fp16 on one H100, three timed steps of 0.1, 0.2 and 0.3 s: median 200 ms, mean 200 ms, 90th percentile
    0.2 + 0.8 x 0.1 = 280 ms (rank 0.9 x 2 = 1.8); the loss scale the last step left, 2 skipped steps, one
    recompilation; the peak fp16's 989 TFLOP/s."""
    import resource

    cfg = RunConfig(per_device_batch=4, devices=1, precision="fp16", steps=3, warmup_steps=1)
    timed = _Timed(step_s=[5.0, 0.1, 0.2, 0.3], losses=[], skipped=2, last_metrics={"loss_scale": 1024.0},
                   recompilations=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    fig = _figures(cfg, TrainProgram.from_config(cfg), "gpu", [Gpu(stats={"peak_bytes_in_use": 10})], "tf32", timed, 5)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert fig["step_ms_p90"] == pytest.approx(280) and fig["step_ms_median"] == pytest.approx(200)
    assert (fig["final_loss_scale"], fig["skipped_steps"], fig["recompilations"]) == (1024.0, 2, 1)
    assert fig["peak_tflops"] == pytest.approx(989) and fig["peak_tflops_source"].startswith("datasheet dense peak")
    assert before <= fig["process_peak_rss_bytes"] <= after  # Linux reports KiB
    assert set(fig) == {"step_ms_median", "step_ms_p90", "step_ms_mean", "timed_steps", "samples_per_s", "tokens_per_s",
                        "model_flops_per_step", "achieved_tflops", "peak_tflops", "peak_tflops_source", "mfu",
                        "peak_memory_bytes", "peak_memory_source", "process_peak_rss_bytes", "device_memory_limit_bytes",
                        "recompilations", "skipped_steps", "final_loss_scale"}
    bf16 = dataclasses.replace(cfg, precision="bf16")
    assert _figures(bf16, TrainProgram.from_config(bf16), "gpu", [Gpu()], "tf32", timed, 5)["final_loss_scale"] is None


def test_an_fp32_run_is_measured_against_the_unit_its_products_ran_in():
    """fp32 with products at "highest": 2 x 67 TFLOP/s of fp32 units, not TF32's 2 x 494.7."""
    _, fig = run_figures(1, precision="fp32", fp32_matmul="fp32")
    assert fig["peak_tflops"] == pytest.approx(2 * 67)


def test_without_a_peak_or_tokens_those_figures_are_absent():
    cfg = RunConfig(workload="mlp", preset="tiny", per_device_batch=4, devices=1, steps=1, warmup_steps=0)
    timed = _Timed(step_s=[0.5], losses=[], skipped=0, last_metrics={}, recompilations=0)
    fig = _figures(cfg, TrainProgram.from_config(cfg), "gpu", [Gpu("NVIDIA Mystery 9000")], "tf32", timed, 1)
    assert (fig["tokens_per_s"], fig["peak_tflops"], fig["mfu"]) == (None, None, None)
    assert fig["samples_per_s"] == pytest.approx(8) and fig["achieved_tflops"] > 0


@pytest.mark.parametrize("precision, emulated", [("bf16", False), ("fp32", False), ("fp8", True), ("mxfp8", True)])
def test_on_the_cpu_the_peak_is_measured_and_fp8_said_to_be_emulated(precision, emulated):
    import jax

    from migration.hardware import cpu_peak_flops

    peak, label = peak_flops_for("cpu", jax.devices("cpu")[0], precision, "fp32", 4)
    measured, measured_label = cpu_peak_flops(precision)
    assert peak == measured > 0 and label.startswith(measured_label.removesuffix(" (cached)"))
    assert label.endswith("; fp8 is emulated on the CPU (converted and computed as bf16): no fp8 units") == emulated
    if not emulated:  # the measured label as it is, nothing added
        assert label.removesuffix(" (cached)") == measured_label.removesuffix(" (cached)")
