"""`--fix` and `--diff`: the rewrites that are mechanical and safe, made with LibCST so that comments,
quotes and layout stay as they were (LibCST is the `fix` extra: `pip install .[fix]`; the check itself
needs only the standard library).

- REMOVED001: a removed alias that has a drop-in successor taking the same arguments becomes it
  (`jax.tree_map` -> `jax.tree.map` and the rest of the tree family, `jax.experimental.PartitionSpec`
  -> `jax.sharding.PartitionSpec`, `maps.Mesh` -> `jax.sharding.Mesh`, pjit's
  `with_sharding_constraint` -> `jax.lax`'s, the old array types -> `jax.Array`); an import of one
  (`from jax import tree_map`) imports it from where it lives now under the same local name.
- PJIT001: pjit's removed keywords become `in_shardings` / `out_shardings`.
- ENV001: a module-level `os.environ[...] = ...` after the first JAX import moves to just before it,
  when everything it reads is already bound there.

Only places the check reported are rewritten; everything else keeps its finding and its suggested
change. Fixed counts are findings before less findings after, per rule, from the check itself.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
from collections import Counter

from migration.codecheck.context import Context
from migration.codecheck.engine import analyse
from migration.codecheck.findings import CodeCheckError

FIXABLE = ("REMOVED001", "PJIT001", "ENV001")
# a removed name -> its successor, which takes the same arguments and returns the same thing
RENAMES = {f"jax.tree_{n}": f"jax.tree.{n}" for n in
           ("map", "leaves", "flatten", "unflatten", "structure", "transpose", "reduce")}
RENAMES |= {"jax.tree_multimap": "jax.tree.map", "jax.tree_util.tree_multimap": "jax.tree_util.tree_map",
            "jax.experimental.PartitionSpec": "jax.sharding.PartitionSpec",
            "jax.experimental.pjit.PartitionSpec": "jax.sharding.PartitionSpec",
            "jax.experimental.pjit.with_sharding_constraint": "jax.lax.with_sharding_constraint",
            "jax.experimental.maps.Mesh": "jax.sharding.Mesh", "jax.interpreters.pxla.Mesh": "jax.sharding.Mesh",
            "jax.interpreters.pxla.PartitionSpec": "jax.sharding.PartitionSpec",
            "jax.experimental.pjit.NamedSharding": "jax.sharding.NamedSharding",
            "jax.numpy.round_": "jax.numpy.round", "jax.numpy.product": "jax.numpy.prod",
            "jax.numpy.alltrue": "jax.numpy.all", "jax.numpy.sometrue": "jax.numpy.any",
            "jax.numpy.cumproduct": "jax.numpy.cumprod", "jax.numpy.row_stack": "jax.numpy.vstack",
            "jax.treedef_is_leaf": "jax.tree_util.treedef_is_leaf"}
RENAMES |= dict.fromkeys(("jax.numpy.DeviceArray", "jax.random.KeyArray", "jax.random.PRNGKeyArray",
                          "jax.interpreters.xla.DeviceArray", "jax.interpreters.pxla.ShardedDeviceArray"), "jax.Array")
# what `from <module> import <name>` of a removed name imports instead: (module, name), the local name kept
IMPORT_RENAMES = {old: ("jax.tree_util", "tree_" + new.rsplit(".", 1)[1]) if new.startswith("jax.tree.")
                  else tuple(new.rsplit(".", 1)) for old, new in RENAMES.items()}


@dataclasses.dataclass(frozen=True)
class FixResult:
    path: str
    before: str
    after: str
    fixed: Counter  # rule -> findings that the rewrite removed

    @property
    def changed(self) -> bool:
        return self.before != self.after

    def diff(self) -> str:
        return "".join(difflib.unified_diff(self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
                                            f"a/{self.path}", f"b/{self.path}"))


def libcst():
    try:
        import libcst as cst  # reason: an optional extra, only --fix and --diff need it
    except ImportError:
        raise CodeCheckError("--fix and --diff need LibCST: pip install libcst (or pip install .[fix])") from None
    return cst


def fix_source(text: str, filename: str = "<string>", rules: set[str] | frozenset[str] = frozenset(FIXABLE)
               ) -> FixResult:
    """`text` with the fixable findings of `rules` rewritten, and how many findings that removed per rule."""
    before = [f for f in analyse(text, filename).findings if f.rule in rules]
    targets = [f for f in before if f.rule in FIXABLE]
    if not targets:
        return FixResult(filename, text, text, Counter())
    cst = libcst()
    from migration.codecheck.rewrite import Rewriter  # reason: needs LibCST, an optional extra; see libcst()

    tree = ast.parse(text)
    rewriter = Rewriter(Context(tree, filename), tree, targets)
    after = cst.metadata.MetadataWrapper(cst.parse_module(text)).visit(rewriter).code
    if after != text:
        ast.parse(after)  # a rewrite that does not parse is a defect here, never written to the user's file
    remaining = Counter(f.rule for f in analyse(after, filename).findings if f.rule in FIXABLE)
    fixed = Counter({r: n - remaining[r] for r, n in Counter(f.rule for f in targets).items() if n > remaining[r]})
    return FixResult(filename, text, after, fixed)


def _spelling(ctx: Context, full: str) -> str | None:
    """`full` written with the file's own import names ('jax.tree.map' where `import jax`), or None."""
    for local, bound in sorted(ctx.aliases.items(), key=lambda kv: -len(kv[1])):
        if (full == bound or full.startswith(bound + ".")) and local in _module_level_names(ctx):
            return local + full[len(bound):]
    return None


def _module_level_names(ctx: Context) -> set[str]:
    names = set()
    for stmt in ctx.tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in stmt.names}
    return names


def _binds(stmt: ast.stmt) -> set[str]:
    """Names a module-level statement binds."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {a.asname or a.name.split(".")[0] for a in stmt.names}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _movable_env_lines(ctx: Context, tree: ast.Module, lines: set[int]) -> tuple[int, set[int]]:
    """(index of the top-level statement holding the first JAX import, first lines of the module-level
    statements flagged ENV001 that can move before it: each reads only names bound before that
    statement and not bound again between it and the flagged one)."""
    line = ctx.jax_import[0] if ctx.jax_import else -1
    index = next((i for i, s in enumerate(tree.body) if s.lineno <= line <= s.end_lineno), -1)
    if index < 0:
        return -1, set()
    available = set().union(*(_binds(s) for s in tree.body[:index]))
    movable = set()
    for i, stmt in enumerate(tree.body[index + 1:], index + 1):
        if stmt.lineno in lines and isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr)):
            reads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            rebound = set().union(*(_binds(s) for s in tree.body[index:i]))
            if reads <= available and not reads & rebound:
                movable.add(stmt.lineno)
    return index, movable
