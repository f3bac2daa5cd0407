"""The fp8 recipe against values worked out by hand (each docstring shows the arithmetic): the per-tensor scale
(largest magnitude over the format's largest value: 448 for e4m3, 57,344 for e5m2), what e4m3's three mantissa
bits keep of a value, the product multiplied back by both scales, the gradients in e5m2 against the e4m3
operands kept from the forward pass, the MXFP8 recipe's fallback where the contraction is not whole blocks of
32, and which layers the recipe reaches."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from migration.config.requests import RunConfig
from migration.step.fp8 import (E4M3, E5M2, MX_BLOCK, _cast, _hashable, apply_fp8, block_scaled_dot_general,
                                tensor_scaled_dot_general)
from migration.step.train import TrainProgram

DN = (((1,), (0,)), ((), ()))


def test_a_tensor_is_scaled_so_its_largest_magnitude_is_the_formats_largest():
    """[1, -2, 4]: amax 4, scale 4 / 448 = 1/112; in e4m3 [112, -224, 448] (1.75 x 2^6, 1.75 x 2^7, 1.75 x 2^8:
    all exact); times the scale, the values come back."""
    q, scale = _cast(jnp.array([1.0, -2.0, 4.0], jnp.bfloat16), E4M3)
    assert q.dtype == E4M3 and q.astype(jnp.float32).tolist() == [112.0, -224.0, 448.0]
    assert float(scale) == pytest.approx(4 / 448)
    assert (q.astype(jnp.float32) * scale).tolist() == pytest.approx([1.0, -2.0, 4.0])


def test_e4m3_keeps_three_mantissa_bits():
    """[1, 1.0625]: scale 1.0625 / 448; 1 becomes 448 / 1.0625 = 421.65, between 416 (1.625 x 2^8) and 448
    (steps of 32 there): 416, which scales back to 416 x 1.0625 / 448 = 0.98661."""
    q, scale = _cast(jnp.array([1.0, 1.0625]), E4M3)
    assert q.astype(jnp.float32).tolist() == [416.0, 448.0]
    assert (q.astype(jnp.float32) * scale).tolist() == pytest.approx([0.98661, 1.0625], abs=1e-5)


def test_gradients_are_scaled_into_e5m2_and_an_all_zero_tensor_by_one():
    q, scale = _cast(jnp.array([0.5, -1.0]), E5M2)
    assert q.dtype == E5M2 and q.astype(jnp.float32).tolist() == [28672.0, -57344.0]
    assert float(scale) == pytest.approx(1 / 57344)
    q, scale = _cast(jnp.zeros((3,)), E4M3)
    assert float(scale) == 1.0 and q.astype(jnp.float32).tolist() == [0.0, 0.0, 0.0]


def test_the_product_and_its_gradients_by_hand():
    """x = [1, 1.0625], w = [1, 0]^T: forward x_q . w_q x scales = 0.98661 (x's 1 rounded as above). The
    loss's gradient 1 is exact in e5m2: dL/dx = g w^T = [1, 0]; dL/dw = x_q^T g: the e4m3 x kept from the
    forward pass, [0.98661, 1.0625], not the exact [1, 1.0625]."""
    x, w = jnp.array([[1.0, 1.0625]]), jnp.array([[1.0], [0.0]])
    y = tensor_scaled_dot_general(x, w, DN)
    assert y.dtype == jnp.float32 and float(y[0, 0]) == pytest.approx(0.98661, abs=1e-5)
    dx, dw = jax.grad(lambda a, b: tensor_scaled_dot_general(a, b, DN).sum(), argnums=(0, 1))(x, w)
    assert dx[0].tolist() == pytest.approx([1.0, 0.0], abs=1e-6)
    assert dw[:, 0].tolist() == pytest.approx([0.98661, 1.0625], abs=1e-5)
    assert tensor_scaled_dot_general(x.astype(jnp.bfloat16), w, DN).dtype == jnp.bfloat16  # the lhs's dtype
    assert tensor_scaled_dot_general(x, w, DN, preferred_element_type=jnp.bfloat16).dtype == jnp.bfloat16


def test_mxfp8_falls_back_to_the_per_tensor_recipe_below_a_block_of_32():
    assert MX_BLOCK == 32
    x = jax.random.normal(jax.random.key(0), (4, 16))
    w = jax.random.normal(jax.random.key(1), (16, 8))
    assert jnp.array_equal(block_scaled_dot_general(x, w, DN), tensor_scaled_dot_general(x, w, DN))


def test_dimension_numbers_become_hashable_ints():
    assert _hashable(([[1], [0]], [[], []])) == (((1,), (0,)), ((), ()))
    assert _hashable((((jnp.int32(2),), (0,)), ((0,), (1,)))) == (((2,), (0,)), ((0,), (1,)))


def test_the_recipe_reaches_each_linear_of_the_tiny_llama():
    """The tiny Llama's layers are scanned (one set of stacked weights): attention's q, kv and out, the MLP's
    up (gate and up fused) and down: 5 Linears. Embedding and tied head stay bf16."""
    program = TrainProgram.from_config(RunConfig(workload="llama", preset="tiny", precision="fp8"))
    model = program.workload.build(program.model_cfg, dtype=jnp.bfloat16, block_wrap=lambda f: f, rngs=nnx.Rngs(0))
    assert apply_fp8(model, "fp8") == 5
    linears = [m for _, m in nnx.iter_modules(model) if isinstance(m, nnx.Linear)]
    assert all(m.dot_general is tensor_scaled_dot_general for m in linears)
    assert apply_fp8(model, "mxfp8") == 5 and all(m.dot_general is block_scaled_dot_general for m in linears)


def test_mxfp8_on_whole_blocks_is_jaxs_block_scaled_product():
    """A contraction of 64 is two blocks of 32: JAX's MXFP8 product (cuDNN's block-scaled matmul; traced
    here, it has no CPU kernel), both operands in e4m3 with one e8m0 scale per 32 values, [4, 64] -> two
    scales a row; the result in the lhs's dtype unless one is asked for."""
    x, w = jnp.ones((4, 64), jnp.bfloat16), jnp.ones((64, 8), jnp.bfloat16)
    text = str(jax.make_jaxpr(lambda a, b: block_scaled_dot_general(a, b, DN))(x, w))
    assert "scaled_matmul_wrapper[\n            preferred_element_type=bfloat16" in text
    assert "f8_e4m3fn[1,4,64]" in text and "f8_e4m3fn[1,8,64]" in text
    assert "f8_e8m0fnu[1,4,2]" in text and "f8_e8m0fnu[1,8,2]" in text
    out = jax.eval_shape(lambda a, b: block_scaled_dot_general(a, b, DN), x, w)
    assert (out.shape, out.dtype) == ((4, 8), jnp.bfloat16)
    out = jax.eval_shape(lambda a, b: block_scaled_dot_general(a, b, DN, preferred_element_type=jnp.float32), x, w)
    assert out.dtype == jnp.float32
    short = jax.make_jaxpr(lambda a, b: block_scaled_dot_general(a, b, DN, preferred_element_type=jnp.bfloat16))(
        jnp.ones((4, 48)), jnp.ones((48, 8)))  # 48 is not whole blocks: the per-tensor recipe, as asked in bf16
    assert "scaled_matmul" not in str(short) and short.out_avals[0].dtype == jnp.bfloat16


def test_gradients_come_back_in_each_operands_dtype_along_its_contraction():
    """x^T w over the first dimension (x, w of [2, 1]): 1 x 1 + 1.0625 x 0 = 1 (x's 1.0625 exact as the
    largest); the gradients, bf16 for x and fp16 for w, as the operands were."""
    dn = (((0,), (0,)), ((), ()))
    x, w = jnp.array([[1.0], [1.0625]], jnp.bfloat16), jnp.array([[1.0], [0.0]], jnp.float16)
    y, (dx, dw) = jax.value_and_grad(lambda a, b: tensor_scaled_dot_general(a, b, dn).astype(jnp.float32).sum(),
                                     argnums=(0, 1))(x, w)
    assert float(y) == pytest.approx(0.98661, abs=1e-2)  # x's 1 rounds to 416 / 448 x 1.0625 in e4m3
    assert (dx.dtype, dw.dtype, dx.shape, dw.shape) == (jnp.bfloat16, jnp.float16, (2, 1), (2, 1))
    assert dx[:, 0].astype(jnp.float32).tolist() == [1.0, 0.0]
