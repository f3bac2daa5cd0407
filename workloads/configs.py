"""Configs teams already have, read as data: a Hugging Face `config.json` or a MaxText yaml.

`read_config(text, name)` tells the two formats apart and returns an `Imported`: the built-in family
and dimensions that match the model (the decoder of workloads/transformer.py: `llama` for the modern
layout, `transformer` for GPT-2 and GPT-3), the TPU job's settings the file states (MaxText only), and
every key it read and did not model, each with what the plan does instead (parameters a published
model has that the family here does not, e.g. Qwen2's query, key and value biases, are counted and
listed). A key that would change the answer and is not supported (a mixture of experts, tensor
parallelism on the TPU, a quantized model) is an error naming it, one line; so is a value of the wrong
type, and a file that is neither format.

Nothing in the file runs: JSON is parsed by the standard library, YAML by PyYAML's safe loader with
aliases refused (no expansion bombs), both from at most `MAX_BYTES`. The format readers are
`workloads/hf_config.py` and `workloads/maxtext_config.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
from collections.abc import Mapping
from typing import Any

MAX_BYTES = 256 * 1024
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
            raise ConfigFileError(f"{self.where} {key}: expected an integer from {lo} to {hi}, got {value!r}")
        return value

    def number(self, key: str, default: float | None = None, lo: float = 0.0, hi: float = 1e12) -> float:
        value = self._given(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi) or not math.isfinite(value):
            raise ConfigFileError(f"{self.where} {key}: expected a number from {lo:g} to {hi:g}, got {value!r}")
        return float(value)

    def bool(self, key: str, default: bool | None = None) -> bool:
        value = self._given(key, default)
        if not isinstance(value, bool):
            raise ConfigFileError(f"{self.where} {key}: expected true or false, got {value!r}")
        return value

    def str(self, key: str, default: str | None = None) -> str:
        value = self._given(key, default)
        if not isinstance(value, str):
            raise ConfigFileError(f"{self.where} {key}: expected a string, got {value!r}")
        return value

    def unused(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.used)


def short(value: Any, limit: int = 60) -> str:
    text = json.dumps(value) if not isinstance(value, str) else value
    return text if len(text) <= limit else text[:limit - 1] + "…"


def listed(keys: list[str], data: Mapping[str, Any], why: str) -> str | None:
    """One note naming `keys` (with their values) and why none of them changes the plan."""
    if not keys:
        return None
    return f"{', '.join(f'{k}={short(data[k], 30)}' for k in keys)}: {why}"


@functools.lru_cache(maxsize=1)
def _loader() -> Any:
    """PyYAML's safe loader, reading floats such as 1e-6 (without a dot) as numbers, as MaxText's
    OmegaConf does (YAML 1.1 alone reads them as strings)."""
    import yaml  # reason: PyYAML is needed only to read a MaxText config

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return Loader


def _no_aliases(text: str) -> None:
    import yaml  # reason: PyYAML is needed only to read a MaxText config

    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.AliasEvent):
            raise ConfigFileError("the YAML uses an alias (*name): refused, a config is read without expanding them")


def parse(text: str | bytes, name: str = "") -> tuple[str, dict[str, Any]]:
    """("hf" | "maxtext", the file's mapping), or ConfigFileError saying what the file is not."""
    if isinstance(text, bytes):
        if len(text) > MAX_BYTES:
            raise ConfigFileError(f"{name or 'the config'} is {len(text):,} bytes; at most {MAX_BYTES:,} are read")
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigFileError(f"{name or 'the config'} is not UTF-8 text: neither a config.json nor a MaxText "
                                  "yaml") from None
    if len(text.encode("utf-8")) > MAX_BYTES:
        raise ConfigFileError(f"{name or 'the config'} is over {MAX_BYTES:,} bytes; at most that is read")
    stripped = text.lstrip()
    data: Any
    if stripped.startswith("{") or name.endswith(".json"):
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise ConfigFileError(f"{name or 'the config'} is not valid JSON ({exc})") from None
    else:
        import yaml  # reason: PyYAML is needed only to read a MaxText config

        _no_aliases(text)
        try:
            data = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ConfigFileError(f"{name or 'the config'} is neither JSON nor YAML ({first})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigFileError(f"{name or 'the config'} is not a mapping of keys to values: neither a Hugging Face "
                              "config.json nor a MaxText yaml")
    if "model_type" in data or "architectures" in data:
        return "hf", data
    from workloads.maxtext_config import KNOWN_KEYS  # reason: the two readers import this module

    if any(k in KNOWN_KEYS for k in data):
        return "maxtext", data
    raise ConfigFileError(f"{name or 'the config'} is neither a Hugging Face config.json (it has no model_type) "
                          "nor a MaxText config (none of its keys, e.g. model_name, base_emb_dim, "
                          "per_device_batch_size)")


def read_config(text: str | bytes, name: str = "") -> Imported:
    """The model and TPU settings a config file states (module docstring)."""
    kind, data = parse(text, name)
    if kind == "hf":
        from workloads.hf_config import read_hf

        return read_hf(data)
    from workloads.maxtext_config import read_maxtext

    return read_maxtext(data)
