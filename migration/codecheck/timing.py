"""TIME001: clock reads around JAX work in one scope, and whether the work was waited for before the
clock was read again."""

from __future__ import annotations

import ast
import builtins

from migration.codecheck.ast_helpers import (bind_arguments, child_blocks, children, dotted, last_name, name_tokens,
                                             scope_nodes, target_names, walk)
from migration.codecheck.context import Context
from migration.codecheck.values import Values, is_wait, summary
from migration.codecheck.vocabulary import CLOCKS, INTERVAL_WORDS, LOOPS, SAVE_METHODS, SCOPES

TIMER_CLASS_WORDS = {"timer", "chrono", "stopwatch"}  # a class whose objects time intervals
TIMER_ENDS = {"tick", "toc", "lap", "stop", "split"}  # a timer's methods that end an interval and read it
TIMER_BLOCKS = {"record_time", "record", "measure", "time"}  # a timer's context managers timing their block


class Timing:
    """Clock reads `t0 = time.perf_counter()` ... `time.perf_counter() - t0` in one scope, and
    whether JAX work dispatched between them was waited for before the second read."""

    def __init__(self, ctx: Context, values: Values, scope: ast.AST, starts: dict[str, list[ast.stmt]],
                 nodes: list[ast.AST]):
        self.ctx, self.values, self.starts = ctx, values, starts
        self.paths: dict[int, list[tuple[list[ast.stmt], int]]] = {}
        self.stmt_of: dict[int, ast.stmt] = {}
        self._index(scope.body, [])
        self.found: list[tuple[ast.AST, str]] = []
        for read in (self._read_stmt(n) for n in nodes):
            if read is not None and self._pending(read[1], read[0], read[2]):
                self.found.append((read[3], "the clock is read after a JAX call without waiting for it: this "
                                            "measures dispatch, not the computation"))
        self._timer_ends(nodes, timer_names(ctx))

    def _timer_ends(self, nodes: list[ast.AST], timers: dict[str, str]) -> None:
        """A timer object's interval closed after unwaited JAX work: `chrono.tick(step)` or
        `tracker.toc('total')` once an iteration (the interval runs from its previous iteration),
        `with tracker.record_time('step'): state = step(...)` (the block), a progress reporter handed a
        clock read each iteration (`report_progress(step, time.time())`)."""
        reported: set[int] = set()
        for node in nodes:
            if isinstance(node, ast.With):
                calls = [i.context_expr for i in node.items if isinstance(i.context_expr, ast.Call)]
                if any(self._timer_call(c, timers) in TIMER_BLOCKS for c in calls) \
                        and self._definitely_pending(node.body):
                    self._report_timer(node, reported)
                continue
            if not isinstance(node, ast.Call):
                continue
            method = self._timer_call(node, timers)
            closes = method in TIMER_ENDS or method == "__call__" and any(is_clock(self.ctx, a) for a in node.args)
            stmt = self.stmt_of.get(id(node))
            if closes and stmt is not None and not child_blocks(stmt):
                around = self._around(stmt)
                if around is None:
                    continue
                owner = dotted(node.func.value) if isinstance(node.func, ast.Attribute) else dotted(node.func)
                # the interval starts at the timer's last call that surely runs (`tic`, `pause`, `resume`)
                restarts = [i for i, s in enumerate(around) if not child_blocks(s) and any(
                    isinstance(c, ast.Call) and owner in (dotted(c.func), dotted(getattr(c.func, "value", None)))
                    for c in walk(s))]
                if self._definitely_pending(around[restarts[-1] + 1:] if restarts else around):
                    self._report_timer(stmt, reported)

    def _report_timer(self, stmt: ast.stmt, reported: set[int]) -> None:
        if id(stmt) not in reported:
            reported.add(id(stmt))
            self.found.append((stmt, "a timer's interval ends after a JAX call without waiting for it: this "
                                     "measures dispatch, not the computation"))

    @staticmethod
    def _timer_call(call: ast.Call, timers: dict[str, str]) -> str | None:
        """'tick' for `chrono.tick(step)` on a timer object, '__call__' for calling a progress reporter."""
        func = call.func
        if isinstance(func, ast.Attribute) and dotted(func.value) in timers:
            return func.attr
        if dotted(func) in timers and timers[dotted(func)] == "reporter":
            return "__call__"
        return None

    def _around(self, stmt: ast.stmt) -> list[ast.stmt] | None:
        """The statements run from `stmt` to `stmt` again one iteration later of the innermost loop around it
        (None outside a loop)."""
        path = self.paths.get(id(stmt))
        if not path:
            return None
        for level in range(len(path) - 1, 0, -1):
            parent_block, parent_i = path[level - 1]
            compound = parent_block[parent_i]
            if isinstance(compound, LOOPS) and path[level][0] is compound.body:
                after = [s for block, i in reversed(path[level:]) for s in block[i + 1:]]
                return after + [s for block, i in path[level:] for s in block[:i]]
        return None

    def _definitely_pending(self, stmts: list[ast.stmt]) -> bool:
        """Whether JAX work dispatched in `stmts` may still run at their end: a wait in a branch taken every
        N steps (`if step % 100 == 0:`), which the last step seldom takes, does not settle work dispatched
        before it; nor does one in a timer's own statements."""
        pending = False
        for stmt in stmts:
            for event in self._definite_events(stmt):
                pending = event == "jax"
        return pending

    def _definite_events(self, stmt: ast.stmt) -> list[str]:
        if isinstance(stmt, SCOPES):
            return []
        if not child_blocks(stmt):
            return self._events(stmt)
        if not (isinstance(stmt, ast.If) and periodic(stmt.test)):
            heads = [n for f in ("test", "iter", "items", "subject") for n in as_list(getattr(stmt, f, None))]
            return [e for h in heads for e in self._events(h)] + [
                e for block in child_blocks(stmt) for s in block for e in self._definite_events(s)]
        events = self._events(stmt.test)
        for block in child_blocks(stmt):  # taken every N steps: its waits settle nothing for the last step
            if self._definitely_pending(block):
                events.append("jax")
        return events

    @staticmethod
    def starts_in(ctx: Context, nodes: list[ast.AST]) -> dict[str, list[ast.stmt]]:
        """Variable -> the statements that assign it a clock reading (`t0 = time.perf_counter()`)."""
        starts: dict[str, list[ast.stmt]] = {}
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and is_clock(ctx, node.value):
                for t in getattr(node, "targets", [getattr(node, "target", None)]):
                    for name in target_names(t):
                        starts.setdefault(name, []).append(node)
        return starts

    def _index(self, block: list[ast.stmt], path: list) -> None:
        for i, stmt in enumerate(block):
            here = path + [(block, i)]
            self.paths[id(stmt)] = here
            for node in [] if isinstance(stmt, SCOPES) else [stmt] if child_blocks(stmt) else scope_nodes(stmt):
                self.stmt_of.setdefault(id(node), stmt)
            for sub in child_blocks(stmt):
                self._index(sub, here)
            if child_blocks(stmt):
                heads = [n for f in ("test", "iter", "items", "subject") for n in as_list(getattr(stmt, f, None))]
                for node in (n for h in heads for n in walk(h)):
                    self.stmt_of.setdefault(id(node), stmt)

    def _latest(self, name: str, before: int) -> ast.stmt | None:
        earlier = [s for s in self.starts.get(name, []) if s.lineno <= before]
        return max(earlier, key=lambda s: s.lineno, default=None)

    def _read_stmt(self, node: ast.AST) -> tuple[ast.stmt, ast.stmt, str, ast.AST] | None:
        """(the statement that reads the clock, the statement that started it, the start's name, where to
        report it: the subtraction when it reads the clock itself, else the statement) for `... - t0`."""
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Name)):
            return None
        stmt = self.stmt_of.get(id(node))
        if stmt is None or node.right.id not in self.starts:
            return None
        if isinstance(node.left, ast.Name):
            stmt = self._latest(node.left.id, stmt.lineno)
        elif not is_clock(self.ctx, node.left):
            return None
        start = self._latest(node.right.id, stmt.lineno - 1) if stmt is not None else None
        where = node if is_clock(self.ctx, node.left) else stmt
        return (stmt, start, node.right.id, where) if start is not None and start is not stmt else None

    def _between(self, start: ast.stmt, end: ast.stmt) -> list[ast.stmt] | None:
        """Statements run after `start` and before `end` (a loop around `end` adds its earlier iterations)."""
        ps, pe = self.paths.get(id(start)), self.paths.get(id(end))
        if not ps or not pe:
            return None
        d = 0
        while d < min(len(ps), len(pe)) and ps[d][0] is pe[d][0] and ps[d][1] == pe[d][1]:
            d += 1
        if d == min(len(ps), len(pe)) or ps[d][0] is not pe[d][0] or ps[d][1] > pe[d][1]:
            return None
        stmts = [s for block, i in reversed(ps[d + 1:]) for s in block[i + 1:]]
        stmts += ps[d][0][ps[d][1] + 1:pe[d][1]]
        for level in range(d + 1, len(pe)):
            parent_block, parent_i = pe[level - 1]
            compound, (block, i) = parent_block[parent_i], pe[level]
            if isinstance(compound, LOOPS) and block is compound.body:
                stmts += compound.body
            stmts += block[:i]
        return stmts

    def _pending(self, start: ast.stmt, end: ast.stmt, name: str) -> bool:
        between = self._between(start, end)
        if not between or self._carried_over_waiting_loop(start, end, name):
            return False
        return self._definitely_pending(between)

    def _carried_over_waiting_loop(self, start: ast.stmt, end: ast.stmt, name: str) -> bool:
        """`t = time.time()` ... `for ...: step(); ...; now = time.time(); rate = n / (now - t); t = now`:
        the start is set again after the read inside the loop around it, and each iteration waits somewhere,
        so from one read to the next the interval holds a whole iteration's work."""
        path = self.paths.get(id(end), [])
        loops = [block[i] for block, i in path if isinstance(block[i], LOOPS)]
        if not loops:
            return False
        loop = loops[-1]
        if start.lineno < end.lineno and any(s is start for s in walk(loop)):
            return False  # started earlier in the same iteration: the interval holds no other iteration
        resets = any(name in target_names(t) for s in walk(loop) if isinstance(s, (ast.Assign, ast.AnnAssign))
                     and s.lineno >= end.lineno for t in getattr(s, "targets", [getattr(s, "target", None)]))
        return resets and "sync" in (e for s in loop.body for e in self._events(s))

    def _events(self, root: ast.AST) -> list[str]:
        """'jax' for work dispatched to the device, 'sync' for a wait, in evaluation order (children first)."""
        events, stack = [], [(root, False)]
        live = self.values.comprehension_names(root, self.values.names)
        while stack:
            node, expanded = stack.pop()
            if isinstance(node, SCOPES):
                continue
            if expanded:
                events += [kind] if (kind := self._event(node, live)) else []
                continue
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(list(children(node))))
        return events

    def _event(self, node: ast.AST, live: set[str]) -> str | None:
        if isinstance(node, ast.JoinedStr):
            return "sync" if self.values.sync_message(node, live) else None
        if not isinstance(node, ast.Call):
            return None
        if is_wait(self.ctx, node) or any(self._waits(arg) for arg in node.args):
            return "sync"
        if last_name(node.func) in SAVE_METHODS and any(self.values.is_device(a, self.values.names) for a in node.args):
            return "sync"  # a checkpoint save copies the device values to the host first
        callee = self.ctx.callee(node)
        if callee is not None:  # a function of this file that waits for what it dispatched or was given
            seed = frozenset(p for p, arg in bind_arguments(callee, node).items()
                             if self.values.is_device(arg, self.values.names))
            if summary(self.ctx, callee, seed).waits:
                return "sync"
        if self.values.sync_message(node, live):
            return "sync"
        if isinstance(node.func, ast.Name) and hasattr(builtins, node.func.id):
            return None  # min(), sum() and friends dispatch nothing themselves
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("items", "keys", "values", "get"):
            return None  # reading a dict of results dispatches nothing
        if isinstance(self.ctx.parents.get(node), ast.Expr) and not self.ctx.is_step_call(node) \
                and not self.ctx.resolve(node.func).startswith(("jax.", "flax.", "optax.")):
            return None  # a callback handed results (`progress_fn(step, metrics)`): it returns nothing to wait for
        return "jax" if self.values.is_device(node, self.values.names) else None


    def _waits(self, fn: ast.AST) -> bool:
        """A function of this file handed to a call (a tree map) that waits."""
        if isinstance(fn, ast.Name):
            defs = self.ctx.functions.get(fn.id, [])
            return len(defs) == 1 and summary(self.ctx, defs[0], frozenset(
                a.arg for a in defs[0].args.args)).waits
        return False


def timer_names(ctx: Context) -> dict[str, str]:
    """Names the file binds to a timer object (`chrono = train_utils.Chrono()`, `utils.TimeTracker()`,
    a `Timer`, a `Stopwatch`): 'timer'; to CLU's progress reporter (`periodic_actions.ReportProgress(...)`):
    'reporter'."""
    cached = ctx.summaries.get(("timers",))
    if cached is not None:
        return cached
    found: dict[str, str] = {}
    ctx.summaries[("timers",)] = found
    for node in ctx.of(ast.Assign):
        if not isinstance(node.value, ast.Call):
            continue
        words = set(name_tokens(last_name(node.value.func)))
        kind = "reporter" if words >= {"report", "progress"} else "timer" if words & TIMER_CLASS_WORDS or \
            words >= {"time", "tracker"} else None
        if kind:
            found.update((name, kind) for t in node.targets for name in target_names(t))
    return found


def periodic(test: ast.AST) -> bool:
    """A test that holds every N steps: `step % N == 0`, `should_log(step)`, `every_n(step)`, or another
    module's schedule handed an interval (`itstime(step, config.log_steps)`)."""
    for node in walk(test):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            return True
        if isinstance(node, ast.Call):
            words = set(name_tokens(last_name(node.func)))
            args = [w for a in node.args for w in name_tokens(last_name(a))]
            if "every" in words or "should" in words or set(args) & INTERVAL_WORDS:
                return True
    return False


def uses_timer(nodes: list[ast.AST], timers: dict[str, str]) -> bool:
    """Whether a scope's nodes call a timer object or a progress reporter (`timer_names`)."""
    return bool(timers) and any(isinstance(n, ast.Call) and timer_call(n, timers) for n in nodes)


def timer_call(call: ast.Call, timers: dict[str, str]) -> bool:
    """`chrono.pause()`, `report_progress(step)`: a call of a timer object or progress reporter."""
    return dotted(call.func) in timers or isinstance(call.func, ast.Attribute) and dotted(call.func.value) in timers


def is_clock(ctx: Context, node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and ctx.resolve(node.func) in CLOCKS


def as_list(value) -> list:
    if value is None:
        return []
    return [getattr(v, "context_expr", v) for v in value] if isinstance(value, list) else [value]

