"""What a checkpoint folder says about itself (`checkpoint.json`, beside the Orbax state that
migration/running/checkpoint.py writes and reads): the model it belongs to, its precision, step and
layout. Read without JAX, so that a request naming a checkpoint is checked where requests are."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from migration.common import ConfigError
from migration.config.requests import CHECKPOINT_META_FILE

FORMAT = 1  # of checkpoint.json; a folder of another format is refused


@dataclasses.dataclass(frozen=True)
class CheckpointMeta:
    """What `checkpoint.json` says about the state beside it."""

    workload: str
    preset: str
    model: dict[str, Any]  # the run's overrides of the preset
    dims: dict[str, Any]  # the resolved model config: what the parameter shapes follow
    precision: str
    step: int
    sharding: str
    devices: int
    backend: str
    device_kind: str
    loss_scale: dict[str, float] | None = None  # {"scale", "good_steps"} of an fp16 run
    format: int = FORMAT

    @property
    def layout(self) -> str:
        return layout_text(self.devices, self.backend, self.sharding)

    @property
    def model_name(self) -> str:
        return f"{self.workload}/{self.preset}"


def layout_text(devices: int, backend: str, sharding: str) -> str:
    """"8 cpu devices, replicated": where a state lived and how."""
    return f"{devices} {backend} device{'s' if devices != 1 else ''}, {sharding}"


def model_dims(model_cfg: Any) -> dict[str, Any]:
    """The resolved model config as JSON values (what `checkpoint.json` stores and compares)."""
    fields = dataclasses.asdict(model_cfg) if dataclasses.is_dataclass(model_cfg) else {"config": repr(model_cfg)}
    return json.loads(json.dumps(fields, default=str))


def read_meta(path: str | Path) -> CheckpointMeta:
    """The checkpoint folder's metadata; ConfigError("restore_checkpoint", ...) when unreadable."""
    file = Path(path) / CHECKPOINT_META_FILE
    try:
        data = json.loads(file.read_text())
        meta = CheckpointMeta(**data)
    except (OSError, ValueError, TypeError) as exc:
        raise ConfigError("restore_checkpoint", f"{file} is not a readable checkpoint description ({exc}); allowed: "
                                                "a folder written by save_checkpoint") from None
    kinds = {"workload": str, "preset": str, "model": dict, "dims": dict, "precision": str, "step": int,
             "sharding": str, "devices": int, "backend": str, "device_kind": str, "format": int}
    wrong = [name for name, kind in kinds.items()
             if not isinstance(getattr(meta, name), kind) or isinstance(getattr(meta, name), bool)]
    if meta.loss_scale is not None and not isinstance(meta.loss_scale, dict):
        wrong.append("loss_scale")
    if wrong:
        raise ConfigError("restore_checkpoint", f"{file} is not a readable checkpoint description (wrong type of "
                                                f"{', '.join(wrong)}); allowed: a folder written by save_checkpoint")
    if meta.format != FORMAT:
        raise ConfigError("restore_checkpoint", f"{path} has checkpoint format {meta.format}; this version reads "
                                                f"format {FORMAT}")
    return meta


def read_checkpoint(path: str | Path, field: str = "checkpoint") -> CheckpointMeta:
    """read_meta of the folder `path`, refusals naming `field`: no such folder, no checkpoint.json in
    it, or one this version cannot read."""
    folder = Path(path).absolute()
    try:
        folder.is_dir()
    except OSError as exc:  # a name too long for the file system, say
        raise ConfigError(field, f"cannot read {str(folder)[:120]!r}: {exc.strerror}; allowed: a folder written by "
                                 "run --save-checkpoint") from None
    if not folder.is_dir():
        raise ConfigError(field, f"no such folder: {folder}; allowed: a folder written by run --save-checkpoint")
    if not (folder / CHECKPOINT_META_FILE).is_file():
        raise ConfigError(field, f"{folder} is not a checkpoint folder (no {CHECKPOINT_META_FILE} in it); allowed: a "
                                 "folder written by run --save-checkpoint")
    try:
        return read_meta(folder)
    except ConfigError as exc:
        raise ConfigError(field, exc.message) from None


def checkpoint_model(meta: CheckpointMeta) -> Any:
    """The checkpoint's model config: its workload's preset with its overrides, given the resolved
    dimensions it was saved with (what the parameter shapes follow, should the preset have changed).
    ConfigError("checkpoint", ...) when that model cannot be built here."""
    # reason: the workloads import JAX; only a checkpoint that is being read needs them
    from workloads import get_workload

    try:
        workload = get_workload(meta.workload)
        cfg = workload.config(meta.preset, meta.model)
        if model_dims(cfg) != meta.dims and dataclasses.is_dataclass(cfg):
            cfg = workload.check(dataclasses.replace(cfg, **meta.dims))
    except (KeyError, ValueError, TypeError) as exc:  # WorkloadError and ModelConfigError are ValueErrors
        raise ConfigError("checkpoint", f"its model {meta.model_name} cannot be built here ({type(exc).__name__}: "
                                        f"{exc}); allowed: a checkpoint of a registered workload") from None
    return cfg
