"""The environment a worker runs in, and what `python -m migration env` reports.

JAX reads XLA_PYTHON_CLIENT_PREALLOCATE, XLA_PYTHON_CLIENT_MEM_FRACTION, XLA_FLAGS, JAX_PLATFORMS,
JAX_NUM_CPU_DEVICES and CUDA_VISIBLE_DEVICES only before it initialises, so they are decided here,
without importing JAX, and set by the worker before its first `import jax`. GPU presence is
detected through NVML, which does not touch a CUDA context, so the calling process (a server on a
shared box) never claims GPU memory.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Mapping

from migration.config.requests import PlanRequest, RunConfig
from migration.config.distributed import devices_per_process
from migration.hardware import nvidia_gpus

# Variables that change what JAX/XLA do; reported by `env` and recorded with every run.
JAX_ENV_VARS = (
    "JAX_PLATFORMS",
    "JAX_NUM_CPU_DEVICES",
    "JAX_ENABLE_X64",
    "JAX_DEFAULT_MATMUL_PRECISION",
    "JAX_COMPILATION_CACHE_DIR",
    "JAX_SKIP_CUDA_CONSTRAINTS_CHECK",
    "XLA_FLAGS",
    "XLA_PYTHON_CLIENT_PREALLOCATE",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_ALLOCATOR",
    "CUDA_VISIBLE_DEVICES",
    "TF_CPP_MIN_LOG_LEVEL",
    "TPU_WORKER_HOSTNAMES",
    "TPU_ACCELERATOR_TYPE",
)


# The server's secrets: the users file and passwords, Ray's token. No worker needs them, and a
# worker runs user-chosen work, so none is passed on (`without_secrets`).
SECRET_VARIABLES = ("MIGRATION_AUTH", "MIGRATION_AUTH_FILE", "RAY_AUTH_TOKEN", "GRADIO_AUTH")
SECRET_MARKERS = ("PASSWORD", "SECRET", "TOKEN", "CREDENTIAL", "PRIVATE_KEY")


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less the server's secrets and anything whose name says it is one."""
    return {k: v for k, v in env.items()
            if k not in SECRET_VARIABLES and not any(m in k.upper() for m in SECRET_MARKERS)}


def resolve_platform(platform: str) -> str:
    """'auto' -> 'gpu' when NVML (or, without nvidia-ml-py, the driver's device nodes) shows an
    NVIDIA GPU, else 'cpu'."""
    if platform != "auto":
        return platform
    if nvidia_gpus() or glob.glob("/proc/driver/nvidia/gpus/*"):
        return "gpu"
    return "cpu"


def worker_environment(cfg: RunConfig, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The full environment for a worker running `cfg` (base: the caller's environment)."""
    env = without_secrets(os.environ if base is None else base)
    platform = resolve_platform(cfg.platform)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true" if cfg.preallocate else "false"
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{cfg.memory_fraction:.3g}"
    flags = " ".join(f for f in (env.get("XLA_FLAGS", ""), cfg.xla_flags) if f)
    if flags:
        env["XLA_FLAGS"] = flags
    if cfg.matmul_precision == "highest":
        env["JAX_DEFAULT_MATMUL_PRECISION"] = "highest"
    if platform == "cpu":
        env["JAX_PLATFORMS"] = "cpu"
        env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process(cfg))
    else:
        env["JAX_PLATFORMS"] = "cuda"
        if cfg.visible_devices:
            env["CUDA_VISIBLE_DEVICES"] = cfg.visible_devices
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    return env


# XLA flags of the serving programs, planned and run alike: no dot merging, so that a decode step reads
# each weight once (the merger joins a layer's queries and keys-and-values projections into one product
# by concatenating their weights, a copy of them every step, when they are under the threshold).
SERVING_XLA_FLAGS = "--xla_gpu_dot_merger_threshold_mb=0"


def with_serving_flags(env: dict[str, str]) -> dict[str, str]:
    """`env` with SERVING_XLA_FLAGS added to its XLA flags (a serving process's, before JAX is imported)."""
    env["XLA_FLAGS"] = " ".join(f for f in (env.get("XLA_FLAGS", ""), SERVING_XLA_FLAGS) if f)
    return env


# XLA's own rematerialisation pass: off for planning, so that a fit never hides recomputation.
DISABLE_XLA_REMAT = "--xla_disable_hlo_passes=rematerialization"
# LLVM's optimisation of machine code that never runs: off where a process compiles only to read the
# program. Buffer assignment, and so every memory figure, and the optimised HLO the step time is read from
# come before code generation; a CPU plan then compiles in about half the time (tests/test_memory_properties.py
# compares figures compiled with and without it).
NO_CODEGEN_OPTIMISATION = "--xla_backend_optimization_level=0"


# libtpu, compiling for a TPU slice without its chips, first looks for the TPU host it runs on and logs
# that it found none unless these say: a compiling process is its own host (the slice compiled for is the
# topology asked for, whatever these name). It also writes a log file to /tmp/tpu_logs each time a process
# loads it (about 5 KB; a hosted server's planner workers load it for every TPU plan, 1,800 files in a day
# of test runs here) and never removes them: TPU_LOG_DIR=disabled keeps its log on stderr only, unless the
# caller set a folder of their own (tests/test_tpu_source.py shows libtpu reads the variable).
LIBTPU_COMPILE_ONLY = {"TPU_WORKER_HOSTNAMES": "localhost", "TPU_ACCELERATOR_TYPE": "v5p-8",
                       "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_LOG_DIR": "disabled"}


def compile_environment(base: Mapping[str, str] | None = None, platform: str = "cpu") -> dict[str, str]:
    """The environment of a process that compiles to read programs, not to run them: no preallocation,
    XLA's own rematerialisation off, machine code left unoptimised, and (platform "cpu") deviceless GPU
    compiles through the CUDA plugin. A planner worker's, and the `serve-plan` command's before it imports JAX."""
    env = without_secrets(os.environ if base is None else base)
    given = env.get("XLA_FLAGS", "")
    flags = [f for f in (given,) if f] + [DISABLE_XLA_REMAT]
    if "xla_backend_optimization_level" not in given:  # the caller's own level stands
        flags.append(NO_CODEGEN_OPTIMISATION)
    env["XLA_FLAGS"] = " ".join(flags)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    env["JAX_PLATFORMS"] = platform
    for name, value in LIBTPU_COMPILE_ONLY.items():
        env.setdefault(name, value)
    return env


def planner_environment(req: PlanRequest, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment of a planner worker. Compiles never allocate, and XLA's automatic
    rematerialisation is disabled so that a predicted fit never hides recomputation.

    A catalog target compiles deviceless on the CPU backend (the CUDA plugin still compiles for
    the described GPU). "local" compiles for this machine's devices without preallocating, with
    the request's memory share, so that the limit the device reports is the job's budget."""
    on_cpu = req.target != "local" or resolve_platform("auto") == "cpu"
    env = compile_environment(base, "cpu" if on_cpu else "cuda")
    if req.target == "local":
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{req.memory_fraction:.3g}"
        if on_cpu:
            env["JAX_NUM_CPU_DEVICES"] = str(req.gpus)
    return env


def jax_env_in_effect(env: Mapping[str, str] | None = None) -> dict[str, str]:
    env = os.environ if env is None else env
    return {k: env[k] for k in JAX_ENV_VARS if k in env}
