"""One job across several processes, through jax.distributed, with real processes on this machine.

Two processes on the loopback address, each with 2 CPU devices (JAX's gloo CPU collectives), run the
same tiny config as one 4-device job, started exactly as on two hosts (`python -m migration run
--coordinator HOST:PORT --num-processes 2 --process-id I`), or as under srun (`--distributed auto` in
a SLURM-shaped environment: JAX's own cluster detection). Their losses must equal those of one
process on 4 devices (conftest's in-process `Trainer`: the same step and data), to float32 rounding:
the 2-process job all-reduces over gloo in another order, about 1e-7 relative.

No test can hang: every process leads its own process group, killed at the test's deadline; each
run also has its own `--timeout`, which bounds how long a process waits for a peer that never comes.
"""

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from migration.cli.commands import main as cli
from migration.planning.deployment import deployment_snippet
from migration.common import ConfigError
from migration.config.requests import PlanRequest, RunConfig, validate
from migration.config.distributed import parse_coordinator
from migration.results import Plan

ROOT = Path(__file__).resolve().parent.parent
LOSS_RTOL = 1e-6  # float32: the collectives of two processes sum in another order (measured: 1e-7)
DEADLINE_S = 240  # per test, for all its processes together
TINY = dict(workload="mlp", preset="tiny", per_device_batch=4, devices=4, steps=4, warmup_steps=1)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_flags(cfg: RunConfig) -> list[str]:
    return ["run", "--workload", cfg.workload, "--preset", cfg.preset, "--batch", str(cfg.per_device_batch), "--devices",
            str(cfg.devices), "--steps", str(cfg.steps), "--warmup", str(cfg.warmup_steps), "--sharding",
            cfg.sharding, "--platform", "cpu", "--timeout", "150", "--quiet"]


def launch(commands: list[list[str]], tmp: Path, envs: list[dict] | None = None) -> list[tuple[int, str]]:
    """Start every command at once (`python -m migration ...`, each in its own process group) and
    wait for all; (exit code, output) each. At the deadline every group still running is killed
    (the CLI's worker follows its parent through its lifeline) and the test fails with the output."""
    procs, logs = [], []
    try:
        for i, args in enumerate(commands):
            log = open(tmp / f"process-{i}.log", "w+")
            logs.append(log)
            env = {**os.environ, **(envs[i] if envs else {})}
            procs.append(subprocess.Popen([sys.executable, "-m", "migration", *args], cwd=ROOT, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + DEADLINE_S
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
    finally:
        hung = [p for p in procs if p.poll() is None]
        for p in hung:
            os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    assert not hung, f"{len(hung)} process(es) still running after {DEADLINE_S} s, killed:\n" + "\n----\n".join(outputs)
    return [(p.returncode, out) for p, out in zip(procs, outputs)]


def two_process_job(cfg: RunConfig, tmp: Path) -> tuple[dict, list[str]]:
    """`cfg` as 2 processes of 2 devices each, joined at a free loopback port: process 0's report, outputs."""
    port = free_port()
    commands = [run_flags(cfg) + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                  str(i), "--json", str(tmp / f"report-{i}.json")] for i in range(2)]
    results = launch(commands, tmp)
    for code, out in results:
        assert code == 0, out
    assert not (tmp / "report-1.json").exists()  # process 0 writes the job's report
    assert "process 1 of 2: process 0 writes the report files" in results[1][1]
    return json.loads((tmp / "report-0.json").read_text()), [out for _, out in results]


def one_process_losses(trainer, cfg: RunConfig) -> list[float]:
    return [float(m["loss"]) for m in trainer(cfg).run(cfg.steps)]


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicated", "fsdp"])
def test_two_processes_train_exactly_like_one_process_on_four_devices(trainer, tmp_path, sharding):
    cfg = RunConfig(**TINY, sharding=sharding)
    report, outputs = two_process_job(cfg, tmp_path)
    assert report["status"] == "ok", report["message"]
    assert (report["process_index"], report["process_count"], report["device_count"]) == (0, 2, 4)
    assert report["config"]["num_processes"] == 2 and report["sharding"] == sharding
    expected = one_process_losses(trainer, cfg)
    assert len(set(expected)) == cfg.steps  # the loss moves: equal curves mean the same training
    np.testing.assert_allclose(report["losses"], expected, rtol=LOSS_RTOL)
    # Process 1 measured the same job: its summary shows the same last loss.
    assert f" {report['losses'][-1]:.4f} (first step" in outputs[1]


@pytest.mark.slow
def test_a_two_process_job_saves_a_checkpoint_that_one_process_continues(trainer, tmp_path):
    """Weights carried from a 2-host FSDP job to one host: both processes write their shards of one
    Orbax checkpoint; one process on 4 devices, replicated, restores it and trains on with the
    losses of 6 uninterrupted steps."""
    cfg = RunConfig(**TINY, sharding="fsdp")
    ckpt = tmp_path / "ckpt"
    port = free_port()
    results = launch([run_flags(cfg) + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id",
                                        str(i), "--save-checkpoint", str(ckpt)] for i in range(2)], tmp_path)
    for code, out in results:
        assert code == 0, out
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert (meta["step"], meta["devices"], meta["sharding"]) == (cfg.steps, 4, "fsdp")
    more = RunConfig(**{**TINY, "steps": 2})
    [(code, out)] = launch([run_flags(more) + ["--restore-checkpoint", str(ckpt), "--json",
                                               str(tmp_path / "continued.json")]], tmp_path)
    assert code == 0, out
    continued = json.loads((tmp_path / "continued.json").read_text())
    straight = one_process_losses(trainer, RunConfig(**{**TINY, "steps": cfg.steps + 2}))
    np.testing.assert_allclose(continued["losses"], straight[cfg.steps:], rtol=1e-5)


@pytest.mark.slow
def test_a_process_whose_coordinator_never_starts_fails_within_its_timeout_saying_so(tmp_path):
    """Process 1 waits for process 0 half the run's --timeout (7 s of 15), then fails with the reason."""
    cfg = RunConfig(**TINY)
    flags = run_flags(cfg)
    flags[flags.index("--timeout") + 1] = "15"
    port = free_port()  # nothing listens there: process 0 never started
    t0 = time.monotonic()
    [(code, out)] = launch([flags + ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
                                     "--process-id", "1"]], tmp_path)
    assert code == 1 and time.monotonic() - t0 < 60, out
    assert f"while joining the multi-process job (coordinator 127.0.0.1:{port}): nothing answered at " \
           f"127.0.0.1:{port} within 7 s" in out and "start process 0 of the job there" in out, out


def slurm_env(tasks: int, port: int) -> list[dict]:
    """What `srun --ntasks=N` on one node gives each task, as JAX's SLURM detection reads it (the
    coordinator: the step's first node, at JAX_COORDINATOR_PORT)."""
    return [{"SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "127.0.0.1", "SLURM_NTASKS": str(tasks),
             "SLURM_STEP_NUM_NODES": "1", "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i),
             "JAX_COORDINATOR_PORT": str(port)} for i in range(tasks)]


@pytest.mark.slow
def test_a_multi_node_plan_runs_as_one_job_under_slurm_and_is_refused_as_one_process(trainer, tmp_path):
    """A plan for 2 nodes of 2 GPUs: refused when started as one process (the message says how to
    launch it); started as its sbatch script does (srun, `--distributed auto`: JAX detects SLURM),
    it runs as one job of two processes of 2 CPU devices, with the losses of one process on 4; process
    0 writes the report and the exports, whose deployment script has the sbatch and Job forms."""
    from migration.planning.planner import plan_migration

    plan = plan_migration(PlanRequest(workload="mlp", preset="tiny", target="h100-sxm", gpus=4, gpus_per_node=2,
                                      global_batch=16, max_per_device_batch=4, precision="fp32",
                                      compile_for_tpu=False),
                          lambda *a, **k: None)
    assert plan.ok and plan.nodes == 2 and plan.gpus == 4, plan.message
    plan_file = tmp_path / "plan.json"
    plan.to_json(plan_file)
    common = ["run", "--plan", str(plan_file), "--platform", "cpu", "--steps", "3", "--warmup", "1", "--timeout",
              "150", "--quiet"]
    [(code, out)] = launch([common + ["--export-dir", str(tmp_path / "alone")]], tmp_path)
    assert code == 2 and "spans 2 nodes" in out and "--num-processes 2" in out and "--coordinator" in out, out
    results = launch([common + ["--distributed", "auto", "--export-dir", str(tmp_path / f"exports-{i}"), "--json",
                                str(tmp_path / f"report-{i}.json")] for i in range(2)], tmp_path,
                     slurm_env(2, free_port()))
    for code, out in results:
        assert code == 0, out
    assert "exports:" in results[0][1] and "exports:" not in results[1][1]
    assert not (tmp_path / "report-1.json").exists() and not any((tmp_path / "exports-1").glob("*"))
    report = json.loads((tmp_path / "report-0.json").read_text())
    assert (report["process_index"], report["process_count"], report["device_count"]) == (0, 2, 4)
    single = {k: v for k, v in report["config"].items() if k not in ("coordinator", "num_processes", "process_id")}
    np.testing.assert_allclose(report["losses"], one_process_losses(trainer, RunConfig(**single)), rtol=LOSS_RTOL)
    [deploy] = (tmp_path / "exports-0").glob("deploy-*.sh")
    script = deploy.read_text()
    assert "srun --nodes=2 --ntasks=4 --ntasks-per-node=2" in script and "completions: 2" in script


def stub_plan(**fields) -> Plan:
    """A plan with the decisions the deployment script is built from (no planning needed for its text;
    the script rebuilds the environment from them)."""
    required = {f.name: None for f in dataclasses.fields(Plan)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    base = dict(status="ok", workload="transformer", preset="tiny", gpus=24, gpus_per_node=8, nodes=3,
                target="h100-sxm", target_name="NVIDIA H100 SXM", per_device_batch=8, accumulation_steps=1,
                global_batch=192, precision="bf16", remat="none", memory_fraction=0.8, environment={})
    return Plan(**{**required, **base, **fields})


def run_script(script: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=30, check=False,
                          env={**os.environ, **env})


def test_the_deployment_script_of_a_multi_node_plan_launches_it_with_srun_a_kubernetes_job_or_by_hand(tmp_path):
    script = tmp_path / "deploy.sh"
    script.write_text(deployment_snippet(stub_plan(), command="echo python -m migration run --plan plan.json"))
    assert subprocess.run(["bash", "-n", str(script)], check=False).returncode == 0
    sbatch = run_script(script, "sbatch")
    assert sbatch.returncode == 0, sbatch.stderr
    assert "#SBATCH --nodes=3" in sbatch.stdout and "#SBATCH --ntasks-per-node=8" in sbatch.stdout
    assert "srun --nodes=3 --ntasks=24 --ntasks-per-node=8 echo python -m migration run --plan plan.json " \
           "--coordinator auto" in sbatch.stdout
    assert "export XLA_FLAGS=" in sbatch.stdout and "CUDA_VISIBLE_DEVICES" not in sbatch.stdout
    kube = run_script(script, "kubernetes")
    service, job = yaml.safe_load_all(kube.stdout)
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"  # headless
    name = job["metadata"]["name"]
    spec = job["spec"]
    assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", 3, 3)
    assert spec["template"]["spec"]["subdomain"] == service["metadata"]["name"] == name
    container = spec["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["args"][0].endswith(f'--coordinator {name}-0.{name}:1234 --num-processes 3 '
                                         f'--process-id "$JOB_COMPLETION_INDEX"')
    flags = [e["value"] for e in container["env"] if e["name"] == "XLA_FLAGS"]
    assert len(flags) == 1 and "--xla_gpu_enable_latency_hiding_scheduler=true" in flags[0].split()
    by_hand = run_script(script, COORDINATOR="node0:1234", NODE_RANK="2")
    assert by_hand.returncode == 0 and by_hand.stdout.strip().endswith(
        "--coordinator node0:1234 --num-processes 3 --process-id 2"), by_hand.stdout + by_hand.stderr
    missing = run_script(script)
    assert missing.returncode != 0 and "set COORDINATOR" in missing.stderr


def test_a_one_node_plan_keeps_its_one_command():
    snippet = deployment_snippet(stub_plan(gpus=8, nodes=1))
    assert snippet.rstrip().endswith("python -m migration run --plan plan.json") and "srun" not in snippet


@pytest.mark.parametrize("flags, message", [
    (["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "2"],
     "process_id: must be from 0 to 1 (num_processes is 2); got 2 (flag --process-id)"),
    (["--coordinator", "127.0.0.1", "--num-processes", "2"], "coordinator: must be HOST:PORT"),
    (["--coordinator", "127.0.0.1:99999", "--num-processes", "2"], "port must be a number from 1 to 65535"),
    (["--coordinator", "two words:80", "--num-processes", "2"], "is not a host name or address"),
    (["--num-processes", "2", "--process-id", "1"], "need a coordinator: start one process per host"),
    (["--coordinator", "h:1", "--num-processes", "0"], "num_processes: must be an integer from 1 to 1024; got 0"),
    (["--coordinator", "h:1", "--num-processes", "3"], "4 devices do not divide over 3 processes"),
    (["--distributed", "auto", "--num-processes", "2"], "the cluster (SLURM, Open MPI, ...) gives the process count"),
    (["--coordinator", "h:1", "--num-processes", "2", "--step-style", "pmap"], "runs the migrated jit step only"),
])
def test_bad_multi_process_flags_are_refused_before_any_process_starts(capsys, flags, message):
    code = cli(["run", "--workload", "mlp", "--devices", "4", *flags])
    err = capsys.readouterr().err
    assert code == 2 and message in err, err


def test_coordinator_and_distributed_auto_are_one_choice(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(["run", "--coordinator", "h:1", "--distributed", "auto"])
    assert exit_.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_coordinator_addresses():
    assert parse_coordinator("10.0.0.1:1234") == ("10.0.0.1", 1234)
    assert parse_coordinator("node-0.svc.cluster.local:80") == ("node-0.svc.cluster.local", 80)
    assert parse_coordinator("[fd00::1]:1234") == ("[fd00::1]", 1234)
    for bad in (":1234", "host:", "host:port", "fd00::1:1234", "host:0"):
        with pytest.raises(ValueError):
            parse_coordinator(bad)
    assert validate(RunConfig(workload="mlp", devices=8, coordinator="auto")).coordinator == "auto"
    with pytest.raises(ConfigError, match="coordinator: must be empty"):
        validate(RunConfig(workload="mlp", coordinator=1234))


def test_the_one_host_comparison_runs_of_a_plan_are_refused_in_a_multi_process_job(capsys, tmp_path):
    from migration.planning.planner import plan_migration

    plan = plan_migration(PlanRequest(workload="mlp", preset="tiny", target="a100-40gb", gpus=3, global_batch=48,
                                      compile_for_tpu=False), lambda *a, **k: None)
    plan.to_json(tmp_path / "plan.json")  # a real plan: the CLI checks every field of a plan file first
    code = cli(["run", "--plan", str(tmp_path / "plan.json"), "--pmap-before", "--coordinator", "h:1",
                "--num-processes", "3", "--process-id", "1", "--export-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2 and "a multi-process job runs the plan's jit step only" in err and "(flag --coordinator)" in err, err
