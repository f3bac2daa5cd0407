"""Workload protocol: analytic parameter counts and FLOPs, data shapes, and learnability."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from migration.config.requests import RunConfig
from workloads import WORKLOADS
from workloads.base import no_wrap

ALL_PRESETS = [(w.name, p) for w in WORKLOADS.values() for p in w.presets]


@pytest.mark.parametrize("name,preset", ALL_PRESETS)
def test_param_count_matches_model(name, preset):
    w = WORKLOADS[name]
    cfg = w.config(preset)
    model = nnx.eval_shape(lambda: w.build(cfg, dtype=jnp.float32, block_wrap=no_wrap, rngs=nnx.Rngs(0)))
    actual = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert actual == w.param_count(cfg)


def test_transformer_presets_have_the_promised_sizes():
    w = WORKLOADS["transformer"]
    assert abs(w.param_count(w.config("small")) - 42e6) < 1e6  # the guide's 42M example
    assert abs(w.param_count(w.config("gpt2-small")) - 124e6) < 1e6
    assert abs(w.param_count(w.config("gpt2-medium")) - 355e6) < 5e6
    assert w.config("gpt2-small").seq_len == 1024


def test_transformer_flops_follow_6n_plus_attention():
    w = WORKLOADS["transformer"]
    cfg = w.config("gpt2-small")
    non_embedding = cfg.n_layers * 12 * cfg.d_model**2
    six_n = 6 * (non_embedding + cfg.vocab_size * cfg.d_model) * cfg.seq_len
    attention = 12 * cfg.n_layers * cfg.d_model * cfg.seq_len**2
    assert w.flops_per_example(cfg) == pytest.approx(six_n + attention, rel=1e-9)


def test_mlp_flops_are_six_times_the_weights():
    w = WORKLOADS["mlp"]
    cfg = w.config("tiny")
    weights = sum(i * o for i, o in cfg.layer_sizes)
    assert w.flops_per_example(cfg) == 6 * weights


def test_cnn_flops_count_resnet18_at_about_half_a_gigamac():
    # ResNet-18 on 32x32 inputs is ~0.56 GMACs forward: 3 x 2 x 0.56e9 FLOPs for training.
    w = WORKLOADS["cnn"]
    assert w.flops_per_example(w.config("resnet18")) == pytest.approx(3 * 2 * 0.556e9, rel=0.02)


@pytest.mark.parametrize("name", list(WORKLOADS))
def test_batches_have_the_declared_fixed_shapes(name):
    w = WORKLOADS[name]
    cfg = w.config("tiny")
    shapes = w.batch_shapes(cfg, 6)
    for seed in (0, 1):
        batch = jax.jit(lambda k: w.make_batch(cfg, k, 6))(jax.random.key(seed))
        assert {k: (v.shape, v.dtype) for k, v in batch.items()} == {k: (s.shape, s.dtype) for k, s in shapes.items()}


def test_transformer_data_follows_its_rule():
    w = WORKLOADS["transformer"]
    cfg = w.config("tiny")
    tokens = np.asarray(w.make_batch(cfg, jax.random.key(3), 64)["tokens"])
    perm = np.asarray(jax.random.permutation(jax.random.key(20261129), cfg.vocab_size))
    follows = (perm[tokens[:, :-1]] == tokens[:, 1:]).mean()
    assert 0.9 < follows < 0.99  # 5% noise, the rest predictable


@pytest.mark.parametrize("name,batch,steps,lr", [("mlp", 32, 40, 3e-3), ("cnn", 32, 40, 3e-3), ("transformer", 8, 40, 3e-3)])
def test_loss_falls_clearly_on_every_tiny_preset(trainer, name, batch, steps, lr):
    t = trainer(RunConfig(workload=name, preset="tiny", per_device_batch=batch, learning_rate=lr))
    losses = [float(m["loss"]) for m in t.run(steps)]
    first, last = np.mean(losses[:3]), np.mean(losses[-5:])
    assert last < 0.6 * first, losses
