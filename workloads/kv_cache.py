"""The decoder's KV cache: its dtype, its layout, the write of new keys and values, and the attention
of new tokens over it (workloads/transformer.py's decode path; the serving planner compiles it).

One array per layer for the keys and one for the values, each (batch, kv heads, positions, head size)
or (batch, positions, kv heads, head size) as the attention that reads it wants (`cache_layout`), so
that a decode step reads every cached byte once, where it lies:

- cuDNN's fused attention (NVIDIA GPUs, `attention="cudnn"`) takes keys and values as (B, T, K, Dh)
  and each row's length as a padding mask: one kernel reads the layer's cache, the scores never leave it;
- the XLA attention (every backend, and an fp8 cache, whose conversion fuses into the products) runs
  two batched products with batch and kv head as the batch dimensions, so the cache is (B, K, T, Dh).

A cache stacked over layers makes XLA copy each layer's slice before the products read it, and a
layout the products do not take makes it transpose one: either moves the whole cache two more times
per token (tests/test_decode.py reads the compiled decode step's bytes).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

SERVING_DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32, "int8": jnp.bfloat16}

HEADS_FIRST = ("batch", "kv_head", "position", "head_dim")
POSITIONS_FIRST = ("batch", "position", "kv_head", "head_dim")


def cache_dtype(precision: str, kv_cache: str = "auto") -> Any:
    """The KV cache's dtype for a serving precision: the compute dtype's, or e4m3 with an fp8 cache."""
    return jnp.float8_e4m3fn if kv_cache == "fp8" else SERVING_DTYPES[precision]


def is_fp8(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def fused_decode(attention: str, dtype: Any) -> bool:
    """Whether cuDNN's fused attention reads the cache in a decode step: the model's attention is
    cuDNN's and the cache is in the compute dtype (an fp8 cache is converted inside XLA's products)."""
    return attention == "cudnn" and not is_fp8(dtype)


def cache_layout(attention: str, dtype: Any) -> tuple[str, ...]:
    """The axes of one layer's keys (or values): those the decode step's attention reads in place."""
    return POSITIONS_FIRST if fused_decode(attention, dtype) else HEADS_FIRST


def layer_shape(layout: tuple[str, ...], batch: int, kv_heads: int, max_len: int, head_dim: int) -> tuple[int, ...]:
    sizes = {"batch": batch, "kv_head": kv_heads, "position": max_len, "head_dim": head_dim}
    return tuple(sizes[a] for a in layout)


def to_cache(x: jax.Array, dtype: Any) -> jax.Array:
    """Keys or values as the cache stores them; an fp8 cache clips to its largest value (unit scale, as
    serving engines' fp8 KV caches do without calibration) rather than overflow."""
    if is_fp8(dtype):
        top = float(jnp.finfo(dtype).max)
        x = jnp.clip(x.astype(jnp.float32), -top, top)
    return x.astype(dtype)


def write(cache: jax.Array, x: jax.Array, start: jax.Array, layout: tuple[str, ...]) -> jax.Array:
    """`cache` (one layer's keys or values, on `layout`) with `x` (B, S, K, Dh) written at positions
    start..start+S-1 of each row (start (B,) int); positions past the cache are dropped. In place
    when the cache is donated."""
    b, s = x.shape[:2]
    rows, cols = jnp.arange(b)[:, None], start[:, None] + jnp.arange(s)[None, :]  # (B, 1), (B, S)
    value = to_cache(x, cache.dtype)
    if layout == POSITIONS_FIRST:
        return cache.at[rows, cols].set(value, mode="drop")
    # (B, S) index pairs on the batch and position axes with a slice between: the values go in as (B, S, K, Dh)
    return cache.at[rows, :, cols].set(value, mode="drop")


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array, layout: tuple[str, ...],
                     implementation: str = "xla") -> jax.Array:
    """Queries (B, S, H, Dh) at positions start + i against one layer's cached keys and values (on
    `layout`): query i of row b sees cache positions 0..start[b] + i. One new token a row (S = 1) on
    cuDNN's fused attention when the layout is its own, the row's length its padding mask; otherwise
    XLA's: the query scaled first, the products and the softmax in float32 from the cache's stored
    values (bf16, fp16 or fp8, converted inside the products)."""
    b, s, h, dh = q.shape
    if implementation == "cudnn" and layout == POSITIONS_FIRST and s == 1:
        return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=start + 1, implementation="cudnn")
    if layout == POSITIONS_FIRST:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (B, K, M, Dh): a copy, off the fused path
    out_dtype = q.dtype
    # the products in float32 from the cache's own bytes: the conversion fuses into them on a GPU, and
    # the CPU backend has no bf16 x bf16 -> f32 product in this layout
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    kv_heads, m = k.shape[1], k.shape[2]
    q = (q * (1.0 / math.sqrt(dh))).reshape(b, s, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("bqkgd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32)  # (B, K, G, S, M)
    visible = jnp.arange(m)[None, None, :] <= (start[:, None] + jnp.arange(s)[None, :])[:, :, None]  # (B, S, M)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    # the softmax's normalisation applied to the output (G x Dh a row) rather than to the scores (M a
    # row): the scores are read by the max, then by the product and the sum, never rewritten
    weights = jnp.exp(scores - jnp.max(scores, axis=-1, keepdims=True))
    out = jnp.einsum("bkgqs,bksd->bqkgd", weights, v, preferred_element_type=jnp.float32)
    total = jnp.sum(weights, axis=-1).transpose(0, 3, 1, 2)[..., None]  # (B, S, K, G, 1)
    return (out / total).astype(out_dtype).reshape(b, s, h, dh)
