"""Precision and rematerialisation policies, each resolved once from its name by one table.

Precision: parameters and optimizer state are always float32 ("master weights"); the policy sets
the dtype the model computes in, and whether the loss is scaled. fp16 has five exponent bits, so
small gradients underflow unless the loss is multiplied by a large factor before the backward
pass; the dynamic scaler below lowers that factor and skips the update when a gradient overflows,
and raises it again after a run of good steps. bf16 has fp32's exponent range and needs no scaling.

Remat: one table from names to `jax.checkpoint_policies`; the policy is applied to each block's
call through `nnx.remat`, which keeps NNX state updates (e.g. BatchNorm statistics) working.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from migration.config.limits import CUSTOM_REMAT, REMAT_NAMED, parse_custom_remat
from workloads.base import BlockWrap, Remat, no_wrap


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    compute_dtype: Any
    loss_scaling: bool
    description: str
    fp8: str | None = None  # the fp8 recipe of the model's Linear products (migration/step/fp8.py), if any


PRECISION_POLICIES: dict[str, PrecisionPolicy] = {
    "fp32": PrecisionPolicy("fp32", jnp.float32, False, "float32 compute and parameters"),
    "bf16": PrecisionPolicy("bf16", jnp.bfloat16, False, "bfloat16 compute; float32 parameters and optimizer state"),
    "fp16": PrecisionPolicy(
        "fp16", jnp.float16, True,
        "float16 compute; float32 master weights; dynamic loss scaling (skip update on overflow)",
    ),
    "fp8": PrecisionPolicy(
        "fp8", jnp.bfloat16, False,
        "Linear products in fp8 with per-tensor current scaling (e4m3 forward, e5m2 gradients), bf16 elsewhere; "
        "float32 parameters and optimizer state", fp8="fp8",
    ),
    "mxfp8": PrecisionPolicy(
        "mxfp8", jnp.bfloat16, False,
        "Linear products in MXFP8 (e4m3, one power-of-two scale per 32 values; Blackwell), bf16 elsewhere; "
        "float32 parameters and optimizer state", fp8="mxfp8",
    ),
}


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    name: str
    checkpoint_policy: Callable[..., bool] | None  # None with enabled=True: save nothing
    enabled: bool
    description: str

    def block_wrap(self) -> BlockWrap:
        if not self.enabled:
            return no_wrap
        return Remat(self.checkpoint_policy)


_cp = jax.checkpoint_policies
_saved = REMAT_NAMED["save_dot_except_mlp"]
REMAT_POLICIES: dict[str, RematPolicy] = {
    "none": RematPolicy("none", None, False, "keep every activation for the backward pass"),
    "dots": RematPolicy("dots", _cp.dots_saveable, True, "per block: keep matmul outputs, recompute the rest"),
    "dots_no_batch": RematPolicy(
        "dots_no_batch", _cp.dots_with_no_batch_dims_saveable, True,
        "per block: keep matmul outputs without batch dimensions (not attention scores), recompute the rest",
    ),
    "save_dot_except_mlp": RematPolicy(
        "save_dot_except_mlp", _cp.save_only_these_names(*_saved), True,
        "per block: keep the attention side's matmul outputs (q, k, v, attention output and its projection), "
        "recompute the MLP and the elementwise work",
    ),
    "save_qkv": RematPolicy(
        "save_qkv", _cp.save_only_these_names(*REMAT_NAMED["save_qkv"]), True,
        "per block: keep the q, k, v projections, recompute attention, its projection and the MLP",
    ),
    "offload_dot_except_mlp": RematPolicy(
        "offload_dot_except_mlp",
        _cp.save_and_offload_only_these_names(names_which_can_be_saved=[],
                                              names_which_can_be_offloaded=list(REMAT_NAMED["offload_dot_except_mlp"]),
                                              offload_src="device", offload_dst="pinned_host"),
        True,
        "per block: as save_dot_except_mlp, but the kept activations wait in pinned host memory "
        "(copied out in the forward pass, back in the backward pass)",
    ),
    "full": RematPolicy("full", _cp.nothing_saveable, True, "per block: keep only block inputs, recompute everything"),
}


def remat_policy(name: str) -> RematPolicy:
    """The policy of a name: one of REMAT_POLICIES, or a custom one ("custom:NAME=device|offload,...",
    migration/config/limits.py) keeping each listed activation on the device or in pinned host memory and
    recomputing the rest (MaxText's `remat_policy: custom`)."""
    if not name.startswith(CUSTOM_REMAT):
        return REMAT_POLICIES[name]
    where = parse_custom_remat(name)
    policy = _cp.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n, w in where.items() if w == "device"],
        names_which_can_be_offloaded=[n for n, w in where.items() if w == "offload"],
        offload_src="device", offload_dst="pinned_host")
    kept = ", ".join(f"{n} ({'on the device' if w == 'device' else 'in host memory'})" for n, w in where.items())
    return RematPolicy(name, policy, True, f"per block: keep {kept or 'nothing'}, recompute the rest")


class LossScaleState(NamedTuple):
    scale: jax.Array  # float32 scalar
    good_steps: jax.Array  # int32 scalar: consecutive finite steps since the last change


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
    """Dynamic loss scaling for fp16 (the usual scheme: halve on overflow, double after a run)."""

    initial_scale: float = 2.0**15
    growth_interval: int = 200
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0
    max_scale: float = 2.0**24

    def init(self) -> LossScaleState:
        return LossScaleState(jnp.asarray(self.initial_scale, jnp.float32), jnp.asarray(0, jnp.int32))

    def update(self, state: LossScaleState, grads_finite: jax.Array) -> LossScaleState:
        grow = state.good_steps + 1 >= self.growth_interval
        scale = jnp.where(
            grads_finite,
            jnp.where(grow, jnp.minimum(state.scale * self.growth_factor, self.max_scale), state.scale),
            jnp.maximum(state.scale * self.backoff_factor, self.min_scale),
        )
        good = jnp.where(grads_finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
        return LossScaleState(scale.astype(jnp.float32), good)


def all_finite(tree: Any) -> jax.Array:
    leaves = jax.tree.leaves(tree)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()
