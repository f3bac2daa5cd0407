"""The visitor that runs the node-local rules: it walks the tree once and hands each node to the rule
families that look at it (device and API rules, tracing and shape rules, settings rules)."""

from __future__ import annotations

import ast
from collections.abc import Callable

from migration.codecheck.ast_helpers import children, last_name
from migration.codecheck.attention_rules import AttentionRules
from migration.codecheck.cloud_rules import CloudRules
from migration.codecheck.context import Context
from migration.codecheck.device_rules import DeviceRules
from migration.codecheck.router_rules import RouterRules
from migration.codecheck.family import RawFinding
from migration.codecheck.settings_rules import SettingsRules
from migration.codecheck.shape_rules import ShapeRules
from migration.codecheck.topology_rules import TopologyRules


class Checker(ast.NodeVisitor):
    """TPU001, PMAP001/002, REMOVED001/002, TRACE001, SHAPE001, BATCH001, FP16001, PREC001, ATTN001 and ROUTER001, in the
    order the nodes are visited (`found`)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.found: list[RawFinding] = []
        self.device = DeviceRules(ctx, self.found)
        self.shape = ShapeRules(ctx, self.found)
        self.settings = SettingsRules(ctx, self.found)
        self.cloud = CloudRules(ctx, self.found)
        self.topology = TopologyRules(ctx, self.found)
        self.attention = AttentionRules(ctx, self.found)
        self.router = RouterRules(ctx, self.found)

    # the walk: NodeVisitor's, dispatching through a table by node type (the class's functions, not bound
    # methods: a checker holding its own methods would be a reference cycle) and over the cached children
    def visit(self, node: ast.AST) -> None:
        method = _DISPATCH.get(node.__class__)
        if method is None:
            method = _method(node.__class__)
        method(self, node)

    def generic_visit(self, node: ast.AST) -> None:
        for child in children(node):  # `visit` inlined: a call less per node
            method = _DISPATCH.get(child.__class__)
            if method is None:
                method = _method(child.__class__)
            method(self, child)

    # imports and names ---------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        self.device.removed_import(node, [a.name for a in node.names])
        self.cloud.imports(node, [a.name for a in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self.device.removed_import(node, [f"{node.module}.{a.name}" for a in node.names])
            self.cloud.imports(node, [f"{node.module}.{a.name}" for a in node.names])

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not isinstance(self.ctx.parents.get(node), ast.Attribute):
            self._name_use(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        # a plain local name resolves to itself, which no rule's dotted names match: only imported names
        # (and a snippet's bare `pmap`) are handed on
        if isinstance(node.ctx, ast.Load) and (node.id in self.ctx.aliases or node.id == "pmap"):
            self._name_use(node)

    def _name_use(self, node: ast.Name | ast.Attribute) -> None:
        self.device.name_use(node)
        self.settings.name_use(node)

    # functions and control flow ----------------------------------------------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self.shape.enter_function(node)
        pmapped = self.device.enter_function(self.ctx.transforms.get(id(node), []))
        self.settings.batch_defaults(node.args)
        self.generic_visit(node)
        self.device.leave_function(pmapped)
        self.shape.leave_function()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        self.shape.check_traced(node, node.test, "if")
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self.shape.check_traced(node, node.test, "while")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self.shape.check_traced(node, node.test, "... if ... else")
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        self.shape.check_traced(node, node.test, "assert")
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        self.shape.for_loop(node)
        self.generic_visit(node)

    # calls, assignments, constants, comparisons -------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = self.ctx.resolve(node.func)
        last = last_name(node.func)
        self.device.call(node, name, last)
        self.shape.call(node, last)
        self.settings.batch_call(node, name, last)
        self.settings.precision(node, name)
        self.cloud.call(node, name)
        self.topology.call(node, last)
        self.attention.call(node, name, last)
        self.router.call(node, last)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        self.cloud.subscript(node)
        self.generic_visit(node)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        self.cloud.string(node)
        for value in node.values:  # its literal parts are not Cloud Storage paths of their own
            if isinstance(value, ast.Constant):
                self.settings.constant(value)
            else:
                self.visit(value)

    def visit_Assign(self, node: ast.Assign) -> None:
        self.settings.assign(node)
        self.topology.assign(node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self.settings.ann_assign(node)
        self.topology.assign(node)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        self.settings.dict_entries(node)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        self.settings.constant(node)
        self.cloud.string(node)

    def visit_Compare(self, node: ast.Compare) -> None:
        self.device.compare(node)
        self.topology.compare(node)
        self.generic_visit(node)


_DISPATCH: dict[type, Callable[[Checker, ast.AST], None]] = {}  # node type -> the Checker function that visits it


def _method(kind: type) -> Callable[[Checker, ast.AST], None]:
    method = _DISPATCH[kind] = getattr(Checker, "visit_" + kind.__name__, Checker.generic_visit)
    return method
