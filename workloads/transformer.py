"""The decoder-only language model: the GPT-2 layout and the modern family (RMSNorm, SwiGLU MLP, rotary
positions, grouped-query attention, the layout of Llama-style models), one model with any dimensions, its
decode path over a KV cache (workloads/kv_cache.py) and its tensor-parallel layout. The two families as
workloads, their task and presets: workloads/decoders.py.

Layers are stacked (every block parameter has a leading `n_layers` axis) and run by one
`lax.scan`, so XLA compiles one block body whatever the depth; `layer_loop="unrolled"` runs them
as a Python loop instead (the code of a model that loops over its layers, or Paxml's
`USE_REPEATED_LAYER=False`): one copy of the block per layer in the program, no stacked buffer of
saved activations between forward and backward, and a compile that grows with the depth.
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

from workloads.base import (
    BlockWrap,
    ModelConfigError,
)

NORMS = ("layernorm", "rmsnorm")
# The MLP's activation: a plain two-matrix MLP (up, activation, down) with GELU, ReLU or squared ReLU
# (Primer's; MaxText's 2023 default decoder is ReLU), or a gated one (a gate and an up projection, their
# product down: SwiGLU with SiLU, Llama's; GeGLU with GELU, Gemma's).
MLPS = ("gelu", "swiglu", "geglu", "relu", "squared_relu")
GATED_MLPS = ("swiglu", "geglu")
POSITIONS = ("learned", "rope")
ATTENTIONS = ("xla", "cudnn", "splash")
LAYER_LOOPS = ("scan", "unrolled")
# Names of the activations a block tags with `checkpoint_name`, which the named remat policies
# (migration/step/policies.py) save, offload or recompute.
# The block's input is tagged too ("decoder_layer_input", MaxText's name): under a layer scan it is the
# carry each layer keeps for its backward pass, which a policy may offload to host memory.
CHECKPOINT_NAMES = ("query_proj", "kv_proj", "attention_out", "attention_proj", "mlp_hidden", "mlp_out",
                    "decoder_layer_input")
# cuDNN's fused attention takes head sizes that are multiples of 8, up to 128 on every architecture
# it supports (the planner picks XLA attention otherwise).
CUDNN_HEAD_DIM_MAX = 128
# XLA's GPU compiler turns a one-row product whose operands are smaller than this (elements) into a multiply
# and a reduction (xla/backends/gpu/transforms/dot_strength_reduction.cc, its threshold): see as_gemm
STRENGTH_REDUCED_BELOW = 10_000_000

# Bounds of each dimension a user may give (CLI, app, API): validation and help text read them.
DIM_LIMITS: dict[str, tuple[int, int]] = {
    "n_layers": (1, 256),
    "d_model": (8, 65536),
    "n_heads": (1, 1024),
    "n_kv_heads": (1, 1024),
    "d_ff": (1, 262144),
    "vocab_size": (2, 1_048_576),
    "seq_len": (2, 131072),
}


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    vocab_size: int
    seq_len: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # grouped-query attention when smaller than n_heads (it must divide it)
    d_ff: int
    tied_embeddings: bool = True  # output projection = the input embedding's transpose
    norm: str = "layernorm"
    mlp: str = "gelu"  # one of MLPS: "gelu": up, GELU, down; "swiglu": SiLU(gate) x up, down; ...
    positions: str = "learned"  # "learned": a position table; "rope": rotary on queries and keys
    bias: bool = True  # biases in the linear layers (GPT-2) or none (modern family)
    rope_theta: float = 500000.0
    # Llama 3's frequency scaling of rotary positions ("llama3" rope_type): 1.0 is none; otherwise long
    # wavelengths are divided by this factor, short ones kept, those between blended (`rope_frequencies`).
    rope_scaling: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    norm_eps: float = 1e-5  # the norms' epsilon (GPT-2's layer_norm_epsilon, Llama 3's rms_norm_eps)
    noise: float = 0.05
    # jax.nn.dot_product_attention's implementation: "xla" (every backend) or "cudnn" (NVIDIA GPUs); or
    # "splash": Pallas' block-sparse flash attention for TPUs (MaxText's), compiled for a TPU slice only
    attention: str = "xla"
    layer_loop: str = "scan"  # "scan": one lax.scan over the stacked layers; "unrolled": a Python loop over them
    # The longest sequence the model serves (prompt and generation), its published context window: 0 is
    # seq_len. With rotary positions it may exceed the training length (Llama 3.1 8B trains here at 2,048
    # and serves 131,072); learned positions serve at most their table, seq_len.
    context: int = 0
    # Each head's size where a model sets it apart from d_model / n_heads (Gemma's 256, Qwen3's 128): 0 is
    # d_model / n_heads. The queries then project d_model to n_heads x head_size, the output back.
    head_size: int = 0
    # Under tensor parallelism, the residual stream between blocks sharded over the tensor axis by its
    # embedding dimension (MaxText's `activation_embed` rule on TPUs) rather than whole on each device of the
    # split: a block's saved input is then a 1/T share. Off: the residual stream is replicated (Megatron's).
    residual_over_tensor: bool = False

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.n_heads

    @property
    def gated(self) -> bool:
        """The MLP has a gate beside its up projection (three matrices, not two)."""
        return self.mlp in GATED_MLPS

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention's output): n_heads x head size."""
        return self.n_heads * self.head_dim

    @property
    def max_context(self) -> int:
        return self.context or self.seq_len


def check_config(cfg: TransformerConfig) -> TransformerConfig:
    """`cfg` unchanged if its dimensions are in range and consistent; else ModelConfigError."""
    for name, (lo, hi) in DIM_LIMITS.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelConfigError(name, f"must be an integer from {lo} to {hi}; got {value!r}")
    for name, allowed in (("norm", NORMS), ("mlp", MLPS), ("positions", POSITIONS), ("attention", ATTENTIONS),
                          ("layer_loop", LAYER_LOOPS)):
        if getattr(cfg, name) not in allowed:
            raise ModelConfigError(name, f"must be one of {', '.join(allowed)}; got {getattr(cfg, name)!r}")
    for name in ("tied_embeddings", "bias", "residual_over_tensor"):
        if not isinstance(getattr(cfg, name), bool):
            raise ModelConfigError(name, f"must be true or false; got {getattr(cfg, name)!r}")
    if isinstance(cfg.head_size, bool) or not (isinstance(cfg.head_size, int) and 0 <= cfg.head_size <= 1024):
        raise ModelConfigError("head_size", f"must be an integer from 0 (d_model / n_heads) to 1024; got {cfg.head_size!r}")
    if not cfg.head_size and cfg.d_model % cfg.n_heads:
        raise ModelConfigError("n_heads", f"must divide d_model ({cfg.d_model}); got {cfg.n_heads}")
    if cfg.n_heads % cfg.n_kv_heads:
        raise ModelConfigError("n_kv_heads", f"must divide n_heads ({cfg.n_heads}); got {cfg.n_kv_heads}")
    if cfg.positions == "rope" and cfg.head_dim % 2:
        raise ModelConfigError("n_heads", f"rotary positions need an even head size; got {cfg.head_dim}")
    if not (isinstance(cfg.noise, (int, float)) and 0 <= cfg.noise <= 0.5):
        raise ModelConfigError("noise", f"must be a number from 0 to 0.5; got {cfg.noise!r}")
    for name, lo, hi in (("rope_theta", 1, 1e9), ("rope_scaling", 1, 1024), ("rope_low_freq_factor", 0.01, 1000),
                         ("rope_high_freq_factor", 0.01, 1000), ("norm_eps", 1e-12, 0.1)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and lo <= value <= hi):
            raise ModelConfigError(name, f"must be a number from {lo:g} to {hi:g}; got {value!r}")
    if cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
        raise ModelConfigError("rope_high_freq_factor", f"must be above rope_low_freq_factor "
                                                        f"({cfg.rope_low_freq_factor:g}); got {cfg.rope_high_freq_factor!r}")
    if isinstance(cfg.rope_original_context, bool) or not (
            isinstance(cfg.rope_original_context, int) and 1 <= cfg.rope_original_context <= 1_048_576):
        raise ModelConfigError("rope_original_context", f"must be an integer from 1 to 1048576; "
                                                        f"got {cfg.rope_original_context!r}")
    if isinstance(cfg.context, bool) or not (isinstance(cfg.context, int) and 0 <= cfg.context <= 1_048_576):
        raise ModelConfigError("context", f"must be an integer from 0 (seq_len) to 1048576; got {cfg.context!r}")
    if cfg.positions == "learned" and cfg.context > cfg.seq_len:
        raise ModelConfigError("context", f"learned positions serve at most their table of seq_len ({cfg.seq_len}) "
                                          f"positions; got {cfg.context}")
    return cfg


_init = nnx.initializers.normal(stddev=0.02)


def linear(cfg: TransformerConfig, d_in: int, d_out: int, *, dtype, rngs: nnx.Rngs, init=_init) -> nnx.Linear:
    return nnx.Linear(d_in, d_out, use_bias=cfg.bias, kernel_init=init, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def norm_layer(cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs) -> nnx.Module:
    if cfg.norm == "rmsnorm":
        return nnx.RMSNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
    return nnx.LayerNorm(cfg.d_model, epsilon=cfg.norm_eps, dtype=dtype, param_dtype=jnp.float32, rngs=rngs)


def fused_halves(h: jax.Array, shards: int = 1) -> tuple[jax.Array, jax.Array]:
    """The two outputs a fused projection computes along its last axis (keys and values, or the gate
    and the up projection). Trained layout: first all of one, then all of the other. With `shards`
    (a tensor-parallel layout, `shard_fused`), the axis holds `shards` blocks, each the first's and
    then the second's columns of one shard, so that each GPU's block has both halves of its part."""
    *lead, width = h.shape
    parts = h.reshape(*lead, shards, 2, width // (2 * shards))
    return parts[..., 0, :].reshape(*lead, width // 2), parts[..., 1, :].reshape(*lead, width // 2)


class Attention(nnx.Module):
    shards = 1  # the fused keys-and-values projection's layout (fused_halves)

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        d, dh = cfg.d_model, cfg.head_dim
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        self.q = linear(cfg, d, cfg.n_heads * dh, dtype=dtype, rngs=rngs)
        self.kv = linear(cfg, d, 2 * cfg.n_kv_heads * dh, dtype=dtype, rngs=rngs)
        self.out = linear(cfg, cfg.n_heads * dh, d, dtype=dtype, rngs=rngs, init=out_init)
        self.n_heads, self.n_kv_heads, self.implementation = cfg.n_heads, cfg.n_kv_heads, cfg.attention

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None) -> jax.Array:  # (B, T, D)
        b, t, _ = x.shape
        q = checkpoint_name(self.q(x), "query_proj").reshape(b, t, self.n_heads, -1)  # (B, T, H, Dh)
        k, v = (h.reshape(b, t, self.n_kv_heads, -1) for h in  # (B, T, K, Dh) each
                fused_halves(checkpoint_name(self.kv(x), "kv_proj"), self.shards))
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        y = checkpoint_name(self._causal(q, k, v).reshape(b, t, -1), "attention_out")
        return checkpoint_name(self.out(y), "attention_proj")


    def _causal(self, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        if self.implementation == "xla" and q.dtype == jnp.float16:
            return causal_attention(q, k, v)  # the CPU backend rejects jax.nn's fp16 version (float32 accumulation)
        if self.implementation == "splash":
            return splash_attention(q, k, v)
        if self.implementation == "cudnn":
            q, k, v = heads_alike(q, k, v)
        # K < H heads are taken as they are (grouped-query attention)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=self.implementation)

    def extend(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None, start: jax.Array,
               cache: tuple[jax.Array, jax.Array], prefill: bool = False
               ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """Attention of the new tokens `x` (B, S, D), at positions start..start+S-1 of each row (start
        (B,) int), over this layer's KV cache (keys and values, on kv_cache.cache_layout): their keys
        and values are written into it in place, and each attends to the cache's positions up to its
        own. Grouped-query heads are cached once (K of them), as the model computes them. With
        `prefill` (every row starts at 0) the tokens attend among themselves, with the training
        forward's attention (fused where it is), not over the whole cache."""
        b, s, _ = x.shape
        q = as_gemm(self.q, x, self.shards).reshape(b, s, self.n_heads, -1)
        k, v = (h.reshape(b, s, self.n_kv_heads, -1) for h in
                fused_halves(as_gemm(self.kv, x, self.shards), self.shards))
        if rope is not None:
            q, k = rotate(q, *rope), rotate(k, *rope)
        layout = kv_cache.cache_layout(self.implementation, cache[0].dtype)
        cache_k, cache_v = (kv_cache.write(c, x, start, layout) for c, x in zip(cache, (k, v)))
        y = (self._causal(q, k, v) if prefill
             else kv_cache.cached_attention(q, cache_k, cache_v, start, layout, self.implementation))
        return as_gemm(self.out, y.reshape(b, s, -1), self.shards), (cache_k, cache_v)


def as_gemm(layer: Any, x: jax.Array, shards: int = 1) -> jax.Array:
    """`layer(x)` (a Linear, or Int8Linear) over two rows where `x` (B, S, D) has one and the product
    would not stay a GEMM.

    XLA's GPU compiler rewrites a product of one row by a matrix whose operands come to fewer than
    STRENGTH_REDUCED_BELOW elements on a device (a 1B model's projections, an 8B model's keys-and-values)
    as an elementwise multiply, written out whole, and a reduction that reads it back
    (dot_strength_reduction.cc): three passes over the weights where a GEMM reads them once. A second,
    zero row keeps it a GEMM; its output row is dropped. Larger products are left as they are."""
    if x.shape[0] * x.shape[1] != 1:
        return layer(x)
    rows, cols = layer.kernel.shape[-2:]
    if rows * cols // shards + rows + cols >= STRENGTH_REDUCED_BELOW:
        return layer(x)
    return layer(jnp.concatenate([x, jnp.zeros_like(x)], axis=1))[:, :1]


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention by Pallas' splash kernel for TPUs (block-sparse flash attention: masked blocks
    skipped, the scores never stored), as MaxText runs it: queries scaled first, grouped key and value
    heads repeated, one kernel per sequence, inside `shard_map` over the mesh the step set (a custom call
    is not partitioned by XLA): the batch over every axis but "tensor", the heads over "tensor"."""
    # reason: Pallas' TPU kernels are needed only by a program compiled for a TPU slice
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    group = q.shape[2] // k.shape[2]
    q = (q * (1.0 / math.sqrt(q.shape[-1]))).astype(k.dtype)
    q, k, v = (x.transpose(0, 2, 1, 3) for x in (q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)))

    def local(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:  # (B, H, T, Dh) on one device
        heads, t = q.shape[1], q.shape[2]
        kernel = splash.make_splash_mha(masks.MultiHeadMask([masks.CausalMask((t, t))] * heads),
                                        head_shards=1, q_seq_shards=1)
        return jax.vmap(kernel)(q, k, v)

    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.axis_names:
        return local(q, k, v).transpose(0, 2, 1, 3)
    batch = tuple(a for a in mesh.axis_names if a != "tensor")
    spec = jax.sharding.PartitionSpec(batch, "tensor" if "tensor" in mesh.axis_names else None, None, None)
    out = jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)(q, k, v)
    return out.transpose(0, 2, 1, 3)


def heads_alike(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Queries, keys and values (B, T, heads, Dh) held alike, as cuDNN's fused attention demands of its
    partitioned call: on an ambient mesh with a tensor axis (the step sets it under tensor parallelism), the batch
    over every other axis and the heads over the tensor axis (whole where the key heads do not divide over
    it); unchanged otherwise."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "tensor" not in mesh.axis_names or mesh.shape["tensor"] == 1:
        return q, k, v
    batch = tuple(a for a in mesh.axis_names if a != "tensor" and mesh.shape[a] > 1) or None
    split = "tensor" if k.shape[2] % mesh.shape["tensor"] == 0 and q.shape[2] % mesh.shape["tensor"] == 0 else None
    spec = jax.sharding.PartitionSpec(batch, None, split, None)
    return tuple(jax.lax.with_sharding_constraint(x, spec) for x in (q, k, v))  # type: ignore[return-value]


def residual(x: jax.Array, cfg: TransformerConfig) -> jax.Array:
    """The residual stream (B, T, D) as the layout keeps it between blocks: with `residual_over_tensor` on a
    mesh with a tensor axis, D sharded over it (the batch over the other axes); otherwise as XLA lays it."""
    mesh = jax.sharding.get_abstract_mesh()
    if not cfg.residual_over_tensor or "tensor" not in mesh.axis_names or mesh.shape["tensor"] == 1:
        return x
    batch = tuple(a for a in mesh.axis_names if a != "tensor")
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(batch, None, "tensor"))


def rope_frequencies(cfg: TransformerConfig) -> jax.Array:
    """The rotary angular frequencies, (Dh/2,) in float32: theta^(-2i/Dh), with Llama 3's scaling
    where `rope_scaling` > 1. Measured against the original context, a wavelength longer than
    context / low_freq_factor is divided by the factor, one shorter than context / high_freq_factor is
    kept, and those between are blended linearly in context / wavelength."""
    dh = cfg.head_dim
    freq = cfg.rope_theta ** (-jnp.arange(0, dh, 2, dtype=jnp.float32) / dh)
    if cfg.rope_scaling == 1:
        return freq
    ratio = cfg.rope_original_context * freq / (2 * math.pi)  # context / wavelength
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    keep = jnp.clip((ratio - low) / (high - low), 0.0, 1.0)  # 0: divided by the factor, 1: kept
    return (1 - keep) * freq / cfg.rope_scaling + keep * freq


def rope_tables(cfg: TransformerConfig, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles, (T, Dh/2) in float32."""
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * rope_frequencies(cfg)[None]
    return jnp.cos(angles), jnp.sin(angles)


def rope_at(cfg: TransformerConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos and sin of the rotary angles at `positions` (B, T) int: (B, T, Dh/2) in float32."""
    angles = positions.astype(jnp.float32)[..., None] * rope_frequencies(cfg)
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary positions on (B, T, heads, Dh), the two halves of each head as (real, imaginary); cos
    and sin (T, Dh/2) for every row alike, or (B, T, Dh/2) per row."""
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    c, s = (cos[None, :, None], sin[None, :, None]) if cos.ndim == 2 else (cos[:, :, None], sin[:, :, None])
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention with grouped heads written out as einsums: the query scaled by 1/sqrt(Dh)
    before the product, both products accumulated in float32, the softmax in float32. In fp16 the
    unscaled q.k overflows past 65,504 (inf, then NaN, which loss scaling cannot rescue). The fp16
    path (jax.nn's XLA version asks for float32 accumulation of fp16 products in a form the CPU
    backend rejects) and the reference the jax.nn paths are tested against."""
    b, t, h, dh = q.shape
    kv_heads = k.shape[2]
    q = (q * (1.0 / math.sqrt(dh))).astype(k.dtype).reshape(b, t, kv_heads, h // kv_heads, dh)  # (B, T, K, G, Dh)
    scores = jnp.einsum("bqkgd,bskd->bkgqs", q, k, preferred_element_type=jnp.float32)  # (B, K, G, T, T)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgqs,bskd->bqkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(v.dtype).reshape(b, t, h, dh)  # (B, T, H, Dh)


def _squared_relu(h: jax.Array) -> jax.Array:
    return jnp.square(jax.nn.relu(h))


# Each MLP's activation: of the hidden units (plain), or of the gate (gated).
ACTIVATION = {"gelu": jax.nn.gelu, "relu": jax.nn.relu, "squared_relu": _squared_relu, "swiglu": jax.nn.silu,
               "geglu": jax.nn.gelu}


class Mlp(nnx.Module):
    shards = 1  # the fused gate-and-up projection's layout (fused_halves)

    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        self.gated, self.activation = cfg.gated, cfg.mlp
        self.up = linear(cfg, cfg.d_model, (2 if self.gated else 1) * cfg.d_ff, dtype=dtype, rngs=rngs)
        self.down = linear(cfg, cfg.d_ff, cfg.d_model, dtype=dtype, rngs=rngs, init=out_init)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, T, D); one row: a decode step's (as_gemm)
        h = checkpoint_name(as_gemm(self.up, x, self.shards), "mlp_hidden")
        act = ACTIVATION[self.activation]
        if self.gated:
            gate, up = fused_halves(h, self.shards)
            return checkpoint_name(as_gemm(self.down, act(gate) * up, self.shards), "mlp_out")
        return checkpoint_name(as_gemm(self.down, act(h), self.shards), "mlp_out")


class Block(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs)
        self.norm2 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope: tuple[jax.Array, jax.Array] | None) -> jax.Array:  # (B, T, D)
        x = checkpoint_name(x, "decoder_layer_input")
        x = x + self.attn(self.norm1(x), rope)
        return x + self.mlp(self.norm2(x))

    def extend(self, x: jax.Array, rope, start: jax.Array, cache, prefill: bool = False):
        y, cache = self.attn.extend(self.norm1(x), rope, start, cache, prefill)
        x = x + y
        return x + self.mlp(self.norm2(x)), cache


class Decoder(nnx.Module):
    def __init__(self, cfg: TransformerConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=_init, dtype=dtype,
                               param_dtype=jnp.float32, rngs=rngs)
        if cfg.positions == "learned":
            self.positions = nnx.Embed(cfg.seq_len, cfg.d_model, embedding_init=_init, dtype=dtype,
                                       param_dtype=jnp.float32, rngs=rngs)

        @nnx.split_rngs(splits=cfg.n_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stacked(rngs: nnx.Rngs) -> Block:
            return Block(cfg, dtype=dtype, rngs=rngs)

        self.blocks = stacked(rngs)  # every parameter (n_layers, ...)
        self.norm_f = norm_layer(cfg, dtype=dtype, rngs=rngs)
        if not cfg.tied_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False, kernel_init=_init, dtype=dtype,
                                   param_dtype=jnp.float32, rngs=rngs)
        self.block_call = block_wrap(Block.__call__)

    def __call__(self, tokens: jax.Array) -> jax.Array:  # (B, T) int32 -> (B, T, V) logits
        return self.project(self.hidden(tokens))

    def project(self, x: jax.Array) -> jax.Array:  # (B, T, D) -> (B, T, V) logits
        return self.embed.attend(x) if self.cfg.tied_embeddings else self.head(x)

    def hidden(self, tokens: jax.Array) -> jax.Array:  # (B, T) int32 -> (B, T, D), after the final norm
        cfg = self.cfg
        t = tokens.shape[1]
        x = self.embed(tokens)
        rope = None
        if cfg.positions == "learned":
            x = x + self.positions(jnp.arange(t))[None]
        else:
            rope = rope_tables(cfg, t)
        graphdef, layers = nnx.split(self.blocks)

        def layer(x: jax.Array, params: Any) -> tuple[jax.Array, None]:
            return residual(self.block_call(nnx.merge(graphdef, params), residual(x, cfg), rope), cfg), None

        if cfg.layer_loop == "unrolled":
            for i in range(cfg.n_layers):
                x, _ = layer(x, jax.tree.map(lambda a: a[i], layers))
        else:
            x, _ = jax.lax.scan(layer, x, layers)
        return self.norm_f(x)


    def prefill(self, tokens: jax.Array, last: jax.Array, cache: dict[str, jax.Array]
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """A batch of prompts (B, P), right-padded, each row's last prompt token at `last` (B,): the
        logits (B, 1, V) of those positions and the cache filled from position 0. The prompt attends
        among itself as in training (fused attention where the model uses it)."""
        return self.extend(tokens, jnp.zeros_like(last), cache, last, prefill=True)

    def extend(self, tokens: jax.Array, start: jax.Array, cache: dict[str, jax.Array],
               last: jax.Array | None = None, prefill: bool = False) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The decode path: logits (B, S, V) of `tokens` (B, S) placed at positions start..start+S-1
        of each row (start (B,) int32), given the keys and values of the positions before them in
        `cache` ({"k", "v"}: a list of n_layers arrays each (kv_cache.cache_layout), M positions long);
        returns the
        cache with these tokens' keys and values written in (in place when the cache is donated). A
        prompt is one call with start 0 (the prefill; with `last` (B,), the position of each row's
        last prompt token, only those logits, (B, 1, V)), then one token a call. Positions past M are
        dropped; every position must stay below `seq_len` with learned positions."""
        cfg = self.cfg
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None]  # (B, S)
        x = self.embed(tokens)
        rope = None
        if cfg.positions == "learned":
            x = x + self.positions(positions)
        else:
            rope = rope_at(cfg, positions)
        graphdef, layers = nnx.split(self.blocks)
        k, v = list(cache["k"]), list(cache["v"])
        for i in range(cfg.n_layers):  # each layer's cache its own array, written in place and read where it lies
            block = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], layers))  # noqa: B023
            x, (k[i], v[i]) = block.extend(x, rope, start, (k[i], v[i]), prefill)
        x = self.norm_f(x)
        if last is not None:  # the prefill needs only each row's last prompt position
            x = jnp.take_along_axis(x, (last - start)[:, None, None], axis=1)
        return self.project(x), {"k": k, "v": v}


# Tensor parallelism (Megatron's): the projections into heads and hidden units split by columns, the
# projections out of them by rows, the output head by vocabulary; everything else replicated.
COLUMN_PARALLEL, ROW_PARALLEL = ("q", "kv", "up", "head"), ("out", "down")


def tensor_parallel_spec(path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                         axis: str) -> jax.sharding.PartitionSpec:
    """The PartitionSpec of the parameter at `path` (names, e.g. ("blocks", "attn", "kv", "kernel"))
    of `shape` over `shards` GPUs on mesh axis `axis`; a dimension that does not divide (a GPT-2
    vocabulary of 50,257) stays whole on every GPU."""
    P = jax.sharding.PartitionSpec
    owner, leaf = (path[-2], path[-1]) if len(path) > 1 else ("", path[-1])
    if owner in COLUMN_PARALLEL:  # kernels (..., in, out), biases and scales (..., out): split out
        split = len(shape) - 1
    elif owner in ROW_PARALLEL and leaf == "kernel":  # (..., in, out): split in; biases and scales whole
        split = len(shape) - 2
    else:
        return P()
    if shape[split] % shards:
        return P()
    return P(*[axis if i == split else None for i in range(len(shape))])


def tensor_parallel_shardings(state: Any, mesh: jax.sharding.Mesh, axis: str = "model", spec: Any = None) -> Any:
    """NamedShardings for a model's state (nnx.split's) over `mesh`'s `axis` (`spec`, by default
    tensor_parallel_spec)."""
    shards = mesh.shape[axis]
    spec = spec or tensor_parallel_spec

    def sharding(path, x):
        names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        return jax.sharding.NamedSharding(mesh, spec(names, tuple(x.shape), shards, axis))

    return jax.tree_util.tree_map_with_path(sharding, state)
