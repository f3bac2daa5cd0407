"""Expert parallelism (+epE, migration/config/layouts.py): the routed experts split over an "expert" mesh axis,
the tokens sent to them and back by all-to-all (capacity dispatch) or ragged all-to-all (dropless). On 8 CPU
devices each layout follows the unsplit run's losses, holds each expert weight where the layout says, and its
compiled step carries the all-to-alls (the programs compiled for an H100 and a TPU slice the ragged ones); the
planner searches it for a mixture-of-experts model and writes it in MaxText's settings; the step model prices
the all-to-all inside a node and across nodes; bad layouts are one line naming `sharding`."""

import re

import jax
import numpy as np
import pytest

from migration.common import ConfigError
from migration.config.layouts import Layout, parse_layout
from migration.config.requests import PlanRequest, RunConfig, validate
from migration.planning.deployment import maxtext_parallelism, mesh_of
from migration.planning.search import Communication
from migration.step.train import abstract_batch, abstract_state, jit_step

CAPACITY = {"dispatch": "capacity"}
REFERENCE: dict[str, np.ndarray] = {}


def moe_run(**over) -> RunConfig:
    return RunConfig(**{**dict(workload="moe", preset="tiny", model=CAPACITY, per_device_batch=2, devices=8,
                               learning_rate=3e-3), **over})


@pytest.mark.parametrize("layout", ["fsdp+ep4", "replicated+ep2", "hybrid:4+ep2+tp2"])
def test_each_expert_layout_follows_the_unsplit_losses_and_splits_the_experts(trainer, layout):
    if "fsdp" not in REFERENCE:
        REFERENCE["fsdp"] = np.array([m["loss"] for m in trainer(moe_run(sharding="fsdp")).run(5)])
    run = trainer(moe_run(sharding=validate(moe_run(sharding=layout)).sharding))
    losses = np.array([m["loss"] for m in run.run(5)])
    np.testing.assert_allclose(losses, REFERENCE["fsdp"], rtol=1e-3)
    assert REFERENCE["fsdp"][-1] < REFERENCE["fsdp"][0] - 0.05, "the task is learnable: the loss falls in 5 steps"
    lay = parse_layout(layout)
    assert dict(run.mesh.shape) == lay.axes(8) and run.mesh.shape["expert"] == lay.expert
    up = run.state.params["blocks"]["experts"]["up"].value  # (MoE layers, experts, d_model, 2 x expert_d_ff)
    assert tuple(up.sharding.spec)[1] == "expert"
    assert up.size // up.addressable_shards[0].data.size == lay.expert_shards(8)
    # A weight that is no routed expert's (nor split by the tensor axis): sharded over the expert axis too
    # where the layout shards the state, whole where it replicates it.
    embed = run.state.params["embed"]["embedding"].value
    shared_by = lay.axes(8)["fsdp"] * lay.expert if lay.shards_state() else 1
    assert embed.size // embed.addressable_shards[0].data.size == shared_by
    # The dispatch and the combine are all-to-alls in the compiled step (forward and backward).
    program, mesh = run.program, run.mesh
    text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile().as_text()
    assert len(re.findall(r" all-to-all(-start)?\(", text)) >= 4


def test_without_an_expert_axis_the_step_has_no_all_to_all(trainer):
    run = trainer(moe_run(sharding="fsdp"))
    program, mesh = run.program, run.mesh
    text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).as_text()
    assert "expert" not in str(mesh.axis_names) and "all_to_all" not in text


@pytest.mark.parametrize("layout", ["fsdp", "hybrid:4+tp2"])
def test_dropless_experts_on_a_split_batch_compute_each_devices_own_rows(trainer, layout):
    """The grouped products (ragged_dot: a kernel XLA's partitioner cannot split) run in shard_map over the
    step's mesh: on 8 devices each computes its own slots, so the compiled step's expert products are an
    eighth of the same step's on one device, not the whole batch's on every device; the losses follow the
    single device's."""
    from migration.planning.hlo_cost import read_program

    def expert_flops(run) -> float:
        program, mesh = run.program, run.mesh
        text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile(
        ).as_text()
        return sum(k.flops for k in read_program(text) if k.kind in ("matmul", "convolution"))

    one = trainer(moe_run(model={}, devices=1, per_device_batch=16, sharding="replicated"))
    split = trainer(moe_run(model={}, sharding=layout))
    np.testing.assert_allclose([m["loss"] for m in split.run(3)], [m["loss"] for m in one.run(3)], rtol=1e-3)
    ratio = expert_flops(split) / expert_flops(one)
    assert 0.1 < ratio < 0.2, ratio  # 1/8 of the products (plus the tensor-split attention's share)


@pytest.mark.parametrize("layout", ["fsdp+ep4", "hybrid:4+ep2+tp2"])
def test_dropless_expert_layouts_follow_the_unsplit_losses_and_hold_their_share_of_the_experts(trainer, layout):
    """Each device's slots sorted by expert, sent to the devices holding their experts, computed there by grouped
    products over that device's share and sent back (workloads/expert_parallel.py): the losses are the
    unsplit dropless run's (on the CPU the ragged all-to-all runs in its gathered form)."""
    if "dropless" not in REFERENCE:
        REFERENCE["dropless"] = np.array([m["loss"] for m in trainer(moe_run(model={}, sharding="fsdp")).run(4)])
    run = trainer(moe_run(model={}, sharding=layout))
    np.testing.assert_allclose([m["loss"] for m in run.run(4)], REFERENCE["dropless"], rtol=1e-3)
    up = run.state.params["blocks"]["experts"]["up"].value
    assert tuple(up.sharding.spec)[1] == "expert"
    assert up.size // up.addressable_shards[0].data.size == parse_layout(layout).expert_shards(8)


def _gpu_step_text(sharding: str, devices: int = 8) -> str:
    from migration.hardware import GPU_SPECS
    from migration.planning.memory import deviceless_devices
    from migration.step.train import TrainProgram, make_mesh

    program = TrainProgram.from_config(validate(moe_run(model={}, devices=devices, sharding=sharding)))
    mesh = make_mesh(deviceless_devices(GPU_SPECS["h100-sxm"], 1, devices), sharding)
    return jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile(
    ).as_text()


def test_a_dropless_expert_split_compiles_for_an_h100_with_ragged_all_to_alls_read_at_the_rows_sent():
    """Dispatch and combine, forward and backward: four ragged all-to-alls, each read at the rows a device sends
    (its slots, not the worst-case receive buffer it is written into); none without the expert axis."""
    from migration.planning.hlo_cost import read_program

    text = _gpu_step_text("fsdp+ep4", devices=4)
    ragged = re.findall(r"ragged-all-to-all-start\((%[\w.-]+), (%[\w.-]+)", text)
    assert len(ragged) >= 4
    kernels = [k for k in read_program(text) if k.kind == "ragged-all-to-all"]
    slots = 2 * 64 * 2  # a device's 2 sequences x 64 tokens x top 2
    d_model = 64
    per_call = slots * d_model * 4  # float32 rows
    assert sum(k.count for k in kernels) >= 4
    assert all(k.bytes / k.count == per_call and k.group == 4 for k in kernels), kernels
    assert "ragged-all-to-all" not in _gpu_step_text("fsdp", devices=4)


@pytest.mark.slow
def test_on_a_tpu_slice_the_grouped_products_over_the_receive_buffer_count_the_slots_not_the_buffer():
    """libtpu's grouped products over the worst-case receive buffer (4 x a device's tokens x min(top-k, local
    experts) rows) count the rows the groups fill at an even spread: row by row, the split step's expert products
    are the unsplit step's. In the whole row tiles libtpu states (128 rows here), a device's 256 slots in 4
    experts take 2 tiles and 3 more for the boundaries between experts (2.5 x the rows) unsplit, and 2 tiles
    split (one expert a device: no boundary)."""
    from migration.hardware import TPU_SPECS
    from migration.planning.hlo_cost import read_program
    from migration.planning.source import tpu_topology
    from migration.step.train import TrainProgram, make_mesh

    devices = list(tpu_topology(TPU_SPECS["tpu-v5p-8"]).devices)  # 4 chips

    def products(sharding: str) -> tuple[float, str]:
        program = TrainProgram.from_config(validate(moe_run(model={}, devices=len(devices), sharding=sharding)))
        mesh = make_mesh(devices, sharding)
        text = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile(
        ).as_text()
        return sum(k.flops for k in read_program(text) if k.kind == "matmul"), text

    def row_by_row(text: str) -> float:
        return sum(k.flops for k in read_program(text.replace('ragged_dot_tiling="', 'untiled="')) if k.kind == "matmul")

    whole, whole_text = products("fsdp")
    split, text = products("fsdp+ep4")
    assert len(re.findall(r" ragged-all-to-all\(", text)) >= 4
    assert row_by_row(text) == pytest.approx(row_by_row(whole_text), rel=0.01)
    assert set(re.findall(r'ragged_dot_tiling="(\d+),', whole_text + text)) == {"128"}
    assert whole == pytest.approx(row_by_row(whole_text) * 5 / 2, rel=0.01)
    assert split == pytest.approx(row_by_row(text), rel=0.01)


@pytest.mark.parametrize("text,layout", [("fsdp+ep8", Layout("fsdp", 0, 1, 8)),
                                         ("hybrid:16+ep4+tp2", Layout("hybrid", 16, 2, 4)),
                                         ("replicated+ep2", Layout("replicated", 0, 1, 2))])
def test_expert_layout_names_round_trip(text, layout):
    assert parse_layout(text) == layout and layout.name == text


@pytest.mark.parametrize("over,sharding,message", [
    ({}, "fsdp+ep3", r"\+ep3: the expert split must divide the 4 routed experts; e.g. \+ep2"),
    ({"workload": "llama", "model": {}}, "fsdp+ep2", r"\+ep2: llama has no routed experts"),
    ({"devices": 2}, "fsdp+ep4", r"the expert split times the tensor split \(4\) must divide the GPUs \(2\)"),
    ({}, "hybrid:2+ep4", r"hybrid:2: the FSDP group must divide the GPUs \(8\) and be a multiple of the expert"),
])
def test_bad_expert_layouts_are_one_line_naming_the_field(over, sharding, message):
    with pytest.raises(ConfigError, match=message) as info:
        validate(moe_run(**over, sharding=sharding))
    assert info.value.field == "sharding" and "\n" not in str(info.value)


def test_a_plans_expert_split_wider_than_a_node_spans_whole_nodes():
    with pytest.raises(ConfigError, match="must span whole nodes"):
        PlanRequest.from_dict(dict(workload="moe", preset="deepseek-v3", model={**CAPACITY, "n_experts": 96},
                                   gpus=48, sharding="fsdp+ep12"))
    req = PlanRequest.from_dict(dict(workload="moe", preset="deepseek-v3", model=CAPACITY, gpus=64,
                                     sharding="fsdp+ep16"))
    assert req.sharding == "fsdp+ep16"


def test_maxtext_settings_multiply_to_the_gpus_and_name_the_expert_split():
    for name, gpus in (("fsdp+ep8", 32), ("fsdp+ep16", 32), ("hybrid:16+ep4+tp2", 64), ("replicated+ep2", 16)):
        settings = maxtext_parallelism(parse_layout(name), gpus, 8)
        assert np.prod(list(settings.values())) == gpus, (name, settings)
        assert settings["ici_expert_parallelism"] * settings["dcn_expert_parallelism"] == parse_layout(name).expert
    assert maxtext_parallelism(parse_layout("fsdp+ep16"), 32, 8)["dcn_expert_parallelism"] == 2
    assert "ici_expert_parallelism" not in maxtext_parallelism(parse_layout("fsdp"), 32, 8)
    mesh = mesh_of("fsdp+ep8", 32, 8, 4)
    assert mesh["axes"] == {"data": 1, "fsdp": 4, "expert": 8, "tensor": 1}
    assert "'expert'" in mesh["batch_spec"] and "all-to-all" in mesh["state_spec"]


def test_the_all_to_all_is_priced_inside_a_node_and_across_nodes():
    base = dict(param_count=10**9, devices=16, compute_bytes=2, link_bytes_per_s=50e9, per_node=8,
                intra_bytes_per_s=450e9, network_bytes_per_s=50e9, expert_params=8 * 10**8,
                dispatch_bytes_per_example=1e8)
    comm = Communication(**base)
    inside = comm.all_to_all_seconds("fsdp+ep8", "full", batch=4)
    across = comm.all_to_all_seconds("fsdp+ep16", "full", batch=4)
    # 3 transfers (forward, backward, recompute) x (E-1)/E x 4 examples x 1e8 bytes, over NVLink inside a node
    assert inside == pytest.approx(3 * 7 / 8 * 4e8 / 450e9)
    # across two nodes, half of each GPU's bytes leave the node over its network share
    assert across == pytest.approx(3 * 15 / 16 * 4e8 * 0.5 / 50e9)
    assert comm.all_to_all_seconds("fsdp+ep8", "full", batch=8) == pytest.approx(2 * inside)
    assert comm.all_to_all_seconds("fsdp", "full", batch=4) == 0.0
    assert comm.all_to_all_seconds("fsdp+ep8", "none", batch=4) == pytest.approx(inside * 2 / 3)
    # FSDP gathers a GPU's 1/E of the experts over its FSDP group; the other weights over FSDP x expert
    assert comm.bytes_per_micro_batch("fsdp+ep8", "full", 4) < comm.bytes_per_micro_batch("fsdp", "full", 4) \
        + comm.all_to_all_bytes("fsdp+ep8", "full", 4)
    plain = Communication(**{**base, "expert_params": 0, "dispatch_bytes_per_example": 0.0})
    assert plain.seconds("fsdp", 1) == pytest.approx(comm.seconds("fsdp", 1))


def test_the_state_share_counts_the_experts_split_under_replicated_state():
    lay = parse_layout("replicated+ep4")
    assert lay.state_shards(8) == 1 and lay.expert_shards(8) == 4
    assert lay.state_fraction(8, expert_share=0.75) == pytest.approx(0.25 + 0.75 / 4)
    assert parse_layout("fsdp+ep4").state_fraction(8, 0.75) == pytest.approx(1 / 8)


@pytest.mark.parametrize("model", [CAPACITY, {}], ids=["capacity", "dropless"])
def test_the_planner_searches_expert_parallelism_for_an_moe(model):
    from migration.planning.planner import plan_migration

    req = PlanRequest.from_dict(dict(workload="moe", preset="tiny", model=model, target="h100-sxm", gpus=8,
                                     global_batch=64, max_per_device_batch=8, compile_for_tpu=False))
    plan = plan_migration(req, lambda *a, **k: None)
    assert "fsdp+ep4" in plan.max_batch_by_sharding, plan.max_batch_by_sharding
    timed = {r["sharding"]: r for r in plan.ranked if r.get("status", "").startswith(("chosen", "compiled"))}
    assert "fsdp+ep4" in timed, [(r["sharding"], r.get("status")) for r in plan.ranked]


def test_a_dropless_expert_parallel_plan_states_the_spread_its_exchange_is_timed_at():
    """The step time of a plan whose layout sends the slots by ragged all-to-all says what it assumed of their
    spread over the expert group (even: factor 1.00) and what measures it; a program without the exchange says
    nothing of it."""
    from migration.planning import steptime
    from migration.planning.hlo_cost import Kernel
    from migration.planning.planner import plan_migration

    req = PlanRequest.from_dict(dict(workload="moe", preset="tiny", target="h100-sxm", gpus=8, sharding="fsdp+ep4",
                                     global_batch=32, max_per_device_batch=4, compile_for_tpu=False))
    plan = plan_migration(req, lambda *a, **k: None)
    assert plan.ok and plan.sharding == "fsdp+ep4", plan.message
    split = {d.decision: d.reason for d in plan.decisions}["step_time"]
    assert "from the compiled program" in split and "ragged all-to-alls" in split
    assert "imbalance factor 1.00" in split and "router_device_load" in split
    others = [Kernel("a", "all-to-all", 0.0, 1e6, None, 1.0, group=4), Kernel("g", "all-gather", 0.0, 1e6, None, 1.0)]
    assert steptime.exchange_text(others) == ""
