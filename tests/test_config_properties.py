"""Properties of validation: whatever value lands in a numeric field, the outcome is either a valid config
(every field within LIMITS / PLAN_LIMITS, whole numbers as ints) or a ConfigError naming a field of the
config; never another exception type."""

import dataclasses
import math
import unicodedata

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migration.config import forms
from migration.config.limits import LIMITS, PLAN_LIMITS
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request

ANY = st.one_of(
    st.integers(),
    st.integers(min_value=-3, max_value=300),  # small values hit the valid ranges often
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-2, max_value=300),
    st.sampled_from([0.0, 0.5, 1.0, 256.0, 256.5, -0.0, 1e300, float("nan"), float("inf"), float("-inf")]),
    st.text(max_size=12),
    st.sampled_from(["256", " 32 ", "0", "0.5", "1e-3", "nan", "inf", "-1", "1_0", "٣", "", "  "]),
    st.booleans(),
    st.none(),
)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

RUN_FIELDS = {f.name for f in dataclasses.fields(RunConfig)}
PLAN_FIELDS = {f.name for f in dataclasses.fields(PlanRequest)}
RUN_INTS = ("per_device_batch", "devices", "accumulation_steps", "steps", "warmup_steps", "seed", "profile_steps")
RUN_FLOATS = ("learning_rate", "timeout_s", "silence_timeout_s", "memory_fraction")
PLAN_INTS = ("global_batch", "per_core_batch", "gpus", "max_per_device_batch", "accumulation_steps")
PLAN_FLOATS = ("memory_fraction", "safety_margin", "timeout_s", "silence_timeout_s")
FORM_PLAN = dict(workload="transformer", preset="tiny", source="tpu-v5e-8", global_batch=256, per_core_batch=0,
                 source_precision="bf16", target="h100-sxm", gpus=1, memory_fraction=0.8, granularity="multiple8",
                 remat="auto", precision="auto", accumulation=0)


def within(value, limits, field, integer):
    lo, hi = limits[field]
    if integer:
        assert type(value) is int, (field, value)
    else:
        assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value), (field, value)
    assert lo <= value <= hi, (field, value)


def assert_valid_run(cfg: RunConfig):
    for field in RUN_INTS:
        within(getattr(cfg, field), LIMITS, field, integer=True)
    for field in RUN_FLOATS:
        within(getattr(cfg, field), LIMITS, field, integer=False)
    assert cfg.warmup_steps < cfg.steps


def assert_valid_plan(req: PlanRequest):
    from migration.hardware import TPU_SPECS

    for field in ("global_batch", "gpus", "max_per_device_batch"):
        within(getattr(req, field), PLAN_LIMITS, field, integer=True)
    for field in PLAN_FLOATS:
        within(getattr(req, field), PLAN_LIMITS, field, integer=False)
    if req.per_core_batch is not None:
        within(req.per_core_batch, PLAN_LIMITS, "per_core_batch", integer=True)
        assert req.per_core_batch * TPU_SPECS[req.source].devices == req.global_batch
    if req.accumulation_steps is not None:
        within(req.accumulation_steps, LIMITS, "accumulation_steps", integer=True)
        assert req.accumulation_steps * req.gpus <= req.global_batch


def outcome(make, fields):
    """The config `make()` returns, or None after a ConfigError naming one of `fields`."""
    try:
        return make()
    except ConfigError as exc:
        assert exc.field in fields, exc
        assert "\n" not in str(exc) and str(exc).startswith(f"{exc.field}: ")
        return None


@pytest.mark.parametrize("field", RUN_INTS + RUN_FLOATS)
@SETTINGS
@given(value=ANY)
def test_run_config_numeric_fields(field, value):
    cfg = outcome(lambda: validate(RunConfig(**{field: value})), RUN_FIELDS)
    if cfg is not None:
        assert_valid_run(cfg)


@pytest.mark.parametrize("field", PLAN_INTS + PLAN_FLOATS)
@SETTINGS
@given(value=ANY, source=st.sampled_from(["tpu-v5e-8", "tpu-v4-8"]))
def test_plan_request_numeric_fields(field, value, source):
    req = outcome(lambda: validate_plan_request(PlanRequest(source=source, **{field: value})), PLAN_FIELDS)
    if req is not None:
        assert_valid_plan(req)


@pytest.mark.parametrize("field", ["global_batch", "per_core_batch", "gpus", "memory_fraction", "accumulation"])
@SETTINGS
@given(value=ANY, other=ANY)
def test_form_plan_numeric_fields(field, value, other):
    # `other` goes into global_batch (or gpus when global_batch is the field): the pairs that contradict
    # each other are reached too.
    second = "gpus" if field == "global_batch" else "global_batch"
    req = outcome(lambda: forms.plan_request(**{**FORM_PLAN, field: value, second: other}), PLAN_FIELDS)
    if req is not None:
        assert_valid_plan(req)


@pytest.mark.parametrize("field", ["steps", "learning_rate"])
@SETTINGS
@given(value=ANY, max_steps=st.one_of(st.none(), st.integers(min_value=1, max_value=200_000)))
def test_form_run_settings_numeric_fields(field, value, max_steps):
    raw = {"steps": 20, "learning_rate": 3e-3, "label": "x", field: value}
    try:
        steps, lr, label = forms.run_settings(**raw, max_steps=max_steps)
    except ConfigError as exc:
        assert exc.field in RUN_FIELDS and "\n" not in str(exc), exc
        return
    assert type(steps) is int and LIMITS["steps"][0] <= steps <= LIMITS["steps"][1]
    assert max_steps is None or steps <= max_steps
    assert type(lr) is float and LIMITS["learning_rate"][0] <= lr <= LIMITS["learning_rate"][1]
    assert label == "x"


@SETTINGS
@given(value=st.one_of(st.text(max_size=120), st.none(), st.integers(), st.binary(max_size=8)))
def test_form_label(value):
    try:
        label = forms.run_settings(20, 3e-3, value)[2]
    except ConfigError as exc:
        assert exc.field == "label" and "\n" not in str(exc)
        return
    assert isinstance(label, str) and len(label) <= forms.LABEL_MAX_CHARS and label == label.strip()
    assert not any(unicodedata.category(ch) in ("Cc", "Cs", "Zl", "Zp") for ch in label)


@pytest.mark.parametrize("make,field", [
    (lambda: validate(RunConfig(learning_rate=10**400)), "learning_rate"),  # math.isfinite would overflow
    (lambda: validate(RunConfig(steps=10**5000)), "steps"),  # repr would raise ValueError (4,300 digits)
    (lambda: validate(RunConfig(visible_devices=5)), "visible_devices"),
    (lambda: validate(RunConfig(visible_devices="٣")), "visible_devices"),
    (lambda: validate_plan_request(PlanRequest(memory_fraction=-10**400)), "memory_fraction"),
    (lambda: validate_plan_request(PlanRequest(global_batch=10**400)), "global_batch"),
    (lambda: validate_plan_request(PlanRequest(workload="x" * 10_000)), "workload"),
])
def test_extreme_values_are_config_errors(make, field):
    with pytest.raises(ConfigError) as err:
        make()
    assert err.value.field == field and len(str(err.value)) < 300
