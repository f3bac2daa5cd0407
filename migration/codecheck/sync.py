"""SYNC001: host synchronisation in a training loop. Each loop that runs a step is walked in order,
twice: the first pass learns what an iteration leaves behind, the second reports."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (assigned_pairs, bind_arguments, child_blocks, children, iterated_values,
                                             last_name, mutations, name_tokens, scope_nodes, stmt_writes, target_names,
                                             walk)
from migration.codecheck.context import Context
from migration.codecheck.values import Values, host_targets, step_state_names, summary
from migration.codecheck.vocabulary import CLOCKS, ENV_TOKENS, EVAL_TOKENS, INTERVAL_WORDS, LOOPS, SCOPES, TREE_MAPS


def direct_step_call(ctx: Context, loop: ast.AST, training: bool = False) -> bool:
    """Whether the loop body runs a step itself (not only inside a nested loop); with `training`, a
    step that trains (not only `eval_step`, `p_generate_step`, ...)."""
    stack = list(loop.body)
    while stack:
        node = stack.pop()
        kind = node.__class__
        if kind is ast.Call and ctx.is_step_call(node) and not (training and is_eval_step(ctx, node)):
            return True
        if kind not in LOOPS_AND_SCOPES:
            stack.extend(children(node))
    return False


LOOPS_AND_SCOPES = frozenset((*LOOPS, *SCOPES))  # the node types `direct_step_call` does not look into


def is_env_step(call: ast.Call) -> bool:
    """`env.step(action)`, `self.environment.step(...)`: a host environment's step."""
    return isinstance(call.func, ast.Attribute) and call.func.attr == "step" \
        and bool(set(name_tokens(last_name(call.func.value))) & ENV_TOKENS)


def is_eval_step(ctx: Context, call: ast.Call) -> bool:
    """A step that only evaluates, predicts or generates (`p_eval_step`, `generate_step`)."""
    name = last_name(call.func)
    return bool((set(name_tokens(name)) | set(name_tokens(ctx.compiled.get(name, "")))) & EVAL_TOKENS)


class SyncWalk:
    """Walks statements in order, tracking which names hold this iteration's device results
    (`fresh`), which hold earlier ones (`prior`), and whether this iteration's step was
    dispatched. A host conversion of a fresh value, or of a prior one before the step is
    dispatched, waits for the device. Branches under `if step % N == 0:` are the remedy. A
    function of this file called with fresh values is walked too (one level deep)."""

    def __init__(self, ctx: Context, values: Values, counters: set[str], gate_source: ast.AST, depth: int = 0,
                 eval_only: bool = False):
        self.ctx, self.values, self.counters, self.depth = ctx, values, counters, depth
        self.eval_only = eval_only  # an evaluation loop: fetching its outputs to the host is its purpose
        self.clock_names = {n for s in walk(gate_source) if isinstance(s, ast.Assign)
                            and any(isinstance(c, ast.Call) and ctx.resolve(c.func) in CLOCKS for c in walk(s.value))
                            for t in s.targets for n in target_names(t)}
        self.gated_loops: set[int] = set()  # id() of step loops this loop reaches only under a gate
        self.gate_names: set[str] = set()
        self.gate_names = {n for s in walk(gate_source) if isinstance(s, ast.Assign)
                           and self._gate(s.value) == "gate" for t in s.targets for n in target_names(t)}
        self.found: list[tuple[ast.AST, str]] = []

    def scan(self, body: list[ast.stmt], fresh: set[str], prior: set[str], dispatched: bool, report: bool) -> None:
        self.fresh, self.prior, self.dispatched = set(fresh), set(prior), dispatched
        self.report, self.gated = report, False
        self._block(body)

    def _live(self) -> set[str]:
        return self.fresh if self.dispatched else self.fresh | self.prior

    def _flag(self, node: ast.AST, message: str) -> None:
        if self.report and not self.gated:
            self.found.append((node, message))

    # statements --------------------------------------------------------------------------
    def _block(self, stmts: list[ast.stmt]) -> None:
        saved = self.gated
        for stmt in stmts:
            self._stmt(stmt)
        self.gated = saved

    def _stmt(self, stmt: ast.stmt) -> None:
        if isinstance(stmt, SCOPES):
            return
        if isinstance(stmt, ast.If):
            self._if(stmt)
        elif isinstance(stmt, LOOPS):
            self._inner_loop(stmt)
        elif child_blocks(stmt):
            heads = [i.context_expr for i in getattr(stmt, "items", [])] + [getattr(stmt, "subject", None)]
            self._exprs([h for h in heads if h is not None])
            for block in child_blocks(stmt):
                self._block(block)
        else:
            if isinstance(stmt, ast.Assert):
                self._test(stmt.test, stmt)
            self._exprs([stmt])
            self._assign(stmt)

    def _if(self, stmt: ast.If) -> None:
        polarity = self._gate(stmt.test)
        if polarity is None:
            self._test(stmt.test, stmt)
            self._block(stmt.body)
            self._block(stmt.orelse)
            return
        gated, open_ = (stmt.body, stmt.orelse) if polarity == "gate" else (stmt.orelse, stmt.body)
        saved, self.gated = self.gated, True
        self._block(gated)
        self.gated = saved
        self._block(open_)
        if polarity == "anti" and all(isinstance(s, (ast.Continue, ast.Break, ast.Return)) for s in stmt.body):
            self.gated = True  # `if step % N: continue` gates the rest of the block

    def _inner_loop(self, loop: ast.stmt) -> None:
        if direct_step_call(self.ctx, loop):  # checked on its own; here only its results count
            if self.gated:  # an evaluation every N steps: its own waits are paid every N steps
                self.gated_loops.add(id(loop))
            self.dispatched = True
            self.fresh |= {n for s in walk(loop) for names, v in stmt_writes(s) for n in names
                           if self.values.is_device(v, self.values.names)}
            return
        if isinstance(loop, ast.While):
            self._test(loop.test, loop)
        else:
            self._exprs([loop.iter])
            values = iterated_values(loop.target, loop.iter, loop.body)
            for name in target_names(loop.target):
                self._set(name, loop.iter if name in values else ast.Constant(0))
        self._block(loop.body)
        self._block(loop.orelse)

    # expressions -------------------------------------------------------------------------
    def _test(self, test: ast.AST, stmt: ast.AST) -> None:
        if self.values.is_device(test, self._live()):
            self._flag(stmt, "a branch on a device value converts it to a Python bool")

    def _exprs(self, nodes: list[ast.AST]) -> None:
        for root in nodes:  # one finding a statement: the first wait in it is the one that costs
            if self.eval_only and self._collects_outputs(root):
                continue
            live = self.values.comprehension_names(root, self._live())
            flagged = False
            acting = {id(n) for c in walk(root) if c.__class__ is ast.Call and is_env_step(c)
                      for a in c.args + [k.value for k in c.keywords] for n in walk(a)}
            for node in walk(root):
                if id(node) in acting:
                    continue  # `env.step(int(action))`: the host environment needs the action; no remedy
                message = "a conditional expression on a device value converts it to a Python bool" \
                    if isinstance(node, ast.IfExp) and self.values.is_device(node.test, live) \
                    else self.values.sync_message(node, live)
                if message and not flagged:
                    self._flag(node, message)
                    flagged = True
                if isinstance(node, ast.Call) and self.depth == 0 and self.report and not self.gated:
                    self._callee(node, live)

    def _collects_outputs(self, stmt: ast.AST) -> bool:
        """`preds.extend(jax.device_get(ids))`, `outputs.append(np.asarray(logits))`, `predicted =
        tohost(predicted)`: outputs copied out whole to be kept on the host (an evaluation's predictions),
        not a value read to decide or log."""
        values = [v for _, v in mutations(stmt)] + [v for _, v in assigned_pairs(stmt)]
        return any(self._fetched(v) for v in values)

    def _fetched(self, value: ast.AST) -> bool:
        """A copy to the host (`jax.device_get(out)`), a tuple or list of copies, or a tree map over one
        (`jax.tree.map(np.copy, jax.device_get(out))`)."""
        if isinstance(value, (ast.Tuple, ast.List)):
            return bool(value.elts) and all(self._fetched(e) for e in value.elts)
        if not isinstance(value, ast.Call):
            return False
        if self._fetches(value):
            return True
        return self.ctx.resolve(value.func) in TREE_MAPS and any(self._fetched(a) for a in value.args[1:])

    def _fetches(self, call: ast.Call) -> bool:
        name = self.ctx.resolve(call.func)
        fn = self.ctx.callee(call)
        return name == "jax.device_get" or name.startswith("numpy.") \
            or fn is not None and not self.ctx.is_step_call(call) and summary(self.ctx, fn).returns_host

    def _callee(self, call: ast.Call, live: set[str]) -> None:
        """Syncs inside a function of this file that the step loop calls: with this step's values, or
        a step function of this file itself (`def train_step(...): ... return np.array(loss).mean()`)."""
        fn = self.ctx.callee(call)
        if fn is None:
            return
        args = bind_arguments(fn, call)
        seeds = {p for p, arg in args.items() if self.values.is_device(arg, live)}
        values = Values(self.ctx, fn, seed=seeds)
        members = any(n.startswith("self.") for n in values.names)  # `self.state` a step of the class set
        if not seeds and not members and not self.ctx.is_step_call(call):
            return
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        inner = SyncWalk(self.ctx, values, params - seeds, fn, depth=1)
        inner.scan(fn.body, fresh=values.names, prior=set(), dispatched=True, report=True)
        self.found += [(node, f"{message} (in `{fn.name}`, called every step at line {call.lineno})")
                       for node, message in inner.found]

    def _assign(self, stmt: ast.stmt) -> None:
        for target, value in assigned_pairs(stmt):
            host = host_targets(self.ctx, target, value)
            for name in target_names(target):
                self._set(name, ast.Constant(0) if name in host else value)
        for container, value in mutations(stmt):
            if self._is_fresh(value) or self.values.is_device(value, self._all()):
                (self.fresh if self._is_fresh(value) else self.prior).add(container)
        if self._has_step(stmt):
            self.dispatched = True
            self.fresh |= {n for c in walk(stmt) if isinstance(c, ast.Call) and self.ctx.is_step_call(c)
                           for n in step_state_names(c)}

    def _set(self, name: str, value: ast.AST) -> None:
        fresh = self._is_fresh(value)
        device = fresh or self.values.is_device(value, self._all())
        self.fresh.discard(name)
        self.prior.discard(name)
        (self.fresh if fresh else self.prior if device else set()).add(name)

    def _all(self) -> set[str]:
        return self.fresh | self.prior | self.values.names

    def _is_fresh(self, value: ast.AST) -> bool:
        """This step's device result: from a step call (not one of this file's that hands back host
        values), or computed from one."""
        steps = [n for n in walk(value) if isinstance(n, ast.Call) and self.ctx.is_step_call(n)]
        device = any((fn := self.ctx.callee(n)) is None or not summary(self.ctx, fn).returns_host for n in steps)
        return self.values.is_device(value, self.fresh) or device

    def _has_step(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and self.ctx.is_step_call(n) for n in walk(node))

    def _gate(self, test: ast.AST) -> str | None:
        """'gate' when the test holds on a few steps (`step % N == 0`, `step == last`), 'anti' when
        it holds on most (`step % N`, `step % N != 0`), None otherwise."""
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            inner = self._gate(test.operand)
            return {"gate": "anti", "anti": "gate"}.get(inner or "")
        if isinstance(test, ast.Name) and test.id in self.gate_names:
            return "gate"
        if isinstance(test, ast.BinOp) and isinstance(test.op, ast.Mod):
            return "anti"
        if isinstance(test, ast.BoolOp):
            parts = [self._gate(v) for v in test.values]
            if isinstance(test.op, ast.And):
                return "gate" if "gate" in parts else None
            # `step % N == 0 or step == last`; not `... or verbose`, which opens it on every step when set
            return "gate" if all(p == "gate" for p in parts) else None
        if isinstance(test, ast.Call):
            return self._call_gate(test)
        return self._compare_gate(test) if isinstance(test, ast.Compare) else None

    def _call_gate(self, call: ast.Call) -> str | None:
        """`should_log(step)`, `write_summary_every_n_steps(...)`: a function of this file whose returns are
        gates, or one whose name says it decides by the step (`every`, `should_`)."""
        fn = self.ctx.callee(call) if self.depth == 0 else None  # one level deep: functions may call each other
        if fn is not None:
            returns = [n.value for n in scope_nodes(fn) if isinstance(n, ast.Return) and n.value is not None]
            inner = SyncWalk(self.ctx, self.values, {a.arg for a in fn.args.args}, fn, depth=1)
            return "gate" if returns and all(inner._gate(r) == "gate" for r in returns) else None
        tokens = name_tokens(last_name(call.func))
        if "every" in tokens or tokens[:1] == ("should",):
            return "gate"
        return "gate" if self._schedule_call(call) else None

    def _schedule_call(self, call: ast.Call) -> bool:
        """`train_utils.itstime(step, config.log_eval_steps, total_steps)`, `due(step, every=100)`: a call
        of another module's handed the loop's step counter and an interval (an argument whose name says
        steps, every, interval, frequency or period): it decides by the step, as `step % N == 0` does."""
        args = list(call.args) + [k.value for k in call.keywords]
        if not any(isinstance(a, ast.Name) and a.id in self.counters for a in args):
            return False
        words = {w for a in args if not (isinstance(a, ast.Name) and a.id in self.counters)
                 for w in name_tokens(last_name(a))}
        words |= {w for k in call.keywords if k.arg for w in name_tokens(k.arg)}
        return bool(words & INTERVAL_WORDS)

    def _compare_gate(self, test: ast.Compare) -> str | None:
        operands = [test.left, *test.comparators]
        if any(isinstance(o, ast.BinOp) and isinstance(o.op, ast.Mod) for o in operands):
            return {ast.Eq: "gate", ast.NotEq: "anti"}.get(type(test.ops[0]))
        names = {n.id for n in walk(test) if isinstance(n, ast.Name)}
        if isinstance(test.ops[0], ast.Eq) and names & self.counters:
            return "gate"
        if isinstance(test.ops[0], (ast.Gt, ast.GtE, ast.Lt, ast.LtE)) and self._elapsed(test):
            return "gate"  # `time.time() - last_log > 60`: once a minute, not every step
        return None

    def _elapsed(self, test: ast.Compare) -> bool:
        """A comparison of elapsed time: a clock read, or a name the loop sets from one, on either side."""
        return any(isinstance(n, ast.Call) and self.ctx.resolve(n.func) in CLOCKS
                   or isinstance(n, ast.Name) and n.id in self.clock_names for n in walk(test))


def loop_counters(loop: ast.For | ast.AsyncFor | ast.While) -> set[str]:
    """The loop variable and names incremented in the loop (`step += 1`)."""
    counters = set(target_names(loop.target)) if isinstance(loop, (ast.For, ast.AsyncFor)) else set()
    return counters | {n for s in walk(loop) if isinstance(s, ast.AugAssign) for n in target_names(s.target)}


def step_loop_syncs(ctx: Context, values: Values, loop: ast.For | ast.AsyncFor | ast.While,
                    eval_only: bool = False) -> tuple[list, set[int]]:
    """SYNC001 in one loop that runs a step: a first pass learns what an iteration leaves behind. Also the
    step loops nested in it that it runs only under a gate (`if step % N == 0: for batch in eval_data: ...`)."""
    walk = SyncWalk(ctx, values, loop_counters(loop), loop, eval_only=eval_only)
    walk.scan(loop.body, fresh=set(), prior=set(), dispatched=False, report=False)
    walk.scan(loop.body, fresh=set(), prior=walk.fresh | walk.prior, dispatched=False, report=True)
    return walk.found, walk.gated_loops
