"""What a plan hands over to run it elsewhere: the device mesh of its layout (axes, specs, MaxText's
parallelism settings, how the job launches), the environment its job needs and the scripts that set it
and start the job (one node; several nodes through srun, a Kubernetes indexed Job, or by hand).

The environment is always rebuilt here from the plan's decisions (target, GPUs and nodes, memory
share, state sharding, precision, the model's size): a plan is also a file a user can upload, and
what its `environment` field says is never copied into a worker or a script. Every value written
into a shell script is quoted with `shlex.quote`, and every comment is one line of printable text,
so nothing in a plan can become a command for whoever runs the script.

No JAX here: the server rebuilds environments for uploaded plans.
"""

from __future__ import annotations

import json
import math
import re
import shlex
from typing import Any

from migration.common import model_name
from migration.config.layouts import parse_layout
from migration.hardware import GPU_SPECS, gpu_spec_for_device_kind

DEFAULT_PORT = 1234  # in the launch scripts: any port free on the coordinator's host
RUN_COMMAND = "python -m migration run --plan plan.json"
_UNPRINTABLE = re.compile(r"[^\x20-\x7e\u00a0-\u2027\u202f-\u2065\u206a-\ufffd]")


def one_line(text: Any, max_chars: int = 300) -> str:
    """`text` as one line of printable characters (line breaks, controls and bidirectional overrides
    become spaces), cut to `max_chars`: safe in a shell comment."""
    return _UNPRINTABLE.sub(" ", str(text))[:max_chars]


def combine_threshold(nbytes: float) -> int:
    """`nbytes` rounded up to a whole MiB: a combine threshold that takes one block's collective whole."""
    return int(math.ceil(max(nbytes, 1) / 2**20) * 2**20)


def xla_flags_for(sharding: str, precision: str, block_params: int) -> list[tuple[str, str]]:
    """XLA flags for a multi-GPU step, each with its reason. Combine thresholds are one block's
    collective, so each layer's communication is one collective that overlaps the next layer's compute."""
    compute = 4 if precision == "fp32" else 2  # FSDP gathers parameters in the compute dtype
    flags = [("--xla_gpu_enable_latency_hiding_scheduler=true",
              "schedule collectives early and overlap them with compute")]
    if parse_layout(sharding).shards_state():
        gather = combine_threshold(block_params * compute)
        flags += [
            (f"--xla_gpu_all_gather_combine_threshold_bytes={gather}",
             f"one all-gather per block (about {block_params:,} parameters per block, in the compute dtype)"),
            (f"--xla_gpu_reduce_scatter_combine_threshold_bytes={gather}",
             "one reduce-scatter of each block's gradients"),
            ("--xla_gpu_enable_pipelined_all_gather=true",
             "gather the next layer's parameters while this layer computes (the scanned layer loop)"),
            ("--xla_gpu_enable_pipelined_reduce_scatter=true",
             "reduce-scatter a layer's gradients while the previous layer's backward pass runs"),
        ]
    else:
        flags.append((f"--xla_gpu_all_reduce_combine_threshold_bytes={combine_threshold(block_params * 4)}",
                      f"one all-reduce per block's float32 gradients (about {block_params:,} parameters per block)"))
    return flags


def plan_environment(*, memory_fraction: float, gpus: int, nodes: int, gpus_per_node: int, sharding: str,
                     precision: str, compute_capability: tuple[int, int] | None,
                     block_params: int) -> dict[str, dict[str, str]]:
    """Environment variables for the target, each with its reason. XLA flags follow NVIDIA's guidance
    for JAX on GPUs (JAX-Toolbox's GPU performance notes, the JAX GPU performance tips): they matter
    where collectives run, so a one-GPU plan sets none; every flag named here is accepted by the
    installed XLA (tests/test_xla_flags.py checks it in a fresh process)."""
    env = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": {
            "value": "false",
            "why": "allocate on demand: on a shared GPU a job should not take 75% of the card at start-up",
        },
        "XLA_PYTHON_CLIENT_MEM_FRACTION": {
            "value": f"{memory_fraction:.2f}",
            "why": f"cap this job at {memory_fraction:.0%} of each GPU; the plan's budget is computed from it",
        },
        "CUDA_VISIBLE_DEVICES": {
            "value": ",".join(str(i) for i in range(gpus)),
            "why": "pin the job to its GPUs (set before JAX is imported)",
        },
    }
    if gpus > 1:
        flags = xla_flags_for(sharding, precision, block_params)
        env["XLA_FLAGS"] = {"value": " ".join(f for f, _ in flags), "why": "; ".join(f"{f}: {why}" for f, why in flags)}
        if (compute_capability or (0, 0))[0] == 9:
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = {
                "value": "1",
                "why": ("Hopper: one hardware work queue per device keeps kernels in the order XLA's latency-hiding "
                        "scheduler chose, so collectives overlap compute as scheduled (NVIDIA's guidance for "
                        "multi-GPU JAX on Hopper; not for Blackwell)"),
            }
    if nodes > 1:
        env["CUDA_VISIBLE_DEVICES"]["value"] = ",".join(str(i) for i in range(min(gpus, gpus_per_node)))
        env["CUDA_VISIBLE_DEVICES"]["why"] = "on every node, that node's GPUs (set before JAX is imported)"
    return env


def block_params(workload: Any, cfg: Any) -> int:
    """Parameters per block (a layer of the scan; the model's parameters over its blocks, so an upper
    figure), for the collectives' combine thresholds."""
    return int(workload.param_count(cfg) / max(1, workload.activation_profile(cfg).n_blocks))


def environment_of(plan: Any) -> dict[str, dict[str, str]]:
    """The environment a plan's job gets, rebuilt from its decisions by this code (never read from the
    plan's own `environment` field). The plan's workload and dimensions must have been checked
    (`config.check_model`) and its fields typed (`planfile.checked_plan`)."""
    # reason: workloads import JAX, which the server needs only when it rebuilds a plan's environment
    from workloads import resolve_workload

    workload = resolve_workload(plan.workload)
    cfg = workload.config(plan.preset, plan.model)
    spec = GPU_SPECS.get(plan.target) or gpu_spec_for_device_kind(plan.planned_device_kind or "")
    return plan_environment(memory_fraction=plan.memory_fraction, gpus=plan.gpus, nodes=plan.nodes,
                            gpus_per_node=plan.gpus_per_node, sharding=plan.sharding, precision=plan.precision,
                            compute_capability=spec.compute_capability if spec else None,
                            block_params=block_params(workload, cfg))


def export_lines(plan: Any, skip: tuple[str, ...] = ()) -> list[str]:
    """The plan's environment as quoted `export` lines, with their reasons as comments."""
    lines = []
    for name, item in environment_of(plan).items():
        if name not in skip:
            lines += [f"# {one_line(item['why'], 600)}", f"export {name}={shlex.quote(item['value'])}"]
    return lines


def deployment_snippet(plan: Any, command: str = RUN_COMMAND) -> str:
    """A shell snippet that sets the target's environment and starts the job."""
    lines = ["#!/usr/bin/env bash",
             one_line(f"# Environment for {model_name(plan.workload, plan.preset, plan.model)} on {plan.gpus} x {plan.target_name}:"),
             one_line(f"# {plan.per_device_batch} per GPU x {plan.accumulation_steps} accumulation = global batch "
                      f"{plan.global_batch}, {plan.precision}, remat {plan.remat}."),
             *mesh_lines(plan),
             "set -euo pipefail", *export_lines(plan)]
    if plan.nodes > 1:  # one job of several processes: the sbatch, Kubernetes and by-hand launches
        return "\n".join(lines) + "\n" + multi_node_launch(plan, command)
    lines.append(command)
    return "\n".join(lines) + "\n"


def mesh_lines(plan: Any) -> list[str]:
    """The layout as comments: its mesh, the specs of the state and the batch, MaxText's settings for it."""
    mesh = getattr(plan, "mesh", None) or {}
    if not mesh:
        return []
    maxtext = " ".join(f"{k}={v}" for k, v in (mesh.get("maxtext") or {}).items())
    return [one_line(f"# layout {mesh.get('layout')}: {mesh.get('describe')}"),
            one_line(f"# mesh = {mesh.get('mesh')}; batch {mesh.get('batch_spec')}; state: {mesh.get('state_spec')}"),
            one_line(f"# MaxText: {maxtext}; {mesh.get('launch')}")]


def job_name(plan: Any) -> str:
    """A Kubernetes / SLURM job name for the plan (lowercase letters, digits and '-')."""
    name = re.sub(r"[^a-z0-9-]+", "-", f"migration-{plan.workload}-{plan.preset}".lower()).strip("-")
    return name[:40].rstrip("-")


def sbatch_script(plan: Any, run: str = RUN_COMMAND) -> str:
    """An sbatch script: `nodes` nodes, one task per GPU, started by srun; JAX reads its place from
    SLURM (coordinator: the first node) and gives each task the GPU of its local rank."""
    gpn = plan.gpus_per_node
    rack = rack_nodes(plan)
    lines = ["#!/usr/bin/env bash", f"#SBATCH --job-name={job_name(plan)}", f"#SBATCH --nodes={plan.nodes}",
             f"#SBATCH --ntasks-per-node={gpn}", f"#SBATCH --gpus-per-node={gpn}", "#SBATCH --exclusive",
             *([f"#SBATCH --segment={rack}"] if rack and plan.nodes % rack == 0 else []),
             "set -euo pipefail", *export_lines(plan, skip=("CUDA_VISIBLE_DEVICES",)),
             f"# {plan.gpus} processes, one per GPU: JAX detects SLURM (--coordinator auto)",
             f"srun --nodes={plan.nodes} --ntasks={plan.gpus} --ntasks-per-node={gpn} {run} --coordinator auto"]
    return "\n".join(lines) + "\n"


def kubernetes_job(plan: Any, run: str = RUN_COMMAND,
                   image: str = "YOUR_TRAINING_IMAGE", port: int = DEFAULT_PORT) -> str:
    """A headless Service and an indexed Job: one pod per node with all its GPUs, the pod's
    JOB_COMPLETION_INDEX as its process id, pod 0 (reached through the Service) the coordinator."""
    name, n = job_name(plan), plan.nodes
    command = f'{run} --coordinator {name}-0.{name}:{port} --num-processes {n} --process-id "$JOB_COMPLETION_INDEX"'
    env = "".join(f"        - name: {k}\n          value: {json.dumps(item['value'])}\n"
                  for k, item in environment_of(plan).items() if k != "CUDA_VISIBLE_DEVICES")
    return (f"apiVersion: v1\nkind: Service\nmetadata:\n  name: {name}\nspec:\n  clusterIP: None\n"
            f"  selector:\n    job-name: {name}\n---\n"
            f"apiVersion: batch/v1\nkind: Job\nmetadata:\n  name: {name}\nspec:\n  completionMode: Indexed\n"
            f"  completions: {n}\n  parallelism: {n}\n  backoffLimit: 0\n  template:\n    spec:\n"
            f"      subdomain: {name}\n      restartPolicy: Never\n      containers:\n      - name: train\n"
            f"        image: {image}\n        command: [\"bash\", \"-c\"]\n        args:\n"
            f"        - {json.dumps(command)}\n"
            f"        ports:\n        - containerPort: {port}\n"
            f"        env:\n{env}"
            f"        resources:\n          limits:\n            nvidia.com/gpu: {plan.gpus_per_node}\n")


def rack_nodes(plan: Any) -> int | None:
    """Nodes per NVLink domain where the domain spans nodes (an NVL72 rack: 18 trays of 4), else None."""
    domain, gpn = getattr(plan, "domain_gpus", 0) or 0, plan.gpus_per_node
    return domain // gpn if gpn and domain > gpn else None


def domain_note(plan: Any) -> list[str]:
    """What a multi-node launch must keep for an NVLink domain that spans nodes: each domain's nodes in one
    rack, so that their collectives run over NVLink rather than the network."""
    rack = rack_nodes(plan)
    if not rack:
        return []
    whole = plan.nodes % rack == 0
    return [f"# NVLink domain: {plan.domain_gpus} GPUs, {rack} nodes of {plan.gpus_per_node}. Each group of {rack} "
            "consecutive nodes must be one rack's NVLink domain (SLURM's topology/block plugin: "
            + (f"--segment={rack}, set below" if whole else f"{plan.nodes} nodes are not whole groups of {rack}: "
               "the last group is a partial rack")
            + "; Kubernetes: an NVIDIA DRA ComputeDomain for the pods, which sets up the IMEX channels multi-node "
            "NVLink needs). Collectives between domains cross the network."]


def per_node_command(plan: Any, run: str = RUN_COMMAND) -> str:
    """The command each node runs by hand: one process per node, COORDINATOR and NODE_RANK from the caller."""
    return (f'{run} --coordinator "${{COORDINATOR:?set COORDINATOR=host-of-node-0:{DEFAULT_PORT}}}" '
            f'--num-processes {plan.nodes} --process-id "${{NODE_RANK:?set NODE_RANK to 0..{plan.nodes - 1}}}"')


def multi_node_launch(plan: Any, run: str = RUN_COMMAND) -> str:
    """The launch part of a multi-node plan's deployment script: `bash deploy.sh sbatch` prints the
    sbatch script, `bash deploy.sh kubernetes` the Service and indexed Job, and with COORDINATOR and
    NODE_RANK set, `bash deploy.sh` runs this node's process."""
    n = plan.nodes
    return "\n".join([
        (f"# {plan.gpus} GPUs on {n} nodes of {plan.gpus_per_node}: one job of several processes joined by "
         "jax.distributed. With this file as deploy.sh:"),
        "#   bash deploy.sh sbatch > job.sbatch && sbatch job.sbatch   # SLURM: srun, one process per GPU",
        "#   bash deploy.sh kubernetes | kubectl apply -f -          # Kubernetes: an indexed Job, one pod per node",
        (f"#   COORDINATOR=node0:{DEFAULT_PORT} NODE_RANK=0 bash deploy.sh  # by hand, on each node: NODE_RANK 0 "
         f"(on the coordinator's host) to {n - 1}"),
        "# Every process needs plan.json where the command runs (the image, or a shared folder).",
        *domain_note(plan),
        'case "${1:-}" in',
        "sbatch)", "cat <<'SBATCH'", sbatch_script(plan, run).rstrip("\n"), "SBATCH", ";;",
        "kubernetes)", "cat <<'KUBERNETES'", kubernetes_job(plan, run).rstrip("\n"), "KUBERNETES", ";;",
        "*)", per_node_command(plan, run), ";;",
        "esac",
    ]) + "\n"


# -- the mesh ---------------------------------------------------------------------------------
def mesh_of(layout: str, gpus: int, per_node: int, nodes: int) -> dict[str, Any]:
    """What the plan file and the deployment snippet say of the layout: the mesh's axes and sizes, the
    specs of the state and the batch, and how the job launches."""
    lay = parse_layout(layout)
    axes = lay.axes(gpus) if lay.kind == "hybrid" or lay.inner > 1 else {"data": gpus}
    state_axis = "fsdp" if "fsdp" in axes else "data"
    batch = [a for a in axes if a != "tensor"]
    sent = "tokens dispatched to their experts by all-to-all (a ragged all-to-all under dropless routing)"
    expert_note = (f"; routed experts split over 'expert' (their expert axis), the other weights over 'fsdp' x "
                   f"'expert'; {sent}" if lay.shards_state() else
                   f"; routed experts split over 'expert' (their expert axis); {sent}")
    return {
        "layout": layout, "axes": axes, "describe": lay.describe(gpus, per_node),
        "mesh": f"jax.make_mesh({tuple(axes.values())}, {tuple(axes)})",
        "batch_spec": f"P(None, {tuple(batch) if len(batch) > 1 else repr(batch[0])})",
        "state_spec": ("P() (whole on every GPU)" if not lay.shards_state() else
                       f"each array's largest dimension divisible by {axes.get(state_axis, gpus)} over {state_axis!r}")
                      + ("; block weights split over 'tensor' (q, kv, up: outputs; out, down: inputs)"
                         if lay.tensor > 1 else "") + (expert_note if lay.expert > 1 else ""),
        "maxtext": maxtext_parallelism(lay, gpus, per_node),
        "launch": (f"{nodes} processes, one per node, each calling jax.distributed.initialize() first; devices in "
                   "node order, so the innermost mesh axes stay inside a node" if nodes > 1 else
                   "one process over the node's GPUs"),
        "code": "migration/step/train.py make_mesh, state_shardings, batch_sharding",
    }


def maxtext_parallelism(lay: Any, gpus: int, per_node: int) -> dict[str, int]:
    """The layout in MaxText's settings: ici_* inside a node, dcn_* across nodes (expert parallelism wider
    than a node: ici_expert_parallelism the node's share, dcn_expert_parallelism the nodes)."""
    nodes = max(1, gpus // per_node)
    ici_e = min(lay.expert, max(1, per_node // lay.tensor))
    dcn_e = lay.expert // ici_e
    expert = {"ici_expert_parallelism": ici_e, "dcn_expert_parallelism": dcn_e} if lay.expert > 1 else {}
    inside = max(1, per_node // (lay.tensor * ici_e))
    if lay.kind == "replicated":
        return {"ici_data_parallelism": inside, "dcn_data_parallelism": nodes // dcn_e, **expert,
                "ici_tensor_parallelism": lay.tensor}
    if lay.kind == "fsdp":
        return {"ici_fsdp_parallelism": inside, "dcn_fsdp_parallelism": nodes // dcn_e, **expert,
                "ici_tensor_parallelism": lay.tensor}
    group_nodes = max(1, lay.group // per_node)
    return {"ici_fsdp_parallelism": max(1, min(lay.group, per_node) // (lay.tensor * ici_e)),
            "ici_data_parallelism": max(1, per_node // lay.group),
            "dcn_fsdp_parallelism": max(1, group_nodes // dcn_e), "dcn_data_parallelism": nodes // group_nodes,
            **expert, "ici_tensor_parallelism": lay.tensor}