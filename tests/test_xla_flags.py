"""Every XLA flag a plan's environment block names is accepted by the installed XLA.

XLA parses XLA_FLAGS when a backend first starts, for every backend (GPU flags included), and aborts
on a flag it does not know: a fresh CPU process that starts JAX with the flags is the check.
"""

import os
import subprocess
import sys

import pytest

from migration.planning.deployment import xla_flags_for
from migration.running.worker_env import DISABLE_XLA_REMAT, NO_CODEGEN_OPTIMISATION

START_JAX = "import jax, jax.numpy as jnp; print(float(jnp.ones(3).sum()))"


def start_jax_with(flags: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": " ".join(flags)}
    return subprocess.run([sys.executable, "-c", START_JAX], env=env, capture_output=True, text=True, timeout=120)


def planned_flags() -> list[str]:
    flags = {DISABLE_XLA_REMAT, NO_CODEGEN_OPTIMISATION}
    for sharding in ("replicated", "fsdp"):
        for precision in ("bf16", "fp32"):
            flags.update(f for f, _ in xla_flags_for(sharding, precision, 123_456_789))
    return sorted(flags)


def test_every_planned_flag_is_accepted_by_the_installed_xla():
    flags = planned_flags()
    assert any("latency_hiding" in f for f in flags) and any("combine_threshold" in f for f in flags)
    done = start_jax_with(flags)
    assert done.returncode == 0 and done.stdout.strip() == "3.0", done.stderr[-2000:]


@pytest.mark.parametrize("flag", ["--xla_gpu_enable_no_such_thing=true"])
def test_an_unknown_flag_is_refused_so_the_check_can_fail(flag):
    done = start_jax_with([flag])
    assert done.returncode != 0 and "no_such_thing" in done.stderr
