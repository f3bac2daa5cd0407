"""Compiled figures by program: each lowered program is compiled once, wherever it comes from.

A planner's candidates are often one program under two names (remat policies that save the same
products, an accumulation that divides nothing), and the same program is asked for again by the TPU side,
a comparison and a later plan. Here a lowered program's figures are kept under a key of the program
itself (its StableHLO text without source locations), the devices it is compiled for, the compiler's
flags and which figures are read of it (`lowered_key`), in the cache of compiled figures
(compile_cache.py): a second request for the same program is a lookup, whatever produced it.

Those keys do not depend on the code that builds the programs, only on the packages that compile
(package_versions) and on this module and the reader of kernels (compile_cache.FIGURE_SOURCES): a change
to the workloads or the train step that leaves a program as it was keeps its figures, in the cache and in
the read-only store of the test suite, at the cost of one lowering.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from migration.common import is_oom
from migration.planning.compile_cache import PROGRAM_PREFIX, CompileCache, figures_fingerprint, package_versions
from migration.planning.hlo_cost import pack, read_program

# A failure message kept with a program the compiler said cannot fit (TPU messages list the largest buffers).
MESSAGE_CHARS = 20_000


# XLA's options for a GPU program compiled for its figures (a deviceless target's or this machine's GPU's: the
# executable is read, never run): each kernel's machine code built without LLVM's and ptxas' optimizations, and a
# kernel built once in this process taken from its own kernel cache after (the candidates of one search share most
# of their kernels). What XLA optimizes, fuses, schedules and assigns is the same program: the figures read of it
# are identical (tests/test_compile_options.py); bench/gpu_compile_options.py measures the time saved.
GPU_FIGURE_OPTIONS = {"xla_gpu_disable_gpuasm_optimizations": True, "xla_backend_optimization_level": 0,
                      "xla_gpu_enable_llvm_module_compilation_parallelism": True}
_KERNEL_CACHE: dict[int, str] = {}  # process id -> the folder of that process's kernel cache
# A process that plans many models (a test run) starts its kernel cache afresh past this size: XLA reads the
# whole file at each compile. One plan's search writes a few MB (llama 8B for 256 H100s: 9 MB).
KERNEL_CACHE_MAX_BYTES = 256 * 2**20


def new_kernel_cache() -> None:
    """Forget this process's kernel caches: the next GPU compile for figures starts a cold one."""
    _KERNEL_CACHE.pop(os.getpid(), None)


def figure_compile_options(devices: Any) -> dict[str, Any]:
    """The options `figures_of_program` compiles with for `devices`: GPU_FIGURE_OPTIONS and a kernel cache
    private to this process (a folder of its own, removed when it exits; started afresh past
    KERNEL_CACHE_MAX_BYTES) for a GPU program; none otherwise."""
    first = next(iter(getattr(devices, "flat", devices)), None)
    if getattr(first, "platform", "") != "gpu":
        return {}
    pid = os.getpid()
    if pid not in _KERNEL_CACHE:
        folder = tempfile.mkdtemp(prefix="migration-kernels-")
        atexit.register(shutil.rmtree, folder, True)
        _KERNEL_CACHE[pid] = folder
    kind = hashlib.sha256(str(getattr(first, "device_kind", "")).encode()).hexdigest()[:12]
    path = os.path.join(_KERNEL_CACHE[pid], f"kernels-{kind}.bin")  # one per GPU kind: no kernel crosses targets
    if os.path.exists(path) and os.path.getsize(path) > KERNEL_CACHE_MAX_BYTES:
        os.remove(path)
    return {**GPU_FIGURE_OPTIONS, "xla_gpu_kernel_cache_file": path}


class CompileOOM(RuntimeError):
    """The compiler said the program needs more memory than the device has (kept as a figure: asked again,
    the same message is raised without compiling)."""


def compiled_peak_bytes(compiled: Any) -> int | None:
    """Peak device bytes of a compiled program from its memory analysis: arguments + outputs -
    aliased (donated) + temporaries. None where the backend gives no analysis."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


def train_step_figures(compiled: Any, batch_bytes: int, kernels: bool, per_node: int | None,
                       fp32_unit: str) -> dict[str, Any]:
    """What is kept of a compiled train step: its peak bytes per device, the bytes of its state arguments
    (all arguments but the batch's `batch_bytes` per device), and with `kernels` its kernels and collectives
    (hlo_cost.pack; a TPU's fp32 products as bf16 passes, `fp32_unit`)."""
    stats = compiled.memory_analysis()
    state = None if stats is None else int(stats.argument_size_in_bytes) - batch_bytes
    found: dict[str, Any] = {"peak_bytes": compiled_peak_bytes(compiled), "state_bytes": state}
    if kernels:
        found["kernels"] = pack(read_program(compiled.as_text(), fp32_unit, per_node))
    return found


def serving_figures(compiled: Any) -> dict[str, Any]:
    """What is kept of a compiled serving program: its peak, donated and temporary bytes and its kernels."""
    stats = compiled.memory_analysis()
    return {"peak_bytes": compiled_peak_bytes(compiled), "donated_bytes": int(stats.alias_size_in_bytes),
            "temp_bytes": int(stats.temp_size_in_bytes), "kernels": pack(read_program(compiled.as_text()))}


def lowered_key(lowered: Any, devices: Any, target: Any, reading: Any) -> str:
    """The key of a lowered program's figures: the program's text (no source locations: an edit that moves
    code keeps its programs), the devices it is compiled for (platform, kind, ids in mesh order) and the
    `target` they stand for (a deviceless target's configuration), the compiler's flags, the packages
    that compile, the code that reads the figures and what is read (`reading`)."""
    text = lowered.as_text(debug_info=False)
    found = list(getattr(devices, "flat", devices))
    device_part = [getattr(found[0], "platform", ""), str(getattr(found[0], "device_kind", "")),
                   getattr(devices, "shape", None) and list(devices.shape), [int(d.id) for d in found]]
    tpu_flags = os.environ.get("LIBTPU_INIT_ARGS", "")  # migration: ignore[TPUENV001] libtpu's flags shape its compile
    parts = [package_versions(), figures_fingerprint(), hashlib.sha256(text.encode()).hexdigest(), device_part,
             target, reading, os.environ.get("XLA_FLAGS", ""), tpu_flags]
    return PROGRAM_PREFIX + hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def figures_of_program(lowered: Any, devices: Any, target: Any, reading: tuple[Any, ...],
                       read: Callable[[Any], dict[str, Any]], where: str,
                       cache: CompileCache | None = None) -> dict[str, Any]:
    """`read(compiled)` of `lowered` compiled for `devices`, kept in the cache of compiled figures under
    `lowered_key` (with `where`: how the figures were made, and `compile_s`: how long the compile took), or
    what was kept there. A program the compiler found over the device's memory raises CompileOOM with the
    compiler's message, the first time and each time after; other failures raise what XLA raises."""
    cache = cache if cache is not None else CompileCache()
    key = lowered_key(lowered, devices, target, reading)
    found = cache.get(key, keep=True)  # kept where a store answered: the next store, written from caches, has it
    if found is None:
        t0 = time.perf_counter()
        try:
            compiled = lowered.compile(figure_compile_options(devices))
        except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
            if not is_oom(str(exc)):
                raise
            found = {"oom": str(exc)[:MESSAGE_CHARS]}
        else:
            found = read(compiled)
        seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
        found = {**found, "compile_s": round(seconds, 2), "where": where}
        cache.put(key, found)
    if "oom" in found:
        raise CompileOOM(found["oom"])
    return {k: v for k, v in found.items() if k != "where"}
