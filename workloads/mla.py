"""Multi-head latent attention (DeepSeek-V2/V3), for training and for serving.

Queries come directly or through a compressed width (q_lora_rank); keys and values through one compressed
vector of kv_lora_rank per token (normed), expanded per head; each head's query and key carry
qk_rope_head_dim rotated dimensions beside qk_nope_head_dim others, the key's rotated part one for all heads.

The training forward (and a prompt's prefill) expands the compressed keys and values. The decode path
caches what the model compresses: per token and layer the normed latent (kv_lora_rank) and the rotated
key part (qk_rope_head_dim), one copy for all heads, and attends in the latent space (the expansion's key
half folded into the queries, its value half applied after the weighted sum: DeepSeek-V2's "absorbed"
form), so a step reads the compressed cache once and never expands it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from workloads import kv_cache
from workloads.transformer import as_gemm, causal_attention, linear, rotate, splash_attention


def attention_any_v(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention whose values may be narrower than queries and keys (MLA): (B, T, H, Dqk) x 2 and
    (B, T, H, Dv) -> (B, T, H, Dv), products accumulated and the softmax taken in float32."""
    if q.shape[-1] == v.shape[-1]:
        return causal_attention(q, k, v)
    t, dh = q.shape[1], q.shape[-1]
    q = (q * (1.0 / math.sqrt(dh))).astype(k.dtype)
    scores = jnp.einsum("bqhd,bshd->bhqs", q, k, preferred_element_type=jnp.float32)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), dtype=bool)), scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqs,bshd->bqhd", probs, v, preferred_element_type=jnp.float32).astype(v.dtype)


def dense_weight(layer: Any, dtype: Any) -> jax.Array:
    """A Linear's kernel (in, out) in `dtype` (an int8 one scaled back by its columns' scales)."""
    kernel = layer.kernel[...].astype(dtype)
    scale = getattr(layer, "scale", None)
    return kernel if scale is None else kernel * scale[...].astype(dtype)


class LatentAttention(nnx.Module):
    """MLA (see the module's docstring): __call__ the training forward, `extend` the decode path."""

    shards = 1  # GPUs its heads split over when served (workloads/decoding.py shard_fused)

    def __init__(self, cfg: Any, *, dtype, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.n_heads
        self.nope, self.rope_dim, self.v_dim, self.rank = (cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                                           cfg.v_head_dim, cfg.kv_lora_rank)
        qk = self.nope + self.rope_dim
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        plain = dataclasses.replace(cfg, bias=False)
        if cfg.q_lora_rank:
            self.q_a = linear(plain, d, cfg.q_lora_rank, dtype=dtype, rngs=rngs)
            self.q_norm = nnx.RMSNorm(cfg.q_lora_rank, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32,
                                      rngs=rngs)
            self.q = linear(plain, cfg.q_lora_rank, h * qk, dtype=dtype, rngs=rngs)
        else:
            self.q = linear(plain, d, h * qk, dtype=dtype, rngs=rngs)
        self.kv_a = linear(plain, d, self.rank + self.rope_dim, dtype=dtype, rngs=rngs)
        self.kv_norm = nnx.RMSNorm(self.rank, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        self.kv = linear(plain, self.rank, h * (self.nope + self.v_dim), dtype=dtype, rngs=rngs)
        self.out = linear(plain, h * self.v_dim, d, dtype=dtype, rngs=rngs, init=out_init)
        self.n_heads, self.lora_q, self.implementation = h, bool(cfg.q_lora_rank), cfg.attention

    def _queries(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        b, t, _ = x.shape
        q_in = self.q_norm(as_gemm(self.q_a, x)) if self.lora_q else x
        q = checkpoint_name(as_gemm(self.q, q_in, self.shards), "query_proj").reshape(b, t, self.n_heads, -1)
        return q[..., :self.nope], rotate(q[..., self.nope:], *rope)

    def _compressed(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        """Each token's normed latent (B, T, rank) and rotated key part (B, T, 1, rope)."""
        b, t, _ = x.shape
        compressed = as_gemm(self.kv_a, x)
        c, k_rope = compressed[..., :self.rank], compressed[..., self.rank:].reshape(b, t, 1, -1)
        return self.kv_norm(c), rotate(k_rope, *rope)

    def _expanded(self, q_nope, q_rope, latent, k_rope) -> jax.Array:
        """Attention among the tokens themselves, keys and values expanded per head: (B, T, H x v)."""
        b, t, h = q_nope.shape[0], q_nope.shape[1], self.n_heads
        kv = checkpoint_name(self.kv(latent), "kv_proj").reshape(b, t, h, -1)
        k_nope, v = kv[..., :self.nope], kv[..., self.nope:]
        q = jnp.concatenate([q_nope, q_rope], axis=-1)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (b, t, h, self.rope_dim))], axis=-1)
        if self.implementation == "splash":  # the kernel takes one head width: values padded, the padding cut
            padded = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - self.v_dim)))
            y = splash_attention(q, k, padded)[..., :self.v_dim]
        else:
            y = attention_any_v(q, k, v)
        return y.reshape(b, t, -1)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:  # (B, T, D)
        q_nope, q_rope = self._queries(x, rope)
        y = checkpoint_name(self._expanded(q_nope, q_rope, *self._compressed(x, rope)), "attention_out")
        return checkpoint_name(self.out(y), "attention_proj")

    def extend(self, x: jax.Array, rope, start: jax.Array, cache: tuple[jax.Array, jax.Array],
               prefill: bool = False) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """The new tokens `x` (B, S, D) at positions start..start+S-1 over this layer's compressed cache
        (latents (B, M, 1, rank) and rotated key parts (B, M, 1, rope), positions first): theirs written in
        place, each attending to the positions up to its own in the latent space; with `prefill` (every row
        from 0) the prompt attends among itself as in training."""
        q_nope, q_rope = self._queries(x, rope)
        latent, k_rope = self._compressed(x, rope)
        layout = kv_cache.POSITIONS_FIRST
        cached = tuple(kv_cache.write(c, new, start, layout) for c, new in
                       zip(cache, (latent[:, :, None, :], k_rope)))
        if prefill:
            return self.out(self._expanded(q_nope, q_rope, latent, k_rope)), cached
        b, s, h = q_nope.shape[0], q_nope.shape[1], self.n_heads
        f32, dt = jnp.float32, x.dtype
        # the weights' products in the compute dtype, as the projections' are; the cache's in float32 from its
        # own bytes (the conversion fuses into the products on a GPU, as kv_cache.cached_attention's)
        w = dense_weight(self.kv, dt).reshape(self.rank, h, self.nope + self.v_dim)
        c, r = cached[0][:, :, 0].astype(f32), cached[1][:, :, 0].astype(f32)  # (B, M, rank), (B, M, rope)
        q_latent = jnp.einsum("bshn,rhn->bshr", q_nope.astype(dt), w[..., :self.nope]).astype(f32)
        scores = jnp.einsum("bshr,bmr->bhsm", q_latent, c) + jnp.einsum("bshp,bmp->bhsm", q_rope.astype(f32), r)
        scores = scores * (1.0 / math.sqrt(self.nope + self.rope_dim))
        m = c.shape[1]
        visible = jnp.arange(m)[None, None, :] <= (start[:, None] + jnp.arange(s)[None, :])[:, :, None]  # (B, S, M)
        scores = jnp.where(visible[:, None], scores, jnp.finfo(f32).min)
        probs = jax.nn.softmax(scores, axis=-1)
        y = jnp.einsum("bshr,rhv->bshv", jnp.einsum("bhsm,bmr->bshr", probs, c).astype(dt), w[..., self.nope:])
        return as_gemm(self.out, y.astype(dt).reshape(b, s, -1), self.shards), cached
