"""The hardware table: exact catalog matching, device-reported memory, and one MFU peak per matmul unit."""

import types

import pytest

from migration.hardware import GPU_SPECS, MATMUL_UNITS, fp32_matmul_precision, gpu_spec_for_device_kind, matmul_unit
from migration.running.measure import peak_flops_for


@pytest.mark.parametrize("kind,key", [
    ("Tesla V100-SXM2-16GB", "v100-16gb"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("Tesla T4", "t4"),
    ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("nvidia h200 141gb hbm3e ", "h200"),
])
def test_device_kinds_match_their_own_entry_exactly(kind, key):
    assert gpu_spec_for_device_kind(kind).key == key


@pytest.mark.parametrize("kind", ["Tesla V100-PCIE-16GB", "NVIDIA A100-PCIE-40GB", "NVIDIA H200 NVL", "NVIDIA A10G",
                                  "NVIDIA L40S", "NVIDIA H100", "cpu"])
def test_a_device_not_in_the_catalog_borrows_no_entry(kind):
    """A 16 GB card never gets a 32 GB budget, and a similar name is not the same GPU."""
    assert gpu_spec_for_device_kind(kind) is None


def test_memory_is_what_the_device_reports_where_a_capture_exists():
    # XLA's captured target descriptions (openxla/xla .../target_config/specs/): bytes, not datasheet GB.
    assert GPU_SPECS["h100-sxm"].memory_bytes == 84942979072 > 80e9
    assert GPU_SPECS["a100-40gb"].memory_bytes == 42331013120
    assert GPU_SPECS["v100-16gb"].memory_bytes == 16935682048 < GPU_SPECS["v100-32gb"].memory_bytes
    for spec in GPU_SPECS.values():
        assert spec.source.endswith(".txtpb") or "datasheet" in spec.source or "whitepaper" in spec.source


@pytest.mark.parametrize("key", sorted(GPU_SPECS))
def test_every_entry_has_a_peak_for_each_unit_it_has(key):
    spec = GPU_SPECS[key]
    units = {"fp32", "fp16"} | ({"bf16", "tf32"} if spec.bf16_native else set())
    assert set(spec.peak_tflops) == units
    ladder = [spec.peak_tflops[u] for u in ("fp16", "tf32", "fp32") if u in spec.peak_tflops]
    assert ladder == sorted(ladder, reverse=True) and ladder[-1] > 0
    assert set(spec.peak_tflops) <= set(MATMUL_UNITS)


@pytest.mark.parametrize("platform,cc,setting,expected", [
    ("gpu", (8, 0), None, "tf32"), ("gpu", (9, 0), "default", "tf32"), ("gpu", (8, 6), "high", "tf32"),
    ("gpu", (8, 0), "bfloat16", "tf32"), ("gpu", (9, 0), "highest", "fp32"), ("gpu", (8, 0), "float32", "fp32"),
    ("gpu", (7, 0), None, "fp32"), ("gpu", (7, 5), "default", "fp32"), ("cpu", None, None, "fp32"),
])
def test_fp32_products_run_as_tf32_only_where_xla_does_so(platform, cc, setting, expected):
    assert fp32_matmul_precision(platform, cc, setting) == expected


A100 = types.SimpleNamespace(device_kind="NVIDIA A100-SXM4-40GB")


@pytest.mark.parametrize("precision,fp32_matmul,tflops,label", [
    ("bf16", "tf32", 312, "bf16 tensor cores"),
    ("fp16", "tf32", 312, "fp16 tensor cores"),
    ("fp32", "tf32", 156, "TF32 tensor cores"),
    ("fp32", "fp32", 19.5, "fp32 on CUDA cores"),
])
def test_mfu_peak_follows_what_the_products_run_in(precision, fp32_matmul, tflops, label):
    peak, source = peak_flops_for("gpu", A100, precision, fp32_matmul, devices=2)
    assert peak == pytest.approx(2 * tflops * 1e12)
    assert label in source and "x 2" in source
    assert matmul_unit(precision, fp32_matmul) in MATMUL_UNITS


def test_no_peak_where_the_unit_or_the_gpu_is_missing():
    peak, source = peak_flops_for("gpu", types.SimpleNamespace(device_kind="Tesla V100-SXM2-32GB"), "bf16", "fp32", 1)
    assert peak is None and "no bf16 tensor cores" in source
    peak, source = peak_flops_for("gpu", types.SimpleNamespace(device_kind="NVIDIA L40S"), "bf16", "tf32", 1)
    assert peak is None and "unknown GPU" in source


@pytest.mark.parametrize("setting,unit,a100_tflops", [
    ("F32_F32_F32", "fp32", 19.5), ("F64_F64_F64", "fp32", 19.5), ("TF32_TF32_F32", "tf32", 156),
    ("TF32_TF32_F32_X3", "tf32x3", 52), ("BF16_BF16_F32", "bf16", 312), ("BF16_BF16_F32_X3", "bf16x3", 104),
    ("BF16_BF16_F32_X6", "bf16x6", 52), ("BF16_BF16_F32_X9", "bf16x9", 312 / 9), ("F16_F16_F32", "fp16", 312),
    ("tensorfloat32", "tf32", 156), ("fastest", "tf32", 156),
])
def test_every_matmul_precision_name_maps_to_its_unit_and_peak(setting, unit, a100_tflops):
    """JAX's algorithm names for fp32 products are not TF32: F32_F32_F32 on an A100 read as TF32 would
    put MFU's peak 8x too high."""
    assert fp32_matmul_precision("gpu", (8, 0), setting) == unit
    assert GPU_SPECS["a100-40gb"].peak_flops(unit) == pytest.approx(a100_tflops * 1e12)
    assert unit in MATMUL_UNITS
    assert fp32_matmul_precision("gpu", (7, 0), setting) == ("fp16" if unit == "fp16" else "fp32")  # V100
    assert fp32_matmul_precision("cpu", None, setting) == "fp32"
