"""Tensor-parallel serving layout (workloads/decoding.py `shard_fused`, workloads/transformer.py `tensor_parallel_spec`):
the fused projections reordered so that each GPU's block holds both halves of its heads or hidden
units, the parameters and the KV cache placed over a "model" axis of CPU devices; the logits of the
full forward and of prefill plus decode equal the unsharded model's."""

from __future__ import annotations

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from migration.config.serving import serve_request
from migration.planning.serving import kv_cache_bytes, serve_plan
from workloads.decoding import empty_cache, serving_decoder
from workloads.decoders import LLAMA, WORKLOAD
from workloads.transformer import tensor_parallel_shardings


def placed(model, mesh: Mesh):
    """The model's state placed over `mesh` by tensor_parallel_spec."""
    graphdef, state = nnx.split(model)

    return graphdef, jax.device_put(state, tensor_parallel_shardings(state, mesh))


@pytest.mark.parametrize("family,precision,shards", [("llama", "fp32", 2), ("llama", "int8", 2), ("gpt2", "fp32", 2),
                                                     ("gpt2", "fp32", 4)])
def test_the_sharded_layout_computes_the_same_logits(family, precision, shards):
    cfg = (LLAMA if family == "llama" else WORKLOAD).presets["tiny"]  # llama: 2 kv heads; gpt2: 4 heads
    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    whole = serving_decoder(cfg, precision, nnx.Rngs(5))
    graphdef, state = placed(serving_decoder(cfg, precision, nnx.Rngs(5), shards=shards), mesh)
    kv = state["blocks"]["attn"]["kv"]["kernel"]
    assert kv.sharding.spec == P(None, None, "model") and len(kv.addressable_shards) == shards
    tokens = jax.random.randint(jax.random.key(0), (2, 12), 0, cfg.vocab_size)
    tol = 1e-5 if precision == "fp32" else 2e-2
    forward = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t))(state, tokens)
    np.testing.assert_allclose(forward, whole(tokens), atol=tol * float(jnp.abs(whole(tokens)).max()))
    # prefill then two decode steps, the cache split over kv heads
    dtype = forward.dtype
    cache_sharding = NamedSharding(mesh, P(None, "model", None, None))  # (B, K, M, Dh): XLA attention's layout
    cache = jax.tree.map(lambda c: jax.device_put(c, cache_sharding), empty_cache(cfg, 2, 16, dtype))
    ref_cache = empty_cache(cfg, 2, 16, dtype)
    last = jnp.array([11, 7])
    step = jax.jit(lambda st, t, s, c: nnx.merge(graphdef, st).extend(t, s, c))
    got, cache = jax.jit(lambda st, t, l, c: nnx.merge(graphdef, st).prefill(t, l, c))(state, tokens, last, cache)
    want, ref_cache = whole.prefill(tokens, last, ref_cache)
    for position in range(2):
        np.testing.assert_allclose(got, want, atol=tol * float(jnp.abs(want).max()))
        token = jnp.argmax(want[:, -1], -1)[:, None].astype(jnp.int32)
        got, cache = step(state, token, last + 1 + position, cache)
        want, ref_cache = whole.extend(token, last + 1 + position, ref_cache)
    assert all(c.sharding.is_equivalent_to(cache_sharding, c.ndim) for c in cache["k"])  # stayed split


def collectives(compiled_text: str) -> Counter:
    return Counter(re.findall(r"= \S+ (all-reduce|all-gather|all-to-all|collective-permute|reduce-scatter)"
                              r"(?:-start)?\(", compiled_text))


@pytest.mark.parametrize("family,shards", [("llama", 2), ("gpt2", 4)])
def test_a_decode_step_over_the_layout_needs_only_two_all_reduces_a_layer(family, shards):
    """Megatron's split: the attention output and the MLP's down projection each sum their GPUs' parts
    (one all-reduce each); nothing else moves. The trained layout placed the same way would need the
    halves of the fused projections moved between GPUs (collective-permutes), which shard_fused avoids."""
    cfg = (LLAMA if family == "llama" else WORKLOAD).presets["tiny"]
    mesh = Mesh(np.array(jax.devices()[:shards]), ("model",))
    cache_sharding = NamedSharding(mesh, P(None, "model", None, None))  # (B, K, M, Dh): XLA attention's layout
    found = {}
    for layout in (shards, 1):
        graphdef, state = placed(serving_decoder(cfg, "fp32", nnx.Rngs(0), shards=layout), mesh)
        cache = jax.device_put(empty_cache(cfg, 2, 16, jnp.float32), cache_sharding)
        step = jax.jit(lambda st, t, s, c: nnx.merge(graphdef, st).extend(t, s, c))
        found[layout] = collectives(step.lower(state, jnp.zeros((2, 1), jnp.int32), jnp.array([3, 4]), cache)
                                    .compile().as_text())
    assert found[shards] == Counter({"all-reduce": 2 * cfg.n_layers}), found
    assert found[1]["collective-permute"] > 0, found


def test_a_tensor_parallel_plan_is_per_gpu_and_pays_for_its_all_reduces():
    """Deviceless plans of the same model on 1 and 2 H100s: each GPU holds half the KV cache (compiled as
    the arithmetic says) and less than the whole weights; the decode step's all-reduces cost time
    over NVLink; a GPU count that does not divide the kv heads is refused."""
    plans = {g: serve_plan(serve_request(workload="llama", preset="tiny", target="h100-sxm", prompt_len=32,
                                         gen_len=16, batches="1,8", gpus=g)) for g in (1, 2)}
    for one, two in zip(plans[1]["rows"], plans[2]["rows"]):
        assert two["gpus"] == 2 and two["batch"] == one["batch"]
        assert two["kv_cache_bytes"] * 2 == one["kv_cache_bytes"] == kv_cache_bytes(
            LLAMA.presets["tiny"], one["batch"], 48, 2)
        assert two["kv_cache_bytes_compiled"] == two["kv_cache_bytes_read"] == one["kv_cache_bytes_read"] / 2
        assert one["weights_bytes"] / 2 < two["weights_bytes"] < one["weights_bytes"]  # embeddings whole on each
        assert one["decode_communication_s"] == 0 < two["decode_communication_s"]
        assert two["tokens_per_s_per_gpu"] == pytest.approx(two["batch"] / two["predicted_tpot_s"] / 2)
    assert "NVLink" in plans[2]["link"]
