"""Raw values from a form or an API call -> validated configs.

Every refusal is a `ConfigError(field, message)`: one line naming the field, the value received and
what is allowed. Nothing is coerced silently: 256.0 and " 256 " are the whole number 256, but 256.5,
True, None, NaN and "256.5" are refused rather than rounded or guessed at.

This module imports no JAX at module level (choices that need the workload catalog import it when
called) and no UI toolkit at all, so the app, the API and the CLI share it.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
import unicodedata
from pathlib import Path
from typing import Any

from migration.config import (
    CHECKPOINT_META_FILE,
    GRANULARITIES,
    LIMITS,
    PLAN_LIMITS,
    PRECISIONS,
    REMAT_NAMES,
    SHARDINGS,
    ConfigError,
    PlanRequest,
    validate_plan_request,
)

LABEL_MAX_CHARS = 80
_SHOWN_MAX = 60  # characters of a received value quoted back in a message
_WHOLE_TEXT = re.compile(r"[+-]?[0-9]+", re.ASCII)
_NUMBER_TEXT = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?", re.ASCII)
_TEXT_MAX = 100  # longer numeric text is refused before parsing (int() of 5,000 digits raises)
# Characters a one-line label must not hold: controls (Cc), lone surrogates (Cs), line and paragraph
# separators (Zl, Zp) and the bidirectional overrides that reorder how the text around them displays.
_BIDI = set("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")


def _shown(value: Any) -> str:
    """`repr(value)`, cut to a readable length (the message stays one line)."""
    try:
        text = repr(value)
    except ValueError:  # an int of over 4,300 digits
        return f"an int of {value.bit_length():,} bits" if isinstance(value, int) else type(value).__name__
    if len(text) > _SHOWN_MAX:
        extra = f", {len(value):,} characters" if isinstance(value, str) else ""
        text = f"{text[:_SHOWN_MAX]}... ({type(value).__name__}{extra})"
    return text


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _bounds(lo: float, hi: float, integer: bool) -> str:
    return f"{int(lo)} to {int(hi)}" if integer else f"{lo:g} to {hi:g}"


def whole(value: Any, field: str, lo: float, hi: float, *, note: str = "") -> int:
    """`value` as an int in [lo, hi]: an int, an integral float (256.0) or a string of ASCII digits with
    optional surrounding spaces (" 256 "). Refuses bool, None, NaN, ±inf, fractions, other text and values
    out of range with a ConfigError naming `field`; `note` is added after the range (e.g. what 0 means)."""
    allowed = f"must be a whole number from {_bounds(lo, hi, True)}{note}; got {_shown(value)}"
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
    allowed = f"must be a number from {_bounds(lo, hi, False)}; got {_shown(value)}"
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
        raise ConfigError(field, f"must be one of {', '.join(allowed)}; got {_shown(value)}")
    return value


def label_text(value: Any, field: str = "label", max_chars: int = LABEL_MAX_CHARS) -> str:
    """A one-line label: text of at most `max_chars` characters once stripped, with no control
    characters, line breaks or bidirectional overrides anywhere in it."""
    if not isinstance(value, str):
        raise ConfigError(field, f"must be text of at most {max_chars} characters; got {_shown(value)}")
    for i, ch in enumerate(value):
        if unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") or ch in _BIDI:
            raise ConfigError(field, f"must be one line of text without control characters; got {_shown(value)} "
                                     f"(U+{ord(ch):04X} at position {i})")
    text = value.strip()
    if len(text) > max_chars:
        raise ConfigError(field, f"must be at most {max_chars} characters; got {len(text)} characters: "
                                 f"{_shown(value)}")
    return text


# The form's model dimension fields, in order -> the workload config's fields (0: the preset's value).
DIMENSION_FIELDS = ("n_layers", "d_model", "n_heads", "n_kv_heads", "d_ff", "vocab_size", "seq_len")
EMBEDDINGS = ("preset", "tied", "untied")


def model_overrides(values: tuple[Any, ...], embeddings: Any) -> dict[str, Any]:
    """Dimension overrides from the form: whole numbers, 0 keeps the preset's value (the workload then
    checks ranges and consistency, naming the field)."""
    from workloads.transformer import DIM_LIMITS

    out = {}
    for field, value in zip(DIMENSION_FIELDS, values):
        n = whole(value, field, 0, DIM_LIMITS[field][1], note=" (0: the preset's)")
        if n:
            out[field] = n
    tie = choice(embeddings, "embeddings", EMBEDDINGS)
    if tie != "preset":
        out["tied_embeddings"] = tie == "tied"
    return out


def plan_request(workload: Any, preset: Any, source: Any, global_batch: Any, per_core_batch: Any,
                 source_precision: Any, target: Any, gpus: Any, memory_fraction: Any, granularity: Any,
                 remat: Any, precision: Any, accumulation: Any, n_layers: Any = 0, d_model: Any = 0, n_heads: Any = 0,
                 n_kv_heads: Any = 0, d_ff: Any = 0, vocab_size: Any = 0, seq_len: Any = 0,
                 embeddings: Any = "preset", sharding: Any = "auto", gpus_per_node: Any = 8) -> PlanRequest:
    """A validated PlanRequest from the Migrate form's values (the app's conventions: per_core_batch 0 is
    global batch / the TPU's cores, accumulation 0 and remat/precision/sharding "auto" let the planner
    choose, a dimension 0 keeps the preset's). Only registered workloads are accepted: the app never
    imports a module named in a request. Raises ConfigError naming the first bad field, including
    settings that contradict each other."""
    from migration.hardware import GPU_SPECS, TPU_SPECS
    from workloads import WORKLOADS  # imports JAX (no backend initialised)

    workload = choice(workload, "workload", tuple(WORKLOADS))
    preset = choice(preset, "preset", tuple(WORKLOADS[workload].presets))
    source = choice(source, "source", tuple(TPU_SPECS))
    req = PlanRequest(
        workload=workload,
        preset=preset,
        source=source,
        global_batch=whole(global_batch, "global_batch", *PLAN_LIMITS["global_batch"]),
        per_core_batch=whole(per_core_batch, "per_core_batch", 0, PLAN_LIMITS["per_core_batch"][1],
                             note=" (0: global batch / the TPU's cores)") or None,
        source_precision=choice(source_precision, "source_precision", ("bf16", "fp32")),
        target=choice(target, "target", ("local", *GPU_SPECS)),
        gpus=whole(gpus, "gpus", *PLAN_LIMITS["gpus"]),
        memory_fraction=number(memory_fraction, "memory_fraction", *PLAN_LIMITS["memory_fraction"]),
        granularity=choice(granularity, "granularity", GRANULARITIES),
        remat=_auto(choice(remat, "remat", ("auto", *REMAT_NAMES))),
        precision=_auto(choice(precision, "precision", ("auto", *PRECISIONS))),
        accumulation_steps=whole(accumulation, "accumulation_steps", 0, LIMITS["accumulation_steps"][1],
                                 note=" (0: chosen by the planner)") or None,
        model=model_overrides((n_layers, d_model, n_heads, n_kv_heads, d_ff, vocab_size, seq_len), embeddings),
        sharding=_auto(choice(sharding, "sharding", ("auto", *SHARDINGS))),
        gpus_per_node=whole(gpus_per_node, "gpus_per_node", *PLAN_LIMITS["gpus_per_node"]),
    )
    return validate_plan_request(req)


def _auto(value: str) -> str | None:
    return None if value == "auto" else value


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
        raise ConfigError(field, f"absolute paths are not allowed; give {rule}; got {_shown(value)}")
    if ".." in re.split(r"[/\\]", text):
        raise ConfigError(field, f"'..' is not allowed; give {rule}; got {_shown(value)}")
    if not _CHECKPOINT_NAME.fullmatch(text):
        raise ConfigError(field, f"must be {rule}; got {_shown(value)}")
    return text


def user_folder(user: str) -> str:
    """A folder name for one user's private files: readable, and distinct for distinct user names."""
    readable = re.sub(r"[^A-Za-z0-9_-]", "_", user)[:32] or "local"
    return f"{readable}-{hashlib.sha256(user.encode()).hexdigest()[:8]}"


def checkpoint_folders(save: Any, restore: Any, root: Path) -> tuple[str, str]:
    """(save_checkpoint, restore_checkpoint) for a RunConfig from the form's two names, resolved
    under `root` (the user's private checkpoint folder); a restore name must name a checkpoint there."""
    save_name, restore_name = checkpoint_name(save, "save_checkpoint"), checkpoint_name(restore, "restore_checkpoint")
    if restore_name and not (root / restore_name / CHECKPOINT_META_FILE).is_file():
        have = sorted(p.parent.name for p in root.glob(f"*/{CHECKPOINT_META_FILE}"))
        raise ConfigError("restore_checkpoint", f"no checkpoint named {restore_name!r}; yours: "
                                                f"{', '.join(have) if have else 'none yet'} (save one with 'Save a "
                                                "checkpoint after the run')")
    return (str(root / save_name) if save_name else "", str(root / restore_name) if restore_name else "")


def run_settings(steps: Any, learning_rate: Any, label: Any,
                 max_steps: int | None = None) -> tuple[int, float, str]:
    """(steps, learning_rate, label) for a run from raw values. Steps are limited by LIMITS["steps"] and,
    when given, by `max_steps` (a server's per-user limit, which the message then names)."""
    lo, hi = LIMITS["steps"]
    note = ""
    if max_steps is not None and max_steps < hi:
        hi, note = max_steps, " (this server's per-user limit)"
    return (whole(steps, "steps", lo, hi, note=note),
            number(learning_rate, "learning_rate", *LIMITS["learning_rate"]),
            label_text(label))
