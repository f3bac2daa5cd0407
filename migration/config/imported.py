"""A config file's model and TPU job as plan settings: `--config-from PATH` and the app's upload.

`workloads/configs.py` reads the file as data (a Hugging Face config.json or a MaxText yaml); this
module turns what it says into a `PlanRequest`, where any setting the user gave beside the file wins:
the family and preset, every model field the file sets (dimension flags over them), and from a MaxText
config the TPU job: its global batch (`per_device_batch_size` x the source slice's devices x
`gradient_accumulation_steps` x the slices: 4 on a v5p-8's 4 devices is 16), precision, state sharding
and slices. What the file says and the plan does not model goes with the request (`config_notes`) and is
listed in the plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from migration.common import ConfigError, read_upload
from migration.config import forms
from migration.config.fields import FIELD
from migration.config.limits import check_remat_name, maxtext_custom
from migration.config.requests import PlanRequest, validate_plan_request
from migration.hardware import TPU_SPECS
from workloads.configs import MAX_BYTES, ConfigFileError, Imported, read_config


# An upload to the app is read in the server's process: at most this much (a config.json is about 1 KB,
# a MaxText yaml a few), so no upload costs it more than a few milliseconds of parsing.
APP_MAX_BYTES = 64 * 1024


def read_config_bytes(data: bytes, name: str, field: str = "config") -> Imported:
    """The file's model and job, or ConfigError(field, one line)."""
    try:
        return read_config(data, name)
    except ConfigFileError as exc:
        raise ConfigError(field, str(exc)) from None


def form_request(raw: Mapping[str, Any], path: Any) -> PlanRequest:
    """The app's plan request: the form's plan fields (`raw`, by name), and where a config was uploaded
    (`path`, Gradio's copy of it), the config's model and TPU job under the fields the user changed from
    their defaults and the dimensions they set (0 keeps the file's)."""
    req = forms.plan_request(**raw)
    if not path:
        return req
    data = read_upload(path, "config_file", APP_MAX_BYTES, "a MaxText yaml or a Hugging Face config.json")
    if len(data) > APP_MAX_BYTES:
        raise ConfigError("config_file", f"is over {APP_MAX_BYTES // 1024} KiB; a config.json or MaxText yaml is a "
                                         "few KiB")
    imported = read_config_bytes(data, Path(path).name, field="config_file")
    changed = {name for name, value in raw.items() if name in FIELD and value != FIELD[name].default}
    return with_imported(req, imported, changed - {"workload", "preset"})


def read_config_path(path: str) -> Imported:
    """`read_config_bytes` of a file on disk (at most MAX_BYTES are read)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError("config", f"cannot read {path}: {exc.strerror or exc}") from None
    return read_config_bytes(data, Path(path).name)


def with_imported(req: PlanRequest, imported: Imported, given: Collection[str],
                  model: Mapping[str, Any] | None = None) -> PlanRequest:
    """`req` with what `imported` states, except the settings named in `given` (the user's) and the model
    fields in `model` (the user's dimensions, over the file's)."""
    changes: dict[str, Any] = {}
    if "workload" not in given:
        changes["workload"] = imported.workload
        changes["preset"] = req.preset if "preset" in given else imported.preset
    changes["model"] = {**imported.model, **(model if model is not None else req.model)}
    notes = [imported.describe()]
    s = imported.settings
    if s:
        spec = TPU_SPECS.get(req.source)
        slices = req.source_slices if "source_slices" in given else s["slices"]
        changes["source_slices"] = slices
        if "global_batch" not in given and spec is not None:
            examples = s["per_device_batch"] * spec.devices * s["accumulation"] * slices
            if examples < 1 or not float(examples).is_integer():
                raise ConfigError("config", f"per_device_batch_size {s['per_device_batch']:g} x {spec.devices} devices of "
                                            f"{spec.name} is {examples:g} examples, not a whole batch")
            changes["global_batch"] = int(examples)
            notes.append(f"global batch {int(examples):,} = per_device_batch_size {s['per_device_batch']:g} x "
                         f"{spec.devices} devices of {spec.name}"
                         + (f" x gradient_accumulation_steps {s['accumulation']}" if s["accumulation"] > 1 else "")
                         + (f" x {slices} slices" if slices > 1 else ""))
        if s["accumulation"] > 1:
            notes.append(f"gradient_accumulation_steps={s['accumulation']}: the TPU side is compiled as one step of "
                         "the whole per-device batch (the same FLOPs per optimizer step, more activation memory "
                         "than the job's micro-batches)")
        if "source_precision" not in given:
            changes["source_precision"] = s["source_precision"]
        if "source_sharding" not in given:
            changes["source_sharding"] = s["source_sharding"]
        if "source_dcn_fsdp" not in given:
            changes["source_dcn_fsdp"] = s["source_dcn_fsdp"]
        if "source_tensor" not in given and s["source_tensor"] > 1:
            changes["source_tensor"] = s["source_tensor"]
            notes.append(f"ici_tensor_parallelism={s['source_tensor']}: the TPU side is compiled with tensor "
                         f"parallelism over {s['source_tensor']} chips of each slice and FSDP over the rest")
        if "source_expert" not in given and s.get("source_expert", 1) > 1:
            changes["source_expert"] = s["source_expert"]
            notes.append(f"ici_expert_parallelism={s['source_expert']}: the TPU side is compiled with the routed "
                         f"experts split over {s['source_expert']} chips of each slice and FSDP over the rest")
        if "source_remat" not in given:
            remat = s["source_remat"]
            changes["source_remat"] = maxtext_custom(remat) if isinstance(remat, dict) else check_remat_name(
                "source_remat", remat, maxtext=True)
            said = ("custom (" + ", ".join(f"{k}={v}" for k, v in remat.items()) + ")" if isinstance(remat, dict)
                    else remat)
            notes.append(f"remat_policy={said}: the TPU side is compiled with this product's {changes['source_remat']}"
                         + ("" if changes["source_remat"] == remat else " (the same activations kept)"))
        if "mu_dtype" not in given and s.get("mu_dtype", "float32") != "float32":
            changes["mu_dtype"] = s["mu_dtype"]
            notes.append(f"AdamW's first moment in {s['mu_dtype']} (mu_dtype, or weight_dtype where it is unset): "
                         "kept in the plan, 14 bytes of state a parameter against 16")
    notes.extend(imported.notes)
    changes["config_notes"] = tuple(notes)
    return validate_plan_request(dataclasses.replace(req, **changes))
