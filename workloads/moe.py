"""The mixture-of-experts decoder: the modern decoder of workloads/transformer.py whose MLP is, in some or all
layers, a set of routed experts (each token to its top-k of them, weighted by the router) beside optional
shared experts every token passes; attention grouped-query (Mixtral, Qwen3, Llama 4) or multi-head latent
(MLA, DeepSeek-V2/V3: keys and values through a low-rank compressed vector, rotary positions on a part of
each head kept apart). Presets with the published dimensions; the workload `moe`.

Routing: the router's logits in float32 from float32 weights, scores by softmax (Mixtral, Qwen3, DeepSeek-V2)
or sigmoid (DeepSeek-V3, Llama 4), the top-k kept, renormalised over the k where the model does, scaled by
DeepSeek-V3's routed scaling factor. The load-balancing loss (Switch Transformer's: experts x the sum over
experts of the share of token slots routed to each and its mean score) is added to the task's loss with its
coefficient.

Two ways to compute the experts, as the model's trainers do:

- "dropless": every token's k slots sorted by expert and computed as grouped matrix products
  (`jax.lax.ragged_dot`, the form of MaxText's `sparse_matmul`; megablox's on TPUs), nothing dropped;
- "capacity": each expert takes at most capacity_factor x tokens x k / experts slots (GShard's dispatch and
  combine as one-hot products), later slots dropped (counted: `dropped_fraction`).

Layers: the first `first_dense` are dense (DeepSeek's first_k_dense_replace), and of the rest every
`moe_period`-th is MoE (Llama 4 Maverick's interleave step 2), the others dense, with their own MLP width
`d_ff`; experts have `expert_d_ff`. Layers run as one `lax.scan` over groups of `moe_period` layers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, final

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from workloads import moe_counts
from workloads.mla import LatentAttention
from workloads.base import ActivationProfile, BlockWrap, ModelConfigError, chunked_cross_entropy
from workloads.decoders import DecoderWorkload
from workloads.expert_parallel import (
    EXPERT_AXIS,
    TENSOR_AXIS,
    exchange_slots,
    expert_split,
    moe_expert_parallel_spec,
)
from workloads.transformer import (
    ACTIVATION,
    Block,
    Attention,
    Mlp,
    fused_halves,
    linear,
    norm_layer,
    residual,
    rope_at,
    rope_tables,
    Decoder,
    TransformerConfig,
    check_config,
    tensor_parallel_spec,
)

DISPATCHES = ("dropless", "capacity")
ROUTER_SCORES = ("softmax", "sigmoid")
MOE_ATTENTIONS = ("gqa", "mla")
# Bounds of the MoE dimensions a user may give (beside the decoder's, transformer.DIM_LIMITS).
MOE_LIMITS: dict[str, tuple[int, int]] = {
    "n_experts": (1, 1024),
    "top_k": (1, 64),
    "expert_d_ff": (1, 262144),
    "n_shared_experts": (0, 64),
    "first_dense": (0, 256),
    "moe_period": (1, 64),
    "q_lora_rank": (0, 65536),
    "kv_lora_rank": (1, 65536),
    "qk_nope_head_dim": (1, 1024),
    "qk_rope_head_dim": (2, 1024),
    "v_head_dim": (1, 1024),
}


@dataclasses.dataclass(frozen=True)
class MoeConfig(TransformerConfig):
    n_experts: int = 8  # routed experts per MoE layer
    top_k: int = 2  # experts each token is routed to
    expert_d_ff: int = 0  # each expert's hidden width (0: d_ff)
    n_shared_experts: int = 0  # experts every token passes, one MLP of n x expert_d_ff (DeepSeek, Llama 4)
    first_dense: int = 0  # leading dense layers (DeepSeek's first_k_dense_replace)
    moe_period: int = 1  # of the layers after those, every moe_period-th is MoE (Llama 4 Maverick: 2)
    dispatch: str = "dropless"  # one of DISPATCHES
    capacity_factor: float = 1.25  # slots per expert over an even share, with dispatch "capacity"
    router_score: str = "softmax"  # one of ROUTER_SCORES
    router_topk_norm: bool = True  # the k weights renormalised to sum to 1
    router_scale: float = 1.0  # DeepSeek-V3's routed_scaling_factor
    aux_loss: float = 0.01  # the load-balancing loss's coefficient (0: none)
    attention_type: str = "gqa"  # one of MOE_ATTENTIONS
    q_lora_rank: int = 0  # MLA: the queries' compressed width (0: a direct projection, DeepSeek-V2-Lite)
    kv_lora_rank: int = 512  # MLA: the keys' and values' compressed width
    qk_nope_head_dim: int = 128  # MLA: each head's query/key width without rotary positions
    qk_rope_head_dim: int = 64  # MLA: each head's width with them (the key's part shared by the heads)
    v_head_dim: int = 128  # MLA: each head's value width

    @property
    def expert_width(self) -> int:
        return self.expert_d_ff or self.d_ff

    @property
    def n_moe_layers(self) -> int:
        return (self.n_layers - self.first_dense) // self.moe_period

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    @property
    def attention_width(self) -> int:
        """Width of the attention's output before its projection back to d_model."""
        return self.n_heads * self.v_head_dim if self.attention_type == "mla" else self.q_width


def check_moe_config(cfg: MoeConfig) -> MoeConfig:
    """`cfg` unchanged when its decoder and MoE dimensions are in range and consistent; else
    ModelConfigError naming the field."""
    check_config(cfg)
    for name, (lo, hi) in MOE_LIMITS.items():
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ModelConfigError(name, f"must be an integer from {lo} to {hi}; got {value!r}")
    for name, allowed in (("dispatch", DISPATCHES), ("router_score", ROUTER_SCORES),
                          ("attention_type", MOE_ATTENTIONS)):
        if getattr(cfg, name) not in allowed:
            raise ModelConfigError(name, f"must be one of {', '.join(allowed)}; got {getattr(cfg, name)!r}")
    if cfg.top_k > cfg.n_experts:
        raise ModelConfigError("top_k", f"must be at most n_experts ({cfg.n_experts}); got {cfg.top_k}")
    cf = cfg.capacity_factor
    if isinstance(cf, bool) or not isinstance(cf, (int, float)) or not (0 < cf <= 64) or cf != cf:
        raise ModelConfigError("capacity_factor", f"must be a number above 0 and at most 64 (slots per expert over "
                                                  f"an even share); got {cf!r}")
    for name, lo, hi in (("router_scale", 0.001, 1000), ("aux_loss", 0, 10)):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and lo <= value <= hi):
            raise ModelConfigError(name, f"must be a number from {lo:g} to {hi:g}; got {value!r}")
    if not isinstance(cfg.router_topk_norm, bool):
        raise ModelConfigError("router_topk_norm", f"must be true or false; got {cfg.router_topk_norm!r}")
    if cfg.first_dense >= cfg.n_layers:
        raise ModelConfigError("first_dense", f"must leave at least one MoE layer of the n_layers ({cfg.n_layers}); "
                                              f"got {cfg.first_dense}")
    if (cfg.n_layers - cfg.first_dense) % cfg.moe_period:
        raise ModelConfigError("moe_period", f"must divide the layers after the first dense ones "
                                             f"({cfg.n_layers} - {cfg.first_dense} = {cfg.n_layers - cfg.first_dense}); "
                                             f"got {cfg.moe_period}")
    if cfg.positions != "rope":
        raise ModelConfigError("positions", f"the MoE decoder takes rotary positions (rope); got {cfg.positions!r}")
    if cfg.attention_type == "mla":
        if cfg.qk_rope_head_dim % 2:
            raise ModelConfigError("qk_rope_head_dim", f"must be even (rotary pairs); got {cfg.qk_rope_head_dim}")
        if cfg.attention not in ("xla", "splash"):
            raise ModelConfigError("attention", f"multi-head latent attention runs as XLA's attention, or on a TPU "
                                                f"slice as splash (its values padded to the queries' width); got "
                                                f"{cfg.attention!r}")
    return cfg


class Routing(NamedTuple):
    """What a MoE layer's router did with a batch (float32 scalars): its load-balancing loss, the share of
    token slots dropped past the experts' capacity, the busiest expert's slots over an even share (1:
    perfectly spread; n_experts: every slot to one expert), and under expert parallelism the busiest device's
    (the slots of the experts it holds, over an even share; 1 without an expert axis)."""

    balance: jax.Array
    dropped: jax.Array
    load: jax.Array
    device_load: jax.Array

    @staticmethod
    def none() -> "Routing":
        zero = jnp.zeros((), jnp.float32)
        return Routing(zero, zero, zero, zero)


class _Experts(nnx.Module):
    """The routed experts of one MoE layer and their router. Returns the layer's output and its `Routing`."""

    def __init__(self, cfg: MoeConfig, *, dtype, rngs: nnx.Rngs):
        e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_width
        init = nnx.initializers.normal(stddev=0.02)
        out_init = nnx.initializers.normal(stddev=0.02 / math.sqrt(2 * cfg.n_layers))
        self.router = nnx.Param(init(rngs.params(), (d, e), jnp.float32))
        self.up = nnx.Param(init(rngs.params(), (e, d, (2 if cfg.gated else 1) * f), jnp.float32))
        self.down = nnx.Param(out_init(rngs.params(), (e, f, d), jnp.float32))
        self.cfg, self.dtype = cfg, dtype
        self.scales = nnx.data(None)  # int8 weights' per-column scales (up, down): workloads/decoding.py quantize_int8

    def weights(self) -> tuple[jax.Array, jax.Array]:
        """The up and down projections in the compute dtype (int8 ones scaled back by their columns)."""
        up, down = self.up[...].astype(self.dtype), self.down[...].astype(self.dtype)
        if self.scales is not None:
            up, down = (w * s[...].astype(self.dtype)[..., None, :] for w, s in zip((up, down), self.scales))
        return up, down

    def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each token's k experts (N, k) int32, their weights (N, k) float32, and the load-balancing loss."""
        cfg = self.cfg
        logits = jnp.dot(x.astype(jnp.float32), self.router[...], preferred_element_type=jnp.float32)  # (N, E)
        scores = jax.nn.softmax(logits, axis=-1) if cfg.router_score == "softmax" else jax.nn.sigmoid(logits)
        weights, experts = jax.lax.top_k(scores, cfg.top_k)
        if cfg.router_topk_norm:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        weights = weights * cfg.router_scale
        # Switch's balance loss: E x sum_e (share of slots routed to e) x (mean normalised score of e)
        share = jnp.mean(jax.nn.one_hot(experts, cfg.n_experts, dtype=jnp.float32).sum(axis=1), axis=0) / cfg.top_k
        probs = scores / (jnp.sum(scores, axis=-1, keepdims=True) + 1e-20)
        balance = cfg.n_experts * jnp.sum(share * jnp.mean(probs, axis=0))
        return experts.astype(jnp.int32), weights, balance

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Routing]:  # (B, T, D)
        b, t, d = x.shape
        flat = x.reshape(b * t, d)
        experts, weights, balance = self.route(flat)
        up, down = self.weights()
        if self.cfg.dispatch == "dropless":
            y, dropped = self._dropless(flat, experts, weights, up, down), jnp.zeros((), jnp.float32)
        else:
            y, dropped = self._capacity(flat, experts, weights, up, down, t)
        slots = jnp.bincount(experts.reshape(-1), length=self.cfg.n_experts).astype(jnp.float32)
        mesh = jax.sharding.get_abstract_mesh()
        split = 1 if mesh.empty or EXPERT_AXIS not in mesh.axis_names else mesh.shape[EXPERT_AXIS]
        held = slots.reshape(split, -1).sum(axis=-1)  # each device's experts' slots (consecutive experts)
        load, device_load = (jax.lax.stop_gradient(jnp.max(v) / jnp.mean(v)) for v in (slots, held))
        return checkpoint_name(y.reshape(b, t, d), "mlp_out"), Routing(
            balance, jax.lax.stop_gradient(dropped), load, device_load)

    def serve(self, x: jax.Array, apart: bool = False) -> jax.Array:  # (B, S, D)
        """The layer's output as a server computes it: every slot (dropless, whatever the training's
        dispatch), by grouped products; with `apart`, none (the serving planner prices them apart)."""
        if apart:
            return jnp.zeros_like(x)
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        experts, weights, _ = self.route(flat)
        return self._grouped(flat, experts, weights, *self.weights()).reshape(b, s, d).astype(x.dtype)

    def _hidden(self, h: jax.Array) -> jax.Array:
        act = ACTIVATION[self.cfg.mlp]
        if self.cfg.gated:
            gate, up = fused_halves(h)
            return act(gate) * up
        return act(h)

    def _dropless(self, x: jax.Array, experts: jax.Array, weights: jax.Array, up: jax.Array,
                  down: jax.Array) -> jax.Array:
        """Every slot computed: on each device, its own tokens' N x k slots sorted by expert and two grouped
        products over them. A grouped product is a kernel XLA's partitioner cannot split (on a sharded batch
        it would gather every device's rows and compute them all everywhere), so it runs in shard_map over the
        ambient mesh (set by the step: migration/step/train.py), the rows split over every axis but the
        tensor one. Without an expert axis the experts come gathered by the layout; with one, each device
        holds its share of them and the slots travel to it and back (workloads/expert_parallel.py
        `exchange_slots`). Over a tensor axis each expert stays split by its hidden units (Megatron's split:
        the gate's and the up projection's columns, the down projection's rows; the partial outputs summed
        over the axis)."""
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
        batch = tuple(a for a in axes if a != TENSOR_AXIS)
        if not axes or x.shape[0] % math.prod(mesh.shape[a] for a in batch):
            return self._grouped(x, experts, weights, up, down)
        P = jax.sharding.PartitionSpec  # noqa: N806
        rows, split = P(batch or None), EXPERT_AXIS if EXPERT_AXIS in axes else None
        if TENSOR_AXIS not in axes and split is None:
            return jax.shard_map(self._grouped, mesh=mesh, in_specs=(rows, rows, rows, P(), P()), out_specs=rows,
                                 check_vma=False)(x, experts, weights, up, down)
        tensor = TENSOR_AXIS if TENSOR_AXIS in axes else None
        width = down.shape[-2]
        parts = (up[..., :width], up[..., width:]) if self.cfg.gated and tensor else up  # gate's, up's columns
        products = self._grouped if split is None else self._exchanged

        def local(x, experts, weights, parts, down):
            y = products(x, experts, weights, parts, down)
            return y if tensor is None else jax.lax.psum(y, TENSOR_AXIS)

        by_column = P(split, None, tensor)
        return jax.shard_map(local, mesh=mesh, out_specs=rows, check_vma=False, in_specs=(
            rows, rows, rows, (by_column, by_column) if isinstance(parts, tuple) else by_column,
            P(split, tensor, None)))(x, experts, weights, parts, down)

    def _exchanged(self, x: jax.Array, experts: jax.Array, weights: jax.Array,
                   up: jax.Array | tuple[jax.Array, ...], down: jax.Array) -> jax.Array:
        """Inside shard_map with an expert axis: the rows' slots sorted by expert, sent to the devices that hold
        their experts (`up` and `down` here this device's share), computed there and brought back."""
        return self._sorted(x, experts, weights, lambda rows, sizes: exchange_slots(
            rows, sizes, self.cfg.n_experts, experts.shape[1], lambda got, local: self._products(got, local, up, down)))

    def _grouped(self, x: jax.Array, experts: jax.Array, weights: jax.Array, up: jax.Array | tuple[jax.Array, ...],
                 down: jax.Array) -> jax.Array:
        """The slots of the rows `x` sorted by expert and computed by grouped products (`up` the fused
        projection, or the gate's and the up projection's columns apart)."""
        return self._sorted(x, experts, weights, lambda rows, sizes: self._products(rows, sizes, up, down))

    def _sorted(self, x: jax.Array, experts: jax.Array, weights: jax.Array, compute) -> jax.Array:
        """The rows' N x k slots sorted by expert, `compute(rows, sizes per expert)` of them (N k, D), each
        weighted by its router weight and summed back into its token's row."""
        n, k = experts.shape
        slots = experts.reshape(-1)
        order = jnp.argsort(slots)
        token = order // k
        sizes = jnp.bincount(slots, length=self.cfg.n_experts).astype(jnp.int32)
        rows = jnp.take(x, token, axis=0).astype(self.dtype)  # (N k, D), by expert
        y = compute(rows, sizes)  # (N k, D)
        y = y * weights.reshape(-1)[order][:, None].astype(y.dtype)
        return jnp.zeros_like(x, dtype=y.dtype).at[token].add(y)

    def _products(self, rows: jax.Array, sizes: jax.Array, up: jax.Array | tuple[jax.Array, ...],
                  down: jax.Array) -> jax.Array:
        """Rows sorted by expert, `sizes` of them per expert, through their experts' two grouped products."""
        if isinstance(up, tuple):
            gate, lin = (checkpoint_name(jax.lax.ragged_dot(rows, w, sizes), "mlp_hidden") for w in up)
            hidden = ACTIVATION[self.cfg.mlp](gate) * lin
        else:
            hidden = self._hidden(checkpoint_name(jax.lax.ragged_dot(rows, up, sizes), "mlp_hidden"))
        return jax.lax.ragged_dot(hidden, down, sizes)

    def _capacity(self, x: jax.Array, experts: jax.Array, weights: jax.Array, up: jax.Array,
                  down: jax.Array, rows_per_group: int) -> tuple[jax.Array, jax.Array]:
        """Per sequence (GShard's group), at most C slots an expert (capacity_factor x an even share of the
        sequence's slots), taken in token order; later ones dropped."""
        cfg = self.cfg
        n, k = experts.shape
        g, t = n // rows_per_group, rows_per_group
        e, capacity = cfg.n_experts, max(1, math.ceil(cfg.capacity_factor * t * k / cfg.n_experts))
        onehot = jax.nn.one_hot(experts.reshape(g, t * k), e, dtype=jnp.int32)  # (G, T k, E), slots in token order
        position = jnp.sum((jnp.cumsum(onehot, axis=1) - 1) * onehot, axis=-1).reshape(g, t, k)
        kept = position < capacity
        dispatch = jnp.zeros((g, t, e, capacity), self.dtype)
        combine = jnp.zeros((g, t, e, capacity), self.dtype)
        for j in range(k):  # slot by slot: (G, T, E, C) alive, not k of them
            place = (jax.nn.one_hot(experts.reshape(g, t, k)[..., j], e, dtype=self.dtype)[..., None]
                     * jax.nn.one_hot(jnp.where(kept[..., j], position[..., j], capacity), capacity,
                                      dtype=self.dtype)[:, :, None, :])
            dispatch = dispatch + place
            combine = combine + place * weights.reshape(g, t, k)[..., j, None, None].astype(self.dtype)
        rows = expert_split(jnp.einsum("gtec,gtd->gecd", dispatch, x.reshape(g, t, -1).astype(self.dtype)), 1)
        h = checkpoint_name(jnp.einsum("gecd,edf->gecf", rows, up), "mlp_hidden")
        y = expert_split(jnp.einsum("gecf,efd->gecd", self._hidden(h), down), 1, to_experts=False)
        dropped = 1.0 - jnp.mean(kept.astype(jnp.float32))
        return jnp.einsum("gtec,gecd->gtd", combine, y).reshape(n, -1), dropped


class _MoeBlock(nnx.Module):
    def __init__(self, cfg: MoeConfig, *, dtype, rngs: nnx.Rngs):
        self.norm1 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.attn = (LatentAttention(cfg, dtype=dtype, rngs=rngs) if cfg.attention_type == "mla"
                     else Attention(cfg, dtype=dtype, rngs=rngs))
        self.norm2 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.experts = _Experts(cfg, dtype=dtype, rngs=rngs)
        if cfg.n_shared_experts:
            shared = dataclasses.replace(cfg, d_ff=cfg.n_shared_experts * cfg.expert_width, bias=False)
            self.shared = Mlp(shared, dtype=dtype, rngs=rngs)
        self.has_shared = bool(cfg.n_shared_experts)

    def __call__(self, x: jax.Array, rope) -> tuple[jax.Array, Routing]:  # (B, T, D)
        x = checkpoint_name(x, "decoder_layer_input")
        x = x + self.attn(self.norm1(x), rope)
        h = self.norm2(x)
        y, routing = self.experts(h)
        if self.has_shared:
            y = y + self.shared(h)
        return x + y, routing

    def extend(self, x: jax.Array, rope, start: jax.Array, cache, prefill: bool = False, apart: bool = False):
        """The decode path (Block.extend's), the routed experts as a server computes them (_Experts.serve)."""
        y, cache = self.attn.extend(self.norm1(x), rope, start, cache, prefill)
        x = x + y
        h = self.norm2(x)
        y = self.experts.serve(h, apart)
        return x + (y + self.shared(h) if self.has_shared else y), cache


class _DenseBlock(Block):
    """A dense layer of an MoE model (its attention as the model's): the dense decoder's block, returning
    no balance loss and nothing dropped."""

    def __init__(self, cfg: MoeConfig, *, dtype, rngs: nnx.Rngs):  # noqa: super-init-not-called
        self.norm1 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.attn = (LatentAttention(cfg, dtype=dtype, rngs=rngs) if cfg.attention_type == "mla"
                     else Attention(cfg, dtype=dtype, rngs=rngs))
        self.norm2 = norm_layer(cfg, dtype=dtype, rngs=rngs)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, rope) -> tuple[jax.Array, Routing]:
        return super().__call__(x, rope), Routing.none()


def _stack(n: int, make, rngs: nnx.Rngs) -> nnx.Module:
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked(rngs: nnx.Rngs) -> nnx.Module:
        return make(rngs)

    return stacked(rngs)


class MoeDecoder(Decoder):
    """The MoE decoder: embeddings and output as the dense decoder's; the first dense layers as one scan,
    then a scan over groups of moe_period layers (moe_period - 1 dense, then one MoE)."""

    routed_apart = False  # the decode path leaves the routed experts' products out (MoeDecoder.extend)

    def __init__(self, cfg: MoeConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=nnx.initializers.normal(stddev=0.02),
                               dtype=dtype, param_dtype=jnp.float32, rngs=rngs)
        groups = cfg.n_moe_layers
        if cfg.first_dense:
            self.dense = _stack(cfg.first_dense, lambda r: _DenseBlock(cfg, dtype=dtype, rngs=r), rngs)
        if cfg.moe_period > 1:
            self.between = _stack(groups * (cfg.moe_period - 1), lambda r: _DenseBlock(cfg, dtype=dtype, rngs=r),
                                  rngs)
        self.blocks = _stack(groups, lambda r: _MoeBlock(cfg, dtype=dtype, rngs=r), rngs)
        self.norm_f = norm_layer(cfg, dtype=dtype, rngs=rngs)
        if not cfg.tied_embeddings:
            self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                   kernel_init=nnx.initializers.normal(stddev=0.02), dtype=dtype,
                                   param_dtype=jnp.float32, rngs=rngs)
        self.dense_call = block_wrap(_DenseBlock.__call__)
        self.moe_call = block_wrap(_MoeBlock.__call__)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        return self.hidden_and_router(tokens)[0]

    def hidden_and_router(self, tokens: jax.Array) -> tuple[jax.Array, Routing]:
        """(B, T) int32 -> the final hidden states (B, T, D), and the `Routing` of the MoE layers (each figure
        their mean)."""
        cfg = self.cfg
        x = self.embed(tokens)
        # MLA rotates qk_rope_head_dim of each head (DeepSeek's rope tables are that wide)
        rotated = dataclasses.replace(cfg, head_size=cfg.qk_rope_head_dim) if cfg.attention_type == "mla" else cfg
        rope = rope_tables(rotated, tokens.shape[1])

        def run(x, stack, call):
            graphdef, layers = nnx.split(stack)

            def layer(x, params):
                y, routing = call(nnx.merge(graphdef, params), residual(x, cfg), rope)
                return residual(y, cfg), routing

            return jax.lax.scan(layer, x, layers)

        if cfg.first_dense:
            x, _ = run(x, self.dense, self.dense_call)
        moe_graph, moe_layers = nnx.split(self.blocks)
        between = nnx.split(self.between) if cfg.moe_period > 1 else None

        def group(x, params):
            moe_params, dense_params = params
            if between is not None:
                graphdef = between[0]
                for i in range(cfg.moe_period - 1):
                    x, _ = self.dense_call(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], dense_params)),  # noqa: B023
                                           residual(x, cfg), rope)
            y, routing = self.moe_call(nnx.merge(moe_graph, moe_params), residual(x, cfg), rope)
            return residual(y, cfg), routing

        dense_by_group = None
        if between is not None:
            dense_by_group = jax.tree.map(lambda a: a.reshape(cfg.n_moe_layers, cfg.moe_period - 1, *a.shape[1:]),
                                          between[1])
        x, routing = jax.lax.scan(group, x, (moe_layers, dense_by_group))
        return self.norm_f(x), Routing(*(jnp.mean(v) for v in routing))

    def layers(self) -> list[tuple[Any, bool]]:
        """Every layer's module with its parameters, in the model's order, and whether it is MoE."""
        cfg, out = self.cfg, []
        unstack = lambda stack, i: nnx.merge(graphs[id(stack)], jax.tree.map(lambda a: a[i], params[id(stack)]))  # noqa: E731
        stacks = [self.blocks] + ([self.dense] if cfg.first_dense else []) + ([self.between] if cfg.moe_period > 1 else [])
        graphs, params = {}, {}
        for stack in stacks:
            graphs[id(stack)], params[id(stack)] = nnx.split(stack)
        for i in range(cfg.first_dense):
            out.append((unstack(self.dense, i), False))
        for g in range(cfg.n_moe_layers):
            for j in range(cfg.moe_period - 1):
                out.append((unstack(self.between, g * (cfg.moe_period - 1) + j), False))
            out.append((unstack(self.blocks, g), True))
        return out

    def extend(self, tokens: jax.Array, start: jax.Array, cache: dict[str, list[jax.Array]],
               last: jax.Array | None = None, prefill: bool = False) -> tuple[jax.Array, dict[str, list[jax.Array]]]:
        """The decode path (Decoder.extend's contract), one cache entry a layer in the model's order: keys and
        values for grouped-query attention, the compressed latents and rotated key parts for MLA
        (workloads/mla.py). The routed experts compute every slot (dropless, as a server does); with
        `routed_apart` set, none (the serving planner prices them apart: planning/serving.py)."""
        cfg = self.cfg
        positions = start[:, None] + jnp.arange(tokens.shape[1], dtype=start.dtype)[None]  # (B, S)
        rotated = dataclasses.replace(cfg, head_size=cfg.qk_rope_head_dim) if cfg.attention_type == "mla" else cfg
        rope = rope_at(rotated, positions)
        x = self.embed(tokens)
        k, v = list(cache["k"]), list(cache["v"])
        for i, (layer, is_moe) in enumerate(self.layers()):
            more = {"apart": self.routed_apart} if is_moe else {}
            x, (k[i], v[i]) = layer.extend(x, rope, start, (k[i], v[i]), prefill, **more)
        x = self.norm_f(x)
        if last is not None:
            x = jnp.take_along_axis(x, (last - start)[:, None, None], axis=1)
        return self.project(x), {"k": k, "v": v}


def _moe(vocab: int, seq: int, d: int, layers: int, heads: int, kv_heads: int, d_ff: int, experts: int, k: int,
         expert_d_ff: int, *, tied: bool = False, theta: float = 1e6, context: int = 0, **more: Any) -> MoeConfig:
    return MoeConfig(vocab_size=vocab, seq_len=seq, d_model=d, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads,
                     d_ff=d_ff, tied_embeddings=tied, norm="rmsnorm", mlp="swiglu", positions="rope", bias=False,
                     rope_theta=theta, context=context, n_experts=experts, top_k=k, expert_d_ff=expert_d_ff, **more)


# Published dimensions (the models' config.json on Hugging Face), trained here at 4,096 tokens a sequence.
PRESETS: dict[str, MoeConfig] = {
    "tiny": _moe(256, 64, 64, 3, 4, 2, 128, 4, 2, 64, tied=True, theta=10000.0, first_dense=1, n_shared_experts=1),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts, top 2, SwiGLU 14,336 wide
    "mixtral-8x7b": _moe(32000, 4096, 4096, 32, 32, 8, 14336, 8, 2, 14336, context=32768),
    # mistralai/Mixtral-8x22B-v0.1
    "mixtral-8x22b": _moe(32768, 4096, 6144, 56, 48, 8, 16384, 8, 2, 16384, context=65536),
    # deepseek-ai/DeepSeek-V3: MLA, 256 routed experts (top 8, sigmoid scores, scaled 2.5) and one shared,
    # the first 3 of 61 layers dense (18,432 wide); the multi-token-prediction module is not counted
    "deepseek-v3": _moe(129280, 4096, 7168, 61, 128, 128, 18432, 256, 8, 2048, theta=10000.0, context=163840,
                        first_dense=3, n_shared_experts=1, router_score="sigmoid", router_scale=2.5,
                        aux_loss=0.0001, attention_type="mla", q_lora_rank=1536, kv_lora_rank=512,
                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    # deepseek-ai/DeepSeek-V2-Lite: MLA without compressed queries, 64 routed experts (top 6) and 2 shared
    "deepseek-v2-lite": _moe(102400, 4096, 2048, 27, 16, 16, 10944, 64, 6, 1408, theta=10000.0, context=163840,
                             first_dense=1, n_shared_experts=2, router_topk_norm=False, aux_loss=0.001,
                             attention_type="mla", q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128,
                             qk_rope_head_dim=64, v_head_dim=128),
    # Qwen/Qwen3-30B-A3B: 128 experts, top 8, 128-wide heads
    "qwen3-30b-a3b": _moe(151936, 4096, 2048, 48, 32, 4, 6144, 128, 8, 768, head_size=128, context=40960,
                          aux_loss=0.001),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": _moe(151936, 4096, 4096, 94, 64, 4, 12288, 128, 8, 1536, head_size=128, context=40960,
                            aux_loss=0.001),
    # meta-llama/Llama-4-Scout-17B-16E (text model): 16 experts, top 1 (sigmoid), one shared, every layer MoE;
    # it serves 10,485,760 positions, the context here is capped at the product's limit
    "llama4-scout": _moe(202048, 4096, 5120, 48, 40, 8, 16384, 16, 1, 8192, head_size=128, theta=500000.0,
                         context=1048576, n_shared_experts=1, router_score="sigmoid", router_topk_norm=False),
    # meta-llama/Llama-4-Maverick-17B-128E (text model): 128 experts, top 1, one shared, MoE every 2nd layer
    "llama4-maverick": _moe(202048, 4096, 5120, 48, 40, 8, 16384, 128, 1, 8192, head_size=128, theta=500000.0,
                            context=1048576, n_shared_experts=1, moe_period=2, router_score="sigmoid",
                            router_topk_norm=False),
}


def moe_tensor_parallel_spec(path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
    """Tensor parallelism of an MoE model: each expert's hidden units split (its up projection by columns,
    its down by rows), the router whole, everything else as the dense decoder's."""
    if len(path) > 1 and path[-2] == "experts" and path[-1] in ("up", "down"):
        split = len(shape) - (1 if path[-1] == "up" else 2)
        if shape[split] % shards == 0:
            return jax.sharding.PartitionSpec(*[axis if i == split else None for i in range(len(shape))])
        return jax.sharding.PartitionSpec()
    return tensor_parallel_spec(path, shape, shards, axis)


@final
class MoeWorkload(DecoderWorkload):
    name = "moe"
    description = ("mixture-of-experts decoder (routed and shared experts, top-k, dropless or capacity dispatch; "
                   "grouped-query or multi-head latent attention); presets with the published dimensions of "
                   "Mixtral, DeepSeek-V2-Lite and V3, Qwen3-MoE and Llama 4")
    presets = PRESETS
    default_preset = "tiny"
    custom_base = "mixtral-8x7b"
    free_dimensions = tuple(f.name for f in dataclasses.fields(MoeConfig))

    def tensor_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        return moe_tensor_parallel_spec(path, shape, shards, axis)

    def routed_experts(self, cfg: MoeConfig) -> int:
        return cfg.n_experts

    def expert_parallel_spec(self, path: tuple[str, ...], shape: tuple[int, ...], shards: int,
                             axis: str) -> jax.sharding.PartitionSpec:
        return moe_expert_parallel_spec(path, shape, shards, axis)

    def build(self, cfg: MoeConfig, *, dtype, block_wrap: BlockWrap, rngs: nnx.Rngs) -> MoeDecoder:
        return MoeDecoder(cfg, dtype=dtype, block_wrap=block_wrap, rngs=rngs)

    def check(self, cfg: MoeConfig) -> MoeConfig:
        return check_moe_config(cfg)

    def follow(self, preset: MoeConfig, overrides: dict[str, Any]) -> dict[str, Any]:
        return {}

    def loss(self, model: MoeDecoder, batch) -> jax.Array:
        return self.loss_and_metrics(model, batch)[0]

    def loss_and_metrics(self, model: MoeDecoder, batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The task's loss plus the load-balancing loss, and what the router did: the share of slots dropped
        and the busiest expert's and device's load over an even share (each the mean over the MoE layers)."""
        tokens = batch["tokens"]
        hidden, routing = model.hidden_and_router(tokens[:, :-1])
        loss = chunked_cross_entropy(hidden, model.project, tokens[:, 1:]) + model.cfg.aux_loss * routing.balance
        return loss, {"router_dropped": routing.dropped, "router_load": routing.load,
                      "router_device_load": routing.device_load}

    # -- analytic counts (workloads/moe_counts.py) ---------------------------------------------------
    def param_count(self, cfg: MoeConfig) -> int:
        return moe_counts.parameter_counts(cfg)[0]

    def routed_expert_params(self, cfg: MoeConfig) -> int:
        return cfg.n_moe_layers * cfg.n_experts * moe_counts.mlp_params(cfg, cfg.expert_width)

    def dispatch_bytes_per_example(self, cfg: MoeConfig, elem: int) -> float:
        """The dispatch and the combine of every MoE layer: the sequence's token slots (k each, capacity_factor
        x that under capacity dispatch) of d_model values, sent to their experts and back."""
        slots = cfg.seq_len * cfg.top_k * (cfg.capacity_factor if cfg.dispatch == "capacity" else 1.0)
        return 2.0 * cfg.n_moe_layers * slots * cfg.d_model * elem

    def active_param_count(self, cfg: MoeConfig) -> int:
        """Parameters a token passes through: every dense weight, the shared experts and k routed ones."""
        return moe_counts.parameter_counts(cfg)[1]

    def forward_flops_by_part(self, cfg: MoeConfig) -> dict[str, float]:
        return moe_counts.forward_flops_by_part(cfg)

    def flops_per_example(self, cfg: MoeConfig) -> float:
        """6 x the matmul parameters a token passes (active), the output projection, and the attention
        scores and values over the full T x T (as the dense decoders count them)."""
        parts = self.forward_flops_by_part(cfg)
        head = 2 * cfg.seq_len * cfg.vocab_size * cfg.d_model
        return 3.0 * (sum(parts.values()) + head)

    def activation_profile(self, cfg: MoeConfig) -> ActivationProfile:
        base = super().activation_profile(dataclasses.replace(cfg, d_ff=cfg.expert_width))
        t, k = cfg.seq_len, cfg.top_k
        up = (2 if cfg.gated else 1) * cfg.expert_width
        # per MoE layer: k slots of the expert's hidden activations, the sorted rows and their outputs
        per_block = base.per_block + t * ((k - 1) * (3 if cfg.gated else 2) * cfg.expert_width + 2 * k * cfg.d_model)
        named = {**base.named, "mlp_hidden": t * k * up, "mlp_out": t * cfg.d_model}
        return dataclasses.replace(base, per_block=per_block, named=named)


WORKLOAD = MoeWorkload()
