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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from migration.config.checkpoints import (  # noqa: F401  (read_meta, layout_text: used through this module)
    CheckpointMeta, checkpoint_model, layout_text, model_dims, read_checkpoint, read_meta)
from migration.common import ConfigError
from migration.config.requests import CHECKPOINT_META_FILE, RunConfig
from migration.step.policies import LossScaleState
from migration.step.train import TrainProgram, TrainState, abstract_state, replicated
from workloads import get_workload
from workloads.base import no_wrap

STATE_DIR = "state"  # the Orbax tree, inside the checkpoint folder


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


def orbax() -> Any:
    """orbax.checkpoint, imported when a checkpoint is saved or read: the import alone costs about half a second
    of CPU, which every run worker paid at its start, checkpoint or not (bench/import_cost.py measures that start)."""
    import orbax.checkpoint as ocp  # reason: see the docstring

    return ocp


def restore(path: str | Path, cfg: RunConfig, program: TrainProgram, mesh: Mesh) -> tuple[TrainState, CheckpointMeta]:
    """The saved state, placed as `program` holds it on `mesh` (its sharding, its device count)."""
    ocp = orbax()
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
    ocp = orbax()
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


def restore_params(path: str | Path, accept: Callable[[Any], None] | None = None) -> tuple[Any, Any, CheckpointMeta]:
    """The model config, the parameters only (an nnx.State of float32 Params on one CPU device; the
    optimizer state is not read) and the description of a checkpoint folder. `accept(model_cfg)` may
    refuse the model (ConfigError) before any array is read. ConfigError("checkpoint", ...) for a
    folder that is no checkpoint or whose parameters cannot be read."""
    folder = Path(path).absolute()
    meta = read_checkpoint(folder)
    cfg = checkpoint_model(meta)
    if accept is not None:
        accept(cfg)
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    model = nnx.eval_shape(lambda: get_workload(meta.workload).build(cfg, dtype=jnp.float32, block_wrap=no_wrap,
                                                                     rngs=nnx.Rngs(0)))
    target = {"params": jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=cpu),
                                     nnx.state(model, nnx.Param))}
    ocp = orbax()
    state_dir = folder / STATE_DIR
    try:
        with ocp.Checkpointer(ocp.PyTreeCheckpointHandler()) as checkpointer:
            tree = checkpointer.restore(state_dir, args=ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        detail = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
        raise ConfigError("checkpoint", f"the parameters in {state_dir} could not be read ({type(exc).__name__}"
                                        f"{': ' + detail if detail else ''})") from None
    return cfg, tree["params"], meta
