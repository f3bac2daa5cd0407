"""Tracing and recompile rules: TRACE001 (Python control flow on a traced value inside a transformed
function) and SHAPE001 (batch shapes that vary between steps, so the step compiles again)."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (assigned_pairs, dotted, last_name, scope_nodes, static_uses,
                                             target_names, walk)
from migration.codecheck.context import Context
from migration.codecheck.family import RawFinding, RuleFamily


class ShapeRules(RuleFamily):
    """TRACE001 and SHAPE001. `traced` holds, per enclosing function, the names traced inside it."""

    def __init__(self, ctx: Context, found: list[RawFinding]):
        super().__init__(ctx, found)
        self.traced: list[set[str]] = []

    # functions (TRACE001) ----------------------------------------------------------------
    def enter_function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        transforms = self.ctx.transforms.get(id(node), [])
        params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        outer = self.traced[-1] if self.traced else set()
        traced = (outer - params) | {n for t in transforms for n in t.traced(node)}
        self.traced.append(propagate_traced(node, traced) if traced else set())

    def leave_function(self) -> None:
        self.traced.pop()

    def check_traced(self, node: ast.AST, test: ast.AST, keyword: str) -> None:
        names = traced_uses(test, self.traced[-1]) if self.traced else []
        if names:
            self.add(node, "TRACE001", f"`{keyword}` on `{names[0]}`, a traced value inside a transformed function: "
                                       "it raises a ConcretizationTypeError (or silently specialises) under jit")

    def for_loop(self, node: ast.For) -> None:
        it = node.iter
        if isinstance(it, ast.Call) and dotted(it.func) == "range":
            self.check_traced(node, ast.Tuple(elts=list(it.args), ctx=ast.Load()), "for ... in range")

    # calls (SHAPE001) ------------------------------------------------------------------------
    def call(self, node: ast.Call, last: str) -> None:
        if last in ("batch", "padded_batch") and isinstance(node.func, ast.Attribute):
            if flag_missing(node, "drop_remainder"):
                self.add(node, "SHAPE001", f"`.{last}(...)` without drop_remainder=True yields a smaller last batch")
        unbatched = any(k.arg == "batch_sampler" or k.arg == "batch_size" and isinstance(k.value, ast.Constant)
                        and k.value.value is None for k in node.keywords)
        if self._torch_loader(node) and not unbatched and flag_missing(node, "drop_last"):
            self.add(node, "SHAPE001", "`DataLoader(...)` without drop_last=True yields a smaller last batch")

    def _torch_loader(self, node: ast.Call) -> bool:
        """torch.utils.data.DataLoader (or a bare `DataLoader` in a snippet), not grain's or another's."""
        return self.ctx.resolve(node.func).startswith("torch.") and last_name(node.func) == "DataLoader" \
            or self.ctx.is_bare(node.func) and node.func.id == "DataLoader"


def propagate_traced(fn: ast.AST, traced: set[str]) -> set[str]:
    """`traced` plus the names computed from traced values inside the function."""
    traced = set(traced)
    pairs = [p for n in scope_nodes(fn) for p in assigned_pairs(n)]
    pairs += [(n.target, n.iter) for n in scope_nodes(fn) if isinstance(n, (ast.For, ast.AsyncFor))]
    # each value's names read other than statically, found once: `traced_uses(value, traced)` is not empty
    # exactly when they meet `traced`
    reads = [(target, {n.id for n in walk(value) if n.__class__ is ast.Name and id(n) not in static})
             for target, value in pairs for static in [static_uses(value)]]
    changed = True
    while changed:
        changed = False
        for target, names in reads:
            if names & traced:
                new = set(target_names(target)) - traced
                traced |= new
                changed |= bool(new)
    return traced


def traced_uses(expr: ast.AST, traced: set[str]) -> list[str]:
    static = static_uses(expr)
    return [n.id for n in walk(expr) if isinstance(n, ast.Name) and n.id in traced and id(n) not in static]


def flag_missing(node: ast.Call, keyword: str) -> bool:
    """True when the keyword is absent or literally False (a variable may be True: not flagged)."""
    value = next((k.value for k in node.keywords if k.arg == keyword), None)
    return value is None or isinstance(value, ast.Constant) and value.value is False
