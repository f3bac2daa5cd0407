"""The one place that chooses where runs execute: this machine (`LocalExecutor`), or a Ray cluster."""

from __future__ import annotations

from typing import Any

from migration.running.runner import LocalExecutor


def make_executor(ray_address: str = "") -> Any:
    """This machine, or (given an address, from MIGRATION_RAY_ADDRESS) a Ray cluster. Raises
    `ExecutorError` when the cluster cannot be used."""
    if not ray_address:
        return LocalExecutor()
    # reason: imports ray, an optional package, only when a cluster is configured
    from migration.cluster.ray_cluster import RayExecutor

    return RayExecutor.connect(ray_address)
