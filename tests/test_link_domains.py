"""NVLink domains, not nodes of 8: a target's domain (8 on an HGX board, 72 in an NVL72 rack, a node of PCIe
cards) sets where collectives run at the link's speed, what the layouts keep together and what a launch
script asks of the scheduler. The plans here are real deviceless compiles of the tiny Llama."""

import dataclasses

import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest, validate_plan_request
from migration.hardware import Links, link_bandwidth
from migration.planning.deployment import deployment_snippet, sbatch_script
from migration.planning.hlo_cost import Kernel
from migration.planning.planner import plan_migration
from migration.planning.steptime import cross_domain_seconds
from migration.results import Plan


@pytest.mark.parametrize("target,gpus,per_node,node,nodes,domain,domains", [
    ("h100-sxm", 16, 8, 8, 2, 8, 2),  # HGX: a node is the domain
    ("b200", 64, 8, 8, 8, 8, 8),
    ("gb200", 72, 8, 4, 18, 72, 1),  # the rack: 18 trays of 4, one domain
    ("gb300", 144, 4, 4, 36, 72, 2),
    ("gb200", 100, 4, 4, 25, 72, 2),  # 72 + 28
    ("gb200", 8, 4, 4, 2, 8, 1),
    ("rtx-pro-6000", 16, 8, 8, 2, 8, 2),  # PCIe cards: the node's PCIe is their link
    ("h100-pcie", 4, 8, 8, 1, 4, 1),
])
def test_the_request_knows_its_nodes_and_link_domains(target, gpus, per_node, node, nodes, domain, domains):
    req = validate_plan_request(PlanRequest(workload="llama", target=target, gpus=gpus, gpus_per_node=per_node,
                                            global_batch=8 * gpus))
    assert (req.node_gpus, req.nodes, req.domain, req.domains) == (node, nodes, domain, domains)


def test_gpus_that_fill_no_whole_tray_are_refused_naming_the_trays():
    with pytest.raises(ConfigError) as info:
        validate_plan_request(PlanRequest(workload="llama", target="gb200", gpus=10, global_batch=80))
    assert info.value.field == "gpus" and "GB200 NVL72 hosts hold 4 GPUs" in str(info.value)


def test_a_collective_crossing_nvl72_racks_pays_the_network_and_one_inside_does_not():
    inside = Links.of("gb200", domains=1)
    assert inside.network is None and inside.intra == 900e9
    across = Links.of("gb200", domains=2)
    dp = Kernel("ar", "all-reduce", 0.0, 8e9, None, 1, group=2, asynchronous=True, nodes=2)
    fsdp = Kernel("ag", "all-gather", 0.0, 8e9, None, 1, group=72, asynchronous=True, nodes=1)
    network, nvlink = cross_domain_seconds([dp, fsdp], across)
    assert network == pytest.approx(nvlink * 900e9 / 50e9, rel=0.01)  # one GPU per rack: its own NIC
    assert Links.of("gb300", domains=2).network == 100e9  # ConnectX-8 800 Gb/s per GPU
    assert "inside each domain of 72" in link_bandwidth("gb200", 2, 72)[1]


@pytest.fixture(scope="module")
def nvl72_plans():
    base = dict(workload="llama", preset="tiny", target="gb200", compile_for_tpu=False, sharding="hybrid:4")
    return {gpus: plan_migration(validate_plan_request(PlanRequest(**base, gpus=gpus, global_batch=8 * gpus)),
                                 lambda *a, **k: None) for gpus in (72, 100)}


def test_72_gpus_on_nvl72_plan_as_one_domain(nvl72_plans):
    plan = nvl72_plans[72]
    assert plan.status == "ok" and (plan.nodes, plan.gpus_per_node, plan.domain_gpus) == (18, 4, 72)
    decisions = {d.decision: d for d in plan.decisions}
    assert "link_domains" not in decisions
    assert "share one NVLink domain" in decisions["nodes"].reason
    assert "hosts hold 4" in decisions["nodes"].reason  # the default 8 per node, capped at a tray's 4


def test_100_gpus_on_nvl72_are_planned_with_the_cost_of_crossing_racks_said(nvl72_plans):
    plan = nvl72_plans[100]
    assert plan.status == "ok" and plan.domain_gpus == 72
    why = {d.decision: d for d in plan.decisions}["link_domains"].reason
    assert "2 NVLink domains (72 + 28 GPUs)" in why and "partly filled" in why
    assert "over the network (400 Gb/s per GPU)" in why and "were every collective inside a domain" in why


def test_a_launch_over_nvl72_racks_asks_for_whole_racks():
    required = {f.name: None for f in dataclasses.fields(Plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    plan = Plan(**{**required, **dict(status="ok", workload="llama", preset="tiny", gpus=144, gpus_per_node=4,
                                      nodes=36, domain_gpus=72, target="gb200", target_name="GB200 NVL72",
                                      per_device_batch=8, accumulation_steps=1, global_batch=1152,
                                      precision="bf16", remat="none", memory_fraction=0.8, environment={})})
    assert "#SBATCH --segment=18" in sbatch_script(plan)
    assert "NVLink domain: 72 GPUs, 18 nodes of 4" in deployment_snippet(plan)
    hgx = dataclasses.replace(plan, target="h100-sxm", gpus_per_node=8, nodes=18, domain_gpus=8)
    assert "--segment" not in sbatch_script(hgx) and "NVLink domain" not in deployment_snippet(hgx)
