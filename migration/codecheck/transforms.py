"""How a function is transformed (jit, pmap, grad, a lax loop body) and which of its arguments are
therefore traced, with the static arguments the transformation declares."""

from __future__ import annotations

import ast
import dataclasses

from migration.codecheck.ast_helpers import const_int, const_str


@dataclasses.dataclass(frozen=True)
class Transform:
    """How one function is transformed: which of its arguments are traced."""
    kind: str                              # "compile" | "grad" | "control"
    pmap: bool = False
    static_names: frozenset[str] = frozenset()
    static_nums: frozenset[int] = frozenset()
    argnums: frozenset[int] | None = None  # grad: the differentiated positions
    bound: bool = False                    # applied to `obj.method`: positions skip `self`

    def traced(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
        positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        offset = 1 if self.bound and positional[:1] in (["self"], ["cls"]) else 0
        at = lambda nums: {positional[offset + i] for i in nums if -len(positional) <= offset + i < len(positional)}
        if self.argnums is not None:
            return at(self.argnums)
        every = positional + [a.arg for a in fn.args.kwonlyargs]
        every += [a.arg for a in (fn.args.vararg, fn.args.kwarg) if a]
        if self.kind == "control":  # lax passes only the carry/operands: defaulted parameters keep their values
            every = [a for a in every if a not in defaulted_params(fn)]
        return set(every) - self.static_names - at(self.static_nums) - {"self", "cls"}


def defaulted_params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters that have a default value."""
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    with_default = positional[len(positional) - len(fn.args.defaults):] if fn.args.defaults else []
    return set(with_default) | {a.arg for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}


def int_set(node: ast.AST) -> frozenset[int]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    return frozenset(v for v in (const_int(e) for e in elts) if v is not None)


def str_set(node: ast.AST) -> frozenset[str]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    return frozenset(v for v in (const_str(e) for e in elts) if v)

