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
