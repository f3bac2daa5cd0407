"""The form's field table (`migration/config/fields.py`) is the one source of the form's fields: every
field is checked by the same validation, has its command-line flag, and (see tests/test_api_shape.py
and tests/test_app.py) its component and API parameter. These tests go over the table, so a field
added to it is covered without a line here."""

from __future__ import annotations

import argparse
import inspect

import pytest

from migration.cli.parser import build_parser
from migration.config import forms
from migration.config.fields import FIELDS, Field, fields_of, flags_of
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig
from migration.service.autotune import TOP_MAX, AutotuneSettings
from migration.service.orchestrate import RunOptions

IDS = [f.name for f in FIELDS]


def bad_values(f: Field) -> list:
    """Values the field must refuse, by kind."""
    if f.kind in ("int", "float"):
        lo, hi = f.bounds()
        out = [hi * 2 + 1, lo - 1, float("nan"), "abc", None, True]
        return out + ([lo + 0.5] if f.kind == "int" else [])
    if f.kind == "choice":
        return ["no-such-choice", 3, None]
    if f.kind == "bool":
        return ["yes", 2, None]
    if f.kind == "folder":
        return ["../elsewhere", "/etc", "a/b", 5]
    if f.kind == "prices":
        return ["tpu-v5p=-1", "tpu-v5p=0", "tpu-v5p=nan", "tpu-v5p=inf", "h100-sxm=1e9", "tpu-v99=1", "h100-sxm",
                "=4", "line\nbreak", "x" * 700, 5, None]
    return ["line\nbreak", "x" * 500, 5]


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_field_takes_its_default_and_refuses_bad_values_naming_itself(f):
    assert forms.parse(f, f.default) == ({} if f.kind == "prices" else f.default)  # prices: none given
    for value in bad_values(f):
        with pytest.raises(ConfigError) as err:
            forms.parse(f, value)
        assert err.value.field == f.target and "\n" not in str(err.value), (value, err.value)


@pytest.mark.parametrize("f", FIELDS, ids=IDS)
def test_every_field_fills_a_field_of_what_it_fills(f):
    """A field's value goes somewhere: the plan request, the run config, the run options, the
    autotune settings, or the job (label, checkpoints: the service's)."""
    homes = {"plan": PlanRequest, "run": RunConfig, "options": RunOptions, "autotune": AutotuneSettings}
    if f.fills == "job":
        assert f.name in ("label", "save_checkpoint", "restore_checkpoint")
    elif f.name in ("embeddings", "attention", "layer_loop", "mlp") or f.zero == "the preset's":
        assert "model" in inspect.signature(PlanRequest).parameters  # dimensions go into the model overrides
    else:
        assert f.target in inspect.signature(homes[f.fills]).parameters, f


@pytest.mark.parametrize("f", [f for f in FIELDS if f.commands], ids=[f.name for f in FIELDS if f.commands])
def test_every_command_line_field_has_its_flag(f):
    parser = build_parser()
    for command in f.commands:
        value = "1" if f.kind in ("int", "float") else (f.allowed() or ("x",))[0] if f.kind == "choice" else "x"
        argv = [command, *(["--plan", "p.json"] if command == "autotune" else []),
                *([f.cli_flag] if f.kind == "bool" else [f.cli_flag, value])]
        args = parser.parse_args(argv)
        assert getattr(args, f.name) == (True if f.kind == "bool" else value), (command, f.cli_flag)
        assert getattr(parser.parse_args(argv[:1 + 2 * (command == "autotune")]), f.name) is None  # absent: None


def test_the_endpoints_take_their_fields_in_table_order_with_the_new_ones_last():
    """API callers pass the fields positionally, so an endpoint's fields keep their order and a new
    field goes at the end: /run's parameters as they were, then `seed`."""
    assert [f.name for f in fields_of("plan")][:3] == ["workload", "preset", "source"]
    assert [f.name for f in fields_of("plan")][-10:] == ["label", "network_gbps", "attention", "layer_loop",
                                                         "train_tokens", "prices", "source_slices", "tpu_step_ms",
                                                         "allow_fp8", "mu_dtype"]
    run = [f.name for f in fields_of("run")]
    assert run[:7] == ["steps", "learning_rate", "compare_tpu", "profile", "fp32_reference", "pmap_before", "scaling"]
    # tpu_step_ms moved to the end when the plan took it too (the TPU job's measured step: the plan checks its
    # prediction against it)
    assert run[-13:] == ["label", "save_checkpoint", "restore_checkpoint", "seed", "network_gbps", "attention",
                         "layer_loop", "train_tokens", "prices", "source_slices", "tpu_step_ms", "allow_fp8", "mu_dtype"]
    assert [f.name for f in fields_of("autotune")] == ["top", "timed_steps", "label"]


def test_the_plan_request_signature_is_the_table():
    params = inspect.signature(forms.plan_request).parameters
    assert list(params)[:-1] == [f.name for f in forms.PLAN_FIELDS]
    assert all(params[f.name].default == f.default for f in forms.PLAN_FIELDS)


def test_run_values_put_each_field_where_it_belongs():
    config, options = forms.run_values(steps="7", seed=3, pmap_before=True)
    assert config == {"steps": 7, "learning_rate": 3e-3, "seed": 3}
    assert options == {"tpu_style": False, "profile": False, "fp32_reference": False, "pmap_before": True,
                       "scaling": False}
    RunConfig(**config)
    RunOptions(**options)
    with pytest.raises(ConfigError, match="seed: must be a whole number from 0 to 2147483647; got -1"):
        forms.run_values(seed=-1)
    with pytest.raises(TypeError, match="unknown field 'sed'"):
        forms.run_values(sed=1)


def test_the_autotune_fields_keep_the_autotuners_limit():
    assert dict((f.name, f.bounds()[1]) for f in flags_of("autotune"))["top"] == TOP_MAX


def test_the_command_line_refuses_a_bad_field_value_with_the_forms_message(capsys):
    from migration.cli.commands import main

    assert main(["run", "--seed", "-1"]) == 2
    assert "seed: must be a whole number from 0 to 2147483647; got '-1' (flag --seed)" in capsys.readouterr().err
    assert main(["plan", "--gpus", "1.5"]) == 2
    assert "gpus: must be a whole number from 1 to 4096; got '1.5'" in capsys.readouterr().err


def test_command_line_flags_absent_are_none_so_commands_know_what_was_given():
    args = build_parser().parse_args(["plan"])
    assert all(getattr(args, f.name) is None for f in flags_of("plan"))
    assert isinstance(args, argparse.Namespace)
