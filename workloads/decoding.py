"""The model as a server holds it (workloads/transformer.py's Decoder): weight-only int8, the fused
projections laid out for tensor parallelism, the serving dtypes, and the KV cache's arrays for its
decode path (their layout: workloads/kv_cache.py). The serving planner and the measured server build
their model here (migration/planning/serving.py, migration/running/serving.py)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from workloads import kv_cache
from workloads.base import no_wrap
from workloads.kv_cache import SERVING_DTYPES
from workloads.mla import LatentAttention
from workloads.moe import MoeConfig, MoeDecoder
from workloads.transformer import Attention, Decoder, Mlp, TransformerConfig


class Int8Linear(nnx.Module):
    """A Linear whose kernel is stored as int8 with one float32 scale per output column (weight-only,
    symmetric): y = (x @ kernel) * scale + bias, the dot in the compute dtype. The int8 kernel is
    converted inside the dot's operand, where XLA can fuse the conversion into the matmul; the scale
    applies to the product, so no dequantised copy of the weights needs to exist."""

    def __init__(self, kernel: jax.Array, scale: jax.Array, bias: jax.Array | None, dtype):
        self.kernel = nnx.Param(kernel)  # int8 (..., in, out)
        self.scale = nnx.Param(scale)  # float32 (..., out)
        self.bias = nnx.Param(bias) if bias is not None else None
        self.dtype = dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        # The barrier ties the kernel's conversion to this layer's input: without it the scheduler may
        # convert every layer's weights up front (a whole bf16 copy of them alive at once).
        x, kernel = jax.lax.optimization_barrier((x.astype(self.dtype), self.kernel[...]))
        y = jnp.dot(x, kernel.astype(self.dtype)) * self.scale[...].astype(self.dtype)
        return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def quantize_kernel(kernel: jax.Array) -> tuple[jax.Array, jax.Array]:
    """int8 values and float32 scales of `kernel` (..., in, out): per output column, the largest
    magnitude maps to 127 (a zero column gets scale 1)."""
    w = kernel.astype(jnp.float32)
    peak = jnp.max(jnp.abs(w), axis=-2)
    scale = jnp.where(peak > 0, peak / 127.0, 1.0)
    return jnp.clip(jnp.round(w / scale[..., None, :]), -127, 127).astype(jnp.int8), scale


def quantize_int8(model: Decoder) -> Decoder:
    """`model` with every Linear (attention and MLP projections of every layer, and the output head
    when it is not tied to the embedding) replaced by an Int8Linear of its weights, and an MoE model's
    routed experts held as int8 with their columns' scales, in place. The embedding, the norms and the
    router stay in floating point: a tied head reads the embedding as it is."""
    for path, module in list(nnx.iter_modules(model)):
        if hasattr(module, "scales") and hasattr(module, "router"):  # an MoE layer's routed experts
            (up, up_scale), (down, down_scale) = (quantize_kernel(w[...]) for w in (module.up, module.down))
            module.up, module.down = nnx.Param(up), nnx.Param(down)
            module.scales = (nnx.Param(up_scale), nnx.Param(down_scale))
        elif isinstance(module, nnx.Linear):
            kernel, scale = quantize_kernel(module.kernel[...])
            bias = module.bias[...] if module.bias is not None else None
            parent = model
            for name in path[:-1]:
                parent = getattr(parent, name)
            setattr(parent, path[-1], Int8Linear(kernel, scale, bias, module.dtype))
    return model


def shard_fused(model: Decoder, shards: int) -> Decoder:
    """`model` laid out for `shards`-way tensor parallelism, in place: the columns of the fused
    projections (keys and values of grouped-query attention; gate and up of gated MLPs, an MoE model's
    dense layers and shared experts among them) reordered so that each of `shards` contiguous blocks
    holds both halves of one shard's heads or hidden units, which `fused_halves` then reads. The
    function computed is unchanged. MLA's projections hold whole heads in contiguous columns already."""
    if shards == 1:
        return model
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, Attention):
            linear = module.kv
        elif isinstance(module, Mlp) and module.gated:
            linear = module.up
        else:
            if isinstance(module, LatentAttention):
                module.shards = shards  # nothing fused to reorder: whole heads in contiguous columns
            continue
        for name in ("kernel", "bias", "scale"):
            var = getattr(linear, name, None)
            if var is not None:
                x = var[...]
                *lead, width = x.shape
                var[...] = jnp.swapaxes(x.reshape(*lead, 2, shards, width // (2 * shards)), -3, -2).reshape(x.shape)
        module.shards = shards
    return model


def serving_decoder(cfg: TransformerConfig, precision: str, rngs: nnx.Rngs, state: Any = None,
                    shards: int = 1) -> Decoder:
    """The model as a server holds it: floating weights (and the KV cache, and the compute) in the
    serving dtype; for "int8", the Linear weights quantised to int8 from float32 (quantize_int8) and
    the rest in bf16; with `shards` > 1, laid out for tensor parallelism (shard_fused). `state`, when
    given, replaces the fresh parameters first (a checkpoint's)."""
    dtype = SERVING_DTYPES[precision]
    model = (MoeDecoder if isinstance(cfg, MoeConfig) else Decoder)(cfg, dtype=dtype, block_wrap=no_wrap, rngs=rngs)
    if state is not None:
        nnx.update(model, state)
    if precision == "int8":
        quantize_int8(model)
    shard_fused(model, shards)
    cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x  # noqa: E731
    nnx.update(model, jax.tree.map(cast, nnx.state(model)))
    return model


def cache_shapes(cfg: TransformerConfig, batch: int, max_len: int, dtype: Any) -> tuple[tuple[int, ...], ...]:
    """The shapes of one layer's two cache arrays in a `dtype` cache: keys and values
    (kv_cache.cache_layout), or for MLA the normed latents and the rotated key parts (workloads/mla.py),
    positions first with one head for all."""
    if getattr(cfg, "attention_type", "gqa") == "mla":
        return ((batch, max_len, 1, cfg.kv_lora_rank), (batch, max_len, 1, cfg.qk_rope_head_dim))
    layout = kv_cache.cache_layout(cfg.attention, dtype)
    return (kv_cache.layer_shape(layout, batch, cfg.n_kv_heads, max_len, cfg.head_dim),) * 2


def cache_layout_of(cfg: TransformerConfig, dtype: Any) -> tuple[str, ...]:
    """The axes of one layer's cache arrays (MLA's: positions first, one head)."""
    if getattr(cfg, "attention_type", "gqa") == "mla":
        return kv_cache.POSITIONS_FIRST
    return kv_cache.cache_layout(cfg.attention, dtype)


def empty_cache(cfg: TransformerConfig, batch: int, max_len: int, dtype) -> dict[str, list[jax.Array]]:
    """The cache as `extend` takes it: {"k": [n_layers arrays], "v": [...]}, zeros."""
    shapes = cache_shapes(cfg, batch, max_len, dtype)
    return {name: [jnp.zeros(shape, dtype) for _ in range(cfg.n_layers)] for name, shape in zip(("k", "v"), shapes)}
