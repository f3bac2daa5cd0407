"""Raw values from a form or an API call -> validated configs.

Every refusal is a `ConfigError(field, message)`: one line naming the field, the value received and
what is allowed. Nothing is coerced silently: 256.0 and " 256 " are the whole number 256, but 256.5,
True, None, NaN and "256.5" are refused rather than rounded or guessed at.

This module imports no JAX at module level (choices that need the workload catalog import it when
called) and no UI toolkit at all, so the app, the API and the CLI share it.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import numbers
import re
import unicodedata
from pathlib import Path
from typing import Any

from migration.common import ConfigError, one_of, shown
from migration.config.layouts import parse_layout
from migration.hardware import parse_tpu_slice
from migration.config.fields import AUTO, DIMENSIONS, FIELD, FIELDS, LABEL_MAX_CHARS, Field
from migration.config.requests import CHECKPOINT_META_FILE, PlanRequest, validate_plan_request
from migration.prices import parse_prices

_WHOLE_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_TEXT_MAX = 100  # longer numeric text is refused before parsing (int() of 5,000 digits raises)
# Characters a one-line label must not hold: controls (Cc), lone surrogates (Cs), line and paragraph
# separators (Zl, Zp) and the bidirectional overrides that reorder how the text around them displays.
_BIDI = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")




def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounds(lo: float, hi: float, integer: bool) -> str:
    return f"{int(lo)} to {int(hi)}" if integer else f"{lo:g} to {hi:g}"


def whole(value: Any, field: str, lo: float, hi: float, *, note: str = "") -> int:
    """`value` as an int in [lo, hi]: an int, an integral float (256.0) or a string of ASCII digits with
    optional surrounding spaces (" 256 "). Refuses bool, None, NaN, ±inf, fractions, other text and values
    out of range with a ConfigError naming `field`; `note` is added after the range (e.g. what 0 means)."""
    allowed = f"must be a whole number from {_bounds(lo, hi, True)}{note}; got {shown(value)}"
    parsed: int | None = None
    if isinstance(value, str):
        text = value.strip()
        if len(text) <= _TEXT_MAX and _WHOLE_TEXT.fullmatch(text):
            parsed = int(text)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        parsed = int(value)
    elif _is_number(value):
        try:
            if math.isfinite(value) and value == math.floor(value):
                parsed = int(value)
        except (OverflowError, ValueError, TypeError):
            parsed = None
    if parsed is None or not lo <= parsed <= hi:
        raise ConfigError(field, allowed)
    return parsed


def number(value: Any, field: str, lo: float, hi: float) -> float:
    """`value` as a finite float in [lo, hi]: an int, a float or a decimal string ("3e-4", " 0.8 ").
    Refuses bool, None, NaN, ±inf, other text and values out of range with a ConfigError naming `field`."""
    allowed = f"must be a number from {_bounds(lo, hi, False)}; got {shown(value)}"
    parsed: float | None = None
    try:
        if isinstance(value, str):
            text = value.strip()
            if len(text) <= _TEXT_MAX and _NUMBER_TEXT.fullmatch(text):
                parsed = float(text)
        elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
            # Compare exactly first: float() of an int beyond 1e308 raises OverflowError.
            parsed = float(value) if lo <= int(value) <= hi else None
        elif _is_number(value):
            parsed = float(value)
    except (OverflowError, ValueError, TypeError):
        parsed = None
    if parsed is None or not math.isfinite(parsed) or not lo <= parsed <= hi:
        raise ConfigError(field, allowed)
    return parsed


def choice(value: Any, field: str, allowed: tuple[str, ...] | list[str]) -> str:
    """`value` if it is one of `allowed` (exactly: no case folding, no stripping)."""
    if not isinstance(value, str) or value not in allowed:
        raise ConfigError(field, f"must be one of {one_of(allowed)}; got {shown(value)}")
    return value


def label_text(value: Any, field: str = "label", max_chars: int = LABEL_MAX_CHARS) -> str:
    """A one-line label: text of at most `max_chars` characters once stripped, with no control
    characters, line breaks or bidirectional overrides anywhere in it."""
    if not isinstance(value, str):
        raise ConfigError(field, f"must be text of at most {max_chars} characters; got {shown(value)}")
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in _BIDI:
            raise ConfigError(field, f"must be one line of text without control characters; got {shown(value)} "
                                     f"(U+{ord(ch):04X} at position {i})")
    text = value.strip()
    if len(text) > max_chars:
        raise ConfigError(field, f"must be at most {max_chars} characters; got {len(text)} characters: "
                                 f"{shown(value)}")
    return text


def flag(value: Any, field: str) -> bool:
    """A checkbox: true or false (1 and 0 too, as JSON clients send them); nothing else."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    raise ConfigError(field, f"must be true or false; got {shown(value)}")


def parse(field: Field, value: Any, *, hi: float | None = None, note: str = "") -> Any:
    """One field's raw value from a form, an API call or the command line, checked and converted by its
    kind; `hi` lowers an int's upper limit (a server's), which `note` then names."""
    name = field.target
    if field.kind == "int":
        lo, top = field.bounds()
        zero = f" (0: {field.zero})" if field.zero else ""
        return whole(value, name, lo, top if hi is None else hi, note=note or zero)
    if field.kind == "float":
        return number(value, name, *field.bounds())
    if field.kind == "choice":
        return choice(value, name, field.allowed())
    if field.kind == "layout":
        return value if value == AUTO else parse_layout(value, name).name
    if field.kind == "bool":
        return flag(value, name)
    if field.kind == "folder":
        return checkpoint_name(value, name)
    if field.kind == "prices":
        return parse_prices(value, name)
    return label_text(value, name, 400 if field.name == "source_remat" else LABEL_MAX_CHARS)


def raw_values(fields: tuple[Field, ...], values: tuple[Any, ...], named: dict[str, Any]) -> dict[str, Any]:
    """Field name -> raw value: `values` in the fields' order, then `named`, then each field's default."""
    if len(values) > len(fields):
        raise TypeError(f"{len(values)} values for {len(fields)} fields")
    raw = {f.name: f.default for f in fields}
    raw.update(zip((f.name for f in fields), values))
    unknown = sorted(set(named) - set(raw))
    if unknown:
        raise TypeError(f"unknown field {unknown[0]!r}; the fields are {', '.join(raw)}")
    raw.update(named)
    return raw


PLAN_FIELDS = tuple(f for f in FIELDS if f.fills == "plan")  # the form's first, in their API order


MODEL_DIMENSIONS = (*DIMENSIONS, "embeddings")  # the form's model fields, in order


def model_dimensions(**raw: Any) -> dict[str, Any]:
    """The model overrides from the form's model fields (MODEL_DIMENSIONS, raw; those not given are the
    preset's): a dimension's 0 and embeddings "preset" keep the preset's. ConfigError naming the field."""
    model: dict[str, Any] = {}
    for name in MODEL_DIMENSIONS:
        value = parse(FIELD[name], raw.get(name, FIELD[name].default))
        if name == "embeddings":
            if value != "preset":
                model["tied_embeddings"] = value == "tied"
        elif value:
            model[name] = value
    return model


def plan_request(*values: Any, registered_only: bool = True, extra_model: dict[str, Any] | None = None,
                 **named: Any) -> PlanRequest:
    """A validated PlanRequest from the plan fields' raw values (`FIELDS`' "plan" fields, positionally in
    their order or by name; a field not given takes its default). The form's conventions: an int's 0
    where it has a meaning (per-core batch 0 is global batch / the TPU's cores, accumulation 0 lets the
    planner choose, a dimension 0 keeps the preset's) and "auto" choices become the planner's to make.
    With `registered_only` (the app) the workload must be a registered one: the app never imports a
    module named in a request. `extra_model`: config fields the form has no field for (the command line's
    --dim), checked by the workload with the rest. Raises ConfigError naming the first bad field, including
    settings that contradict each other."""
    raw = raw_values(PLAN_FIELDS, values, named)
    kwargs: dict[str, Any] = {}
    model: dict[str, Any] = dict(extra_model or {})
    named_slices = 1
    for f in PLAN_FIELDS:
        value = raw[f.name]
        if f.name in MODEL_DIMENSIONS:
            if f.name == MODEL_DIMENSIONS[0]:  # the model's fields together, where the first stands
                model.update(model_dimensions(**{name: raw[name] for name in MODEL_DIMENSIONS}))
            continue
        if f.name == "preset" and registered_only:
            value = choice(value, "preset", preset_choices(kwargs["workload"]))
        elif f.name == "source":  # a slice as Google Cloud names it, or N of them ("2xv6e-256")
            value, named_slices = parse_tpu_slice(value)
        elif f.kind == "choice" and not registered_only and f.name in ("workload", "preset"):
            value = label_text(value, f.name, 200)  # a reference or a team's preset: the workload checks it
        else:
            value = parse(f, value)
        if f.name == "attention":
            if value != AUTO:
                model["attention"] = value
        elif f.name == "mlp":
            if value != "preset":
                model["mlp"] = value
        elif f.name == "layer_loop":
            if value != FIELD["layer_loop"].default:
                model["layer_loop"] = value
        else:
            auto = f.kind in ("choice", "layout") and value == AUTO
            kwargs[f.target] = None if auto or (f.zero and value == 0) else value
    if named_slices > 1:
        if kwargs.get("source_slices", 1) not in (1, named_slices):
            raise ConfigError("source_slices", f"the source names {named_slices} slices ({raw['source']}); "
                                               f"got {kwargs['source_slices']}")
        kwargs["source_slices"] = named_slices
    return validate_plan_request(PlanRequest(**kwargs, model=model))


def signature(fields: tuple[Field, ...], **keywords: Any) -> inspect.Signature:
    """A function's signature with one parameter per field (its default), then `keywords` (keyword-only):
    what `help()` and introspection see of a function that takes the fields positionally or by name."""
    kind, only = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
    return inspect.Signature([*(inspect.Parameter(f.name, kind, default=f.default) for f in fields),
                              *(inspect.Parameter(k, only, default=v) for k, v in keywords.items())])


plan_request.__signature__ = signature(PLAN_FIELDS, registered_only=True)  # type: ignore[attr-defined]


def preset_choices(workload: str) -> tuple[str, ...]:
    # reason: the workloads import JAX (not its backend); kept out of this module's import
    from workloads import WORKLOADS

    return tuple(WORKLOADS[workload].presets)


CHECKPOINT_NAME_MAX = 64
_CHECKPOINT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*", re.ASCII)


def checkpoint_name(value: Any, field: str) -> str:
    """A checkpoint folder's name as a form gives it ("" for none): letters, digits, '.', '_' and
    '-', not starting with '.'. The server keeps checkpoints in its own private folder, so a path
    (absolute, with a separator, or with '..') is refused, saying so."""
    text = label_text(value, field, CHECKPOINT_NAME_MAX)
    rule = (f"a folder name of letters, digits, '.', '_' and '-' (at most {CHECKPOINT_NAME_MAX} characters, not "
            "starting with '.'), like run-1, kept in this server's private checkpoint folder")
    if not text:
        return ""
    if text.startswith(("/", "\\", "~")) or re.match(r"[A-Za-z]:", text):
        raise ConfigError(field, f"absolute paths are not allowed; give {rule}; got {shown(value)}")
    if ".." in re.split(r"[/\\]", text):
        raise ConfigError(field, f"'..' is not allowed; give {rule}; got {shown(value)}")
    if not _CHECKPOINT_NAME.fullmatch(text):
        raise ConfigError(field, f"must be {rule}; got {shown(value)}")
    return text


def user_folder(user: str) -> str:
    """A folder name for one user's private files: readable, and distinct for distinct user names."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", user)[:32] or "local"
    return f"{readable}-{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def checkpoint_folder(value: Any, field: str, root: Path) -> str:
    """The folder of the checkpoint a form names (checkpoint_name) under `root` (the user's private
    checkpoint folder), which must hold one; "" for none."""
    name = checkpoint_name(value, field)
    if name and not (root / name / CHECKPOINT_META_FILE).is_file():
        have = sorted(p.parent.name for p in root.glob(f"*/{CHECKPOINT_META_FILE}"))
        raise ConfigError(field, f"no checkpoint named {name!r}; yours: {', '.join(have) if have else 'none yet'} "
                                 "(save one with 'Save a checkpoint after the run')")
    return str(root / name) if name else ""


def checkpoint_folders(save: Any, restore: Any, root: Path) -> tuple[str, str]:
    """(save_checkpoint, restore_checkpoint) for a RunConfig from the form's two names, resolved
    under `root` (the user's private checkpoint folder); a restore name must name a checkpoint there."""
    save_name = checkpoint_name(save, "save_checkpoint")
    return str(root / save_name) if save_name else "", checkpoint_folder(restore, "restore_checkpoint", root)


RUN_FIELDS = tuple(f for f in FIELDS if f.fills in ("run", "options"))


def run_values(*values: Any, max_steps: int | None = None, **named: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(run config fields, run options fields) from the run fields' raw values (`FIELDS`' "run" and
    "options" fields, positionally or by name; defaults for those not given). Steps are limited by
    LIMITS["steps"] and, when given, by `max_steps` (a server's per-user limit, which the message names)."""
    raw = raw_values(RUN_FIELDS, values, named)
    config: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for f in RUN_FIELDS:
        (config if f.fills == "run" else options)[f.target] = parse_steps(f, raw[f.name], max_steps)
    return config, options


AUTOTUNE_FIELDS = tuple(f for f in FIELDS if f.fills == "autotune")


def autotune_values(*values: Any, max_steps: int | None = None, **named: Any) -> dict[str, Any]:
    """The autotune settings' fields from their raw values (as `run_values`)."""
    raw = raw_values(AUTOTUNE_FIELDS, values, named)
    return {f.target: parse_steps(f, raw[f.name], max_steps) for f in AUTOTUNE_FIELDS}


# Fields counting steps -> the untimed steps a run adds to them, within a server's per-user limit.
STEP_FIELDS = {"steps": 0, "timed_steps": 2}


def parse_steps(f: Field, value: Any, max_steps: int | None) -> Any:
    """`parse`, with a step count held within `max_steps` (a server's per-user limit) when it is lower."""
    extra = STEP_FIELDS.get(f.name)
    if extra is None or max_steps is None or max_steps - extra >= f.bounds()[1]:
        return parse(f, value)
    return parse(f, value, hi=max(1, max_steps - extra), note=" (this server's per-user limit)")


def of_fills(values: dict[str, Any], *fills: str) -> dict[str, Any]:
    """The values of the fields that fill `fills` ("plan", "run", ...), from a form's values by name."""
    return {name: value for name, value in values.items() if FIELD[name].fills in fills}


run_values.__signature__ = signature(RUN_FIELDS, max_steps=None)  # type: ignore[attr-defined]
autotune_values.__signature__ = signature(AUTOTUNE_FIELDS, max_steps=None)  # type: ignore[attr-defined]


def run_settings(steps: Any, learning_rate: Any, label: Any, max_steps: int | None = None) -> tuple[int, float, str]:
    """(steps, learning_rate, label) for a run from raw values (see `run_values`)."""
    config, _ = run_values(steps=steps, learning_rate=learning_rate, max_steps=max_steps)
    return config["steps"], config["learning_rate"], parse(FIELD["label"], label)
