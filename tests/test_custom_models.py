"""Transformers of any dimensions: analytic counts against built models, the published sizes of the
presets, one-line refusals of bad dimensions (API and CLI), one compiled block body whatever the
depth, and the CLI's dimension flags reaching the plan."""

import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from migration.cli.parser import MODEL_FLAGS, build_parser, model_overrides as _model_overrides
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate, validate_plan_request
from migration.step.train import (
    TrainProgram,
    abstract_batch,
    abstract_state,
    jit_step,
    make_data_mesh,
)
from workloads import WORKLOADS
from workloads.transformer import DIM_LIMITS

ROOT = Path(__file__).resolve().parent.parent
FAMILIES = ("transformer", "llama")


def build(workload, cfg, *, abstract: bool):
    make = lambda: workload.build(cfg, dtype=jnp.float32, block_wrap=lambda f: f, rngs=nnx.Rngs(0))
    return nnx.eval_shape(make) if abstract else make()


def counted(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


# -- any valid dimensions --------------------------------------------------------------------------

@st.composite
def dimensions(draw):
    family = draw(st.sampled_from(FAMILIES))
    preset = draw(st.sampled_from(sorted(WORKLOADS[family].presets)))
    rope = WORKLOADS[family].presets[preset].positions == "rope"
    n_heads = draw(st.integers(1, 8))
    n_kv_heads = draw(st.sampled_from([k for k in range(1, n_heads + 1) if n_heads % k == 0]))
    # d_model >= 8 (DIM_LIMITS); rotary positions need an even head size.
    smallest = max(1, -(-DIM_LIMITS["d_model"][0] // n_heads))
    head_dim = draw(st.integers(smallest, smallest + 8).filter(lambda h: not rope or h % 2 == 0))
    overrides = {
        "n_layers": draw(st.integers(1, 3)),
        "d_model": n_heads * head_dim,
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "d_ff": draw(st.integers(1, 64)),
        "vocab_size": draw(st.integers(2, 300)),
        "seq_len": draw(st.integers(2, 32)),
        "tied_embeddings": draw(st.booleans()),
    }
    return family, preset, overrides


def with_random_values(model, seed: int = 0):
    """(graphdef, state) of an abstract model with small random values for its arrays: a forward pass
    without initialising eagerly (one compile per example instead of one per initialiser)."""
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(seed)

    def fill(s):
        assert jnp.issubdtype(s.dtype, jnp.floating), s
        return rng.normal(0.0, 0.02, s.shape).astype(s.dtype)

    return graphdef, jax.tree.map(fill, state)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(dimensions(), st.integers(1, 3))
def test_any_valid_dimensions_build_a_model_of_the_analytic_size_that_runs(dims, batch):
    family, preset, overrides = dims
    w = WORKLOADS[family]
    cfg = w.config(preset, overrides)
    for field, value in overrides.items():
        assert getattr(cfg, field) == value
    model = build(w, cfg, abstract=True)
    assert counted(model) == w.param_count(cfg)

    graphdef, state = with_random_values(model)
    tokens = jax.random.randint(jax.random.key(0), (batch, cfg.seq_len), 0, cfg.vocab_size, dtype=jnp.int32)
    logits = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))(state, tokens)
    assert logits.shape == (batch, cfg.seq_len, cfg.vocab_size)
    assert bool(jnp.isfinite(logits).all())


def test_a_built_model_runs_eagerly_on_its_own_initial_values():
    w = WORKLOADS["llama"]
    cfg = w.config("tiny", {"n_layers": 1, "d_model": 24, "n_heads": 6, "n_kv_heads": 3, "d_ff": 7, "vocab_size": 5,
                            "seq_len": 3, "tied_embeddings": False})
    model = build(w, cfg, abstract=False)
    assert counted(model) == w.param_count(cfg)
    logits = model(jnp.zeros((2, 3), jnp.int32))
    assert logits.shape == (2, 3, 5) and bool(jnp.isfinite(logits).all())


# -- the presets' published sizes ------------------------------------------------------------------

PUBLISHED = [
    ("llama", "1b", 1_235_814_400),  # Llama 3.2 1B
    ("llama", "3b", 3_212_749_824),  # Llama 3.2 3B
    ("llama", "8b", 8_030_261_248),  # Llama 3.1 8B
    ("transformer", "gpt2-xl", 1_557_611_200),
    ("transformer", "gpt2-large", 774_030_080),
]


@pytest.mark.parametrize("family,preset,params", PUBLISHED)
def test_presets_have_the_published_parameter_counts(family, preset, params):
    w = WORKLOADS[family]
    cfg = w.config(preset)
    assert w.param_count(cfg) == params
    assert counted(build(w, cfg, abstract=True)) == params  # eval_shape: nothing is allocated


def test_the_modern_presets_use_the_modern_layout():
    for preset in ("1b", "3b", "8b"):
        cfg = WORKLOADS["llama"].config(preset)
        assert (cfg.norm, cfg.mlp, cfg.positions, cfg.bias) == ("rmsnorm", "swiglu", "rope", False)
        assert cfg.n_kv_heads == 8 < cfg.n_heads
    assert WORKLOADS["llama"].config("8b").tied_embeddings is False
    assert WORKLOADS["llama"].config("1b").tied_embeddings is True


# -- bad dimensions: one line naming the field -----------------------------------------------------

BAD_DIMENSIONS = [
    ({"n_kv_heads": 3}, "n_kv_heads"),  # tiny llama: 4 heads
    ({"n_heads": 4, "n_kv_heads": 3}, "n_kv_heads"),
    ({"d_model": 66}, "n_heads"),  # 4 heads do not divide 66
    ({"d_model": 36, "n_heads": 4, "n_kv_heads": 2}, "n_heads"),  # head size 9: odd, rotary needs even
    ({"d_model": 24, "n_heads": 8, "n_kv_heads": 8}, "n_heads"),  # head size 3
    ({"n_layers": 0}, "n_layers"),
    ({"n_layers": 257}, "n_layers"),
    ({"n_layers": -1}, "n_layers"),
    ({"vocab_size": 1}, "vocab_size"),
    ({"seq_len": 1}, "seq_len"),
    ({"d_model": 4, "n_heads": 2, "n_kv_heads": 2}, "d_model"),
    ({"n_layer": 2}, "n_layer"),  # not a dimension
    ({"hidden": 2}, "hidden"),
    ({"n_layers": 2.0}, "n_layers"),
    ({"n_layers": "2"}, "n_layers"),
    ({"d_ff": None}, "d_ff"),
    ({"n_layers": True}, "n_layers"),
    ({"tied_embeddings": 1}, "tied_embeddings"),
]


@pytest.mark.parametrize("model,field", BAD_DIMENSIONS, ids=[f"{f}-{m}" for m, f in BAD_DIMENSIONS])
def test_bad_dimensions_are_refused_in_one_line_naming_the_field(model, field):
    for make in (lambda: validate(RunConfig(workload="llama", preset="tiny", model=model)),
                 lambda: validate_plan_request(PlanRequest(workload="llama", preset="tiny", model=model))):
        with pytest.raises(ConfigError) as info:
            make()
        assert info.value.field == field
        text = str(info.value)
        assert text.startswith(f"{field}: ") and "\n" not in text and len(text) < 400


def test_an_unknown_dimension_lists_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"^n_layer: not a dimension of llama\b.*allowed: .*\bn_layers\b"):
        validate(RunConfig(workload="llama", preset="tiny", model={"n_layer": 2}))


def test_the_model_overrides_must_be_a_mapping_of_names():
    for model in ([("n_layers", 2)], {2: 3}):
        with pytest.raises(ConfigError) as info:
            validate(RunConfig(workload="llama", preset="tiny", model=model))
        assert info.value.field == "model"


def test_cli_refuses_kv_heads_that_do_not_divide_the_heads_in_one_line():
    proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "llama", "--kv-heads", "3",
                           "--no-tpu-compile", "--target", "t4"], cwd=ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "n_kv_heads" in lines[0] and "got 3" in lines[0]


@pytest.mark.parametrize("dims,says", [
    (["n_experts=2000"], "n_experts"),
    (["top_k=9"], "top_k"),
    (["capacity_factor=0"], "capacity_factor"),
    (["dispatch=sorted"], "dispatch"),
    (["__class__=x"], "__class__"),
    (["n_experts"], "--dim takes NAME=VALUE"),
    (["n_experts=" + "9" * 200], "--dim takes NAME=VALUE"),
])
def test_dim_values_are_data_checked_by_the_workload_in_one_line(dims, says):
    """--dim NAME=VALUE reaches only the workload's config (never a flag, a path or code): an unknown name,
    a value out of range or of the wrong kind is one line naming the field."""
    from migration.cli.commands import plan_request as plan_request_from_args

    args = build_parser().parse_args(["plan", "--workload", "moe", "--preset", "tiny", "--no-tpu-compile",
                                      *[x for d in dims for x in ("--dim", d)]])
    with pytest.raises(ConfigError, match=re.escape(says)) as info:
        plan_request_from_args(args)
    assert "\n" not in str(info.value)


def test_dim_values_reach_the_plan_request():
    from migration.cli.commands import plan_request as plan_request_from_args

    args = build_parser().parse_args(["plan", "--workload", "moe", "--preset", "tiny", "--no-tpu-compile", "--dim",
                                      "dispatch=capacity", "--dim", "capacity_factor=1.5", "--dim", "n_experts=8",
                                      "--sharding", "fsdp+ep4", "--gpus", "8"])
    req = plan_request_from_args(args)
    assert {k: req.model.get(k) for k in ("dispatch", "capacity_factor", "n_experts")} == \
        {"dispatch": "capacity", "capacity_factor": 1.5, "n_experts": 8}
    assert req.sharding == "fsdp+ep4"


# -- scanned layers: one block body whatever the depth ---------------------------------------------

def lowered_step_text(n_layers: int) -> str:
    program = TrainProgram.from_config(RunConfig(workload="llama", preset="tiny", model={"n_layers": n_layers}))
    mesh = make_data_mesh(jax.devices()[:1])
    return jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).as_text()


def test_the_train_step_of_a_deep_model_lowers_to_one_block_body():
    shallow, deep = lowered_step_text(4), lowered_step_text(32)
    d = WORKLOADS["llama"].presets["tiny"].d_model
    assert f"tensor<32x{d}x" in deep and f"tensor<4x{d}x" in shallow  # block parameters stacked on a layer axis
    assert len(deep) / len(shallow) < 1.1, (len(shallow), len(deep))
    assert deep.count("stablehlo.while") == shallow.count("stablehlo.while") > 0


# -- the CLI's dimension flags ---------------------------------------------------------------------

def test_dimension_flags_equal_to_the_preset_are_dropped():
    base = WORKLOADS["llama"].presets["8b"]
    args = build_parser().parse_args(["plan", "--workload", "llama", "--layers", "2",
                                      "--vocab", str(base.vocab_size), "--untied"])
    assert _model_overrides(args) == {"n_layers": 2}  # 8b is untied and has this vocabulary already
    assert args.preset == WORKLOADS["llama"].custom_base == "8b"
    args = build_parser().parse_args(["plan", "--workload", "llama", "--preset", "tiny", "--tied", "--heads", "8"])
    assert _model_overrides(args) == {"n_heads": 8}  # tiny is tied
    assert args.preset == "tiny"
    assert set(MODEL_FLAGS.values()) == set(DIM_LIMITS)


@pytest.mark.slow
def test_cli_dimension_flags_reach_the_plan(tmp_path):
    out = tmp_path / "plan.json"
    flags = {"layers": 2, "d-model": 64, "heads": 4, "kv-heads": 2, "d-ff": 96, "vocab": 256, "seq": 32}
    argv = [x for flag, value in flags.items() for x in (f"--{flag}", str(value))]
    proc = subprocess.run([sys.executable, "-m", "migration", "plan", "--workload", "llama", *argv, "--target", "t4",
                           "--global-batch", "16", "--no-tpu-compile", "--quiet", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, check=False, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    plan = json.loads(out.read_text())
    expected = {"n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96, "vocab_size": 256,
                "seq_len": 32}
    w = WORKLOADS["llama"]
    assert plan["status"] == "ok"
    assert plan["workload"] == "llama" and plan["preset"] == w.custom_base
    base = w.presets[plan["preset"]]
    assert expected == {k: v for k, v in expected.items() if getattr(base, k) != v}  # all differ from 8b
    assert {k: v for k, v in plan["model"].items() if k in DIM_LIMITS} == expected
    assert "tied_embeddings" not in plan["model"]  # not given: the base preset's layout
    assert plan["param_count"] == w.param_count(w.config(plan["preset"], plan["model"]))
    assert plan["param_count"] == w.param_count(w.config(plan["preset"], expected))
