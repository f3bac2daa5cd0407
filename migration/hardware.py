"""Accelerator facts in one table, and the peak FLOP/s that MFU is measured against.

GPU figures are the vendors' datasheet numbers (dense, i.e. without structured sparsity; the
datasheets print the sparse figure twice as large). Sources: NVIDIA V100, T4, A10, L4, A100, H100
and H200 datasheets; NVIDIA Ada GPU architecture whitepaper (RTX 4090, fp32-accumulate tensor
rate); CUDA C Programming Guide, "Compute Capabilities" table (per-SM limits). TPU figures: Google
Cloud TPU system-architecture pages. See also ../shared/reference/hardware.md.

On the CPU backend there is no datasheet peak worth the name: the worker measures one large
matrix product per dtype once per machine and caches it (see `cpu_peak_flops`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from pathlib import Path

GB = 1000**3
GiB = 1024**3
TFLOPS = 1e12


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    key: str
    name: str
    device_kind_pattern: str  # regex on jax Device.device_kind
    compute_capability: tuple[int, int]
    sm_count: int
    memory_bytes: int
    bandwidth_bytes_per_s: float
    l2_bytes: int
    clock_ghz: float
    peak_tflops: dict[str, float]  # dense tensor-core (or plain fp32) peaks by compute dtype
    bf16_native: bool

    def peak_flops(self, precision: str, fp32_matmul: str = "tf32") -> float | None:
        """Dense peak for the dtype the matrix products run in (fp32 may run as TF32)."""
        key = "tf32" if precision == "fp32" and fp32_matmul == "tf32" else precision
        value = self.peak_tflops.get(key)
        return None if value is None else value * TFLOPS


GPU_SPECS: dict[str, GpuSpec] = {
    s.key: s
    for s in [
        GpuSpec("v100-32gb", "V100 SXM2 32GB", r"V100", (7, 0), 80, 32 * GB, 900e9, 6 * 2**20, 1.53,
                {"fp16": 125, "fp32": 15.7}, False),
        GpuSpec("t4", "T4", r"\bT4\b", (7, 5), 40, 16 * GB, 320e9, 4 * 2**20, 1.59,
                {"fp16": 65, "fp32": 8.1}, False),
        GpuSpec("a10", "A10", r"\bA10\b(?!0)", (8, 6), 72, 24 * GB, 600e9, 6 * 2**20, 1.695,
                {"bf16": 125, "fp16": 125, "tf32": 62.5, "fp32": 31.2}, True),
        GpuSpec("l4", "L4", r"\bL4\b", (8, 9), 58, 24 * GB, 300e9, 48 * 2**20, 2.04,
                {"bf16": 121, "fp16": 121, "tf32": 60, "fp32": 30.3}, True),
        GpuSpec("rtx-4090", "GeForce RTX 4090", r"4090", (8, 9), 128, 24 * GB, 1008e9, 72 * 2**20, 2.52,
                {"bf16": 165, "fp16": 165, "tf32": 82.6, "fp32": 82.6}, True),
        GpuSpec("a100-40gb", "A100 SXM4 40GB", r"A100.*40GB", (8, 0), 108, 40 * GB, 1555e9, 40 * 2**20, 1.41,
                {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}, True),
        GpuSpec("a100-80gb", "A100 SXM4 80GB", r"A100", (8, 0), 108, 80 * GB, 2039e9, 40 * 2**20, 1.41,
                {"bf16": 312, "fp16": 312, "tf32": 156, "fp32": 19.5}, True),
        GpuSpec("h100-pcie", "H100 PCIe 80GB", r"H100.*PCIe", (9, 0), 114, 80 * GB, 2000e9, 50 * 2**20, 1.755,
                {"bf16": 756, "fp16": 756, "tf32": 378, "fp32": 51}, True),
        GpuSpec("h100-sxm", "H100 SXM5 80GB", r"H100", (9, 0), 132, 80 * GB, 3350e9, 50 * 2**20, 1.98,
                {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67}, True),
        GpuSpec("h200", "H200 SXM 141GB", r"H200", (9, 0), 132, 141 * GB, 4800e9, 50 * 2**20, 1.98,
                {"bf16": 989, "fp16": 989, "tf32": 494.7, "fp32": 67}, True),
    ]
}


def gpu_spec_for_device_kind(device_kind: str) -> GpuSpec | None:
    """The catalog entry a JAX device kind (e.g. 'NVIDIA H100 80GB HBM3') belongs to, if any.

    Entries are tried in table order, so the more specific pattern of a family comes first.
    """
    for spec in GPU_SPECS.values():
        if re.search(spec.device_kind_pattern, device_kind, flags=re.IGNORECASE):
            return spec
    return None


# -- CPU: measured once per machine ------------------------------------------------------------

def _cache_dir() -> Path:
    return Path(os.environ.get("MIGRATION_CACHE_DIR", Path.home() / ".cache" / "tpu-gpu-migration"))


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
    import jax
    import jax.numpy as jnp

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "fp16": jnp.float16}[precision]
    key = f"{_cpu_model()}|{os.cpu_count()}|jax {jax.__version__}|{precision}"
    path = _cache_dir() / "cpu_peak.json"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
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
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home still gets the figure, just not cached
    return flops, label.format(n=n)


# -- TPUs (migration sources) -------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class TpuSpec:
    key: str
    name: str
    generation: str
    devices: int  # JAX devices in the slice (TensorCores on v2/v3, chips from v4 on)
    hbm_bytes_per_device: int
    bf16_tflops_per_device: float
    bandwidth_bytes_per_s_per_chip: float
    topology: str  # for jax.experimental.topologies.get_topology_desc(..., "tpu")


TPU_SPECS: dict[str, TpuSpec] = {
    s.key: s
    for s in [
        # v3: two TensorCores per chip, each its own JAX device with 16 GiB; 123 TFLOP/s per chip.
        TpuSpec("tpu-v3-8", "TPU v3-8", "v3", 8, 16 * GiB, 123 / 2, 900e9, "v3:2x2"),
        TpuSpec("tpu-v4-8", "TPU v4-8", "v4", 4, 32 * GiB, 275, 1228e9, "v4:2x2x1"),
        TpuSpec("tpu-v5e-8", "TPU v5e-8 (v5 lite)", "v5e", 8, 16 * GB, 197, 819e9, "v5e:2x4"),
        TpuSpec("tpu-v5p-8", "TPU v5p-8", "v5p", 4, 95 * GB, 459, 2765e9, "v5p:2x2x1"),
        TpuSpec("tpu-v6e-8", "TPU v6e-8 (Trillium)", "v6e", 8, 32 * GB, 918, 1640e9, "v6e:2x4"),
    ]
}


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
}


def _installed_version(*names: str) -> tuple[int, int] | None:
    from importlib import metadata

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
    against); the device numbers are the datasheet's.
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
