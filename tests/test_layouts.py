"""The layouts real GPU runs use (migration/config/layouts.py), run on 8 CPU devices: hybrid sharding
(FSDP inside a group, data parallelism across groups, as MaxText's ici_fsdp x dcn_data and its
dcn_fsdp) and tensor parallelism inside a node follow the replicated run's losses in bf16 within 1%
per step, and their state is laid out as the layout says."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from migration.config.layouts import Layout, parse_layout
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate

LAYOUTS = ["fsdp", "hybrid:4", "hybrid:2", "replicated+tp2", "hybrid:4+tp2", "fsdp+tp4"]
REFERENCE: dict[str, np.ndarray] = {}


@pytest.mark.parametrize("layout", [pytest.param(name, marks=pytest.mark.slow) if name not in ("hybrid:4", "hybrid:4+tp2")
                                    else name for name in LAYOUTS])
def test_each_layout_follows_the_replicated_losses_in_bf16(trainer, layout):
    base = RunConfig(workload="llama", preset="tiny", per_device_batch=2, devices=8, precision="bf16",
                     learning_rate=3e-3, accumulation_steps=2)
    if "replicated" not in REFERENCE:  # the replicated run, once for every layout
        REFERENCE["replicated"] = np.array([m["loss"] for m in trainer(base).run(5)])
    reference = REFERENCE["replicated"]
    run = trainer(RunConfig(**{**base.to_dict(), "sharding": layout}))
    losses = np.array([m["loss"] for m in run.run(5)])
    np.testing.assert_allclose(losses, reference, rtol=0.01)
    assert reference[-1] < reference[0] - 0.05, "the task is learnable: the loss falls in 5 steps"
    lay = parse_layout(layout)
    axes = dict(run.mesh.shape)
    if lay.kind == "hybrid" or lay.tensor > 1:
        assert axes == lay.axes(8)
    # The largest weight is split over exactly the GPUs the layout shares it among.
    big = max(jax.tree.leaves(run.state.params), key=lambda x: x.size)
    assert big.size // big.addressable_shards[0].data.size == lay.state_shards(8)


def test_hybrid_keeps_a_whole_state_copy_in_every_group(trainer):
    run = trainer(RunConfig(workload="llama", preset="tiny", per_device_batch=1, devices=8, sharding="hybrid:4"))
    kernel = run.state.params["blocks"]["mlp"]["up"]["kernel"].value
    spec = kernel.sharding.spec
    assert "fsdp" in tuple(spec) and "data" not in tuple(spec)
    # Devices 0 and 4 (one per group) hold the same piece; devices 0..3 hold the four pieces of one copy.
    shards = {s.device.id: str(s.index) for s in kernel.addressable_shards}
    assert shards[0] == shards[4] and len({shards[d] for d in range(4)}) == 4


def test_tensor_split_is_megatrons(trainer):
    run = trainer(RunConfig(workload="llama", preset="tiny", per_device_batch=1, devices=8, sharding="replicated+tp2"))
    blocks = run.state.params["blocks"]
    assert tuple(blocks["attn"]["q"]["kernel"].value.sharding.spec) == (None, None, "tensor")  # column: outputs
    assert tuple(blocks["mlp"]["down"]["kernel"].value.sharding.spec) == (None, "tensor", None)  # row: inputs


@pytest.mark.parametrize("text,layout", [("fsdp", Layout("fsdp")), ("hybrid:16", Layout("hybrid", 16)),
                                         ("replicated+tp8", Layout("replicated", 0, 8)),
                                         ("hybrid:64+tp4", Layout("hybrid", 64, 4))])
def test_layout_names_round_trip(text, layout):
    assert parse_layout(text) == layout and layout.name == text


def test_axes_multiply_to_the_gpus():
    for devices, per_node in ((8, 8), (64, 8), (4096, 8), (32, 4)):
        for lay in (Layout("replicated"), Layout("fsdp"), Layout("hybrid", per_node), Layout("hybrid", 2 * per_node, 2),
                    Layout("fsdp", 0, per_node)):
            if lay.group > devices:
                continue
            a = lay.check(devices, per_node).axes(devices)
            assert a["data"] * a["fsdp"] * a["tensor"] == devices


@pytest.mark.parametrize("sharding,devices,message", [
    ("zero2", 8, "sharding: must be replicated, fsdp or hybrid:G"),
    ("hybrid:3", 8, "hybrid:3: the FSDP group must divide the GPUs"),
    ("fsdp+tp3", 8, "tensor parallelism needs a power of two"),
    ("hybrid:2+tp4", 8, "multiple of the tensor split"),
    ("fsdp+tp16", 8, "tensor parallelism needs a power of two up to the GPUs of a node"),
])
def test_bad_layouts_are_refused_in_one_line(sharding, devices, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        validate(RunConfig(workload="llama", devices=devices, sharding=sharding))


def test_plan_layout_override_is_checked_against_the_nodes():
    with pytest.raises(ConfigError, match="hybrid:12: a group larger than a node must be whole nodes of 8"):
        PlanRequest.from_dict(dict(workload="llama", gpus=48, sharding="hybrid:12"))
    with pytest.raises(ConfigError, match="tensor parallelism needs a power of two up to the GPUs of a node"):
        PlanRequest.from_dict(dict(workload="llama", gpus=32, sharding="fsdp+tp16"))
    with pytest.raises(ConfigError, match="mlp names no weights to split"):
        PlanRequest.from_dict(dict(workload="mlp", gpus=8, sharding="fsdp+tp2"))
    assert PlanRequest.from_dict(dict(workload="llama", gpus=32, sharding="hybrid:16+tp2")).sharding == "hybrid:16+tp2"


def test_fsdp_spec_leaves_the_tensor_split_alone():
    from migration.step.train import fsdp_spec

    assert fsdp_spec((32, 4096, 14336), 4, "fsdp", P(None, None, "tensor")) == P(None, "fsdp", "tensor")
    assert fsdp_spec((30, 8), 4, "fsdp", P(None, "tensor")) == P(None, "tensor")


@pytest.mark.parametrize("sharding,kv_heads", [("fsdp+tp2", 2), ("hybrid:4+tp2", 4), ("fsdp+tp4", 2)])
def test_a_tensor_split_compiles_with_cudnns_fused_attention_for_an_h100(sharding, kv_heads):
    """cuDNN's fused attention is a custom call whose partitioner demands the queries, keys and values held
    alike: under a tensor split the step holds them so (the heads over the tensor axis, or whole where the key
    heads do not divide over it), and the program compiled for 8 H100s without the devices keeps the fused
    kernel. Without it the compile raised `Query, key and value should have same sharding`."""
    from migration.hardware import GPU_SPECS
    from migration.planning.memory import deviceless_devices
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    model = {"attention": "cudnn", "n_heads": 4, "n_kv_heads": kv_heads, "d_model": 256, "head_size": 64}
    program = TrainProgram.from_config(RunConfig(workload="llama", preset="tiny", model=model, per_device_batch=2,
                                                 devices=8, precision="bf16", sharding=sharding))
    mesh = make_mesh(deviceless_devices(GPU_SPECS["h100-sxm"], 1, 8), sharding)
    text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile(
    ).as_text()
    assert "__cudnn$fmha" in text
