"""A team's model as it is written: Linen, Haiku, Equinox, NNX and plain functions, through one protocol.

Each style is tried on a tiny instance of a real public model of that style (tests/fixtures/your_models/:
flax's lm1b Transformer in Linen, dm-haiku's example transformer, a GPT-2 in Equinox, JAX's MNIST
classifier from scratch as plain functions, the CNN of flax's NNX MNIST tutorial): its parameter count is the tree's and the hand count's,
its FLOPs (read from the traced program, and from the compiled step by `planning/hlo_cost.py`) within 5%
of a count worked out by hand; it is planned for a catalog GPU and a TPU slice and run three steps on
this machine through the command line; the migration decisions (precision, FSDP, tensor parallelism by
partition rules, remat where the code allows it) compile and train on the CPU backend's devices.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from migration.planning import hlo_cost
from migration.step.policies import PRECISION_POLICIES, REMAT_POLICIES
from migration.step.train import (
    TrainProgram,
    abstract_batch,
    abstract_state,
    batch_maker,
    init_state_on,
    jit_step,
    make_mesh,
)
from workloads import WORKLOADS
from workloads.base import ModelConfigError

ROOT = Path(__file__).resolve().parents[1]
STYLES = {"functional": "functional_mlp", "linen": "linen_lm1b", "haiku": "haiku_transformer",
          "equinox": "equinox_gpt", "nnx": "nnx_cnn"}


def fixture(style: str):
    return importlib.import_module(f"tests.fixtures.your_models.{STYLES[style]}")


def reference(style: str) -> str:
    return f"tests.fixtures.your_models.{STYLES[style]}:WORKLOAD"


def program(workload, *, batch: int = 4, devices: int = 1, precision: str = "fp32", remat: str = "none",
            sharding: str = "replicated", accumulation: int = 1) -> TrainProgram:
    return TrainProgram(workload=workload, model_cfg=workload.config(workload.default_preset),
                        precision=PRECISION_POLICIES[precision], remat=REMAT_POLICIES[remat], per_device_batch=batch,
                        devices=devices, accumulation_steps=accumulation, learning_rate=1e-3, seed=0,
                        sharding=sharding)


def tree_params(style: str) -> int:
    """The parameter count of the model made the style's own way, without the adapter."""
    m = fixture(style)
    key = jax.random.key(0)
    if style == "functional":
        tree = jax.eval_shape(m.init, key)
    elif style == "linen":
        example = jnp.zeros((1, m.CONFIG.max_len), jnp.int32)
        tree = jax.eval_shape(lambda: m.make(lambda cls: cls).init({"params": key, "dropout": key}, example))["params"]
    elif style == "haiku":
        import haiku as hk
        t = hk.transform(lambda b: m.loss(b, block_wrap=lambda f: f))
        tree = jax.eval_shape(t.init, key, {"tokens": jnp.zeros((1, m.T), jnp.int32)})
    elif style == "nnx":
        from flax import nnx
        tree = nnx.state(nnx.eval_shape(lambda: m.CNN(rngs=nnx.Rngs(0))), nnx.Param)
    else:
        import equinox as eqx
        tree = eqx.filter(eqx.filter_eval_shape(m.GPT, key),
                          lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact))
    return sum(math.prod(x.shape) for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("style", STYLES)
def test_a_models_parameters_and_flops_come_from_its_program(style):
    m = fixture(style)
    w, cfg = m.WORKLOAD, m.WORKLOAD.config("default")
    assert w.param_count(cfg) == tree_params(style) == m.HAND_PARAMS
    assert w.flops_per_example(cfg) == pytest.approx(m.HAND_TRAIN_FLOPS, rel=0.05)
    # the compiled training step (CPU backend), read as the planner reads a GPU or TPU program
    p = program(w, batch=4)
    mesh = make_mesh(jax.devices()[:1], "replicated")
    compiled = jit_step(p, mesh).lower(abstract_state(p, mesh), abstract_batch(p, mesh)).compile()
    compiled_flops = sum(k.flops for k in hlo_cost.read_program(compiled.as_text())) / 4
    assert compiled_flops == pytest.approx(m.HAND_TRAIN_FLOPS, rel=0.05)
    assert w.tokens_per_example(cfg) == (None if style in ("functional", "nnx") else 32)


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer", "llama"])
def test_a_built_in_familys_analytic_counts_agree_with_its_program(name):
    """The built-in families keep their analytic counts as overrides; the program says the same, exactly for
    the dense families. The CNN's analytic count follows the usual convention of charging every tap of a
    convolution, padding included, and the first convolution's input gradient; the program does neither
    (on the tiny preset's small images that is 8% fewer)."""
    w = WORKLOADS[name]
    cfg = w.config("tiny")
    facts = w.facts(cfg)
    assert w.param_count(cfg) == facts.params
    assert facts.train_flops == pytest.approx(w.flops_per_example(cfg), rel=0.10 if name == "cnn" else 1e-9)
    assert facts.train_flops <= w.flops_per_example(cfg) * (1 + 1e-9)
    assert set(w.checkpoint_names) <= set(facts.names)


@pytest.mark.parametrize("style, precision, remat, sharding", [
    ("functional", "fp16", "dots", "fsdp"),
    ("linen", "bf16", "full", "fsdp+tp2"),
    ("haiku", "bf16", "full", "replicated"),
    ("equinox", "bf16", "dots_no_batch", "fsdp+tp2"),
    ("nnx", "fp16", "none", "fsdp"),
])
def test_migration_decisions_apply_to_a_tree_the_product_did_not_write(style, precision, remat, sharding):
    """float32 masters with the compute dtype at the boundary (fp16 with loss scaling), FSDP on any tree,
    tensor parallelism where the partition rules say, remat where the code allows it; three steps train."""
    w = fixture(style).WORKLOAD
    p = program(w, batch=2, devices=4, precision=precision, remat=remat, sharding=sharding, accumulation=2)
    mesh = make_mesh(jax.devices()[:4], sharding)
    state = init_state_on(p, mesh)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(state.params))
    step, make = jit_step(p, mesh), batch_maker(p, mesh)
    losses = []
    for i in range(3):
        state, metrics = step(state, make(i))
        losses.append(float(metrics["loss"]))
    assert all(math.isfinite(x) for x in losses)
    specs = {jax.tree_util.keystr(path): s.sharding.spec
             for path, s in jax.tree_util.tree_leaves_with_path(abstract_state(p, mesh).params)}
    if sharding.startswith("fsdp"):  # the largest matrix is split over the FSDP axis
        assert any("fsdp" in tuple(spec) or "data" in tuple(spec) for spec in specs.values())
    if "tp" in sharding:  # the rules' MLP weights split over the tensor axis, nothing else
        split = [k for k, spec in specs.items() if "tensor" in tuple(spec)]
        assert split and all(("Dense_" in k or "up/" in k or "down/" in k or "query" in k or "key" in k
                              or "value" in k or "out/" in k) for k in split), split


def test_a_run_trains_on_the_teams_own_data_when_given():
    """`data`: the team's batches (host arrays) replace the synthetic ones, checked against the batch spec."""
    import itertools

    import numpy as np

    from workloads.functional import Functional

    m = fixture("functional")
    rng = np.random.default_rng(0)
    batch = {"image": rng.normal(size=(8, 28, 28)).astype(np.float32), "label": rng.integers(0, 10, 8, dtype=np.int32)}
    served = []

    def data(batch_size):
        served.append(batch_size)
        return itertools.repeat(batch)

    def losses(workload):
        p = program(workload, batch=4, devices=2)
        mesh = make_mesh(jax.devices()[:2], "replicated")
        state, step, make = init_state_on(p, mesh), jit_step(p, mesh), batch_maker(p, mesh)
        out = []
        for i in range(3):
            state, metrics = step(state, make(i))
            out.append(float(metrics["loss"]))
        return out

    base = dict(name="mnist-own-data", init=m.init, loss=m.loss, batch={"image": ((28, 28), "float32"),
                                                                       "label": ((), "int32", 10)})
    own = losses(Functional(**base, data=data))
    same = losses(Functional(**base, make_batch=lambda key, n: {k: jnp.asarray(v) for k, v in batch.items()}))
    assert served == [8] and own == pytest.approx(same, rel=1e-6)  # the same batches: the same losses
    assert own != pytest.approx(losses(Functional(**base)), rel=1e-3)  # not the synthetic ones
    wrong = Functional(**base, data=lambda n: iter([{"image": np.zeros((n, 28, 28), np.float32),
                                                     "label": np.zeros((n,), np.int64)}]))
    with pytest.raises(ModelConfigError, match="'label' is int64"):
        losses(wrong)


def _rematerialised(workload, remat: str) -> tuple[bool, list[float]]:
    """Whether the step of `workload` under `remat` recomputes anything (a checkpoint in its program), and
    the losses of three steps."""
    p = program(workload, batch=2, devices=1, remat=remat)
    mesh = make_mesh(jax.devices()[:1], "replicated")
    text = str(jax.make_jaxpr(p.step_fn(mesh))(abstract_state(p, mesh), abstract_batch(p, mesh)))
    state, step, make = init_state_on(p, mesh), jit_step(p, mesh), batch_maker(p, mesh)
    losses = []
    for i in range(3):
        state, metrics = step(state, make(i))
        losses.append(float(metrics["loss"]))
    return "checkpoint[" in text or "remat" in text, losses


def test_blocks_named_by_class_or_path_are_recomputed_without_a_change_to_the_code():
    import haiku as hk

    from workloads.equinox import Equinox
    from workloads.haiku import Haiku

    m = fixture("equinox")
    spec = {"tokens": ((m.T,), "int32", m.VOCAB)}
    plain = Equinox("eqx-plain", make=m.GPT, loss=m.loss, batch=spec)
    baseline = _rematerialised(plain, "none")
    assert plain.remat_unavailable("full") and not baseline[0]
    by_class = Equinox("eqx-named", make=m.GPT, loss=m.loss, batch=spec, remat_blocks=("Block",))
    assert by_class.remat_unavailable("full") is None
    recomputed, losses = _rematerialised(by_class, "full")
    assert recomputed and losses == pytest.approx(baseline[1], rel=1e-5)
    # by path: the same two blocks wrapped, nothing else
    model, marker = m.GPT(jax.random.key(0)), (lambda fn: fn)
    for named in (("Block",), (r"blocks/\d+",)):
        wrapped = Equinox("eqx-path", make=m.GPT, loss=m.loss, batch=spec, remat_blocks=named)._wrapped(model, marker)
        assert [type(b).__name__ for b in wrapped.blocks] == ["Checkpointed"] * m.LAYERS
        assert type(wrapped.head).__name__ == "Linear"

    class Block(hk.Module):
        def __call__(self, x):
            return x + hk.Linear(x.shape[-1])(jax.nn.gelu(hk.Linear(4 * x.shape[-1])(x)))

    def loss(batch):
        x = hk.Linear(32)(batch["x"])
        for _ in range(2):
            x = Block()(x)
        return jnp.mean((x - 1.0) ** 2)

    batch = {"x": ((16,), "float32")}
    bare, named = Haiku("hk-plain", loss=loss, batch=batch), Haiku("hk-named", loss=loss, batch=batch,
                                                                   remat_blocks=("Block",))
    assert bare.remat_unavailable("full") and named.remat_unavailable("full") is None
    assert named.param_count(named.config("default")) == bare.param_count(bare.config("default")) == 16 * 32 + 32 + 2 * (
        32 * 128 + 128 + 128 * 32 + 32)
    recomputed, losses = _rematerialised(named, "full")
    assert recomputed and losses == pytest.approx(_rematerialised(bare, "none")[1], rel=1e-5)


def test_the_plan_says_where_counts_come_from_and_shows_a_claimed_count_that_differs():
    """A model that gives no counts: its FLOPs read from the program, said in the plan. A team's own count
    (an override) is checked against the program: agreement said, a mismatch shown with its size."""
    from migration.planning.planner import counts_decisions
    from workloads.base import Workload
    from workloads.tree import Yours

    m = fixture("nnx")
    derived = {d.decision: d for d in counts_decisions(m.WORKLOAD, m.WORKLOAD.config("default"))}
    assert set(derived) == {"model_flops"} and "traced program" in derived["model_flops"].reason

    class Claimed(Workload):
        name, description, default_preset = "claimed-cnn", "", "default"
        presets = {"default": Yours("claimed-cnn")}

        def build(self, cfg, *, dtype, block_wrap, rngs):
            return m.CNN(rngs=rngs)

        def loss(self, model, batch):
            return m.loss(model, batch)

        def batch_shapes(self, cfg, n):
            return {"image": jax.ShapeDtypeStruct((n, 28, 28, 1), jnp.float32),
                    "label": jax.ShapeDtypeStruct((n,), jnp.int32)}

        def param_count(self, cfg):
            return m.HAND_PARAMS

        def flops_per_example(self, cfg):  # 6 x parameters x examples: the dense rule of thumb, wrong for a CNN
            return 6 * m.HAND_PARAMS

    w = Claimed()
    checks = {d.decision: d for d in counts_decisions(w, w.config("default"))}
    assert checks["param_count_check"].value == "agrees"
    gap = 6 * m.HAND_PARAMS / m.HAND_TRAIN_FLOPS - 1
    assert checks["flops_per_example_check"].value == f"{gap:+.1%}" and "check it" in checks["flops_per_example_check"].reason


def test_remat_policies_the_code_does_not_allow_are_named_with_the_reason():
    functional, haiku = fixture("functional").WORKLOAD, fixture("haiku").WORKLOAD
    why = functional.remat_unavailable("full")
    assert why and "block_wrap" in why
    assert functional.remat_unavailable("dots") is None  # one checkpoint around the loss saves matmul outputs
    assert haiku.remat_unavailable("full") is None  # its blocks go through block_wrap
    named = functional.remat_unavailable("save_qkv", ("query_proj", "kv_proj"))
    assert named and "query_proj" in named and "checkpoint_name" in named


def test_partition_rules_split_one_dimension_by_logical_axis():
    w = fixture("linen").WORKLOAD
    assert tuple(w.tensor_parallel_spec(("params", "x/Dense_0/kernel"), (64, 128), 2, "tensor")) == (None, "tensor")
    assert tuple(w.tensor_parallel_spec(("params", "x/attention/query/kernel"), (64, 4, 16), 2, "tensor")) == (
        None, "tensor", None)  # heads first; kv is not split twice
    assert tuple(w.tensor_parallel_spec(("params", "x/LayerNorm_0/scale"), (64,), 2, "tensor")) == ()
    with pytest.raises(ModelConfigError, match="partition_rules"):
        w.tensor_parallel_spec(("params", "x/Dense_0/kernel"), (64,), 2, "tensor")


# -- bad input: one line naming the problem ------------------------------------------------------------

def _functional(**kw):
    from workloads.functional import Functional

    base = dict(name="bad", init=lambda key: {"w": jnp.zeros((4, 2))},
                loss=lambda p, b, k: jnp.mean((b["x"] @ p["w"]) ** 2),
                batch={"x": ((4,), "float32")})
    return Functional(**{**base, **kw})


@pytest.mark.parametrize("make, field, words", [
    (lambda: _functional(loss=lambda p, b, k: b["x"] @ p["w"]), "loss", "not a floating scalar"),
    (lambda: _functional(batch={"x": ((4,), "float33")}), "batch", "dtype 'float33'"),
    (lambda: _functional(batch={"x": ((4,), "int32")}), "batch", "needs high"),
    (lambda: _functional(batch={"x": ((-1,), "float32")}), "batch", "positive integers"),
    (lambda: _functional(init=lambda key: {"w": jnp.zeros((4, 2)), "act": "relu"}), "parameters", "'act' is a str"),
    (lambda: _functional(partition_rules=[("(", ("mlp",))]), "partition_rules", "not a regular expression"),
    (lambda: _functional(name="a b"), "name", "letters, digits"),
])
def test_bad_model_input_is_one_line_naming_the_problem(make, field, words):
    with pytest.raises(ModelConfigError) as info:
        w = make()
        w.param_count(w.config("default"))
    message = str(info.value)
    assert info.value.field == field and words in message and "\n" not in message


def test_the_optional_styles_are_imported_only_by_their_adapters():
    code = ("import sys, workloads, workloads.tree, workloads.functional, workloads.linen; "
            "print(sorted(m for m in ('haiku', 'equinox') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


# -- through the command line: planned for a GPU and a TPU slice, run here ------------------------------

def cli(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "migration", *args], cwd=ROOT, capture_output=True, text=True,
                          check=False, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_a_model_in_each_style_is_planned_for_a_gpu_and_a_tpu_slice_and_runs_here(style, tmp_path):
    """Planned for an H100 and a v5p-8 by the command line; Linen and Equinox also run three steps in a worker
    (every style trains three steps in `test_migration_decisions_apply_to_a_tree_the_product_did_not_write`)."""
    m = fixture(style)
    plan_json = tmp_path / "plan.json"
    proc = cli("plan", "--workload", reference(style), "--target", "h100-sxm", "--source", "tpu-v5p-8",
               "--global-batch", "32", "--quiet", "--json", str(plan_json))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    plan = json.loads(plan_json.read_text())
    assert plan["status"] == "ok" and plan["param_count"] == m.HAND_PARAMS
    assert plan["prediction_method"] == "compiled-for-target"
    tpu = plan["comparison"]["tpu"]  # the TPU side compiled for the v5p-8 slice, without the chips
    assert "compiled TPU program" in tpu["step_source"] and tpu["peak_bytes_per_device"] > 0
    decisions = {d["decision"]: d for d in plan["decisions"]}
    if style in ("functional", "equinox", "nnx"):  # no block_wrap in their code: full remat is not offered, and why
        assert "full" in decisions["remat_not_offered"]["value"]
        assert "block_wrap" in decisions["remat_not_offered"]["reason"]
    if style not in ("linen", "equinox"):  # the other styles train three steps in-process above
        return
    run_json = tmp_path / "run.json"
    proc = cli("run", "--workload", reference(style), "--steps", "3", "--warmup", "1", "--platform", "cpu",
               "--batch", "4", "--precision", "bf16", "--quiet", "--json", str(run_json))
    assert proc.returncode == 0, proc.stderr + proc.stdout
    report = json.loads(run_json.read_text())
    assert report["status"] == "ok" and report["param_count"] == m.HAND_PARAMS
    assert len(report["losses"]) == 3 and all(math.isfinite(x) for x in report["losses"])
    assert report["model_flops_per_step"] == pytest.approx(m.HAND_TRAIN_FLOPS * 4, rel=0.05)
