"""Checkpoints carried between device layouts: Orbax save on one mesh, restore onto another (real
JAX on the 8 CPU devices of tests/conftest.py), refusal of another model's checkpoint, validation of
the folders, and the runner and CLI end to end."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from migration.running import checkpoint

from migration.config import forms
from migration.common import ConfigError
from migration.config.requests import CHECKPOINT_META_FILE, RunConfig, validate
from migration.running.runner import run
from migration.step.train import DATA_AXIS, TrainProgram, replicate_per_device, step_parts

ROOT = Path(__file__).resolve().parent.parent
# The TPU-style job: 8 devices, replicated state, fp32 so that layouts agree to rounding; the MLP,
# the quickest workload to compile on 2 cores (the state's layout, not the model, is under test).
TPU_STYLE = RunConfig(workload="mlp", preset="tiny", per_device_batch=1, devices=8, steps=3, warmup_steps=1,
                      precision="fp32")


def train(cfg: RunConfig, steps: int, *, start: int = 0, restore_from: Path | None = None,
          save_after: tuple[int, Path] | None = None) -> list[float]:
    """The losses of `steps` jit steps of `cfg` on its first `cfg.devices` CPU devices, from fresh
    parameters or a checkpoint; `save_after` (n, folder): save the state after n steps, on the way."""
    program = TrainProgram.from_config(cfg)
    parts = step_parts(program, jax.devices()[: cfg.devices])
    if restore_from is None:
        state = parts.init_state()
    else:
        state, _ = checkpoint.restore(restore_from, cfg, program, parts.mesh)
    losses = []
    for i in range(start, start + steps):
        if save_after and i - start == save_after[0]:
            checkpoint.save(save_after[1], state, cfg, program, "cpu", jax.devices()[0].device_kind)
        state, metrics = parts.step(state, parts.make_batch(i))
        losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def saved_after_three(tmp_path_factory):
    """The TPU-style job run straight for 6 steps, its state saved after step 3 on the way (the
    save neither changes nor interrupts the run); the folder and the 6 losses."""
    folder = tmp_path_factory.mktemp("ckpt") / "after3"
    straight = train(TPU_STYLE, 6, save_after=(3, folder))
    return folder, straight


@pytest.mark.parametrize("devices,sharding", [(1, "replicated"), (4, "fsdp")])
def test_training_continues_on_another_layout_with_the_same_losses(saved_after_three, devices, sharding):
    folder, straight = saved_after_three
    # Same global batch (8) on the new layout, so the data is the same.
    cfg = dataclasses.replace(TPU_STYLE, devices=devices, per_device_batch=8 // devices, sharding=sharding)
    program = TrainProgram.from_config(cfg)
    parts = step_parts(program, jax.devices()[:devices])
    state, meta = checkpoint.restore(folder, cfg, program, parts.mesh)
    assert meta.step == 3 and meta.devices == 8 and meta.sharding == "replicated"
    assert int(state.step) == 3
    leaves = jax.tree.leaves(state.params)
    assert all(leaf.sharding.mesh.devices.size == devices for leaf in leaves)
    sharded = [leaf for leaf in leaves if DATA_AXIS in leaf.sharding.spec]
    assert bool(sharded) == (sharding == "fsdp")
    if sharding == "fsdp":  # each device holds a quarter of a sharded parameter
        big = max(sharded, key=lambda leaf: leaf.size)
        assert big.addressable_shards[0].data.size == big.size // 4
    rest = train(cfg, 3, start=3, restore_from=folder)
    np.testing.assert_allclose(rest, straight[3:], rtol=2e-5)
    assert rest != straight[:3]  # it really continued: a fresh start would repeat the first losses


def test_a_run_may_change_precision_and_the_fp16_loss_scale_is_carried(saved_after_three, tmp_path):
    """fp32 -> fp16: the parameters as saved, a fresh loss scale; fp16 -> fp16: the scale as saved."""
    folder, _ = saved_after_three
    fp32 = TrainProgram.from_config(TPU_STYLE)
    fp32_state, _ = checkpoint.restore(folder, TPU_STYLE, fp32, step_parts(fp32, jax.devices()[:1]).mesh)
    cfg = dataclasses.replace(TPU_STYLE, devices=2, per_device_batch=4, precision="fp16")
    program = TrainProgram.from_config(cfg)
    mesh = step_parts(program, jax.devices()[:2]).mesh
    state, meta = checkpoint.restore(folder, cfg, program, mesh)
    assert meta.precision == "fp32" and meta.loss_scale is None and fp32_state.loss_scale is None
    assert float(state.loss_scale.scale) == program.loss_scale.initial_scale and int(state.loss_scale.good_steps) == 0
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(fp32_state.params)):
        assert a.dtype == b.dtype == np.float32 and np.array_equal(np.asarray(a), np.asarray(b))
    scaled = state._replace(loss_scale=state.loss_scale._replace(scale=state.loss_scale.scale / 4,
                                                                 good_steps=state.loss_scale.good_steps + 7))
    written = checkpoint.save(tmp_path / "fp16", scaled, cfg, program, "cpu", "cpu")
    assert written["layout"] == "2 cpu devices, replicated"
    again, meta = checkpoint.restore(tmp_path / "fp16", cfg, program, mesh)
    assert meta.loss_scale == {"scale": program.loss_scale.initial_scale / 4, "good_steps": 7}
    assert float(again.loss_scale.scale) == program.loss_scale.initial_scale / 4 and int(again.loss_scale.good_steps) == 7


@pytest.mark.slow
def test_the_pmap_before_step_continues_from_a_checkpoint_too(saved_after_three):
    """The TPU-era step (a copy of the state per device) restored from the same checkpoint trains on
    as the jit step did."""
    folder, straight = saved_after_three
    cfg = dataclasses.replace(TPU_STYLE, step_style="pmap")
    program = TrainProgram.from_config(cfg)
    parts = step_parts(program, jax.devices()[:8], "pmap")
    state, _ = checkpoint.restore(folder, cfg, program, parts.mesh)
    state = replicate_per_device(state, parts.mesh)
    assert state.step.shape == (8,) and set(np.asarray(state.step)) == {3}
    losses = []
    for i in range(3, 6):
        state, metrics = parts.step(state, parts.make_batch(i))
        losses.append(float(parts.host_metrics(jax.device_get(metrics))["loss"]))
    np.testing.assert_allclose(losses, straight[3:], rtol=2e-5)


def test_a_checkpoint_of_another_model_is_refused_naming_what_differs(saved_after_three):
    folder, _ = saved_after_three
    cfg = dataclasses.replace(TPU_STYLE, preset="small")
    program = TrainProgram.from_config(cfg)
    mesh = step_parts(program, jax.devices()[:1]).mesh
    with pytest.raises(ConfigError) as info:
        checkpoint.restore(folder, cfg, program, mesh)
    assert str(info.value) == (
        "restore_checkpoint: the checkpoint is mlp/tiny (hidden [128]), the run is mlp/small (hidden [1024, 1024]); a checkpoint "
        "restores only into the model it was saved from (same workload and dimensions): choose that model, or leave "
        "restore_checkpoint empty to start fresh")
    other = dataclasses.replace(TPU_STYLE, workload="transformer")
    with pytest.raises(ConfigError, match=r"checkpoint is mlp/tiny, the run is transformer/tiny; "):
        checkpoint.check_matches(checkpoint.read_meta(folder), other, TrainProgram.from_config(other).model_cfg)


def test_checkpoint_folders_are_validated_with_clear_messages(tmp_path):
    def refused(**fields) -> str:
        with pytest.raises(ConfigError) as info:
            validate(RunConfig(steps=3, **fields))
        return str(info.value)

    assert "absolute folder path" in refused(save_checkpoint="relative/dir")
    assert "absolute folder path" in refused(restore_checkpoint="../up")
    missing = tmp_path / "missing"
    assert refused(restore_checkpoint=str(missing)) == (f"restore_checkpoint: no such folder: {missing}; allowed: "
                                                        "a folder written by save_checkpoint")
    assert f"no {CHECKPOINT_META_FILE} in it" in refused(restore_checkpoint=str(tmp_path))
    (tmp_path / "notes.txt").write_text("mine")
    assert refused(save_checkpoint=str(tmp_path)).startswith("save_checkpoint: ")
    assert "holds other files" in refused(save_checkpoint=str(tmp_path))
    assert "is a file" in refused(save_checkpoint=str(tmp_path / "notes.txt"))
    assert "does not save one" in refused(save_checkpoint=str(tmp_path / "new"), step_style="pmap")
    assert "one line" in refused(save_checkpoint="/tmp/a\nb")
    # Accepted: a new folder to save to, and a folder holding a checkpoint (also replaced by a save).
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / CHECKPOINT_META_FILE).write_text("{}")
    validate(RunConfig(steps=3, save_checkpoint=str(tmp_path / "new" / "deeper"), restore_checkpoint=str(tmp_path / "ck")))
    validate(RunConfig(steps=3, save_checkpoint=str(tmp_path / "ck")))
    validate(RunConfig(steps=3, step_style="pmap", restore_checkpoint=str(tmp_path / "ck")))  # restores, never saves


def test_an_unreadable_description_is_refused(tmp_path):
    (tmp_path / CHECKPOINT_META_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match="is not a readable checkpoint description"):
        checkpoint.read_meta(tmp_path)


def test_the_app_takes_folder_names_under_its_own_folder_and_refuses_paths(tmp_path):
    root = tmp_path / forms.user_folder("alice")
    assert forms.user_folder("alice") != forms.user_folder("alice/..") and "/" not in forms.user_folder("a/../b")
    assert forms.checkpoint_folders("run-1", "", root) == (str(root / "run-1"), "")
    for bad, says in (("/etc", "absolute paths are not allowed"), ("~/x", "absolute paths are not allowed"),
                      ("..", "'..' is not allowed"), ("a/../../b", "'..' is not allowed"),
                      ("a/b", "must be a folder name"), (".hidden", "must be a folder name"),
                      ("x" * 65, "at most 64 characters"), (7, "must be text")):
        with pytest.raises(ConfigError, match=says) as info:
            forms.checkpoint_folders(bad, "", root)
        assert info.value.field == "save_checkpoint"
    with pytest.raises(ConfigError, match="no checkpoint named 'run-1'; yours: none yet"):
        forms.checkpoint_folders("", "run-1", root)
    (root / "run-1").mkdir(parents=True)
    (root / "run-1" / CHECKPOINT_META_FILE).write_text("{}")
    assert forms.checkpoint_folders("", "run-1", root) == ("", str(root / "run-1"))
    with pytest.raises(ConfigError, match="no checkpoint named 'run-2'; yours: run-1 "):
        forms.checkpoint_folders("", "run-2", root)


@pytest.mark.slow
def test_runner_saves_then_a_run_on_another_device_count_continues(tmp_path, saved_after_three):
    """Worker processes: 8 devices replicated save after 3 steps; 2 devices FSDP restore and run 3
    more; the losses are those of the job run straight (in this process)."""
    _, straight = saved_after_three
    folder = tmp_path / "ckpt"
    first = run(dataclasses.replace(TPU_STYLE, save_checkpoint=str(folder)))
    assert first.ok, first.message
    assert first.checkpoint_saved == f"step 3 to {folder} (8 cpu devices, replicated)"
    assert first.checkpoint_saved_bytes == checkpoint.folder_bytes(folder) and first.restored_step is None
    assert json.loads((folder / CHECKPOINT_META_FILE).read_text())["step"] == 3
    events = []
    second = run(dataclasses.replace(TPU_STYLE, devices=2, per_device_batch=4, sharding="fsdp",
                                     restore_checkpoint=str(folder)), events.append)
    assert second.ok, second.message
    assert second.restored_step == 3
    assert second.checkpoint_restored == (f"step 3 from {folder} (saved on 8 cpu devices, replicated, fp32) "
                                          "onto 2 cpu devices, fsdp")
    restored = [e for e in events if e["event"] == "restored"]
    assert restored and restored[0]["from_layout"] == "8 cpu devices, replicated"
    np.testing.assert_allclose(first.losses, straight[:3], rtol=2e-5)
    np.testing.assert_allclose(second.losses, straight[3:], rtol=2e-5)


@pytest.mark.slow
def test_cli_saves_to_a_relative_folder_and_refuses_another_model(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "migration", "run", "--workload", "mlp", "--batch", "1",
                               "--steps", "2", "--warmup", "1", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})

    saved = cli("--preset", "tiny", "--save-checkpoint", "ck")
    assert saved.returncode == 0, saved.stderr
    assert (tmp_path / "ck" / CHECKPOINT_META_FILE).is_file()  # relative to where the command ran
    assert f"step 2 to {tmp_path / 'ck'} (1 cpu device, replicated)" in saved.stdout
    refused = cli("--preset", "small", "--restore-checkpoint", str(tmp_path / "ck"))
    assert refused.returncode == 1
    assert "Traceback" not in refused.stderr + refused.stdout
    assert ("error: run invalid: restore_checkpoint: the checkpoint is mlp/tiny (hidden [128]), the run is mlp/small "
            "(hidden [1024, 1024])") in refused.stderr
    missing = cli("--preset", "tiny", "--restore-checkpoint", "nowhere")
    assert missing.returncode == 2 and "(flag --restore-checkpoint)" in missing.stderr
    assert f"no such folder: {tmp_path / 'nowhere'}" in missing.stderr


def test_a_run_worker_imports_orbax_only_when_it_saves_or_restores():
    """Orbax costs about half a second of CPU to import (bench/import_cost.py measures a worker's start): a run
    worker's modules leave it out until a checkpoint is written or read, which brings it in."""
    code = ("import sys, migration.running.worker, migration.running.measure, workloads; "
            "before = 'orbax.checkpoint' in sys.modules; "
            "from migration.running import checkpoint; checkpoint.orbax(); "
            "print(before, 'orbax.checkpoint' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]
