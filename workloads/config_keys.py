"""What the config readers share: the result (`Imported`), the one-line error, and typed access to keys
that remembers which were read (so the others can be listed). See workloads/configs.py."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from typing import Any

# Where a config does not say the training sequence (a config.json gives the context a model serves).
DEFAULT_SEQ = 4096


class ConfigFileError(ValueError):
    """A config file that cannot be read as a model this product plans. `str()` is one line."""


@dataclasses.dataclass(frozen=True)
class Imported:
    """A model and its TPU job as a config file states them.

    `workload` / `preset` / `model`: the family, the preset its dimensions start from and every field
    set from the file; `settings`: the TPU job's (MaxText: `per_device_batch`, `accumulation`,
    `slices`, `source_precision`, `source_sharding`); `notes`: each key read and not modelled, with what
    the plan does instead; `missing_params`: parameters of the file's model that the family here lacks
    (counted in `notes`)."""

    format: str
    name: str
    workload: str
    preset: str
    model: dict[str, Any]
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    notes: tuple[str, ...] = ()
    missing_params: int = 0

    def describe(self) -> str:
        return f"{self.format} ({self.name})"


class Reader:
    """Typed access to a config's keys; remembers which were read, so the rest can be listed."""

    def __init__(self, data: Mapping[str, Any], where: str):
        self.data, self.where, self.used = data, where, set()

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.data.get(key, default)
        return default if value is None else value

    def _given(self, key: str, default: Any) -> Any:
        value = self.raw(key, default)
        if value is None:
            raise ConfigFileError(f"{self.where} has no {key}")
        return value

    def int(self, key: str, default: int | None = None, lo: int = 1, hi: int = 10**7) -> int:
        value = self._given(key, default)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ConfigFileError(f"{self.where} {key}: expected an integer from {lo} to {hi}, got {short(value)}")
        return value

    def number(self, key: str, default: float | None = None, lo: float = 0.0, hi: float = 1e12) -> float:
        value = self._given(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi) or not math.isfinite(value):
            raise ConfigFileError(f"{self.where} {key}: expected a number from {lo:g} to {hi:g}, got {short(value)}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self._given(key, default)
        if not isinstance(value, bool):
            raise ConfigFileError(f"{self.where} {key}: expected true or false, got {short(value)}")
        return value

    def str(self, key: str, default: str | None = None) -> str:
        value = self._given(key, default)
        if not isinstance(value, str):
            raise ConfigFileError(f"{self.where} {key}: expected a string, got {short(value)}")
        return value

    def unused(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.used)


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, default=str) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 1] + "…"


def listed(keys: list[str], data: Mapping[str, Any], why: str) -> str | None:
    """One note naming `keys` (with their values) and why none of them changes the plan."""
    if not keys:
        return None
    return f"{', '.join(f'{k}={short(data[k], 30)}' for k in keys)}: {why}"
