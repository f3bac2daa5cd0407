"""Analysing files: parse the source, run the node-local rules, the environment rules and the per-scope
walks (SYNC001, TIME001), apply the silencing comments, and collect the facts the checklist grades
from. `check_source` takes text, `check_sources` and `check_paths` return a `CodeCheck`."""

from __future__ import annotations

import ast
import dataclasses
import sys
from collections.abc import Iterable
from pathlib import Path

from migration.codecheck.ast_helpers import SCOPE_TYPES, scope_nodes, walk
from migration.codecheck.checker import Checker
from migration.codecheck.context import Context
from migration.codecheck.env_rules import env_findings, env_writes
from migration.codecheck.family import RawFinding
from migration.codecheck.findings import CodeCheck, CodeCheckError, EnvSetting, Finding, MonitoringUse, RouterSite
from migration.codecheck.ignores import apply_ignores, read_ignores
from migration.codecheck.inputs import read_source, refuse_unreadable
from migration.codecheck.monitoring import monitoring_uses
from migration.codecheck.rules import RULES
from migration.codecheck.sync import direct_step_call, step_loop_syncs
from migration.codecheck.timing import Timing, is_clock, timer_call, timer_names, uses_timer
from migration.codecheck.values import Values
from migration.codecheck.vocabulary import ENV_PREFIXES, FRAMEWORK_EXPERIMENTS, LOOPS


LOOP_TYPES = frozenset(LOOPS)


@dataclasses.dataclass
class FileResult:
    findings: list[Finding]
    env: list[EnvSetting]
    monitoring: list[MonitoringUse]
    uses_jax: bool = False
    routers: list[RouterSite] = dataclasses.field(default_factory=list)


def scope_findings(ctx: Context) -> list[RawFinding]:
    """SYNC001 and TIME001: per scope (the module and each function); none in a file that imports other
    libraries but no JAX (its steps run somewhere else, its values are not device arrays). A snippet
    importing only the standard library, or nothing, is read as JAX code."""
    if not ctx.uses_jax and third_party_imports(ctx.tree):
        return []
    found = []
    functions = ctx.of(ast.FunctionDef, ast.AsyncFunctionDef)
    scopes = [ctx.tree] + sorted(functions, key=lambda n: (n.lineno, n.col_offset))
    timers = timer_names(ctx)
    # the scopes with a loop, a clock read or a timer's call (read from the file's nodes by type): the
    # others have nothing either check looks for, and their nodes are not gathered
    clocked = [n for n in ctx.of(ast.Assign, ast.AnnAssign) if is_clock(ctx, n.value)]
    timer_calls = [n for n in ctx.of(ast.Call) if timer_call(n, timers)] if timers else []
    candidates = {id(scope_of(ctx, n)) for n in ctx.of(*LOOPS) + clocked + timer_calls}
    for scope in scopes:
        framework_loops = framework_step_loop(ctx, scope)
        if id(scope) not in candidates and not framework_loops:
            continue
        nodes = list(scope_nodes(scope))
        loops = [n for n in nodes if n.__class__ in LOOP_TYPES and direct_step_call(ctx, n)]
        loops += framework_loops
        starts = Timing.starts_in(ctx, nodes)
        timed = starts or uses_timer(nodes, timers)
        if not loops and not timed:
            continue
        values = Values(ctx, scope)
        per_loop, gated = [], set()
        for loop in loops:
            syncs, gated_inside = step_loop_syncs(ctx, values, loop, not direct_step_call(ctx, loop, training=True))
            per_loop.append((loop, syncs))
            gated |= gated_inside
        for loop, syncs in per_loop:
            if id(loop) in gated:
                continue  # an evaluation the training loop runs every N steps: not a wait of every step
            where = getattr(loop, "_runs_every_step", None) or f"the step loop at line {loop.lineno}"
            found += [(node, "SYNC001", f"{message} in {where}: the host waits for the device every step", None)
                      for node, message in syncs]
        if timed:
            timing = Timing(ctx, values, scope, starts, nodes)
            found += [(node, "TIME001", message, None) for node, message in timing.found]
    return found


def scope_of(ctx: Context, node: ast.AST) -> ast.AST:
    """The function, class or lambda whose own body holds `node`, else the module."""
    parent = ctx.parents.get(node)
    while parent is not None and parent.__class__ not in SCOPE_TYPES:
        parent = ctx.parents.get(parent)
    return ctx.tree if parent is None else parent


def framework_step_loop(ctx: Context, scope: ast.AST) -> list[ast.While]:
    """A training framework's per-step method read as the body of its loop: jaxline calls an experiment's
    `step` once every training step (`class Experiment(experiment.AbstractExperiment): def step(...)`)."""
    cls = ctx.parents.get(scope)
    if not (isinstance(scope, ast.FunctionDef) and scope.name == "step" and isinstance(cls, ast.ClassDef)
            and any(ctx.resolve(b) in FRAMEWORK_EXPERIMENTS for b in cls.bases)):
        return []
    loop = ast.copy_location(ast.While(test=ast.Constant(True), body=scope.body, orelse=[]), scope)
    loop._runs_every_step = f"`{cls.name}.step`, which jaxline runs every training step"
    return [loop] if direct_step_call(ctx, loop) else []


def third_party_imports(tree: ast.Module) -> set[str]:
    """Top-level packages a file imports from outside the standard library."""
    roots = {a.name.split(".")[0] for n in walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {n.module.split(".")[0] for n in walk(tree) if isinstance(n, ast.ImportFrom) and n.module
              and not n.level}
    return roots - set(sys.stdlib_module_names) - {"__future__"}


def analyse(text: str, filename: str) -> FileResult:
    refuse_unreadable(text, filename)
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError as exc:
        raise CodeCheckError(f"{filename}: not valid Python (line {exc.lineno}: {exc.msg}); paste or upload .py source")
    except ValueError as exc:  # e.g. null bytes
        raise CodeCheckError(f"{filename}: not Python source ({exc})")
    except RecursionError:
        raise CodeCheckError(f"{filename}: expressions nested too deeply to parse")
    # The interpreter's recursion limit is left alone: a server checks code in several threads at once.
    try:
        return analyse_tree(tree, text, filename)
    except RecursionError:
        raise CodeCheckError(f"{filename}: expressions nested too deeply to check (the visitor recurses once "
                             "per nesting level)")


def analyse_tree(tree: ast.Module, text: str, filename: str) -> FileResult:
    ctx = Context(tree, filename)
    checker = Checker(ctx)
    checker.visit(tree)
    writes = env_writes(ctx)
    raw = checker.found + env_findings(ctx, writes) + scope_findings(ctx)
    findings = {}
    for node, rule_id, message, replacement in raw:
        rule = RULES[rule_id]
        f = Finding(filename, getattr(node, "lineno", 0), getattr(node, "col_offset", 0) + 1, rule.id,
                    rule.severity, message, replacement or rule.replacement)
        findings.setdefault((f.line, f.col, f.rule), f)
    kept = apply_ignores(list(findings.values()), read_ignores(text), filename)
    env = [EnvSetting(filename, w.node.lineno, w.name, w.value, not ctx.after_jax_import(w.node.lineno))
           for w in writes if w.name.startswith(ENV_PREFIXES)]
    monitoring = [MonitoringUse(filename, line, call, kind) for line, call, kind in monitoring_uses(ctx)]
    return FileResult(sorted(kept, key=lambda f: (f.file, f.line, f.col, f.rule)), env, monitoring, ctx.uses_jax,
                      checker.router.sites)


def check_source(text: str, filename: str = "<pasted>") -> list[Finding]:
    """Findings for one Python source text, sorted by line. Never executes it."""
    return analyse(text, filename).findings


def check_sources(sources: list[tuple[str, str]]) -> CodeCheck:
    """Findings and facts for [(filename, text)]. Never executes the code."""
    results = [(name, analyse(text, name)) for name, text in sources]
    return CodeCheck(files=tuple(name for name, _ in results),
                     findings=tuple(f for _, r in results for f in r.findings),
                     env_settings=tuple(e for _, r in results for e in r.env),
                     monitoring=tuple(m for _, r in results for m in r.monitoring),
                     jax_files=tuple(name for name, r in results if r.uses_jax),
                     routers=tuple(s for _, r in results for s in r.routers))


def check_paths(paths: Iterable[str | Path]) -> CodeCheck:
    """`check_sources` over files; the same errors as `check_files` (CodeCheckError, OSError)."""
    return check_sources([read_source(p) for p in paths])


def check_files(paths: Iterable[str | Path]) -> list[Finding]:
    """The findings of `check_paths`, sorted by file and line."""
    return list(check_paths(paths).findings)

