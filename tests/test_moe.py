"""The mixture-of-experts decoder (workloads/moe.py): its published sizes, its routing and both ways of
computing the experts against a token-by-token reference, its layer plans, and bad dimensions."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from migration.config.requests import RunConfig
from workloads import WORKLOADS
from workloads.base import ModelConfigError
from workloads.moe import _Experts

MOE = WORKLOADS["moe"]

# (total, active per token) as the model cards and papers state them: Mixtral (Mistral's announcements: 46.7B
# / 12.9B, 141B / 39B), DeepSeek-V3 (technical report: 671B / 37B), DeepSeek-V2-Lite (the V2 paper: 15.7B /
# 2.4B, its active count without the input embedding), Qwen3 (model cards: 30.5B / 3.3B, 235B / 22B),
# Llama 4 (Meta's model cards: 109B / 17B and 400B / 17B, with the vision encoder this text model lacks).
PUBLISHED = {
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "mixtral-8x22b": (141e9, 39e9),
    "deepseek-v3": (671e9, 37e9),
    "deepseek-v2-lite": (15.7e9, 2.4e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "qwen3-235b-a22b": (235e9, 22e9),
    "llama4-scout": (109e9, 17e9),
    "llama4-maverick": (400e9, 17e9),
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_presets_have_the_published_total_and_active_parameters(preset):
    cfg = MOE.config(preset)
    total, active = MOE.param_count(cfg), MOE.active_param_count(cfg)
    if preset == "deepseek-v2-lite":
        active -= cfg.vocab_size * cfg.d_model  # the paper's count leaves the input embedding out
    want_total, want_active = PUBLISHED[preset]
    assert total == pytest.approx(want_total, rel=0.02) and active == pytest.approx(want_active, rel=0.03)
    assert active < total / 2  # each token passes a small share of an MoE model


def _experts(**over):
    cfg = MOE.config("tiny", over)
    return cfg, _Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(3))


def _reference(layer: _Experts, x: jax.Array) -> np.ndarray:
    """Token by token: the sum over the token's k experts of its router weight times that expert's MLP."""
    cfg = layer.cfg
    flat = x.reshape(-1, x.shape[-1])
    experts, weights, _ = layer.route(flat)
    up, down = np.asarray(layer.up[...]), np.asarray(layer.down[...])
    out = np.zeros(flat.shape, np.float32)
    for n in range(flat.shape[0]):
        for e, w in zip(np.asarray(experts[n]), np.asarray(weights[n])):
            h = np.asarray(flat[n]) @ up[e]
            gate, lin = h[: cfg.expert_width], h[cfg.expert_width:]
            out[n] += w * (np.asarray(jax.nn.silu(gate)) * lin) @ down[e]
    return out.reshape(x.shape)


def test_dropless_experts_compute_every_tokens_k_experts():
    cfg, layer = _experts()
    x = jax.random.normal(jax.random.key(0), (2, 16, cfg.d_model))
    y, routing = layer(x)
    np.testing.assert_allclose(np.asarray(y), _reference(layer, x), rtol=2e-4, atol=2e-5)
    assert float(routing.dropped) == 0.0 and 0.5 < float(routing.balance) < 4.0  # 1 when perfectly spread
    # the busiest expert's slots over an even share, as counted from the router's choices
    experts = np.asarray(layer.route(x.reshape(-1, cfg.d_model))[0]).reshape(-1)
    counts = np.bincount(experts, minlength=cfg.n_experts)
    assert float(routing.load) == pytest.approx(counts.max() / counts.mean()) and float(routing.load) >= 1.0


def test_capacity_dispatch_drops_only_past_each_experts_slots_in_token_order():
    """With room for every slot it computes what dropless does; with a capacity factor of 0.5, each
    sequence's later slots past an expert's C = ceil(0.5 x T x k / E) are dropped, and the share dropped is
    the one a slot-by-slot count gives."""
    cfg, layer = _experts(dispatch="capacity", capacity_factor=4.0)  # C = T x k: nothing can be dropped
    x = jax.random.normal(jax.random.key(1), (2, 16, cfg.d_model))
    y, routing = layer(x)
    np.testing.assert_allclose(np.asarray(y), _reference(layer, x), rtol=2e-4, atol=2e-5)
    assert float(routing.dropped) == 0.0

    cfg, layer = _experts(dispatch="capacity", capacity_factor=0.5)
    dropped = layer(x)[1].dropped
    experts = np.asarray(layer.route(x.reshape(-1, cfg.d_model))[0]).reshape(2, 16 * cfg.top_k)
    capacity = int(np.ceil(0.5 * 16 * cfg.top_k / cfg.n_experts))
    kept = sum(min(np.sum(row == e), capacity) for row in experts for e in range(cfg.n_experts))
    assert float(dropped) == pytest.approx(1 - kept / experts.size) and float(dropped) > 0


def test_router_scores_run_in_float32_under_bf16():
    cfg = MOE.config("tiny")
    layer = _Experts(cfg, dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(0), (1, 8, cfg.d_model), jnp.bfloat16)
    text = jax.jit(lambda x: layer.route(x.reshape(-1, cfg.d_model))).lower(x).as_text()
    assert "f32" in text and layer.router[...].dtype == jnp.float32
    experts, weights, _ = layer.route(x.reshape(-1, cfg.d_model))
    assert weights.dtype == jnp.float32 and np.allclose(np.asarray(weights).sum(-1), 1.0, atol=1e-6)


@pytest.mark.parametrize("over", [
    {},
    {"dispatch": "capacity"},
    {"attention_type": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 24,
     "q_lora_rank": 24},
    {"n_layers": 5, "first_dense": 1, "moe_period": 2, "router_score": "sigmoid", "n_shared_experts": 0},
], ids=["dropless", "capacity", "mla", "interleaved"])
def test_the_tiny_moe_learns_its_task(trainer, over):
    t = trainer(RunConfig(workload="moe", preset="tiny", model=over, per_device_batch=8, learning_rate=3e-3))
    losses = [float(m["loss"]) for m in t.run(40)]
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


def test_layer_plans_count_dense_and_moe_layers():
    cfg = MOE.config("llama4-maverick")
    assert (cfg.n_moe_layers, cfg.n_dense_layers) == (24, 24)
    cfg = MOE.config("deepseek-v3")
    assert (cfg.n_moe_layers, cfg.n_dense_layers) == (58, 3)


@pytest.mark.parametrize("over, field", [
    ({"top_k": 5}, "top_k"),
    ({"capacity_factor": 0}, "capacity_factor"),
    ({"capacity_factor": -1.5}, "capacity_factor"),
    ({"capacity_factor": float("nan")}, "capacity_factor"),
    ({"n_layers": 4, "first_dense": 1, "moe_period": 2}, "moe_period"),
    ({"first_dense": 3}, "first_dense"),
    ({"n_experts": 0}, "n_experts"),
    ({"dispatch": "einsum"}, "dispatch"),
    ({"attention_type": "mla", "qk_rope_head_dim": 7}, "qk_rope_head_dim"),
    ({"attention_type": "mla", "attention": "cudnn"}, "attention"),
    ({"positions": "learned"}, "positions"),
    ({"router_score": "relu"}, "router_score"),
])
def test_bad_moe_dimensions_are_one_line_naming_the_field(over, field):
    with pytest.raises(ModelConfigError) as info:
        MOE.config("tiny", over)
    text = str(info.value)
    assert text.startswith(f"{field}: ") and "\n" not in text and len(text) < 300


def test_under_an_expert_split_the_busiest_devices_share_is_counted_from_the_routers_choices():
    """The layer traced in a mesh with an expert axis of 2 (experts 0-1 on one device, 2-3 on the other; the
    capacity dispatch, whose buffers are resharded by expert): its device load is the busier device's slots
    over an even share, as counted by hand from the router's top-k; without the axis, 1. (The dropless layer's
    figure under the split, from a whole run: tests/test_moe_checklist.py.)"""
    cfg, layer = _experts(dispatch="capacity", capacity_factor=4.0)
    x = jax.random.normal(jax.random.key(3), (2, 16, cfg.d_model))
    experts = np.asarray(layer.route(x.reshape(-1, cfg.d_model))[0]).reshape(-1)
    held = np.bincount(experts, minlength=cfg.n_experts).reshape(2, -1).sum(axis=1)
    mesh = jax.make_mesh((2,), ("expert",), devices=jax.devices()[:2], axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh):
        y, routing = jax.jit(lambda v: layer(v))(x)
    assert held.max() > held.mean()  # this batch is not evenly spread: the figure has something to show
    assert float(routing.device_load) == pytest.approx(held.max() / held.mean(), rel=1e-6)
    np.testing.assert_allclose(np.asarray(y), _reference(layer, x), rtol=2e-4, atol=2e-5)
    assert float(layer(x)[1].device_load) == 1.0
