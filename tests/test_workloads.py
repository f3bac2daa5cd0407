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


def test_mlp_flops_are_six_times_the_weights_less_the_first_layers_input_gradient():
    w = WORKLOADS["mlp"]
    cfg = w.config("tiny")
    weights = sum(i * o for i, o in cfg.layer_sizes)
    first = cfg.layer_sizes[0][0] * cfg.layer_sizes[0][1]
    assert w.flops_per_example(cfg) == 6 * weights - 2 * first


def test_llama_flops_count_grouped_query_attention_and_the_swiglu_mlp():
    """Llama 3.1 8B by its published shapes: per token 6 x (the blocks' matmul weights: q and output
    4096 x 4096, k and v 4096 x 1024 each, three 4096 x 14336 MLP matrices; the 128,256 x 4096 output
    head) + 12 x layers x d_model x seq for the scores and values (PaLM's convention)."""
    w = WORKLOADS["llama"]
    cfg = w.config("8b")
    per_layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336
    per_token = 6 * (32 * per_layer + 128256 * 4096) + 12 * 32 * 4096 * 2048
    assert w.flops_per_example(cfg) == pytest.approx(per_token * 2048, rel=1e-12)
    assert 6 * (32 * per_layer + 128256 * 4096) == pytest.approx(6 * 7.5e9, rel=0.01)  # 8.0B less the input embedding


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


# One block for the decoders: XLA's cost analysis counts a scan's body once, whatever its length.
COMPILED_CASES = [
    ("mlp", "tiny", {}, 64),
    ("mlp", "small", {}, 64),
    ("cnn", "tiny", {}, 16),
    ("transformer", "tiny", {"n_layers": 1, "d_model": 256, "n_heads": 4, "seq_len": 128, "vocab_size": 512}, 8),
    ("llama", "tiny", {"n_layers": 1, "d_model": 256, "n_heads": 4, "n_kv_heads": 2, "d_ff": 512, "seq_len": 128,
                       "vocab_size": 512}, 8),
]


@pytest.mark.parametrize("name, preset, model, batch", COMPILED_CASES, ids=[c[0] + "-" + c[1] for c in COMPILED_CASES])
def test_training_flops_match_the_compiled_steps_cost_analysis(name, preset, model, batch):
    """Each family's FLOPs per example against XLA's count for the whole train step compiled for the
    CPU backend (fp32). The compiled count also holds the elementwise work and the optimizer update,
    which the model-FLOPs convention leaves out: within -5% / +10% of ours."""
    import jax

    from migration.config.requests import RunConfig
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_data_mesh

    mesh = make_data_mesh(jax.devices()[:1])
    program = TrainProgram.from_config(RunConfig(workload=name, preset=preset, model=model, per_device_batch=batch,
                                                 precision="fp32"))
    compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    w = WORKLOADS[name]
    ours = w.flops_per_example(w.config(preset, model)) * batch
    assert 0.95 <= analysis["flops"] / ours <= 1.10, (analysis["flops"], ours)
