"""Monitoring facts: where the code reads device memory or utilisation (`memory_stats`, pynvml,
nvidia-smi) or starts a profiler or monitoring hook."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import const_str, last_name
from migration.codecheck.context import Context


def monitoring_uses(ctx: Context) -> list[tuple[int, str]]:
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


def _monitoring_call(ctx: Context, node: ast.Call) -> str | None:
    name = ctx.resolve(node.func)
    last = last_name(node.func)
    if last == "memory_stats":
        return "memory_stats"
    if name.startswith("pynvml.") and last.startswith("nvml"):
        return name
    if name.startswith(("jax.profiler.", "jax.monitoring.")):
        return name
    if name.split(".")[0] in ("subprocess", "os") and any(
            "nvidia-smi" in s.value for a in node.args + [k.value for k in node.keywords] for s in ast.walk(a)
            if const_str(s) is not None):
        return "nvidia-smi"
    return None

