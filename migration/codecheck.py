"""Code check: reads Python source with `ast` (never runs it) and finds what will not carry over
from a TPU-era JAX training script to GPUs, with the replacement to write.

Rules live in one table (`RULES`); each finding carries the line, rule id, severity, message and
replacement. `check_source` takes text, `check_files` paths; both refuse text over `MAX_BYTES`
and text that is not Python with a clear `CodeCheckError`. `check_sources` and `check_paths` return
a `CodeCheck`: the findings plus the facts the migration checklist grades from the user's code:
where JAX/XLA environment variables are set (`EnvSetting`) and where device memory or utilisation
is read (`MonitoringUse`).

A finding is silenced by a comment on its line, `# migration: ignore[RULE1, RULE2] reason`, where
the reason has at least `MIN_REASON_WORDS` words. A silencing comment without a reason silences
nothing and is itself reported (IGNORE001).
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import io
import re
import tokenize
from collections.abc import Iterable, Iterator
from pathlib import Path

MAX_BYTES = 1_000_000
MAX_SOURCE_BYTES = MAX_BYTES  # per file, pasted or uploaded: every entry point refuses more
MAX_FILES = 20  # files in one check from the app (a paste and uploads)
SEVERITIES = ("error", "warning", "info")
MIN_REASON_WORDS = 3


@dataclasses.dataclass(frozen=True)
class Rule:
    id: str
    severity: str
    title: str
    replacement: str


RULES: dict[str, Rule] = {r.id: r for r in [
    Rule("TPU001", "error", "TPU-only device selection",
         "select devices without naming the platform: jax.devices() / jax.local_devices(), and place data with "
         "jax.device_put(x, NamedSharding(mesh, P(...))); leave JAX_PLATFORMS unset (or list the GPU platform)"),
    Rule("PMAP001", "warning", "pmap (in maintenance mode)",
         "jax.jit over arrays sharded with NamedSharding on a jax.make_mesh mesh (or jax.shard_map for per-device code)"),
    Rule("PMAP002", "warning", "collective under pmap",
         "under jit with a sharded batch, a mean over the global batch is all-reduced by XLA: drop lax.pmean/psum, "
         "or keep them inside jax.shard_map"),
    Rule("REMOVED001", "error", "removed from JAX (absent in JAX 0.10)",
         "the replacement the finding names; for device_put_replicated / device_put_sharded: "
         "jax.device_put(x, NamedSharding(mesh, P())) to replicate, NamedSharding(mesh, P('data')) to shard"),
    Rule("REMOVED002", "error", "jax.clear_backends was removed",
         "jax.clear_caches() for compiled functions; to give GPU memory back, end the process (run each job in its own)"),
    Rule("ENV001", "error", "JAX/XLA environment set after `import jax`",
         "set XLA_*, JAX_* and CUDA_VISIBLE_DEVICES before the first `import jax` (or in the launching shell): JAX "
         "reads them once, when it initialises"),
    Rule("SYNC001", "warning", "host synchronisation in the training loop",
         "keep per-step metrics on the device and fetch them every N steps (inside `if step % N == 0:`) or after "
         "the loop; the step then never waits for the host"),
    Rule("TIME001", "warning", "timing a jitted call without block_until_ready",
         "call .block_until_ready() (or jax.block_until_ready(out)) on the result before reading the clock: JAX "
         "dispatches asynchronously"),
    Rule("TRACE001", "error", "Python control flow on a traced value inside a jitted function",
         "jnp.where for element-wise choices, jax.lax.cond / lax.switch for branches, lax.while_loop / lax.fori_loop "
         "for loops; or mark the argument static (static_argnames / static_argnums)"),
    Rule("SHAPE001", "warning", "batch shapes that vary between steps",
         "drop the last partial batch (drop_remainder=True / drop_last=True) or pad it to the fixed shape with a mask: "
         "every new shape is a new compile"),
    Rule("BATCH001", "warning", "hard-coded TPU-sized batch",
         "size the per-device batch from the GPU's memory (python -m migration plan) and keep the global batch with "
         "gradient accumulation"),
    Rule("FP16001", "warning", "float16 without loss scaling",
         "use bfloat16 where the GPU has it (compute capability 8.0+), or add dynamic loss scaling (scale the loss, "
         "unscale the gradients, skip non-finite updates)"),
    Rule("PREC001", "info", "matmul precision left to the platform default",
         "state the precision the numerics need: jax.config.update('jax_default_matmul_precision', 'float32') or "
         "`with jax.default_matmul_precision('float32'):` (TPUs default to bf16 passes, GPUs of compute capability "
         "8.0+ to TF32), and compare results on both"),
    Rule("IGNORE001", "info", "ignore comment without a reason",
         f"say why the finding stays, after the rule list: `# migration: ignore[RULE] reason` with at least "
         f"{MIN_REASON_WORDS} words"),
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


@dataclasses.dataclass(frozen=True)
class EnvSetting:
    """One place where the code sets an XLA_/JAX_/CUDA_VISIBLE_DEVICES/TF_CPP_/NCCL_ variable."""
    file: str
    line: int
    name: str            # e.g. XLA_PYTHON_CLIENT_PREALLOCATE
    value: str | None    # the constant assigned, or None when it is not a literal (or is appended to)
    before_import: bool  # set before the first `import jax` of that file (or the file imports no JAX)


@dataclasses.dataclass(frozen=True)
class MonitoringUse:
    """One read of device memory or utilisation (or a profiler / monitoring hook)."""
    file: str
    line: int
    call: str            # e.g. "memory_stats", "pynvml.nvmlDeviceGetMemoryInfo", "jax.profiler.trace", "nvidia-smi"


@dataclasses.dataclass(frozen=True)
class CodeCheck:
    files: tuple[str, ...]
    findings: tuple[Finding, ...]
    env_settings: tuple[EnvSetting, ...]
    monitoring: tuple[MonitoringUse, ...]

    def to_dict(self) -> dict:
        return {"files": list(self.files),
                "findings": [f.to_dict() for f in self.findings],
                "env_settings": [dataclasses.asdict(e) for e in self.env_settings],
                "monitoring": [dataclasses.asdict(m) for m in self.monitoring]}

    @classmethod
    def from_dict(cls, d) -> CodeCheck:
        return cls(files=tuple(d.get("files", ())),
                   findings=tuple(Finding(**f) for f in d.get("findings", ())),
                   env_settings=tuple(EnvSetting(**e) for e in d.get("env_settings", ())),
                   monitoring=tuple(MonitoringUse(**m) for m in d.get("monitoring", ())))


class CodeCheckError(ValueError):
    """The input cannot be checked (too large, not Python); the message says why."""


# -- vocabulary ------------------------------------------------------------------------------
ENV_PREFIXES = ("XLA_", "JAX_", "CUDA_VISIBLE_DEVICES", "TF_CPP_", "NCCL_")
JAX_IMPORTERS = {"jax", "jaxlib", "flax", "optax", "orbax", "chex", "haiku", "equinox", "jmp"}
DEFAULT_ALIASES = {"jnp": "jax.numpy", "np": "numpy", "lax": "jax.lax"}
CLOCKS = {"time.time", "time.time_ns", "time.perf_counter", "time.perf_counter_ns", "time.monotonic",
          "time.monotonic_ns", "timeit.default_timer", "datetime.datetime.now", "datetime.datetime.utcnow"}
COMPILE_TRANSFORMS = {"jit", "pjit", "pmap", "xmap", "shard_map", "vmap", "checkpoint", "remat", "custom_jvp",
                      "custom_vjp"}
GRAD_TRANSFORMS = {"grad", "value_and_grad", "jacfwd", "jacrev", "hessian"}
CONTROL_FLOW = {"scan", "fori_loop", "while_loop", "cond", "switch", "map", "associative_scan"}
BARE_TRANSFORMS = {"jit", "pjit", "pmap", "xmap", "vmap", "grad", "value_and_grad", "shard_map"}
COLLECTIVES = {"pmean", "psum", "pmax", "pmin", "all_gather", "ppermute", "all_to_all", "psum_scatter"}
STEP_TOKENS = {"step", "train", "update"}
COMPUTE_NAMESPACES = ("jax.numpy.", "jax.lax.", "jax.random.", "jax.nn.", "jax.scipy.", "jax.image.", "optax.",
                      "jax.device_put")
HOST_BUILTINS = {"float", "int", "bool", "str", "repr", "complex", "format", "round", "len", "range", "enumerate",
                 "zip", "print", "isinstance", "issubclass", "hasattr", "type", "id", "hash", "open", "sorted"}
HOST_NAMESPACES = ("numpy.", "math.", "time.", "os.", "json.", "logging.", "random.", "statistics.")
HOST_JAX = {"jax.device_get", "jax.devices", "jax.local_devices", "jax.device_count", "jax.local_device_count",
            "jax.process_index", "jax.process_count", "jax.default_backend"}
CONVERSIONS = {"float", "int", "bool", "str", "repr", "complex", "format", "round"}
SYNC_METHODS = {"item", "tolist"}
WAIT_METHODS = {"block_until_ready", "wait_until_finished"}
AOT_METHODS = {"lower", "compile", "trace", "eval_shape", "cost_analysis", "memory_analysis", "as_text"}
LOG_METHODS = {"info", "debug", "warning", "warn", "error", "critical", "log", "scalar", "scalars", "add_scalar",
               "add_scalars", "write_scalars", "log_metrics", "set_postfix", "set_description"}
NOT_LOGGERS = {"jax", "numpy", "math", "torch", "tensorflow", "scipy", "optax", "flax"}
STATIC_ATTRS = {"shape", "ndim", "dtype", "size", "sharding", "weak_type"}
STATIC_FUNCS = {"isinstance", "len", "hasattr", "callable", "type", "getattr", "ndim", "shape", "size", "iscomplexobj",
                "isrealobj", "issubdtype", "result_type"}
DEVICE_QUERIES = {"devices", "local_devices", "device_count", "local_device_count", "get_backend"}
PLATFORM_KEYS = {"jax_platform_name", "jax_platforms"}
PLATFORM_ENV = {"JAX_PLATFORMS", "JAX_PLATFORM_NAME"}
PLATFORM_ATTRS = {"platform", "device_kind"}
CONFIG_TOKENS = {"args", "arg", "config", "cfg", "conf", "flags", "opts", "options", "hparams", "hps", "settings"}
LOW_PRECISION = {"bfloat16", "fastest", "default"}
BATCH_MIN = 512
SIZE_TOKENS = {"batch", "batchsize", "bs", "bsz"}
NOT_SIZE_TOKENS = {"num", "n", "nb", "count", "cnt", "idx", "index", "id", "ids", "i", "step", "steps", "every",
                   "freq", "interval", "no", "max", "min", "limit", "cap", "threshold"}
NOT_STEP_PREFIXES = {"is", "has", "should", "can", "make", "build", "create", "get"}
STEP_FN_SUFFIXES = {"fn", "func", "function", "impl"}
HALF_DTYPES = {"jax.numpy.float16", "numpy.float16", "jax.numpy.half", "numpy.half"}
DTYPE_NAMES = {"float16", "float32", "float64", "bfloat16", "half", "single", "double", "int8", "int16", "int32",
               "int64", "uint8", "uint16", "uint32", "uint64", "bool_", "complex64", "complex128"}
LOSS_SCALING_HINTS = ("loss_scal", "lossscal", "dynamic_scale", "dynamicscale", "gradscaler", "grad_scaler")
LOOPS = (ast.For, ast.AsyncFor, ast.While)
MUTATORS = {"append", "extend", "insert", "add", "appendleft"}
APPLY_METHODS = {"apply", "apply_fn", "apply_gradients", "apply_updates", "value_and_grad"}
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
REMOVED = {
    "jax.device_put_replicated": "jax.device_put(x, NamedSharding(mesh, P())) to replicate",
    "jax.device_put_sharded": "jax.device_put(x, NamedSharding(mesh, P('data'))) to shard along the mesh",
    "jax.tree_map": "jax.tree.map", "jax.tree_multimap": "jax.tree.map", "jax.tree_leaves": "jax.tree.leaves",
    "jax.tree_flatten": "jax.tree.flatten", "jax.tree_unflatten": "jax.tree.unflatten",
    "jax.tree_structure": "jax.tree.structure", "jax.tree_transpose": "jax.tree.transpose",
    "jax.tree_reduce": "jax.tree.reduce", "jax.tree_util.tree_multimap": "jax.tree.map",
    "jax.xla_computation": "jax.jit(f).lower(*args).compiler_ir()",
    "jax.experimental.maps": "jax.shard_map for xmap; jax.make_mesh (or jax.sharding.Mesh) for Mesh",
    "jax.experimental.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.experimental.optimizers": "optax", "jax.experimental.stax": "flax.linen (or jax.example_libraries.stax)",
    "jax.experimental.host_callback": "jax.debug.callback or jax.experimental.io_callback",
    "jax.experimental.global_device_array": "jax.Array built with jax.make_array_from_callback",
    "jax.ops.index_update": "x.at[idx].set(y)", "jax.ops.index_add": "x.at[idx].add(y)", "jax.ops.index": "x.at[idx]",
    "jax.random.KeyArray": "jax.Array (keys from jax.random.key)", "jax.numpy.DeviceArray": "jax.Array",
    "jax.interpreters.xla.DeviceArray": "jax.Array", "jax.lib.xla_bridge": "jax.default_backend() / jax.devices()",
    "jax.sharding.PositionalSharding": "NamedSharding(mesh, P(...))", "flax.optim": "optax",
    "jax.experimental.pjit.with_sharding_constraint": "jax.lax.with_sharding_constraint",
    "jax.experimental.pjit.PartitionSpec": "jax.sharding.PartitionSpec",
    "jax.interpreters.pxla.ShardedDeviceArray": "jax.Array", "jax.random.PRNGKeyArray": "jax.Array",
    "jax.abstract_arrays": "jax.core.ShapedArray", "jax.lax.tie_in": "nothing: drop the call (a no-op since 2020)",
    "jax.experimental.gda_serialization": "orbax.checkpoint", "jax.experimental.enable_x64":
        "jax.config.update('jax_enable_x64', True)",
}
# Every quantifier is bounded, so a search costs at most a few hundred steps per character of a
# comment, whatever is pasted (an unbounded `[^\]]*` made a long line of repeated openings quadratic).
IGNORE_COMMENT = re.compile(r"#[ \t]{0,16}migration:[ \t]{0,16}ignore\[([^\]\n]{0,256})\]([^#\n]{0,512})")
MAX_FOLDED_BITS = 4096  # integer constants folded beyond this are treated as unknown (`2**64**64**64` is)
NAME_TOKENS_MAX_CHARS = 128  # only this much of an identifier is split into words


# -- small AST helpers ----------------------------------------------------------------------
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


def _const_int(node: ast.AST | None) -> int | None:
    """An int literal, or arithmetic on int literals (`4 * 1024`, `1 << 12`, `65536 // 64`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return node.value
    if not isinstance(node, ast.BinOp):
        return None
    a, b = _const_int(node.left), _const_int(node.right)
    if a is None or b is None:
        return None
    # Each result is bounded before it is computed: pasted arithmetic must never hold the CPU.
    if isinstance(node.op, ast.Pow):
        fits = 0 <= b <= 64 and max(a.bit_length(), 1) * b <= MAX_FOLDED_BITS
        return a ** b if fits else None
    if isinstance(node.op, ast.LShift):
        return a << b if 0 <= b <= 64 and a.bit_length() + b <= MAX_FOLDED_BITS else None
    if isinstance(node.op, ast.Mult):
        return a * b if a.bit_length() + b.bit_length() <= MAX_FOLDED_BITS else None
    if isinstance(node.op, ast.FloorDiv):
        return a // b if b else None
    return {ast.Add: a + b, ast.Sub: a - b}.get(type(node.op))


def _tokens(name: str) -> list[str]:
    """Lower-case words of an identifier: 'p_trainStep' -> ['p', 'train', 'step']."""
    # A run of capitals backtracks once per character at each start: cut the name first.
    return [t.lower() for t in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name[:NAME_TOKENS_MAX_CHARS])]


def _target_names(target: ast.AST) -> list[str]:
    """Assigned names: 'x' for `x = ...`, 'self.state' for `self.state = ...`, all of a tuple."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in _target_names(elt)]
    if isinstance(target, ast.Starred):
        return _target_names(target.value)
    dotted = _dotted(target)
    return [dotted] if dotted else []


def _assigned_pairs(stmt: ast.AST) -> list[tuple[ast.AST, ast.AST]]:
    """(target, value) pairs of an assignment; tuple unpacking of a tuple value is paired up."""
    if isinstance(stmt, ast.Assign):
        pairs = [(t, stmt.value) for t in stmt.targets]
    elif isinstance(stmt, (ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and stmt.value is not None:
        pairs = [(stmt.target, stmt.value)]
    else:
        return []
    out = []
    for target, value in pairs:
        if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple) and len(target.elts) == len(value.elts):
            out += list(zip(target.elts, value.elts))
        else:
            out.append((target, value))
    return out


def _mutations(stmt: ast.AST) -> list[tuple[str, ast.AST]]:
    """(container, value) for `xs.append(v)` / `.extend` / `.insert` / `.add` and `d[k] = v`."""
    out = []
    call = stmt.value if isinstance(stmt, ast.Expr) else None
    if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr in MUTATORS \
            and call.args and _dotted(call.func.value):
        out.append((_dotted(call.func.value), call.args[-1]))
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
    for target in targets if getattr(stmt, "value", None) is not None else []:
        while isinstance(target, ast.Subscript):
            target = target.value
            if _dotted(target):
                out.append((_dotted(target), stmt.value))
    return out


def _writes(stmt: ast.AST) -> list[tuple[list[str], ast.AST]]:
    """(names, value) for assignments and container mutations of one statement."""
    return [(_target_names(t), v) for t, v in _assigned_pairs(stmt)] + [([c], v) for c, v in _mutations(stmt)]


def _iterated_values(target: ast.AST, it: ast.AST) -> list[str]:
    """The names of a loop target that receive the iterated values: `v` in `for k, v in d.items()`,
    `x` in `for i, x in enumerate(xs)`, nothing in `for k in d.keys()`, every name otherwise."""
    kind = _last_name(it.func) if isinstance(it, ast.Call) else ""
    pair = isinstance(target, ast.Tuple) and len(target.elts) == 2
    if kind in ("items", "enumerate") and pair:
        return _target_names(target.elts[1])
    return [] if kind == "keys" else _target_names(target)


def _scope_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """Nodes of one function (or module) body, not descending into nested functions or classes."""
    stack = list(ast.iter_child_nodes(scope))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, SCOPES):
            stack.extend(ast.iter_child_nodes(node))


def _child_blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    """The statement lists nested in a compound statement (bodies, else, handlers, finally, cases)."""
    if isinstance(stmt, SCOPES):
        return []
    blocks = [getattr(stmt, f) for f in ("body", "orelse", "finalbody") if isinstance(getattr(stmt, f, None), list)]
    blocks += [h.body for h in getattr(stmt, "handlers", [])]
    blocks += [c.body for c in getattr(stmt, "cases", [])]
    return [b for b in blocks if b and isinstance(b[0], ast.stmt)]


def _static_uses(expr: ast.AST) -> set[int]:
    """ids of nodes used only statically: under .shape/.dtype, len()/np.ndim()/isinstance(), and in
    `is` comparisons or comparisons with a string or a dtype (which a traced array never equals)."""
    static: set[int] = set()
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Attribute) and sub.attr in STATIC_ATTRS:
            static |= {id(n) for n in ast.walk(sub.value)}
        elif isinstance(sub, ast.Call) and _last_name(sub.func) in STATIC_FUNCS:
            static |= {id(n) for n in ast.walk(sub)}
        elif isinstance(sub, ast.Compare) and (any(isinstance(op, (ast.Is, ast.IsNot)) for op in sub.ops)
                                               or any(_const_str(c) is not None or _dotted(c) and _is_dtype(c)
                                                      for c in [sub.left, *sub.comparators])):
            static |= {id(n) for n in ast.walk(sub)}
    return static


def _is_step_name(name: str) -> bool:
    """`train_step`, `p_update`, `step_fn`, `train_on_batch`: yes. Classes (`TrainStep`), predicates and
    builders (`is_step`, `make_train_step`), other helpers (`update_metrics`, `count_steps`): no."""
    tokens = _tokens(name)
    if not tokens or name.lstrip("_")[:1].isupper() or tokens[0] in NOT_STEP_PREFIXES:
        return False
    core = tokens[:-1] if tokens[-1] in STEP_FN_SUFFIXES else tokens
    return bool(core) and (core[-1] in STEP_TOKENS or core[0] == "train")


def _is_batch_size_name(name: str) -> bool:
    """`global_batch`, `BATCH_SIZE`, `per_device_batch`: yes. Counts (`NUM_BATCHES`, `batch_idx`), bounds
    (`max_per_device_batch`, a search limit) and amounts per batch (`tokens_per_batch`): no."""
    tokens = _tokens(name)
    sizes = [i for i, t in enumerate(tokens) if t in SIZE_TOKENS]
    if not sizes or NOT_SIZE_TOKENS & set(tokens):
        return False
    i = sizes[0]
    return not (i > 0 and tokens[i - 1] == "per" and tokens[i] == "batch")


# -- file-wide facts ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Transform:
    """How one function is transformed: which of its arguments are traced."""
    kind: str                              # "compile" | "grad" | "control"
    pmap: bool = False
    static_names: frozenset[str] = frozenset()
    static_nums: frozenset[int] = frozenset()
    argnums: frozenset[int] | None = None  # grad: the differentiated positions
    bound: bool = False                    # applied to `obj.method`: positions skip `self`

    def traced(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
        positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
        offset = 1 if self.bound and positional[:1] in (["self"], ["cls"]) else 0
        at = lambda nums: {positional[offset + i] for i in nums if -len(positional) <= offset + i < len(positional)}
        if self.argnums is not None:
            return at(self.argnums)
        every = positional + [a.arg for a in fn.args.kwonlyargs]
        every += [a.arg for a in (fn.args.vararg, fn.args.kwarg) if a]
        if self.kind == "control":  # lax passes only the carry/operands: defaulted parameters keep their values
            every = [a for a in every if a not in _defaulted(fn)]
        return set(every) - self.static_names - at(self.static_nums) - {"self", "cls"}


def _defaulted(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    """Parameters that have a default value."""
    positional = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    with_default = positional[len(positional) - len(fn.args.defaults):] if fn.args.defaults else []
    return set(with_default) | {a.arg for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults) if d is not None}


def _int_set(node: ast.AST) -> frozenset[int]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    return frozenset(v for v in (_const_int(e) for e in elts) if v is not None)


def _str_set(node: ast.AST) -> frozenset[str]:
    elts = node.elts if isinstance(node, (ast.Tuple, ast.List)) else [node]
    return frozenset(v for v in (_const_str(e) for e in elts) if v)


class _Context:
    """What the whole file tells: import aliases, the first JAX import, transformed functions,
    compiled names, whether it uses pmap / shard_map and loss scaling."""

    def __init__(self, tree: ast.Module, filename: str):
        self.filename = filename
        self.tree = tree
        self.nodes = list(ast.walk(tree))
        self.parents = {child: node for node in self.nodes for child in ast.iter_child_nodes(node)}
        self.aliases: dict[str, str] = dict(DEFAULT_ALIASES)
        self.removed_bindings: set[str] = set()
        self.jax_import: tuple[int, str] | None = None
        for node in sorted((n for n in self.nodes if isinstance(n, (ast.Import, ast.ImportFrom))),
                           key=lambda n: n.lineno):
            self._read_import(node)
        self._read_bindings()
        self.transforms: dict[int, list[_Transform]] = {}  # id(FunctionDef) -> how it is transformed
        self._jax_work: dict[int, bool] = {}
        self._defs_in: dict[int, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}  # scope -> its functions
        self.compiled: dict[str, str] = {}  # name bound to a transformed function -> the function's name
        for node in self.nodes:
            self._read_transforms(node)
        self._read_uses()

    def _read_bindings(self) -> None:
        """Names the file binds itself, and its functions by name."""
        nodes = self.nodes
        self.functions: dict[str, list[ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in (n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            self.functions.setdefault(node.name, []).append(node)
        self.bound_here = {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)}
        self.bound_here |= set(self.functions)
        self.bound_here |= {a.arg for n in nodes if isinstance(n, ast.arguments)
                            for a in n.posonlyargs + n.args + n.kwonlyargs}

    def _read_uses(self) -> None:
        """Whether the file uses pmap, shard_map (or xmap), and loss scaling anywhere."""
        nodes = self.nodes
        refs = {self.resolve(n) for n in nodes if isinstance(n, (ast.Name, ast.Attribute))}
        self.uses_pmap = "jax.pmap" in refs
        self.uses_shard_map = any(r.endswith(("shard_map", "xmap")) for r in refs)
        words = {w.lower() for n in nodes for w in (getattr(n, "id", None), getattr(n, "attr", None),
                                                    getattr(n, "name", None), getattr(n, "module", None))
                 if isinstance(w, str)}
        self.has_loss_scaling = any(h in w for w in words for h in LOSS_SCALING_HINTS)

    # imports ---------------------------------------------------------------------------
    def _read_import(self, node: ast.Import | ast.ImportFrom) -> None:
        if isinstance(node, ast.ImportFrom) and (node.level or not node.module):
            return
        for alias in node.names:
            if isinstance(node, ast.Import):
                full = alias.name
                local, bound = (alias.asname, full) if alias.asname else (full.split(".")[0], full.split(".")[0])
            else:
                full = f"{node.module}.{alias.name}"
                local, bound = alias.asname or alias.name, full
            self.aliases[local] = bound
            if _removed_key(full):
                self.removed_bindings.add(local)
            root = full.split(".")[0]
            if root in JAX_IMPORTERS and self.jax_import is None:
                self.jax_import = (node.lineno, root)

    def resolve(self, node: ast.AST) -> str:
        """The dotted name with its import alias expanded: 'jnp.float16' -> 'jax.numpy.float16'."""
        dotted = _dotted(node)
        root, _, rest = dotted.partition(".")
        base = self.aliases.get(root, root)
        return f"{base}.{rest}" if rest and base else base

    # transformations ---------------------------------------------------------------------
    def transform_kind(self, node: ast.AST) -> str | None:
        """'compile' | 'grad' | 'control' when `node` names a JAX transformation."""
        name = self.resolve(node)
        last = name.rsplit(".", 1)[-1]
        bare = self.is_bare(node) and last in BARE_TRANSFORMS
        if not (name.startswith("jax.") or bare):
            return None
        if last in COMPILE_TRANSFORMS:
            return "compile"
        if last in GRAD_TRANSFORMS:
            return "grad"
        return "control" if last in CONTROL_FLOW and name.startswith("jax.lax.") else None

    def _partial_target(self, call: ast.Call) -> ast.AST | None:
        """`jax.jit` in `functools.partial(jax.jit, ...)`."""
        if self.resolve(call.func) in ("functools.partial", "partial") and call.args:
            return call.args[0]
        return None

    def _make_transform(self, kind_node: ast.AST, keywords: list[ast.keyword],
                        args: list[ast.AST]) -> _Transform | None:
        """The transform `kind_node` names, with the static arguments its keywords declare."""
        kind = self.transform_kind(kind_node)
        if kind is None:
            return None
        names, nums, argnums = frozenset(), frozenset(), None
        for kw in keywords:
            if kw.arg == "static_argnames":
                names |= _str_set(kw.value)
            elif kw.arg in ("static_argnums", "static_broadcasted_argnums", "nondiff_argnums"):
                nums |= _int_set(kw.value)
            elif kw.arg == "argnums":
                argnums = _int_set(kw.value)
        if kind == "grad" and argnums is None:
            argnums = _int_set(args[1]) if len(args) > 1 else frozenset({0})
        pmap = self.resolve(kind_node).rsplit(".", 1)[-1] == "pmap"
        return _Transform(kind, pmap, names, nums, argnums if kind == "grad" else None)

    def _record(self, call: ast.Call, fn_ref: ast.AST, transform: _Transform | None) -> None:
        if transform is None or not isinstance(fn_ref, (ast.Name, ast.Attribute)):
            return
        fn = self.definition(call, fn_ref.id if isinstance(fn_ref, ast.Name) else fn_ref.attr)
        if fn is not None:
            bound = isinstance(fn_ref, ast.Attribute)
            self.transforms.setdefault(id(fn), []).append(dataclasses.replace(transform, bound=bound))

    def definition(self, node: ast.AST, name: str) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The function `name` as seen from `node`: defined in its scope or an enclosing one (or class)."""
        scope = self.parents.get(node)
        while scope is not None:
            if isinstance(scope, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                if id(scope) not in self._defs_in:
                    self._defs_in[id(scope)] = {}
                    for n in _scope_nodes(scope):
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            self._defs_in[id(scope)].setdefault(n.name, n)
                if name in self._defs_in[id(scope)]:
                    return self._defs_in[id(scope)][name]
            scope = self.parents.get(scope)
        return None

    def _read_transforms(self, node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for dec in node.decorator_list:
                transform = self._decorator_transform(dec)
                if transform:
                    self.transforms.setdefault(id(node), []).append(transform)
                    self.compiled[node.name] = node.name
        elif isinstance(node, ast.Call):
            self._read_transform_call(node)

    def _decorator_transform(self, dec: ast.AST) -> _Transform | None:
        if not isinstance(dec, ast.Call):
            return self._make_transform(dec, [], [])
        target = self._partial_target(dec)
        if target is not None:
            return self._make_transform(target, dec.keywords, [])
        return self._make_transform(dec.func, dec.keywords, [])

    def _read_transform_call(self, call: ast.Call) -> None:
        """`jax.jit(f, ...)`, `partial(jax.pmap, ...)(f)`, `lax.scan(body, ...)`; names bound to the result."""
        inner = call.func if isinstance(call.func, ast.Call) else None
        target = self._partial_target(inner) if inner is not None else None
        if target is not None:
            transform = self._make_transform(target, inner.keywords + call.keywords, call.args)
        else:
            transform = self._make_transform(call.func, call.keywords, call.args)
        if transform is None or not call.args:
            return
        if transform.kind == "control":
            refs = [e for a in call.args for e in (a.elts if isinstance(a, (ast.List, ast.Tuple)) else [a])]
            for ref in refs:
                self._record(call, ref, transform)
            return
        self._record(call, call.args[0], transform)
        parent = self.parents.get(call)
        if isinstance(parent, ast.Assign) and parent.value is call:
            fn = _last_name(call.args[0])
            for t in parent.targets:
                for name in _target_names(t):
                    self.compiled[name.rsplit(".", 1)[-1]] = fn

    # calls -------------------------------------------------------------------------------
    def is_step_call(self, call: ast.Call) -> bool:
        """A call that runs a training step: `train_step(...)`, `p_update(...)`, `self.step_fn(...)`;
        not predicates or builders (`is_step(...)`, `make_train_step(...)`), nor `pbar.update(1)`."""
        args = call.args + [k.value for k in call.keywords]
        if not args or all(isinstance(a, ast.Constant) for a in args):
            return False
        if self.resolve(call.func).startswith(("os.", "jax.config")):
            return False
        name = _last_name(call.func)
        if not (_is_step_name(name) or _is_step_name(self.compiled.get(name, ""))):
            return False
        fn = self.callee(call)
        return fn is None or self._does_jax_work(fn)

    def _does_jax_work(self, fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
        """Whether a (not transformed) function of this file calls JAX, optax, flax or a compiled function:
        `def latest_step(path): return int(path.name)` does not, so calling it runs no step."""
        if id(fn) not in self._jax_work:
            calls = [n for n in _scope_nodes(fn) if isinstance(n, ast.Call)]
            self._jax_work[id(fn)] = any(
                self.resolve(c.func).split(".")[0] in ("jax", "optax", "flax") or _last_name(c.func) in self.compiled
                or _last_name(c.func) in APPLY_METHODS or _is_step_name(_last_name(c.func)) for c in calls)
        return self._jax_work[id(fn)]

    def is_host_call(self, call: ast.Call) -> bool:
        """A call whose result lives on the host: conversions, numpy, time, device_get, len, print."""
        name = self.resolve(call.func)
        return (name in HOST_BUILTINS or name in HOST_JAX or name.startswith(HOST_NAMESPACES)
                or isinstance(call.func, ast.Attribute) and call.func.attr in SYNC_METHODS)

    def is_logger_call(self, call: ast.Call) -> bool:
        name = self.resolve(call.func)
        return (isinstance(call.func, ast.Attribute) and call.func.attr in LOG_METHODS
                and name.split(".")[0] not in NOT_LOGGERS)

    def callee(self, call: ast.Call) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
        """The one function of this file that `f(...)` or `self.f(...)` calls (not a transformed one)."""
        func = call.func
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in ("self", "cls"):
            name = func.attr
        else:
            name = func.id if isinstance(func, ast.Name) else ""
        defs = self.functions.get(name, [])
        return defs[0] if len(defs) == 1 and id(defs[0]) not in self.transforms else None

    def is_bare(self, node: ast.AST) -> bool:
        """A name neither imported nor bound in the file (`pmap` in a pasted snippet)."""
        return isinstance(node, ast.Name) and node.id not in self.aliases and node.id not in self.bound_here

    def after_jax_import(self, line: int) -> bool:
        return self.jax_import is not None and line > self.jax_import[0]


def _removed_key(full: str) -> str | None:
    """The REMOVED entry `full` falls under ('jax.experimental.maps' for 'jax.experimental.maps.xmap')."""
    parts = full.split(".")
    for n in range(len(parts), 1, -1):
        key = ".".join(parts[:n])
        if key in REMOVED:
            return key
    return None


# -- device values -------------------------------------------------------------------------
class _Values:
    """Which names of one scope hold device arrays: results of jitted or step calls, of jnp/lax
    operations, and of calls and expressions on those. Host conversions end the chain."""

    def __init__(self, ctx: _Context, scope: ast.AST, seed: set[str] = frozenset()):
        self.ctx = ctx
        self.names: set[str] = set(seed)
        writes = [w for n in _scope_nodes(scope) for w in _writes(n)]
        changed = True
        while changed:
            changed = False
            for names, value in writes:
                new = set(names) - self.names if self.is_device(value, self.names) else set()
                self.names |= new
                changed |= bool(new)

    def is_device(self, node: ast.AST, known: set[str]) -> bool:
        """Whether `node` evaluates to (or holds) a device array, the names in `known` holding ones."""
        stack = [(node, known)]
        while stack:
            device, parts = self._look(*stack.pop())
            if device:
                return True
            stack.extend(parts)
        return False

    def _look(self, node: ast.AST, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        """(a device value for certain, the sub-expressions that decide it otherwise)."""
        if isinstance(node, (ast.Name, ast.Attribute)):
            if _dotted(node) in known:
                return True, []
            keep = isinstance(node, ast.Attribute) and node.attr not in STATIC_ATTRS
            return False, [(node.value, known)] if keep else []
        if isinstance(node, ast.Subscript):
            return False, [(node.value, known)]
        if isinstance(node, ast.Call):
            return self._look_call(node, known)
        if isinstance(node, (ast.Constant, ast.JoinedStr, ast.Lambda)):
            return False, []
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Is, ast.IsNot, ast.In, ast.NotIn))
                                                 for op in node.ops):
            return False, []  # identity and key membership: answered on the host
        if isinstance(node, ast.IfExp):
            return False, [(node.body, known), (node.orelse, known)]
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = self.comprehension_names(node, known)
            elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            return False, [(e, inner) for e in elts]
        return False, [(c, known) for c in ast.iter_child_nodes(node)]

    def comprehension_names(self, node: ast.AST, known: set[str]) -> set[str]:
        """`known` plus the loop variables of comprehensions in `node` that iterate over device values."""
        names = set(known)
        for gen in (n for n in ast.walk(node) if isinstance(n, ast.comprehension)):
            if self.is_device(gen.iter, names):
                names |= set(_iterated_values(gen.target, gen.iter))
        return names

    def _look_call(self, call: ast.Call, known: set[str]) -> tuple[bool, list[tuple[ast.AST, set[str]]]]:
        ctx = self.ctx
        if ctx.is_host_call(call) or ctx.transform_kind(call.func) or _last_name(call.func) in AOT_METHODS:
            return False, []
        if isinstance(call.func, ast.Call) and ctx.transform_kind(call.func.func):
            return True, []  # jax.grad(loss)(params)
        name = ctx.resolve(call.func)
        if ctx.is_step_call(call) or _last_name(call.func) in ctx.compiled or name.startswith(COMPUTE_NAMESPACES):
            return True, []
        parts = [call.func.value] if isinstance(call.func, ast.Attribute) else []
        return False, [(a, known) for a in parts + call.args + [k.value for k in call.keywords]]

    def sync_message(self, node: ast.AST, known: set[str]) -> str | None:
        """Why `node` copies a device value to the host (and waits for it), or None."""
        if isinstance(node, ast.JoinedStr):
            if any(isinstance(v, ast.FormattedValue) and self.is_device(v.value, known) for v in node.values):
                return "an f-string formats a device array"
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and _const_str(node.left) is not None:
            return "`%` formats a device array" if self.is_device(node.right, known) else None
        return self._sync_call_message(node, known) if isinstance(node, ast.Call) else None

    def _sync_call_message(self, call: ast.Call, known: set[str]) -> str | None:
        ctx = self.ctx
        name = ctx.resolve(call.func)
        args = call.args + [k.value for k in call.keywords]
        live = lambda nodes: any(self.is_device(a, known) for a in nodes)
        if name in CONVERSIONS and call.args and live(call.args[:1]):
            return f"`{name}(...)` of a device array"
        if isinstance(call.func, ast.Attribute) and call.func.attr in SYNC_METHODS and live([call.func.value]):
            return f"`.{call.func.attr}()` of a device array"
        if (name == "jax.device_get" or name.startswith("numpy.")) and live(args):
            return f"`{name}(...)` of a device array"
        if (name == "print" or ctx.is_logger_call(call)) and live(args):
            return f"`{name or _last_name(call.func)}(...)` formats a device array"
        if _last_name(call.func) == "format" and isinstance(call.func, ast.Attribute) \
                and _const_str(call.func.value) is not None and live(args):
            return "`str.format` formats a device array"
        return None


# -- SYNC001: one step loop at a time ------------------------------------------------------
def _direct_step_call(ctx: _Context, loop: ast.AST) -> bool:
    """Whether the loop body runs a step itself (not only inside a nested loop)."""
    stack = list(loop.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Call) and ctx.is_step_call(node):
            return True
        if not isinstance(node, (*LOOPS, *SCOPES)):
            stack.extend(ast.iter_child_nodes(node))
    return False


class _SyncWalk:
    """Walks statements in order, tracking which names hold this iteration's device results
    (`fresh`), which hold earlier ones (`prior`), and whether this iteration's step was
    dispatched. A host conversion of a fresh value, or of a prior one before the step is
    dispatched, waits for the device. Branches under `if step % N == 0:` are the remedy. A
    function of this file called with fresh values is walked too (one level deep)."""

    def __init__(self, ctx: _Context, values: _Values, counters: set[str], gate_source: ast.AST, depth: int = 0):
        self.ctx, self.values, self.counters, self.depth = ctx, values, counters, depth
        self.gate_names: set[str] = set()
        self.gate_names = {n for s in ast.walk(gate_source) if isinstance(s, ast.Assign)
                           and self._gate(s.value) == "gate" for t in s.targets for n in _target_names(t)}
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
        elif _child_blocks(stmt):
            heads = [i.context_expr for i in getattr(stmt, "items", [])] + [getattr(stmt, "subject", None)]
            self._exprs([h for h in heads if h is not None])
            for block in _child_blocks(stmt):
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
        if _direct_step_call(self.ctx, loop):  # checked on its own; here only its results count
            self.dispatched = True
            self.fresh |= {n for s in ast.walk(loop) for names, v in _writes(s) for n in names
                           if self.values.is_device(v, self.values.names)}
            return
        if isinstance(loop, ast.While):
            self._test(loop.test, loop)
        else:
            self._exprs([loop.iter])
            values = _iterated_values(loop.target, loop.iter)
            for name in _target_names(loop.target):
                self._set(name, loop.iter if name in values else ast.Constant(0))
        self._block(loop.body)
        self._block(loop.orelse)

    # expressions -------------------------------------------------------------------------
    def _test(self, test: ast.AST, stmt: ast.AST) -> None:
        if self.values.is_device(test, self._live()):
            self._flag(stmt, "a branch on a device value converts it to a Python bool")

    def _exprs(self, nodes: list[ast.AST]) -> None:
        for root in nodes:
            live = self.values.comprehension_names(root, self._live())
            for node in ast.walk(root):
                if isinstance(node, ast.IfExp) and self.values.is_device(node.test, live):
                    self._flag(node, "a conditional expression on a device value converts it to a Python bool")
                message = self.values.sync_message(node, live)
                if message:
                    self._flag(node, message)
                if isinstance(node, ast.Call) and self.depth == 0 and self.report and not self.gated:
                    self._callee(node, live)

    def _callee(self, call: ast.Call, live: set[str]) -> None:
        """Syncs inside a function of this file that the step loop calls with this step's values."""
        fn = self.ctx.callee(call)
        if fn is None or self.ctx.is_step_call(call):
            return
        args = _bind_arguments(fn, call)
        seeds = {p for p, arg in args.items() if self.values.is_device(arg, live)}
        if not seeds:
            return
        values = _Values(self.ctx, fn, seed=seeds)
        params = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs}
        inner = _SyncWalk(self.ctx, values, params - seeds, fn, depth=1)
        inner.scan(fn.body, fresh=values.names, prior=set(), dispatched=True, report=True)
        self.found += [(node, f"{message} (in `{fn.name}`, called every step at line {call.lineno})")
                       for node, message in inner.found]

    def _assign(self, stmt: ast.stmt) -> None:
        for target, value in _assigned_pairs(stmt):
            for name in _target_names(target):
                self._set(name, value)
        for container, value in _mutations(stmt):
            if self._is_fresh(value) or self.values.is_device(value, self._all()):
                (self.fresh if self._is_fresh(value) else self.prior).add(container)
        if self._has_step(stmt):
            self.dispatched = True

    def _set(self, name: str, value: ast.AST) -> None:
        fresh = self._is_fresh(value)
        device = fresh or self.values.is_device(value, self._all())
        self.fresh.discard(name)
        self.prior.discard(name)
        (self.fresh if fresh else self.prior if device else set()).add(name)

    def _all(self) -> set[str]:
        return self.fresh | self.prior | self.values.names

    def _is_fresh(self, value: ast.AST) -> bool:
        return self.values.is_device(value, self.fresh) or self._has_step(value)

    def _has_step(self, node: ast.AST) -> bool:
        return any(isinstance(n, ast.Call) and self.ctx.is_step_call(n) for n in ast.walk(node))

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
            return "gate" if all(p == "gate" for p in parts) else None
        return self._compare_gate(test) if isinstance(test, ast.Compare) else None

    def _compare_gate(self, test: ast.Compare) -> str | None:
        operands = [test.left, *test.comparators]
        if any(isinstance(o, ast.BinOp) and isinstance(o.op, ast.Mod) for o in operands):
            return {ast.Eq: "gate", ast.NotEq: "anti"}.get(type(test.ops[0]))
        names = {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if isinstance(test.ops[0], ast.Eq) and names & self.counters:
            return "gate"
        return None


def _loop_counters(loop: ast.For | ast.AsyncFor | ast.While) -> set[str]:
    """The loop variable and names incremented in the loop (`step += 1`)."""
    counters = set(_target_names(loop.target)) if isinstance(loop, (ast.For, ast.AsyncFor)) else set()
    return counters | {n for s in ast.walk(loop) if isinstance(s, ast.AugAssign) for n in _target_names(s.target)}


def _step_loop_syncs(ctx: _Context, values: _Values, loop: ast.For | ast.AsyncFor | ast.While) -> list:
    """SYNC001 in one loop that runs a step: a first pass learns what an iteration leaves behind."""
    walk = _SyncWalk(ctx, values, _loop_counters(loop), loop)
    walk.scan(loop.body, fresh=set(), prior=set(), dispatched=False, report=False)
    walk.scan(loop.body, fresh=set(), prior=walk.fresh | walk.prior, dispatched=False, report=True)
    return walk.found


def _bind_arguments(fn: ast.FunctionDef | ast.AsyncFunctionDef, call: ast.Call) -> dict[str, ast.AST]:
    """Parameter name -> argument expression for a call of `fn` (`self` skipped for `self.method(...)`)."""
    params = [a.arg for a in fn.args.posonlyargs + fn.args.args]
    if isinstance(call.func, ast.Attribute) and params[:1] in (["self"], ["cls"]):
        params = params[1:]
    bound = dict(zip(params, (a for a in call.args if not isinstance(a, ast.Starred))))
    bound.update({k.arg: k.value for k in call.keywords if k.arg})
    return bound


# -- TIME001 ------------------------------------------------------------------------------
class _Timing:
    """Clock reads `t0 = time.perf_counter()` ... `time.perf_counter() - t0` in one scope, and
    whether JAX work dispatched between them was waited for before the second read."""

    def __init__(self, ctx: _Context, values: _Values, scope: ast.AST, starts: dict[str, list[ast.stmt]],
                 nodes: list[ast.AST]):
        self.ctx, self.values, self.starts = ctx, values, starts
        self.paths: dict[int, list[tuple[list[ast.stmt], int]]] = {}
        self.stmt_of: dict[int, ast.stmt] = {}
        self._index(scope.body, [])
        self.found: list[tuple[ast.AST, str]] = []
        reads = {id(s): s for s in (self._read_stmt(n) for n in nodes) if s is not None}
        for stmt, start in reads.values():
            if self._pending(start, stmt):
                self.found.append((stmt, "the clock is read after a JAX call without waiting for it: this "
                                         "measures dispatch, not the computation"))

    @staticmethod
    def starts_in(ctx: _Context, nodes: list[ast.AST]) -> dict[str, list[ast.stmt]]:
        """Variable -> the statements that assign it a clock reading (`t0 = time.perf_counter()`)."""
        starts: dict[str, list[ast.stmt]] = {}
        for node in nodes:
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and _is_clock(ctx, node.value):
                for t in getattr(node, "targets", [getattr(node, "target", None)]):
                    for name in _target_names(t):
                        starts.setdefault(name, []).append(node)
        return starts

    def _index(self, block: list[ast.stmt], path: list) -> None:
        for i, stmt in enumerate(block):
            here = path + [(block, i)]
            self.paths[id(stmt)] = here
            for node in [] if isinstance(stmt, SCOPES) else [stmt] if _child_blocks(stmt) else _scope_nodes(stmt):
                self.stmt_of.setdefault(id(node), stmt)
            for sub in _child_blocks(stmt):
                self._index(sub, here)
            if _child_blocks(stmt):
                heads = [n for f in ("test", "iter", "items", "subject") for n in _as_list(getattr(stmt, f, None))]
                for node in (n for h in heads for n in ast.walk(h)):
                    self.stmt_of.setdefault(id(node), stmt)

    def _latest(self, name: str, before: int) -> ast.stmt | None:
        earlier = [s for s in self.starts.get(name, []) if s.lineno <= before]
        return max(earlier, key=lambda s: s.lineno, default=None)

    def _read_stmt(self, node: ast.AST) -> tuple[ast.stmt, ast.stmt] | None:
        """(the statement that reads the clock, the statement that started it) for `... - t0`."""
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Sub) and isinstance(node.right, ast.Name)):
            return None
        stmt = self.stmt_of.get(id(node))
        if stmt is None or node.right.id not in self.starts:
            return None
        if isinstance(node.left, ast.Name):
            stmt = self._latest(node.left.id, stmt.lineno)
        elif not _is_clock(self.ctx, node.left):
            return None
        start = self._latest(node.right.id, stmt.lineno - 1) if stmt is not None else None
        return (stmt, start) if start is not None and start is not stmt else None

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

    def _pending(self, start: ast.stmt, end: ast.stmt) -> bool:
        between = self._between(start, end)
        if not between:
            return False
        pending = False
        for event in (e for s in between for e in self._events(s)):
            pending = event == "jax"
        return pending

    def _events(self, root: ast.AST) -> list[str]:
        """'jax' for work dispatched to the device, 'sync' for a wait, in evaluation order (children first)."""
        events, stack = [], [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if isinstance(node, SCOPES):
                continue
            if expanded:
                events += [kind] if (kind := self._event(node)) else []
                continue
            stack.append((node, True))
            stack.extend((child, False) for child in reversed(list(ast.iter_child_nodes(node))))
        return events

    def _event(self, node: ast.AST) -> str | None:
        if isinstance(node, ast.JoinedStr):
            return "sync" if self.values.sync_message(node, self.values.names) else None
        if not isinstance(node, ast.Call):
            return None
        if _last_name(node.func) in WAIT_METHODS or self.ctx.resolve(node.func) == "jax.device_get":
            return "sync"
        if self.values.sync_message(node, self.values.names):
            return "sync"
        if isinstance(node.func, ast.Name) and hasattr(builtins, node.func.id):
            return None  # min(), sum() and friends dispatch nothing themselves
        return "jax" if self.values.is_device(node, self.values.names) else None


def _is_clock(ctx: _Context, node: ast.AST | None) -> bool:
    return isinstance(node, ast.Call) and ctx.resolve(node.func) in CLOCKS


def _as_list(value) -> list:
    if value is None:
        return []
    return [getattr(v, "context_expr", v) for v in value] if isinstance(value, list) else [value]


# -- node-local rules --------------------------------------------------------------------
class _Checker(ast.NodeVisitor):
    """TPU001, PMAP001/002, REMOVED001/002, TRACE001, SHAPE001, BATCH001, FP16001 and PREC001."""

    def __init__(self, ctx: _Context):
        self.ctx = ctx
        self.found: list[tuple[ast.AST, str, str, str | None]] = []
        self.traced: list[set[str]] = []
        self.pmap_depth = 0
        self.platform_names: set[str] = set()
        self.platform_names = {n for node in ctx.nodes for t, v in _assigned_pairs(node)
                               if self._platform_query(v) for n in _target_names(t)}

    def add(self, node: ast.AST, rule: str, message: str, replacement: str | None = None) -> None:
        self.found.append((node, rule, message, replacement))

    # imports and names (REMOVED001, PMAP001) ----------------------------------------------
    def visit_Import(self, node: ast.Import) -> None:
        self._removed_import(node, [a.name for a in node.names])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.module and not node.level:
            self._removed_import(node, [f"{node.module}.{a.name}" for a in node.names])

    def _removed_import(self, node: ast.AST, names: list[str]) -> None:
        for full in names:
            key = _removed_key(full)
            if key:
                self.add(node, "REMOVED001", f"`{full}` is imported: it was removed from JAX", REMOVED[key])
                return

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if not isinstance(self.ctx.parents.get(node), ast.Attribute):
            self._name_use(node)
        self.generic_visit(node)

    def visit_Name(self, node: ast.Name) -> None:
        if isinstance(node.ctx, ast.Load):
            self._name_use(node)

    def _name_use(self, node: ast.Name | ast.Attribute) -> None:
        full = self.ctx.resolve(node)
        root = _dotted(node).split(".")[0]
        if full == "jax.pmap" or self.ctx.is_bare(node) and node.id == "pmap":
            self.add(node, "PMAP001", "pmap is in maintenance mode; it replicates by hand what jit + sharding does")
        key = _removed_key(full)
        if key and root not in self.ctx.removed_bindings:
            self.add(node, "REMOVED001", f"`{full}` was removed from JAX", REMOVED[key])
        if full in HALF_DTYPES:
            self._half(node)

    # functions (TRACE001, PMAP002 context, BATCH001 defaults) -----------------------------
    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        transforms = self.ctx.transforms.get(id(node), [])
        params = {a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs}
        outer = self.traced[-1] if self.traced else set()
        traced = (outer - params) | {n for t in transforms for n in t.traced(node)}
        self.traced.append(self._propagate(node, traced) if traced else set())
        pmapped = any(t.pmap for t in transforms)
        self.pmap_depth += pmapped
        self._batch_defaults(node.args)
        self.generic_visit(node)
        self.pmap_depth -= pmapped
        self.traced.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    @staticmethod
    def _propagate(fn: ast.AST, traced: set[str]) -> set[str]:
        """Names computed from traced values inside the function are traced too."""
        traced = set(traced)
        pairs = [p for n in _scope_nodes(fn) for p in _assigned_pairs(n)]
        pairs += [(n.target, n.iter) for n in _scope_nodes(fn) if isinstance(n, (ast.For, ast.AsyncFor))]
        changed = True
        while changed:
            changed = False
            for target, value in pairs:
                if _traced_uses(value, traced):
                    new = set(_target_names(target)) - traced
                    traced |= new
                    changed |= bool(new)
        return traced

    def _check_traced(self, node: ast.AST, test: ast.AST, keyword: str) -> None:
        names = _traced_uses(test, self.traced[-1]) if self.traced else []
        if names:
            self.add(node, "TRACE001", f"`{keyword}` on `{names[0]}`, a traced value inside a transformed function: "
                                       "it raises a ConcretizationTypeError (or silently specialises) under jit")

    def visit_If(self, node: ast.If) -> None:
        self._check_traced(node, node.test, "if")
        self.generic_visit(node)

    def visit_While(self, node: ast.While) -> None:
        self._check_traced(node, node.test, "while")
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        self._check_traced(node, node.test, "... if ... else")
        self.generic_visit(node)

    def visit_Assert(self, node: ast.Assert) -> None:
        self._check_traced(node, node.test, "assert")
        self.generic_visit(node)

    def visit_For(self, node: ast.For) -> None:
        it = node.iter
        if isinstance(it, ast.Call) and _dotted(it.func) == "range":
            self._check_traced(node, ast.Tuple(elts=list(it.args), ctx=ast.Load()), "for ... in range")
        self.generic_visit(node)

    # calls ---------------------------------------------------------------------------------
    def visit_Call(self, node: ast.Call) -> None:
        name = self.ctx.resolve(node.func)
        last = _last_name(node.func)
        self._tpu_call(node, name, last)
        self._collective(node, name, last)
        if last in ("device_put_replicated", "device_put_sharded") and self.ctx.is_bare(node.func):
            self.add(node, "REMOVED001", f"`{name or last}` was removed in JAX 0.10", REMOVED[f"jax.{last}"])
        if last == "clear_backends":
            self.add(node, "REMOVED002", f"`{name or last}` no longer exists")
        self._shape(node, last)
        self._batch_call(node, name, last)
        self._precision(node, name)
        self.generic_visit(node)

    def _tpu_call(self, node: ast.Call, name: str, last: str) -> None:
        backend = next((_const_str(k.value) for k in node.keywords if k.arg == "backend"), None)
        arg = _const_str(node.args[0]) if node.args and last in DEVICE_QUERIES else None
        if any(v and v.lower() == "tpu" for v in (backend, arg)):
            self.add(node, "TPU001", f"`{name or last}(... \"tpu\")` selects TPU devices only: it fails on a GPU "
                                     "machine")
        if last in ("startswith", "endswith") and isinstance(node.func, ast.Attribute) and node.args \
                and _names_only_tpu(node.args[0]) and self._platform_query(node.func.value):
            self.add(node, "TPU001", "the code checks for a TPU device: on a GPU machine the check fails or the "
                                     "TPU branch never runs")
        if name.endswith("config.update") and len(node.args) > 1 and _const_str(node.args[0]) in PLATFORM_KEYS:
            value = _const_str(node.args[1]) or ""
            if "tpu" in value.lower().split(","):
                self.add(node, "TPU001", f"`{_const_str(node.args[0])}` is set to {value!r}: JAX then looks for a TPU")

    def _collective(self, node: ast.Call, name: str, last: str) -> None:
        if last in COLLECTIVES and name.startswith("jax.lax.") and \
                (self.pmap_depth or self.ctx.uses_pmap and not self.ctx.uses_shard_map):
            self.add(node, "PMAP002", f"`{name}` inside a pmapped function")

    def _shape(self, node: ast.Call, last: str) -> None:
        if last in ("batch", "padded_batch") and isinstance(node.func, ast.Attribute):
            if self._flag_missing(node, "drop_remainder"):
                self.add(node, "SHAPE001", f"`.{last}(...)` without drop_remainder=True yields a smaller last batch")
        unbatched = any(k.arg == "batch_sampler" or k.arg == "batch_size" and isinstance(k.value, ast.Constant)
                        and k.value.value is None for k in node.keywords)
        if self._torch_loader(node) and not unbatched and self._flag_missing(node, "drop_last"):
            self.add(node, "SHAPE001", "`DataLoader(...)` without drop_last=True yields a smaller last batch")

    def _torch_loader(self, node: ast.Call) -> bool:
        """torch.utils.data.DataLoader (or a bare `DataLoader` in a snippet), not grain's or another's."""
        return self.ctx.resolve(node.func).startswith("torch.") and _last_name(node.func) == "DataLoader" \
            or self.ctx.is_bare(node.func) and node.func.id == "DataLoader"

    @staticmethod
    def _flag_missing(node: ast.Call, keyword: str) -> bool:
        """True when the keyword is absent or literally False (a variable may be True: not flagged)."""
        value = next((k.value for k in node.keywords if k.arg == keyword), None)
        return value is None or isinstance(value, ast.Constant) and value.value is False

    def _precision(self, node: ast.Call, name: str) -> None:
        if name.endswith("config.update") and len(node.args) > 1 \
                and _const_str(node.args[0]) == "jax_default_matmul_precision" and _low_precision(node.args[1]):
            self.add(node, "PREC001", f"the default matmul precision is set to {_const_str(node.args[1])!r}: "
                                      "TPU and GPU run it differently (bf16 passes vs TF32)")
        if name.endswith("default_matmul_precision") and isinstance(self.ctx.parents.get(node), ast.Expr):
            self.add(node, "PREC001", "`default_matmul_precision(...)` on its own does nothing: it is a context "
                                      "manager, so the platform default stays in effect")
        for kw in node.keywords:
            if kw.arg == "precision" and _low_precision(kw.value):
                self.add(kw.value, "PREC001", "the platform-default matmul precision is requested: bf16 passes on "
                                              "TPU, TF32 on recent GPUs")

    # BATCH001 ------------------------------------------------------------------------------
    def _batch(self, node: ast.AST, name: str | None, value: ast.AST | None) -> None:
        size = _const_int(value)
        if name and size is not None and size >= BATCH_MIN and _is_batch_size_name(name):
            self.add(node, "BATCH001", f"`{name} = {size}`: a TPU-pod-sized batch rarely fits one GPU's memory")

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, (ast.Name, ast.Attribute)):
                self._batch(node, _last_name(target), node.value)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if isinstance(node.target, (ast.Name, ast.Attribute)):
            self._batch(node, _last_name(node.target), node.value)
        self.generic_visit(node)

    def visit_Dict(self, node: ast.Dict) -> None:
        for key, value in zip(node.keys, node.values):
            self._batch(value, _const_str(key), value)
        self.generic_visit(node)

    def _batch_call(self, node: ast.Call, name: str, last: str) -> None:
        for kw in node.keywords:
            if kw.arg != "default":
                self._batch(kw.value, kw.arg, kw.value)
        first = _const_str(node.args[0]) if node.args else None
        if not first:
            return
        if last == "add_argument":
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            self._batch(node, first.lstrip("-"), default)
        elif (last == "get" or last.startswith("DEFINE_")) and len(node.args) > 1:
            self._batch(node, first, node.args[1])
        elif name == "getattr" and len(node.args) > 2:
            self._batch(node, _const_str(node.args[1]), node.args[2])

    def _batch_defaults(self, args: ast.arguments) -> None:
        positional = args.posonlyargs + args.args
        for arg, default in zip(positional[len(positional) - len(args.defaults):], args.defaults):
            self._batch(default, arg.arg, default)
        for arg, default in zip(args.kwonlyargs, args.kw_defaults):
            if default is not None:
                self._batch(default, arg.arg, default)

    # FP16001, TPU001 comparisons -------------------------------------------------------------
    def visit_Constant(self, node: ast.Constant) -> None:
        if node.value == "float16" and self._string_dtype_site(node):
            self._half(node)

    def _string_dtype_site(self, node: ast.Constant) -> bool:
        parent = self.ctx.parents.get(node)
        if isinstance(parent, ast.keyword):
            return "dtype" in _tokens(parent.arg or "")
        if isinstance(parent, ast.Call) and node in parent.args:
            return _last_name(parent.func) in ("astype", "dtype")
        return self._dtype_target(node)

    def _dtype_target(self, node: ast.AST) -> bool:
        """`node` is the value given to something named like a dtype (`compute_dtype = ...`, `dtype=...`)."""
        parent = self.ctx.parents.get(node)
        if isinstance(parent, ast.keyword):
            return "dtype" in _tokens(parent.arg or "")
        targets = getattr(parent, "targets", [getattr(parent, "target", None)])
        return isinstance(parent, (ast.Assign, ast.AnnAssign)) \
            and any("dtype" in _tokens(_last_name(t)) for t in targets)

    def _half(self, node: ast.AST) -> None:
        if self.ctx.has_loss_scaling or self._only_compared(node):
            return
        if self.ctx.jax_import is None and not self._dtype_target(node):
            return  # numpy-only code: float16 storage on the host is not a training dtype
        self.add(node, "FP16001", "float16 is used and the file has no loss scaling")

    def _only_compared(self, node: ast.AST) -> bool:
        """float16 in a comparison, an isinstance/issubdtype test, or a table of several dtypes."""
        parent = self.ctx.parents.get(node)
        if isinstance(parent, (ast.Tuple, ast.List, ast.Set)) and sum(map(_is_dtype, parent.elts)) >= 2:
            return True
        if isinstance(parent, ast.Dict) and sum(map(_is_dtype, parent.values)) >= 2:
            return True
        while parent is not None and not isinstance(parent, ast.stmt):
            if isinstance(parent, ast.Compare) or isinstance(parent, ast.Call) and \
                    _last_name(parent.func) in ("isinstance", "issubdtype", "issubclass"):
                return True
            parent = self.ctx.parents.get(parent)
        return False

    def visit_Compare(self, node: ast.Compare) -> None:
        operands = [node.left, *node.comparators]
        tpu = [o for o in operands if _names_only_tpu(o)]
        if tpu and any(self._platform_query(o) for o in operands if o not in tpu):
            self.add(node, "TPU001", "the code checks for a TPU backend: on a GPU machine the check fails or the "
                                     "TPU branch never runs")
        self.generic_visit(node)

    def _platform_query(self, node: ast.AST) -> bool:
        """An expression that reads the platform: default_backend(), device.platform / .device_kind,
        or a name assigned one of those."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id in self.platform_names:
                return True
            if isinstance(sub, ast.Call) and _last_name(sub.func) in ("default_backend", "get_backend"):
                return True
            if isinstance(sub, ast.Attribute) and sub.attr in PLATFORM_ATTRS:
                return not (set(_tokens(_dotted(sub.value))) & CONFIG_TOKENS)
        return False


def _traced_uses(expr: ast.AST, traced: set[str]) -> list[str]:
    static = _static_uses(expr)
    return [n.id for n in ast.walk(expr) if isinstance(n, ast.Name) and n.id in traced and id(n) not in static]


def _is_dtype(node: ast.AST) -> bool:
    name = _const_str(node) or _dotted(node)
    return name.rsplit(".", 1)[-1] in DTYPE_NAMES


def _names_only_tpu(node: ast.AST) -> bool:
    """A string naming the TPU ("tpu", "TPU v4"), or a tuple of strings that only name TPUs."""
    if _const_str(node) is not None:
        return "tpu" in node.value.lower()
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        values = [(_const_str(e) or "").lower() for e in node.elts]
        return any("tpu" in v for v in values) and not any(p in v for v in values for p in ("gpu", "cuda", "rocm"))
    return False


def _low_precision(node: ast.AST) -> bool:
    """`"bfloat16"`, `"fastest"`, `"default"`, `lax.Precision.DEFAULT`, `Precision("bfloat16")`, or a tuple of them."""
    if isinstance(node, (ast.Tuple, ast.List)):
        return any(_low_precision(e) for e in node.elts)
    if _const_str(node) is not None:
        return node.value.lower() in LOW_PRECISION
    if isinstance(node, ast.Attribute):
        return node.attr == "DEFAULT" and _dotted(node.value).endswith("Precision")
    if isinstance(node, ast.Call) and _dotted(node.func).endswith("Precision") and node.args:
        return _low_precision(node.args[0])
    return False


# -- environment and monitoring facts --------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _EnvWrite:
    node: ast.AST
    name: str
    value: str | None


def _env_writes(ctx: _Context) -> list[_EnvWrite]:
    """Every `os.environ[...] = / += ...`, `os.environ.update/setdefault(...)` and `os.putenv(...)`."""
    writes = []
    for node in ctx.nodes:
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                key = _const_str(target.slice) if isinstance(target, ast.Subscript) \
                    and ctx.resolve(target.value) == "os.environ" else None
                if key:
                    value = None if isinstance(node, ast.AugAssign) else _const_str(node.value)
                    writes.append(_EnvWrite(node, key, value))
        elif isinstance(node, ast.Call):
            writes += _env_call_writes(ctx, node)
    return sorted(writes, key=lambda w: (w.node.lineno, w.node.col_offset))


def _env_call_writes(ctx: _Context, node: ast.Call) -> list[_EnvWrite]:
    name = ctx.resolve(node.func)
    if name in ("os.environ.setdefault", "os.putenv") and node.args and _const_str(node.args[0]):
        value = _const_str(node.args[1]) if len(node.args) > 1 else None
        return [_EnvWrite(node, _const_str(node.args[0]), value)]
    if name != "os.environ.update":
        return []
    pairs = [(_const_str(k), v) for a in node.args if isinstance(a, ast.Dict) for k, v in zip(a.keys, a.values)]
    pairs += [(k.arg, k.value) for k in node.keywords]
    return [_EnvWrite(node, key, _const_str(value)) for key, value in pairs if key]


def _env_findings(ctx: _Context, writes: list[_EnvWrite]) -> list[tuple[ast.AST, str, str, None]]:
    found = []
    for w in writes:
        if w.name.startswith(ENV_PREFIXES) and ctx.after_jax_import(w.node.lineno):
            line, module = ctx.jax_import
            via = "" if module == "jax" else ", which imports JAX"
            found.append((w.node, "ENV001", f"`{w.name}` is set after `import {module}` (line {line}){via}", None))
        if w.name in PLATFORM_ENV and "tpu" in (w.value or "").lower().split(","):
            found.append((w.node, "TPU001", f"`{w.name}={w.value}` makes JAX look for a TPU", None))
        if w.name == "JAX_DEFAULT_MATMUL_PRECISION" and (w.value or "").lower() in LOW_PRECISION:
            found.append((w.node, "PREC001", f"`{w.name}={w.value}`: TPU and GPU run it differently", None))
    return found


def _monitoring(ctx: _Context) -> list[tuple[int, str]]:
    """(line, call) for each read of device memory or utilisation, profiler or monitoring hook."""
    uses = []
    for node in ctx.nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml":
            uses += [(node.lineno, f"pynvml.{a.name}") for a in node.names]
        elif isinstance(node, ast.Call):
            call = _monitoring_call(ctx, node)
            if call:
                uses.append((node.lineno, call))
    return sorted(set(uses))


def _monitoring_call(ctx: _Context, node: ast.Call) -> str | None:
    name = ctx.resolve(node.func)
    last = _last_name(node.func)
    if last == "memory_stats":
        return "memory_stats"
    if name.startswith("pynvml.") and last.startswith("nvml"):
        return name
    if name.startswith(("jax.profiler.", "jax.monitoring.")):
        return name
    if name.split(".")[0] in ("subprocess", "os") and any(
            "nvidia-smi" in s.value for a in node.args + [k.value for k in node.keywords] for s in ast.walk(a)
            if _const_str(s) is not None):
        return "nvidia-smi"
    return None


# -- silencing comments ----------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Ignore:
    line: int
    col: int
    rules: frozenset[str]
    reason: str

    @property
    def has_reason(self) -> bool:
        return sum(any(c.isalpha() for c in w) for w in self.reason.split()) >= MIN_REASON_WORDS


def _ignores(text: str) -> list[_Ignore]:
    found = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            m = IGNORE_COMMENT.search(tok.string) if tok.type == tokenize.COMMENT else None
            if m:
                rules = frozenset(r.strip() for r in m.group(1).split(",") if r.strip())
                found.append(_Ignore(tok.start[0], tok.start[1] + 1, rules, m.group(2).strip()))
    except (tokenize.TokenError, SyntaxError):
        pass  # the text parsed with ast; comments read so far stand
    return found


def _apply_ignores(findings: list[Finding], ignores: list[_Ignore], filename: str) -> list[Finding]:
    rule = RULES["IGNORE001"]
    silenced: dict[int, frozenset[str]] = {}
    extra = []
    for ig in ignores:
        unknown = sorted(ig.rules - RULES.keys())
        if not ig.has_reason:
            message = f"`# migration: ignore[{', '.join(sorted(ig.rules))}]` has no reason, so it silences nothing"
        elif unknown or not ig.rules:
            message = f"`# migration: ignore[...]` names no known rule ({', '.join(unknown) or 'none given'})"
        else:
            message = None
        if message:
            extra.append(Finding(filename, ig.line, ig.col, rule.id, rule.severity, message, rule.replacement))
        if ig.has_reason:
            silenced[ig.line] = ig.rules
    kept = [f for f in findings if f.rule not in silenced.get(f.line, ())]
    return kept + extra


# -- entry points ----------------------------------------------------------------------------
@dataclasses.dataclass
class _FileResult:
    findings: list[Finding]
    env: list[EnvSetting]
    monitoring: list[MonitoringUse]


def _scope_findings(ctx: _Context) -> list[tuple[ast.AST, str, str, None]]:
    """SYNC001 and TIME001: per scope (the module and each function)."""
    found = []
    scopes = [ctx.tree] + [n for n in ctx.nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope in scopes:
        nodes = list(_scope_nodes(scope))
        loops = [n for n in nodes if isinstance(n, LOOPS) and _direct_step_call(ctx, n)]
        starts = _Timing.starts_in(ctx, nodes)
        if not loops and not starts:
            continue
        values = _Values(ctx, scope)
        for loop in loops:
            found += [(node, "SYNC001", f"{message} in the step loop at line {loop.lineno}: the host waits for the "
                                        "device every step", None)
                      for node, message in _step_loop_syncs(ctx, values, loop)]
        if starts:
            timing = _Timing(ctx, values, scope, starts, nodes)
            found += [(node, "TIME001", message, None) for node, message in timing.found]
    return found


def _refuse_unreadable(text: object, filename: str) -> str:
    """`text` if it is source `ast` can read within the size limit; a one-line CodeCheckError otherwise."""
    if not isinstance(text, str):
        raise CodeCheckError(f"{filename}: expected Python source as text; got {type(text).__name__}")
    size = len(text.encode("utf-8", errors="replace"))
    if size > MAX_SOURCE_BYTES:
        raise CodeCheckError(f"{filename}: {size:,} bytes; the limit is {MAX_SOURCE_BYTES:,} bytes per file")
    if "\0" in text:  # ast.parse refuses it (SyntaxError on 3.11.4+, ValueError before): say where
        line = text.count("\n", 0, text.index("\0")) + 1
        raise CodeCheckError(f"{filename}: contains a null byte (line {line}); Python source is text without "
                             "null bytes")
    return text


def check_pasted(text: str) -> str:
    """`text` if pasted code is within `MAX_SOURCE_BYTES`; CodeCheckError otherwise, e.g.
    `pasted code: 1,200,000 bytes; the limit is 1,000,000 bytes per file`."""
    return _refuse_unreadable(text, "pasted code")


def read_upload(path: str | Path) -> tuple[str, str]:
    """(file name, text) of an uploaded file: a .py file of at most `MAX_SOURCE_BYTES` in UTF-8 (a BOM is
    dropped). Anything else is a one-line CodeCheckError naming the file and what is allowed."""
    p = Path(path)
    if p.suffix != ".py":
        raise CodeCheckError(f"{p.name}: only .py files are checked; upload Python source files ending in .py")
    try:
        size = p.stat().st_size
        if size > MAX_SOURCE_BYTES:
            raise CodeCheckError(f"{p.name}: {size:,} bytes; the limit is {MAX_SOURCE_BYTES:,} bytes per file")
        data = p.read_bytes()
    except OSError as exc:
        raise CodeCheckError(f"{p.name}: could not be read ({exc.strerror or type(exc).__name__}); upload it again")
    skip = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a BOM (Windows editors write one) is not source
    try:
        text = data[skip:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = skip + exc.start
        raise CodeCheckError(f"{p.name}: not UTF-8 text (byte 0x{data[at]:02x} at offset {at}); "
                             "upload Python source saved as UTF-8")
    return p.name, _refuse_unreadable(text, p.name)


def _analyse(text: str, filename: str) -> _FileResult:
    _refuse_unreadable(text, filename)
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
        return _analyse_tree(tree, text, filename)
    except RecursionError:
        raise CodeCheckError(f"{filename}: expressions nested too deeply to check (the visitor recurses once "
                             "per nesting level)")


def _analyse_tree(tree: ast.Module, text: str, filename: str) -> _FileResult:
    ctx = _Context(tree, filename)
    checker = _Checker(ctx)
    checker.visit(tree)
    writes = _env_writes(ctx)
    raw = checker.found + _env_findings(ctx, writes) + _scope_findings(ctx)
    findings = {}
    for node, rule_id, message, replacement in raw:
        rule = RULES[rule_id]
        f = Finding(filename, getattr(node, "lineno", 0), getattr(node, "col_offset", 0) + 1, rule.id,
                    rule.severity, message, replacement or rule.replacement)
        findings.setdefault((f.line, f.col, f.rule), f)
    kept = _apply_ignores(list(findings.values()), _ignores(text), filename)
    env = [EnvSetting(filename, w.node.lineno, w.name, w.value, not ctx.after_jax_import(w.node.lineno))
           for w in writes if w.name.startswith(ENV_PREFIXES)]
    monitoring = [MonitoringUse(filename, line, call) for line, call in _monitoring(ctx)]
    return _FileResult(sorted(kept, key=lambda f: (f.file, f.line, f.col, f.rule)), env, monitoring)


def check_source(text: str, filename: str = "<pasted>") -> list[Finding]:
    """Findings for one Python source text, sorted by line. Never executes it."""
    return _analyse(text, filename).findings


def check_sources(sources: list[tuple[str, str]]) -> CodeCheck:
    """Findings and facts for [(filename, text)]. Never executes the code."""
    results = [(name, _analyse(text, name)) for name, text in sources]
    return CodeCheck(files=tuple(name for name, _ in results),
                     findings=tuple(f for _, r in results for f in r.findings),
                     env_settings=tuple(e for _, r in results for e in r.env),
                     monitoring=tuple(m for _, r in results for m in r.monitoring))


def _read_source(path: str | Path) -> tuple[str, str]:
    p = Path(path)
    if p.suffix != ".py":
        raise CodeCheckError(f"{p}: only .py files are checked")
    if p.stat().st_size > MAX_BYTES:
        raise CodeCheckError(f"{p}: {p.stat().st_size:,} bytes; the limit is {MAX_BYTES:,} bytes per file")
    try:
        return str(p), p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise CodeCheckError(f"{p}: not UTF-8 text; only Python source is checked")


def check_paths(paths: Iterable[str | Path]) -> CodeCheck:
    """`check_sources` over files; the same errors as `check_files` (CodeCheckError, OSError)."""
    return check_sources([_read_source(p) for p in paths])


def check_files(paths: Iterable[str | Path]) -> list[Finding]:
    return list(check_paths(paths).findings)


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
