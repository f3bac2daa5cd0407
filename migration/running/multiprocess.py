"""Joining a multi-process job at run time (`jax.distributed`), in the worker, before anything starts
JAX's backend; what the settings mean and how they are checked is migration/config/distributed.py.
Imported only by the worker, once its environment is set: it imports JAX.
"""

from __future__ import annotations

import socket
import time
from typing import Any, NamedTuple

import jax
from jax._src.distributed import global_state  # what the cluster said, before the backend starts

from migration.config.distributed import AUTO, CPU_COLLECTIVES, LAUNCH_HINT, is_multiprocess, join_timeout_s, parse_coordinator
from migration.common import ConfigError


class ProcessPlace(NamedTuple):
    """This process's place in its job."""

    index: int
    count: int


def join(cfg: Any) -> ProcessPlace:
    """Join `cfg`'s job: JAX's CPU collectives and this process's share of the CPU devices, then
    `jax.distributed.initialize`. Call before anything that starts JAX's backend. A one-process
    run joins nothing: (0, 1)."""
    if not is_multiprocess(cfg):
        return ProcessPlace(0, 1)
    deadline = time.monotonic() + join_timeout_s(cfg)
    if cfg.coordinator != AUTO and cfg.process_id != 0:
        wait_for_coordinator(cfg.coordinator, join_timeout_s(cfg))
    jax.config.update("jax_cpu_collectives_implementation", CPU_COLLECTIVES)
    where = {} if cfg.coordinator == AUTO else dict(coordinator_address=cfg.coordinator,
                                                    num_processes=cfg.num_processes, process_id=cfg.process_id)
    try:
        jax.distributed.initialize(**where, initialization_timeout=max(1, int(deadline - time.monotonic())))
    except ValueError as exc:  # auto without a cluster JAX knows: it names the argument it lacks
        raise ConfigError("coordinator", f"JAX found no cluster to join ({exc}); {LAUNCH_HINT}") from None
    if cfg.coordinator == AUTO:
        # What the cluster said, before the backend starts (jax.process_count() would start it).
        place = ProcessPlace(global_state.process_id, global_state.num_processes)
    else:
        place = ProcessPlace(cfg.process_id, cfg.num_processes)
    if cfg.devices % place.count:
        raise ConfigError("devices", f"is the job's global device count: {cfg.devices} devices do not divide over "
                                     f"the {place.count} processes the cluster started; use a multiple of {place.count}")
    # CPU backend only (a GPU process sees its GPUs): this process's share of the job's devices.
    jax.config.update("jax_num_cpu_devices", cfg.devices // place.count)
    return place


def wait_for_coordinator(address: str, timeout_s: float) -> None:
    """Wait until something listens at `address` (process 0's coordinator service); ConnectionError
    saying so after `timeout_s`. JAX itself, failing to reach it, aborts the process with a bare
    DEADLINE_EXCEEDED."""
    host, port = parse_coordinator(address)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=2):
                return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise ConnectionError(
                    f"nothing answered at {address} within {timeout_s:g} s ({exc.strerror or exc}): start process 0 "
                    "of the job there (its --coordinator names its own host and a free port), or check the address "
                    "and that the port is open between the hosts") from None
        time.sleep(0.5)


def leave(cfg: Any) -> None:
    """Leave the job once this process's work is done: waits (JAX's shutdown barrier) until every
    process got there, so process 0, which hosts the coordinator, never ends before the others."""
    if is_multiprocess(cfg):
        jax.distributed.shutdown()
