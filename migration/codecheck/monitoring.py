"""Monitoring facts: where the code reads device memory or utilisation (`memory_stats`, pynvml,
nvidia-smi, a device memory profile) or captures a profiler trace (a timeline of the device's work).

Annotations (`StepTraceAnnotation`, `TraceAnnotation`, `annotate_function`) only name spans inside a
trace something else captures, and `jax.monitoring` listeners see JAX's own events (compiles); neither
reads memory or utilisation, so neither is listed."""

from __future__ import annotations

import ast

from migration.codecheck.ast_helpers import (const_str, last_name, walk)
from migration.codecheck.context import Context

MEMORY, UTILISATION, TRACE = "memory", "utilisation", "trace"
# what each kind tells about the job on the GPU; the checklist passes on memory or utilisation reads
TRACES = ("jax.profiler.trace", "jax.profiler.start_trace", "jax.profiler.start_server")
MEMORY_PROFILES = ("jax.profiler.device_memory_profile", "jax.profiler.save_device_memory_profile")


def monitoring_uses(ctx: Context) -> list[tuple[int, str, str]]:
    """(line, call, kind) for each read of device memory or utilisation, or profiler trace."""
    uses = []
    for node in ctx.of(ast.ImportFrom, ast.Call):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pynvml":
            uses += [(node.lineno, f"pynvml.{a.name}", _nvml_kind(a.name)) for a in node.names]
        elif isinstance(node, ast.Call):
            found = _monitoring_call(ctx, node)
            if found:
                uses.append((node.lineno, *found))
    return sorted(set(uses))


def _nvml_kind(name: str) -> str:
    return MEMORY if "Memory" in name else UTILISATION


def _monitoring_call(ctx: Context, node: ast.Call) -> tuple[str, str] | None:
    name = ctx.resolve(node.func)
    last = last_name(node.func)
    if last == "memory_stats":
        return "memory_stats", MEMORY
    if name.startswith("pynvml.") and last.startswith("nvml"):
        return name, _nvml_kind(last)
    if name in MEMORY_PROFILES:
        return name, MEMORY
    if name in TRACES:
        return name, TRACE
    if name.split(".")[0] in ("subprocess", "os") and any(
            "nvidia-smi" in s.value for a in node.args + [k.value for k in node.keywords] for s in walk(a)
            if const_str(s) is not None):
        return "nvidia-smi", UTILISATION
    return None
