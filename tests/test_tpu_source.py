"""The TPU side of a plan, compiled: libtpu (installed with the product) describes every catalog slice
without its chips, as many JAX devices as the catalog says, and one process compiles the same model
for a TPU slice and for a GPU target. Where libtpu cannot load, the plan says so in one line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from migration.config.requests import PlanRequest
from migration.hardware import TPU_SPECS
from migration.planning.source import compile_for_source_tpu, tpu_topology

ROOT = Path(__file__).resolve().parent.parent
# The device kind libtpu reports for each generation's chips.
DEVICE_KIND = {"v3": "TPU v3", "v4": "TPU v4", "v5e": "TPU v5 lite", "v5p": "TPU v5", "v6e": "TPU v6 lite",
               "tpu7x": "TPU7x"}


@pytest.mark.parametrize("key", list(TPU_SPECS))
def test_libtpu_describes_every_catalog_slice_with_its_device_count(key):
    spec = TPU_SPECS[key]
    topo = tpu_topology(spec)
    assert len(topo.devices) == spec.devices
    assert {d.device_kind for d in topo.devices} == {DEVICE_KIND[spec.generation]}


def test_one_process_compiles_the_model_for_a_tpu_slice_and_a_gpu_target():
    from migration.planning.planner import plan_migration

    plan = plan_migration(PlanRequest(workload="llama", preset="tiny", source="tpu-v4-8", global_batch=32,
                                      target="h100-sxm", gpus=1), lambda *a, **k: None)
    assert plan.ok and plan.step_time["source"] == "compiled program"
    src = plan.source_tpu_compile
    assert src["status"] == "ok", src
    assert src["device_kind"] == "TPU v4" and src["topology"] == "v4:2x2x1"
    # 8 per chip (32 over the 4 chips of a v4-8), bf16, no remat: a real program's peak, under the chip's HBM.
    assert 0 < src["peak_bytes_per_chip"] < TPU_SPECS["tpu-v4-8"].hbm_bytes_per_device


def test_the_tpu_compiler_says_when_the_stated_setup_exceeds_the_chips_hbm():
    # Llama 3 8B dimensions, 64 per chip at 8,192 tokens on a v5e-8 (16 GB chips), no remat: far over.
    req = PlanRequest(workload="llama", preset="8b", source="tpu-v5e-8", global_batch=512, target="h100-sxm")
    src = compile_for_source_tpu(req)
    assert src["status"] == "does-not-fit", src
    assert src["hbm_bytes_per_device"] == TPU_SPECS["tpu-v5e-8"].hbm_bytes_per_device and src["reason"]


def test_without_libtpu_the_plan_says_the_tpu_compile_is_unavailable_and_why():
    code = ("import json; from migration.config.requests import PlanRequest; "
            "from migration.planning.source import compile_for_source_tpu; "
            "print(json.dumps(compile_for_source_tpu(PlanRequest(workload='mlp', source='tpu-v5p-8'))))")
    env = {**os.environ, "TPU_LIBRARY_PATH": "/nonexistent/libtpu.so", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "unavailable"
    assert "libtpu" in out["reason"] and "requirements.txt" in out["reason"] and "\n" not in out["reason"]
