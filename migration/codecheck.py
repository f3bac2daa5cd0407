"""Code check: reads Python source with `ast` (never runs it) and finds what will not carry over
from a TPU-era JAX training script to GPUs, with the replacement to write.

Rules live in one table (`RULES`); each finding carries the line, rule id, severity, message and
replacement. `check_source` takes text, `check_files` paths; both refuse text over `MAX_BYTES`
and text that is not Python with a clear `CodeCheckError`.
"""

from __future__ import annotations

import ast
import dataclasses
from collections.abc import Iterable
from pathlib import Path

MAX_BYTES = 1_000_000
SEVERITIES = ("error", "warning", "info")


@dataclasses.dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    title: str
    replacement: str


RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("TPU001", "error", "TPU-only device selection",
         "select devices without naming the platform: jax.devices() / jax.local_devices(), and place data with "
         "jax.device_put(x, NamedSharding(mesh, P(...)))"),
    Rule("PMAP001", "warning", "pmap (in maintenance mode)",
         "jax.jit over arrays sharded with NamedSharding on a jax.make_mesh mesh (or jax.shard_map for per-device code)"),
    Rule("PMAP002", "warning", "collective under pmap",
         "under jit with a sharded batch, a mean over the global batch is all-reduced by XLA: drop lax.pmean/psum, "
         "or keep them inside jax.shard_map"),
    Rule("REMOVED001", "error", "removed in JAX 0.10",
         "jax.device_put(x, NamedSharding(mesh, P())) to replicate; NamedSharding(mesh, P('data')) to shard"),
    Rule("REMOVED002", "error", "jax.clear_backends was removed",
         "jax.clear_caches() for compiled functions; to give GPU memory back, end the process (run each job in its own)"),
    Rule("ENV001", "error", "JAX/XLA environment set after `import jax`",
         "set XLA_*, JAX_* and CUDA_VISIBLE_DEVICES before the first `import jax` (or in the launching shell): JAX "
         "reads them once, when it initialises"),
    Rule("SYNC001", "warning", "host synchronisation in the training loop",
         "keep per-step metrics on the device and fetch them every N steps (or after the loop); the step then never "
         "waits for the host"),
    Rule("TIME001", "warning", "timing a jitted call without block_until_ready",
         "call .block_until_ready() (or jax.block_until_ready(out)) on the result before reading the clock: JAX "
         "dispatches asynchronously"),
    Rule("TRACE001", "error", "Python control flow on a traced value inside a jitted function",
         "jnp.where for element-wise choices, jax.lax.cond / lax.switch for branches, lax.while_loop / lax.fori_loop "
         "for loops; or mark the argument static (static_argnames)"),
    Rule("SHAPE001", "warning", "batch shapes that vary between steps",
         "drop the last partial batch (drop_remainder=True / drop_last=True) or pad it to the fixed shape with a mask: "
         "every new shape is a new compile"),
    Rule("BATCH001", "warning", "hard-coded TPU-sized batch",
         "size the per-device batch from the GPU's memory (python -m migration plan) and keep the global batch with "
         "gradient accumulation"),
    Rule("FP16001", "warning", "float16 without loss scaling",
         "use bfloat16 where the GPU has it (compute capability 8.0+), or add dynamic loss scaling (scale the loss, "
         "unscale the gradients, skip non-finite updates)"),
    Rule("PREC001", "info", "matmul precision assumption",
         "TPUs run fp32 matmuls in bf16 passes by default, GPUs of compute capability 8.0+ in TF32: set "
         "jax.default_matmul_precision explicitly where numerics depend on it, and check results on both"),
]}


@dataclasses.dataclass(frozen=True)
class Finding:
    file: str
    line: int
    col: int
    rule: str
    severity: str
    message: str
    replacement: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


class CodeCheckError(ValueError):
    """The input cannot be checked (too large, not Python); the message says why."""


ENV_PREFIXES = ("XLA_", "JAX_", "CUDA_VISIBLE_DEVICES", "TF_CPP_", "NCCL_")
SYNC_CALLS = {"float", "int"}
SYNC_ATTRS = {"item", "tolist"}
SYNC_FUNCS = {("np", "asarray"), ("np", "array"), ("numpy", "asarray"), ("numpy", "array"), ("jax", "device_get")}
LOOP_STEP_HINTS = ("step", "train", "update")
STATIC_ATTRS = {"shape", "ndim", "dtype", "size"}


def _dotted(node: ast.AST) -> str:
    """'jax.lax.pmean' for an attribute chain, the name for a Name, '' otherwise."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _last_name(func: ast.AST) -> str:
    """The called name: 'block_until_ready' for `f(x).block_until_ready()`, 'f' for `f()`."""
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _const_str(node: ast.AST | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Checker(ast.NodeVisitor):
    def __init__(self, filename: str, tree: ast.Module):
        self.filename = filename
        self.findings: list[Finding] = []
        self.import_jax_line: int | None = None
        self.loop_depth_in_training: list[bool] = []
        self.jit_params: list[set[str]] = []  # parameters of enclosing jitted functions (traced)
        self.pmap_functions: set[str] = set()
        self.in_pmap = 0
        self.has_loss_scaling = any(
            isinstance(n, ast.Name) and any(k in n.id.lower() for k in ("loss_scale", "lossscale", "dynamicscale", "scaler"))
            or isinstance(n, ast.Attribute) and any(k in n.attr.lower() for k in ("loss_scale", "dynamicscale", "scaler"))
            for n in ast.walk(tree))
        self._collect_pmapped(tree)

    def add(self, node: ast.AST, rule_id: str, message: str) -> None:
        rule = RULES[rule_id]
        self.findings.append(Finding(self.filename, getattr(node, "lineno", 0), getattr(node, "col_offset", 0) + 1,
                                     rule.id, rule.severity, message, rule.replacement))

    # -- helpers -------------------------------------------------------------------------
    def _collect_pmapped(self, tree: ast.Module) -> None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func).split(".")[-1] == "pmap" and node.args:
                if isinstance(node.args[0], ast.Name):
                    self.pmap_functions.add(node.args[0].id)

    @staticmethod
    def _decorator_kind(dec: ast.AST) -> tuple[str | None, set[str]]:
        """('jit'|'pmap'|None, static argument names) for a decorator."""
        call = dec if isinstance(dec, ast.Call) else None
        name = _dotted(call.func if call else dec)
        static: set[str] = set()
        if call and name.split(".")[-1] == "partial" and call.args:
            name = _dotted(call.args[0])
        if call:
            for kw in call.keywords:
                if kw.arg in ("static_argnames",):
                    if isinstance(kw.value, (ast.Tuple, ast.List)):
                        static |= {s for s in (_const_str(e) for e in kw.value.elts) if s}
                    elif _const_str(kw.value):
                        static.add(_const_str(kw.value))
        last = name.split(".")[-1]
        if last in ("jit", "pjit"):
            return "jit", static
        if last == "pmap":
            return "pmap", static
        return None, static

    # -- visitors ------------------------------------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        if any(a.name == "jax" or a.name.startswith("jax.") for a in node.names) and self.import_jax_line is None:
            self.import_jax_line = node.lineno
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and (node.module == "jax" or node.module.startswith("jax.")) and self.import_jax_line is None:
            self.import_jax_line = node.lineno
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        kind, static = None, set()
        for dec in node.decorator_list:
            k, s = self._decorator_kind(dec)
            if k:
                kind, static = k, s
                if k == "pmap":
                    self.add(dec, "PMAP001", f"`{node.name}` is decorated with pmap")
        if node.name in self.pmap_functions:
            kind = kind or "pmap"
        traced = {a.arg for a in node.args.args + node.args.kwonlyargs} - static - {"self"} if kind else None
        if traced is not None:
            self.jit_params.append(traced)
        if kind == "pmap":
            self.in_pmap += 1
        self.generic_visit(node)
        if kind == "pmap":
            self.in_pmap -= 1
        if traced is not None:
            self.jit_params.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _is_training_loop(self, node: ast.For | ast.While) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Call):
                name = _dotted(sub.func).split(".")[-1].lower()
                if any(h in name for h in LOOP_STEP_HINTS):
                    return True
        return False

    def visit_For(self, node: ast.For) -> None:
        self.loop_depth_in_training.append(self._is_training_loop(node))
        self._timing_in_block(node.body)
        self.generic_visit(node)
        self.loop_depth_in_training.pop()

    def visit_While(self, node: ast.While) -> None:
        self._check_traced_test(node, node.test, "while")
        self.loop_depth_in_training.append(self._is_training_loop(node))
        self.generic_visit(node)
        self.loop_depth_in_training.pop()

    def visit_If(self, node: ast.If) -> None:
        self._check_traced_test(node, node.test, "if")
        self.generic_visit(node)

    def _check_traced_test(self, node: ast.AST, test: ast.AST, keyword: str) -> None:
        if not self.jit_params:
            return
        traced = self.jit_params[-1]
        static_uses: set[int] = set()
        for sub in ast.walk(test):
            if isinstance(sub, ast.Attribute) and sub.attr in STATIC_ATTRS:
                static_uses |= {id(n) for n in ast.walk(sub.value)}
            if isinstance(sub, ast.Call) and _dotted(sub.func) in ("isinstance", "len", "hasattr", "callable"):
                static_uses |= {id(n) for n in ast.walk(sub)}
            if isinstance(sub, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot)) for op in sub.ops):
                static_uses |= {id(n) for n in ast.walk(sub)}
        names = [n.id for n in ast.walk(test) if isinstance(n, ast.Name) and n.id in traced and id(n) not in static_uses]
        if names:
            self.add(node, "TRACE001", f"`{keyword}` on `{names[0]}`, a traced argument of a jitted function: "
                                       "it raises a ConcretizationTypeError (or silently specialises) under jit")

    def visit_Call(self, node: ast.Call) -> None:
        name = _dotted(node.func)
        last = name.split(".")[-1]
        # TPU001: devices("tpu") / devices(backend="tpu")
        if last in ("devices", "local_devices", "device_count", "local_device_count"):
            arg = _const_str(node.args[0]) if node.args else None
            arg = arg or next((_const_str(k.value) for k in node.keywords if k.arg == "backend"), None)
            if arg and arg.lower() == "tpu":
                self.add(node, "TPU001", f"`{name}(\"tpu\")` selects TPU devices only: it fails on a GPU machine")
        # PMAP001 / PMAP002
        if last == "pmap" and name in ("pmap", "jax.pmap"):
            self.add(node, "PMAP001", "pmap is in maintenance mode; it replicates by hand what jit + sharding does")
        if last in ("pmean", "psum", "pmax", "pmin", "all_gather") and name.split(".")[0] in ("lax", "jax") and self.in_pmap:
            self.add(node, "PMAP002", f"`{name}` inside a pmapped function")
        # REMOVED001 / REMOVED002
        if last in ("device_put_replicated", "device_put_sharded"):
            self.add(node, "REMOVED001", f"`{name}` was removed in JAX 0.10")
        if last == "clear_backends":
            self.add(node, "REMOVED002", f"`{name}` no longer exists")
        # ENV001 through os.environ.update / setdefault / putenv
        if name in ("os.environ.update", "os.environ.setdefault", "os.putenv") and self._after_import(node):
            keys = [_const_str(node.args[0])] if last in ("setdefault", "putenv") and node.args else \
                [_const_str(k) for a in node.args if isinstance(a, ast.Dict) for k in a.keys] + \
                [k.arg for k in node.keywords]
            bad = [k for k in keys if k and k.startswith(ENV_PREFIXES)]
            if bad:
                self.add(node, "ENV001", f"`{bad[0]}` is set after `import jax` (line {self.import_jax_line})")
        # SYNC001
        if self.loop_depth_in_training and self.loop_depth_in_training[-1]:
            if (name in SYNC_CALLS and node.args and not isinstance(node.args[0], ast.Constant)) \
                    or (isinstance(node.func, ast.Attribute) and node.func.attr in SYNC_ATTRS and not node.args) \
                    or tuple(name.split(".")[-2:]) in SYNC_FUNCS:
                self.add(node, "SYNC001", f"`{name or last}(...)` inside the training loop copies to the host and "
                                          "waits for the device every step")
        # SHAPE001
        if last == "batch" and isinstance(node.func, ast.Attribute):
            if not any(k.arg == "drop_remainder" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords):
                self.add(node, "SHAPE001", "`.batch(...)` without drop_remainder=True yields a smaller last batch")
        if last == "DataLoader":
            if not any(k.arg == "drop_last" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords):
                self.add(node, "SHAPE001", "`DataLoader(...)` without drop_last=True yields a smaller last batch")
        # FP16001 / PREC001
        if name.endswith("default_matmul_precision") or (last == "update" and node.args and
                                                          _const_str(node.args[0]) == "jax_default_matmul_precision"):
            self.add(node, "PREC001", "matmul precision is set here: its default differs between TPU and GPU")
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr == "float16" and _dotted(node.value) in ("jnp", "jax.numpy", "np", "numpy") \
                and not self.has_loss_scaling:
            self.add(node, "FP16001", "float16 is used and the file has no loss scaling")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            # ENV001: os.environ["XLA_FLAGS"] = ...
            if isinstance(target, ast.Subscript) and _dotted(target.value) == "os.environ":
                key = _const_str(target.slice)
                if key and key.startswith(ENV_PREFIXES) and self._after_import(node):
                    self.add(node, "ENV001", f"`{key}` is set after `import jax` (line {self.import_jax_line})")
            # BATCH001
            if isinstance(target, ast.Name) and "batch" in target.id.lower() and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, int) and not isinstance(node.value.value, bool) \
                    and node.value.value >= 512:
                self.add(node, "BATCH001", f"`{target.id} = {node.value.value}`: a TPU-pod-sized batch rarely fits one "
                                           "GPU's memory")
        self.generic_visit(node)

    def _after_import(self, node: ast.AST) -> bool:
        return self.import_jax_line is not None and node.lineno > self.import_jax_line

    def _timing_in_block(self, body: list[ast.stmt]) -> None:
        """TIME001 in a block: `t = time.time()` ... `time.time() - t` with a call between and no sync."""
        clock = ("time.time", "time.perf_counter", "time.monotonic", "perf_counter", "timeit.default_timer")
        for i, stmt in enumerate(body):
            if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and _dotted(stmt.value.func) in clock:
                start = stmt.targets[0].id if isinstance(stmt.targets[0], ast.Name) else None
                between: list[ast.stmt] = []
                for later in body[i + 1:]:
                    reads_clock = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Sub)
                                      and isinstance(n.right, ast.Name) and n.right.id == start
                                      for n in ast.walk(later))
                    if reads_clock:
                        calls = [n for s in between for n in ast.walk(s) if isinstance(n, ast.Call)]
                        synced = any(_last_name(c.func) in ("block_until_ready", "device_get", "float", "item",
                                                                "asarray", "array", "print")
                                     for c in calls)
                        if calls and not synced:
                            self.add(later, "TIME001", "the clock is read after a JAX call without waiting for it: "
                                                       "this measures dispatch, not the computation")
                        break
                    between.append(later)

    def visit_Module(self, node: ast.Module) -> None:
        self._timing_in_block(node.body)
        self.generic_visit(node)


def check_source(text: str, filename: str = "<pasted>") -> list[Finding]:
    """Findings for one Python source text, sorted by line. Never executes it."""
    if len(text.encode("utf-8", errors="replace")) > MAX_BYTES:
        raise CodeCheckError(f"{filename}: {len(text.encode()):,} bytes; the limit is {MAX_BYTES:,} bytes per file")
    try:
        tree = ast.parse(text, filename=filename)
    except SyntaxError as exc:
        raise CodeCheckError(f"{filename}: not valid Python (line {exc.lineno}: {exc.msg}); paste or upload .py source")
    except ValueError as exc:  # e.g. null bytes
        raise CodeCheckError(f"{filename}: not Python source ({exc})")
    checker = _Checker(filename, tree)
    checker.visit(tree)
    for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
        checker._timing_in_block(fn.body)
    unique = {(f.line, f.col, f.rule): f for f in checker.findings}
    return sorted(unique.values(), key=lambda f: (f.file, f.line, f.col, f.rule))


def check_files(paths: Iterable[str | Path]) -> list[Finding]:
    findings: list[Finding] = []
    for path in paths:
        p = Path(path)
        if p.suffix != ".py":
            raise CodeCheckError(f"{p}: only .py files are checked")
        if p.stat().st_size > MAX_BYTES:
            raise CodeCheckError(f"{p}: {p.stat().st_size:,} bytes; the limit is {MAX_BYTES:,} bytes per file")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CodeCheckError(f"{p}: not UTF-8 text; only Python source is checked")
        findings += check_source(text, str(p))
    return findings


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
