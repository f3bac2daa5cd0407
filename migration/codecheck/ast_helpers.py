"""Small helpers over `ast` nodes: dotted names, constants, assignment targets, the nodes of one scope,
and the naming conventions for training steps and batch sizes."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Sequence

from migration.codecheck.vocabulary import (DTYPE_NAMES, MANY_STEPS_TOKENS, MUTATORS, NOT_SIZE_TOKENS, NOT_STEP_PREFIXES, SCOPES,
                                            SIZE_TOKENS, STATIC_ATTRS, STATIC_FUNCS, STEP_FN_SUFFIXES, STEP_TOKENS)

MAX_FOLDED_BITS = 4096  # integer constants folded beyond this are treated as unknown (`2**64**64**64` is)
NAME_TOKENS_MAX_CHARS = 128  # only this much of an identifier is split into words
WORD = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+")


# The grammar's types that are not nodes (names, strings, numbers, constants), or nodes no rule walks to:
# the operator and load/store markers (`.op`, `.ops`, `.ctx`: shared leaf nodes, read through their field).
NOT_WALKED = {"identifier", "string", "int", "constant", "expr_context", "operator", "cmpop", "boolop", "unaryop"}
# Two lists of nodes may also hold None: `{**a}`'s key, a keyword-only argument without a default.
MAY_HOLD_NONE = {(ast.Dict, "keys"), (ast.arguments, "kw_defaults")}
_DECLARED = re.compile(r"(\w+)[*?]? (\w+)")  # "stmt* body" in a node type's grammar: `ast.If.__doc__`
_LAYOUTS: dict[type, tuple[tuple[str, bool], ...]] = {}


def _layout(cls: type) -> tuple[tuple[str, bool], ...]:
    """(field, whether a list there may hold None) for each field of `cls` that holds nodes, read from the
    type's grammar (`If(expr test, stmt* body, stmt* orelse)`)."""
    declared = {field: kind for kind, field in _DECLARED.findall(cls.__doc__ or "")}
    layout = _LAYOUTS[cls] = tuple((f, (cls, f) in MAY_HOLD_NONE) for f in cls._fields
                                   if declared.get(f) not in NOT_WALKED)
    return layout


def children(node: ast.AST) -> list[ast.AST]:
    """`ast.iter_child_nodes(node)` as a list, less the operator and load/store markers, kept on the node
    after the first call (the rules walk the same subtrees many times, and a tree is never changed once
    parsed)."""
    kids = node.__dict__.get("_kids")
    if kids is None:
        kids = []
        layout = _LAYOUTS.get(node.__class__)
        for field, may_hold_none in _layout(node.__class__) if layout is None else layout:
            value = getattr(node, field, None)
            if value is None:
                continue
            if value.__class__ is list:
                kids += [v for v in value if v is not None] if may_hold_none else value
            else:
                kids.append(value)
        node._kids = kids
    return kids


def walk(node: ast.AST) -> list[ast.AST]:
    """`ast.walk(node)` (the node, then its descendants breadth first) as a new list, from `children`; the
    descendants are kept on the node (the rules walk the same statements and expressions many times), the
    node itself not: a node holding itself would be a reference cycle, and a file's tree is freed as soon
    as it is checked only while it holds none."""
    below = node.__dict__.get("_below")
    if below is None:
        out, i = [node], 0
        while i < len(out):
            current = out[i]
            kids = current.__dict__.get("_kids")
            out.extend(children(current) if kids is None else kids)
            i += 1
        node._below = out[1:]
        return out
    return [node, *below]


def dotted(node: ast.AST) -> str:
    """'jax.lax.pmean' for an attribute chain, the name for a Name, '' otherwise."""
    kind = node.__class__  # the exact node types: a parsed tree holds no subclasses of them
    if kind is ast.Name:
        return node.id
    if kind is not ast.Attribute:
        return ""
    known = node.__dict__.get("_dotted")
    if known is None:
        base = dotted(node.value)
        known = node._dotted = f"{base}.{node.attr}" if base else ""
    return known


def last_name(func: ast.AST) -> str:
    """The called name: 'block_until_ready' for `f(x).block_until_ready()`, 'f' for `f()`."""
    kind = func.__class__
    if kind is ast.Attribute:
        return func.attr
    return func.id if kind is ast.Name else ""


def const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def const_int(node: ast.AST | None) -> int | None:
    """An int literal, or arithmetic on int literals (`4 * 1024`, `1 << 12`, `65536 // 64`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if not isinstance(node, ast.BinOp):
        return None
    a, b = const_int(node.left), const_int(node.right)
    if a is None or b is None:
        return None
    # Each result is bounded before it is computed: pasted arithmetic must never hold the CPU.
    if isinstance(node.op, ast.Pow):
        fits = 0 <= b <= 64 and max(a.bit_length(), 1) * b <= MAX_FOLDED_BITS
        return a ** b if fits else None
    if isinstance(node.op, ast.LShift):
        return a << b if 0 <= b <= 64 and a.bit_length() + b <= MAX_FOLDED_BITS else None
    if isinstance(node.op, ast.Mult):
        return a * b if a.bit_length() + b.bit_length() <= MAX_FOLDED_BITS else None
    if isinstance(node.op, ast.FloorDiv):
        return a // b if b else None
    return {ast.Add: a + b, ast.Sub: a - b}.get(type(node.op))


@functools.lru_cache(maxsize=4096)
def name_tokens(name: str) -> tuple[str, ...]:
    """Lower-case words of an identifier: 'p_trainStep' -> ('p', 'train', 'step')."""
    # A run of capitals backtracks once per character at each start: cut the name first.
    return tuple(t.lower() for t in WORD.findall(name[:NAME_TOKENS_MAX_CHARS]))


def target_names(target: ast.AST) -> list[str]:
    """Assigned names: 'x' for `x = ...`, 'self.state' for `self.state = ...`, all of a tuple."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in target_names(elt)]
    if isinstance(target, ast.Starred):
        return target_names(target.value)
    name = dotted(target)
    return [name] if name else []


ONE_TARGET_WRITES = frozenset((ast.AnnAssign, ast.AugAssign, ast.NamedExpr))


def assigned_pairs(stmt: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs of an assignment; tuple unpacking of a tuple value is paired up."""
    kind = stmt.__class__
    if kind is ast.Assign:
        pairs = [(t, stmt.value) for t in stmt.targets]
    elif kind in ONE_TARGET_WRITES and stmt.value is not None:
        pairs = [(stmt.target, stmt.value)]
    else:
        return []
    out = []
    for target, value in pairs:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            out += list(zip(target.elts, value.elts))
        else:
            out.append((target, value))
    return out


def mutations(stmt: ast.AST) -> list[tuple[str, ast.AST]]:
    """(container, value) for `xs.append(v)` / `.extend` / `.insert` / `.add` and `d[k] = v`."""
    out = []
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in MUTATORS \
            and call.args and dotted(call.func.value):
        out.append((dotted(call.func.value), call.args[-1]))
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    for target in targets if getattr(stmt, "value", None) is not None else []:
        while isinstance(target, ast.Subscript):
            target = target.value
            if dotted(target):
                out.append((dotted(target), stmt.value))
    return out


def stmt_writes(stmt: ast.AST) -> list[tuple[list[str], ast.AST]]:
    """(names, value) for assignments and container mutations of one statement."""
    return [(target_names(t), v) for t, v in assigned_pairs(stmt)] + [([c], v) for c, v in mutations(stmt)]


def iterated_values(target: ast.AST, it: ast.AST, body: Sequence[ast.AST] = ()) -> list[str]:
    """The names of a loop target that receive the iterated values: `v` in `for k, v in d.items()`,
    `x` in `for i, x in enumerate(xs)`, nothing in `for k in d.keys()`, nor `k` in
    `for k in d: ... d[k]` (a key of what is iterated, when `body` indexes it so); every name otherwise."""
    kind = last_name(it.func) if isinstance(it, ast.Call) else ""
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    if kind in ("items", "enumerate") and pair:
        return target_names(target.elts[1])
    if kind == "keys":
        return []
    container = _container_text(it)
    keys = {n.slice.id for root in body for n in walk(root) if isinstance(n, ast.Subscript)
            and isinstance(n.slice, ast.Name) and _container_text(n.value) == container}
    return [n for n in target_names(target) if n not in keys]


def _container_text(node: ast.AST) -> str:
    """`d["a"]` for `d.get("a", [])` and `d.get("a")`, `d` for `d.keys()`, the source text otherwise."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "keys"):
        if node.func.attr == "keys" and not node.args:
            return ast.unparse(node.func.value)
        if node.func.attr == "get" and node.args:
            return ast.unparse(ast.Subscript(node.func.value, node.args[0]))
    return ast.unparse(node)


SCOPE_TYPES = frozenset(SCOPES)


def scope_nodes(scope: ast.AST) -> list[ast.AST]:
    """Nodes of one function (or module) body, not descending into nested functions or classes. Kept on
    the node after the first call: the rules ask for the same scopes many times, and a tree is never
    changed once parsed."""
    cached = scope.__dict__.get("_scope_nodes")
    if cached is None:
        cached, stack = [], list(children(scope))
        while stack:
            node = stack.pop()
            cached.append(node)
            if node.__class__ not in SCOPE_TYPES:
                kids = node.__dict__.get("_kids")
                stack.extend(children(node) if kids is None else kids)
        scope._scope_nodes = cached
    return cached


def child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (bodies, else, handlers, finally, cases); kept on
    the statement after the first call. Not to be changed."""
    blocks = stmt.__dict__.get("_blocks")
    if blocks is None:
        blocks = stmt._blocks = _child_blocks(stmt)
    return blocks


def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    if stmt.__class__ in SCOPE_TYPES:
        return []
    blocks = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in blocks if b and isinstance(b[0], ast.stmt)]


def static_uses(expr: ast.AST) -> set[int]:
    """ids of nodes used only statically: under .shape/.dtype, len()/np.ndim()/isinstance(), and in
    `is` comparisons or comparisons with a string or a dtype (which a traced array never equals)."""
    static: set[int] = set()
    for sub in walk(expr):
        kind = sub.__class__
        if kind is ast.Attribute and sub.attr in STATIC_ATTRS:
            static |= {id(n) for n in walk(sub.value)}
        elif kind is ast.Call and last_name(sub.func) in STATIC_FUNCS:
            static |= {id(n) for n in walk(sub)}
        elif kind is ast.Compare and (any(isinstance(op, (ast.Is, ast.IsNot)) for op in sub.ops)
                                               or any(const_str(c) is not None or dotted(c) and is_dtype(c)
                                                      for c in [sub.left, *sub.comparators])):
            static |= {id(n) for n in walk(sub)}
    return static


def is_dtype(node: ast.AST) -> bool:
    name = const_str(node) or dotted(node)
    return name.rsplit(".", 1)[-1] in DTYPE_NAMES


@functools.lru_cache(maxsize=4096)
def is_step_name(name: str) -> bool:
    """`train_step`, `p_update`, `step_fn`, `train_on_batch`: yes. Classes (`TrainStep`), predicates and
    builders (`is_step`, `make_train_step`), other helpers (`update_metrics`, `count_steps`), and calls
    that run many steps (`train_epoch`, `train_and_evaluate`, `train_loop`): no."""
    tokens = name_tokens(name)
    if not tokens or name.lstrip("_")[:1].isupper() or tokens[0] in NOT_STEP_PREFIXES \
            or MANY_STEPS_TOKENS & set(tokens):
        return False
    core = tokens[:-1] if tokens[-1] in STEP_FN_SUFFIXES else tokens
    return bool(core) and (core[-1] in STEP_TOKENS or core[0] == "train")


def is_batch_size_name(name: str) -> bool:
    """`global_batch`, `BATCH_SIZE`, `per_device_batch`: yes. Counts (`NUM_BATCHES`, `batch_idx`), bounds
    (`max_per_device_batch`, a search limit) and amounts per batch (`tokens_per_batch`): no."""
    tokens = name_tokens(name)
    sizes = [i for i, t in enumerate(tokens) if t in SIZE_TOKENS]
    if not sizes or NOT_SIZE_TOKENS & set(tokens):
        return False
    i = sizes[0]
    return not (i > 0 and tokens[i - 1] == "per" and tokens[i] == "batch")


def bind_arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> dict[str, ast.AST]:
    """Parameter name -> argument expression for a call of `fn` (`self` skipped for `self.method(...)`)."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
        params = params[1:]
    bound = dict(zip(params, (a for a in call.args if not isinstance(a, ast.Starred))))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound

