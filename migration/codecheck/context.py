"""What a whole file tells the checks: import aliases, the first JAX import, the names it binds, its
transformed functions and the names bound to them, and which calls run a training step, return host
values or log."""

from __future__ import annotations

import ast
import bisect
import dataclasses

from migration.codecheck.ast_helpers import (dotted, is_step_name, last_name, name_tokens, scope_nodes,
                                             target_names, walk)
from migration.codecheck.placement import placement_helpers
from migration.codecheck.transforms import Transform, int_set, str_set
from migration.codecheck.vocabulary import (APPLY_METHODS, BARE_TRANSFORMS, COMPILE_TRANSFORMS, CONTROL_FLOW,
                                            DEFAULT_ALIASES, GRAD_TRANSFORMS, HOST_BUILTINS, HOST_IO_TOKENS, HOST_JAX,
                                            HOST_NAMESPACES, JAX_IMPORTERS, LOG_METHODS, LOSS_SCALING_HINTS,
                                            NOT_LOGGERS, PLACEMENT_HELPERS, SYNC_METHODS, WRAPPERS, removed_key)
from migration.codecheck.vocabulary import ENV_TOKENS, ES_METHODS, ES_RECEIVERS, VENDORED


class Context:
    """What the whole file tells: import aliases, the first JAX import, transformed functions,
    compiled names, whether it uses pmap / shard_map and loss scaling."""

    def __init__(self, tree: ast.Module, filename: str):
        self.filename = filename
        self.tree = tree
        self.nodes = walk(tree)
        self.parents = {child: node for node in self.nodes for child in node._kids}
        self.by_type: dict[type, list[ast.AST]] = {}
        self._position: dict[int, int] | None = None  # id(node) -> its place in the walk, when asked
        for node in self.nodes:
            kind = self.by_type.get(node.__class__)
            if kind is None:
                kind = self.by_type[node.__class__] = []
            kind.append(node)
        self.aliases: dict[str, str] = dict(DEFAULT_ALIASES)
        self.aliases_read = False
        self.removed_bindings: set[str] = set()
        self.jax_import: tuple[int, str] | None = None
        # in the file's order (two imports on one line are statements of one block, in the walk's order too)
        for node in sorted(self.of(ast.Import, ast.ImportFrom), key=lambda n: (n.lineno, n.col_offset)):
            self._read_import(node)
        self._read_module_aliases()
        self.aliases_read = True
        self._read_bindings()
        self.transforms: dict[int, list[Transform]] = {}  # id(FunctionDef) -> how it is transformed
        self._jax_work: dict[int, bool] = {}
        self._defs_in: dict[int, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}  # scope -> its functions
        self.compiled: dict[str, str] = {}  # name bound to a transformed function -> the function's name
        self.summaries: dict[tuple, object] = {}  # (id(FunctionDef), seed) -> values.Summary, on first use
        self._callees: dict[int, ast.FunctionDef | ast.AsyncFunctionDef | None] = {}  # id(Call) -> `callee`
        self.call_reads: dict[int, tuple] = {}  # id(Call) -> what decides whether it returns a device value
        for node in self.nodes:
            if node.__class__ in TRANSFORM_SITES:
                self._read_transforms(node)
        self._read_uses()
        self.placement_helpers = placement_helpers(
            [f for fs in self.functions.values() for f in fs],
            lambda call: self.resolve(call.func) in PLACEMENT_HELPERS)

    def _read_module_aliases(self) -> None:
        """`ju = flax.jax_utils`, `pmap = jax.pmap`, `P = jax.sharding.PartitionSpec`: a name the module binds
        once to a dotted name of an import is followed like an import (`ju.replicate` is
        `flax.jax_utils.replicate`)."""
        binds: dict[str, list[ast.AST]] = {}
        for stmt in self.tree.body:
            for target in (stmt.targets if isinstance(stmt, ast.Assign) else
                           [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []):
                for name in target_names(target):
                    binds.setdefault(name, []).append(stmt.value if isinstance(stmt, ast.Assign) else None)
        for name, values in binds.items():
            value = values[0]
            if len(values) != 1 or not isinstance(value, (ast.Name, ast.Attribute)) or name in self.aliases:
                continue
            text = dotted(value)
            root = text.split(".")[0]
            if text and root in self.aliases and root not in DEFAULT_ALIASES:
                full = self.resolve(value)
                self.aliases[name] = full
                if removed_key(full):
                    self.removed_bindings.add(name)

    def _read_bindings(self) -> None:
        """Names the file binds itself, and its functions by name (a name bound to a lambda counts as
        a function: `log = lambda m: print(float(m))`)."""
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in self.in_walk_order(ast.FunctionDef, ast.AsyncFunctionDef):
            self.functions.setdefault(node.name, []).append(node)
        for node in (n for n in self.of(ast.Assign) if isinstance(n.value, ast.Lambda)):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    self.functions.setdefault(target.id, []).append(lambda_function(target.id, node.value))
        self.bound_here = {n.id for n in self.of(ast.Name) if n.ctx.__class__ is not ast.Load}
        self.bound_here |= set(self.functions)
        classes = self.of(ast.ClassDef)
        self.classes = {c.name: c for c in classes if sum(o.name == c.name for o in classes) == 1}
        self.bound_here |= {c.name for c in classes}  # the file's own class is no snippet's pmap or DataLoader
        self.bound_here |= {a.arg for n in self.of(ast.arguments) for a in n.posonlyargs + n.args + n.kwonlyargs}
        # name -> sorted (line, callee name) of each `name = Callee(...)`: which class last made an object,
        # looked up per call by bisection (a scan of the file per call was quadratic in the file's length)
        self.made_by: dict[str, list[tuple[int, str]]] = {}
        for n in self.of(ast.Assign):
            if n.value.__class__ is not ast.Call:
                continue
            func = n.value.func
            # `obj = Trainer(...)`, or a class of this file's own constructor: `state = TrainState.create(...)`
            maker = func.id if isinstance(func, ast.Name) else func.value.id if isinstance(func, ast.Attribute) \
                and isinstance(func.value, ast.Name) and func.value.id in self.classes else None
            if maker:
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        self.made_by.setdefault(t.id, []).append((n.lineno, maker))
        for made in self.made_by.values():
            made.sort()

    def _read_uses(self) -> None:
        """Whether the file uses JAX at all, pmap, shard_map (or xmap), and loss scaling anywhere."""
        parents = self.parents
        # whole chains: `jax.lax.pmean`, not `jax.lax`; a plain name resolves by its spelling alone
        names = {n.id for n in self.of(ast.Name) if parents[n].__class__ is not ast.Attribute}
        refs = {self.expand(name) for name in names}
        refs |= {self.resolve(n) for n in self.of(ast.Attribute) if parents[n].__class__ is not ast.Attribute}
        self.uses_pmap = "jax.pmap" in refs
        self.uses_shard_map = any(r.endswith(("shard_map", "xmap")) for r in refs)
        # JAX in the file: an import of it (or Flax, Optax, ...) or a name under jax (jnp, lax)
        self.uses_jax = self.jax_import is not None or any(r.startswith("jax.") for r in refs)
        spelled = {getattr(n, field) for kind, field in WORDS.items() for n in self.by_type.get(kind, ())}
        self.words = words = {w.lower() for w in spelled if isinstance(w, str)}  # every identifier, lower-cased
        self.has_loss_scaling = any(h in w for w in words for h in LOSS_SCALING_HINTS)

    def of(self, *types: type) -> list[ast.AST]:
        """The file's nodes of these exact types (type by type, each in walk order)."""
        return [n for t in types for n in self.by_type.get(t, ())]

    def in_walk_order(self, *types: type) -> list[ast.AST]:
        """The file's nodes of these exact types, in walk order."""
        found = self.of(*types)
        if sum(t in self.by_type for t in types) > 1:
            if self._position is None:
                self._position = {id(n): i for i, n in enumerate(self.nodes)}
            found.sort(key=lambda n: self._position[id(n)])
        return found

    # imports ---------------------------------------------------------------------------
    def _read_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.ImportFrom) and node.level and not node.module:
            # `from . import ninjax as nj`: a library a project vendors is read as that library
            for alias in node.names:
                if alias.name in VENDORED:
                    self.aliases[alias.asname or alias.name] = alias.name
            return
        if isinstance(node, ast.ImportFrom) and (node.level or not node.module):
            return
        for alias in node.names:
            if isinstance(node, ast.Import):
                full = alias.name
                local, bound = (alias.asname, full) if alias.asname else (full.split(".")[0], full.split(".")[0])
            else:
                full = f"{node.module}.{alias.name}"
                local, bound = alias.asname or alias.name, full
            self.aliases[local] = bound
            if removed_key(full):
                self.removed_bindings.add(local)
            root = full.split(".")[0]
            if root in JAX_IMPORTERS and self.jax_import is None:
                self.jax_import = (node.lineno, root)

    def resolve(self, node: ast.AST) -> str:
        """The dotted name with its import alias expanded: 'jnp.float16' -> 'jax.numpy.float16' (kept on the
        node once the file's aliases are all read)."""
        cached = node.__dict__.get("_resolved")
        if cached is not None:
            return cached
        full = self.expand(dotted(node))
        if self.aliases_read:
            node._resolved = full
        return full

    def expand(self, name: str) -> str:
        """A dotted name with its import alias expanded."""
        root, _, rest = name.partition(".")
        base = self.aliases.get(root, root)
        full = f"{base}.{rest}" if rest and base else base
        return WRAPPERS.get(full, full)

    # transformations ---------------------------------------------------------------------
    def transform_kind(self, node: ast.AST) -> str | None:
        """'compile' | 'grad' | 'control' when `node` names a JAX transformation."""
        name = self.resolve(node)
        if not name.startswith("jax.") and not (node.__class__ is ast.Name and self.is_bare(node)):
            return None  # most calls: neither under jax nor a snippet's bare name
        last = name.rsplit(".", 1)[-1]
        if not name.startswith("jax.") and last not in BARE_TRANSFORMS:
            return None
        if last in COMPILE_TRANSFORMS:
            return "compile"
        if last in GRAD_TRANSFORMS:
            return "grad"
        return "control" if last in CONTROL_FLOW and name.startswith("jax.lax.") else None

    def _partial_target(self, call: ast.Call) -> ast.AST | None:
        """`jax.jit` in `functools.partial(jax.jit, ...)`."""
        if self.resolve(call.func) in ("functools.partial", "partial") and call.args:
            return call.args[0]
        return None

    def _make_transform(self, kind_node: ast.AST, keywords: list[ast.keyword],
                        args: list[ast.AST]) -> Transform | None:
        """The transform `kind_node` names, with the static arguments its keywords declare."""
        kind = self.transform_kind(kind_node)
        if kind is None:
            return None
        names, nums, argnums = frozenset(), frozenset(), None
        for kw in keywords:
            if kw.arg == "static_argnames":
                names |= str_set(kw.value)
            elif kw.arg in ("static_argnums", "static_broadcasted_argnums", "nondiff_argnums"):
                nums |= int_set(kw.value)
            elif kw.arg == "argnums":
                argnums = int_set(kw.value)
        if kind == "grad" and argnums is None:
            argnums = int_set(args[1]) if len(args) > 1 else frozenset({0})
        pmap = self.resolve(kind_node).rsplit(".", 1)[-1] == "pmap"
        return Transform(kind, pmap, names, nums, argnums if kind == "grad" else None)

    def _record(self, call: ast.Call, fn_ref: ast.AST, transform: Transform | None) -> None:
        if transform is None or not isinstance(fn_ref, (ast.Name, ast.Attribute)):
            return
        fn = self.definition(call, fn_ref.id if isinstance(fn_ref, ast.Name) else fn_ref.attr)
        if fn is not None:
            bound = isinstance(fn_ref, ast.Attribute)
            self.transforms.setdefault(id(fn), []).append(dataclasses.replace(transform, bound=bound))

    def definition(self, node: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The function `name` as seen from `node`: defined in its scope or an enclosing one (or class)."""
        scope = self.parents.get(node)
        while scope is not None:
            if isinstance(scope, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if id(scope) not in self._defs_in:
                    self._defs_in[id(scope)] = {}
                    for n in scope_nodes(scope):
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self._defs_in[id(scope)].setdefault(n.name, n)
                if name in self._defs_in[id(scope)]:
                    return self._defs_in[id(scope)][name]
            scope = self.parents.get(scope)
        return None

    def _read_transforms(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                transform = self._decorator_transform(dec)
                if transform:
                    self.transforms.setdefault(id(node), []).append(transform)
                    self.compiled[node.name] = node.name
        elif isinstance(node, ast.Call):
            self._read_transform_call(node)

    def _decorator_transform(self, dec: ast.AST) -> Transform | None:
        if not isinstance(dec, ast.Call):
            return self._make_transform(dec, [], [])
        target = self._partial_target(dec)
        if target is not None:
            return self._make_transform(target, dec.keywords, [])
        return self._make_transform(dec.func, dec.keywords, [])

    def _read_transform_call(self, call: ast.Call) -> None:
        """`jax.jit(f, ...)`, `partial(jax.pmap, ...)(f)`, `lax.scan(body, ...)`; names bound to the result."""
        inner = call.func if isinstance(call.func, ast.Call) else None
        target = self._partial_target(inner) if inner is not None else None
        if target is not None:
            transform = self._make_transform(target, inner.keywords + call.keywords, call.args)
        else:
            transform = self._make_transform(call.func, call.keywords, call.args)
        if transform is None or not call.args:
            return
        if transform.kind == "control":
            refs = [e for a in call.args for e in (a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])]
            for ref in refs:
                self._record(call, ref, transform)
            return
        self._record(call, call.args[0], transform)
        parent = self.parents.get(call)
        if isinstance(parent, ast.Assign) and parent.value is call:
            fn = last_name(call.args[0])
            for t in parent.targets:
                for name in target_names(t):
                    self.compiled[name.rsplit(".", 1)[-1]] = fn

    # calls -------------------------------------------------------------------------------
    def is_step_call(self, call: ast.Call) -> bool:
        """A call that runs a training step: `train_step(...)`, `p_update(...)`, `self.step_fn(...)`;
        not predicates or builders (`is_step(...)`, `make_train_step(...)`), nor `pbar.update(1)`. Read
        once per call."""
        known = call.__dict__.get("_is_step")
        if known is None:
            known = call._is_step = self._is_step_call(call)
        return known

    def _is_step_call(self, call: ast.Call) -> bool:
        args = call.args + [k.value for k in call.keywords]
        receiver = set(name_tokens(last_name(call.func.value))) if isinstance(call.func, ast.Attribute) else set()
        if receiver & ENV_TOKENS:
            return False  # `env.step(action)`: a simulator's step on the host, not a training step
        if call.func.__class__ is ast.Attribute and call.func.attr in ES_METHODS and receiver & ES_RECEIVERS:
            return True  # an evolution strategy's `strategy.ask(...)` / `solver.tell(...)`: its update step
        if not args or all(isinstance(a, ast.Constant) for a in args):
            return False
        if self.resolve(call.func).startswith(("os.", "jax.config")):
            return False
        name = last_name(call.func)
        if not (is_step_name(name) or is_step_name(self.compiled.get(name, ""))):
            return False
        if name == "update" and isinstance(call.func, ast.Attribute) and len(args) == 1 and self.callee(call) is None:
            return False  # `metrics.update(other)`: a dict merging another, not an update step
        fn = self.callee(call)
        return fn is None or self._does_jax_work(fn)

    def _does_jax_work(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether a (not transformed) function of this file calls JAX, optax, flax or a compiled function:
        `def latest_step(path): return int(path.name)` does not, so calling it runs no step."""
        if id(fn) not in self._jax_work:
            calls = [n for n in scope_nodes(fn) if isinstance(n, ast.Call)]
            self._jax_work[id(fn)] = any(
                self.resolve(c.func).split(".")[0] in ("jax", "optax", "flax") or last_name(c.func) in self.compiled
                or last_name(c.func) in APPLY_METHODS or is_step_name(last_name(c.func)) for c in calls)
        return self._jax_work[id(fn)]

    def is_host_call(self, call: ast.Call) -> bool:
        """A call whose result lives on the host: conversions, numpy, time, device_get, len, print."""
        name = self.resolve(call.func)
        return (name in HOST_BUILTINS or name in HOST_JAX or name.startswith(HOST_NAMESPACES)
                or isinstance(call.func, ast.Attribute) and call.func.attr in SYNC_METHODS
                or bool(set(name_tokens(last_name(call.func))) & HOST_IO_TOKENS))

    def is_logger_call(self, call: ast.Call) -> bool:
        name = self.resolve(call.func)
        return (isinstance(call.func, ast.Attribute) and call.func.attr in LOG_METHODS
                and name.split(".")[0] not in NOT_LOGGERS)

    def callee(self, call: ast.Call) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The one function of this file that `f(...)` or `self.f(...)` calls, or `obj.f(...)` where `obj`
        was last made by a class of this file (`obj = Trainer(...)`); not a transformed one. Read once
        per call (kept here, not on the node: a call in the function it calls would hold that function)."""
        known = self._callees.get(id(call), call)
        if known is call:
            known = self._callees[id(call)] = self._callee(call)
        return known

    def _callee(self, call: ast.Call) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
            name = func.attr
        elif isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
            method = self._method_of_instance(func.value.id, func.attr, call.lineno)
            return method if method is not None and id(method) not in self.transforms else None
        else:
            name = func.id if isinstance(func, ast.Name) else ""
        defs = self.functions.get(name, [])
        return defs[0] if len(defs) == 1 and id(defs[0]) not in self.transforms else None

    def _method_of_instance(self, name: str, method: str, line: int) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        made = self.made_by.get(name, [])
        before = bisect.bisect_left(made, (line,))  # the assignments on earlier lines
        if not before:
            return None
        cls = self.classes.get(made[before - 1][1])
        return next((m for m in cls.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and m.name == method), None) if cls is not None else None

    def is_bare(self, node: ast.AST) -> bool:
        """A name neither imported nor bound in the file (`pmap` in a pasted snippet)."""
        return isinstance(node, ast.Name) and node.id not in self.aliases and node.id not in self.bound_here

    def after_jax_import(self, line: int) -> bool:
        return self.jax_import is not None and line > self.jax_import[0]


def lambda_function(name: str, lam: ast.Lambda) -> ast.FunctionDef:
    """`def name(args): return body` standing for `name = lambda args: body`, at the lambda's place (its
    body is the lambda's own node, so what is found in it points into the file)."""
    fn = ast.FunctionDef(name=name, args=lam.args, body=[ast.Return(lam.body)], decorator_list=[], returns=None)
    ast.copy_location(fn, lam)
    ast.copy_location(fn.body[0], lam.body)
    return fn


# the nodes that may name a transformation: a decorated function, a call
TRANSFORM_SITES = {ast.FunctionDef, ast.AsyncFunctionDef, ast.Call}
# the identifiers a node spells, by node type (the loss-scaling hints are looked for in them)
WORDS = {ast.Name: "id", ast.Attribute: "attr", ast.FunctionDef: "name", ast.AsyncFunctionDef: "name",
         ast.ClassDef: "name", ast.alias: "name", ast.ImportFrom: "module", ast.ExceptHandler: "name"}