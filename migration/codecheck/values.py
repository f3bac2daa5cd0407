"""Value tracking: which names of one scope hold device arrays, and which expressions copy a device
value to the host (and so wait for the device)."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import const_str, dotted, iterated_values, last_name, scope_nodes, stmt_writes
from migration.codecheck.context import Context
from migration.codecheck.vocabulary import AOT_METHODS, COMPUTE_NAMESPACES, CONVERSIONS, STATIC_ATTRS, SYNC_METHODS


class Values:
    """Which names of one scope hold device arrays: results of jitted or step calls, of jnp/lax
    operations, and of calls and expressions on those. Host conversions end the chain."""

    def __init__(self, ctx: Context, scope: ast.AST, seed: set[str] = frozenset()):
        self.ctx = ctx
        self.names: set[str] = set(seed)
        writes = [w for n in scope_nodes(scope) for w in stmt_writes(n)]
        changed = True
        while changed:
            changed = False
            for names, value in writes:
                new = set(names) - self.names if self.is_device(value, self.names) else set()
                self.names |= new
                changed |= bool(new)

    def is_device(self, node: ast.AST, known: set[str]) -> bool:
        """Whether `node` evaluates to (or holds) a device array, the names in `known` holding ones."""
        stack = [(node, known)]
        while stack:
            device, parts = self._look(*stack.pop())
            if device:
                return True
            stack.extend(parts)
        return False

    def _look(self, node: ast.AST, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        """(a device value for certain, the sub-expressions that decide it otherwise)."""
        if isinstance(node, (ast.Name, ast.Attribute)):
            if dotted(node) in known:
                return True, []
            keep = isinstance(node, ast.Attribute) and node.attr not in STATIC_ATTRS
            return False, [(node.value, known)] if keep else []
        if isinstance(node, ast.Subscript):
            return False, [(node.value, known)]
        if isinstance(node, ast.Call):
            return self._look_call(node, known)
        if isinstance(node, (ast.Constant, ast.JoinedStr, ast.Lambda)):
            return False, []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn))
                                                 for op in node.ops):
            return False, []  # identity and key membership: answered on the host
        if isinstance(node, ast.IfExp):
            return False, [(node.body, known), (node.orelse, known)]
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = self.comprehension_names(node, known)
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            return False, [(e, inner) for e in elts]
        return False, [(c, known) for c in ast.iter_child_nodes(node)]

    def comprehension_names(self, node: ast.AST, known: set[str]) -> set[str]:
        """`known` plus the loop variables of comprehensions in `node` that iterate over device values."""
        names = set(known)
        for gen in (n for n in ast.walk(node) if isinstance(n, ast.comprehension)):
            if self.is_device(gen.iter, names):
                names |= set(iterated_values(gen.target, gen.iter))
        return names

    def _look_call(self, call: ast.Call, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        ctx = self.ctx
        if ctx.is_host_call(call) or ctx.transform_kind(call.func) or last_name(call.func) in AOT_METHODS:
            return False, []
        if isinstance(call.func, ast.Call) and ctx.transform_kind(call.func.func):
            return True, []  # jax.grad(loss)(params)
        name = ctx.resolve(call.func)
        if ctx.is_step_call(call) or last_name(call.func) in ctx.compiled or name.startswith(COMPUTE_NAMESPACES):
            return True, []
        parts = [call.func.value] if isinstance(call.func, ast.Attribute) else []
        return False, [(a, known) for a in parts + call.args + [k.value for k in call.keywords]]

    def sync_message(self, node: ast.AST, known: set[str]) -> str | None:
        """Why `node` copies a device value to the host (and waits for it), or None."""
        if isinstance(node, ast.JoinedStr):
            if any(isinstance(v, ast.FormattedValue) and self.is_device(v.value, known) for v in node.values):
                return "an f-string formats a device array"
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and const_str(node.left) is not None:
            return "`%` formats a device array" if self.is_device(node.right, known) else None
        return self._sync_call_message(node, known) if isinstance(node, ast.Call) else None

    def _sync_call_message(self, call: ast.Call, known: set[str]) -> str | None:
        ctx = self.ctx
        name = ctx.resolve(call.func)
        args = call.args + [k.value for k in call.keywords]
        live = lambda nodes: any(self.is_device(a, known) for a in nodes)
        if name in CONVERSIONS and call.args and live(call.args[:1]):
            return f"`{name}(...)` of a device array"
        if isinstance(call.func, ast.Attribute) and call.func.attr in SYNC_METHODS and live([call.func.value]):
            return f"`.{call.func.attr}()` of a device array"
        if (name == "jax.device_get" or name.startswith("numpy.")) and live(args):
            return f"`{name}(...)` of a device array"
        if (name == "print" or ctx.is_logger_call(call)) and live(args):
            return f"`{name or last_name(call.func)}(...)` formats a device array"
        if last_name(call.func) == "format" and isinstance(call.func, ast.Attribute) \
                and const_str(call.func.value) is not None and live(args):
            return "`str.format` formats a device array"
        return None

