"""The decoder families' decode path (workloads/transformer.py `Decoder.extend`): a prompt's prefill
and token-by-token decode over a preallocated KV cache give the logits of the full forward pass at
every position, for both families, tied and untied, in float32 and bfloat16, with prompts of
different lengths in one batch.

Tolerances: float32, 2e-5 of the logits' scale (the two paths sum the same products in another
order); bfloat16, 0.03 of the scale (each path rounds its activations to bfloat16 at other points).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from workloads.base import no_wrap
from workloads.decoding import cache_shapes, empty_cache
from workloads.decoders import LLAMA, WORKLOAD
from workloads.transformer import Decoder

FAMILIES = {
    "gpt2": WORKLOAD.presets["tiny"],
    "llama-tied": LLAMA.presets["tiny"],
    "llama-untied": dataclasses.replace(LLAMA.presets["tiny"], tied_embeddings=False),
    "gpt2-untied": dataclasses.replace(WORKLOAD.presets["tiny"], tied_embeddings=False),
}
TOLERANCE = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}


def model_of(cfg, dtype) -> Decoder:
    return Decoder(cfg, dtype=dtype, block_wrap=no_wrap, rngs=nnx.Rngs(0))


def compiled(model: Decoder, donate: bool = False):
    """`model.extend` and the full forward as compiled functions of the model's state."""
    graphdef, state = nnx.split(model)
    extend = jax.jit(lambda st, tokens, start, cache: nnx.merge(graphdef, st).extend(tokens, start, cache),
                     donate_argnums=(3,) if donate else ())
    forward = jax.jit(lambda st, tokens: nnx.merge(graphdef, st)(tokens))
    return (lambda *a: extend(state, *a)), (lambda tokens: forward(state, tokens)), extend


def compiled_prefill(model: Decoder):
    graphdef, state = nnx.split(model)
    fn = jax.jit(lambda st, tokens, last, cache: nnx.merge(graphdef, st).prefill(tokens, last, cache))
    return lambda *a: fn(state, *a)


def tokens_of(cfg, batch: int, length: int) -> jax.Array:
    return jax.random.randint(jax.random.key(1), (batch, length), 0, cfg.vocab_size, dtype=jnp.int32)


def close(a, b, dtype) -> float:
    """The largest difference as a share of the reference's largest magnitude."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-6))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_then_decode_gives_the_full_forward_logits_at_every_position(family, dtype):
    cfg = FAMILIES[family]
    extend, forward, _ = compiled(model_of(cfg, dtype))
    prefill = compiled_prefill(model_of(cfg, dtype))
    tokens = tokens_of(cfg, 2, 24)
    full = forward(tokens)  # (B, T, V)
    prompt = 9
    cache = empty_cache(cfg, 2, 24, dtype)
    start = jnp.zeros((2,), jnp.int32)
    logits, cache = extend(tokens[:, :prompt], start, cache)
    errors = [close(logits, full[:, :prompt], dtype)]
    first, filled = prefill(tokens[:, :prompt], jnp.full((2,), prompt - 1, jnp.int32), empty_cache(cfg, 2, 24, dtype))
    errors.append(close(first[:, 0], full[:, prompt - 1], dtype))  # the prefill program: last position only
    errors.append(close(filled["k"], cache["k"], dtype))
    for i in range(prompt, 24):
        step, cache = extend(tokens[:, i:i + 1], jnp.full((2,), i, jnp.int32), cache)
        errors.append(close(step[:, 0], full[:, i], dtype))
    assert max(errors) <= TOLERANCE[dtype], errors
    assert len(cache["k"]) == cfg.n_layers and cache["k"][0].shape == cache_shapes(cfg, 2, 24, dtype)[0]
    assert cache["k"][0].shape[1] == cfg.n_kv_heads and cache["k"][0].dtype == dtype  # grouped heads once


@pytest.mark.parametrize("family", ["gpt2", "llama-tied"])
def test_prompts_of_different_lengths_share_one_padded_batch(family):
    cfg = FAMILIES[family]
    model = model_of(cfg, jnp.float32)
    extend, _, _ = compiled(model)
    seqs = tokens_of(cfg, 3, 16)
    lengths = jnp.array([3, 7, 12], jnp.int32)
    padded = jnp.where(jnp.arange(16)[None] < lengths[:, None], seqs, 0)  # right-padded to the bucket
    cache = empty_cache(cfg, 3, 16, jnp.float32)
    logits, cache = compiled_prefill(model)(padded[:, :12], lengths - 1, cache)  # (B, 1, V): each row's last
    # the next token of each row goes at its own length, over what the padding wrote there
    nxt = seqs[jnp.arange(3), lengths]
    step, cache = extend(nxt[:, None], lengths, cache)
    for row in range(3):
        n = int(lengths[row])
        own = model(seqs[row:row + 1, :n + 1])
        assert close(logits[row, 0], own[0, n - 1], jnp.float32) <= TOLERANCE[jnp.float32]
        assert close(step[row, 0], own[0, n], jnp.float32) <= TOLERANCE[jnp.float32]


def test_the_decode_step_compiles_once_and_updates_the_donated_cache():
    cfg = FAMILIES["llama-tied"]
    extend, _, jitted = compiled(model_of(cfg, jnp.float32), donate=True)
    cache = empty_cache(cfg, 2, 16, jnp.float32)
    token = jnp.zeros((2, 1), jnp.int32)
    for i in range(4):
        old = cache
        _, cache = extend(token, jnp.full((2,), i, jnp.int32), cache)
        if jax.default_backend() != "cpu":  # the CPU backend may keep a donated buffer
            assert all(layer.is_deleted() for layer in old["k"])
    assert jitted._cache_size() == 1  # one program for every position


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_the_cache_layouts_give_the_same_attention(dtype):
    """cuDNN's layout (positions before heads) read by the XLA attention, where cuDNN does not run (a
    chunk of several tokens, or this CPU), gives what the XLA layout gives."""
    from workloads import kv_cache

    b, s, h, k, m, dh = 2, 3, 8, 2, 20, 16
    keys = jax.random.split(jax.random.key(3), 3)
    q = jax.random.normal(keys[0], (b, s, h, dh), dtype)
    cache_k, cache_v = (jax.random.normal(key, (b, k, m, dh), dtype) for key in keys[1:])
    start = jnp.array([4, 11], jnp.int32)
    heads_first = kv_cache.cached_attention(q, cache_k, cache_v, start, kv_cache.HEADS_FIRST)
    positions_first = kv_cache.cached_attention(q, cache_k.transpose(0, 2, 1, 3), cache_v.transpose(0, 2, 1, 3), start,
                                                kv_cache.POSITIONS_FIRST, "cudnn")
    np.testing.assert_allclose(np.asarray(positions_first, np.float32), np.asarray(heads_first, np.float32),
                               rtol=1e-6, atol=1e-6)
    # a row sees its cache up to its own position only: what lies past it changes nothing
    later = cache_k.at[0, :, start[0] + s:].set(100.0)
    np.testing.assert_array_equal(kv_cache.cached_attention(q, later, cache_v, start, kv_cache.HEADS_FIRST)[0],
                                  heads_first[0])


def test_the_cache_layout_is_the_one_its_attention_reads_in_place():
    from workloads import kv_cache

    assert kv_cache.cache_layout("cudnn", jnp.bfloat16) == kv_cache.POSITIONS_FIRST  # cuDNN's (B, T, K, Dh)
    assert kv_cache.cache_layout("cudnn", jnp.float8_e4m3fn) == kv_cache.HEADS_FIRST  # fp8: XLA's products
    assert kv_cache.cache_layout("xla", jnp.bfloat16) == kv_cache.HEADS_FIRST
    cfg = dataclasses.replace(FAMILIES["llama-tied"], attention="cudnn")
    assert cache_shapes(cfg, 3, 40, jnp.bfloat16)[0] == (3, 40, cfg.n_kv_heads, cfg.head_dim)
    assert cache_shapes(FAMILIES["llama-tied"], 3, 40, jnp.bfloat16)[0] == (3, cfg.n_kv_heads, 40, cfg.head_dim)
