"""The allowed values of every config field, in one place, and the error that names a bad one: the
choices (precisions, remat policies, shardings, step styles, platforms) and the numeric ranges that
validation, the form and the CLI's help all read. The standard library only.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from migration.common import ConfigError, shown

Precision = Literal["fp32", "bf16", "fp16", "fp8", "mxfp8"]
FP8_PRECISIONS = ("fp8", "mxfp8")  # bf16 compute with fp8 Linear products (migration/step/fp8.py)
RematName = Literal["none", "dots", "dots_no_batch", "save_dot_except_mlp", "save_qkv", "offload_dot_except_mlp",
                    "full"]
# The activations each named policy saves (or offloads to host memory): names a model tags with
# `checkpoint_name`. A named policy applies only to a workload whose `checkpoint_names` include them.
REMAT_NAMED: dict[str, tuple[str, ...]] = {
    "save_dot_except_mlp": ("query_proj", "kv_proj", "attention_out", "attention_proj"),
    "save_qkv": ("query_proj", "kv_proj"),
    "offload_dot_except_mlp": ("query_proj", "kv_proj", "attention_out", "attention_proj"),
}
Platform = Literal["auto", "cpu", "gpu"]
# How parameters, gradients and optimizer state live on the devices (see migration/step/train.py): the
# choices a form offers; hybrid:G and +tpT layouts are written out (migration/config/layouts.py).
Sharding = Literal["replicated", "fsdp"]
SHARDINGS: tuple[str, ...] = get_args(Sharding)
# The step a run times: "jit" is the migrated step (migration/step/train.py); "pmap" is the TPU-era step
# as the guide writes it (pmap over the devices, lax.pmean of the gradients, replicated state).
StepStyle = Literal["jit", "pmap"]
STEP_STYLES: tuple[str, ...] = get_args(StepStyle)

# jax_default_matmul_precision of a run: "default" leaves the platform's (TF32 for fp32 products on
# NVIDIA compute capability 8.0+), "highest" computes fp32 products in fp32 (the fp32 reference).
MatmulPrecision = Literal["default", "highest"]
MATMUL_PRECISIONS: tuple[str, ...] = get_args(MatmulPrecision)

PRECISIONS: tuple[str, ...] = get_args(Precision)
REMAT_NAMES: tuple[str, ...] = get_args(RematName)
PLATFORMS: tuple[str, ...] = get_args(Platform)

# Allowed ranges, in one place: validation and the CLI's help both read them.
LIMITS: dict[str, tuple[float, float]] = {
    "per_device_batch": (1, 65536),
    "devices": (1, 256),  # the job's global count: several hosts of a multi-process job together
    "accumulation_steps": (1, 1024),
    "steps": (1, 100_000),
    "warmup_steps": (0, 99_999),
    "learning_rate": (1e-8, 1.0),
    "tpu_step_ms": (0.001, 3_600_000.0),  # the user's measured TPU step time (0: not given)
    "seed": (0, 2**31 - 1),
    "timeout_s": (1, 7 * 24 * 3600),
    "silence_timeout_s": (2, 3600),
    "memory_fraction": (0.05, 1.0),
    "profile_steps": (0, 20),
    "num_processes": (1, 1024),
    "process_id": (0, 1023),
}


Granularity = Literal["multiple8", "pow2"]
GRANULARITIES: tuple[str, ...] = get_args(Granularity)

PLAN_LIMITS: dict[str, tuple[float, float]] = {
    "global_batch": (1, 1_048_576),
    "per_core_batch": (1, 65536),
    "gpus": (1, 4096),  # 512 nodes of 8: the size of job a large TPU pod slice moves to
    "gpus_per_node": (1, 16),
    "network_gbps": (0, 12800),  # each GPU's network between nodes, Gb/s (0: one 400 Gb/s port, assumed)
    "train_tokens": (1e6, 1e16),  # tokens (or examples) the comparison's time and cost are for: 1M to 10 quadrillion
    "source_slices": (1, 64),  # TPU slices of the source job, joined by the data-centre network (multislice)
    "memory_fraction": (0.05, 1.0),
    "safety_margin": (0.0, 0.5),
    "max_per_device_batch": (1, 65536),
    "timeout_s": (10, 7200),
    "silence_timeout_s": (2, 3600),
}


def check_int(cfg: Any, field: str) -> None:
    """`cfg.<field>` is an int (not a bool) within `LIMITS[field]`."""
    value = getattr(cfg, field)
    lo, hi = LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(field, f"must be an integer from {int(lo)} to {int(hi)}; got {shown(value)}")
