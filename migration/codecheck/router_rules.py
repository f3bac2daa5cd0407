"""ROUTER001: a mixture-of-experts router scoring its experts in 16 bits, and where the code scores them.

A router site is a softmax, log-softmax, top-k or sigmoid whose input is a router's (a name or call with
`router` / `routing` in it, or `gate` / `gating` inside a function or class about experts: `moe`, `expert`,
`switch`, `mixture`, ...). Its type is read from what the code says, never guessed: a cast or `dtype=` in the
input itself (`router_logits.astype(jnp.float32)`, `nn.Dense(E, dtype=jnp.bfloat16)(x)`), else the last
assignment of the input's name in the same function, else the `dtype=` of the router layer the class builds
(`self.router = nnx.Linear(..., dtype=jnp.bfloat16)`). A site in bfloat16 or float16 is ROUTER001: the
router's probabilities decide which experts each token reaches and weigh their outputs, and in 16 bits close
scores tie and small ones round away, so the top-k and the balance loss drift from what float32 gives (MaxText,
DeepSeek and Mixtral's reference code score in float32). The migration checklist grades its router item
from these sites (`RouterSite`), a pass only where every site is float32 by the code's own cast."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (assigned_pairs, const_str, dotted, last_name, name_tokens, scope_nodes,
                                             walk)
from migration.codecheck.context import Context
from migration.codecheck.family import RawFinding, RuleFamily
from migration.codecheck.findings import RouterSite

SCORE_CALLS = {"softmax", "log_softmax", "top_k", "approx_max_k", "sigmoid"}
ROUTER_TOKENS = {"router", "routers", "routing", "routed"}
GATE_TOKENS = {"gate", "gates", "gating"}
SCORE_TOKENS = {"logits", "logit", "scores", "score", "probs", "weights"}
EXPERT_TOKENS = {"moe", "expert", "experts", "router", "routing", "switch", "mixture", "mixtral", "gshard", "deepseek"}
HALF = {"bfloat16", "float16", "half", "bf16", "fp16"}
FULL = {"float32", "fp32", "f32", "float64", "single"}
CASTS = {"astype", "asarray", "array", "convert_element_type"}
DTYPE_KEYWORDS = ("dtype", "preferred_element_type")
FOLLOW = 3  # assignments followed back from a site's input, at most


def dtype_word(node: ast.AST | None) -> str | None:
    """"half" or "full" for a dtype written as a name or a string (`jnp.bfloat16`, "float32"), else None."""
    if node is None:
        return None
    word = (const_str(node) or dotted(node)).rsplit(".", 1)[-1].lower()
    return "half" if word in HALF else "full" if word in FULL else None


class RouterRules(RuleFamily):
    def __init__(self, ctx: Context, found: list[RawFinding]):
        super().__init__(ctx, found)
        self.sites: list[RouterSite] = []

    def call(self, node: ast.Call, last: str) -> None:
        if last not in SCORE_CALLS or not (node.args or node.keywords):
            return
        expr = node.args[0] if node.args else node.keywords[0].value
        if self._scored_before(expr, node):
            return  # top_k(softmax(logits)), top_k(probs + bias) of probs = sigmoid(logits): the first is the site
        if not self._router_input(expr, node, sigmoid=last == "sigmoid"):
            return
        kind = self._dtype(expr, node, FOLLOW)
        shown = ast.unparse(expr)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        self.sites.append(RouterSite(self.ctx.filename, node.lineno, last, {"half": "16-bit", "full": "float32"}
                                     .get(kind or "", "not said")))
        if kind == "half":
            self.add(node, "ROUTER001", f"`{last}({shown})` scores the experts in 16 bits")

    def _scored_before(self, expr: ast.AST, at: ast.AST) -> bool:
        """The input holds a score call's result: one nested in it, or a name assigned an expression with one
        (`probs = jax.nn.softmax(logits.astype(jnp.float32)).astype(dtype)`, then `top_k(probs)`)."""
        for n in walk(expr):
            value = self._assigned(n.id, at) if isinstance(n, ast.Name) else n
            if value is not None and any(isinstance(c, ast.Call) and last_name(c.func) in SCORE_CALLS
                                         for c in walk(value)):
                return True
        return False

    # -- is it a router's? -------------------------------------------------------------------------
    def _router_input(self, expr: ast.AST, at: ast.AST, sigmoid: bool) -> bool:
        """A router's input by its own names, or (`logits = self.router(x)`) by what its name was assigned."""
        tokens = _tokens(expr)
        if not tokens & (ROUTER_TOKENS | GATE_TOKENS) and isinstance(expr, ast.Name):
            value = self._assigned(expr.id, at)
            tokens |= _tokens(value) if value is not None else set()
        if tokens & ROUTER_TOKENS:
            return True
        if not tokens & GATE_TOKENS or (sigmoid and not tokens & SCORE_TOKENS):
            return False
        return self._about_experts(at)

    def _about_experts(self, node: ast.AST) -> bool:
        """Inside a function or class whose name is about experts (`MoeLayer`, `route_to_experts`, ...)."""
        parent = self.ctx.parents.get(node)
        while parent is not None:
            if isinstance(parent, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and \
                    set(name_tokens(parent.name)) & EXPERT_TOKENS:
                return True
            parent = self.ctx.parents.get(parent)
        return False

    # -- in which type? --------------------------------------------------------------------------
    def _dtype(self, expr: ast.AST, at: ast.AST, follow: int) -> str | None:
        """"half", "full" or None: the outermost cast or dtype keyword in `expr`, else (a name) its last
        assignment before `at` in the same function, else (a call of a layer the class built) its dtype."""
        said = _said(expr, self._constants())
        if said:
            return said
        if follow <= 0:
            return None
        # only the router's own names are followed (`router_logits`, `gate_scores`): the tokens' activations
        # beside them say nothing of the scores' type (bf16 activations by float32 weights give float32)
        names = [dotted(n) for n in walk(expr) if isinstance(n, (ast.Name, ast.Attribute)) and dotted(n)
                 and set(name_tokens(dotted(n).rsplit(".", 1)[-1])) & (ROUTER_TOKENS | GATE_TOKENS | SCORE_TOKENS)]
        for name in names:
            value = self._assigned(name, at)
            if value is not None:
                return self._dtype(value, value, follow - 1)
        layers = [n.func for n in walk(expr) if isinstance(n, ast.Call)]
        return next((d for d in (self._layer_dtype(f, at) for f in layers) if d), None)

    def _assigned(self, name: str, at: ast.AST) -> ast.AST | None:
        """The value `name` was last assigned before `at` in the same function (None: not there)."""
        scope, line = self._scope(at), getattr(at, "lineno", 0)
        latest: tuple[int, ast.AST] | None = None
        for stmt in scope_nodes(scope) if scope is not None else ():
            if getattr(stmt, "lineno", line) >= line:
                continue
            for target, value in assigned_pairs(stmt):
                if dotted(target) == name and (latest is None or stmt.lineno > latest[0]):
                    latest = (stmt.lineno, value)
        return None if latest is None else latest[1]

    def _layer_dtype(self, func: ast.AST, at: ast.AST) -> str | None:
        """The dtype `self.router = Layer(..., dtype=...)` gives the layer `func` calls, in the enclosing class."""
        attr = dotted(func)
        if not attr.startswith("self.") or not set(name_tokens(attr[5:])) & (ROUTER_TOKENS | GATE_TOKENS):
            return None
        cls = self.ctx.parents.get(at)
        while cls is not None and not isinstance(cls, ast.ClassDef):
            cls = self.ctx.parents.get(cls)
        for n in walk(cls) if cls is not None else ():
            if isinstance(n, (ast.Assign, ast.AnnAssign)) and isinstance(n.value, ast.Call):
                targets = n.targets if isinstance(n, ast.Assign) else [n.target]
                if any(dotted(t) == attr for t in targets):
                    return _keyword_dtype(n.value, self._constants())
        return None

    def _constants(self) -> dict[str, str]:
        """Module-level names bound to a dtype (`COMPUTE = jnp.bfloat16`): "half" or "full" by name."""
        if not hasattr(self, "_module_dtypes"):
            self._module_dtypes = {}
            for stmt in self.ctx.tree.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    word = dtype_word(stmt.value)
                    if word:
                        self._module_dtypes[stmt.targets[0].id] = word
        return self._module_dtypes

    def _scope(self, node: ast.AST) -> ast.AST | None:
        scope = self.ctx.parents.get(node)
        while scope is not None and not isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                                                           ast.Module)):
            scope = self.ctx.parents.get(scope)
        return scope


def _tokens(expr: ast.AST) -> set[str]:
    """The words of the names, attributes and strings in an expression."""
    tokens: set[str] = set()
    for n in walk(expr):
        name = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else \
            const_str(n) if isinstance(n, ast.Constant) else None
        if name:
            tokens.update(name_tokens(name))
    return tokens


def _said(expr: ast.AST, constants: dict[str, str]) -> str | None:
    """The type the expression itself states: the outermost cast (`x.astype(jnp.float32)`,
    `jnp.asarray(x, jnp.bfloat16)`) or `dtype=` / `preferred_element_type=` keyword, in walk order."""
    for n in walk(expr):
        if not isinstance(n, ast.Call):
            continue
        last = last_name(n.func)
        word = _keyword_dtype(n, constants)
        if last in CASTS and n.args and (last == "astype" or len(n.args) > 1):
            word = _word(n.args[-1], constants) or word
        if word:
            return word
    return None


def _word(node: ast.AST, constants: dict[str, str]) -> str | None:
    return dtype_word(node) or (constants.get(node.id) if isinstance(node, ast.Name) else None)


def _keyword_dtype(call: ast.Call, constants: dict[str, str]) -> str | None:
    for k in call.keywords:
        if k.arg in DTYPE_KEYWORDS:
            return _word(k.value, constants)
    return None
