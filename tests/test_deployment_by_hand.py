"""The environment a plan hands over, against values worked out by hand for each branch: precision (the
compute dtype FSDP gathers in), state sharding, one GPU or several, one node or several, and compute
capability 8.0, 9.0 and 10.0 (each docstring shows the arithmetic)."""

import dataclasses
from pathlib import Path

import pytest

from migration.planning.deployment import combine_threshold, deployment_snippet, plan_environment, xla_flags_for
from migration.planning.deployment import mesh_of
from migration.results import Plan

MIB = 2**20


@pytest.mark.parametrize("nbytes, expected", [(1, MIB), (MIB, MIB), (MIB + 1, 2 * MIB), (0, MIB), (10.5 * MIB, 11 * MIB)])
def test_a_combine_threshold_is_rounded_up_to_a_whole_mib(nbytes, expected):
    assert combine_threshold(nbytes) == expected


@pytest.mark.parametrize("precision, element", [("bf16", 2), ("fp16", 2), ("fp8", 2), ("fp32", 4)])
def test_fsdp_combines_one_blocks_gather_in_the_compute_dtype(precision, element):
    """A block of 50,000,000 parameters gathered in bf16: 100,000,000 B = 95.37 MiB -> 96 MiB
    (100,663,296); in fp32: 200,000,000 B = 190.73 MiB -> 191 MiB (200,278,016)."""
    flags = dict(xla_flags_for("fsdp", precision, 50_000_000))
    gather = {2: 96 * MIB, 4: 191 * MIB}[element]
    assert f"--xla_gpu_all_gather_combine_threshold_bytes={gather}" in flags
    assert f"--xla_gpu_reduce_scatter_combine_threshold_bytes={gather}" in flags
    assert {"--xla_gpu_enable_pipelined_all_gather=true", "--xla_gpu_enable_pipelined_reduce_scatter=true",
            "--xla_gpu_enable_latency_hiding_scheduler=true"} <= set(flags)
    assert not any("all_reduce" in f for f in flags)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_replicated_state_combines_one_blocks_float32_gradients_whatever_the_precision(precision):
    """Gradients are all-reduced in float32: 50,000,000 x 4 B = 190.73 MiB -> 191 MiB."""
    flags = [f for f, _ in xla_flags_for("replicated", precision, 50_000_000)]
    assert flags == ["--xla_gpu_enable_latency_hiding_scheduler=true",
                     f"--xla_gpu_all_reduce_combine_threshold_bytes={191 * MIB}"]


def environment(**kw):
    base = dict(memory_fraction=0.8, gpus=8, nodes=1, gpus_per_node=8, sharding="fsdp", precision="bf16",
                compute_capability=(9, 0), block_params=1_000_000)
    return plan_environment(**{**base, **kw})


@pytest.mark.parametrize("cc, connections", [((8, 0), None), ((9, 0), "1"), ((10, 0), None), (None, None)])
def test_only_hopper_gets_one_hardware_queue_per_device(cc, connections):
    env = environment(compute_capability=cc)
    assert env.get("CUDA_DEVICE_MAX_CONNECTIONS", {}).get("value") == connections
    assert "--xla_gpu_all_gather_combine_threshold_bytes=2097152" in env["XLA_FLAGS"]["value"]  # 2 MB -> 2 MiB


def test_one_gpu_sets_no_xla_flags_and_pins_its_device():
    env = environment(gpus=1, memory_fraction=0.455)
    assert "XLA_FLAGS" not in env and "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    assert env["CUDA_VISIBLE_DEVICES"]["value"] == "0"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"]["value"] == "0.46" and env["XLA_PYTHON_CLIENT_PREALLOCATE"]["value"] == "false"


def test_several_nodes_see_their_own_gpus_on_each_node():
    """16 GPUs on 2 nodes of 8: each node sees 0-7; 4 GPUs on one node: 0-3."""
    assert environment(gpus=16, nodes=2)["CUDA_VISIBLE_DEVICES"]["value"] == "0,1,2,3,4,5,6,7"
    assert environment(gpus=4)["CUDA_VISIBLE_DEVICES"]["value"] == "0,1,2,3"
    assert environment(gpus=4)["CUDA_VISIBLE_DEVICES"]["why"] == "pin the job to its GPUs (set before JAX is imported)"
    assert environment(gpus=16, nodes=2)["CUDA_VISIBLE_DEVICES"]["why"] == (
        "on every node, that node's GPUs (set before JAX is imported)")


def test_an_fp32_plans_gathers_are_combined_at_four_bytes_a_parameter():
    """FSDP gathers in the compute dtype: 1,000,000 parameters a block x 4 B = 3.81 MiB -> 4 MiB in fp32,
    x 2 B = 1.91 MiB -> 2 MiB in bf16."""
    for precision, mib in (("fp32", 4), ("bf16", 2)):
        flags = environment(precision=precision)["XLA_FLAGS"]["value"]
        assert f"--xla_gpu_all_gather_combine_threshold_bytes={mib * MIB}" in flags, precision


# The scripts a user copies, whole. Each expected file was read line by line against the plan it is for:
# three_h100_nodes.sh, 24 H100s on 3 nodes of 8, replicated state: the tiny transformer's blocks hold 60,288
# parameters, whose float32 gradients (241,152 B) round up to a 1 MiB all-reduce threshold; Hopper gets one
# hardware queue per device; srun starts 24 tasks, 8 per node; the indexed Job has 3 completions of 8 GPUs;
# by hand, NODE_RANK runs 0..2. two_gb200_racks_fsdp.sh, 144 GB200s on 36 nodes of 4 in NVL72 racks, FSDP:
# the tiny Llama's 45,216-parameter blocks gathered in bf16 (90,432 B) round up to 1 MiB for the all-gather
# and the reduce-scatter; no CUDA_DEVICE_MAX_CONNECTIONS on Blackwell; 72 / 4 = 18 nodes per NVLink domain,
# so --segment=18. two_h100_nodes_hybrid_fp32.sh, 16 H100s on 2 nodes, hybrid:8 (FSDP in a node x data over
# 2), fp32, 4 layers, 45.5% of each GPU: the mesh (2, 8, 1), MaxText's ici_fsdp 8 x dcn_data 2; 220,544 / 4 =
# 55,136 parameters per block (the per-block figure is the parameters over the blocks, an upper one) gathered
# in fp32 (220,544 B) round up to 1 MiB; "0.46" and "46%"; srun 16 tasks; 2 completions; NODE_RANK 0..1.
# A change to any line fails here and is reviewed as a change to what users run.
EXPECTED = Path(__file__).resolve().parent / "fixtures" / "deployment"


def _stub(**fields):
    required = {f.name: None for f in dataclasses.fields(Plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    base = dict(status="ok", workload="transformer", preset="tiny", gpus=24, gpus_per_node=8, nodes=3,
                target="h100-sxm", target_name="NVIDIA H100 SXM", per_device_batch=8, accumulation_steps=1,
                global_batch=192, precision="bf16", remat="none", memory_fraction=0.8, environment={})
    return Plan(**{**required, **base, **fields})


@pytest.mark.parametrize("expected, fields", [
    ("three_h100_nodes.sh", {}),
    ("two_gb200_racks_fsdp.sh", dict(workload="llama", gpus=144, gpus_per_node=4, nodes=36, domain_gpus=72,
                                      target="gb200", target_name="GB200 NVL72", global_batch=1152, sharding="fsdp")),
    ("two_h100_nodes_hybrid_fp32.sh", dict(gpus=16, nodes=2, precision="fp32", sharding="hybrid:8",
                                           mesh=mesh_of("hybrid:8", 16, 8, 2), model={"n_layers": 4},
                                           memory_fraction=0.455, global_batch=128)),
])
def test_the_deployment_script_is_the_one_reviewed_by_hand(expected, fields):
    assert deployment_snippet(_stub(**fields)) == (EXPECTED / expected).read_text()
