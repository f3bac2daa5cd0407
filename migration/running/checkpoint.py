"""Train state carried between device layouts: saved with Orbax from one, restored onto another.

A checkpoint is a folder holding the train state (parameters, model state, optimizer state, step)
as an Orbax `StandardCheckpointHandler` tree in `state/`, and beside it `checkpoint.json`: the
model it belongs to (workload, preset, overrides and the resolved dimensions), the precision, the
step, and the layout it was saved from (devices, backend, sharding), plus the fp16 loss scale.

Each process writes the shards it holds (process 0 the description); restoring reads them back
into abstract targets (`jax.ShapeDtypeStruct`s carrying the *new* run's `NamedSharding`s, from
`train.abstract_state`),
so a state saved replicated on an 8-device TPU-style mesh comes back replicated on 1 device, or
FSDP-sharded over 4, without ever being gathered whole on the host. Parameters are float32 in
every precision (the compute dtype is a cast), so a run may continue in another precision; the
loss scale then starts afresh where the new precision scales the loss and the checkpoint has none.

A checkpoint of another model is refused before any array is read (`check_matches`), with a
`ConfigError` naming what differs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from migration.config.limits import ConfigError
from migration.config.requests import CHECKPOINT_META_FILE, RunConfig
from migration.step.policies import LossScaleState
from migration.step.train import TrainProgram, TrainState, abstract_state, replicated

STATE_DIR = "state"  # the Orbax tree, inside the checkpoint folder
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
    if meta.format != FORMAT:
        raise ConfigError("restore_checkpoint", f"{path} has checkpoint format {meta.format}; this version reads "
                                                f"format {FORMAT}")
    return meta


def check_matches(meta: CheckpointMeta, cfg: RunConfig, model_cfg: Any) -> None:
    """Refuse a checkpoint saved from another model than the run's: another workload, or other
    dimensions (a different preset with the same dimensions has the same parameters and is taken)."""
    dims = model_dims(model_cfg)
    differs = sorted(k for k in set(dims) | set(meta.dims) if dims.get(k) != meta.dims.get(k))
    if meta.workload == cfg.workload and not differs:
        return
    shown = differs[:4] if meta.workload == cfg.workload else []  # another workload: its name says enough

    def describe(name: str, values: dict[str, Any]) -> str:
        detail = ", ".join(f"{k} {values.get(k, 'unset')}" for k in shown)
        return f"{name} ({detail})" if detail else name

    raise ConfigError(
        "restore_checkpoint",
        f"the checkpoint is {describe(meta.model_name, meta.dims)}, the run is "
        f"{describe(f'{cfg.workload}/{cfg.preset}', dims)}; a checkpoint restores only into the model it was saved "
        "from (same workload and dimensions): choose that model, or leave restore_checkpoint empty to start fresh",
    )


def restore(path: str | Path, cfg: RunConfig, program: TrainProgram, mesh: Mesh) -> tuple[TrainState, CheckpointMeta]:
    """The saved state, placed as `program` holds it on `mesh` (its sharding, its device count)."""
    meta = read_meta(path)
    check_matches(meta, cfg, program.model_cfg)
    target = abstract_state(program, mesh)
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        tree = checkpointer.restore(Path(path).absolute() / STATE_DIR,
                                    args=ocp.args.StandardRestore(_saved_tree(target)))
    return TrainState(tree["params"], tree["model_state"], tree["opt_state"],
                      _loss_scale(meta, program, mesh), tree["step"]), meta


def save(path: str | Path, state: TrainState, cfg: RunConfig, program: TrainProgram, backend: str,
         device_kind: str) -> dict[str, Any]:
    """Write `state` (and its `checkpoint.json`) to the folder `path`, replacing a checkpoint there;
    returns what was written: path, step, layout, bytes."""
    folder = Path(path).absolute()
    folder.mkdir(parents=True, exist_ok=True)
    step = int(_local_value(state.step))
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as checkpointer:
        checkpointer.save(folder / STATE_DIR, args=ocp.args.StandardSave(_saved_tree(state)), force=True)
    scale = None
    if state.loss_scale is not None:
        scale = {"scale": float(_local_value(state.loss_scale.scale)),
                 "good_steps": int(_local_value(state.loss_scale.good_steps))}
    meta = CheckpointMeta(workload=cfg.workload, preset=cfg.preset, model=dict(cfg.model),
                          dims=model_dims(program.model_cfg), precision=cfg.precision, step=step,
                          sharding=cfg.sharding, devices=cfg.devices, backend=backend, device_kind=device_kind,
                          loss_scale=scale)
    if jax.process_index() == 0:  # one description per checkpoint, however many processes wrote shards
        (folder / CHECKPOINT_META_FILE).write_text(json.dumps(dataclasses.asdict(meta), indent=2) + "\n")
    return {"path": str(folder), "step": step, "layout": meta.layout, "bytes": folder_bytes(folder)}


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _local_value(scalar: jax.Array) -> Any:
    """A replicated scalar's value from this process's own copy (a multi-process job's arrays are
    not all addressable here)."""
    return scalar.addressable_data(0).item()


def _saved_tree(state: TrainState) -> dict[str, Any]:
    """The arrays Orbax stores: everything but the loss scale (kept in checkpoint.json, so that a
    state moves between precisions that do and do not scale the loss)."""
    return {"params": state.params, "model_state": state.model_state, "opt_state": state.opt_state,
            "step": state.step}


def _loss_scale(meta: CheckpointMeta, program: TrainProgram, mesh: Mesh) -> LossScaleState | None:
    if not program.precision.loss_scaling:
        return None
    if meta.loss_scale is None:
        fresh = program.loss_scale.init()
        return jax.device_put(fresh, replicated(mesh))
    saved = LossScaleState(jnp.float32(meta.loss_scale["scale"]), jnp.int32(meta.loss_scale["good_steps"]))
    return jax.device_put(saved, replicated(mesh))
