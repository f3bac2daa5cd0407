"""One job across several processes (several hosts, or one process per GPU), through JAX's own
multi-process runtime (`jax.distributed`), never a launcher of our own.

JAX's multi-controller model: every process runs the same program and calls
`jax.distributed.initialize` before anything touches a device; `jax.devices()` is then every
process's devices (`jax.local_devices()` its own). The run's mesh spans them all, and each process
computes only its addressable shards of every array. So a run needs no data loader per process:
migration/step/train.py's batch generator is a jit whose `out_shardings` is the step's batch sharding,
and each process makes exactly its shards of the same global batch a one-process run makes (same
seed, same losses). The step's metrics leave the step fully replicated, so each process reads them
from its own devices.

Where a process learns its place in the job (RunConfig's `coordinator`, `num_processes`,
`process_id`; `devices` is the GLOBAL device count):
- explicit: `coordinator` "host:port" (the host of process 0 and a free port there, reachable from
  every process), `num_processes`, `process_id` in [0, num_processes);
- `coordinator` "auto": JAX's cluster detection (`jax.distributed.initialize()` without arguments).
  JAX 0.10.2 detects, in this order (jax._src.clusters): Open MPI (`mpirun`), SLURM (`srun`, from
  SLURM_JOB_ID, SLURM_STEP_NODELIST, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID), TPU VMs on GKE and
  GCE, and Kubernetes (with the `kubernetes` package and API access to the pod's Job). Under SLURM
  and Open MPI each process then uses the one GPU of its local rank. JAX_COORDINATOR_PORT overrides
  the port it derives.

On the CPU backend (tests, a laptop) cross-process collectives need JAX's CPU collectives
implementation ("gloo"; "mpi" needs an MPI library), and each process its share of the devices
(`jax_num_cpu_devices`); both are set here, before the backend starts.

Joining and leaving the job at run time is migration/running/multiprocess.py. The launch scripts for a
multi-node plan (srun, a Kubernetes indexed Job, by hand) are written by
migration/planning/deployment.py.
"""

from __future__ import annotations

import re
from typing import Any

from migration.common import ConfigError, shown
from migration.config.limits import check_int

AUTO = "auto"  # `coordinator`: let JAX detect the cluster
CPU_COLLECTIVES = "gloo"  # accepted by jaxlib 0.10.2's jax_cpu_collectives_implementation: gloo, mpi, megascale
MAX_JOIN_TIMEOUT_S = 300  # JAX's own default for jax.distributed.initialize
_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?)$")
LAUNCH_HINT = ("start one process per host (or per GPU) with --coordinator HOST:PORT --num-processes N --process-id I "
               "(HOST:PORT: process 0's host and a free port there), or under srun / mpirun with --coordinator auto")


def is_multiprocess(cfg: Any) -> bool:
    """Whether `cfg` runs as one of several processes (explicit or detected)."""
    return cfg.coordinator != ""


def devices_per_process(cfg: Any) -> Any:
    """This process's share of the job's devices where the process count is known (an explicit
    coordinator); the whole count otherwise (one process; "auto" until it joins, when `join` sets
    it). Takes an unvalidated config (the worker sets its environment first)."""
    n = cfg.num_processes
    if cfg.coordinator in ("", AUTO) or not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return cfg.devices
    return cfg.devices // n


def parse_coordinator(text: str) -> tuple[str, int]:
    """'host:port' (host a name, an IPv4 address or a [bracketed] IPv6 address) -> (host, port);
    ValueError saying what is wrong."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"must be HOST:PORT, e.g. 10.0.0.1:1234 or node0:1234; got {shown(text)}")
    if not _HOST.match(host):
        raise ValueError(f"{host!r} is not a host name or address (IPv6 goes in brackets: [fd00::1]:1234)")
    if not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port must be a number from 1 to 65535; got {shown(port)}")
    return host, int(port)


def check_distributed(cfg: Any) -> None:
    """The multi-process fields of a RunConfig (called by config.validate); ConfigError naming the
    field, what it got and what is allowed."""
    if not isinstance(cfg.coordinator, str):
        raise ConfigError("coordinator", f"must be empty (one process), 'auto' or HOST:PORT; got {shown(cfg.coordinator)}")
    for field in ("num_processes", "process_id"):
        check_int(cfg, field)
    if cfg.coordinator == "":
        if cfg.num_processes != 1 or cfg.process_id != 0:
            raise ConfigError("coordinator", f"num_processes {cfg.num_processes} / process_id {cfg.process_id} "
                                             f"need a coordinator: {LAUNCH_HINT}")
        return
    if cfg.coordinator == AUTO:
        if cfg.num_processes != 1 or cfg.process_id != 0:
            raise ConfigError("num_processes", "with coordinator auto the cluster (SLURM, Open MPI, ...) gives the "
                                               "process count and id; leave num_processes and process_id unset")
    else:
        try:
            parse_coordinator(cfg.coordinator)
        except ValueError as exc:
            raise ConfigError("coordinator", str(exc)) from None
        if not cfg.process_id < cfg.num_processes:
            raise ConfigError("process_id", f"must be from 0 to {cfg.num_processes - 1} (num_processes is "
                                            f"{cfg.num_processes}); got {cfg.process_id}")
        if cfg.devices % cfg.num_processes:
            raise ConfigError("devices", f"is the job's global device count and every process holds the same "
                                         f"number: {cfg.devices} devices do not divide over {cfg.num_processes} "
                                         f"processes; use a multiple of {cfg.num_processes}")
    if cfg.step_style != "jit":
        raise ConfigError("step_style", "a multi-process job runs the migrated jit step only (pmap is the "
                                        "one-host 'before'); use step_style jit")


def join_timeout_s(cfg: Any) -> int:
    """How long a process waits for the others to join: half the run's limit (so a peer that never
    comes is reported as such, before the run's own timeout stops the worker), at most JAX's default."""
    return max(1, int(min(cfg.timeout_s / 2, MAX_JOIN_TIMEOUT_S)))
