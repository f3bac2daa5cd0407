"""Workload registry: name -> workload object (see `workloads.base.Workload`).

Importing this package imports JAX and Flax but does not initialise any backend.
"""

from __future__ import annotations

from workloads.base import Workload
from workloads.cnn import WORKLOAD as _cnn
from workloads.mlp import WORKLOAD as _mlp
from workloads.transformer import WORKLOAD as _transformer

WORKLOADS: dict[str, Workload] = {w.name: w for w in (_mlp, _cnn, _transformer)}


def get_workload(name: str) -> Workload:
    return WORKLOADS[name]
