"""Test setup: the CPU backend with 4 XLA CPU devices, set before JAX is first imported."""

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["JAX_NUM_CPU_DEVICES"] = "4"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import pytest  # noqa: E402

from migration.config import RunConfig  # noqa: E402
from migration.policies import DynamicLossScale  # noqa: E402
from migration.train import TrainProgram, batch_maker, init_state_on, jit_step, make_data_mesh  # noqa: E402


class Trainer:
    """Runs a program in-process on the first `devices` CPU devices (for numerics tests)."""

    def __init__(self, cfg: RunConfig, loss_scale: DynamicLossScale | None = None):
        self.program = TrainProgram.from_config(cfg, loss_scale=loss_scale)
        self.mesh = make_data_mesh(jax.devices()[: cfg.devices])
        self.state = init_state_on(self.program, self.mesh)
        self.step = jit_step(self.program, self.mesh)
        self.make = batch_maker(self.program, self.mesh)

    def run(self, steps: int, start: int = 0) -> list[dict]:
        out = []
        for i in range(start, start + steps):
            self.state, metrics = self.step(self.state, self.make(i))
            out.append(jax.device_get(metrics))
        return out


@pytest.fixture
def trainer():
    return Trainer
