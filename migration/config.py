"""Run configuration: one frozen dataclass, validated once at the edge.

Validation returns messages a user can act on: which field is wrong, what it got, what is allowed.
This module imports no JAX at module level, so a worker can validate before it sets JAX's
environment.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, get_args

Precision = Literal["fp32", "bf16", "fp16"]
RematName = Literal["none", "dots", "dots_no_batch", "full"]
Platform = Literal["auto", "cpu", "gpu"]

PRECISIONS: tuple[str, ...] = get_args(Precision)
REMAT_NAMES: tuple[str, ...] = get_args(RematName)
PLATFORMS: tuple[str, ...] = get_args(Platform)

# Allowed ranges, in one place: validation and the CLI's help both read them.
LIMITS: dict[str, tuple[float, float]] = {
    "per_device_batch": (1, 65536),
    "devices": (1, 64),
    "accumulation_steps": (1, 1024),
    "steps": (1, 100_000),
    "warmup_steps": (0, 99_999),
    "learning_rate": (1e-8, 1.0),
    "seed": (0, 2**31 - 1),
    "timeout_s": (1, 7 * 24 * 3600),
    "memory_fraction": (0.05, 1.0),
}


class ConfigError(ValueError):
    """A config field is invalid. `str()` is one line naming the field and what is allowed."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything that defines one measured training run.

    global batch per optimizer step = per_device_batch * devices * accumulation_steps.
    """

    workload: str = "transformer"
    preset: str = "tiny"
    per_device_batch: int = 8
    devices: int = 1
    precision: Precision = "fp32"
    remat: RematName = "none"
    accumulation_steps: int = 1
    steps: int = 20
    warmup_steps: int = 2
    learning_rate: float = 3e-3
    seed: int = 0
    timeout_s: float = 600.0
    # Environment of the worker (read by JAX only before it initialises).
    platform: Platform = "auto"
    memory_fraction: float = 0.8
    preallocate: bool = False
    xla_flags: str = ""
    visible_devices: str = ""  # CUDA_VISIBLE_DEVICES, e.g. "0" or "0,1"; empty: leave as is

    @property
    def global_batch(self) -> int:
        return self.per_device_batch * self.devices * self.accumulation_steps

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ConfigError(unknown[0], f"unknown field; allowed fields are {', '.join(sorted(names))}")
        return validate(cls(**data))


def _check_int(cfg: RunConfig, field: str) -> None:
    value = getattr(cfg, field)
    lo, hi = LIMITS[field]
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ConfigError(field, f"must be an integer from {int(lo)} to {int(hi)}; got {value!r}")


def _check_float(cfg: RunConfig, field: str) -> None:
    value = getattr(cfg, field)
    lo, hi = LIMITS[field]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not lo <= value <= hi:
        raise ConfigError(field, f"must be a number from {lo:g} to {hi:g}; got {value!r}")


def _check_choice(cfg: RunConfig, field: str, allowed: tuple[str, ...]) -> None:
    value = getattr(cfg, field)
    if value not in allowed:
        raise ConfigError(field, f"must be one of {', '.join(allowed)}; got {value!r}")


def validate(cfg: RunConfig) -> RunConfig:
    """Return `cfg` unchanged if valid; raise ConfigError naming the first bad field otherwise."""
    from workloads import WORKLOADS  # imports JAX (no backend initialised): keep it out of module scope

    _check_choice(cfg, "workload", tuple(WORKLOADS))
    _check_choice(cfg, "preset", tuple(WORKLOADS[cfg.workload].presets))
    for field in ("per_device_batch", "devices", "accumulation_steps", "steps", "warmup_steps", "seed"):
        _check_int(cfg, field)
    for field in ("learning_rate", "timeout_s", "memory_fraction"):
        _check_float(cfg, field)
    _check_choice(cfg, "precision", PRECISIONS)
    _check_choice(cfg, "remat", REMAT_NAMES)
    _check_choice(cfg, "platform", PLATFORMS)
    if cfg.warmup_steps >= cfg.steps:
        raise ConfigError(
            "warmup_steps",
            f"must be smaller than steps ({cfg.steps}) so that at least one step is timed; got {cfg.warmup_steps}",
        )
    if not isinstance(cfg.preallocate, bool):
        raise ConfigError("preallocate", f"must be true or false; got {cfg.preallocate!r}")
    if not isinstance(cfg.xla_flags, str) or "\n" in cfg.xla_flags:
        raise ConfigError("xla_flags", "must be one line of space-separated --xla_... flags")
    bad_flags = [f for f in cfg.xla_flags.split() if not f.startswith("--")]
    if bad_flags:
        raise ConfigError("xla_flags", f"each flag must start with '--' (e.g. --xla_gpu_autotune_level=2); got {bad_flags[0]!r}")
    ids = cfg.visible_devices.split(",") if cfg.visible_devices else []
    if not isinstance(cfg.visible_devices, str) or not all(i.strip().isdigit() for i in ids):
        raise ConfigError("visible_devices", f"must be empty or comma-separated GPU indices like 0,1; got {cfg.visible_devices!r}")
    return cfg
