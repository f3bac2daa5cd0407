"""Run configuration: one frozen dataclass, validated once at the edge.

Validation returns messages a user can act on: which field is wrong, what it got, what is allowed.
This module imports no JAX at module level, so a worker can validate before it sets JAX's
environment.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from migration.common import ConfigError, one_of, shown
from migration.config.distributed import check_distributed
from migration.config.layouts import Layout, parse_layout
from migration.config.limits import (
    LIMITS,
    MATMUL_PRECISIONS,
    MOMENT_DTYPES,
    PLATFORMS,
    PRECISIONS,
    FP8_PRECISIONS,
    REMAT_NAMED,
    REMAT_NAMES,
    SHARDINGS,
    STEP_STYLES,
    GRANULARITIES,
    PLAN_LIMITS,
    Granularity,
    MatmulPrecision,
    MomentDtype,
    Platform,
    Precision,
    RematName,
    Sharding,
    StepStyle,
    check_int,
    check_remat_name,
    remat_named,
)
from migration.hardware import GPU_SPECS, TPU_SPECS
from migration.prices import checked_key, checked_price

@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one measured training run.

    global batch per optimizer step = per_device_batch * devices * accumulation_steps.
    """

    workload: str = "transformer"
    preset: str = "tiny"
    # Overrides of the preset's dimensions (field -> value, e.g. {"n_layers": 4}); checked by the workload.
    model: dict[str, Any] = dataclasses.field(default_factory=dict)
    per_device_batch: int = 8
    devices: int = 1
    sharding: str = "replicated"  # a layout name (migration/config/layouts.py)
    step_style: StepStyle = "jit"
    precision: Precision = "fp32"
    remat: RematName = "none"
    matmul_precision: MatmulPrecision = "default"  # "highest": fp32 products in fp32 (the fp32 reference)
    accumulation_steps: int = 1
    steps: int = 20
    warmup_steps: int = 2
    learning_rate: float = 3e-3
    seed: int = 0
    timeout_s: float = 600.0
    # A worker that sends nothing (not even its heartbeat) for this long is hung: killed, `timeout`.
    silence_timeout_s: float = 120.0
    # Environment of the worker (read by JAX only before it initialises).
    platform: Platform = "auto"
    memory_fraction: float = 0.8
    preallocate: bool = False
    xla_flags: str = ""
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES, e.g. "0" or "0,1"; empty: leave as is
    # Profile capture: this many extra steps after the timed ones, under jax.profiler.trace.
    profile_steps: int = 0
    profile_dir: str = ""
    # One job across several processes (migration/config/distributed.py): "" runs one process; "auto" lets
    # JAX detect the cluster (SLURM, Open MPI, ...); "host:port" is process 0's host and a free port
    # there, with this process's `process_id` of `num_processes`. `devices` is then the job's global count.
    coordinator: str = ""
    num_processes: int = 1
    process_id: int = 0
    # Checkpoints (migration/running/checkpoint.py): absolute folder paths; empty: none. The run starts from
    # the state in `restore_checkpoint` and writes its state after its last step to `save_checkpoint`.
    save_checkpoint: str = ""
    restore_checkpoint: str = ""
    mu_dtype: MomentDtype = "float32"  # AdamW's first moment (optax's and MaxText's mu_dtype)

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.devices * self.accumulation_steps

    def to_dict(self) -> dict[str, Any]:
        return without_defaults(dataclasses.asdict(self), LATER_DEFAULTS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        return validate(_construct(cls, data))


# Fields added after configurations were first stored and keyed: left out of `to_dict` at their default, so
# a configuration that does not use them keeps the key (a cache's, a record's) it had before they existed.
LATER_DEFAULTS: dict[str, Any] = {"mu_dtype": "float32", "source_all_gathers": False}


def without_defaults(data: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if not (k in later and v == later[k])}


def _construct(cls: type, data: dict[str, Any]) -> Any:
    """`cls(**data)`, refusing unknown fields by name (validation is the caller's)."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(unknown[0], f"unknown field; allowed fields are {', '.join(sorted(names))}")
    return cls(**data)


def _check_float(cfg: RunConfig, field: str) -> None:
    value = getattr(cfg, field)
    lo, hi = LIMITS[field]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and _finite(value)
    if not ok or not lo <= value <= hi:
        raise ConfigError(field, f"must be a number from {lo:g} to {hi:g}; got {shown(value)}")


def _finite(value: float) -> bool:
    """`math.isfinite` that also takes ints too large for a float (they are finite)."""
    return isinstance(value, int) or math.isfinite(value)


def _check_choice(cfg: RunConfig, field: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, field)
    if value not in allowed:
        raise ConfigError(field, f"must be one of {one_of(allowed)}; got {shown(value)}")


def check_model(obj: Any) -> Any:
    """The workload (registered, or a reference where this process allows them), its preset and
    the dimension overrides in `obj.model`; returns the resolved model config."""
    # reason: workloads import JAX (not its backend); kept out of this module's import
    from workloads import WORKLOADS, ModelConfigError, WorkloadError, is_reference, resolve_workload

    if not (isinstance(obj.workload, str) and (obj.workload in WORKLOADS or is_reference(obj.workload))):
        raise ConfigError("workload", f"must be one of {', '.join(WORKLOADS)}; got {shown(obj.workload)}")
    try:
        workload = resolve_workload(obj.workload)
    except WorkloadError as exc:
        raise ConfigError("workload", str(exc)) from None
    _check_choice(obj, "preset", tuple(workload.presets))
    if not isinstance(obj.model, dict) or not all(isinstance(k, str) for k in obj.model):
        raise ConfigError("model", f"must map dimension names to values, e.g. {{\"n_layers\": 4}}; got {shown(obj.model)}")
    try:
        return workload.config(obj.preset, obj.model)
    except ModelConfigError as exc:
        raise ConfigError(exc.field, str(exc).split(": ", 1)[1]) from None


def check_attention(cfg: Any, model_cfg: Any, platform: str) -> None:
    """cuDNN's fused attention exists on NVIDIA GPUs only, in bf16 or fp16: refused on the CPU
    backend (`platform` as resolved, where the caller can) and in fp32, naming what runs instead. TPU's
    splash kernel is compiled for a TPU slice only (the TPU side of a plan): a run here never takes it."""
    if getattr(model_cfg, "attention", None) == "splash":
        raise ConfigError("attention", "splash (Pallas' TPU kernel) runs on TPUs only; a run here uses cudnn (the "
                                       "fused kernel, NVIDIA GPUs) or xla")
    if getattr(model_cfg, "attention", None) != "cudnn":
        return
    if cfg.precision == "fp32":
        raise ConfigError("attention", "cudnn (the fused kernel) computes in bf16 or fp16 only; with precision fp32 "
                                       "use attention xla")
    if platform == "cpu":
        raise ConfigError("attention", "cudnn (the fused kernel) needs an NVIDIA GPU; on the CPU backend use "
                                       "attention xla")


def check_precision_platform(cfg: Any, platform: str) -> None:
    """mxfp8 is cuDNN's block-scaled GEMM, which the CPU backend has no lowering for: refused there (`platform`
    as resolved, where the caller can), naming the per-tensor fp8 that runs there (emulated)."""
    if cfg.precision == "mxfp8" and platform == "cpu":
        raise ConfigError("precision", "mxfp8 (block-scaled, cuDNN) runs on Blackwell GPUs only; on the CPU backend "
                                       "use fp8 (per-tensor scaling, emulated there)")


def remat_unavailable(workload: Any, remat: str) -> str | None:
    """Why `remat` does not apply to `workload` (a named policy needs the model to tag the activations it
    saves; an adapter's model may name no blocks to recompute), or None where it does."""
    return workload.remat_unavailable(remat, remat_named(remat))


def remat_applies(workload: Any, remat: str) -> bool:
    return remat_unavailable(workload, remat) is None


def check_remat_applies(obj: Any) -> None:
    # reason: workloads import JAX (not its backend); kept out of this module's import
    from workloads import resolve_workload

    workload = resolve_workload(obj.workload)
    why = remat_unavailable(workload, obj.remat)
    if why:
        usable = ", ".join(r for r in REMAT_NAMES if remat_applies(workload, r))
        raise ConfigError("remat", f"{obj.remat} does not apply to {obj.workload}: {why}; allowed for it: {usable}")


def validate(cfg: RunConfig) -> RunConfig:
    """Return `cfg` unchanged if valid; raise ConfigError naming the first bad field otherwise."""
    check_attention(cfg, check_model(cfg), cfg.platform)
    for field in ("per_device_batch", "devices", "accumulation_steps", "steps", "warmup_steps", "seed", "profile_steps"):
        check_int(cfg, field)
    for field in ("learning_rate", "timeout_s", "silence_timeout_s", "memory_fraction"):
        _check_float(cfg, field)
    _check_choice(cfg, "precision", PRECISIONS)
    check_precision_platform(cfg, cfg.platform)
    check_remat_name("remat", cfg.remat)
    _check_choice(cfg, "matmul_precision", MATMUL_PRECISIONS)
    _check_choice(cfg, "mu_dtype", MOMENT_DTYPES)
    check_remat_applies(cfg)
    check_run_layout(cfg)
    _check_choice(cfg, "step_style", STEP_STYLES)
    if cfg.step_style == "pmap" and cfg.sharding != "replicated":
        raise ConfigError("step_style", "pmap replicates the state on every device; use sharding replicated with it")
    _check_choice(cfg, "platform", PLATFORMS)
    check_distributed(cfg)
    if cfg.warmup_steps >= cfg.steps:
        raise ConfigError(
            "warmup_steps",
            f"must be smaller than steps ({cfg.steps}) so that at least one step is timed; got {cfg.warmup_steps}",
        )
    if cfg.profile_steps and not (isinstance(cfg.profile_dir, str) and cfg.profile_dir):
        raise ConfigError("profile_dir", "must name a folder for the trace when profile_steps > 0")
    if not isinstance(cfg.preallocate, bool):
        raise ConfigError("preallocate", f"must be true or false; got {cfg.preallocate!r}")
    if not isinstance(cfg.xla_flags, str) or "\n" in cfg.xla_flags:
        raise ConfigError("xla_flags", "must be one line of space-separated --xla_... flags")
    bad_flags = [f for f in cfg.xla_flags.split() if not f.startswith("--")]
    if bad_flags:
        raise ConfigError("xla_flags", f"each flag must start with '--' (e.g. --xla_gpu_autotune_level=2); got {bad_flags[0]!r}")
    ids = cfg.visible_devices.split(",") if isinstance(cfg.visible_devices, str) and cfg.visible_devices else []
    if not isinstance(cfg.visible_devices, str) or not all(i.strip().isascii() and i.strip().isdigit() for i in ids):
        raise ConfigError("visible_devices", f"must be empty or comma-separated GPU indices like 0,1; got {cfg.visible_devices!r}")
    check_checkpoint_folders(cfg)
    return cfg


CHECKPOINT_META_FILE = "checkpoint.json"  # what marks a folder as a checkpoint (migration/running/checkpoint.py)


def check_checkpoint_folders(cfg: RunConfig) -> None:
    """`save_checkpoint` and `restore_checkpoint`: empty, or absolute folder paths (the worker runs in
    another directory); a restore folder must hold a checkpoint, and a save folder must be new, empty
    or a checkpoint (which is replaced). Whether a checkpoint fits the run's model is checked when it
    is read (migration/running/checkpoint.py)."""
    for field in ("save_checkpoint", "restore_checkpoint"):
        value = getattr(cfg, field)
        if not isinstance(value, str) or "\n" in value or "\0" in value:
            raise ConfigError(field, f"must be one line naming a folder, or empty for none; got {shown(value)}")
        if value and not os.path.isabs(value):
            raise ConfigError(field, f"must be an absolute folder path (the run's worker starts in another "
                                     f"directory), or empty for none; got {shown(value)}")
    if cfg.save_checkpoint and cfg.step_style == "pmap":
        raise ConfigError("step_style", "checkpoints hold the jit step's state; the pmap step (the measured "
                                        "\"before\") may start from one but does not save one: use step_style jit")
    restore = Path(cfg.restore_checkpoint)
    if cfg.restore_checkpoint and not restore.is_dir():
        raise ConfigError("restore_checkpoint", f"no such folder: {cfg.restore_checkpoint}; allowed: a folder "
                                                "written by save_checkpoint")
    if cfg.restore_checkpoint and not (restore / CHECKPOINT_META_FILE).is_file():
        raise ConfigError("restore_checkpoint", f"{cfg.restore_checkpoint} is not a checkpoint (no "
                                                f"{CHECKPOINT_META_FILE} in it); allowed: a folder written by "
                                                "save_checkpoint")
    save = Path(cfg.save_checkpoint)
    if cfg.save_checkpoint and save.exists() and not save.is_dir():
        raise ConfigError("save_checkpoint", f"{cfg.save_checkpoint} is a file; allowed: a new or empty folder, "
                                             "or a checkpoint folder (replaced)")
    if cfg.save_checkpoint and save.is_dir() and any(save.iterdir()) and not (save / CHECKPOINT_META_FILE).is_file():
        raise ConfigError("save_checkpoint", f"{cfg.save_checkpoint} holds other files; allowed: a new or empty "
                                             "folder, or a checkpoint folder (replaced)")


# -- planning ------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PlanRequest:
    """A TPU-style setup and a GPU target: what `plan_migration` turns into a GPU plan.

    The TPU-style setup is the source slice, its global batch, its per-core batch (default: global
    batch / the slice's devices), its precision (bf16), no remat and `pmap` over every core.
    """

    workload: str = "transformer"
    preset: str = "tiny"
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # see RunConfig
    source: str = "tpu-v5e-8"
    global_batch: int = 256
    per_core_batch: int | None = None
    source_precision: Precision = "bf16"
    target: str = "h100-sxm"  # a catalog GPU key, or "local" for this machine's devices
    gpus: int = 1  # in all; more than gpus_per_node means several nodes
    gpus_per_node: int = 8
    # Each GPU's network bandwidth between nodes in Gb/s (NICs per GPU x their speed); 0: one 400 Gb/s
    # InfiniBand NDR port per GPU, as in NVIDIA's DGX H100 reference design.
    network_gbps: float = 0.0
    # How the TPU job held its state: None = as the source's memory forces it (replicated under
    # pmap when 16 bytes per parameter fit a chip's HBM, else sharded over the slice).
    source_sharding: Sharding | None = None
    memory_fraction: float = 0.8  # the share of each GPU the job may use (the guide's 0.8)
    safety_margin: float = 0.1  # of that share, kept free for fragmentation and library workspaces
    granularity: Granularity = "multiple8"
    max_per_device_batch: int = 1024
    precision: Precision | None = None  # override; default: bf16 where native, else fp16
    remat: RematName | None = None  # override; default: the cheapest policy that fits
    # Override (a layout name, migration/config/layouts.py); default: the fastest of the layouts that fit.
    sharding: str | None = None
    accumulation_steps: int | None = None  # override
    compile_for_tpu: bool = True  # also compile the TPU-style setup for the source TPU where libtpu is installed
    # The comparison (migration/planning/compare.py): tokens to train (examples where the workload has no
    # tokens), the user's prices over the table's (migration/prices.py), the TPU step they measured (ms).
    train_tokens: float = 1e12
    source_slices: int = 1  # slices of `source` the TPU job ran on (multislice: data parallel across them)
    # The TPU job's remat policy: this product's name, MaxText's (minimal, save_qkv_proj, qkv_proj_offloaded,
    # ...: limits.MAXTEXT_REMAT) or a custom one ("custom:decoder_layer_input=offload,..."); "none" as a
    # TPU-era script writes it. The TPU compile applies it; `tpu_remat` is this product's policy for it.
    source_remat: str = "none"
    # Over several slices, the state sharded over every slice's devices (MaxText's dcn_fsdp_parallelism)
    # rather than inside each slice with data parallelism across them (dcn_data_parallelism, the default).
    source_dcn_fsdp: bool = False
    # Tensor parallelism inside each slice (MaxText's ici_tensor_parallelism): weights and the residual
    # stream's embedding split over this many devices, the state sharded (FSDP) over the rest.
    source_tensor: int = 1
    source_expert: int = 1  # expert parallelism inside each slice of the TPU job (MoE models)
    # The TPU job runs libtpu with --xla_tpu_prefer_async_allgather_to_allreduce=true: its weight gathers, which
    # the default flags compile as all-reduces, are timed as the all-gathers that flag makes them.
    source_all_gathers: bool = False
    prices: dict[str, float] = dataclasses.field(default_factory=dict)
    tpu_step_ms: float | None = None
    # fp8 allowed (it changes numerics): the planner takes fp8 / mxfp8 where the target has the units and the
    # compiled step is faster than bf16's; a `precision` given overrides it
    allow_fp8: bool = False
    timeout_s: float = 900.0
    silence_timeout_s: float = 120.0  # see RunConfig
    # A config file the model and TPU job came from (migration/config/imported.py): what it is, then each
    # key it read and did not model, with what the plan does instead; the plan lists them.
    config_notes: tuple[str, ...] = ()
    # AdamW's first moment, in the TPU job and kept in the plan (MaxText's mu_dtype): a numerics choice the
    # migration leaves as the job made it; bfloat16 holds 14 bytes a parameter of state against 16.
    mu_dtype: MomentDtype = "float32"

    @property
    def node_gpus(self) -> int:
        """GPUs per node (one process of a multi-node job each): the request's, at most what one host of the
        target drives (a GB200 / GB300 NVL72 compute tray: 4)."""
        spec = GPU_SPECS.get(self.target)
        host = spec.gpus_per_host if spec else None
        return min(self.gpus_per_node, host) if host else self.gpus_per_node

    @property
    def nodes(self) -> int:
        return max(1, -(-self.gpus // self.node_gpus))

    @property
    def domain(self) -> int:
        """GPUs whose collectives stay on the target's fast link: its NVLink domain where that spans nodes
        (GB200 / GB300 NVL72: 72 GPUs on 18 trays), else a node (NVLink inside an HGX board, PCIe between
        PCIe cards); at most the job's GPUs. Collectives between domains cross the network."""
        spec = GPU_SPECS.get(self.target)
        size = spec.nvlink_domain if spec and spec.nvlink_domain > self.node_gpus else self.node_gpus
        return min(self.gpus, size)

    @property
    def domains(self) -> int:
        """How many such domains the job spans (the last one partly filled where GPUs are not a multiple)."""
        return max(1, -(-self.gpus // self.domain))

    @property
    def network_bytes_per_s(self) -> float | None:
        """Each GPU's network share between nodes, bytes/s (None: the catalog's assumption)."""
        return self.network_gbps * 1e9 / 8 if self.network_gbps else None

    @property
    def source_devices(self) -> int:
        """JAX devices of the TPU job: the slice's times its slices."""
        return TPU_SPECS[self.source].devices * self.source_slices

    @property
    def tpu_remat(self) -> str:
        """The TPU job's remat policy as this product's (MaxText's names translated)."""
        return check_remat_name("source_remat", self.source_remat, maxtext=True)

    @property
    def source_per_core_batch(self) -> int:
        return self.per_core_batch or max(1, self.global_batch // self.source_devices)

    def to_dict(self) -> dict[str, Any]:
        return without_defaults(dataclasses.asdict(self), LATER_DEFAULTS)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PlanRequest":
        return validate_plan_request(_construct(cls, data))


def _check_range(obj: Any, field: str, limits: dict[str, tuple[float, float]], integer: bool) -> None:
    value = getattr(obj, field)
    lo, hi = limits[field]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if integer and not (isinstance(value, int) and not isinstance(value, bool)):
        is_number = False
    if not is_number or not _finite(value) or not lo <= value <= hi:
        kind, bounds = ("an integer", f"{int(lo)} to {int(hi)}") if integer else ("a number", f"{lo:g} to {hi:g}")
        raise ConfigError(field, f"must be {kind} from {bounds}; got {shown(value)}")


def _check_model_split(obj: Any, lay: Any, per_node: int, field: str = "sharding") -> None:
    """The tensor split needs weights the workload splits; the expert split a mixture-of-experts model whose
    routed experts it divides."""
    # reason: workloads import JAX (not its backend); kept out of this module's import
    from workloads import resolve_workload

    workload = resolve_workload(obj.workload)
    if lay.tensor > 1 and not workload.tensor_parallel:
        raise ConfigError(field, f"{obj.workload} names no weights to split: tensor parallelism (+tp) "
                                      "applies to the transformer, llama and moe families")
    if lay.expert == 1:
        return
    model_cfg = check_model(obj)
    experts = workload.routed_experts(model_cfg)
    if not experts:
        raise ConfigError(field, f"+ep{lay.expert}: {obj.workload} has no routed experts; expert parallelism "
                                      "applies to a mixture-of-experts model (workload moe)")
    if experts % lay.expert:
        fits = [e for e in range(2, lay.expert) if experts % e == 0]
        hint = f"; e.g. +ep{fits[-1]}" if fits else ""
        raise ConfigError(field, f"+ep{lay.expert}: the expert split must divide the {experts} routed experts"
                                      f"{hint}")


def check_run_layout(cfg: Any) -> None:
    """A run's layout over its devices: those of one process form a node (a multi-process job's
    processes are its nodes)."""
    lay = parse_layout(cfg.sharding)
    per_node = cfg.devices // cfg.num_processes if isinstance(cfg.devices, int) and isinstance(
        cfg.num_processes, int) and cfg.num_processes >= 1 else 8
    _check_model_split(cfg, lay, max(1, per_node))
    if isinstance(cfg.devices, int) and isinstance(cfg.num_processes, int) and cfg.num_processes >= 1:
        lay.check(cfg.devices, max(1, cfg.devices // cfg.num_processes))


def check_plan_layout(req: "PlanRequest") -> None:
    lay = parse_layout(req.sharding)
    _check_model_split(req, lay, req.domain)
    lay.check(req.gpus, req.domain)


def check_fp8_target(precision: str, spec: Any, name: str = "", cc: tuple[int, int] | None = None) -> None:
    """fp8 needs fp8 tensor cores (compute capability 8.9 and up: Ada, Hopper, Blackwell), mxfp8 Blackwell's
    block-scaled ones (10.0 and up); refused elsewhere naming the precision and the target. `spec`: a
    catalog entry, or None with the device's `name` and `cc` (this machine's GPU)."""
    if precision not in FP8_PRECISIONS:
        return
    cc = spec.compute_capability if spec is not None else cc
    name = spec.name if spec is not None else name
    need, what = ((10, 0), "Blackwell's block-scaled fp8 tensor cores (compute capability 10.0+)") \
        if precision == "mxfp8" else ((8, 9), "fp8 tensor cores (compute capability 8.9+: Ada, Hopper, Blackwell)")
    if cc is None or cc < need:
        has = f"compute capability {cc[0]}.{cc[1]}" if cc else "no compute capability (not an NVIDIA GPU)"
        other = "fp8 or bf16" if precision == "mxfp8" and cc and cc >= (8, 9) else "bf16" if cc and cc >= (8, 0) else \
            "fp16" if cc else "bf16 or fp32"
        raise ConfigError("precision", f"{precision} needs {what}; {name} has {has}: use {other}")


def validate_plan_request(req: PlanRequest) -> PlanRequest:
    check_model(req)
    notes = req.config_notes
    if not isinstance(notes, (tuple, list)) or len(notes) > 100 or not all(
            isinstance(n, str) and len(n) <= 2000 for n in notes):
        raise ConfigError("config_notes", "a list of at most 100 lines of at most 2,000 characters")
    _check_choice(req, "source", tuple(TPU_SPECS))
    _check_choice(req, "target", ("local", *GPU_SPECS))
    for field in ("global_batch", "gpus", "gpus_per_node", "max_per_device_batch"):
        _check_range(req, field, PLAN_LIMITS, integer=True)
    node = req.node_gpus
    if req.gpus > node and req.gpus % node:
        host = "" if node == req.gpus_per_node else f" ({GPU_SPECS[req.target].name} hosts hold {node} GPUs)"
        raise ConfigError("gpus", f"{req.gpus} GPUs do not fill whole nodes of {node}{host}; use a multiple of "
                                  f"{node} (or at most {node} on one node)")
    if req.target == "local" and req.gpus > req.gpus_per_node:
        raise ConfigError("gpus", f"target local is this machine (one node): at most {req.gpus_per_node}; got {req.gpus}")
    if req.source_sharding is not None:
        _check_choice(req, "source_sharding", SHARDINGS)
    if req.sharding is not None:
        check_plan_layout(req)
    if req.per_core_batch is not None:
        _check_range(req, "per_core_batch", PLAN_LIMITS, integer=True)
    for field in ("memory_fraction", "safety_margin", "timeout_s", "silence_timeout_s", "network_gbps"):
        _check_range(req, field, PLAN_LIMITS, integer=False)
    _check_choice(req, "source_precision", ("bf16", "fp32"))
    _check_choice(req, "mu_dtype", MOMENT_DTYPES)
    source_remat = check_remat_name("source_remat", req.source_remat, maxtext=True)
    # reason: workloads import JAX (not its backend); kept out of this module's import
    from workloads import resolve_workload

    why = remat_unavailable(resolve_workload(req.workload), source_remat)
    if why and source_remat != "none":
        raise ConfigError("source_remat", f"{req.source_remat} does not apply to {req.workload}: {why}")
    _check_choice(req, "granularity", GRANULARITIES)
    if req.precision is not None:
        _check_choice(req, "precision", PRECISIONS)
        if req.target != "local":  # this machine's GPU is checked once the planner has it (plan_migration)
            check_fp8_target(req.precision, GPU_SPECS[req.target])
    if req.remat is not None:
        _check_choice(req, "remat", REMAT_NAMES)
        check_remat_applies(req)
    if req.accumulation_steps is not None:
        _check_range(req, "accumulation_steps", LIMITS, integer=True)
    for flag in ("allow_fp8", "source_dcn_fsdp", "source_all_gathers"):
        if not isinstance(getattr(req, flag), bool):
            raise ConfigError(flag, f"must be true or false; got {shown(getattr(req, flag))}")
    _check_range(req, "train_tokens", PLAN_LIMITS, integer=False)
    _check_range(req, "source_slices", PLAN_LIMITS, integer=True)
    _check_range(req, "source_tensor", PLAN_LIMITS, integer=True)
    _check_range(req, "source_expert", PLAN_LIMITS, integer=True)
    if req.tpu_step_ms is not None:
        _check_range(req, "tpu_step_ms", LIMITS, integer=False)
    if not isinstance(req.prices, dict):
        raise ConfigError("prices", f"must map keys to dollars per hour, e.g. {{\"tpu-v5p\": 4.2}}; got {shown(req.prices)}")
    for key, usd in req.prices.items():
        checked_key(key if isinstance(key, str) else repr(key), "prices", str(key))
        checked_price(usd, "prices", key)
    _check_plan_consistency(req, req.source_devices)
    return req


def _check_plan_consistency(req: PlanRequest, cores: int) -> None:
    """Settings that are each in range but contradict each other (fields already checked one by one)."""
    g, p = req.global_batch, req.per_core_batch
    if p is not None and p > g:
        raise ConfigError("per_core_batch", f"must not exceed global_batch ({g}); got {p}")
    if p is not None and p * cores != g:
        fix = (f"use per_core_batch {g // cores}" if g % cores == 0 else
               f"use a global_batch that is a multiple of {cores}")
        raise ConfigError(
            "per_core_batch",
            f"{p} per core × {cores} cores of {req.source if req.source_slices == 1 else f'{req.source_slices} × {req.source}'} "
            f"= {p * cores}, but global_batch is {g} (with pmap on a "
            f"TPU the global batch is per-core batch × cores); {fix}, or leave per_core_batch unset (global / cores)",
        )
    t, per_slice = req.source_tensor, cores // req.source_slices
    if t > 1 and (t & (t - 1) or per_slice % t):
        raise ConfigError("source_tensor", f"tensor parallelism inside a slice needs a power of two that divides the "
                                           f"slice's {per_slice} devices ({req.source}); got {t}")
    e = req.source_expert
    if e > 1 and (per_slice % (e * t)):
        raise ConfigError("source_expert", f"expert parallelism inside a slice: {e} x the tensor split ({t}) must "
                                           f"divide the slice's {per_slice} devices ({req.source}); got {e}")
    if e > 1:
        _check_model_split(req, Layout("fsdp", 0, 1, e), per_slice, field="source_expert")
    if t > 1 and req.source_sharding == "replicated":
        raise ConfigError("source_tensor", f"{t} with source_sharding replicated: tensor parallelism on the TPU side "
                                           "is planned with the state sharded (fsdp or auto)")
    a, n = req.accumulation_steps, req.gpus
    if a is not None and a * n > g:
        allowed = (f"at most {g // n} with gpus {n}" if g >= n else
                   f"none while gpus ({n}) exceeds global_batch; use at most {g} GPU(s)")
        raise ConfigError(
            "accumulation_steps",
            f"{a} × gpus {n} = {a * n} micro-batches, more than global_batch {g} (each GPU needs at least one "
            f"sample per accumulation step); allowed: {allowed}; got {a}",
        )
