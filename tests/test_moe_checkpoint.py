"""A mixture-of-experts model trained here (AdamW's first moment in bfloat16, as MaxText's MoE recipes keep
it), saved, then served and trained on: the serving request takes its model from the checkpoint, the server's
greedy tokens are the trained model's own continuations, and a run that keeps the first moment in float32
continues from it."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from migration.config.requests import RunConfig
from migration.config.serving import serve_request, serve_run_request
from migration.running import checkpoint
from migration.running.serving import serve_run
from migration.step.train import TrainProgram, make_mesh
from tests.conftest import served_and_greedy, train_and_save
from workloads.moe import MoeDecoder

pytestmark = pytest.mark.slow  # trains and compiles a model; the quick loop has tests/test_moment_dtype.py

TRAINED_MOE = RunConfig(workload="moe", preset="tiny", per_device_batch=2, devices=2, sharding="fsdp", steps=3,
                        warmup_steps=1, precision="fp32", learning_rate=3e-3, mu_dtype="bfloat16")


@pytest.fixture(scope="module")
def trained_moe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt") / "moe"
    return folder, train_and_save(TRAINED_MOE, folder)


def first_moment(opt_state):
    return [s for s in jax.tree.leaves(opt_state, is_leaf=lambda x: hasattr(x, "mu")) if hasattr(s, "mu")][0].mu


def test_the_checkpoints_moe_model_is_what_serving_plans(trained_moe):
    folder, _ = trained_moe
    req = serve_request(workload=None, preset=None, target="h100-sxm", prompt_len=16, gen_len=16,
                        checkpoint=str(folder))
    assert (req.workload, req.preset) == ("moe", "tiny")


def test_served_tokens_are_the_trained_moe_models_greedy_continuations(trained_moe):
    folder, _ = trained_moe
    cfg, params, meta = checkpoint.restore_params(folder)
    assert meta.step == TRAINED_MOE.steps and meta.workload == "moe"
    served, expected = served_and_greedy(cfg, params, MoeDecoder, [[3, 1, 4, 1, 5], [9, 2, 6]], [5, 3])
    assert served == expected


def test_a_serving_run_of_the_trained_moe_checkpoint(trained_moe):
    folder, _ = trained_moe
    result = serve_run(serve_run_request(workload=None, preset=None, precision="int8", requests=4, batches="2",
                                         checkpoint=str(folder)))
    assert result["weights"] == "checkpoint" and result["recompiles"] == 0
    assert result["logits_check"]["within"]
    assert np.isfinite(result["rows"][0]["tpot_p50_s"])


def test_a_run_keeping_the_first_moment_in_float32_continues_from_it(trained_moe):
    """The saved first moment is bfloat16; a run that keeps it in float32 restores it widened (the same
    values), its parameters and second moment as saved."""
    folder, saved = trained_moe
    cfg = dataclasses.replace(TRAINED_MOE, mu_dtype="float32")
    program = TrainProgram.from_config(cfg)
    mesh = make_mesh(jax.devices()[: cfg.devices], cfg.sharding)
    state, meta = checkpoint.restore(folder, cfg, program, mesh)
    assert int(state.step) == meta.step == TRAINED_MOE.steps
    mu, mu_saved = first_moment(state.opt_state), first_moment(saved.opt_state)
    assert {x.dtype for x in jax.tree.leaves(mu)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(mu_saved)} == {jnp.dtype("bfloat16")}
    for a, b in zip(jax.tree.leaves(mu), jax.tree.leaves(mu_saved)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b).astype(np.float32))
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(saved.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
