"""What a model's own program says about it, read without running it.

A team brings the parameters (or a module) and the loss of a batch; everything the planner also needs is
read here from the program JAX traces of that loss, at abstract shapes (no allocation, no compile):

- parameters: the number and bytes of the parameter tree's arrays;
- FLOPs: every matrix product of the forward pass (`dot_general`, convolutions, `ragged_dot`) counted
  from its shapes, 2 x output elements x contracted size (a convolution's taps on padding not counted), a scanned loop as many times as it runs, a
  conditional by its costliest branch; training adds the backward pass (two products per product
  per product), less the gradients nobody needs: an operand that does not depend on the parameters (the
  images of a first layer) gets none, as in the compiled step. Recomputation by a checkpoint is not
  counted (the forward pass is traced once), so MFU stays comparable across remat policies. Elementwise
  work is left out, as hand counts leave it out;
- activations: the residuals the backward pass keeps (what `jax.vjp` holds), per example, as the
  difference between batches of two and of one (the weights it also keeps do not grow with the batch);
- the activations the model tags with `jax.ad_checkpoint.checkpoint_name` (what named remat policies
  save).

The planner then compiles the step for each target and reads its memory and kernels from the compiled
program (`migration/planning`); these figures order its search and cross-check the compile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

# Primitives whose FLOPs are counted (all others are elementwise, data movement or reductions).
MATMULS = ("dot_general", "conv_general_dilated", "ragged_dot", "ragged_dot_general")


@dataclasses.dataclass(frozen=True)
class ProgramFacts:
    """What one trace of the loss says. `flops`: forward FLOPs of the traced batch; `train_flops`: those
    and the backward pass's (the gradient of each operand that depends on the parameters); `widths`: FLOPs by
    the output width (columns) of each product; `names`: checkpoint names the program tags;
    `unknown_loops`: while loops whose trip count the trace does not say (counted once)."""

    flops: float
    train_flops: float
    widths: dict[int, float]
    names: frozenset[str]
    unknown_loops: int = 0

    def typical_width(self) -> int:
        """The output width of the products that do half of the work (FLOP-weighted median)."""
        if not self.widths:
            return 128
        total, seen = sum(self.widths.values()), 0.0
        for width in sorted(self.widths):
            seen += self.widths[width]
            if seen >= total / 2:
                return int(width)
        return int(max(self.widths))


def _jaxprs(value: Any) -> Iterator[Any]:
    """The jaxprs held in one equation parameter (a jaxpr, a closed jaxpr, or a tuple of them)."""
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _jaxprs(item)


def _product_flops(eqn: Any) -> tuple[float, int]:
    """FLOPs of one matrix product and the width of its output."""
    out = eqn.outvars[0].aval
    out_elems = float(math.prod(out.shape))
    width = int(out.shape[-1]) if out.shape else 1
    name = eqn.primitive.name
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval
        return 2.0 * out_elems * math.prod(lhs.shape[d] for d in contract), width
    if name == "conv_general_dilated":
        return _conv_flops(eqn), int(out.shape[eqn.params["dimension_numbers"].out_spec[1]])
    # ragged_dot: (m, k) x (groups, k, n): every row meets one group's (k, n)
    lhs, rhs = eqn.invars[0].aval, eqn.invars[1].aval
    return 2.0 * math.prod(lhs.shape) * rhs.shape[-1], int(rhs.shape[-1])


def _taps(in_size: int, out_size: int, size: int, stride: int, pad_low: int, lhs_dilation: int,
          rhs_dilation: int) -> int:
    """(output position, kernel tap) pairs of one spatial dimension that land on an input value (not on
    padding or between dilated inputs): what a convolution multiplies, counted one by one."""
    last = (in_size - 1) * lhs_dilation
    count = 0
    for o in range(out_size):
        for k in range(size):
            at = o * stride - pad_low + k * rhs_dilation
            count += 0 <= at <= last and at % lhs_dilation == 0
    return count


def _conv_flops(eqn: Any) -> float:
    """2 x batch x output features x input features per group x the valid (position, tap) pairs of each
    spatial dimension: exact under padding, strides and dilations."""
    lhs, rhs, out = eqn.invars[0].aval, eqn.invars[1].aval, eqn.outvars[0].aval
    p, dn = eqn.params, eqn.params["dimension_numbers"]
    pairs = 1
    for i in range(len(dn.out_spec) - 2):
        pairs *= _taps(lhs.shape[dn.lhs_spec[2 + i]], out.shape[dn.out_spec[2 + i]], rhs.shape[dn.rhs_spec[2 + i]],
                       p["window_strides"][i], p["padding"][i][0], p["lhs_dilation"][i], p["rhs_dilation"][i])
    return 2.0 * out.shape[dn.out_spec[0]] * out.shape[dn.out_spec[1]] * rhs.shape[dn.rhs_spec[1]] * pairs


def _inner_deps(eqn: Any, sub: Any, deps: list[bool]) -> list[bool]:
    """Which inputs of the sub-program `sub` of `eqn` depend on the parameters, from `deps` of the
    equation's inputs: one to one where the counts agree (calls, checkpoints, scans), the branch operands
    of a conditional, a while loop's body constants and carry; everything where unsure."""
    n = len(sub.invars)
    name = eqn.primitive.name
    if name == "cond":
        deps = deps[1:]
    elif name == "while":
        cond_n, body_n = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
        deps = deps[cond_n:cond_n + body_n] + deps[cond_n + body_n:]
    if len(deps) == n:
        return list(deps)
    return [any(deps)] * n


def _walk(jaxpr: Any, times: float, acc: dict[str, Any], deps: list[bool]) -> list[bool]:
    """Count the products of `jaxpr` run `times` times; `deps`: which of its inputs depend on the
    parameters. Returns which of its outputs do. A product's backward pass computes the gradient of each
    operand that depends on the parameters (one product each): data-only operands (the images of a first
    layer) cost none, so the count is the one the compiled training step does."""
    dependent = {v for v, d in zip(jaxpr.invars, deps) if d}

    def is_dep(v: Any) -> bool:
        return not isinstance(v, jax.extend.core.Literal) and v in dependent

    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        in_deps = [is_dep(v) for v in eqn.invars]
        out_dep = any(in_deps)
        if name in MATMULS:
            flops, width = _product_flops(eqn)
            acc["flops"] += flops * times
            acc["train"] += flops * times * (1 + sum(in_deps[:2]))
            acc["widths"][width] = acc["widths"].get(width, 0.0) + flops * times
        elif name == "name":  # jax.ad_checkpoint.checkpoint_name
            acc["names"].add(str(eqn.params.get("name")))
        elif name == "cond":
            best = None
            for branch in _jaxprs(eqn.params["branches"]):
                sub = {"flops": 0.0, "train": 0.0, "widths": {}, "names": acc["names"], "unknown": 0}
                _walk(branch, times, sub, _inner_deps(eqn, branch, in_deps))
                if best is None or sub["train"] > best["train"]:
                    best = sub
            if best is not None:
                for key in ("flops", "train", "unknown"):
                    acc[key] += best[key]
                for w, f in best["widths"].items():
                    acc["widths"][w] = acc["widths"].get(w, 0.0) + f
        else:
            repeat = float(eqn.params["length"]) if name == "scan" else 1.0
            if name == "while":
                acc["unknown"] += 1
            for key, value in eqn.params.items():
                if name == "while" and key == "cond_jaxpr":
                    continue
                for sub in _jaxprs(value):
                    inner = _inner_deps(eqn, sub, in_deps)
                    if name in ("scan", "while"):  # a carry may come to depend on the parameters in a later trip
                        probe = {"flops": 0.0, "train": 0.0, "widths": {}, "names": set(), "unknown": 0}
                        outs = _walk(sub, 1.0, probe, inner)
                        carry = eqn.params.get("num_carry", len(outs)) if name == "scan" else len(outs)
                        start = len(inner) - len(outs) if name == "while" else eqn.params.get("num_consts", 0)
                        for i in range(carry):
                            if start + i < len(inner):
                                inner[start + i] = inner[start + i] or outs[i]
                    _walk(sub, times * repeat, acc, inner)
        if out_dep:
            dependent.update(v for v in eqn.outvars)
    return [is_dep(v) for v in jaxpr.outvars]


def read_program(fn: Callable[..., Any], *args: Any, wrt: int = 0) -> ProgramFacts:
    """Trace `fn(*args)` (arrays or `jax.ShapeDtypeStruct`s) and read its products and names; the
    parameters are `args[wrt]` (what the training FLOPs' backward pass differentiates)."""
    closed = jax.make_jaxpr(fn)(*args)
    acc: dict[str, Any] = {"flops": 0.0, "train": 0.0, "widths": {}, "names": set(), "unknown": 0}
    leaves = [len(jax.tree.leaves(a)) for a in args]
    deps = [i == wrt for i, n in enumerate(leaves) for _ in range(n)]
    if len(deps) != len(closed.jaxpr.invars):
        deps = [True] * len(closed.jaxpr.invars)
    _walk(closed.jaxpr, 1.0, acc, deps)
    return ProgramFacts(acc["flops"], acc["train"], acc["widths"], frozenset(acc["names"]), acc["unknown"])


def array_leaves(tree: Any) -> list[Any]:
    return [leaf for leaf in jax.tree.leaves(tree) if hasattr(leaf, "shape") and hasattr(leaf, "dtype")]


def count_elements(tree: Any) -> int:
    return int(sum(math.prod(leaf.shape) for leaf in array_leaves(tree)))


def count_bytes(tree: Any) -> int:
    return int(sum(math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize for leaf in array_leaves(tree)))


def residual_elements(fn: Callable[..., Any], wrt: Any, *others: Any) -> int:
    """Elements of the residuals the backward pass of `fn(wrt, *others)` with respect to `wrt` keeps
    (`jax.vjp`, abstractly: nothing is allocated)."""
    residuals = jax.eval_shape(lambda w, *o: jax.vjp(lambda x: fn(x, *o), w)[1], wrt, *others)
    return count_elements(residuals)
