"""A plan that came from outside this process (an uploaded file, an API value, `run --plan`) made
into a `Plan` this code can trust, or refused with a `ConfigError` naming the field.

A plan file is data, never configuration. Each field is checked against the type the planner
writes (`Plan`'s annotations: numbers finite, text bounded, lists and maps bounded in size and
depth); the choices a run depends on (workload, dimensions, TPU source, target GPU, precision,
remat, state sharding, batch arithmetic, GPUs and nodes) against the same limits as a request;
the catalog names are taken from the catalog; the free texts are cut to one printable line; and
the environment is rebuilt from those decisions (`deployment.environment_of`), whatever the file
said, so that no flag, path or variable in a file reaches a worker or a script.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from typing import Any, Union

from migration.common import ConfigError, shown
from migration.config.layouts import parse_layout
from migration.config.limits import LIMITS, MOMENT_DTYPES, PRECISIONS, REMAT_NAMES
from migration.config.requests import PlanRequest, check_model, validate_plan_request
from migration.planning.deployment import environment_of, one_line
from migration.hardware import GPU_SPECS, TPU_SPECS
from migration.results import Decision, Plan

MAX_PLAN_BYTES = 4 * 2**20  # a plan the planner writes is tens of kilobytes
MAX_TEXT_CHARS = 2000  # any one text in a plan
MAX_ITEMS = 5000  # entries of any one list or map (the search table of a large plan has hundreds)
MAX_DEPTH = 6  # nesting of free-form values (rows of the table, ranked choices)
STATUSES = ("ok", "infeasible")


def _shown(value: Any) -> str:
    """A value for a message: a list or a map by its type alone."""
    return type(value).__name__ if isinstance(value, (dict, list)) else shown(value)


def _plain(value: Any, depth: int = 0) -> bool:
    """A JSON value of bounded size and depth: finite numbers, bounded text, lists and string-keyed maps."""
    if value is None or isinstance(value, bool):
        return True
    if isinstance(value, int):
        return abs(value) < 2**63
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, str):
        return len(value) <= MAX_TEXT_CHARS
    if depth >= MAX_DEPTH:
        return False
    if isinstance(value, list):
        return len(value) <= MAX_ITEMS and all(_plain(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return (len(value) <= MAX_ITEMS and all(isinstance(k, str) and len(k) <= 200 for k in value)
                and all(_plain(v, depth + 1) for v in value.values()))
    return False


def _conforms(value: Any, kind: Any, depth: int = 0) -> bool:
    """Whether `value` (parsed JSON) is of the annotated type `kind`."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return _plain(value, depth)
    if origin in (Union, types.UnionType):
        return any(_conforms(value, a, depth) for a in args)
    if kind is type(None):
        return value is None
    if kind is bool:
        return isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool) and abs(value) < 2**63
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind is str:
        return isinstance(value, str) and len(value) <= MAX_TEXT_CHARS
    if origin is list:
        return isinstance(value, list) and len(value) <= MAX_ITEMS and all(_conforms(v, args[0], depth + 1) for v in value)
    if origin is dict:
        return (isinstance(value, dict) and len(value) <= MAX_ITEMS
                and all(_conforms(k, args[0]) for k in value) and all(_conforms(v, args[1], depth + 1)
                                                                       for v in value.values()))
    if dataclasses.is_dataclass(kind):
        hints = typing.get_type_hints(kind)
        return (isinstance(value, dict) and set(value) == set(hints)
                and all(_conforms(value[k], hints[k], depth + 1) for k in hints))
    return False


_HINTS = typing.get_type_hints(Plan)
_FIELDS = {f.name: f for f in dataclasses.fields(Plan)}


def _typed_fields(data: Any, where: str) -> dict[str, Any]:
    """The plan's known fields, each of its annotated type; ConfigError naming the first that is not."""
    if not isinstance(data, dict):
        raise ConfigError(where, f"must be a JSON object as `python -m migration plan --json` writes it; got {_shown(data)}")
    required = [n for n, f in _FIELDS.items()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ConfigError(where, f"missing {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}: made by an "
                                 "older version or not a plan; make it again with `python -m migration plan --json`")
    fields = {}
    for name, value in data.items():
        if name not in _HINTS:
            continue  # a field of a newer or older version: ignored, never used
        if not _conforms(value, _HINTS[name]):
            raise ConfigError(f"{where}.{name}", f"must be {_type_name(_HINTS[name])} as the planner writes it; "
                                              f"got {_shown(value)}")
        fields[name] = value
    return fields


def _type_name(kind: Any) -> str:
    return str(kind).replace("typing.", "").replace("<class '", "").replace("'>", "")


def _texts(value: Any) -> Any:
    """Every text inside `value` as one printable line (what a file says is shown, never obeyed)."""
    if isinstance(value, str):
        return one_line(value, MAX_TEXT_CHARS)
    if isinstance(value, list):
        return [_texts(v) for v in value]
    if isinstance(value, dict):
        return {one_line(k, 200): _texts(v) for k, v in value.items()}
    return value


STEP_TIME_SOURCES = ("compiled program", "analytic", "none")


def _check_step_time(plan: Plan) -> None:
    """The predicted step time's record as the planner writes it: a known source, an expected error
    and every figure a finite number from 0 (the app shows them; a file says nothing else there)."""
    st = plan.step_time
    if st and st.get("source") not in STEP_TIME_SOURCES:
        raise ConfigError("plan.step_time.source", f"must be one of {', '.join(STEP_TIME_SOURCES)}; "
                                                   f"got {_shown(st.get('source'))}")
    for key, value in st.items():
        if key in ("source", "method"):
            continue
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and 0 <= value < 1e15):
            raise ConfigError(f"plan.step_time.{key}", f"must be a number from 0 or null; got {_shown(value)}")
    if plan.predicted_step_s is not None and not 0 <= plan.predicted_step_s < 1e9:
        raise ConfigError("plan.predicted_step_s", f"must be from 0 seconds; got {plan.predicted_step_s}")


def _within(field: str, value: int, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise ConfigError(f"plan.{field}", f"must be from {lo:g} to {hi:g}; got {value}")


def checked_plan(data: Any, where: str = "plan") -> Plan:
    """`data` (a parsed plan, from anywhere) as a Plan whose every field this code has checked, and
    whose environment, target and source names it has rebuilt; ConfigError naming `where` and the
    field otherwise."""
    fields = _typed_fields(data, where)
    fields = {k: (v if k in ("model",) else _texts(v)) for k, v in fields.items()}
    fields["decisions"] = [Decision(**d) for d in fields.get("decisions", [])]
    plan = Plan(**fields)
    if plan.status not in STATUSES:
        raise ConfigError("plan.status", f"must be one of {', '.join(STATUSES)}; got {_shown(plan.status)}")
    if plan.source not in TPU_SPECS:
        raise ConfigError("plan.source", f"must be one of {', '.join(TPU_SPECS)}; got {_shown(plan.source)}")
    if plan.target != "local" and plan.target not in GPU_SPECS:
        raise ConfigError("plan.target", f"must be local or one of {', '.join(GPU_SPECS)}; got {_shown(plan.target)}")
    parse_layout(plan.sharding, "plan.sharding")
    for field, allowed in (("precision", PRECISIONS), ("remat", REMAT_NAMES), ("mu_dtype", MOMENT_DTYPES)):
        if getattr(plan, field) not in allowed:
            raise ConfigError(f"plan.{field}", f"must be one of {', '.join(allowed)}; got {_shown(getattr(plan, field))}")
    check_model(plan)
    model = {k: v for k, v in plan.model.items() if k != "attention"}
    # The request the plan answers, checked as any request is (GPUs and nodes, memory share, margin).
    validate_plan_request(PlanRequest(
        workload=plan.workload, preset=plan.preset, source=plan.source, global_batch=plan.requested_global_batch,
        target=plan.target, gpus=plan.gpus, gpus_per_node=plan.gpus_per_node,
        memory_fraction=plan.memory_fraction, safety_margin=plan.safety_margin, model=model,
        precision=plan.precision, remat=plan.remat, sharding=plan.sharding, source_slices=plan.source_slices,
        mu_dtype=plan.mu_dtype))
    _check_step_time(plan)
    if plan.nodes != max(1, -(-plan.gpus // plan.gpus_per_node)):
        raise ConfigError("plan.nodes", f"must be GPUs over GPUs per node ({plan.gpus} / {plan.gpus_per_node}); "
                                        f"got {plan.nodes}")
    if plan.ok:
        _within("per_device_batch", plan.per_device_batch, *LIMITS["per_device_batch"])
        _within("accumulation_steps", plan.accumulation_steps, *LIMITS["accumulation_steps"])
        if plan.global_batch != plan.per_device_batch * plan.gpus * plan.accumulation_steps:
            raise ConfigError("plan.global_batch", f"must be per_device_batch x gpus x accumulation_steps "
                                                   f"({plan.per_device_batch} x {plan.gpus} x {plan.accumulation_steps});"
                                                   f" got {plan.global_batch}")
    names = {"target_name": GPU_SPECS[plan.target].name if plan.target in GPU_SPECS else plan.target_name,
             "source_name": TPU_SPECS[plan.source].named(plan.source_slices),
             "source_devices": TPU_SPECS[plan.source].devices * plan.source_slices}
    plan = dataclasses.replace(plan, **names)
    return dataclasses.replace(plan, environment=environment_of(plan))


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not a number a plan holds")


def read_plan(text: str | bytes, where: str = "plan_file") -> Plan:
    """A plan from JSON text (a file's contents), checked by `checked_plan`; ConfigError naming
    `where` when it is not JSON within the size limit."""
    if len(text) > MAX_PLAN_BYTES:
        raise ConfigError(where, f"{len(text):,} bytes; a plan is at most {MAX_PLAN_BYTES:,} bytes")
    try:
        data = json.loads(text, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(where, f"not a plan written by `python -m migration plan --json` (not JSON: "
                                 f"{str(exc).splitlines()[0][:200]})") from None
    return checked_plan(data, where)
