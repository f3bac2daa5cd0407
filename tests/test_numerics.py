"""Numerics of the migrated step on tiny configs, with real compiles on the CPU backend.

Tolerances (float32 unless stated):
- remat on vs off: loss and every gradient equal to rtol 1e-5 / atol 1e-6 (same math, recomputed);
- k micro-batches of b vs one batch of k*b: loss and gradient norm of each of 3 steps to rtol 1e-5;
  parameters after 3 AdamW steps to atol 5e-5 (1/60 of one step's size at lr 3e-3: Adam divides
  by the gradient's magnitude, so a near-zero gradient turns a 1e-9 difference into a visible one);
- 4 CPU devices vs 1 device on the same global batch: same tolerances;
- bf16 vs fp32: per-step loss within 3% relative over 8 steps (bf16 keeps 8 significant bits).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from migration.config.requests import RunConfig, remat_applies
from migration.step.policies import REMAT_POLICIES, DynamicLossScale
from migration.step.train import TrainProgram, init_state_on, make_data_mesh
from workloads import get_workload

RTOL, ATOL = 1e-5, 2e-6
PARAM_RTOL, PARAM_ATOL = 1e-4, 5e-5


def assert_same_training(ma, mb, state_a, state_b):
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([m[key] for m in ma], [m[key] for m in mb], rtol=RTOL)
    assert_trees_close(state_a.params, state_b.params, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def assert_trees_close(a, b, rtol=RTOL, atol=ATOL):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) and la
    for x, y in zip(la, lb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def loss_and_grads(cfg: RunConfig):
    """The loss and gradients of the config's first micro-batch."""
    program = TrainProgram.from_config(cfg)
    mesh = make_data_mesh(jax.devices()[:1])
    state = init_state_on(program, mesh)
    micro = jax.tree.map(lambda x: x[0], program.make_batch(0))
    grad = jax.jit(program.grad_fn())
    grads, loss, _, _ = grad(state.params, state.model_state, micro, jnp.ones((), jnp.float32))
    return float(loss), jax.device_get(grads)


@functools.cache
def without_remat(workload: str):
    """The no-remat loss and gradients every policy of `workload` is compared with (computed once)."""
    return loss_and_grads(RunConfig(workload=workload, preset="tiny", per_device_batch=4))


@pytest.mark.parametrize("workload, remat", [
    *((w, r) for w in ("mlp", "cnn") for r in ("dots", "full")),
    *(("transformer", r) for r in ("dots", "dots_no_batch", "full")),
    # The named policies on the modern layout (grouped-query attention, SwiGLU, rotary positions;
    # the decoder code is the same for both families).
    *(("llama", r) for r in REMAT_POLICIES if r != "none" and remat_applies(get_workload("llama"), r)),
])
def test_remat_leaves_loss_and_gradients_unchanged(workload, remat):
    """Every policy, the named ones (saved or offloaded to host memory) included, recomputes the same math."""
    base = RunConfig(workload=workload, preset="tiny", per_device_batch=4)
    loss0, grads0 = without_remat(workload)
    loss1, grads1 = loss_and_grads(RunConfig(**{**base.to_dict(), "remat": remat}))
    assert loss1 == pytest.approx(loss0, rel=1e-6)
    assert_trees_close(grads1, grads0, rtol=1e-5, atol=1e-6)


def test_remat_really_changes_the_program():
    # The policies must reach the compiled step: "full" recomputes, so its jaxpr has a remat region.
    for remat, expect in (("none", False), ("full", True)):
        program = TrainProgram.from_config(RunConfig(workload="mlp", preset="tiny", remat=remat))
        mesh = make_data_mesh(jax.devices()[:1])
        state = init_state_on(program, mesh)
        jaxpr = jax.make_jaxpr(program.step_fn())(state, program.make_batch(0))
        assert ("remat" in str(jaxpr) or "checkpoint" in str(jaxpr)) is expect


@pytest.mark.parametrize("workload", ["mlp", "transformer"])
def test_accumulating_k_micro_batches_equals_one_batch_of_k_times_b(trainer, workload):
    one = trainer(RunConfig(workload=workload, preset="tiny", per_device_batch=16, accumulation_steps=1))
    acc = trainer(RunConfig(workload=workload, preset="tiny", per_device_batch=4, accumulation_steps=4))
    assert one.program.global_batch == acc.program.global_batch == 16
    m1, m4 = one.run(3), acc.run(3)
    assert_same_training(m4, m1, acc.state, one.state)


@pytest.mark.parametrize("workload", ["mlp", "cnn", "transformer"])
def test_four_cpu_devices_equal_one_device(trainer, workload):
    assert len(jax.devices()) >= 4, "conftest sets JAX_NUM_CPU_DEVICES=8"
    one = trainer(RunConfig(workload=workload, preset="tiny", per_device_batch=8, devices=1))
    four = trainer(RunConfig(workload=workload, preset="tiny", per_device_batch=2, devices=4))
    m1, m4 = one.run(3), four.run(3)
    # The 4-device state really lives on 4 devices:
    assert len(jax.tree.leaves(four.state.params)[0].sharding.device_set) == 4
    assert_same_training(m4, m1, four.state, one.state)
    if workload == "cnn":  # BatchNorm running statistics agree too
        assert_trees_close(four.state.model_state, one.state.model_state, rtol=PARAM_RTOL, atol=PARAM_ATOL)


def test_batchnorm_statistics_are_global_across_devices_not_per_device():
    """The CNN's BatchNorm normalises over the global micro-batch: per-device statistics (what
    `pmap` without an axis name gives) produce a different loss, and the sharded step matches
    the global one (previous test)."""
    program = TrainProgram.from_config(RunConfig(workload="cnn", preset="tiny", per_device_batch=8))
    mesh = make_data_mesh(jax.devices()[:1])
    state = init_state_on(program, mesh)
    micro = jax.tree.map(lambda x: x[0], program.make_batch(0))
    grad = jax.jit(program.grad_fn())
    one = jnp.ones((), jnp.float32)
    global_grads, _, _, _ = grad(state.params, state.model_state, micro, one)
    shards = [grad(state.params, state.model_state, jax.tree.map(lambda x: x[i * 2:(i + 1) * 2], micro), one)[0]
              for i in range(4)]
    per_device_grads = jax.tree.map(lambda *g: sum(g) / 4, *shards)
    flat = lambda t: np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)])
    g, p = flat(global_grads), flat(per_device_grads)
    relative_difference = np.linalg.norm(g - p) / np.linalg.norm(g)
    assert relative_difference > 100 * RTOL  # far outside the tolerance the 4-vs-1 test holds


def test_bf16_tracks_fp32_over_a_few_steps(trainer):
    fp32 = trainer(RunConfig(workload="transformer", preset="tiny", per_device_batch=8, precision="fp32"))
    bf16 = trainer(RunConfig(workload="transformer", preset="tiny", per_device_batch=8, precision="bf16"))
    l32 = np.array([m["loss"] for m in fp32.run(8)])
    l16 = np.array([m["loss"] for m in bf16.run(8)])
    np.testing.assert_allclose(l16, l32, rtol=0.03)
    assert l16[-1] < l16[0]
    # parameters and optimizer state stay float32 under bf16 compute
    assert {x.dtype for x in jax.tree.leaves(bf16.state.params)} == {jnp.dtype(jnp.float32)}


def test_fp16_scaler_backs_off_on_overflow_and_skips_that_update(trainer):
    # A loss scale of 2^40 overflows float16 in the backward pass at once.
    t = trainer(RunConfig(workload="transformer", preset="tiny", per_device_batch=8, precision="fp16"),
                loss_scale=DynamicLossScale(initial_scale=2.0**40))
    before = jax.device_get(t.state.params)
    opt_before = jax.device_get(t.state.opt_state)
    (m,) = t.run(1)
    assert bool(m["skipped"])
    assert float(t.state.loss_scale.scale) == 2.0**39
    assert_trees_close(t.state.params, before, rtol=0, atol=0)  # update skipped
    assert_trees_close(t.state.opt_state, opt_before, rtol=0, atol=0)
    # It keeps halving until the gradients are finite, then training proceeds.
    ms = t.run(30, start=1)
    skipped = [bool(x["skipped"]) for x in ms]
    # Once finite, updates go through; a later overflow (the model's gradients grow as it learns)
    # halves the scale again and skips that one step.
    assert skipped[0] and skipped.count(False) >= 5
    assert float(t.state.loss_scale.scale) <= 2.0**20  # backed off by 2^20 or more
    assert ms[-1]["loss"] < m["loss"]


def test_fp16_scaler_grows_after_a_run_of_good_steps(trainer):
    t = trainer(RunConfig(workload="mlp", preset="tiny", per_device_batch=8, precision="fp16"),
                loss_scale=DynamicLossScale(initial_scale=2.0**8, growth_interval=3))
    ms = t.run(7)
    assert not any(bool(x["skipped"]) for x in ms)
    assert [float(x["loss_scale"]) for x in ms] == [256, 256, 256, 512, 512, 512, 1024]


def test_fp16_computes_in_half_precision_and_bf16_in_bfloat16():
    for precision, dtype in (("fp16", jnp.float16), ("bf16", jnp.bfloat16), ("fp32", jnp.float32)):
        program = TrainProgram.from_config(RunConfig(workload="mlp", preset="tiny", precision=precision))
        mesh = make_data_mesh(jax.devices()[:1])
        state = init_state_on(program, mesh)
        jaxpr = str(jax.make_jaxpr(program.step_fn())(state, program.make_batch(0)))
        dot_lines = [l for l in jaxpr.splitlines() if "dot_general" in l]
        short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}[jnp.dtype(dtype).name]
        assert dot_lines and all(f"{short}[" in l for l in dot_lines), (precision, dot_lines[:2])


# -- attention and the loss -----------------------------------------------------------------------

def _qkv(dtype, heads=4, kv_heads=2, t=48, dh=16):
    kq, kk, kv = jax.random.split(jax.random.key(7), 3)
    q = jax.random.normal(kq, (2, t, heads, dh), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (2, t, kv_heads, dh), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (2, t, kv_heads, dh), jnp.float32).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_jax_nn_attention_matches_the_einsum_reference(dtype, tol):
    """The model's attention (jax.nn.dot_product_attention, XLA implementation, grouped heads) against
    the einsum version it replaced, forward and backward."""
    from workloads.transformer import causal_attention

    q, k, v = _qkv(dtype)
    nn = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
    np.testing.assert_allclose(np.asarray(nn(q, k, v), np.float32), np.asarray(causal_attention(q, k, v), np.float32),
                               atol=tol, rtol=tol)
    if dtype == jnp.float32:
        loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
        g_nn = jax.grad(loss(nn), argnums=(0, 1, 2))(q, k, v)
        g_ref = jax.grad(loss(causal_attention), argnums=(0, 1, 2))(q, k, v)
        assert_trees_close(g_nn, g_ref, rtol=1e-4, atol=1e-5)


def test_fp16_attention_scales_before_the_product_and_accumulates_in_float32():
    """Queries and keys of magnitude 40 with 64-wide heads: q.k is 102,400, past fp16's 65,504, so
    a product formed in fp16 before scaling is inf and the softmax NaN. Scaled first and accumulated
    in float32, the fp16 attention matches the float32 one to fp16's precision, forward and backward."""
    from workloads.transformer import causal_attention

    t, dh = 16, 64
    kq, kk, kv = jax.random.split(jax.random.key(3), 3)
    q = 40.0 + jax.random.uniform(kq, (1, t, 4, dh))  # every product positive: the sum is about 1e5
    k = 40.0 + jax.random.uniform(kk, (1, t, 2, dh))
    v = jax.random.normal(kv, (1, t, 2, dh))
    assert float(jnp.einsum("d,d->", q[0, 0, 0].astype(jnp.float16), k[0, 0, 0].astype(jnp.float16))) == float("inf")
    q, k, v = (x.astype(jnp.float16) for x in (q, k, v))  # the float32 reference takes the same rounded inputs
    half = jax.jit(causal_attention)(q, k, v)
    assert half.dtype == jnp.float16 and bool(jnp.isfinite(half).all())
    full = causal_attention(*(x.astype(jnp.float32) for x in (q, k, v)))
    np.testing.assert_allclose(np.asarray(half, np.float32), np.asarray(full), atol=2e-2, rtol=2e-2)
    grads = jax.jit(jax.grad(lambda q, k, v: causal_attention(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))(
        q, k, v)
    assert all(bool(jnp.isfinite(g).all()) for g in grads)


def test_fp16_attention_takes_the_einsum_path_the_cpu_can_run():
    from workloads.transformer import TransformerConfig, Attention
    from flax import nnx

    cfg = TransformerConfig(vocab_size=64, seq_len=16, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64)
    attn = Attention(cfg, dtype=jnp.float16, rngs=nnx.Rngs(0))
    x = jnp.ones((2, 16, 32), jnp.float16)
    grads = jax.jit(nnx.grad(lambda m: m(x, None).astype(jnp.float32).sum()))(attn)
    assert all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("t, dtype, tol", [(300, jnp.float32, 1e-6), (256, jnp.float32, 1e-6), (300, jnp.bfloat16, 2e-2)])
def test_chunked_cross_entropy_equals_the_full_loss(t, dtype, tol):
    """Chunks of 128 tokens (300: the last one padded and masked) give the loss and gradients of the
    full float32 logits."""
    from workloads.base import LOSS_CHUNK_MIN_LOGITS, chunked_cross_entropy, cross_entropy

    vocab = 4096
    assert t * vocab >= LOSS_CHUNK_MIN_LOGITS  # the chunked path, not the small-problem one
    kh, kw, ky = jax.random.split(jax.random.key(3), 3)
    h = jax.random.normal(kh, (3, t, 32), jnp.float32).astype(dtype)
    w = (0.3 * jax.random.normal(kw, (32, vocab), jnp.float32)).astype(dtype)
    y = jax.random.randint(ky, (3, t), 0, vocab)
    chunked = lambda h, w: chunked_cross_entropy(h, lambda x: x @ w, y)  # noqa: E731
    full = lambda h, w: cross_entropy(h @ w, y)  # noqa: E731
    np.testing.assert_allclose(float(chunked(h, w)), float(full(h, w)), rtol=tol)
    g_chunked = jax.grad(chunked, argnums=(0, 1))(h, w)
    g_full = jax.grad(full, argnums=(0, 1))(h, w)
    for a, b in zip(g_chunked, g_full):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()) * (1 if dtype == jnp.float32 else 5)


def test_the_decoder_loss_is_chunked_and_equals_the_loss_of_its_logits():
    """A decoder whose logits are large enough to chunk: its training loss equals the plain loss
    of model(tokens)'s full logits."""
    from workloads.base import cross_entropy

    w = get_workload("llama")
    cfg = w.config("tiny", {"vocab_size": 8192, "seq_len": 512})
    model = w.build(cfg, dtype=jnp.float32, block_wrap=lambda f: f, rngs=__import__("flax").nnx.Rngs(0))
    batch = w.make_batch(cfg, jax.random.key(1), 2)
    tokens = batch["tokens"]
    assert w.activation_profile(cfg).head_fp32 < 1.5 * cfg.seq_len * cfg.vocab_size  # planned as chunked
    np.testing.assert_allclose(float(w.loss(model, batch)), float(cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])),
                               rtol=1e-6)


# -- rotary positions and norms of the Llama presets ------------------------------------------------

def _llama3_reference_frequencies(head_dim, theta, factor, low, high, context):
    """Meta's reference (llama3 `apply_scaling`), one frequency at a time, in float64."""
    import math

    scaled = []
    for i in range(0, head_dim, 2):
        freq = theta ** (-i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            scaled.append(freq)
        elif wavelen > context / low:
            scaled.append(freq / factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(scaled)


@pytest.mark.parametrize("preset, factor", [("1b", 32.0), ("3b", 32.0), ("8b", 8.0)])
def test_llama_presets_scale_rotary_frequencies_as_llama3_and_use_epsilon_1e_5(preset, factor):
    from workloads.transformer import rope_tables, rope_frequencies

    llama = get_workload("llama")
    cfg = llama.config(preset, {})
    assert (cfg.rope_scaling, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor, cfg.rope_original_context,
            cfg.rope_theta, cfg.norm_eps) == (factor, 1.0, 4.0, 8192, 500000.0, 1e-5)
    want = _llama3_reference_frequencies(cfg.head_dim, 500000.0, factor, 1.0, 4.0, 8192)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), want, rtol=2e-6)
    # all three regimes occur: kept (short wavelengths), divided (long), blended (between)
    plain = 500000.0 ** (-np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    ratio = want / plain
    assert np.isclose(ratio, 1).any() and np.isclose(ratio, 1 / factor).any()
    assert ((ratio > 1 / factor + 1e-6) & (ratio < 1 - 1e-6)).any()
    cos, sin = rope_tables(cfg, 4096)
    for position in (0, 1, 777, 4095):
        np.testing.assert_allclose(np.asarray(cos[position]), np.cos(position * want), atol=2e-4)
        np.testing.assert_allclose(np.asarray(sin[position]), np.sin(position * want), atol=2e-4)
    from flax import nnx

    small = dataclasses.replace(cfg, n_layers=1, d_model=64, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=64, seq_len=8)
    model = llama.build(small, dtype=jnp.float32, block_wrap=lambda f: f, rngs=nnx.Rngs(0))
    assert model.norm_f.epsilon == 1e-5


def test_an_unscaled_rope_keeps_the_plain_frequencies_and_bad_scaling_is_refused():
    from workloads.base import ModelConfigError
    from workloads.transformer import rope_frequencies

    llama = get_workload("llama")
    tiny = llama.config("tiny", {})
    np.testing.assert_allclose(np.asarray(rope_frequencies(tiny)),
                               10000.0 ** (-np.arange(0, tiny.head_dim, 2) / tiny.head_dim), rtol=1e-6)
    for bad in ({"rope_scaling": 0.5}, {"rope_high_freq_factor": 0.5}, {"norm_eps": -1.0}, {"rope_original_context": 0}):
        with pytest.raises(ModelConfigError, match=next(iter(bad))):
            llama.config("8b", bad)
