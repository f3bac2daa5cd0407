"""The TPU-era pmap step (the measured "before") beside the migrated jit step (the "after").

Same seed, same global batch (pmap takes it as (devices, accumulation_steps, per_device_batch, ...)),
same model, accumulation and optimizer: the two styles must train identically up to the order of the
cross-device sums. Tolerances are test_numerics': per-step loss and gradient norm to rtol 1e-5,
parameters after the steps to rtol 1e-4 / atol 5e-5 (Adam turns a 1e-9 difference of a near-zero
gradient into a visible one); the pmap replicas must be bit-identical (every device applies the same
pmean'd update).
"""

import dataclasses
import math

import jax
import numpy as np
import pytest

from migration.common import ConfigError
from migration.config.requests import RunConfig, validate
from migration.results import RunReport
from migration.grading.scaling import scaling_rows
from migration.service.scaling_runs import scaling_table
from migration.step.train import (
    TrainProgram,
    batch_maker,
    make_data_mesh,
    pmap_batch_maker,
    pmap_mesh,
    pmap_step,
    unreplicate,
)
from tests.test_numerics import PARAM_ATOL, PARAM_RTOL, RTOL, assert_trees_close

STEPS = 4


def both_styles(trainer, cfg: RunConfig):
    jit = trainer(cfg)
    pmap = trainer(dataclasses.replace(cfg, step_style="pmap"))
    return jit, pmap


@pytest.mark.parametrize("workload, devices, accumulation_steps", [
    ("transformer", 4, 1),
    ("llama", 4, 2),
    *(pytest.param(w, d, a, marks=pytest.mark.slow)
      for w, d, a in [("transformer", 8, 2), ("llama", 8, 1)]),
])
def test_pmap_step_trains_like_the_jit_step(trainer, workload, devices, accumulation_steps):
    assert len(jax.devices()) >= devices, "conftest sets JAX_NUM_CPU_DEVICES=8"
    cfg = RunConfig(workload=workload, preset="tiny", per_device_batch=2, devices=devices,
                    accumulation_steps=accumulation_steps)
    jit, pmap = both_styles(trainer, cfg)
    mj, mp = jit.run(STEPS), pmap.run(STEPS)
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in mp], [m[key] for m in mj], rtol=RTOL)
    assert mj[-1]["loss"] < mj[0]["loss"]  # it trains: equal losses are not equal constants
    # The pmap state is one copy per device, on those devices, and the copies never drift apart.
    for leaf in jax.tree.leaves(pmap.state):
        assert leaf.shape[0] == devices and len(leaf.sharding.device_set) == devices
        host = np.asarray(leaf)
        assert all(np.array_equal(host[0], host[d]) for d in range(1, devices))
    assert_trees_close(unreplicate(pmap.state.params), jit.state.params, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    assert_trees_close(unreplicate(pmap.state.opt_state), jit.state.opt_state, rtol=PARAM_RTOL, atol=PARAM_ATOL)
    # Its metrics come back once per device, pmean'd: the same value on every device.
    _, raw = pmap.step(pmap.state, pmap.make(STEPS))
    losses = np.asarray(raw["loss"])
    assert losses.shape == (devices,) and np.all(losses == losses[0])


def test_the_pmap_batch_is_the_jit_batch_split_per_device():
    devices = jax.devices()[:4]
    program = TrainProgram.from_config(RunConfig(workload="transformer", preset="tiny", per_device_batch=3,
                                                 devices=4, accumulation_steps=2))
    jit_batch = np.asarray(batch_maker(program, make_data_mesh(devices))(5)["tokens"])
    placed = pmap_batch_maker(program, pmap_mesh(devices))(5)["tokens"]
    assert jit_batch.shape == (2, 12, 65) and placed.shape == (4, 2, 3, 65)
    host = np.asarray(placed)
    for d in range(4):
        np.testing.assert_array_equal(host[d], jit_batch[:, 3 * d:3 * (d + 1)])
    # Placed one slice per device, device d holding slice d (as pmap maps its leading axis).
    for shard in placed.addressable_shards:
        d = devices.index(shard.device)
        assert shard.data.shape == (1, 2, 3, 65)
        np.testing.assert_array_equal(np.asarray(shard.data)[0], host[d])
    # A different batch number is different data (the comparison above is not vacuous).
    assert not np.array_equal(np.asarray(pmap_batch_maker(program, pmap_mesh(devices))(6)["tokens"]), host)


def test_pmap_refuses_a_sharded_state():
    with pytest.raises(ConfigError, match="step_style"):
        validate(RunConfig(devices=2, sharding="fsdp", step_style="pmap"))
    program = TrainProgram.from_config(RunConfig(workload="mlp", preset="tiny", devices=2, sharding="fsdp"))
    with pytest.raises(ValueError, match="replicates"):
        pmap_step(program, jax.devices()[:2])
    program = TrainProgram.from_config(RunConfig(workload="mlp", preset="tiny", devices=2))
    with pytest.raises(ValueError, match="2 devices"):
        pmap_step(program, jax.devices()[:4])


def test_the_report_says_which_step_it_timed_and_old_reports_still_load():
    events = [{"event": "step", "loss": 1.0, "step_ms": 2.0}]
    report = RunReport.from_events(RunConfig(devices=2, step_style="pmap"), events, status="ok")
    assert report.step_style == "pmap" and report.to_dict()["step_style"] == "pmap"
    assert report.csv_row()["step_style"] == "pmap"
    assert RunReport.from_events(RunConfig(), events, status="ok").step_style == "jit"
    older = {k: v for k, v in report.to_dict().items() if k != "step_style"}  # JSON written before the field
    assert RunReport(**older).step_style == "jit"


def fake_report(devices: int, style: str, samples_per_s: float | None, losses=(3.0, 2.0), status="ok") -> RunReport:
    cfg = RunConfig(devices=devices, step_style=style, steps=len(losses), warmup_steps=0)
    events = [{"event": "step", "loss": x, "step_ms": 1.0} for x in losses]
    if status == "ok":
        events.append({"event": "finished", "samples_per_s": samples_per_s, "tokens_per_s": samples_per_s * 64,
                       "step_ms_median": 1.0, "backend": "cpu", "device_kind": "cpu", "jax_version": "0"})
    return RunReport.from_events(cfg, events, status=status, failure_kind=None if status == "ok" else "crashed")


def test_scaling_rows_efficiency_ratio_and_loss_match():
    reports = [fake_report(1, "pmap", 100.0), fake_report(1, "jit", 120.0),
               fake_report(2, "pmap", 150.0), fake_report(2, "jit", 240.0, losses=(3.0, 2.001)),
               fake_report(4, "pmap", None, status="failed"), fake_report(4, "jit", 400.0)]
    rows = {(r["devices"], r["style"]): r for r in scaling_rows(reports)}
    assert [(r["devices"], r["style"]) for r in scaling_rows(reports)] == [(1, "pmap"), (1, "jit"), (2, "pmap"),
                                                                           (2, "jit"), (4, "pmap"), (4, "jit")]
    assert rows[1, "pmap"]["scaling_efficiency"] == rows[1, "jit"]["scaling_efficiency"] == 1.0
    assert rows[2, "pmap"]["scaling_efficiency"] == pytest.approx(150 / 200)
    assert rows[2, "jit"]["scaling_efficiency"] == pytest.approx(240 / 240)
    assert rows[4, "jit"]["scaling_efficiency"] == pytest.approx(400 / 480)
    assert rows[1, "jit"]["jit_over_pmap"] == rows[1, "pmap"]["jit_over_pmap"] == pytest.approx(1.2)
    assert rows[2, "jit"]["jit_over_pmap"] == pytest.approx(1.6)
    assert rows[1, "jit"]["losses_match"] is True and rows[1, "jit"]["max_loss_rel_diff"] == 0
    assert rows[2, "jit"]["losses_match"] is False  # 5e-4 relative at the last step
    assert rows[2, "jit"]["max_loss_rel_diff"] == pytest.approx(0.001 / 2.001)
    failed = rows[4, "pmap"]
    assert failed["status"] == "failed" and failed["samples_per_s"] is None and failed["scaling_efficiency"] is None
    assert rows[4, "jit"]["jit_over_pmap"] is None and rows[4, "jit"]["losses_match"] is None
    assert rows[1, "jit"]["device_kind"] == "cpu" and rows[1, "jit"]["measured_on"]
    different_length = scaling_rows([fake_report(1, "pmap", 1.0), fake_report(1, "jit", 1.0, losses=(3.0,))])
    assert math.isinf(different_length[0]["max_loss_rel_diff"]) and different_length[0]["losses_match"] is False


@pytest.fixture(scope="module")
def worker_runs():
    """Both step styles at 1 and 4 devices, each run in its own worker process (`scaling_table`):
    (rows, progress events, {(devices, style): report}). The two tests below read the same four runs."""
    seen = []
    rows = scaling_table("transformer", "tiny", devices=(1, 4), per_device_batch=4, steps=6, warmup_steps=2,
                         timeout_s=300, on_progress=seen.append)
    reports = {(ev["devices"], ev["style"]): ev["report"] for ev in seen if ev["event"] == "report"}
    return rows, seen, reports


@pytest.mark.slow
def test_both_styles_in_worker_processes_give_ok_reports_with_equal_losses(worker_runs):
    _, _, reports = worker_runs
    for style in ("pmap", "jit"):
        report = reports[4, style]
        assert report.ok, f"{style}: {report.message}\n{report.stderr_tail}"
        assert report.step_style == style and report.config["step_style"] == style
        assert report.device_count == 4 and report.global_batch == 16 and report.backend == "cpu"
        assert report.recompilations == 0 and report.timed_steps == 4 and report.samples_per_s > 0
        assert report.compile_s > 0 and report.peak_memory_bytes > 0
    pmap, jit = reports[4, "pmap"], reports[4, "jit"]
    assert len(pmap.losses) == len(jit.losses) == 6 and jit.losses[-1] < jit.losses[0]
    np.testing.assert_allclose(pmap.losses, jit.losses, rtol=RTOL)


@pytest.mark.slow
def test_scaling_table_measures_both_styles_at_each_device_count(worker_runs):
    rows, seen, _ = worker_runs
    assert [(r["devices"], r["style"]) for r in rows] == [(1, "pmap"), (1, "jit"), (4, "pmap"), (4, "jit")]
    assert all(r["status"] == "ok" and r["backend"] == "cpu" for r in rows), [r["message"] for r in rows]
    assert [r["global_batch"] for r in rows] == [4, 4, 16, 16]
    assert rows[0]["scaling_efficiency"] == rows[1]["scaling_efficiency"] == 1.0
    assert all(r["losses_match"] is True and r["samples_per_s"] > 0 and r["jit_over_pmap"] > 0 for r in rows)
    assert sum(ev["event"] == "report" for ev in seen) == 4
    assert any(ev["event"] == "progress" and "compiled" in ev["message"] for ev in seen)
