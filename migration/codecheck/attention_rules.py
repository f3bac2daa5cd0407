"""ATTN001: attention that stores the scores. A hand-written softmax over a product of two arrays
(`softmax(einsum(q, k) / sqrt(d))`, `softmax(q @ k.T)`, the scores taken from a variable assigned such a
product in the same function), `jax.nn.dot_product_attention(..., implementation="xla")`, and Flax's
`dot_product_attention` (linen or nnx), which compute the T x T scores in HBM. On an NVIDIA GPU of compute
capability 8.0+ in bf16/fp16, cuDNN's fused kernel never stores them: the planner plans such code with
XLA's attention and names the saving (`--attention xla`)."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (assigned_pairs, scope_nodes, walk)
from migration.codecheck.context import Context
from migration.codecheck.family import RawFinding, RuleFamily

TRANSPOSES = ("T", "mT", "swapaxes", "transpose", "moveaxis")
FLAX_ATTENTION = ("flax.linen.dot_product_attention", "flax.linen.attention.dot_product_attention",
                  "flax.nnx.dot_product_attention", "flax.nnx.nn.attention.dot_product_attention")
SCOPE_TYPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.Module)


class AttentionRules(RuleFamily):
    def __init__(self, ctx: Context, found: list[RawFinding]):
        super().__init__(ctx, found)

    def call(self, node: ast.Call, name: str, last: str) -> None:
        if last == "dot_product_attention" and name.startswith("jax.nn."):
            impl = next((k.value for k in node.keywords if k.arg == "implementation"), None)
            if isinstance(impl, ast.Constant) and impl.value == "xla":
                self.add(node, "ATTN001", "`jax.nn.dot_product_attention(..., implementation=\"xla\")` stores the "
                                          "T x T scores per head")
            return
        if name in FLAX_ATTENTION or (last == "dot_product_attention" and name.startswith("flax.")):
            self.add(node, "ATTN001", f"`{name}` computes the T x T scores in HBM (XLA's attention)")
            return
        if last == "softmax" and name.split(".")[0] in ("jax", "flax") and node.args:
            product = self._product(node.args[0], node, depth=0)
            if product:
                self.add(node, "ATTN001", f"softmax over {product}: hand-written attention that stores the T x T "
                                          "scores per head")

    def _product(self, expr: ast.AST, at: ast.AST, depth: int) -> str | None:
        """What makes `expr` a product of two arrays: an einsum/matmul call or `@` in it, or a name assigned
        such an expression earlier in the same function (followed twice at most)."""
        for n in walk(expr):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.MatMult) and _transposed(n.right):
                return "`q @ k.T`"
            if isinstance(n, ast.Call):
                name = self.ctx.resolve(n.func)
                last = name.rsplit(".", 1)[-1]
                if last == "matmul" and len(n.args) == 2 and _transposed(n.args[1]):
                    return "`matmul(q, k.T)`"
                if last == "einsum" and _scores_subscripts(n):
                    return "`einsum(...)` of two activations"
        if depth >= 2:
            return None
        names = {n.id for n in walk(expr) if isinstance(n, ast.Name)}
        scope = self.ctx.parents.get(at)
        while scope is not None and not isinstance(scope, SCOPE_TYPES):
            scope = self.ctx.parents.get(scope)
        if scope is None or not names:
            return None
        line = getattr(at, "lineno", 0)
        for stmt in scope_nodes(scope):
            if getattr(stmt, "lineno", line) >= line:
                continue
            for target, value in assigned_pairs(stmt):
                if isinstance(target, ast.Name) and target.id in names:
                    found = self._product(value, value, depth + 1)
                    if found:
                        return found
        return None


def _transposed(node: ast.AST) -> bool:
    """`k.T`, `k.swapaxes(...)`, `jnp.swapaxes(k, ...)`, `k.transpose(...)`: the keys turned for q k^T."""
    if isinstance(node, ast.Attribute) and node.attr in ("T", "mT"):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        return isinstance(func, ast.Attribute) and func.attr in TRANSPOSES
    return False


def _scores_subscripts(call: ast.Call) -> bool:
    """An einsum of two operands with subscripts of the same rank (3 or more) that share every letter but one
    each, the output keeping both unshared letters: 'bqhd,bkhd->bhqk' (scores), not 'btd,dv->btv' (a layer)."""
    if not call.args or not isinstance(call.args[0], ast.Constant) or not isinstance(call.args[0].value, str):
        return False
    spec = call.args[0].value.replace(" ", "").replace("...", "")
    if "->" not in spec or len(call.args) != 3:
        return False
    inputs, out = spec.split("->")
    parts = inputs.split(",")
    if len(parts) != 2:
        return False
    a, b = (set(x) for x in parts)
    if len(parts[0]) != len(parts[1]) or len(parts[0]) < 3:
        return False
    only_a, only_b = a - b, b - a
    return len(only_a) == 1 and len(only_b) == 1 and only_a <= set(out) and only_b <= set(out)
