"""AdamW's first moment in bfloat16 (optax's and MaxText's mu_dtype): held by the step, counted by the plan
(14 bytes of state a parameter against 16), kept from the TPU job to the run, read from a MaxText config,
and refused by name where it is anything else."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from migration.common import ConfigError
from migration.config.imported import read_config_bytes, with_imported
from migration.config.limits import state_bytes_per_param
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
from migration.planning.planfile import read_plan
from migration.planning.planner import plan_migration
from migration.running.runner import run
from migration.service.orchestrate import config_as_planned
from migration.step.train import TrainProgram
from workloads import get_workload

ROOT = Path(__file__).resolve().parent.parent


def quiet(*args, **kwargs):
    pass


def leaves_bytes(tree) -> int:
    return sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def test_the_step_holds_the_first_moment_in_bfloat16_and_the_second_in_float32():
    cfg = RunConfig(workload="transformer", preset="tiny", mu_dtype="bfloat16")
    params = get_workload("transformer").param_count(get_workload("transformer").config("tiny", {}))
    half = jax.eval_shape(TrainProgram.from_config(cfg).init_state)
    full = jax.eval_shape(TrainProgram.from_config(dataclasses.replace(cfg, mu_dtype="float32")).init_state)
    adam = [s for s in jax.tree.leaves(half.opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {np.dtype("float32")}
    assert leaves_bytes(full.opt_state) - leaves_bytes(half.opt_state) == 2 * params
    assert state_bytes_per_param("bfloat16") == 14 and state_bytes_per_param("float32") == 16
    assert state_bytes_per_param("bfloat16", gradients=False) == 10


@pytest.mark.slow
def test_a_run_trains_with_the_first_moment_in_bfloat16():
    report = run(RunConfig(workload="transformer", preset="tiny", per_device_batch=4, steps=6, warmup_steps=1,
                           platform="cpu", mu_dtype="bfloat16", timeout_s=300))
    assert report.status == "ok", report.error
    assert report.config["mu_dtype"] == "bfloat16"
    assert all(np.isfinite(report.losses)) and report.losses[-1] < report.losses[0]


@pytest.mark.slow
def test_the_plan_counts_fourteen_bytes_a_parameter_and_the_run_keeps_the_jobs_moment():
    req = PlanRequest(workload="transformer", preset="tiny", target="h100-sxm", global_batch=64,
                      compile_for_tpu=False, remat="none", precision="bf16", mu_dtype="bfloat16")
    p = plan_migration(req, quiet)
    assert p.status == "ok" and p.mu_dtype == "bfloat16"
    st = p.state
    assert st["mu_dtype"] == "bfloat16"
    assert st["arithmetic_bytes_per_gpu"] == pytest.approx(14 * p.param_count)
    # The compiled step's state arguments: float32 parameters, a bfloat16 first moment, a float32 second.
    assert st["compiled_state_bytes_per_gpu"] == pytest.approx(10 * p.param_count, rel=0.01)
    assert "bfloat16" in st["how"]
    ran = config_as_planned(p, RunConfig())
    assert ran.mu_dtype == "bfloat16"
    # The plan's JSON, read back as an uploaded plan is, keeps it; an upload that changes it to anything
    # else is refused by name.
    assert read_plan(json.dumps(p.to_dict()), "plan").mu_dtype == "bfloat16"
    for bad in ("$(rm -rf /)", "float16", ["bfloat16"]):
        with pytest.raises(ConfigError) as exc:
            read_plan(json.dumps({**p.to_dict(), "mu_dtype": bad}), "plan")
        assert exc.value.field == "plan.mu_dtype"


def test_anything_but_float32_or_bfloat16_is_refused_by_name():
    for bad in ("float16", "bf16", "", None, 2, "../../etc/passwd"):
        with pytest.raises(ConfigError) as exc:
            validate(RunConfig(mu_dtype=bad))
        assert exc.value.field == "mu_dtype" and "float32" in str(exc.value) and "bfloat16" in str(exc.value)
        with pytest.raises(ConfigError) as exc:
            validate_plan_request(PlanRequest(mu_dtype=bad))
        assert exc.value.field == "mu_dtype"


def test_the_command_line_flag_is_checked_before_anything_runs():
    proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--mu-dtype", "float16"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--mu-dtype" in proc.stderr and "bfloat16" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_default_leaves_every_stored_key_as_it_was():
    """A configuration at the default first moment writes no mu_dtype (the keys of compiled figures, records
    and caches made before it existed stay theirs); another one writes it and reads back."""
    assert "mu_dtype" not in RunConfig().to_dict() and "mu_dtype" not in PlanRequest().to_dict()
    half = RunConfig(mu_dtype="bfloat16")
    assert half.to_dict()["mu_dtype"] == "bfloat16" and RunConfig.from_dict(half.to_dict()) == half
    assert PlanRequest.from_dict(PlanRequest(mu_dtype="bfloat16").to_dict()).mu_dtype == "bfloat16"


def test_a_maxtext_config_gives_the_first_moment_as_maxtext_keeps_it():
    def imported(text: str) -> PlanRequest:
        return with_imported(PlanRequest(source="tpu-v5p-8"), read_config_bytes(text.encode(), "x.yml"),
                             given={"source"})

    assert imported("model_name: llama2-7b\n").mu_dtype == "float32"
    said = imported("model_name: llama2-7b\nmu_dtype: bfloat16\n")
    assert said.mu_dtype == "bfloat16" and any("mu_dtype" in n and "14 bytes" in n for n in said.config_notes)
    # MaxText's default: the first moment in weight_dtype where mu_dtype is unset
    assert imported("model_name: llama2-7b\nweight_dtype: bfloat16\n").mu_dtype == "bfloat16"
    assert imported("model_name: llama2-7b\nweight_dtype: bfloat16\nmu_dtype: float32\n").mu_dtype == "float32"
    odd = imported("model_name: llama2-7b\nmu_dtype: float16\n")
    assert odd.mu_dtype == "float32" and any("mu_dtype=float16" in n for n in odd.config_notes)
    # the user's own choice wins over the file's
    mine = with_imported(PlanRequest(source="tpu-v5p-8", mu_dtype="float32"),
                         read_config_bytes(b"model_name: llama2-7b\nmu_dtype: bfloat16\n", "x.yml"),
                         given={"source", "mu_dtype"})
    assert mine.mu_dtype == "float32"


def test_a_published_maxtext_mixtral_config_is_read_as_maxtext_ran_it():
    """Google's GPU recipe for Mixtral 8x7B on 256 H200 (MaxText of December 2024, kept as published): its
    `decoder_block: mistral` with experts is MaxText's Mixtral of the time, its experts base_mlp_dim wide, its
    first moment in its weight_dtype (bfloat16). Read by today's MaxText defaults its experts are dropless,
    split over its ici_expert_parallelism 8 (by ragged all-to-all); with the `sparse_matmul: false` its MaxText
    meant, capacity dispatch at its factor."""
    path = ROOT / "tests/fixtures/configs/maxtext/gpurecipes-mixtral-8x7b-256gpus-a3u-bf16.yaml"
    imported = read_config_bytes(path.read_bytes(), path.name)
    dropless = with_imported(PlanRequest(source="tpu-v5p-512"), imported, given={"source"})
    assert dropless.source_expert == 8 and dropless.model.get("dispatch", "dropless") == "dropless"
    capacity = read_config_bytes(path.read_bytes() + b"\nsparse_matmul: false\n", path.name)
    req = with_imported(PlanRequest(source="tpu-v5p-512"), capacity, given={"source"})
    w = get_workload(req.workload)
    cfg = w.config(req.preset, req.model)
    assert (req.workload, req.preset, req.mu_dtype, req.source_expert) == ("moe", "mixtral-8x7b", "bfloat16", 8)
    assert (cfg.expert_d_ff, cfg.n_experts, cfg.top_k, cfg.dispatch, cfg.capacity_factor) == (
        14336, 8, 2, "capacity", 1.0)
    assert w.param_count(cfg) == 46_702_792_704  # Mixtral 8x7B's published 46.7B
    assert any("decoder_block=mistral" in n for n in req.config_notes)
