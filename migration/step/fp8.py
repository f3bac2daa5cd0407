"""fp8 matrix products for training, as a `dot_general` for every `nnx.Linear` of a model.

Two recipes, one per precision name:

- ``fp8`` (Ada, Hopper; emulated on the CPU backend): per-tensor *current* scaling. Each product's two
  operands are divided by their own largest magnitude over e4m3's largest value (448) and cast to e4m3;
  the product runs on the fp8 operands with fp32 accumulation and is multiplied back by the two scales.
  In the backward pass the incoming gradient is scaled the same way into e5m2 (largest value 57,344:
  gradients need range more than precision), and both gradient products run on fp8 operands (e5m2 x
  e4m3). Current rather than delayed scaling: the scale comes from the tensor being cast, so a spike in
  activations or gradients cannot overflow a scale remembered from earlier steps, and no amax history
  joins the train state (checkpoints, the optimizer and the step's signature are those of bf16). Its
  price is one max-reduction over each operand per product, which XLA fuses into the cast.
- ``mxfp8`` (Blackwell): JAX's own block-scaled product, `jax.nn.scaled_dot_general` with its
  ``mxfp8`` configuration: every 32 consecutive values along the contraction share a power-of-two
  (e8m0) scale, values in e4m3, cuDNN's block-scaled GEMM. The fine-grained scales make e4m3 enough for
  the gradients too (the MXFP8 recipe of Blackwell's fifth-generation tensor cores). A product whose
  contraction is not a multiple of 32 falls back to the per-tensor recipe.

Everything else computes as the bf16 policy does (norms, softmax, attention's own products, the loss),
and the parameters and AdamW state stay float32. The quantize and transpose helpers are Flax's
(`flax.linen.fp8_ops`); only the choice of scale is written here.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import fp8_ops

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
MX_BLOCK = 32  # values per shared scale in MXFP8 (the OCP microscaling format)
RECIPES = ("fp8", "mxfp8")


def _cast(x: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """`x` in the fp8 `dtype`, scaled so that its largest magnitude is the format's largest value, and the
    scale that multiplies it back (1 for an all-zero tensor)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = jax.lax.stop_gradient(jnp.where(amax > 0, amax / jnp.finfo(dtype).max.astype(jnp.float32), 1.0))
    return fp8_ops.quantize(x, dtype, scale, jnp.float32), scale


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _tensor_scaled(lhs: jax.Array, rhs: jax.Array, dimension_numbers: Any, out_dtype: Any) -> jax.Array:
    return _forward(lhs, rhs, dimension_numbers, out_dtype)[0]


def _forward(lhs, rhs, dimension_numbers, out_dtype):
    lq, ls = _cast(lhs, E4M3)
    rq, rs = _cast(rhs, E4M3)
    y = jax.lax.dot_general(lq, rq, dimension_numbers, preferred_element_type=jnp.float32) * (ls * rs)
    # residuals: the fp8 operands (half the bytes of bf16 ones) and zero-size arrays carrying the dtypes
    return y.astype(out_dtype), (lq, rq, ls, rs, jnp.zeros((0,), lhs.dtype), jnp.zeros((0,), rhs.dtype))


def _backward(dimension_numbers, out_dtype, residuals, g):
    lq, rq, ls, rs, l_kind, r_kind = residuals
    gq, gs = _cast(g, E5M2)
    dl = fp8_ops.dot_general_transpose_lhs(gq, lq, rq, dimension_numbers=dimension_numbers, precision=None,
                                           preferred_element_type=jnp.float32) * (gs * rs)
    dr = fp8_ops.dot_general_transpose_rhs(gq, lq, rq, dimension_numbers=dimension_numbers, precision=None,
                                           preferred_element_type=jnp.float32) * (gs * ls)
    return dl.astype(l_kind.dtype), dr.astype(r_kind.dtype)


_tensor_scaled.defvjp(_forward, _backward)


def tensor_scaled_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
    """`lax.dot_general` on per-tensor scaled fp8 operands (the ``fp8`` recipe); the result in
    `preferred_element_type`, else the left operand's dtype."""
    return _tensor_scaled(lhs, rhs, _hashable(dimension_numbers), jnp.dtype(preferred_element_type or lhs.dtype))


def block_scaled_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
    """JAX's MXFP8 product (the ``mxfp8`` recipe), or the per-tensor one where the contraction is not whole
    blocks of 32."""
    (contract, _), _ = dimension_numbers
    if any(lhs.shape[d] % MX_BLOCK for d in contract):
        return tensor_scaled_dot_general(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
    configs = [jax.nn.get_scaled_dot_general_config("mxfp8")] * 3
    return jax.nn.scaled_dot_general(lhs, rhs, dimension_numbers, configs=configs,
                                     preferred_element_type=jnp.dtype(preferred_element_type or lhs.dtype))


def _hashable(dimension_numbers: Any) -> Any:
    return tuple(tuple(tuple(int(d) for d in dims) for dims in pair) for pair in dimension_numbers)


DOT_GENERALS = {"fp8": tensor_scaled_dot_general, "mxfp8": block_scaled_dot_general}


def apply_fp8(model: nnx.Module, recipe: str) -> int:
    """Route every `nnx.Linear` of `model` through the recipe's fp8 product, in place; returns how many.
    Convolutions, embeddings and attention's own products are left in the compute dtype."""
    dot_general = DOT_GENERALS[recipe]
    count = 0
    for _, module in nnx.iter_modules(model):
        if isinstance(module, nnx.Linear):
            module.dot_general = dot_general
            count += 1
    return count
