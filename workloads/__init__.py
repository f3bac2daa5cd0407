"""Workload registry: name -> workload object (see `workloads.base.Workload`).

Three ways in: the built-in workloads; workloads a team installs on the box as a Python package
declaring an entry point in the group `jax_migration.workloads` (name = "package.module:OBJECT",
loaded when this package is imported, and so listed by the app); and, on the command line only, a
reference `package.module:OBJECT` given as the workload name (`resolve_workload`). The app never
resolves references: it offers registered names only, and never imports code a user sends.

Importing this package imports JAX and Flax but does not initialise any backend.
"""

from __future__ import annotations

import importlib
import logging
from importlib import metadata

from workloads.base import ModelConfigError, Workload
from workloads.cnn import WORKLOAD as _cnn
from workloads.mlp import WORKLOAD as _mlp
from workloads.decoders import LLAMA as _llama, WORKLOAD as _transformer
from workloads.moe import WORKLOAD as _moe

ENTRY_POINT_GROUP = "jax_migration.workloads"
WORKLOADS: dict[str, Workload] = {w.name: w for w in (_mlp, _cnn, _transformer, _llama, _moe)}
BUILTIN = tuple(WORKLOADS)
# References are resolved only in processes that allow them: the command line and workers.
_REFERENCES_ALLOWED = [False]
# Entry points that could not be loaded: name -> one line, for `python -m migration env` and the app.
BROKEN_ENTRY_POINTS: dict[str, str] = {}


class WorkloadError(ValueError):
    """A workload reference cannot be loaded or is not a workload. One line."""


def _checked(obj: object, where: str) -> Workload:
    if isinstance(obj, type) and issubclass(obj, Workload):
        obj = obj()
    if not isinstance(obj, Workload):
        raise WorkloadError(f"{where} is a {type(obj).__name__}, not a workloads.base.Workload")
    return obj


def _load_entry_points() -> None:
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN:
            BROKEN_ENTRY_POINTS[ep.name] = f"entry point {ep.value} would replace the built-in {ep.name}; ignored"
            continue
        try:
            WORKLOADS[ep.name] = _checked(ep.load(), f"entry point {ep.name} = {ep.value}")
        except Exception as exc:  # noqa: BLE001 - a team's broken package must not take the registry down
            BROKEN_ENTRY_POINTS[ep.name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            logging.getLogger(__name__).warning("workload entry point %s not loaded: %s", ep.name,
                                                BROKEN_ENTRY_POINTS[ep.name])


def is_reference(name: str) -> bool:
    return isinstance(name, str) and ":" in name


def allow_references(allowed: bool = True) -> None:
    """Let `resolve_workload` import `package.module:OBJECT` references (the CLI and workers do;
    the app does not)."""
    _REFERENCES_ALLOWED[0] = allowed


def resolve_workload(name: str) -> Workload:
    """A registered workload, or (command line and workers only) `package.module:OBJECT` imported
    and registered under that reference."""
    if name in WORKLOADS:
        return WORKLOADS[name]
    if not is_reference(name):
        raise KeyError(name)
    if not _REFERENCES_ALLOWED[0]:
        raise WorkloadError(f"workload references like {name} are accepted on the command line only; here the "
                            f"registered workloads are {', '.join(WORKLOADS)} (a team registers its own through the "
                            f"'{ENTRY_POINT_GROUP}' entry point group)")
    module_name, _, attr = name.partition(":")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise WorkloadError(f"cannot load {name}: {type(exc).__name__}: {exc}") from exc
    WORKLOADS[name] = _checked(obj, name)
    return WORKLOADS[name]


def get_workload(name: str) -> Workload:
    return resolve_workload(name)


_load_entry_points()

__all__ = ["WORKLOADS", "allow_references", "is_reference", "ModelConfigError", "Workload", "WorkloadError", "get_workload", "resolve_workload"]
