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
# A policy of its own for each tagged activation ("custom:NAME=WHERE,..."; WHERE device: kept on the device,
# offload: kept in pinned host memory; a name not listed is recomputed): MaxText's `remat_policy: custom`,
# in this product's names. The TPU recipes' policies are of this form.
CUSTOM_REMAT = "custom:"
REMAT_TENSORS = ("decoder_layer_input", "query_proj", "kv_proj", "attention_out", "attention_proj", "mlp_hidden",
                 "mlp_out")
REMAT_WHERE = ("device", "offload")
# MaxText's tensor names (its checkpoint_name tags) as this product's; MaxText's `remat` (recompute) is a
# name left out. Keys and values are one fused projection here, the queries apart.
MAXTEXT_TENSORS: dict[str, tuple[str, ...]] = {
    "decoder_layer_input": ("decoder_layer_input",), "query_proj": ("query_proj",), "key_proj": ("kv_proj",),
    "value_proj": ("kv_proj",), "qkv_proj": ("query_proj", "kv_proj"), "context": ("attention_out",),
    "out_proj": ("attention_proj",), "mlpwi": ("mlp_hidden",), "mlpwi_0": ("mlp_hidden",),
    "mlpwi_1": ("mlp_hidden",), "mlpwo": ("mlp_out",),
}


def custom_remat(where: dict[str, str]) -> str:
    """The canonical name of the policy keeping each of `where`'s tensors on the device or offloaded."""
    kept = {k: v for k, v in where.items() if v in REMAT_WHERE}
    return CUSTOM_REMAT + ",".join(f"{k}={kept[k]}" for k in REMAT_TENSORS if k in kept)


def parse_custom_remat(name: str) -> dict[str, str]:
    """{tensor: "device" | "offload"} of a "custom:..." policy name; ConfigError for any other text."""
    body = name.removeprefix(CUSTOM_REMAT)
    where: dict[str, str] = {}
    for part in filter(None, body.split(",")):
        tensor, _, place = part.strip().partition("=")
        if tensor not in REMAT_TENSORS or place not in REMAT_WHERE:
            raise ConfigError("remat", f"a custom policy is custom:NAME=WHERE,... with NAME one of "
                                       f"{', '.join(REMAT_TENSORS)} and WHERE device or offload; got {shown(part)}")
        where[tensor] = place
    return where


# MaxText's remat_policy names (layers.decoders' policy table) as this product's policies: the same tensors
# kept, in this product's names. minimal_offloaded offloads every tagged product (MaxText's offloads every
# product without a batch dimension); minimal_with_context and minimal_flash keep what minimal keeps (the
# attention output of a fused kernel is no product here).
MAXTEXT_REMAT: dict[str, str] = {
    "none": "none", "minimal": "dots_no_batch", "minimal_with_context": "dots_no_batch",
    "minimal_flash": "dots_no_batch", "full": "full",
    "save_dot_with_context_except_mlp": "save_dot_except_mlp", "save_qkv_proj": "save_qkv",
    "save_dot_except_mlp": custom_remat({"query_proj": "device", "kv_proj": "device", "attention_proj": "device"}),
    "save_dot_except_mlpwi": custom_remat({"query_proj": "device", "kv_proj": "device", "attention_proj": "device",
                                           "mlp_out": "device"}),
    "save_out_proj": custom_remat({"attention_proj": "device"}),
    "qkv_proj_offloaded": custom_remat({"query_proj": "offload", "kv_proj": "offload"}),
    "minimal_offloaded": custom_remat({t: "offload" for t in REMAT_TENSORS if t != "decoder_layer_input"}),
}


def maxtext_custom(tensors: dict[str, str]) -> str:
    """MaxText's `remat_policy: custom` with its per-tensor keys ({"decoder_layer_input": "offload", ...}; a
    value `remat` recomputes) as this product's policy; a tensor two of MaxText's names share takes the one
    that keeps the most (device over offload over recompute). ConfigError for a name or place not MaxText's."""
    rank = {"remat": 0, "offload": 1, "device": 2}
    where: dict[str, str] = {}
    for name, place in tensors.items():
        if name not in MAXTEXT_TENSORS or place not in rank:
            raise ConfigError("remat", f"MaxText's custom policy names {', '.join(MAXTEXT_TENSORS)}, each device, "
                                       f"offload or remat; got {shown(name)}={shown(place)}")
        for ours in MAXTEXT_TENSORS[name]:
            if rank[place] > rank.get(where.get(ours, "remat"), 0):
                where[ours] = place
    return custom_remat(where)


def remat_named(remat: str) -> tuple[str, ...]:
    """The tagged activations a policy keeps (on the device or offloaded); () for the others."""
    if remat.startswith(CUSTOM_REMAT):
        return tuple(parse_custom_remat(remat))
    return REMAT_NAMED.get(remat, ())


def check_remat_name(field: str, value: Any, maxtext: bool = False) -> str:
    """`value` as a policy of this product (one of REMAT_NAMES or a custom one; with `maxtext`, MaxText's
    names too, translated, MaxText's meaning first where a name is both), or ConfigError naming `field` and
    what is allowed."""
    if isinstance(value, str) and value.startswith(CUSTOM_REMAT):
        try:
            return custom_remat(parse_custom_remat(value))
        except ConfigError as exc:
            raise ConfigError(field, exc.message) from None
    if maxtext and value in MAXTEXT_REMAT:  # MaxText's meaning first: its save_dot_except_mlp keeps no context
        return MAXTEXT_REMAT[value]
    if value in REMAT_NAMES:
        return value
    allowed = list(REMAT_NAMES) + ([n for n in MAXTEXT_REMAT if n not in REMAT_NAMES] if maxtext else [])
    raise ConfigError(field, f"must be one of {', '.join(allowed)}, or custom:NAME=device|offload,... (NAME one of "
                             f"{', '.join(REMAT_TENSORS)}); got {shown(value)}")


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

# The dtype of AdamW's first moment (optax's and MaxText's `mu_dtype`): float32 by default; bfloat16 saves 2
# bytes a parameter (MaxText's large MoE recipes set it). The second moment stays float32 in both.
MomentDtype = Literal["float32", "bfloat16"]
MOMENT_DTYPES: tuple[str, ...] = get_args(MomentDtype)
MOMENT_BYTES = {"float32": 4, "bfloat16": 2}


def state_bytes_per_param(mu_dtype: str = "float32", gradients: bool = True) -> int:
    """Bytes a parameter of the training state holds, all live during the update: the float32 parameter
    (4), AdamW's first moment in `mu_dtype` and its second in float32 (4), and with `gradients` the float32
    gradient (4): 16, or 14 with a bfloat16 first moment."""
    return 4 + MOMENT_BYTES[mu_dtype] + 4 + (4 if gradients else 0)

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
    "source_tensor": (1, 256),  # tensor parallelism inside a slice of the source job (ici_tensor_parallelism)
    "source_expert": (1, 256),  # expert parallelism inside a slice of the source job (ici_expert_parallelism)
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
