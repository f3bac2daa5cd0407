"""Serving a mixture-of-experts model: its decode path against its training forward (grouped-query and
multi-head latent attention, dense and MoE layers, shared experts, int8 experts), MLA's compressed cache,
the experts a step touches (by hand and by sampling routes), the routed experts' kernels by hand, and
serve-plan on the tiny preset over one and two GPUs with the refusals of splits that do not divide."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from migration.common import ConfigError
from migration.config.serving import ServeRequest, serve_request
from migration.hardware import GPU_SPECS
from migration.planning.routed_experts import (EXPERT_PARALLEL, EXPERT_TENSOR_PARALLEL, expert_layout,
                                               routed_kernels, touched_experts)
from migration.planning.serving import _Planner, kv_bytes_per_token, kv_cache_bytes, serving_config
from workloads import get_workload
from workloads.decoding import cache_shapes, empty_cache, serving_decoder

MOE = get_workload("moe")
MLA = {"attention_type": "mla", "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
       "q_lora_rank": 12, "first_dense": 1, "n_shared_experts": 1}


@pytest.mark.parametrize("dims, precision", [({}, "fp32"), (MLA, "int8"), (MLA, "fp32"),
                                              ({**MLA, "q_lora_rank": 0, "first_dense": 0}, "int8"),
                                              ({"n_layers": 4, "moe_period": 2, "first_dense": 2}, "fp32")],
                         ids=["gqa", "mla-int8", "mla", "mla-direct-queries-int8", "interleaved"])
def test_the_decode_path_gives_the_training_forwards_logits(dims, precision):
    """A prompt prefilled into the cache and three tokens decoded one at a time give the logits the
    training forward gives at those positions: exactly in float32 (to rounding), within int8's rounding of
    the weights for int8 (whose routed experts are held as int8 too: their quantisation changes the logits)."""
    cfg = MOE.config("tiny", dims)
    model = serving_decoder(cfg, precision, nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    full = model(tokens).astype(jnp.float32)
    cache = empty_cache(cfg, 2, 16, jnp.float32 if precision == "fp32" else jnp.bfloat16)
    logits, cache = model.prefill(tokens[:, :6], jnp.array([5, 5]), cache)
    got = [logits[:, 0]]
    for i in range(6, 9):
        logits, cache = model.extend(tokens[:, i:i + 1], jnp.array([i, i]), cache)
        got.append(logits[:, 0])
    err = float(jnp.max(jnp.abs(jnp.stack(got, 1).astype(jnp.float32) - full[:, 5:9])))
    assert err < (1e-5 if precision == "fp32" else 2e-2), err
    if precision == "int8":
        experts = model.blocks.experts
        assert experts.up[...].dtype == jnp.int8 and experts.scales is not None


def test_mla_caches_the_compressed_latent_and_rotated_key_once_for_all_heads():
    """DeepSeek-V3: 61 layers x (kv_lora_rank 512 + rotated key 64) x 2 B = 70,272 B a position in bf16, whole
    on every GPU of a tensor-parallel node (one compressed head); Mixtral 8x7B's grouped-query cache: 2 x 32
    layers x 8 kv heads x 128 x 2 B = 131,072 B, split over the GPUs by kv head."""
    v3 = MOE.config("deepseek-v3", {})
    assert cache_shapes(v3, 3, 40, jnp.bfloat16) == ((3, 40, 1, 512), (3, 40, 1, 64))
    assert kv_cache_bytes(v3, 1, 1, 2) == 70_272
    assert kv_bytes_per_token(v3, "bf16", "auto", 8) == 70_272
    mixtral = MOE.config("mixtral-8x7b", {})
    assert kv_bytes_per_token(mixtral, "bf16", "auto", 1) == 131_072
    assert kv_bytes_per_token(mixtral, "bf16", "auto", 2) == 65_536


def test_the_experts_a_step_touches_by_hand_and_by_sampled_routes():
    """8 experts, top-2: one token touches 2; two touch 8 x (1 - (6/8)^2) = 3.5 in expectation; many touch
    all 8. The formula against routes drawn as the even router draws them (each token's k distinct experts
    uniformly): the mean distinct count of 4,000 draws within 2% at 1, 3, 10 and 40 tokens (128 experts, top-8)."""
    assert touched_experts(8, 2, 1) == pytest.approx(2.0)
    assert touched_experts(8, 2, 2) == pytest.approx(3.5)
    assert touched_experts(8, 2, 1000) == pytest.approx(8.0)
    rng = np.random.default_rng(0)
    for tokens in (1, 3, 10, 40):
        drawn = [len({e for _ in range(tokens) for e in rng.choice(128, 8, replace=False)}) for _ in range(4000)]
        assert np.mean(drawn) == pytest.approx(touched_experts(128, 8, tokens), rel=0.02)


def test_the_routed_kernels_by_hand():
    """Mixtral 8x7B (d 4,096, expert width 14,336, gated, top-2 of 8, 32 MoE layers, no shared experts) at one
    token on two GPUs in bf16: 2 experts touched, 1 a GPU; its up product reads 4,096 x 28,672 x 2 B =
    234,881,024 B of weights a layer, its down 14,336 x 4,096 x 2 B = 117,440,512 B; FLOPs of 1 slot a GPU:
    2 x 4,096 x 28,672 and 2 x 14,336 x 4,096 a layer; the router 2 x 4,096 x 8 a layer; the outputs summed over
    the two GPUs (4,096 x 2 B a layer), there being no shared experts to carry the sum."""
    cfg = MOE.config("mixtral-8x7b", {})
    assert expert_layout(cfg, 2) == EXPERT_PARALLEL and expert_layout(cfg, 3) == EXPERT_TENSOR_PARALLEL
    up, down, router, summed = routed_kernels(cfg, 1, 2, 2, 2, "bf16")
    assert up.flops == 32 * 2 * 4096 * 28672 and down.flops == 32 * 2 * 14336 * 4096
    rows_up = 1 * 4096 * 2 + 1 * 28672 * 2
    assert up.bytes == 32 * (234_881_024 + rows_up)
    assert down.bytes == pytest.approx(32 * (117_440_512 + 14336 * 2 + 4096 * 2))
    assert router.flops == 32 * 2 * 4096 * 8 and router.unit == "fp32"
    assert (summed.kind, summed.group, summed.bytes) == ("all-reduce", 2, 32 * 4096 * 2)
    shared = MOE.config("deepseek-v3", {})
    assert [k.kind for k in routed_kernels(shared, 4, 8, 1, 2, "bf16")] == ["matmul"] * 3  # summed with the shared


@pytest.fixture(scope="module")
def tiny_plans():
    from migration.planning.serving import serve_plan
    one = serve_plan(ServeRequest("moe", "tiny", "h100-sxm", prompt_len=40, gen_len=20))
    two = serve_plan(ServeRequest("moe", "tiny", "h100-sxm", prompt_len=40, gen_len=20, gpus=2, model=MLA,
                                  precision="int8"))
    return one, two


def test_a_tiny_moe_serving_plan_reads_the_experts_its_batch_touches(tiny_plans):
    """Rows read more of the routed experts as the batch grows, never more than they hold, and the bandwidth
    floor counts the touched ones only; the summary says the layout and the counts."""
    one, _ = tiny_plans
    cfg = MOE.config("tiny", {})
    moe = one["mixture_of_experts"]
    assert (moe["param_count"], moe["active_param_count"]) == (MOE.param_count(cfg), MOE.active_param_count(cfg))
    assert moe["experts_per_gpu"] == cfg.n_experts and one["largest_batch"] > 0
    rows = one["rows"]
    touched = [r["experts_touched"] for r in rows]
    assert touched == sorted(touched) and touched[0] == pytest.approx(cfg.top_k) and touched[-1] <= cfg.n_experts
    for r in rows:
        held = moe["routed_bytes_per_gpu_held"]
        assert r["routed_bytes_read"] == pytest.approx(held * r["experts_touched"] / cfg.n_experts)
        assert r["weights_read_bytes"] <= r["weights_bytes"]
        assert r["bandwidth_limit_tpot_s"] == pytest.approx(
            (r["weights_read_bytes"] + r["kv_cache_bytes_read"]) / GPU_SPECS["h100-sxm"].bandwidth_bytes_per_s)


def test_mla_over_two_gpus_keeps_its_cache_whole_and_splits_the_experts_by_number(tiny_plans):
    _, two = tiny_plans
    cfg = MOE.config("tiny", MLA)
    assert two["kv_bytes_per_token"] == cfg.n_layers * (16 + 4) * 2  # bf16 cache beside int8 weights, not halved
    moe = two["mixture_of_experts"]
    assert moe["layout"] == EXPERT_PARALLEL and moe["experts_per_gpu"] == cfg.n_experts // 2
    assert "latent" in moe["attention"]
    assert all(r["decode_communication_s"] > 0 for r in two["rows"])


def test_serving_splits_that_do_not_divide_are_refused_naming_the_counts_that_do():
    """The tiny preset (4 heads, 2 kv heads, 4 experts of width 64) does not divide over 3 GPUs: every part
    that does not is named, and the counts that do; with MLA (one compressed kv head, not split) 4 GPUs do."""
    with pytest.raises(ConfigError, match=r"gpus: .*kv heads 2.*routed experts 4 \(and their width 64\).*"
                                          r"GPU counts that do: 1, 2\)$"):
        serve_request(workload="moe", preset="tiny", target="h100-sxm", prompt_len=8, gen_len=8, gpus=3)
    serve_request(workload="moe", preset="tiny", target="h100-sxm", prompt_len=8, gen_len=8, gpus=4,
                  model={**MLA, "d_ff": 128})
    ok = serve_request(workload="moe", preset="tiny", target="h100-sxm", prompt_len=8, gen_len=8, gpus=2, model=MLA)
    assert serving_config(ok, GPU_SPECS["h100-sxm"]).attention == "xla"  # MLA's decode is its own, not cuDNN's
    assert math.isclose(_Planner(ok).per_token, kv_bytes_per_token(MOE.config("tiny", MLA), "bf16", "auto", 2))


@pytest.mark.parametrize("dims", [{**MLA, "d_ff": 128}, {}], ids=["mla-shared-experts", "gqa"])
def test_the_moe_serving_layout_over_two_devices_gives_the_whole_models_logits(dims):
    """The served layout (planning/serving.py `serving_spec`): the routed experts whole over two CPU devices
    (two of the four each), the attention and the dense and shared MLPs split as Megatron splits them, MLA's
    compressed cache whole on each, a grouped-query cache by kv head; prefill and two decode steps, routed
    experts computed, give the unsplit model's logits."""
    from jax.sharding import Mesh, PartitionSpec as P

    from migration.planning.serving import MODEL_AXIS, cache_sharding, serving_spec
    from workloads.decoding import cache_layout_of
    from workloads.transformer import tensor_parallel_shardings

    cfg = MOE.config("tiny", dims)
    mesh = Mesh(np.array(jax.devices()[:2]), (MODEL_AXIS,))
    whole = serving_decoder(cfg, "fp32", nnx.Rngs(3))
    graphdef, state = nnx.split(serving_decoder(cfg, "fp32", nnx.Rngs(3), shards=2))
    state = jax.device_put(state, tensor_parallel_shardings(state, mesh, MODEL_AXIS, serving_spec))
    up = state["blocks"]["experts"]["up"]
    assert up.sharding.spec == P(None, MODEL_AXIS, None, None) and up.addressable_shards[0].data.shape[1] == cfg.n_experts // 2
    layout = cache_layout_of(cfg, jnp.float32)
    cache = empty_cache(cfg, 2, 16, jnp.float32)
    cache = {name: [jax.device_put(c, cache_sharding(mesh, layout, c.shape)) for c in arrays]
             for name, arrays in cache.items()}
    if cfg.attention_type == "mla":
        assert all(c.sharding.spec == P(None, None, None, None) for c in cache["k"])
    ref_cache = empty_cache(cfg, 2, 16, jnp.float32)
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    last = jnp.array([11, 7])
    got, cache = jax.jit(lambda st, t, l, c: nnx.merge(graphdef, st).prefill(t, l, c))(state, tokens, last, cache)
    want, ref_cache = whole.prefill(tokens, last, ref_cache)
    step = jax.jit(lambda st, t, s, c: nnx.merge(graphdef, st).extend(t, s, c))
    for position in range(2):
        np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))
        token = jnp.argmax(want[:, -1], -1)[:, None].astype(jnp.int32)
        got, cache = step(state, token, last + 1 + position, cache)
        want, ref_cache = whole.extend(token, last + 1 + position, ref_cache)
    np.testing.assert_allclose(got, want, atol=1e-5 * float(jnp.abs(want).max()))


def test_a_model_no_gpu_of_the_node_holds_says_how_many_would():
    """Two MoE layers of 64 experts 4,096 x 14,336 wide (gated): 2 x 64 x 3 x 4,096 x 14,336 x 2 B = 45.1 GB of
    routed experts in bf16, against an L4's 21.6 GB budget (0.9 x 24 GB): nothing fits on one, and the weights
    alone, split evenly, need 3."""
    from migration.planning.serving import serve_plan

    dims = {"d_model": 4096, "n_heads": 32, "n_kv_heads": 8, "n_layers": 2, "first_dense": 0, "n_shared_experts": 0,
            "n_experts": 64, "top_k": 2, "expert_d_ff": 14336, "vocab_size": 1024}
    plan = serve_plan(serve_request(workload="moe", preset="tiny", target="l4", prompt_len=32, gen_len=16, model=dims))
    assert plan["largest_batch"] == 0 and not plan["rows"][0]["fits"]
    held = plan["mixture_of_experts"]["routed_bytes_per_gpu_held"]
    assert held == 2 * 64 * 3 * 4096 * 14336 * 2
    assert plan["fewest_gpus_for_weights"] == math.ceil(plan["rows"][0]["weights_bytes"] / plan["budget_bytes"]) == 3
