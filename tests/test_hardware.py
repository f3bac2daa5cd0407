"""The hardware table: exact catalog matching, device-reported memory, and one MFU peak per matmul unit."""

import types

import pytest

from migration.hardware import (GPU_SPECS, MATMUL_UNITS, fp32_matmul_precision, gpu_spec_for_device_kind,
                                gpu_target_config, host_link_bandwidth, matmul_unit)
from migration.running.measure import peak_flops_for


@pytest.mark.parametrize("kind,key", [
    ("Tesla V100-SXM2-16GB", "v100-16gb"), ("Tesla V100-SXM2-32GB", "v100-32gb"), ("Tesla T4", "t4"),
    ("NVIDIA A10", "a10"), ("NVIDIA L4", "l4"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA A100-SXM4-40GB", "a100-40gb"), ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("NVIDIA H100 PCIe", "h100-pcie"), ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 NVL", "h100-nvl"),
    ("NVIDIA H200", "h200"), ("nvidia h200 141gb hbm3e ", "h200"), ("NVIDIA B200", "b200"), ("NVIDIA GB200", "gb200"),
    ("NVIDIA B300 SXM6 AC", "b300"), ("NVIDIA GB300", "gb300"),
    ("NVIDIA RTX PRO 6000 Blackwell Server Edition", "rtx-pro-6000"), ("NVIDIA A10G", "a10g"), ("NVIDIA L40S", "l40s"),
])
def test_device_kinds_match_their_own_entry_exactly(kind, key):
    assert gpu_spec_for_device_kind(kind).key == key


@pytest.mark.parametrize("kind", ["Tesla V100-PCIE-16GB", "NVIDIA A100-PCIE-40GB", "NVIDIA H200 NVL", "NVIDIA L40",
                                  "NVIDIA A10G-8Q", "NVIDIA H100", "cpu"])
def test_a_device_not_in_the_catalog_borrows_no_entry(kind):
    """A 16 GB card never gets a 32 GB budget, and a similar name is not the same GPU."""
    assert gpu_spec_for_device_kind(kind) is None


def test_memory_is_what_the_device_reports_where_a_capture_exists():
    # XLA's captured target descriptions (openxla/xla .../target_config/specs/): bytes, not datasheet GB.
    assert GPU_SPECS["h100-sxm"].memory_bytes == 84942979072 > 80e9
    assert GPU_SPECS["a100-40gb"].memory_bytes == 42331013120
    assert GPU_SPECS["v100-16gb"].memory_bytes == 16935682048 < GPU_SPECS["v100-32gb"].memory_bytes
    for spec in GPU_SPECS.values():
        assert (spec.source.endswith(".txtpb") or "datasheet" in spec.source or "whitepaper" in spec.source
                or "spec table" in spec.source)


@pytest.mark.parametrize("key", sorted(GPU_SPECS))
def test_every_entry_has_a_peak_for_each_unit_it_has(key):
    spec = GPU_SPECS[key]
    units = ({"fp32", "fp16"} | ({"bf16", "tf32"} if spec.bf16_native else set())
             | ({"fp8"} if spec.compute_capability >= (8, 9) else set())
             | ({"fp4"} if spec.compute_capability >= (10, 0) else set()))
    assert set(spec.peak_tflops) == units
    assert spec.fp8 == (spec.compute_capability >= (8, 9))
    # each narrower unit runs at least as fast as the wider one, fp8 twice bf16 and fp4 at least twice fp8
    ladder = [spec.peak_tflops[u] for u in ("fp4", "fp8", "fp16", "tf32", "fp32") if u in spec.peak_tflops]
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
    peak, source = peak_flops_for("gpu", types.SimpleNamespace(device_kind="NVIDIA L40"), "bf16", "tf32", 1)
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


# Each TPU generation's figures as Google Cloud's TPU pages state them (per chip), with the line quoted.
TPU_CITED = {
    "v3": ("https://cloud.google.com/tpu/docs/v3",
           "| Peak compute per chip | 123 teraflops (bf16) | ... | HBM2 capacity and bandwidth | 32 GiB, 900 GBps |",
           dict(bf16_tflops=123, hbm_bytes=32 * 2**30, bandwidth_bytes_per_s=900e9, ici_bytes_per_s=None, pod_chips=1024)),
    "v4": ("https://cloud.google.com/tpu/docs/v4",
           "Peak compute per chip 275 teraflops (bf16 or int8) ... HBM2 capacity and bandwidth 32 GiB, 1200 GBps",
           dict(bf16_tflops=275, int8_tops=275, hbm_bytes=32 * 2**30, bandwidth_bytes_per_s=1200e9, pod_chips=4096,
                dcn_bytes_per_s=None)),
    "v5e": ("https://cloud.google.com/tpu/docs/v5e",
            "| Peak compute per chip (bf16) | 197 TFLOPs | ... | HBM2 capacity and bandwidth | 16 GB, 819 GBps | ... "
            "| Bidirectional inter-chip interconnect (ICI) bandwidth (per chip) | 400 GBps | (Int8) | 393 TOPs |",
            dict(bf16_tflops=197, int8_tops=393, hbm_bytes=16 * 10**9, bandwidth_bytes_per_s=819e9,
                 ici_bytes_per_s=400e9, pod_chips=256, dcn_bytes_per_s=2 * 100e9 / 8 / 8)),  # 2 x 100 Gbps NICs per 8 chips
    "v5p": ("https://cloud.google.com/tpu/docs/v5p",
            "| Peak compute per chip (BF16) (TFLOPs) | 459 | Peak compute per chip (FP8) (TFLOPs) | 459 | HBM capacity "
            "per chip (GiB) | 95 | HBM bandwidth per chip (GBps) | 2765 | ... (ICI) bandwidth per chip (GBps) | 1200",
            dict(bf16_tflops=459, fp8_tflops=459, hbm_bytes=95 * 2**30, bandwidth_bytes_per_s=2765e9,
                 ici_bytes_per_s=1200e9, pod_chips=8960, dcn_bytes_per_s=50e9 / 8)),  # DCN 50 Gbps per chip
    "v6e": ("https://cloud.google.com/tpu/docs/v6e",
            "| Peak compute per chip (bf16) | 918 TFLOPs | Peak compute per chip (Int8) | 1836 TOPs | HBM capacity per "
            "chip | 32 GB | HBM bandwidth per chip | 1638 GBps | ... (ICI) bandwidth per chip (GBps) | 800",
            dict(bf16_tflops=918, int8_tops=1836, hbm_bytes=32 * 10**9, bandwidth_bytes_per_s=1638e9,
                 ici_bytes_per_s=800e9, pod_chips=256, dcn_bytes_per_s=4 * 200e9 / 8 / 8)),  # 4 x 200 Gbps per 8 chips
    "tpu7x": ("https://cloud.google.com/tpu/docs/tpu7x",
              "| Peak compute per chip (BF16) (TFLOPs) | 459 | 918 | 2307 | Peak compute per chip (FP8) (TFLOPs) | 459 | "
              "918 | 4614 | HBM capacity per chip (GiB) | 95 | 32 | 192 | ... | Number of TensorCores per chip | 2 | 1 | 2",
              dict(bf16_tflops=2307, fp8_tflops=4614, hbm_bytes=192 * 2**30, bandwidth_bytes_per_s=7380e9,
                   ici_bytes_per_s=1200e9, pod_chips=9216, devices_per_chip=2, dcn_bytes_per_s=100e9 / 8)),
}


@pytest.mark.parametrize("generation", list(TPU_CITED))
def test_each_tpu_generation_states_the_figures_its_page_gives(generation):
    from migration.hardware import TPU_CHIPS

    url, quote, figures = TPU_CITED[generation]
    chip = TPU_CHIPS[generation]
    assert chip.source == url and quote
    for name, value in figures.items():
        assert getattr(chip, name) == value, (generation, name)


def test_each_tpu_slice_has_the_chips_its_name_says_and_a_share_of_each_chip():
    from migration.hardware import TPU_SPECS

    generations = {s.generation for s in TPU_SPECS.values()}
    assert {"v4", "v5e", "v5p", "v6e", "tpu7x"} <= generations
    for key, spec in TPU_SPECS.items():
        size = int(key.rsplit("-", 1)[1])
        chip = spec.chip
        assert spec.chips == (size // 2 if chip.cores_in_name else size), key
        assert spec.chips <= chip.pod_chips, key
        assert spec.hbm_bytes_per_device * chip.devices_per_chip == chip.hbm_bytes
        assert spec.bf16_tflops_per_device * chip.devices_per_chip == pytest.approx(chip.bf16_tflops)
    # Single hosts through full pods (v5p: its largest single slice, 6,144 chips; TPU7x: 4,096 chips).
    assert TPU_SPECS["tpu-v5e-256"].chips == TPU_SPECS["tpu-v6e-256"].chips == 256
    assert TPU_SPECS["tpu-v5p-12288"].chips == 6144 and TPU_SPECS["tpu-v4-8192"].chips == 4096
    assert TPU_SPECS["tpu7x-8"].chips == 4 and TPU_SPECS["tpu7x-8"].devices == 8


@pytest.mark.parametrize("key", sorted(GPU_SPECS))
def test_narrow_units_are_the_datasheets_multiples(key):
    """Dense fp8 is twice bf16 on every GPU that has it (Ada, Hopper, Blackwell), fp4 twice fp8 or more
    (Blackwell Ultra's fp4 is 3x): a peak copied from a sparse column would break the ratio."""
    peaks = GPU_SPECS[key].peak_tflops
    if "fp8" in peaks:
        assert peaks["fp8"] == pytest.approx(2 * peaks["bf16"], rel=0.01)
    if "fp4" in peaks:
        assert 2 * peaks["fp8"] <= peaks["fp4"] <= 3 * peaks["fp8"]


@pytest.mark.parametrize("key,domain,host", [("h100-sxm", 8, None), ("b200", 8, None), ("gb200", 72, 4),
                                             ("gb300", 72, 4), ("rtx-pro-6000", 1, None), ("h100-pcie", 1, None),
                                             ("h100-nvl", 2, None)])
def test_nvlink_domains_as_the_systems_are_sold(key, domain, host):
    assert GPU_SPECS[key].nvlink_domain == domain and GPU_SPECS[key].gpus_per_host == host


def test_blackwell_targets_come_from_xlas_captures():
    for key, cc in [("b200", (10, 0)), ("gb200", (10, 0)), ("b300", (10, 3)), ("gb300", (10, 3)),
                    ("rtx-pro-6000", (12, 0))]:
        spec = GPU_SPECS[key]
        assert spec.compute_capability == cc and spec.source.endswith(".txtpb") and spec.peaks_source
        assert f"cuda_compute_capability {{ major: {cc[0]} minor: {cc[1]} }}" in gpu_target_config(spec)
    assert GPU_SPECS["b300"].memory_bytes > GPU_SPECS["b200"].memory_bytes > GPU_SPECS["h200"].memory_bytes
    assert host_link_bandwidth((10, 0), "gb200") > host_link_bandwidth((10, 0), "b200") == 64e9
