"""The LibCST transformer behind `--fix` (migration/codecheck/fix.py imports this module only when a file
has something to fix, so that the check itself never needs LibCST)."""

from __future__ import annotations

import ast

import libcst as cst
from libcst.metadata import PositionProvider

from migration.codecheck.context import Context
from migration.codecheck.findings import Finding
from migration.codecheck.renames import IMPORT_RENAMES, RENAMES, movable_env_lines, spelling
from migration.codecheck.vocabulary import PJIT_KEYWORDS


def dotted(node) -> str | None:
    """`a.b.c` for a Name or a chain of Attributes, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr.value}" if base else None
    return None


class Rewriter(cst.CSTTransformer):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, ctx: Context, tree: ast.Module, targets: list[Finding]):
        super().__init__()
        self.ctx = ctx
        self.at = {(f.rule, f.line, f.col) for f in targets}
        self.lines = {(f.rule, f.line) for f in targets}
        self.jax_index, self.movable = movable_env_lines(
            ctx, tree, {line for rule, line in self.lines if rule == "ENV001"})

    def _start(self, node) -> tuple[int, int]:
        pos = self.get_metadata(PositionProvider, node).start
        return pos.line, pos.column + 1

    # REMOVED001: names ------------------------------------------------------------
    def leave_Attribute(self, original, updated):
        line, col = self._start(original)
        text = dotted(original)
        if ("REMOVED001", line, col) not in self.at or not text:
            return updated
        root, _, rest = text.partition(".")
        full = ".".join(p for p in (self.ctx.aliases.get(root, root), rest) if p)
        new = spelling(self.ctx, RENAMES[full]) if full in RENAMES else None
        return cst.parse_expression(new) if new else updated

    # REMOVED001: imports, PJIT001 keywords -------------------------------------------
    def leave_SimpleStatementLine(self, original, updated):
        line, _ = self._start(original)
        if ("REMOVED001", line) not in self.lines or len(updated.body) != 1 \
                or not isinstance(updated.body[0], cst.ImportFrom):
            return updated
        statement = updated.body[0]
        module = dotted(statement.module) if statement.module and not statement.relative else None
        if not module or isinstance(statement.names, cst.ImportStar):
            return updated
        kept, moved = [], []
        for alias in statement.names:
            full = f"{module}.{dotted(alias.name)}"
            if full not in IMPORT_RENAMES:
                kept.append(alias)
                continue
            new_module, new_name = IMPORT_RENAMES[full]
            local = alias.asname.name.value if alias.asname else dotted(alias.name)
            as_part = f" as {local}" if local != new_name else ""
            moved.append(cst.parse_statement(f"from {new_module} import {new_name}{as_part}\n"))
        if not moved:
            return updated
        if not kept:
            return cst.FlattenSentinel([moved[0].with_changes(leading_lines=updated.leading_lines), *moved[1:]])
        names = [a.with_changes(comma=cst.MaybeSentinel.DEFAULT) if i == len(kept) - 1 else a
                 for i, a in enumerate(kept)]
        return cst.FlattenSentinel([updated.with_changes(body=[statement.with_changes(names=names)]), *moved])

    def leave_Call(self, original, updated):
        line, _ = self._start(original)
        if ("PJIT001", line) not in self.lines:
            return updated
        args = [a.with_changes(keyword=cst.Name(PJIT_KEYWORDS[a.keyword.value]))
                if a.keyword is not None and a.keyword.value in PJIT_KEYWORDS else a for a in updated.args]
        return updated.with_changes(args=args)

    # ENV001: move before the JAX import ------------------------------------------------
    def visit_Module(self, node) -> bool:
        self.anchor = node.body[self.jax_index] if self.movable else None
        self.anchor_new, self.moved = None, []
        return True

    def on_leave(self, original, updated):
        result = super().on_leave(original, updated)
        if original is self.anchor:
            self.anchor_new = result.nodes[0] if isinstance(result, cst.FlattenSentinel) else result
        elif isinstance(original, cst.SimpleStatementLine) and self._start(original)[0] in self.movable:
            self.moved.append(result.with_changes(leading_lines=[e for e in result.leading_lines if e.comment]))
            return cst.RemovalSentinel.REMOVE
        return result

    def leave_Module(self, original, updated):
        if not self.moved:
            return updated
        body = list(updated.body)
        at = next(i for i, s in enumerate(body) if s is self.anchor_new)
        # the import's blank lines and comments above it now stand above the moved settings
        moved = [self.moved[0].with_changes(leading_lines=[*body[at].leading_lines,
                                                           *self.moved[0].leading_lines]), *self.moved[1:]]
        return updated.with_changes(body=body[:at] + moved + [body[at].with_changes(leading_lines=[])]
                                    + body[at + 1:])
