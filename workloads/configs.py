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
`workloads/hf_config.py` and `workloads/maxtext_config.py`, over the shared types of
`workloads/config_keys.py`.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

from workloads.config_keys import ConfigFileError, Imported
from workloads.hf_config import read_hf
from workloads.maxtext_config import KNOWN_KEYS, read_maxtext

MAX_BYTES = 256 * 1024


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


MAX_DEPTH = 32  # a config nests a few levels; PyYAML takes seconds per thousand levels of [ or {


def _nesting(text: str) -> int:
    """The deepest nesting of [ and { outside quotes: checked before YAML parses, in one linear pass."""
    depth = deepest = 0
    quote = ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth = max(0, depth - 1)
    return deepest


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
            text = text.decode("utf-8-sig")
        except UnicodeDecodeError:
            raise ConfigFileError(f"{name or 'the config'} is not UTF-8 text: neither a config.json nor a MaxText "
                                  "yaml") from None
    if len(text.encode("utf-8")) > MAX_BYTES:
        raise ConfigFileError(f"{name or 'the config'} is over {MAX_BYTES:,} bytes; at most that is read")
    text = text.removeprefix("\ufeff")
    data: Any
    as_yaml = name.endswith((".yml", ".yaml"))
    if name.endswith(".json") or (not as_yaml and text.lstrip().startswith("{")):
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as exc:
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise ConfigFileError(f"{name or 'the config'} is not valid JSON ({first})") from None
    else:
        import yaml  # reason: PyYAML is needed only to read a MaxText config

        if _nesting(text) > MAX_DEPTH:
            raise ConfigFileError(f"{name or 'the config'} nests lists or mappings more than {MAX_DEPTH} deep: "
                                  "not a config")
        try:
            _no_aliases(text)
            data = yaml.load(text, Loader=_loader())  # noqa: S506 - a SafeLoader subclass
        except ConfigFileError:
            raise
        except (yaml.YAMLError, ValueError, RecursionError) as exc:
            first = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
            raise ConfigFileError(f"{name or 'the config'} is neither JSON nor YAML ({first})") from None
    if not isinstance(data, dict) or not all(isinstance(k, str) for k in data):
        raise ConfigFileError(f"{name or 'the config'} is not a mapping of keys to values: neither a Hugging Face "
                              "config.json nor a MaxText yaml")
    if "model_type" in data or "architectures" in data:
        return "hf", data
    if any(k in KNOWN_KEYS for k in data):
        return "maxtext", data
    raise ConfigFileError(f"{name or 'the config'} is neither a Hugging Face config.json (it has no model_type) "
                          "nor a MaxText config (none of its keys, e.g. model_name, base_emb_dim, "
                          "per_device_batch_size)")


def read_config(text: str | bytes, name: str = "") -> Imported:
    """The model and TPU settings a config file states (module docstring)."""
    kind, data = parse(text, name)
    return read_hf(data) if kind == "hf" else read_maxtext(data)


__all__ = ["MAX_BYTES", "ConfigFileError", "Imported", "parse", "read_config"]
