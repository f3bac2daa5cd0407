"""Accelerator facts in one table, and the peak FLOP/s that MFU is measured against.

GPU device numbers (SM count, memory as the device reports it, bandwidth, L2, clock) come from
XLA's captured GPU target descriptions (openxla/xla, xla/backends/gpu/target_config/specs/) where
one exists, cited per entry; otherwise from the vendor's datasheet, in decimal GB, which is a
little below what cards report. Peaks are the datasheets' dense figures by matmul unit (fp32 on
CUDA cores, TF32, bf16, fp16). Per-SM limits: CUDA C Programming Guide, "Compute Capabilities".
TPU figures: Google Cloud TPU system-architecture pages. See also ../shared/reference/hardware.md.

On the CPU backend there is no datasheet peak worth the name: the worker measures one large
matrix product per dtype once per machine and caches it (see `cpu_peak_flops`).
"""

from __future__ import annotations

import dataclasses
import math
import re
import os
import time
from typing import Any
from pathlib import Path

from migration.common import GiB, compile_cache_dir, read_json, write_json_atomic

GB = 1000**3
TFLOPS = 1e12

# What the matrix products of a run really execute in, and the peak each is measured against.
# fp32 products run as TF32 on compute capability 8.0+ unless the matmul precision is "highest".
MATMUL_UNITS: dict[str, str] = {
    "fp32": "fp32 on CUDA cores (matmul precision 'highest', or no TF32 below compute capability 8.0)",
    "tf32": "TF32 tensor cores (XLA's default for fp32 products on compute capability 8.0+)",
    "bf16": "bf16 tensor cores",
    "fp16": "fp16 tensor cores",
    "fp8": "fp8 tensor cores (e4m3 / e5m2 operands, fp32 accumulation)",
    "fp4": "fp4 tensor cores (NVFP4 / MXFP4 block-scaled operands)",
    "tf32x3": "three TF32 tensor-core passes per fp32 product (TF32_TF32_F32_X3)",
    "bf16x3": "three bf16 tensor-core passes per fp32 product (BF16_BF16_F32_X3)",
    "bf16x6": "six bf16 tensor-core passes per fp32 product (BF16_BF16_F32_X6)",
    "bf16x9": "nine bf16 tensor-core passes per fp32 product (BF16_BF16_F32_X9)",
}
# Units that run each product as several passes of another: (that unit, passes). Their peak for the
# model's FLOPs is the other unit's over the passes.
MULTI_PASS: dict[str, tuple[str, int]] = {"tf32x3": ("tf32", 3), "bf16x3": ("bf16", 3), "bf16x6": ("bf16", 6),
                                          "bf16x9": ("bf16", 9)}
# jax_default_matmul_precision -> the unit fp32 products run in on a GPU with tensor cores for it (the
# names not listed, and None, are XLA's default: TF32 from compute capability 8.0). The algorithm
# names are JAX's DotAlgorithmPreset values.
FP32_MATMUL_SETTINGS: dict[str, str] = {
    "highest": "fp32", "float32": "fp32", "F32_F32_F32": "fp32", "F64_F64_F64": "fp32",
    "TF32_TF32_F32": "tf32", "TF32_TF32_F32_X3": "tf32x3", "F16_F16_F32": "fp16",
    "BF16_BF16_F32": "bf16", "BF16_BF16_F32_X3": "bf16x3", "BF16_BF16_F32_X6": "bf16x6",
    "BF16_BF16_F32_X9": "bf16x9",
}
# The compute capability each unit's tensor cores need (fp32 runs anywhere, on CUDA cores).
UNIT_MIN_CC = {"fp16": (7, 0), "fp8": (8, 9), "fp4": (10, 0), "tf32": (8, 0), "tf32x3": (8, 0), "bf16": (8, 0), "bf16x3": (8, 0),
               "bf16x6": (8, 0), "bf16x9": (8, 0)}

XLA_SPECS = "openxla/xla xla/backends/gpu/target_config/specs/"


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    device_kinds: tuple[str, ...]  # exact jax Device.device_kind strings this entry stands for
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int  # what the device reports (captured), else the datasheet figure
    bandwidth_bytes_per_s: float
    l2_bytes: int
    clock_ghz: float
    peak_tflops: dict[str, float]  # dense peaks by matmul unit (MATMUL_UNITS keys)
    source: str  # where the device numbers come from
    # GPUs joined by NVLink as the system is sold: 8 on an HGX/DGX board, 72 in a GB200/GB300 NVL72 rack,
    # 2 for NVLink-bridged PCIe pairs, 1 for a PCIe card without a bridge (its GPUs talk over PCIe)
    nvlink_domain: int = 8
    # GPUs one host (one process of a multi-node job) drives at most: 4 on an NVL72 compute tray; None: no
    # limit beyond the request's
    gpus_per_host: int | None = None
    peaks_source: str = ""  # where the dense peaks come from

    @property
    def fp8(self) -> bool:
        """fp8 tensor cores (Ada, Hopper, Blackwell: compute capability 8.9 and up)."""
        return "fp8" in self.peak_tflops

    @property
    def bf16_native(self) -> bool:
        return self.compute_capability >= (8, 0)

    def peak_flops(self, unit: str) -> float | None:
        """Dense peak FLOP/s of one device for a matmul unit (None: the unit does not exist here)."""
        base, passes = MULTI_PASS.get(unit, (unit, 1))
        value = self.peak_tflops.get(base)
        return None if value is None else value * TFLOPS / passes


def _spec(key, name, kinds, cc, sms, memory, bandwidth, l2, clock, peaks, source, **more) -> GpuSpec:
    return GpuSpec(key, name, kinds, cc, sms, int(memory), float(bandwidth), int(l2), clock, peaks, source, **more)


# Peaks: NVIDIA datasheets, dense (the datasheets print sparse figures twice as large); the RTX 4090
# figure is the Ada whitepaper's fp32-accumulate tensor rate. Device numbers: XLA's captured GPU
# target descriptions where one exists (cited per entry), else the datasheet (decimal GB).
GPU_SPECS: dict[str, GpuSpec] = {
    s.key: s
    for s in [
        _spec("v100-16gb", "V100 SXM2 16GB", ("Tesla V100-SXM2-16GB",), (7, 0), 80, 16935682048, 898048000000,
              6291456, 1.53, {"fp16": 125, "fp32": 15.7}, XLA_SPECS + "v100.txtpb"),
        _spec("v100-32gb", "V100 SXM2 32GB", ("Tesla V100-SXM2-32GB",), (7, 0), 80, 32 * GB, 900e9,
              6 * 2**20, 1.53, {"fp16": 125, "fp32": 15.7}, "V100 datasheet (no public capture)"),
        _spec("t4", "T4", ("Tesla T4",), (7, 5), 40, 16 * GB, 320e9, 4 * 2**20, 1.59,
              {"fp16": 65, "fp32": 8.1}, "T4 datasheet (no public capture)", nvlink_domain=1),
        _spec("a10", "A10", ("NVIDIA A10",), (8, 6), 72, 24 * GB, 600e9, 6 * 2**20, 1.695,
              {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}, "A10 datasheet (no public capture)", nvlink_domain=1),
        _spec("l4", "L4", ("NVIDIA L4",), (8, 9), 58, 24 * GB, 300e9, 48 * 2**20, 2.04,
              {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3, "fp8": 242.5}, "L4 datasheet (no public capture)",
              nvlink_domain=1),
        # AWS's G5 card: GA102 with 80 SMs at 1.71 GHz and GeForce-rate tensor cores (512 dense fp16 FLOP per SM
        # and clock with fp32 accumulation, half the A10's); NVIDIA publishes no datasheet for it.
        _spec("a10g", "A10G", ("NVIDIA A10G",), (8, 6), 80, 24 * GB, 600e9, 6 * 2**20, 1.71,
              {"bf16": 70, "fp16": 70, "tf32": 35, "fp32": 35}, "A10G spec table (Baseten, below; AWS's G5 page: 24 GB a GPU; no datasheet, no public capture)",
              nvlink_domain=1, peaks_source="Baseten, 'NVIDIA A10 vs A10G for ML model inference' (A10G spec table: "
              "70 bf16 / fp16 tensor, 35 TF32, 35 fp32 TFLOPS dense); equal to 80 SMs x 1.71 GHz x 512 FLOP/clock"),
        _spec("l40s", "L40S", ("NVIDIA L40S",), (8, 9), 142, 48 * GB, 864e9, 96 * 2**20, 2.52,
              {"bf16": 366.5, "fp16": 366.5, "tf32": 183, "fp32": 91.6, "fp8": 733},
              "L40S datasheet (no public capture; L2: the Ada whitepaper's AD102)", nvlink_domain=1,
              peaks_source="L40S datasheet: fp8 733, TF32 183, fp32 91.6 dense; bf16 / fp16 half the with-sparsity 733 "
                           "(= 142 SMs x 2.52 GHz x 1,024 FLOP/clock; its dense column prints 362.05, the L40's)"),
        _spec("rtx-4090", "GeForce RTX 4090", ("NVIDIA GeForce RTX 4090",), (8, 9), 128, 24 * GB, 1008e9,
              72 * 2**20, 2.52, {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6, "fp8": 330.3},
              "Ada whitepaper (no public capture)", nvlink_domain=1),
        _spec("a100-40gb", "A100 SXM4 40GB", ("NVIDIA A100-SXM4-40GB",), (8, 0), 108, 42331013120,
              1555200000000, 41943040, 1.41, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
              XLA_SPECS + "a100_sxm_40.txtpb"),
        _spec("a100-80gb", "A100 SXM4 80GB", ("NVIDIA A100-SXM4-80GB",), (8, 0), 108, 85100068864,
              2039040000000, 41943040, 1.41, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
              XLA_SPECS + "a100_sxm_80.txtpb"),
        _spec("a100-80gb-pcie", "A100 PCIe 80GB", ("NVIDIA A100 80GB PCIe",), (8, 0), 108, 79050250240,
              2039000000000, 41943040, 1.1105, {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5},
              XLA_SPECS + "a100_pcie_80.txtpb", nvlink_domain=1),
        _spec("h100-pcie", "H100 PCIe 80GB", ("NVIDIA H100 PCIe",), (9, 0), 114, 84942979072, 2039040000000,
              52428800, 1.755, {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51, "fp8": 1513}, XLA_SPECS + "h100_pcie.txtpb",
              nvlink_domain=1),
        _spec("h100-sxm", "H100 SXM5 80GB", ("NVIDIA H100 80GB HBM3",), (9, 0), 132, 84942979072, 3352320000000,
              52428800, 1.98, {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67, "fp8": 1979},
              XLA_SPECS + "h100_sxm.txtpb"),
        _spec("h100-nvl", "H100 NVL 94GB", ("NVIDIA H100 NVL",), (9, 0), 132, 94 * GB, 3900e9, 50 * 2**20, 1.785,
              {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60, "fp8": 1670.5},
              "H100 NVL datasheet (no public capture)", nvlink_domain=2),
        _spec("h200", "H200 SXM 141GB", ("NVIDIA H200", "NVIDIA H200 141GB HBM3e"), (9, 0), 132, 151397597184,
              4800e9, 52428800, 1.98, {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67, "fp8": 1979},
              XLA_SPECS + "h200.txtpb"),
        # Blackwell. Device numbers: XLA's captures. Peaks: the HGX B200 / HGX B300 datasheets' 8-GPU figures and
        # the GB200 / GB300 NVL72 datasheets' 72-GPU figures, per GPU and halved where printed with sparsity.
        _spec("b200", "B200 (HGX)", ("NVIDIA B200",), (10, 0), 148, 191514411008, 7672320000000, 132644864, 1.965,
              {"bf16": 2250, "fp16": 2250, "tf32": 1100, "fp32": 75, "fp8": 4500, "fp4": 9000},
              XLA_SPECS + "b200.txtpb", peaks_source="HGX B200 datasheet"),
        _spec("gb200", "GB200 NVL72", ("NVIDIA GB200",), (10, 0), 152, 197897748480, 7928064000000, 135528448, 2.062,
              {"bf16": 2500, "fp16": 2500, "tf32": 1250, "fp32": 80, "fp8": 5000, "fp4": 10000},
              XLA_SPECS + "gb200.txtpb", nvlink_domain=72, gpus_per_host=4, peaks_source="GB200 NVL72 datasheet"),
        _spec("b300", "B300 (HGX)", ("NVIDIA B300", "NVIDIA B300 SXM6 AC"), (10, 3), 158, 297021865984, 7936000000000,
              135528448, 1.965, {"bf16": 2250, "fp16": 2250, "tf32": 1125, "fp32": 75, "fp8": 4500, "fp4": 13500},
              XLA_SPECS + "b300.txtpb", peaks_source="HGX B300 datasheet"),
        _spec("gb300", "GB300 NVL72", ("NVIDIA GB300",), (10, 3), 152, 297021079552, 7928064000000, 135528448, 2.07,
              {"bf16": 2500, "fp16": 2500, "tf32": 1250, "fp32": 80, "fp8": 5000, "fp4": 15000},
              XLA_SPECS + "gb300.txtpb", nvlink_domain=72, gpus_per_host=4, peaks_source="GB300 NVL72 datasheet"),
        _spec("rtx-pro-6000", "RTX PRO 6000 Blackwell", ("NVIDIA RTX PRO 6000 Blackwell",
              "NVIDIA RTX PRO 6000 Blackwell Server Edition", "NVIDIA RTX PRO 6000 Blackwell Workstation Edition"),
              (12, 0), 188, 103079215104, 1792000000000, 134217728, 2.6,
              {"bf16": 503.8, "fp16": 503.8, "tf32": 251.9, "fp32": 125, "fp8": 1007.6, "fp4": 2015.2},
              XLA_SPECS + "rtx6000pro.txtpb", nvlink_domain=1,
              peaks_source="RTX Blackwell architecture whitepaper (RTX PRO 6000: 4,000 AI TOPS fp4 with sparsity)"),
    ]
}


# GPU-to-GPU bandwidth inside a node, per GPU and direction (the datasheets print NVLink totals for
# both directions: half of them here); PCIe cards talk over PCIe x16 (gen3 16, gen4 32, gen5 64 GB/s).
LINK_BYTES_PER_S: dict[str, tuple[float, str]] = {
    "v100-16gb": (150e9, "NVLink 2: 300 GB/s total (V100 datasheet)"),
    "v100-32gb": (150e9, "NVLink 2: 300 GB/s total (V100 datasheet)"),
    "t4": (16e9, "PCIe gen3 x16"),
    "a10": (32e9, "PCIe gen4 x16"),
    "l4": (32e9, "PCIe gen4 x16"),
    "rtx-4090": (32e9, "PCIe gen4 x16"),
    "a10g": (32e9, "PCIe gen4 x16"),
    "l40s": (32e9, "PCIe gen4 x16 (no NVLink)"),
    "a100-40gb": (300e9, "NVLink 3: 600 GB/s total (A100 datasheet)"),
    "a100-80gb": (300e9, "NVLink 3: 600 GB/s total (A100 datasheet)"),
    "a100-80gb-pcie": (32e9, "PCIe gen4 x16 (no NVLink bridge assumed)"),
    "h100-pcie": (64e9, "PCIe gen5 x16 (no NVLink bridge assumed)"),
    "h100-sxm": (450e9, "NVLink 4: 900 GB/s total (H100 datasheet)"),
    "h100-nvl": (300e9, "NVLink bridge: 600 GB/s total (H100 NVL datasheet)"),
    "h200": (450e9, "NVLink 4: 900 GB/s total (H200 datasheet)"),
    "b200": (900e9, "NVLink 5: 1.8 TB/s total (HGX B200 datasheet)"),
    "b300": (900e9, "NVLink 5: 1.8 TB/s total (HGX B300 datasheet)"),
    "gb200": (900e9, "NVLink 5: 1.8 TB/s total, 72 GPUs on one NVLink switch fabric (GB200 NVL72 datasheet)"),
    "gb300": (900e9, "NVLink 5: 1.8 TB/s total, 72 GPUs on one NVLink switch fabric (GB300 NVL72 datasheet)"),
    "rtx-pro-6000": (64e9, "PCIe gen5 x16 (no NVLink)"),
}
# Between nodes: one 400 Gb/s InfiniBand NDR port per GPU, as in NVIDIA's DGX H100 reference
# design. An assumption about the cluster, not a property of the GPU: plans say so.
INTER_NODE_BYTES_PER_S = 50e9
INTER_NODE_NOTE = "400 Gb/s InfiniBand per GPU between nodes (DGX H100 reference design; assumed)"


# GPU to host memory, one direction, by architecture (compute capability major): Volta and Turing
# on PCIe gen3 x16, Ampere and Ada on gen4, Hopper and Blackwell on gen5 (XLA's B200 capture: 64 GiB/s).
# What offloaded activations travel over. A Grace-Blackwell GPU reaches its Grace CPU's memory over
# NVLink-C2C instead: 900 GB/s in both directions (GB200 / GB300 NVL72 datasheets).
HOST_LINK_BYTES_PER_S = {7: 16e9, 8: 32e9, 9: 64e9, 10: 64e9, 12: 64e9}
GRACE_HOST_LINK = {"gb200": 450e9, "gb300": 450e9}


def host_link_bandwidth(compute_capability: tuple[int, int] | None, key: str | None = None) -> float | None:
    """Bytes/s between a GPU and pinned host memory (PCIe x16 of its generation, or NVLink-C2C to a Grace
    CPU); None when unknown."""
    if key in GRACE_HOST_LINK:
        return GRACE_HOST_LINK[key]
    return HOST_LINK_BYTES_PER_S.get(compute_capability[0]) if compute_capability else None


# Blackwell Ultra systems pair each GPU with a ConnectX-8 800 Gb/s NIC (HGX B300 and GB300 NVL72
# datasheets); the others are assumed to have the DGX H100 design's 400 Gb/s per GPU.
NIC_BYTES_PER_S = {"b300": 100e9, "gb300": 100e9}


def default_network(key: str) -> float:
    """Each GPU's network bandwidth between link domains, one way, when the request gives none."""
    return NIC_BYTES_PER_S.get(key, INTER_NODE_BYTES_PER_S)


def network_note(network_bytes_per_s: float | None, key: str = "") -> str:
    if not network_bytes_per_s or network_bytes_per_s == INTER_NODE_BYTES_PER_S:
        return INTER_NODE_NOTE
    if key in NIC_BYTES_PER_S and network_bytes_per_s == NIC_BYTES_PER_S[key]:
        return "800 Gb/s ConnectX-8 per GPU between link domains (the system's datasheet; assumed)"
    return f"{network_bytes_per_s * 8 / 1e9:,.0f} Gb/s of network per GPU between nodes (as given)"


def link_bandwidth(key: str, domains: int, domain_gpus: int = 8,
                   network_bytes_per_s: float | None = None) -> tuple[float | None, str]:
    """Bytes/s per GPU of a collective over all the target's GPUs, and why.

    A link domain is the GPUs that share the fast link: a node (NVLink on an HGX board, PCIe between
    PCIe cards) or an NVLink domain that spans nodes (an NVL72 rack). Inside one: the GPU's own link.
    Across domains NCCL runs one ring per NIC, each carrying a 1/domain_gpus share of the data over its
    GPU's NIC, so a GPU's collectives move at most its NIC's bandwidth times the GPUs in a domain, and
    never more than its link inside the domain. `network_bytes_per_s`: each GPU's network bandwidth
    (NICs per GPU x their speed; default `default_network`)."""
    link, note = LINK_BYTES_PER_S.get(key, (None, "unknown interconnect"))
    if domains > 1:
        network = network_bytes_per_s or default_network(key)
        rings = network * max(1, domain_gpus)
        return min(link or rings, rings), (f"{note} inside each domain of {domain_gpus}; between domains "
                                           f"{network_note(network, key)}: {max(1, domain_gpus)} rings, one per NIC, "
                                           f"{min(link or rings, rings) / 1e9:,.0f} GB/s per GPU at most")
    return link, note


@dataclasses.dataclass(frozen=True)
class Links:
    """Bytes/s per GPU, one direction, of the links a collective can cross: inside a link domain (a
    node's NVLink or PCIe, or an NVL72 rack's NVLink) and between domains (each GPU's network share;
    None within one domain)."""

    intra: float | None
    network: float | None = None

    @classmethod
    def of(cls, key: str, domains: int, network_bytes_per_s: float | None = None) -> "Links":
        intra = LINK_BYTES_PER_S.get(key, (None, ""))[0]
        return cls(intra, (network_bytes_per_s or default_network(key)) if domains > 1 else None)

    def for_group(self, group: int, domains: int) -> float | None:
        """A collective over `group` GPUs spanning `domains` link domains: inside one its link; across
        domains one ring per member GPU of a domain, each over that GPU's network share (so the group's
        GPUs per domain times it), never faster than the link inside the domain."""
        if domains <= 1:
            return self.intra
        if not self.network:
            return None  # no figure for the network between them: not timed
        rings = self.network * max(1, group // domains)
        return min(self.intra or rings, rings)


def gpu_spec_for_device_kind(device_kind: str) -> GpuSpec | None:
    """The catalog entry whose device kind is exactly `device_kind` (case and surrounding spaces
    aside), or None: a 16 GB V100 never borrows the 32 GB entry's memory or an H100 NVL the SXM's."""
    wanted = device_kind.strip().lower()
    for spec in GPU_SPECS.values():
        if wanted in (k.lower() for k in spec.device_kinds):
            return spec
    return None


def matmul_unit(precision: str, fp32_matmul: str) -> str:
    """The MATMUL_UNITS key a run's products execute in: its compute dtype, or for fp32 compute
    what fp32 products really run as (see `fp32_matmul_precision`)."""
    return fp32_matmul if precision == "fp32" else "fp8" if precision in ("fp8", "mxfp8") else precision


def compute_capability(device: object) -> tuple[int, int] | None:
    """(major, minor) of a JAX GPU device (its `compute_capability` string, e.g. "9.0"); None elsewhere."""
    text = str(getattr(device, "compute_capability", "") or "")
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0
    except ValueError:
        return None


def fp32_matmul_precision(platform: str, compute_capability: tuple[int, int] | None, setting: str | None) -> str:
    """What fp32 matrix products run as: a MATMUL_UNITS key.

    `setting` is jax_default_matmul_precision. On NVIDIA GPUs XLA runs fp32 products as TF32 on
    compute capability 8.0+ unless the precision is "highest" ("float32"); "high" and "default"
    ("tensorfloat32", "bfloat16", "fastest" and None) all allow TF32 there. An algorithm name
    (`FP32_MATMUL_SETTINGS`: F32_F32_F32, BF16_BF16_F32_X6, ...) names its unit and passes, where the
    GPU has the tensor cores for it. CPUs compute fp32.
    """
    if platform != "gpu" or compute_capability is None:
        return "fp32"
    unit = FP32_MATMUL_SETTINGS.get(str(setting), "tf32")
    return unit if compute_capability >= UNIT_MIN_CC.get(unit, (0, 0)) else "fp32"


# -- CPU: measured once per machine ------------------------------------------------------------

def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown-cpu"


def cpu_peak_flops(precision: str) -> tuple[float, str]:
    """Best FLOP/s of a large matrix product in `precision` on this process's CPU backend.

    Measured once per (CPU model, core count, JAX version, dtype) and cached as JSON. Returns the
    figure and a label saying how it was obtained. Must run inside a worker (JAX initialised).
    """
    # reason: import-time cost: the catalog is read without JAX (config layer, server); this runs in workers
    import jax
    import jax.numpy as jnp

    # CPUs have no fp8 units: fp8 products are emulated (converted and computed wider), measured as bf16
    precision = "bf16" if precision in ("fp8", "mxfp8") else precision
    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]
    key = f"{_cpu_model()}|{os.cpu_count()}|jax {jax.__version__}|{precision}"
    path = compile_cache_dir() / "cpu_peak.json"
    cache = read_json(path, {})
    label = f"measured on this CPU: best of 5 {{n}}x{{n}} {precision} matrix products"
    if key in cache:
        return cache[key]["flops"], cache[key]["label"] + " (cached)"
    n = 2048 if precision == "fp32" else 1024  # CPUs emulate half precision: keep it short
    device = jax.devices("cpu")[0]
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    matmul = jax.jit(lambda x: x @ x)
    matmul(a).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        matmul(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    flops = 2.0 * n**3 / best
    cache[key] = {"flops": flops, "label": label.format(n=n), "measured_at": time.strftime("%Y-%m-%d")}
    write_json_atomic(path, cache)  # a read-only home still gets the figure, just not cached
    return flops, label.format(n=n)


# -- TPUs (migration sources) -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TpuChip:
    """One TPU generation's chip, as Google Cloud's TPU pages state it (per chip)."""

    generation: str
    name: str
    bf16_tflops: float  # dense peak
    int8_tops: float | None  # None: not stated
    fp8_tflops: float | None
    hbm_bytes: int
    bandwidth_bytes_per_s: float  # HBM
    ici_bytes_per_s: float | None  # inter-chip interconnect, bidirectional, per chip (None: not stated)
    torus: str  # "2D" or "3D"
    devices_per_chip: int  # JAX devices: TensorCores on v3 and TPU7x, one per chip (megacore) on v4 and v5p
    cores_in_name: bool  # slice names count TensorCores (two per chip), not chips
    pod_chips: int  # the largest pod (or superpod)
    source: str
    # data-centre network between slices (multislice), per chip and one way: the page's "DCN bandwidth per
    # chip", or its per-host NICs shared by the host's chips; None where the page states none
    dcn_bytes_per_s: float | None = None


# Each figure with the line of the page it comes from: bench/tpu_facts_sources.json (retrieved 2026-12-02).
TPU_CHIPS: dict[str, TpuChip] = {c.generation: c for c in [
    TpuChip("v3", "TPU v3", 123, None, None, 32 * GiB, 900e9, None, "2D", 2, True, 1024,
            "https://cloud.google.com/tpu/docs/v3"),
    TpuChip("v4", "TPU v4", 275, 275, None, 32 * GiB, 1200e9, None, "3D", 1, True, 4096,
            "https://cloud.google.com/tpu/docs/v4"),
    TpuChip("v5e", "TPU v5e", 197, 393, None, 16 * GB, 819e9, 400e9, "2D", 1, False, 256,
            "https://cloud.google.com/tpu/docs/v5e", dcn_bytes_per_s=2 * 100e9 / 8 / 8),  # 2 x 100 Gbps per 8 chips
    TpuChip("v5p", "TPU v5p", 459, None, 459, 95 * GiB, 2765e9, 1200e9, "3D", 1, True, 8960,
            "https://cloud.google.com/tpu/docs/v5p", dcn_bytes_per_s=50e9 / 8),  # 50 Gbps per chip
    TpuChip("v6e", "TPU v6e (Trillium)", 918, 1836, 918, 32 * GB, 1638e9, 800e9, "2D", 1, False, 256,
            "https://cloud.google.com/tpu/docs/v6e", dcn_bytes_per_s=4 * 200e9 / 8 / 8),  # 4 x 200 Gbps per 8 chips
    TpuChip("tpu7x", "TPU7x (Ironwood)", 2307, None, 4614, 192 * GiB, 7380e9, 1200e9, "3D", 2, True, 9216,
            "https://cloud.google.com/tpu/docs/tpu7x", dcn_bytes_per_s=100e9 / 8),  # 100 Gbps per chip
]}


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    key: str
    name: str
    generation: str
    devices: int  # JAX devices in the slice (TensorCores on v3 and TPU7x, chips on v4, v5e, v5p, v6e)
    hbm_bytes_per_device: int
    bf16_tflops_per_device: float
    bandwidth_bytes_per_s_per_chip: float
    topology: str  # for jax.experimental.topologies.get_topology_desc(..., "tpu")

    @property
    def is_pod_slice(self) -> bool:
        return self.devices > 8

    @property
    def chip(self) -> TpuChip:
        return TPU_CHIPS[self.generation]

    @property
    def chips(self) -> int:
        return self.devices // self.chip.devices_per_chip

    def peak_flops(self, unit: str) -> float | None:
        """Dense peak FLOP/s of one JAX device for a matmul unit: the MXU's bf16 rate for bf16, fp16 and fp32
        products (TPUs run fp32 products as bf16 passes at JAX's default precision); int8 and fp8 where the
        chip states them."""
        per_chip = {"int8": self.chip.int8_tops, "fp8": self.chip.fp8_tflops}.get(unit, self.chip.bf16_tflops)
        return None if per_chip is None else per_chip * TFLOPS / self.chip.devices_per_chip

    @property
    def bandwidth_bytes_per_s(self) -> float:
        """HBM bandwidth of one JAX device (its share of the chip's)."""
        return self.chip.bandwidth_bytes_per_s / self.chip.devices_per_chip

    @property
    def ici_bytes_per_s(self) -> float | None:
        """What one JAX device sends over the chip's inter-chip links, one way (half the stated
        bidirectional figure, shared by the chip's devices); None where the page states none."""
        ici = self.chip.ici_bytes_per_s
        return None if ici is None else ici / 2 / self.chip.devices_per_chip

    def named(self, slices: int = 1) -> str:
        """The slice's name, or the job's over several slices: "2 × TPU v5p-512"."""
        return self.name if slices == 1 else f"{slices} × {self.name}"

    @property
    def dcn_bytes_per_s(self) -> float | None:
        """What one JAX device sends over the data-centre network to other slices, one way (its share of the
        chip's); None where the page states none."""
        dcn = self.chip.dcn_bytes_per_s
        return None if dcn is None else dcn / self.chip.devices_per_chip

    @property
    def compile_options(self) -> dict[str, Any]:
        """libtpu's description of the slice for a compile without its chips, as live Cloud TPU hosts
        configure them (MaxText's and AXLearn's ahead-of-time compiles): v4 and v5p in megacore mode, one
        JAX device per chip; the others one device per TensorCore; hosts of 2 x 2 chips (a one-chip VM
        alone); one slice."""
        megacore = self.generation in ("v4", "v5p")
        return {"chip_config_name": "megacore" if megacore else "default",
                "chips_per_host_bounds": (1, 1, 1) if self.chips == 1 else (2, 2, 1), "num_slices": 1}


def _tpu_slice(generation: str, size: int, shape: str) -> TpuSpec:
    """The slice a user rents as `<generation>-<size>` (v5e's API name: v5litepod-<size>), of `shape` chips."""
    chip = TPU_CHIPS[generation]
    chips = math.prod(int(d) for d in shape.split("x"))
    if chips != (size // 2 if chip.cores_in_name else size):
        raise ValueError(f"{generation}-{size}: topology {shape} has {chips} chips")
    devices = chips * chip.devices_per_chip
    key = f"{generation}-{size}" if generation == "tpu7x" else f"tpu-{generation}-{size}"
    alias = {"v5e": f" (v5litepod-{size})", "v6e": " (Trillium)", "tpu7x": " (Ironwood)"}.get(generation, "")
    name = f"TPU {generation}-{size}{alias}" if generation != "tpu7x" else f"TPU7x-{size}{alias}"
    return TpuSpec(key, name, generation, devices, chip.hbm_bytes // chip.devices_per_chip,
                   chip.bf16_tflops / chip.devices_per_chip, chip.bandwidth_bytes_per_s, f"{generation}:{shape}")


# The slices a user can rent, by the name Google Cloud gives them, and their chip topology: the TPU pages'
# topology tables (v4, v5e, v5p; v5p's largest single slice is v5p-12288) and XPK's system characteristics
# (https://github.com/AI-Hypercomputer/xpk/blob/367c838253bea41e7d7716145ad6513f44c1a21e/src/xpk/core/
# system_characteristics.py) for v6e and TPU7x. v3, v4, v5p and TPU7x names count TensorCores (two per chip);
# v5e and v6e names count chips.
_TPU_SLICES = {
    "v3": {8: "2x2", 32: "4x4"},
    "v4": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 384: "4x4x12", 512: "4x8x8",
           1024: "8x8x8", 1536: "8x8x12", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16"},
    "v5e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "v5p": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8",
            1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16", 12288: "16x16x24"},
    "v6e": {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"},
    "tpu7x": {8: "2x2x1", 16: "2x2x2", 32: "2x2x4", 64: "2x4x4", 128: "4x4x4", 256: "4x4x8", 512: "4x8x8",
              1024: "8x8x8", 2048: "8x8x16", 4096: "8x16x16", 8192: "16x16x16"},
}
TPU_SPECS: dict[str, TpuSpec] = {
    s.key: s for s in (_tpu_slice(g, size, shape) for g, slices in _TPU_SLICES.items() for size, shape in slices.items())
}


_SLICE_NAME = re.compile(r"^\s*(?:(\d{1,3})\s*[x×]\s*)?(?:tpu-?)?(v\d[a-z]?|v5litepod|7x)-(\d{1,5})\s*$")


def parse_tpu_slice(text: Any, field: str = "source") -> tuple[str, int]:
    """The catalog key and the slice count of a TPU job named as users and Google Cloud name it: a catalog
    key ("tpu-v5p-1024"), an accelerator type ("v5p-1024", "v5litepod-256", "tpu7x-128"), or several
    slices ("2xv6e-256", "4 x v5p-512"). ConfigError naming `field` and what is allowed otherwise."""
    from migration.common import ConfigError, shown  # reason: the catalogs here raise the config layer's error

    if isinstance(text, str) and text in TPU_SPECS:
        return text, 1
    found = _SLICE_NAME.match(text.lower()) if isinstance(text, str) and len(text) <= 40 else None
    if found:
        count, generation, size = int(found.group(1) or 1), found.group(2), int(found.group(3))
        generation = {"v5litepod": "v5e", "7x": "tpu7x"}.get(generation, generation)
        key = f"{generation}-{size}" if generation == "tpu7x" else f"tpu-{generation}-{size}"
        if key in TPU_SPECS and 1 <= count <= 64:
            return key, count
        if key in TPU_SPECS:
            raise ConfigError(field, f"a job of 1 to 64 slices; got {count} x {key}")
        sizes = _TPU_SLICES.get(generation)
        if sizes:
            raise ConfigError(field, f"{generation} slices are {', '.join(f'{generation}-{n}' for n in sizes)}; "
                                     f"got {shown(text)}")
    raise ConfigError(field, f"a TPU slice as Google Cloud names it (v5p-1024, v5litepod-256, v6e-256, tpu7x-128), "
                             f"a catalog key (tpu-v5p-1024) or N slices of one (2xv6e-256); got {shown(text)}")


# -- XLA GPU target description, for compiling without the device ----------------------------

# Per-compute-capability limits (CUDA C Programming Guide, "Compute Capabilities"):
# (shared_memory_per_core, shared_memory_per_block_optin, threads_per_core_limit, fpus_per_core)
_CC_LIMITS: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (7, 0): (98304, 98304, 2048, 64),
    (7, 5): (65536, 65536, 1024, 64),
    (8, 0): (167936, 166912, 2048, 64),
    (8, 6): (102400, 101376, 1536, 128),
    (8, 9): (102400, 101376, 1536, 128),
    (9, 0): (233472, 232448, 2048, 128),
    (10, 0): (233472, 232448, 2048, 128),  # and 10.3, 12.0: XLA's b200 / b300 / rtx6000pro captures
    (10, 3): (233472, 232448, 2048, 128),
    (12, 0): (131072, 101376, 1536, 128),
}


def _installed_version(*names: str) -> tuple[int, int] | None:
    from importlib import metadata  # reason: import-time cost: read only when a target config is built

    for name in names:
        try:
            parts = metadata.version(name).split(".")
            return int(parts[0]), int(parts[1])
        except (metadata.PackageNotFoundError, ValueError, IndexError):
            continue
    return None


def gpu_target_config(spec: GpuSpec) -> str:
    """XLA `GpuTargetConfig` text proto describing `spec`, for a deviceless compile.

    cuDNN and CUDA versions are those of the installed CUDA wheels (what the compile links
    against); the device numbers are the catalog entry's (see its `source`).
    """
    shared_core, shared_optin, threads_core, fpus = _CC_LIMITS[spec.compute_capability]
    dnn = _installed_version("nvidia-cudnn-cu12", "nvidia-cudnn-cu13") or (9, 8)
    cuda = _installed_version("nvidia-cuda-runtime-cu12", "nvidia-cuda-runtime") or (12, 8)
    major, minor = spec.compute_capability
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {shared_core}
  threads_per_core_limit: {threads_core}
  core_count: {spec.sm_count}
  fpus_per_core: {fpus}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(spec.bandwidth_bytes_per_s)}
  l2_cache_size: {spec.l2_bytes}
  clock_rate_ghz: {spec.clock_ghz}
  device_memory_size: {spec.memory_bytes}
  shared_memory_per_block_optin: {shared_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {dnn[0]} minor: {dnn[1]} }}
runtime_version {{ major: {cuda[0]} minor: {cuda[1]} }}
device_description_str: "{spec.name}"
"""


# -- NVIDIA GPUs present: NVML, which never touches a CUDA context ---------------------------

def nvidia_gpus() -> list[dict[str, Any]]:
    """NVIDIA GPUs seen by NVML, with memory in use by other processes. Empty without a driver."""
    try:
        import pynvml  # reason: optional (nvidia-ml-py); absent on machines without the driver's library
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            try:
                procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except pynvml.NVMLError:
                procs = []
            others = [
                {"pid": p.pid, "used_bytes": p.usedGpuMemory}
                for p in procs
                if p.pid != os.getpid()
            ]
            name = pynvml.nvmlDeviceGetName(h)
            gpus.append({
                "index": i,
                "name": name.decode() if isinstance(name, bytes) else name,
                "total_bytes": mem.total,
                "used_bytes": mem.used,
                "free_bytes": mem.free,
                "other_processes": others,
                "used_by_other_processes_bytes": sum(p["used_bytes"] or 0 for p in others),
            })
        return gpus
    finally:
        pynvml.nvmlShutdown()
