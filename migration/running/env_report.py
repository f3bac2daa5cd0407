"""What `python -m migration env` reports. Runs inside a worker (it initialises JAX)."""

from __future__ import annotations

import platform as _platform
import sys
from typing import Any

import flax
import jax
import jaxlib
import optax

from migration.running.worker_env import jax_env_in_effect, nvidia_gpus


def collect_environment() -> dict[str, Any]:
    devices = jax.devices()
    backend = jax.default_backend()
    warnings = []
    if backend == "cpu":
        warnings.append(
            "JAX runs on the CPU backend here: runs measure the CPU, and GPU targets can only be "
            "planned by compiling for them (no GPU figure is measured on this machine)."
        )
    gpus = nvidia_gpus()
    for g in gpus:
        if g["used_by_other_processes_bytes"]:
            warnings.append(
                f"GPU {g['index']} ({g['name']}): {g['used_by_other_processes_bytes'] / 2**30:.1f} GiB "
                "already in use by other processes; a run's memory share must leave room for them."
            )
    memory = []
    for d in devices:
        stats = d.memory_stats() or {}
        memory.append({"device": str(d), "bytes_limit": stats.get("bytes_limit"),
                       "bytes_in_use": stats.get("bytes_in_use")})
    return {
        "backend": backend,
        "devices": [{"id": d.id, "kind": d.device_kind, "platform": d.platform} for d in devices],
        "device_count": len(devices),
        "device_memory": memory,
        "versions": {
            "python": sys.version.split()[0],
            "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "flax": flax.__version__,
            "optax": optax.__version__,
        },
        "host": _platform.node(),
        "env": jax_env_in_effect(),
        "nvidia_gpus": gpus,
        "warnings": warnings,
    }
