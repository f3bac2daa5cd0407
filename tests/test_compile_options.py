"""The options a GPU program is compiled with for its figures (compiled.GPU_FIGURE_OPTIONS and a kernel cache of
the process's own) leave the program XLA builds as it was: the same optimized program text, the same peak and
state bytes, the same kernels read for its step time, for a dense decoder, an fp8 one and a mixture of experts
split over an expert axis, compiled one after another so that the later compiles take kernels from the cache."""

import os
import stat

import jax
import pytest

from migration.config.requests import RunConfig, validate
from migration.hardware import GPU_SPECS
from migration.planning.compiled import figure_compile_options, train_step_figures
from migration.planning.memory import deviceless_devices
from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

DENSE = {"d_model": 128, "n_heads": 4, "n_kv_heads": 2, "d_ff": 256, "n_layers": 2}


def _lowered(workload: str, devices: int, sharding: str, batch: int, precision: str = "bf16",
             remat: str = "none", model: dict | None = None):
    cfg = validate(RunConfig(workload=workload, preset="tiny", per_device_batch=batch, devices=devices,
                             precision=precision, remat=remat, sharding=sharding, model=dict(model or {})))
    program = TrainProgram.from_config(cfg)
    mesh = make_mesh(deviceless_devices(GPU_SPECS["h100-sxm"], 1, devices), sharding)
    return jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)), mesh


CASES = {
    # two candidates of one search (another batch and policy): the second takes kernels from the cache
    "dense": [("llama", 8, "fsdp", 2, "bf16", "none", DENSE), ("llama", 8, "fsdp", 4, "bf16", "dots", DENSE)],
    "fp8": [("llama", 1, "replicated", 4, "fp8", "none", DENSE)],
    "moe": [("moe", 4, "fsdp+ep4", 2, "bf16", "none", {})],
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_gpu_program_compiled_with_the_figure_options_is_the_same_program(case):
    for workload, devices, sharding, batch, precision, remat, model in CASES[case]:
        lowered, mesh = _lowered(workload, devices, sharding, batch, precision, remat, model)
        options = figure_compile_options(mesh.devices)
        assert options["xla_gpu_kernel_cache_file"] and options["xla_gpu_disable_gpuasm_optimizations"]
        plain, fast = lowered.compile(), lowered.compile(options)
        assert fast.as_text() == plain.as_text(), (case, batch, remat)
        assert train_step_figures(fast, 0, True, 8, "tf32") == train_step_figures(plain, 0, True, 8, "tf32")
    assert os.path.getsize(options["xla_gpu_kernel_cache_file"]) > 0  # the cache was written, and read after


def test_the_kernel_cache_is_the_process_own_and_other_platforms_get_no_options():
    mesh = make_mesh(deviceless_devices(GPU_SPECS["h100-sxm"], 1, 2), "fsdp")
    path = figure_compile_options(mesh.devices)["xla_gpu_kernel_cache_file"]
    assert path == figure_compile_options(mesh.devices)["xla_gpu_kernel_cache_file"]  # one per process
    folder = os.path.dirname(path)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # no other user reads or plants kernels in it
    assert figure_compile_options(jax.devices("cpu")) == {}  # a CPU-backend compile is not a GPU program
