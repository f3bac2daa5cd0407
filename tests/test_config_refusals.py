"""Form values and serving requests, accepted and refused: a good value gives the request it names,
field by field; a bad one (out of range, of the wrong type, not finite, a name that escapes its folder,
another user's checkpoint, a checkpoint of another model) is a one-line ConfigError naming the field
and what is allowed, with both ends of every range accepted and the values just past them refused."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
import re
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from migration.common import ConfigError, shown
from migration.config import forms
from migration.config.checkpoints import CheckpointMeta, model_dims
from migration.config.fields import FIELD
from migration.config.requests import CHECKPOINT_META_FILE
from migration.config.serving import (
    ServeRequest,
    ServeRunRequest,
    batch_list,
    decoder_choices,
    serve_request,
    serve_run_request,
    serving_checkpoint,
)


def refusal(call, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    assert "\n" not in str(info.value)
    return info.value


def write_checkpoint(folder, workload: str, preset: str, model: dict) -> str:
    """A checkpoint folder as a training run leaves it, as far as requests read it: its description."""
    from workloads import WORKLOADS

    dims = model_dims(WORKLOADS[workload].config(preset, model))
    meta = CheckpointMeta(workload, preset, model, dims, "fp32", 4, "replicated", 1, "cpu", "cpu")
    folder.mkdir(parents=True)
    (folder / CHECKPOINT_META_FILE).write_text(json.dumps(dataclasses.asdict(meta)))
    return str(folder)


LLAMA_MODEL = {"seq_len": 128, "tied_embeddings": False}
LLAMA_DIMS = "vocab_size 256, seq_len 128, d_model 64, n_layers 2, n_heads 4"  # the first five of its config


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    return {"llama": write_checkpoint(root / "llama", "llama", "tiny", LLAMA_MODEL),
            "mlp": write_checkpoint(root / "mlp", "mlp", "tiny", {}),
            "root": root}


# -- whole numbers ------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,value", [
    (1, 1), (1000, 1000), (256, 256), (256.0, 256), (1.0, 1), (1000.0, 1000), ("1", 1), ("1000", 1000),
    (" 256 ", 256), ("\t256\n", 256), ("+256", 256), ("0256", 256), (np.int64(7), 7), (Fraction(8, 1), 8),
    ("0" * 99 + "7", 7), ("  " + "0" * 99 + "7  ", 7),  # 100 characters once stripped
])
def test_whole_numbers_in_range_are_taken_in_any_honest_spelling(raw, value):
    got = forms.whole(raw, "batch", 1, 1000)
    assert got == value and type(got) is int


@pytest.mark.parametrize("raw", [
    0, 1001, -1, 0.0, 1000.5, 1001.0, 7.5, Fraction(15, 2), "0", "1001", "-1", "7.5", "7e0", "7.", "1_000", "0x10",
    "", " ", "seven", "٧", "7 7", True, False, None, math.nan, math.inf, -math.inf, 1e300, -1e300, 10**400, [7],
    "0" * 100 + "7",  # 101 characters
    Fraction(10**400, 1), Fraction(-(10**400), 1),  # too large for a float
])
def test_other_whole_number_values_are_refused_with_the_range(raw):
    err = refusal(forms.whole, raw, "batch", 1, 1000)
    assert err.field == "batch"
    assert str(err).startswith("batch: must be a whole number from 1 to 1000; got ")


def test_a_whole_number_refusal_quotes_the_value_and_adds_the_note():
    assert str(refusal(forms.whole, 1001, "batch", 1, 1000)) == "batch: must be a whole number from 1 to 1000; got 1001"
    assert str(refusal(forms.whole, "7.5", "batch", 1, 1000)) == "batch: must be a whole number from 1 to 1000; got '7.5'"
    assert (str(refusal(forms.whole, -1, "accumulation_steps", 0, 1024, note=" (0: chosen by the planner)"))
            == "accumulation_steps: must be a whole number from 0 to 1024 (0: chosen by the planner); got -1")
    assert forms.whole(-0.0, "f", 0, 1) == 0 and forms.whole("-3", "f", -5, 5) == -3


# -- real numbers -------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw,value", [
    (0.05, 0.05), (1.0, 1.0), (1, 1.0), ("1", 1.0), (" 0.8 ", 0.8), (".5", 0.5), ("1.", 1.0), ("+0.5", 0.5),
    ("5e-1", 0.5), ("0.5E0", 0.5), ("50e-2", 0.5), (Fraction(1, 2), 0.5), (np.float32(0.5), 0.5), ("0.05", 0.05),
])
def test_numbers_in_range_are_taken_as_floats(raw, value):
    got = forms.number(raw, "memory_fraction", 0.05, 1.0)
    assert got == value and type(got) is float


@pytest.mark.parametrize("raw", [
    0.0499, 1.0001, 0, 2, -0.5, math.nan, math.inf, -math.inf, "nan", "inf", "-inf", "infinity", "0.04", "1.01",
    True, False, None, "80%", "", " ", "1,5", "0x1", "e5", ".", "0.5.1", [0.5], 10**400, -10**400,
])
def test_other_numbers_are_refused_with_the_range(raw):
    err = refusal(forms.number, raw, "memory_fraction", 0.05, 1.0)
    assert err.field == "memory_fraction"
    assert str(err).startswith("memory_fraction: must be a number from 0.05 to 1; got ")


def test_number_text_is_read_up_to_a_hundred_characters():
    assert forms.number("0" * 99 + "1", "f", 0, 10) == 1.0
    assert forms.number(" " + "0" * 99 + "1 ", "f", 0, 10) == 1.0
    refusal(forms.number, "0" * 100 + "1", "f", 0, 10)


def test_a_number_refusal_quotes_the_value_and_an_unbounded_range_still_refuses_huge_ints():
    assert str(refusal(forms.number, 1.5, "memory_fraction", 0.05, 1.0)) == (
        "memory_fraction: must be a number from 0.05 to 1; got 1.5")
    assert str(refusal(forms.number, "fast", "learning_rate", 1e-8, 1.0)) == (
        "learning_rate: must be a number from 1e-08 to 1; got 'fast'")
    assert refusal(forms.number, 10**400, "f", 0, math.inf).field == "f"  # beyond any float: refused, not raised
    assert forms.number(10**300, "f", 0, math.inf) == 1e300
    # An int just past the range is refused even where a float would round it into the range.
    assert forms.number(2**53, "f", 0, 2**53) == 2.0**53
    assert refusal(forms.number, 2**53 + 1, "f", 0, 2**53).field == "f"
    assert refusal(forms.number, -(2**53) - 1, "f", -(2**53), 0).field == "f"


# -- choices, labels, checkboxes ------------------------------------------------------------------------

@pytest.mark.parametrize("raw", ["BF16", " bf16", "bf16 ", "", "fp8", None, 1, ["bf16"], b"bf16"])
def test_a_choice_is_exactly_one_of_the_allowed_values(raw):
    assert forms.choice("bf16", "precision", ("bf16", "fp16")) == "bf16"
    assert forms.choice("fp16", "precision", ["bf16", "fp16"]) == "fp16"
    err = refusal(forms.choice, raw, "precision", ("bf16", "fp16"))
    assert err.field == "precision" and str(err) == f"precision: must be one of bf16, fp16; got {raw!r}"


@pytest.mark.parametrize("raw,value", [
    ("  my run  ", "my run"), ("x" * 80, "x" * 80), ("  " + "x" * 80 + "  ", "x" * 80), ("é ✓ 日本", "é ✓ 日本"),
    ("", ""), ("   ", ""), ("a b", "a b"),
])
def test_a_label_is_one_line_stripped(raw, value):
    assert forms.label_text(raw, "label") == value


@pytest.mark.parametrize("raw,where", [
    ("a\x00b", "U+0000 at position 1"), ("\x07", "U+0007 at position 0"), ("tab\there", "U+0009 at position 3"),
    ("x\x7f", "U+007F at position 1"), ("ab\ud800", "U+D800 at position 2"), ("ab\u2028", "U+2028 at position 2"),
    ("\u2029", "U+2029 at position 0"), ("x\u202ay", "U+202A at position 1"), ("abc\u202edcba", "U+202E at position 3"),
    ("\u2066x", "U+2066 at position 0"), ("\u2069", "U+2069 at position 0"), ("a\u200e", "U+200E at position 1"),
    ("a\u200f", "U+200F at position 1"), ("two\nlines", "U+000A at position 3"), (" x\r", "U+000D at position 2"),
])
def test_a_label_with_control_characters_or_direction_overrides_is_refused_saying_where(raw, where):
    err = refusal(forms.label_text, raw, "label")
    assert err.field == "label"
    assert str(err).startswith("label: must be one line of text without control characters; got ")
    assert str(err).endswith(f"({where})")


def test_a_label_too_long_or_not_text_is_refused_with_the_limit():
    assert str(refusal(forms.label_text, "x" * 81, "label")) == (
        f"label: must be at most 80 characters; got 81 characters: {shown('x' * 81)}")
    assert str(refusal(forms.label_text, "abcd", "name", 3)).startswith("name: must be at most 3 characters; got 4 ")
    assert forms.label_text("abc", "name", 3) == "abc"
    err = refusal(forms.label_text, "z" * 81)  # by default a label, of the form's length
    assert err.field == "label" and str(err).startswith("label: must be at most 80 characters; got 81 characters")
    assert forms.label_text("z" * 80) == "z" * 80
    for raw in (42, None, b"x", ["x"]):
        assert str(refusal(forms.label_text, raw, "label")) == f"label: must be text of at most 80 characters; got {raw!r}"


@pytest.mark.parametrize("raw,value", [(True, True), (False, False), (1, True), (0, False)])
def test_a_checkbox_is_true_or_false(raw, value):
    assert forms.flag(raw, "profile") is value


@pytest.mark.parametrize("raw", [2, -1, "true", "1", "", None, 1.0, 0.0, [True]])
def test_a_checkbox_refuses_anything_else(raw):
    err = refusal(forms.flag, raw, "profile")
    assert err.field == "profile" and str(err) == f"profile: must be true or false; got {raw!r}"


# -- fields by kind -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name,raw,value", [
    ("steps", "100000", 100_000), ("steps", 1, 1), ("accumulation", 0, 0), ("accumulation", "1024", 1024),
    ("learning_rate", "3e-4", 3e-4), ("learning_rate", 1, 1.0), ("granularity", "pow2", "pow2"),
    ("profile", 1, True), ("compare_tpu", False, False), ("save_checkpoint", " run-1 ", "run-1"),
    ("save_checkpoint", "", ""), ("label", " x ", "x"), ("top", 10, 10), ("tpu_step_ms", 0, 0.0),
])
def test_each_field_is_read_by_its_kind(name, raw, value):
    got = forms.parse(FIELD[name], raw)
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("name,raw,message", [
    ("steps", 0, "steps: must be a whole number from 1 to 100000; got 0"),
    ("steps", 100_001, "steps: must be a whole number from 1 to 100000; got 100001"),
    ("accumulation", -1, "accumulation_steps: must be a whole number from 0 to 1024 (0: chosen by the planner); got -1"),
    ("accumulation", 1025, "accumulation_steps: must be a whole number from 0 to 1024 (0: chosen by the planner); "
                           "got 1025"),
    ("n_layers", 257, "n_layers: must be a whole number from 0 to 256 (0: the preset's); got 257"),
    ("learning_rate", 0, "learning_rate: must be a number from 1e-08 to 1; got 0"),
    ("granularity", "pow3", "granularity: must be one of multiple8, pow2; got 'pow3'"),
    ("compare_tpu", 2, "tpu_style: must be true or false; got 2"),
    ("label", "y" * 81, f"label: must be at most 80 characters; got 81 characters: {shown('y' * 81)}"),
])
def test_each_field_refuses_naming_its_target_and_range(name, raw, message):
    err = refusal(forms.parse, FIELD[name], raw)
    assert str(err) == message and err.field == FIELD[name].target


def test_a_folder_field_takes_a_name_and_a_server_limit_replaces_the_zero_note():
    assert "absolute paths are not allowed" in str(refusal(forms.parse, FIELD["restore_checkpoint"], "/etc"))
    assert refusal(forms.parse, FIELD["restore_checkpoint"], "/etc").field == "restore_checkpoint"
    assert forms.parse(FIELD["steps"], 10, hi=10, note=" (a limit)") == 10
    assert str(refusal(forms.parse, FIELD["steps"], 11, hi=10, note=" (a limit)")) == (
        "steps: must be a whole number from 1 to 10 (a limit); got 11")
    assert str(refusal(forms.parse, FIELD["accumulation"], -1, note=" (a limit)")) == (
        "accumulation_steps: must be a whole number from 0 to 1024 (a limit); got -1")


# -- the run and autotune forms -------------------------------------------------------------------------

def test_run_values_fill_the_run_config_and_options_with_defaults():
    config, options = forms.run_values()
    assert config == {"steps": 20, "learning_rate": 3e-3, "seed": 0}
    assert options == {"tpu_style": False, "profile": False, "fp32_reference": False, "pmap_before": False,
                       "scaling": False}
    config, options = forms.run_values(5, "0.01", 1, seed="7", scaling=True)
    assert config == {"steps": 5, "learning_rate": 0.01, "seed": 7}
    assert options == {"tpu_style": True, "profile": False, "fp32_reference": False, "pmap_before": False,
                       "scaling": True}
    # the measured TPU step is the TPU job's: a plan field, which the run's benchmark item also reads
    assert forms.plan_request(tpu_step_ms="12.5").tpu_step_ms == 12.5 and forms.plan_request().tpu_step_ms is None


def test_raw_values_refuse_extra_values_and_unknown_names():
    with pytest.raises(TypeError, match=r"^3 values for 2 fields$"):
        forms.autotune_values(1, 2, 3)
    with pytest.raises(TypeError, match=r"^unknown field 'bogus'; the fields are top, timed_steps$"):
        forms.autotune_values(bogus=1)
    with pytest.raises(TypeError, match=r"^unknown field 'a'; the fields are top"):
        forms.autotune_values(b=1, a=2)
    assert forms.raw_values((FIELD["top"], FIELD["label"]), (4,), {"label": "x"}) == {"top": 4, "label": "x"}
    assert forms.raw_values((FIELD["top"], FIELD["label"]), (), {}) == {"top": 3, "label": ""}


@pytest.mark.parametrize("max_steps,top_step,message", [
    (None, 100_000, "steps: must be a whole number from 1 to 100000; got 100001"),
    (10**9, 100_000, "steps: must be a whole number from 1 to 100000; got 100001"),
    (100_000, 100_000, "steps: must be a whole number from 1 to 100000; got 100001"),
    (99_999, 99_999, "steps: must be a whole number from 1 to 99999 (this server's per-user limit); got 100000"),
    (1000, 1000, "steps: must be a whole number from 1 to 1000 (this server's per-user limit); got 1001"),
    (1, 1, "steps: must be a whole number from 1 to 1 (this server's per-user limit); got 2"),
    (0, 1, "steps: must be a whole number from 1 to 1 (this server's per-user limit); got 2"),
])
def test_a_servers_step_limit_bounds_the_run_steps_and_is_named(max_steps, top_step, message):
    assert forms.run_values(steps=top_step, max_steps=max_steps)[0]["steps"] == top_step
    assert str(refusal(forms.run_values, steps=top_step + 1, max_steps=max_steps)) == message


@pytest.mark.parametrize("max_steps,top_timed,message", [
    (None, 99_998, "timed_steps: must be a whole number from 1 to 99998; got 99999"),
    (100_000, 99_998, "timed_steps: must be a whole number from 1 to 99998; got 99999"),
    (99_999, 99_997, "timed_steps: must be a whole number from 1 to 99997 (this server's per-user limit); got 99998"),
    (12, 10, "timed_steps: must be a whole number from 1 to 10 (this server's per-user limit); got 11"),
    (3, 1, "timed_steps: must be a whole number from 1 to 1 (this server's per-user limit); got 2"),
    (2, 1, "timed_steps: must be a whole number from 1 to 1 (this server's per-user limit); got 2"),
])
def test_autotune_timed_steps_leave_room_for_the_two_warm_up_steps(max_steps, top_timed, message):
    assert forms.autotune_values(timed_steps=top_timed, max_steps=max_steps) == {"top": 3, "timed_steps": top_timed}
    assert str(refusal(forms.autotune_values, timed_steps=top_timed + 1, max_steps=max_steps)) == message


def test_autotune_values_take_their_fields_in_order_and_check_the_ranked_count():
    assert forms.autotune_values() == {"top": 3, "timed_steps": 5}
    assert forms.autotune_values(10, "7") == {"top": 10, "timed_steps": 7}
    assert forms.autotune_values(top=10, timed_steps=1, max_steps=3) == {"top": 10, "timed_steps": 1}
    for bad in (0, 11, 2.5, "all"):
        err = refusal(forms.autotune_values, top=bad)
        assert err.field == "top" and str(err).startswith("top: must be a whole number from 1 to 10; got ")
    params = inspect.signature(forms.autotune_values).parameters
    assert [(p.name, p.default, p.kind) for p in params.values()] == [
        ("top", 3, inspect.Parameter.POSITIONAL_OR_KEYWORD), ("timed_steps", 5, inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("max_steps", None, inspect.Parameter.KEYWORD_ONLY)]


def test_a_signature_lists_the_fields_then_keyword_only_settings():
    sig = forms.signature((FIELD["steps"], FIELD["label"]), max_steps=None, user="me")
    assert [(p.name, p.default, p.kind) for p in sig.parameters.values()] == [
        ("steps", 20, inspect.Parameter.POSITIONAL_OR_KEYWORD), ("label", "", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("max_steps", None, inspect.Parameter.KEYWORD_ONLY), ("user", "me", inspect.Parameter.KEYWORD_ONLY)]
    assert str(forms.signature((FIELD["top"],))) == "(top=3)"


def test_a_forms_values_are_split_by_what_they_fill():
    values = {"steps": 5, "compare_tpu": True, "workload": "llama", "label": "x", "top": 3, "save_checkpoint": ""}
    assert forms.of_fills(values, "run") == {"steps": 5}
    assert forms.of_fills(values, "run", "options") == {"steps": 5, "compare_tpu": True}
    assert forms.of_fills(values, "plan", "job") == {"workload": "llama", "label": "x", "save_checkpoint": ""}
    assert forms.of_fills(values, "autotune") == {"top": 3}


def test_run_settings_are_steps_learning_rate_and_label():
    assert forms.run_settings("1000", "1e-8", "  a  ", max_steps=1000) == (1000, 1e-8, "a")
    assert refusal(forms.run_settings, 20, 3e-3, "x" * 81).field == "label"
    assert refusal(forms.run_settings, 20, 1.5, "").field == "learning_rate"


# -- the plan form ------------------------------------------------------------------------------------

def test_model_dimensions_and_embeddings_of_the_plan_form_become_the_model_overrides():
    req = forms.plan_request(workload="transformer", preset="tiny", n_layers=4, d_model=0, embeddings="tied")
    assert req.model == {"n_layers": 4, "tied_embeddings": True}
    assert forms.plan_request(embeddings="untied").model == {"tied_embeddings": False}
    assert forms.plan_request(embeddings="preset", n_heads="0").model == {}
    assert forms.plan_request(seq_len="128", n_layers=3.0).model == {"seq_len": 128, "n_layers": 3}


def test_the_plan_forms_zero_and_auto_leave_the_choice_to_the_planner():
    req = forms.plan_request(per_core_batch=0, accumulation=0, remat="auto", precision="auto", sharding="auto")
    assert (req.per_core_batch, req.accumulation_steps, req.remat, req.precision, req.sharding) == (
        None, None, None, None, None)
    req = forms.plan_request(global_batch=512, per_core_batch=64, accumulation=2, remat="full", sharding="fsdp",
                             gpus=2, gpus_per_node=2, safety_margin="0.2", max_per_device_batch=64)
    assert (req.global_batch, req.per_core_batch, req.accumulation_steps, req.remat, req.sharding) == (
        512, 64, 2, "full", "fsdp")
    assert (req.gpus, req.gpus_per_node, req.safety_margin, req.max_per_device_batch) == (2, 2, 0.2, 64)


def test_the_app_takes_registered_workloads_and_their_presets_only():
    assert forms.preset_choices("llama") == ("tiny", "1b", "3b", "8b")
    err = refusal(forms.plan_request, workload="llama", preset="gpt2-small")
    assert str(err) == "preset: must be one of tiny, 1b, 3b, 8b; got 'gpt2-small'"
    assert forms.plan_request(workload="llama", preset="1b").preset == "1b"
    assert refusal(forms.plan_request, workload="mypkg.models:MINE").field == "workload"
    assert str(refusal(forms.plan_request, workload=" llama ")).endswith("; got ' llama '")  # exactly a name
    # Where references are allowed, the names are text the workload then checks.
    assert forms.plan_request(workload="llama", preset="1b", registered_only=False).workload == "llama"
    err = refusal(forms.plan_request, workload="x" * 201, registered_only=False)
    assert err.field == "workload" and "at most 200 characters" in str(err)
    err = refusal(forms.plan_request, workload="llama", preset="p\n", registered_only=False)
    assert err.field == "preset" and "without control characters" in str(err)


# -- checkpoint names and folders -------------------------------------------------------------------------

RULE = ("a folder name of letters, digits, '.', '_' and '-' (at most 64 characters, not starting with '.'), like "
        "run-1, kept in this server's private checkpoint folder")


@pytest.mark.parametrize("raw,name", [
    ("", ""), ("   ", ""), ("run-1", "run-1"), (" run-1 ", "run-1"), ("A", "A"), ("9", "9"), ("a.b_c-D", "a.b_c-D"),
    ("a..b", "a..b"), ("x" * 64, "x" * 64), ("run.", "run."),
])
def test_a_checkpoint_name_is_a_plain_folder_name(raw, name):
    assert forms.checkpoint_name(raw, "save_checkpoint") == name


@pytest.mark.parametrize("raw,why", [
    ("/etc", "absolute paths are not allowed; give "), ("\\\\server\\share", "absolute paths are not allowed; give "),
    ("~/x", "absolute paths are not allowed; give "), ("~x", "absolute paths are not allowed; give "),
    ("C:x", "absolute paths are not allowed; give "), ("c:\\x", "absolute paths are not allowed; give "),
    ("z:", "absolute paths are not allowed; give "),
    ("..", "'..' is not allowed; give "), ("a/..", "'..' is not allowed; give "),
    ("../bob/run-1", "'..' is not allowed; give "), ("a\\..\\b", "'..' is not allowed; give "),
    ("a/../../b", "'..' is not allowed; give "),
    (".hidden", "must be "), (".", "must be "), ("-x", "must be "), ("_x", "must be "), ("a/b", "must be "),
    ("a\\b", "must be "), ("a b", "must be "), ("é", "must be "), ("run:1", "must be "), ("a*", "must be "),
])
def test_a_checkpoint_name_that_is_a_path_or_not_a_plain_name_is_refused_with_the_rule(raw, why):
    err = refusal(forms.checkpoint_name, raw, "save_checkpoint")
    assert err.field == "save_checkpoint"
    assert str(err) == f"save_checkpoint: {why}{RULE}; got {raw!r}"


def test_a_checkpoint_name_too_long_or_not_text_is_refused():
    assert "at most 64 characters; got 65 characters" in str(refusal(forms.checkpoint_name, "x" * 65, "save_checkpoint"))
    assert refusal(forms.checkpoint_name, 7, "restore_checkpoint").field == "restore_checkpoint"
    assert "without control characters" in str(refusal(forms.checkpoint_name, "a\nb", "save_checkpoint"))


@pytest.mark.parametrize("user,pattern", [
    ("alice", r"alice-[0-9a-f]{8}"), ("Bob_9-x", r"Bob_9-x-[0-9a-f]{8}"), ("a/b c.d@e", r"a_b_c_d_e-[0-9a-f]{8}"),
    ("../..", r"_____-[0-9a-f]{8}"), ("é", r"_-[0-9a-f]{8}"), ("x" * 40, r"x{32}-[0-9a-f]{8}"),
    ("y" * 32, r"y{32}-[0-9a-f]{8}"), ("", r"local-[0-9a-f]{8}"),
])
def test_a_users_folder_is_a_readable_name_and_a_short_hash(user, pattern):
    assert re.fullmatch(pattern, forms.user_folder(user)), forms.user_folder(user)
    assert forms.user_folder(user) == forms.user_folder(user)


def test_users_whose_names_read_alike_get_distinct_folders():
    names = ["a/b", "a_b", "a b", "a.b", "", "local", "x" * 40, "x" * 41]
    assert len({forms.user_folder(n) for n in names}) == len(names)
    assert forms.user_folder("") == "local-e3b0c442"  # sha256 of nothing


@pytest.fixture
def users(tmp_path):
    alice, bob = tmp_path / forms.user_folder("alice"), tmp_path / forms.user_folder("bob")
    for root, name in ((alice, "run-2"), (alice, "run-1"), (bob, "bob-run")):
        (root / name).mkdir(parents=True)
        (root / name / CHECKPOINT_META_FILE).write_text("{}")
    (alice / "empty").mkdir()  # a folder without a checkpoint in it
    return alice, bob


def test_a_restore_name_resolves_to_the_users_own_checkpoint(users):
    alice, _ = users
    assert forms.checkpoint_folder("run-1", "restore_checkpoint", alice) == str(alice / "run-1")
    assert forms.checkpoint_folder(" run-2 ", "restore_checkpoint", alice) == str(alice / "run-2")
    assert forms.checkpoint_folder("", "restore_checkpoint", alice) == ""
    assert forms.checkpoint_folders("new-run", "run-1", alice) == (str(alice / "new-run"), str(alice / "run-1"))
    assert forms.checkpoint_folders("run-1", "", alice) == (str(alice / "run-1"), "")
    assert forms.checkpoint_folders("", "", alice) == ("", "")


@pytest.mark.parametrize("name", ["run-3", "empty", "bob-run", "RUN-1", "run-1.", "run"])
def test_a_restore_name_without_a_checkpoint_of_the_user_is_refused_listing_theirs(users, name):
    alice, _ = users
    err = refusal(forms.checkpoint_folder, name, "restore_checkpoint", alice)
    assert str(err) == (f"restore_checkpoint: no checkpoint named {name!r}; yours: run-1, run-2 "
                        "(save one with 'Save a checkpoint after the run')")
    assert str(refusal(forms.checkpoint_folders, "", name, alice)) == str(err)


def test_a_folder_whose_description_is_not_a_file_is_no_checkpoint(users):
    alice, _ = users
    (alice / "odd" / CHECKPOINT_META_FILE).mkdir(parents=True)
    err = refusal(forms.checkpoint_folder, "odd", "restore_checkpoint", alice)
    assert err.field == "restore_checkpoint" and "no checkpoint named 'odd'" in str(err)


def test_another_users_checkpoint_cannot_be_reached_by_a_path(users, tmp_path):
    alice, bob = users
    for raw, why in ((f"../{bob.name}/bob-run", "'..' is not allowed"), (f"/{bob.name}/bob-run", "absolute paths")):
        err = refusal(forms.checkpoint_folder, raw, "restore_checkpoint", alice)
        assert err.field == "restore_checkpoint" and why in str(err)
        assert refusal(forms.checkpoint_folders, raw, "", alice).field == "save_checkpoint"
    newcomer = tmp_path / forms.user_folder("carol")
    err = refusal(forms.checkpoint_folder, "bob-run", "checkpoint", newcomer)
    assert str(err) == ("checkpoint: no checkpoint named 'bob-run'; yours: none yet "
                        "(save one with 'Save a checkpoint after the run')")


def test_the_save_name_is_checked_before_the_restore_name(users):
    alice, _ = users
    assert refusal(forms.checkpoint_folders, "/x", "missing", alice).field == "save_checkpoint"
    assert refusal(forms.checkpoint_folders, "ok", "missing", alice).field == "restore_checkpoint"


# -- serving: batch sizes and model choices -----------------------------------------------------------------

@pytest.mark.parametrize("raw,sizes", [
    (None, ()), ("", ()), ((), ()), ("4", (4,)), ("16,1,4,4", (1, 4, 16)), (" 8 , 2 ", (2, 8)), ([8, 2.0], (2, 8)),
    ("1,4096", (1, 4096)), (",".join(map(str, range(1, 17))), tuple(range(1, 17))), (["3"], (3,)),
])
def test_batch_sizes_are_sorted_distinct_whole_numbers(raw, sizes):
    assert batch_list(raw) == sizes


@pytest.mark.parametrize("raw,part", [
    ("0", "0"), ("4097", "4097"), ("1,two", "two"), ("1,,2", ""), ("2.5", "2.5"), ([True], "True"), ("-1", "-1"),
    ("x" * 50, "x" * 40), ([None], "None"),
])
def test_a_bad_batch_size_is_refused_with_the_range(raw, part):
    err = refusal(batch_list, raw)
    assert str(err) == ("batches: each batch size must be a whole number from 1 to 4,096, comma-separated "
                        f"(e.g. 1,8,32); got {part!r}")


@pytest.mark.parametrize("raw", [4, 4.0, True, {"a": 1}])
def test_batch_sizes_that_are_neither_text_nor_a_list_are_refused(raw):
    err = refusal(batch_list, raw)
    assert str(err).startswith("batches: batch sizes are text or a list, comma-separated whole numbers from 1 to "
                               f"4,096 (e.g. 1,8,32); got {type(raw).__name__}")
    assert refusal(serve_run_request, workload="llama", preset="tiny", batches=raw).field == "batches"


def test_too_many_batch_sizes_or_a_narrower_range_are_refused():
    assert str(refusal(batch_list, ",".join(["1"] * 17))) == "batches: at most 16 batch sizes; got 17"
    assert batch_list("1,256", 1, 256, 6) == (1, 256)
    assert "from 1 to 256" in str(refusal(batch_list, "257", 1, 256, 6))
    assert "from 2 to 256" in str(refusal(batch_list, "1", 2, 256, 6))
    assert str(refusal(batch_list, "1,2,3,4,5,6,7", 1, 256, 6)) == "batches: at most 6 batch sizes; got 7"


def test_a_served_model_is_a_decoder_familys_preset_at_a_serving_precision():
    assert decoder_choices("llama", "8b", "int8") == ("llama", "8b", "int8")
    assert decoder_choices("transformer", "gpt2-xl", "fp16") == ("transformer", "gpt2-xl", "fp16")
    assert str(refusal(decoder_choices, "mlp", "tiny", "bf16")) == (
        "workload: mlp has no decode path; serving is for the decoder families (transformer, llama, moe)")
    assert refusal(decoder_choices, "cnn", "tiny", "bf16").field == "workload"
    assert refusal(decoder_choices, "bert", "tiny", "bf16").field == "workload"
    assert str(refusal(decoder_choices, "llama", "gpt2-small", "bf16")) == (
        "preset: must be one of tiny, 1b, 3b, 8b; got 'gpt2-small'")
    assert str(refusal(decoder_choices, "llama", "tiny", "int4")) == (
        "precision: must be one of bf16, fp16, fp32, int8; got 'int4'")


# -- serving plans ------------------------------------------------------------------------------------

def plan_req(**change):
    return serve_request(**{"workload": "llama", "preset": "tiny", "target": "h100-sxm", "prompt_len": 16,
                            "gen_len": 16} | change)


def test_a_serving_plan_request_keeps_every_value():
    req = serve_request(workload="llama", preset="1b", target="l4", prompt_len="1024", gen_len=256.0,
                        precision="int8", model={"n_layers": 4}, batches="16,1,4,4", gpus="2", memory_fraction="0.5")
    assert req == ServeRequest("llama", "1b", "l4", 1024, 256, "int8", {"n_layers": 4}, (1, 4, 16), 2, 0.5, "")
    assert type(req.prompt_len) is int and type(req.gen_len) is int and type(req.memory_fraction) is float
    req = serve_request(workload="transformer", preset="tiny", target="h200", prompt_len=1, gen_len=1)
    assert req == ServeRequest("transformer", "tiny", "h200", 1, 1, "bf16", {}, (), 1, 0.9, "")


@pytest.mark.parametrize("change", [
    dict(gpus=1), dict(gpus=2), dict(gpus=8, preset="1b"), dict(memory_fraction=0.05), dict(memory_fraction=1),
    dict(prompt_len=1, gen_len=63), dict(prompt_len=32, gen_len=32), dict(prompt_len=63, gen_len=1),
    dict(prompt_len=131071, gen_len=1, model={"seq_len": 131072}),
    dict(prompt_len=1, gen_len=131071, model={"seq_len": 131072}),
])
def test_a_serving_plan_takes_the_ends_of_each_range(change):
    req = plan_req(**change)
    assert all(getattr(req, k) == v for k, v in change.items())


@pytest.mark.parametrize("change,message", [
    (dict(prompt_len=0), "prompt_len: must be a whole number from 1 to 131072; got 0"),
    (dict(prompt_len=131073), "prompt_len: must be a whole number from 1 to 131072; got 131073"),
    (dict(gen_len=0), "gen_len: must be a whole number from 1 to 131072; got 0"),
    (dict(gen_len=131073), "gen_len: must be a whole number from 1 to 131072; got 131073"),
    (dict(gen_len=16.5), "gen_len: must be a whole number from 1 to 131072; got 16.5"),
    (dict(prompt_len=None), "prompt_len: must be a whole number from 1 to 131072; got None"),
    (dict(gpus=0), "gpus: must be a whole number from 1 to 8; got 0"),
    (dict(gpus=9), "gpus: must be a whole number from 1 to 8; got 9"),
    (dict(gpus=True), "gpus: must be a whole number from 1 to 8; got True"),
    (dict(memory_fraction=0.049), "memory_fraction: must be a number from 0.05 to 1; got 0.049"),
    (dict(memory_fraction=1.01), "memory_fraction: must be a number from 0.05 to 1; got 1.01"),
    (dict(memory_fraction=math.nan), "memory_fraction: must be a number from 0.05 to 1; got nan"),
    (dict(memory_fraction="90%"), "memory_fraction: must be a number from 0.05 to 1; got '90%'"),
    (dict(precision="int4"), "precision: must be one of bf16, fp16, fp32, int8; got 'int4'"),
    (dict(workload="mlp"), "workload: mlp has no decode path; serving is for the decoder families (transformer, llama, moe)"),
    (dict(gpus=4), "gpus: tensor parallelism over 4 GPUs divides the model's heads and hidden units among them; kv "
                   "heads 2 do not divide by 4 (GPU counts that do: 1, 2)"),
    (dict(gpus=3), "gpus: tensor parallelism over 3 GPUs divides the model's heads and hidden units among them; "
                   "attention heads 4, kv heads 2, MLP width (d_ff) 128 do not divide by 3 (GPU counts that do: 1, 2)"),
    (dict(gpus=3, preset="1b"), "gpus: tensor parallelism over 3 GPUs divides the model's heads and hidden units "
                                "among them; attention heads 32, kv heads 8, MLP width (d_ff) 8192 do not divide by 3 "
                                "(GPU counts that do: 1, 2, 4, 8)"),
    (dict(gpus=2, workload="transformer", model={"d_model": 72, "n_heads": 9, "n_kv_heads": 9, "d_ff": 288}),
     "gpus: tensor parallelism over 2 GPUs divides the model's heads and hidden units among them; attention heads 9, "
     "kv heads 9 do not divide by 2 (GPU counts that do: 1, 3)"),  # 9 is over the 8 of a node
    (dict(gpus=2, workload="transformer", preset="gpt2-xl"),
     "gpus: tensor parallelism over 2 GPUs divides the model's heads and hidden units among them; attention heads 25, "
     "kv heads 25 do not divide by 2 (GPU counts that do: 1, 5)"),
    (dict(prompt_len=33, gen_len=32), "gen_len: prompt (33) + generation (32) = 65 tokens exceed the model's context "
                                      "of 64 (seq_len, its training length)"),
    (dict(prompt_len=130000, gen_len=2000, preset="1b"), "gen_len: prompt (130,000) + generation (2,000) = 132,000 "
                                                         "tokens exceed the model's context of 131,072 (its published "
                                                         "context window)"),
    (dict(prompt_len=131072, gen_len=1, model={"seq_len": 131072}),
     "gen_len: prompt (131,072) + generation (1) = 131,073 tokens exceed the model's context of 131,072 (seq_len, its "
     "training length)"),
    (dict(prompt_len=1, gen_len=131072, model={"seq_len": 131072}),
     "gen_len: prompt (1) + generation (131,072) = 131,073 tokens exceed the model's context of 131,072 (seq_len, its "
     "training length)"),
    (dict(batches="0"), "batches: each batch size must be a whole number from 1 to 4,096, comma-separated "
                        "(e.g. 1,8,32); got '0'"),
])
def test_a_bad_serving_plan_value_is_refused_naming_the_field_and_what_is_allowed(change, message):
    err = refusal(plan_req, **change)
    assert str(err) == message and err.field == message.split(":")[0]


def test_a_bad_model_dimension_is_refused_naming_the_dimension():
    err = refusal(plan_req, model={"n_heads": 3})
    assert err.field == "n_heads" and "must divide d_model (64); got 3" in str(err)
    err = refusal(plan_req, model={"bogus": 1})
    assert err.field == "bogus" and "not a dimension of llama that can be changed; allowed: vocab_size" in str(err)
    err = refusal(plan_req, model={"seq_len": 131073})
    assert err.field == "seq_len" and "131072" in str(err)


def test_the_target_is_a_catalog_gpu():
    err = refusal(plan_req, target="local")
    assert err.field == "target" and "h100-sxm" in str(err) and str(err).endswith("; got 'local'")
    assert refusal(plan_req, target="H100-SXM").field == "target"


# -- serving runs -------------------------------------------------------------------------------------

def run_req(**change):
    return serve_run_request(**{"workload": "llama", "preset": "tiny"} | change)


def test_a_serving_run_request_keeps_every_value():
    assert run_req() == ServeRunRequest("llama", "tiny", "fp32", 50, (4,), (4, 32), (4, 24), 0.0, 0, {}, "")
    req = serve_run_request(workload="transformer", preset="tiny", precision="bf16", requests="7", batches="8,2,2",
                            prompt_min=" 3", prompt_max=30.0, gen_min=5, gen_max="6", temperature="0.7",
                            seed=2**31 - 1)
    assert req == ServeRunRequest("transformer", "tiny", "bf16", 7, (2, 8), (3, 30), (5, 6), 0.7, 2**31 - 1, {}, "")
    assert type(req.requests) is int and type(req.seed) is int and type(req.temperature) is float
    assert all(type(n) is int for n in (*req.prompt_range, *req.gen_range))


@pytest.mark.parametrize("change,field,value", [
    (dict(requests=1), "requests", 1), (dict(requests=1000), "requests", 1000), (dict(seed=0), "seed", 0),
    (dict(seed=2**31 - 1), "seed", 2**31 - 1), (dict(batches="1"), "batches", (1,)),
    (dict(batches="256"), "batches", (256,)), (dict(batches="6,5,4,3,2,1"), "batches", (1, 2, 3, 4, 5, 6)),
    (dict(batches=[2, 2]), "batches", (2,)),
    (dict(prompt_min=1), "prompt_range", (1, 32)), (dict(prompt_min=8, prompt_max=8), "prompt_range", (8, 8)),
    (dict(gen_min=1), "gen_range", (1, 24)), (dict(gen_min=24), "gen_range", (24, 24)),
    (dict(prompt_max=40, gen_max=24), "prompt_range", (4, 40)), (dict(prompt_max=4, gen_max=60), "gen_range", (4, 60)),
    (dict(temperature=0), "temperature", 0.0), (dict(temperature=10), "temperature", 10.0),
    (dict(temperature="1e-3"), "temperature", 1e-3),
])
def test_a_serving_run_takes_the_ends_of_each_range(change, field, value):
    assert getattr(run_req(**change), field) == value


@pytest.mark.parametrize("change,message", [
    (dict(requests=0), "requests: must be a whole number from 1 to 1000; got 0"),
    (dict(requests=1001), "requests: must be a whole number from 1 to 1000; got 1001"),
    (dict(requests=True), "requests: must be a whole number from 1 to 1000; got True"),
    (dict(seed=-1), "seed: must be a whole number from 0 to 2147483647; got -1"),
    (dict(seed=2**31), "seed: must be a whole number from 0 to 2147483647; got 2147483648"),
    (dict(seed=1.5), "seed: must be a whole number from 0 to 2147483647; got 1.5"),
    (dict(batches="0"), "batches: each batch size must be a whole number from 1 to 4,096, comma-separated "
                        "(e.g. 1,8,32); got '0'"),
    (dict(batches="4097"), "batches: each batch size must be a whole number from 1 to 4,096, comma-separated "
                           "(e.g. 1,8,32); got '4097'"),
    (dict(batches="1,2,3,4,5,6,7"), "batches: at most 6 batch sizes; got 7"),
    (dict(batches=""), "batches: give one to 6 batch sizes from 1 to 4,096, comma-separated (e.g. 1,4,8)"),
    (dict(batches=None), "batches: give one to 6 batch sizes from 1 to 4,096, comma-separated (e.g. 1,4,8)"),
    (dict(batches=()), "batches: give one to 6 batch sizes from 1 to 4,096, comma-separated (e.g. 1,4,8)"),
    (dict(prompt_min=0), "prompt_min: must be a whole number from 1 to 131072; got 0"),
    (dict(prompt_max=131073), "prompt_max: must be a whole number from 1 to 131072; got 131073"),
    (dict(gen_min=0), "gen_min: must be a whole number from 1 to 131072; got 0"),
    (dict(gen_max=131073), "gen_max: must be a whole number from 1 to 131072; got 131073"),
    (dict(gen_max="many"), "gen_max: must be a whole number from 1 to 131072; got 'many'"),
    (dict(prompt_min=9, prompt_max=8), "prompt_min: must be at most prompt_max (8); got 9"),
    (dict(gen_min=10, gen_max=9), "gen_min: must be at most gen_max (9); got 10"),
    (dict(prompt_max=40, gen_max=25), "gen_max: the longest prompt (40) and generation (25) exceed the model's "
                                      "context of 64 (seq_len, its training length)"),
    (dict(prompt_max=61, gen_max=4), "gen_max: the longest prompt (61) and generation (4) exceed the model's "
                                     "context of 64 (seq_len, its training length)"),
    (dict(temperature=-0.1), "temperature: must be a number from 0 to 10; got -0.1"),
    (dict(temperature=10.01), "temperature: must be a number from 0 to 10; got 10.01"),
    (dict(temperature=math.inf), "temperature: must be a number from 0 to 10; got inf"),
    (dict(temperature="hot"), "temperature: must be a number from 0 to 10; got 'hot'"),
    (dict(precision="int4"), "precision: must be one of bf16, fp16, fp32, int8; got 'int4'"),
    (dict(workload="mlp"), "workload: mlp has no decode path; serving is for the decoder families (transformer, llama, moe)"),
    (dict(preset="gpt2-small"), "preset: must be one of tiny, 1b, 3b, 8b; got 'gpt2-small'"),
])
def test_a_bad_serving_run_value_is_refused_naming_the_field_and_what_is_allowed(change, message):
    err = refusal(run_req, **change)
    assert str(err) == message and err.field == message.split(":")[0]


def test_the_longest_run_lengths_are_bounded_by_the_largest_context():
    """Llama 3.2 1B serves its published 131,072 tokens (it trains here at 2,048)."""
    req = run_req(workload="llama", preset="1b", prompt_min=1, prompt_max=131071, gen_min=1, gen_max=1)
    assert (req.prompt_range, req.gen_range) == ((1, 131071), (1, 1))
    assert refusal(run_req, preset="1b", prompt_min=1, prompt_max=131072, gen_min=1, gen_max=1).field == "gen_max"


# -- a checkpoint as the served model ---------------------------------------------------------------------

@pytest.mark.parametrize("workload,preset", [
    (None, None), ("", ""), ("llama", None), (None, "tiny"), ("llama", "tiny"), ("", "tiny"), ("llama", ""),
])
def test_a_checkpoint_is_served_as_the_model_it_was_saved_from(saved, workload, preset):
    meta = serving_checkpoint(saved["llama"], workload, preset)
    assert (meta.workload, meta.preset, meta.model, meta.step) == ("llama", "tiny", LLAMA_MODEL, 4)
    plan = serve_request(workload=workload, preset=preset, target="l4", prompt_len=64, gen_len=64,
                         checkpoint=saved["llama"])
    assert plan == ServeRequest("llama", "tiny", "l4", 64, 64, "bf16", LLAMA_MODEL, (), 1, 0.9, saved["llama"])
    run = serve_run_request(workload=workload, preset=preset, prompt_max=64, gen_max=64, checkpoint=saved["llama"])
    assert run == ServeRunRequest("llama", "tiny", "fp32", 50, (4,), (4, 64), (4, 64), 0.0, 0, LLAMA_MODEL,
                                  saved["llama"])


def test_the_checkpoints_model_replaces_the_one_named_and_its_context_bounds_the_lengths(saved):
    plan = serve_request(workload="llama", preset="tiny", target="l4", prompt_len=1, gen_len=1,
                         model={"n_layers": 4}, checkpoint=saved["llama"])
    assert plan.model == LLAMA_MODEL
    err = refusal(serve_request, workload=None, preset=None, target="l4", prompt_len=64, gen_len=65,
                  checkpoint=saved["llama"])
    assert err.field == "gen_len" and "context of 128" in str(err)
    err = refusal(serve_run_request, workload=None, preset=None, prompt_max=65, gen_max=64, checkpoint=saved["llama"])
    assert err.field == "gen_max" and "context of 128" in str(err)


@pytest.mark.parametrize("workload,preset,asked", [
    ("transformer", None, "transformer"), (None, "1b", "1b"), ("llama", "1b", "llama/1b"),
    ("transformer", "tiny", "transformer/tiny"), ("", "8b", "8b"), ("transformer", "", "transformer"),
    (5, None, "5"),
])
def test_a_checkpoint_of_another_model_than_the_one_named_is_refused(saved, workload, preset, asked):
    message = (f"checkpoint: the checkpoint is of another model: llama/tiny ({LLAMA_DIMS}), the request names "
               f"{asked!r}; a checkpoint serves only as the model it was saved from: name that model, or leave "
               "workload and preset empty")
    assert str(refusal(serving_checkpoint, saved["llama"], workload, preset)) == message
    assert str(refusal(serve_request, workload=workload, preset=preset, target="l4", prompt_len=1, gen_len=1,
                       checkpoint=saved["llama"])) == message
    assert str(refusal(serve_run_request, workload=workload, preset=preset, checkpoint=saved["llama"])) == message


@pytest.mark.parametrize("path", [5, None, b"/x", "relative/ckpt", "./ckpt", "~/ckpt", "/nowhere/\n", "/a\0b",
                                  "x\n/abs"])
def test_a_checkpoint_that_is_not_an_absolute_path_is_refused(path):
    message = ("checkpoint: must be the absolute path of a checkpoint folder (written by run --save-checkpoint); "
               f"got {path!r}")
    assert str(refusal(serving_checkpoint, path, None, None)) == message
    if path:  # an empty value names no checkpoint
        assert str(refusal(serve_run_request, workload=None, preset=None, checkpoint=path)) == message


def test_a_checkpoint_path_too_long_for_the_file_system_is_refused():
    err = refusal(serving_checkpoint, "/" + "x" * 300, None, None)
    assert err.field == "checkpoint" and "File name too long" in str(err)


def test_a_newline_or_null_in_a_real_checkpoints_path_is_refused(saved):
    for path in (saved["llama"] + "\n", saved["llama"] + "\0"):
        assert "must be the absolute path" in str(refusal(serving_checkpoint, path, None, None))


def test_a_folder_without_a_readable_decoder_checkpoint_is_refused(saved, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / CHECKPOINT_META_FILE).write_text("{not json")
    cases = [(str(tmp_path / "missing"), "no such folder"), (str(tmp_path), "is not a checkpoint folder"),
             (str(tmp_path / "broken"), "is not a readable checkpoint description"),
             (saved["mlp"], "the checkpoint is of mlp/tiny, which has no decode path; serving is for the decoder "
                            "families (transformer, llama, moe)")]
    for path, words in cases:
        for call in (lambda: serving_checkpoint(path, None, None),
                     lambda: serve_request(workload=None, preset=None, target="l4", prompt_len=1, gen_len=1,
                                           checkpoint=path),
                     lambda: serve_run_request(workload="mlp", preset="tiny", checkpoint=path)):
            err = refusal(call)
            assert err.field == "checkpoint" and words in str(err), str(err)


@pytest.mark.parametrize("field,bad", [("dims", [1, 2]), ("model", "x"), ("step", "3"), ("devices", True),
                                       ("workload", 5), ("loss_scale", [1.0])])
def test_a_checkpoint_description_with_a_field_of_the_wrong_type_is_refused(saved, tmp_path, field, bad):
    meta = json.loads((Path(saved["llama"]) / CHECKPOINT_META_FILE).read_text())
    meta[field] = bad
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / CHECKPOINT_META_FILE).write_text(json.dumps(meta))
    for workload, preset in ((None, None), ("transformer", "small")):
        err = refusal(serving_checkpoint, str(tmp_path / "odd"), workload, preset)
        assert err.field == "checkpoint" and f"(wrong type of {field})" in str(err), str(err)


def test_no_checkpoint_serves_the_preset():
    for none in ("", None):
        assert run_req(checkpoint=none).checkpoint == "" and run_req(checkpoint=none).model == {}
        assert plan_req(checkpoint=none).checkpoint == "" and plan_req(checkpoint=none).model == {}


@pytest.mark.parametrize("model,message", [
    ({"n_heads": 5}, "n_heads: must divide d_model (64); got 5"),
    ({"n_heads": "x"}, "n_heads: must be an integer from 1 to 1024; got 'x'"),
])
def test_a_serving_models_bad_dimension_is_named_once(model, message):
    with pytest.raises(ConfigError) as refused:
        serve_request(workload="llama", preset="tiny", target="l4", model=model, prompt_len=16, gen_len=8)
    assert str(refused.value) == message and refused.value.field == "n_heads"


def test_an_integer_field_takes_both_ends_of_its_range_and_names_a_value_past_them():
    from migration.config.limits import LIMITS, check_int

    lo, hi = LIMITS["steps"]
    for value in (lo, hi):
        check_int(dataclasses.make_dataclass("Cfg", [("steps", int)])(value), "steps")
    with pytest.raises(ConfigError) as refused:
        check_int(dataclasses.make_dataclass("Cfg", [("steps", int)])(hi + 1), "steps")
    assert str(refused.value) == f"steps: must be an integer from {int(lo)} to {int(hi)}; got {hi + 1}"


def test_batch_sizes_of_another_type_are_refused_quoting_forty_characters():
    with pytest.raises(ConfigError) as refused:
        batch_list(10**50)
    assert str(refused.value).endswith(f"(e.g. 1,8,32); got int {str(10**50)[:40]!r}")
