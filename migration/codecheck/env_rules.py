"""Environment rules and facts: every place the code sets an environment variable, ENV001 for JAX/XLA
variables set after the first JAX import, and TPU001 / PREC001 for variables that select the TPU or
leave the matmul precision to the platform."""

from __future__ import annotations

import ast
import dataclasses

from migration.codecheck.ast_helpers import const_str
from migration.codecheck.cloud_rules import is_tpu_env
from migration.codecheck.context import Context
from migration.codecheck.family import RawFinding
from migration.codecheck.vocabulary import ENV_PREFIXES, LOW_PRECISION, PLATFORM_ENV


@dataclasses.dataclass(frozen=True)
class EnvWrite:
    node: ast.AST
    name: str
    value: str | None


def env_writes(ctx: Context) -> list[EnvWrite]:
    """Every `os.environ[...] = / += ...`, `os.environ.update/setdefault(...)` and `os.putenv(...)`."""
    writes = []
    for node in ctx.of(ast.Assign, ast.AnnAssign, ast.AugAssign, ast.Call):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in getattr(node, "targets", [getattr(node, "target", None)]):
                key = const_str(target.slice) if isinstance(target, ast.Subscript) \
                    and ctx.resolve(target.value) == "os.environ" else None
                if key:
                    value = None if isinstance(node, ast.AugAssign) else const_str(node.value)
                    writes.append(EnvWrite(node, key, value))
        elif isinstance(node, ast.Call):
            writes += _env_call_writes(ctx, node)
    return sorted(writes, key=lambda w: (w.node.lineno, w.node.col_offset))


def _env_call_writes(ctx: Context, node: ast.Call) -> list[EnvWrite]:
    name = ctx.resolve(node.func)
    if name in ("os.environ.setdefault", "os.putenv") and node.args and const_str(node.args[0]):
        value = const_str(node.args[1]) if len(node.args) > 1 else None
        return [EnvWrite(node, const_str(node.args[0]), value)]
    if name != "os.environ.update":
        return []
    pairs = [(const_str(k), v) for a in node.args if isinstance(a, ast.Dict) for k, v in zip(a.keys, a.values)]
    pairs += [(k.arg, k.value) for k in node.keywords]
    return [EnvWrite(node, key, const_str(value)) for key, value in pairs if key]


def env_findings(ctx: Context, writes: list[EnvWrite]) -> list[RawFinding]:
    found = []
    for w in writes:
        if w.name.startswith(ENV_PREFIXES) and ctx.after_jax_import(w.node.lineno):
            line, module = ctx.jax_import
            via = "" if module == "jax" else ", which imports JAX"
            found.append((w.node, "ENV001", f"`{w.name}` is set after `import {module}` (line {line}){via}", None))
        if w.name in PLATFORM_ENV and "tpu" in (w.value or "").lower().split(","):
            found.append((w.node, "TPU001", f"`{w.name}={w.value}` makes JAX look for a TPU", None))
        if is_tpu_env(w.name):
            found.append((w.node, "TPUENV001", f"`{w.name}` is set: only the TPU runtime reads it", None))
        if w.name == "JAX_DEFAULT_MATMUL_PRECISION" and (w.value or "").lower() in LOW_PRECISION:
            found.append((w.node, "PREC001", f"`{w.name}={w.value}`: TPU and GPU run it differently", None))
    return found

