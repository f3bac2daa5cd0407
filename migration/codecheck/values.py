"""Value tracking: which names of one scope hold device arrays, and which expressions copy a device
value to the host (and so wait for the device)."""

from __future__ import annotations

import ast
import dataclasses

from migration.codecheck.ast_helpers import (assigned_pairs, children, const_str, dotted, iterated_values, last_name,
                                             mutations, scope_nodes, target_names, walk)
from migration.codecheck.context import Context
from migration.codecheck.vocabulary import (AOT_METHODS, COMPUTE_NAMESPACES, CONVERSIONS, OPTAX_ARRAY_NAMESPACES,
                                            OPTAX_ARRAYS, STATE_ATTRS, STATIC_ATTRS, SYNC_METHODS,
                                            SYNCHRONOUS_CALLS, SYNCHRONOUS_METHODS, WAIT_METHODS)


class Values:
    """Which names of one scope hold device arrays: results of jitted or step calls, of jnp/lax
    operations, and of calls and expressions on those. Host conversions end the chain."""

    def __init__(self, ctx: Context, scope: ast.AST, seed: set[str] = frozenset(), members: bool = True):
        self.ctx = ctx
        self.names: set[str] = set(seed) | state_of_step_arguments(ctx, scope)
        if members:  # `self.state` set to a device value by another method of the class
            self.names |= class_device_attributes(ctx, scope)
        pending = [(names, value) for names, value in scope_writes(ctx, scope) if names]
        changed = True
        while changed:  # until no write adds a name; a write whose names are all known is done
            changed = False
            still = []
            for names, value in pending:
                if names <= self.names:
                    continue
                if self.is_device(value, self.names):
                    self.names |= names
                    changed = True
                else:
                    still.append((names, value))
            pending = still

    def is_device(self, node: ast.AST, known: set[str]) -> bool:
        """Whether `node` evaluates to (or holds) a device array, the names in `known` holding ones."""
        stack = [(node, known)]
        while stack:
            node, known = stack.pop()
            kind = node.__class__
            if kind is ast.Name:  # the commonest nodes, read here as `_look` reads them
                if node.id in known:
                    return True
                continue
            if kind is ast.Constant:
                continue
            device, parts = self._look(node, known)
            if device:
                return True
            stack.extend(parts)
        return False

    def _look(self, node: ast.AST, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        """(a device value for certain, the sub-expressions that decide it otherwise)."""
        kind = node.__class__
        if kind is ast.Name:
            return node.id in known, []
        if kind is ast.Attribute:
            if dotted(node) in known:
                return True, []
            return False, [(node.value, known)] if node.attr not in STATIC_ATTRS else []
        if kind is ast.Call:
            return self._look_call(node, known)
        if kind is ast.Constant or kind is ast.JoinedStr or kind is ast.Lambda:
            return False, []
        if kind is ast.Subscript:
            return False, [(node.value, known)]
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn))
                                                 for op in node.ops):
            return False, []  # identity and key membership: answered on the host
        if isinstance(node, ast.IfExp):
            return False, [(node.body, known), (node.orelse, known)]
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = self.comprehension_names(node, known)
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            return False, [(e, inner) for e in elts]
        return False, [(c, known) for c in children(node)]

    def comprehension_names(self, node: ast.AST, known: set[str]) -> set[str]:
        """`known` plus the loop variables of comprehensions in `node` that iterate over device values."""
        names = set(known)
        for gen in (n for n in walk(node) if isinstance(n, ast.comprehension)):
            if self.is_device(gen.iter, names):
                names |= set(iterated_values(gen.target, gen.iter, [node]))
        return names

    def _look_call(self, call: ast.Call, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        reads = self.ctx.call_reads  # kept by the file's context, not on the node: a call in the function it
        read = reads.get(id(call))      # calls would hold that function, a reference cycle
        if read is None:
            read = reads[id(call)] = self._read_call(call)
        before, callee, after, parts = read
        if before is not None:
            return before, []
        if callee is not None and summary(self.ctx, callee).returns_host:
            return False, []  # a function of this file that hands back host values (`np.array(loss).mean()`)
        if after is not None:
            return after, []
        return False, [(a, known) for a in parts]

    def _read_call(self, call: ast.Call) -> tuple[bool | None, ast.FunctionDef | None, bool | None, list[ast.AST]]:
        """What decides whether a call's result is a device value, whatever names hold ones, read once per
        call: (the answer before this file's callee is asked, the callee, the answer after it, the
        sub-expressions that decide otherwise)."""
        ctx = self.ctx
        if ctx.is_host_call(call) or ctx.transform_kind(call.func) or last_name(call.func) in AOT_METHODS:
            return False, None, None, []
        if isinstance(call.func, ast.Call) and ctx.transform_kind(call.func.func):
            return True, None, None, []  # jax.grad(loss)(params)
        name = ctx.resolve(call.func)
        after = None
        if ctx.is_step_call(call) or last_name(call.func) in ctx.compiled or name.startswith(COMPUTE_NAMESPACES):
            after = True
        elif name.startswith("optax."):  # transformations and schedules are host objects; a few calls compute
            after = name in OPTAX_ARRAYS or name.startswith(OPTAX_ARRAY_NAMESPACES)
        parts = [call.func.value] if isinstance(call.func, ast.Attribute) else []
        return None, ctx.callee(call), after, parts + call.args + [k.value for k in call.keywords]

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



@dataclasses.dataclass(frozen=True)
class Summary:
    """What calling a function of this file does: hands back only host values, waits for the device;
    and which places of the tuple it returns hold host values in every return."""
    returns_host: bool
    waits: bool
    host_places: frozenset[int] = frozenset()


def host_targets(ctx: Context, target: ast.AST, value: ast.AST) -> set[str]:
    """Names of `a, b = f(...)` that receive a host value: `b` when this file's `f` returns
    `state, float(loss)` everywhere."""
    if not (isinstance(target, ast.Tuple) and isinstance(value, ast.Call)):
        return set()
    fn = ctx.callee(value)
    if fn is None:
        return set()
    places = summary(ctx, fn).host_places
    return {n for i, elt in enumerate(target.elts) if i in places for n in target_names(elt)}


def summary(ctx: Context, fn: ast.FunctionDef | ast.AsyncFunctionDef, seed: frozenset[str] = frozenset()) -> Summary:
    """Read once per function (and parameters holding device values, `seed`): its returns are host
    values when none is a device value by its own tracking; it waits when it copies a device value
    to the host, blocks or calls `device_get`."""
    cache, key = ctx.summaries, (id(fn), seed)
    if key not in cache:
        cache[key] = Summary(False, False)  # a recursive call reads as neither while this one is read
        values = Values(ctx, fn, seed=set(seed))
        nodes = list(scope_nodes(fn))
        returns = [n.value for n in nodes if isinstance(n, ast.Return) and n.value is not None]
        waits = any(isinstance(n, ast.Call) and is_wait(ctx, n) or values.sync_message(n, values.names) for n in nodes)
        host = [not values.is_device(r, values.names) for r in returns]
        places = [{i for i, e in enumerate(r.elts) if not values.is_device(e, values.names)}
                  if isinstance(r, ast.Tuple) else None for r in returns]
        common = frozenset.intersection(*map(frozenset, places)) if places and None not in places else frozenset()
        cache[key] = Summary(bool(returns) and all(host), waits, common)
    return cache[key]


def is_wait(ctx: Context, call: ast.Call) -> bool:
    """A call that returns only once the work before it is done (SYNCHRONOUS_CALLS, `.block_until_ready()`,
    an ahead-of-time `.compile()`), or that hands a wait to a tree map (`tree_map(lambda x:
    x.block_until_ready(), out)`)."""
    if last_name(call.func) in WAIT_METHODS | SYNCHRONOUS_METHODS or ctx.resolve(call.func) in SYNCHRONOUS_CALLS:
        return True
    return any(isinstance(a, ast.Lambda) and any(isinstance(n, ast.Call) and is_wait(ctx, n) for n in walk(a.body))
               for a in call.args)


def state_of_step_arguments(ctx: Context, scope: ast.AST) -> set[str]:
    """`network.state`, `trainer.params`, ...: the state attributes of each object a step is called
    with, or called on (`network.train(batch)`), in this scope."""
    key = ("state", id(scope))
    if key not in ctx.summaries:
        ctx.summaries[key] = {n for call in scope_nodes(scope) if isinstance(call, ast.Call)
                              and ctx.is_step_call(call) for n in step_state_names(call)}
    return ctx.summaries[key]


def step_state_names(call: ast.Call) -> set[str]:
    """`network.state`, `network.params`, ... for each plain name a step call is given or made on."""
    holders = call.args + [k.value for k in call.keywords]
    holders += [call.func.value] if isinstance(call.func, ast.Attribute) else []
    return {f"{h.id}.{attr}" for h in holders if isinstance(h, ast.Name) and h.id not in ("self", "cls")
            for attr in STATE_ATTRS}


WRITES = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.Expr)  # what assigned_pairs / mutations read


def scope_writes(ctx: Context, scope: ast.AST) -> list[tuple[set[str], ast.AST]]:
    """(names, value) for each assignment and container mutation of one scope, host targets left out;
    read once per scope."""
    key = ("writes", id(scope))
    if key not in ctx.summaries:
        nodes = [n for n in scope_nodes(scope) if isinstance(n, WRITES)]
        writes = [(set(names) - host_targets(ctx, target, value), value) for n in nodes
                  for target, value in assigned_pairs(n) for names in [target_names(target)]]
        writes += [({c}, v) for n in nodes for c, v in mutations(n)]
        ctx.summaries[key] = writes
    return ctx.summaries[key]


def class_device_attributes(ctx: Context, scope: ast.AST) -> set[str]:
    """For a method: the `self.<attr>` names that any method of its class assigns a device value (read once
    per class)."""
    cls = ctx.parents.get(scope)
    if not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef)) or not isinstance(cls, ast.ClassDef):
        return set()
    key = ("members", id(cls))
    if key not in ctx.summaries:
        methods = [m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
        ctx.summaries[key] = {n for m in methods for n in Values(ctx, m, members=False).names if n.startswith("self.")}
    return ctx.summaries[key]
