"""fp16's dynamic loss scale, step by step against a sequence worked out by hand, and the other small
pieces of the precision and remat policies: the finite check over a whole gradient tree, the remat wrap
only where a policy is enabled, and which compute dtype and fp8 recipe each precision names."""

import jax
import jax.numpy as jnp
import pytest

from migration.step.policies import (PRECISION_POLICIES, REMAT_POLICIES, DynamicLossScale, LossScaleState,
                                     all_finite)
from workloads.base import no_wrap


def run(scaler: DynamicLossScale, finite: list[bool]) -> list[tuple[float, int]]:
    state, out = scaler.init(), []
    for ok in finite:
        state = scaler.update(state, jnp.asarray(ok))
        out.append((float(state.scale), int(state.good_steps)))
    return out


def test_the_scale_doubles_after_a_run_of_good_steps_and_halves_on_an_overflow():
    """Start 2^15, grow every 3 good steps: good, good -> counts 1, 2; the third makes the run: 2^16, count
    0; an overflow halves it (2^15) and restarts the count; three more good steps: 2^16 again."""
    got = run(DynamicLossScale(growth_interval=3), [True, True, True, False, True, True, True])
    assert got == [(2**15, 1), (2**15, 2), (2**16, 0), (2**15, 0), (2**15, 1), (2**15, 2), (2**16, 0)]


def test_the_scale_stays_between_its_bounds():
    """From 4 with a floor of 1: 2, 1, then 1 again (never below the floor). From 2^24 (the ceiling),
    a run of good steps keeps it there."""
    low = DynamicLossScale(initial_scale=4.0, min_scale=1.0)
    assert [s for s, _ in run(low, [False, False, False])] == [2.0, 1.0, 1.0]
    high = DynamicLossScale(initial_scale=2.0**24, growth_interval=1)
    assert [s for s, _ in run(high, [True, True])] == [2.0**24, 2.0**24]


def test_the_factors_are_the_usual_ones():
    s = DynamicLossScale()
    assert (s.initial_scale, s.growth_interval, s.growth_factor, s.backoff_factor, s.min_scale, s.max_scale) == (
        2.0**15, 200, 2.0, 0.5, 1.0, 2.0**24)
    state = s.init()
    assert isinstance(state, LossScaleState) and state.scale.dtype == jnp.float32 and state.good_steps.dtype == jnp.int32
    after = s.update(state, jnp.asarray(True))
    assert after.scale.dtype == jnp.float32 and after.good_steps.dtype == jnp.int32


@pytest.mark.parametrize("bad", [jnp.inf, -jnp.inf, jnp.nan])
def test_one_non_finite_value_anywhere_in_the_tree_fails_the_check(bad):
    tree = {"a": jnp.ones((3,)), "b": [jnp.zeros((2, 2)), jnp.ones((1,), jnp.float16)]}
    assert bool(all_finite(tree))
    tree["b"][0] = tree["b"][0].at[1, 1].set(bad)
    assert not bool(all_finite(tree))


def test_only_enabled_remat_policies_wrap_a_block():
    assert REMAT_POLICIES["none"].block_wrap() is no_wrap
    for name, policy in REMAT_POLICIES.items():
        if name != "none":
            assert policy.enabled and policy.block_wrap() is not no_wrap, name


def test_an_enabled_policy_wraps_a_block_in_one_checkpoint_with_its_own_policy_and_the_same_values():
    def block(x):
        return jnp.sin(x) * 2.0

    x = jnp.arange(3.0)
    for name, policy in REMAT_POLICIES.items():
        if not policy.enabled:
            continue
        wrapped = policy.block_wrap()(block)
        assert jnp.allclose(wrapped(x), jnp.array([0.0, 2 * 0.8414709848, 2 * 0.9092974268])), name
        (eqn,) = jax.make_jaxpr(wrapped)(x).jaxpr.eqns
        assert eqn.primitive.name == "remat2", name
        assert eqn.params["policy"] is policy.checkpoint_policy, name
        assert [e.primitive.name for e in eqn.params["jaxpr"].eqns] == ["sin", "mul"], name


@pytest.mark.parametrize("name, dtype, scaled, fp8", [
    ("fp32", jnp.float32, False, None), ("bf16", jnp.bfloat16, False, None), ("fp16", jnp.float16, True, None),
    ("fp8", jnp.bfloat16, False, "fp8"), ("mxfp8", jnp.bfloat16, False, "mxfp8"),
])
def test_each_precision_names_its_compute_dtype_scaling_and_fp8_recipe(name, dtype, scaled, fp8):
    p = PRECISION_POLICIES[name]
    assert (p.compute_dtype, p.loss_scaling, p.fp8) == (dtype, scaled, fp8)
