"""The plan is picked by the estimate it reports: the compiled program's step time of each candidate the
planner compiles (migration/planning/planner.py `verify`). Real deviceless compiles for catalog GPUs,
on models and targets of several shapes: one node, several nodes (where hybrid layouts are searched),
an override of the layout."""

import dataclasses
import json

import pytest

from migration.config.requests import PlanRequest
from migration.hardware import Links
from migration.planning import ranking
from migration.planning.hlo_collectives import first_group
from migration.planning.hlo_cost import Kernel, pack, unpack
from migration.planning.planner import plan_migration
from migration.planning.steptime import collective_seconds

quiet = lambda *a, **k: None  # noqa: E731
MID = {"n_layers": 4, "d_model": 1024, "n_heads": 8, "n_kv_heads": 8, "d_ff": 4096, "vocab_size": 8192, "seq_len": 1024}


def check_compiled_choice(p) -> None:
    """None of the candidates the plan compiled and timed is faster than the one it chose, and the chosen
    one's compiled figure is the plan's predicted step."""
    assert p.status == "ok"
    assert p.ranking["method"].startswith("compiled step time")
    timed = [r for r in p.ranked if r.get("compiled_step_s") is not None and r["status"] != "compiled: does not fit"]
    assert timed, "the plan compiled and timed at least its choice"
    chosen = [r for r in timed if r["status"].startswith("chosen")]
    assert len(chosen) == 1
    c = chosen[0]
    assert (c["sharding"], c["remat"], c["per_device_batch"], c["accumulation_steps"]) == \
        (p.sharding, p.remat, p.per_device_batch, p.accumulation_steps)
    assert p.predicted_step_s == pytest.approx(c["compiled_step_s"])
    exact = [r for r in timed if r["exact"]]
    assert all(r["compiled_step_s"] >= c["compiled_step_s"] for r in exact)
    # Each compiled row reports how far the analytic estimate was from its compiled figure.
    for r in timed:
        assert r["disagreement"] == pytest.approx(r["analytic_s"] / r["compiled_step_s"] - 1, abs=1e-3)
    assert p.ranking["timed"] >= 1 and p.ranking["top_k"] == ranking.COMPILED_TOP_K


@pytest.mark.parametrize("workload,model,target,gpus,batch", [
    ("llama", MID, "h100-sxm", 8, 64),
    pytest.param("transformer", {"n_layers": 6, "d_model": 768, "n_heads": 12, "seq_len": 1024}, "a100-80gb", 16, 128,
                 marks=pytest.mark.slow),
    pytest.param("llama", {**MID, "n_kv_heads": 2}, "h200", 32, 256, marks=pytest.mark.slow),
])
def test_no_compiled_candidate_is_faster_than_the_chosen_one(workload, model, target, gpus, batch):
    req = PlanRequest(workload=workload, preset="8b" if workload == "llama" else "gpt2-small", model=model,
                      target=target, gpus=gpus, global_batch=batch, compile_for_tpu=False, source="tpu-v5p-64")
    p = plan_migration(req, quiet)
    check_compiled_choice(p)
    if gpus > 8:
        assert any(s.startswith("hybrid:") for s in p.ranking["layouts"]), "hybrid layouts are considered on nodes"
    assert p.mesh["layout"] == p.sharding and p.mesh["axes"]


@pytest.mark.slow
def test_a_hybrid_layout_forced_is_planned_and_timed_over_its_mesh():
    req = PlanRequest(workload="llama", preset="8b", model=MID, target="h100-sxm", gpus=16, global_batch=64,
                      compile_for_tpu=False, sharding="hybrid:8")
    p = plan_migration(req, quiet)
    check_compiled_choice(p)
    assert p.sharding == "hybrid:8" and p.mesh["axes"] == {"data": 2, "fsdp": 8, "tensor": 1}
    assert p.mesh["maxtext"]["ici_fsdp_parallelism"] == 8 and p.mesh["maxtext"]["dcn_data_parallelism"] == 2
    assert "override: hybrid:8" in {d.decision: d.reason for d in p.decisions}["sharding"]
    # The state is shared among a node's 8 GPUs, not all 16.
    assert p.state["shared_by"] == 8
    # The plan file keeps the layout, and the deployment snippet says it.
    from migration.planning.deployment import deployment_snippet
    from migration.planning.planfile import read_plan

    again = read_plan(json.dumps(p.to_dict()))
    assert again.sharding == "hybrid:8" and again.mesh == p.mesh and again.ranking == p.ranking
    snippet = deployment_snippet(p)
    assert "# mesh = jax.make_mesh((2, 8, 1), ('data', 'fsdp', 'tensor'))" in snippet
    assert "dcn_data_parallelism=2" in snippet and "ici_fsdp_parallelism=8" in snippet


def test_replica_groups_read_in_every_form():
    assert first_group("replica_groups=mesh['data'=4,'fsdp'=8,'tensor'=1] {'fsdp'}") == list(range(8))
    assert first_group("replica_groups=mesh['data'=4,'fsdp'=8,'tensor'=1] {'data'}") == [0, 8, 16, 24]
    assert first_group("replica_groups=mesh['data'=2,'fsdp'=2,'tensor'=2] {'fsdp','tensor'}") == [0, 1, 2, 3]
    assert first_group("replica_groups=[4,8]<=[32]") == list(range(8))
    assert first_group("replica_groups=[8,4]<=[4,8]T(1,0)") == [0, 8, 16, 24]
    assert first_group("replica_groups={{0,8},{1,9}}") == [0, 8]
    assert first_group("source_target_pairs={{0,1},{1,2}}") == [0, 1]
    assert first_group("channel_id=3") == []


def test_a_collective_inside_a_node_runs_over_nvlink_and_one_across_nodes_over_the_network():
    links = Links.of("h100-sxm", domains=4)
    assert links.intra == 450e9 and links.network == 50e9
    inside = Kernel("ag", "all-gather", 0.0, 8e9, None, 1, group=8, asynchronous=True, nodes=1)
    across = Kernel("ar", "all-reduce", 0.0, 8e9, None, 1, group=4, asynchronous=True, nodes=4)
    flat = Kernel("ag", "all-gather", 0.0, 8e9, None, 1, group=32, asynchronous=True, nodes=4)
    assert links.for_group(8, 1) == 450e9
    assert links.for_group(4, 4) == 50e9  # one GPU per node: its own NIC
    assert links.for_group(32, 4) == 400e9  # eight rings, one per NIC
    assert collective_seconds(across, links) > collective_seconds(flat, links) > collective_seconds(inside, links)
    assert Links.of("h100-sxm", domains=4, network_bytes_per_s=100e9).for_group(4, 4) == 100e9
    assert Links.of("h100-sxm", domains=1).for_group(8, 1) == 450e9
    # Packed and unpacked with the nodes a group spans.
    assert unpack(pack([across]))[0].nodes == 4


def test_up_to_4096_gpus_and_the_network_are_fields_with_one_line_refusals():
    from migration.common import ConfigError

    req = PlanRequest.from_dict(dict(workload="llama", source="tpu-v5p-1024", target="h100-sxm", gpus=4096,
                                     global_batch=4096, network_gbps=800))
    assert req.nodes == 512 and req.network_bytes_per_s == 100e9
    with pytest.raises(ConfigError, match="gpus: must be an integer from 1 to 4096"):
        PlanRequest.from_dict(dict(gpus=8192))
    with pytest.raises(ConfigError, match="network_gbps: must be a number from 0 to 12800"):
        PlanRequest.from_dict(dict(gpus=16, network_gbps=-1))


@pytest.mark.slow
def test_xla_attention_in_the_users_code_is_planned_with_and_cudnns_saving_recommended():
    from migration.config import forms
    from migration.common import ConfigError

    req = forms.plan_request(workload="transformer", preset="gpt2-small", n_layers=4, seq_len=2048, target="h100-sxm",
                             gpus=8, global_batch=32, attention="xla")
    assert req.model["attention"] == "xla"
    p = plan_migration(dataclasses.replace(req, compile_for_tpu=False), quiet)
    check_compiled_choice(p)
    decisions = {d.decision: d for d in p.decisions}
    assert decisions["attention"].value == "xla" and "override" in decisions["attention"].reason
    saving = decisions["attention_saving"]
    assert 0 < saving.value < 1 and "recommendation: cuDNN's fused attention" in saving.reason
    with pytest.raises(ConfigError, match="attention: must be one of auto, cudnn, xla"):
        forms.plan_request(attention="flash")
