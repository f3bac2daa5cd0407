"""The base of the node-local rule families: each family reads the file's `Context` and appends its
findings to one list shared by all, so that findings keep the order in which the visitor meets them."""

from __future__ import annotations

import ast

from migration.codecheck.context import Context

# (node, rule id, message, replacement or None for the rule's own)
RawFinding = tuple[ast.AST, str, str, str | None]


class RuleFamily:
    """A group of rules checked node by node; `Checker` calls its methods as it visits the tree."""

    def __init__(self, ctx: Context, found: list[RawFinding]):
        self.ctx = ctx
        self.found = found

    def add(self, node: ast.AST, rule: str, message: str, replacement: str | None = None) -> None:
        self.found.append((node, rule, message, replacement))
