"""What `--fix` may rewrite, without LibCST: the removed names with a drop-in successor (and where an import
of one imports it from now), and the reading of a file the rewrites need (how the file spells a name, which
environment settings can move above the first JAX import). migration/codecheck/rewrite.py applies them."""

from __future__ import annotations

import ast

from migration.codecheck.context import Context

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


def spelling(ctx: Context, full: str) -> str | None:
    """`full` written with the file's own import names ('jax.tree.map' where `import jax`), or None."""
    for local, bound in sorted(ctx.aliases.items(), key=lambda kv: -len(kv[1])):
        if (full == bound or full.startswith(bound + ".")) and local in module_level_names(ctx):
            return local + full[len(bound):]
    return None


def module_level_names(ctx: Context) -> set[str]:
    names = set()
    for stmt in ctx.tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom)):
            names |= {a.asname or a.name.split(".")[0] for a in stmt.names}
    return names


def binds(stmt: ast.stmt) -> set[str]:
    """Names a module-level statement binds."""
    if isinstance(stmt, (ast.Import, ast.ImportFrom)):
        return {a.asname or a.name.split(".")[0] for a in stmt.names}
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    return {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def movable_env_lines(ctx: Context, tree: ast.Module, lines: set[int]) -> tuple[int, set[int]]:
    """(index of the top-level statement holding the first JAX import, first lines of the module-level
    statements flagged ENV001 that can move before it: each reads only names bound before that
    statement and not bound again between it and the flagged one)."""
    line = ctx.jax_import[0] if ctx.jax_import else -1
    index = next((i for i, s in enumerate(tree.body) if s.lineno <= line <= s.end_lineno), -1)
    if index < 0:
        return -1, set()
    available = set().union(*(binds(s) for s in tree.body[:index]))
    movable = set()
    for i, stmt in enumerate(tree.body[index + 1:], index + 1):
        if stmt.lineno in lines and isinstance(stmt, (ast.Assign, ast.AugAssign, ast.Expr)):
            reads = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name)}
            rebound = set().union(*(binds(s) for s in tree.body[index:i]))
            if reads <= available and not reads & rebound:
                movable.add(stmt.lineno)
    return index, movable
