"""Run-config validation: one line naming the field, what it got and what is allowed."""

import pytest

from migration.common import ConfigError
from migration.config.requests import RunConfig, validate
from migration.running.worker_env import worker_environment
from migration.results import RunReport, write_csv


@pytest.mark.parametrize(
    "change,field,allowed",
    [
        ({"per_device_batch": 0}, "per_device_batch", "from 1 to 65536"),
        ({"per_device_batch": 2.5}, "per_device_batch", "integer"),
        ({"workload": "bert"}, "workload", "mlp, cnn, transformer"),
        ({"preset": "huge"}, "preset", "tiny"),
        ({"precision": "fp4"}, "precision", "fp32, bf16, fp16, fp8, mxfp8"),
        ({"remat": "some"}, "remat", "none, dots, dots_no_batch, save_dot_except_mlp, save_qkv, offload_dot_except_mlp, full"),
        ({"remat": "save_qkv", "workload": "mlp"}, "remat", "allowed for it: none, dots, dots_no_batch, full"),
        ({"accumulation_steps": 0}, "accumulation_steps", "from 1 to 1024"),
        ({"steps": 5, "warmup_steps": 5}, "warmup_steps", "smaller than steps"),
        ({"learning_rate": float("nan")}, "learning_rate", "number from"),
        ({"memory_fraction": 1.5}, "memory_fraction", "0.05 to 1"),
        ({"xla_flags": "xla_gpu_autotune_level=2"}, "xla_flags", "start with '--'"),
        ({"visible_devices": "gpu0"}, "visible_devices", "indices"),
        ({"platform": "tpu"}, "platform", "auto, cpu, gpu"),
    ],
)
def test_invalid_fields_are_named_with_what_is_allowed(change, field, allowed):
    with pytest.raises(ConfigError) as err:
        validate(RunConfig(**change))
    assert err.value.field == field
    message = str(err.value)
    assert message.startswith(field) and allowed in message and "\n" not in message


def test_defaults_are_valid_and_global_batch_multiplies_out():
    cfg = validate(RunConfig(per_device_batch=8, devices=4, accumulation_steps=3))
    assert cfg.global_batch == 96


def test_from_dict_rejects_unknown_fields():
    with pytest.raises(ConfigError, match="unknown field"):
        RunConfig.from_dict({"batch_size": 8})


def test_worker_environment_sets_jax_variables_before_import():
    env = worker_environment(RunConfig(platform="cpu", devices=4, memory_fraction=0.5, xla_flags="--xla_dump_to=/tmp/x"),
                             base={"XLA_FLAGS": "--xla_cpu_enable_fast_math=false"})
    assert env["JAX_PLATFORMS"] == "cpu" and env["JAX_NUM_CPU_DEVICES"] == "4"
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    assert env["XLA_FLAGS"] == "--xla_cpu_enable_fast_math=false --xla_dump_to=/tmp/x"
    gpu = worker_environment(RunConfig(platform="gpu", visible_devices="1", preallocate=True), base={})
    assert gpu["JAX_PLATFORMS"] == "cuda" and gpu["CUDA_VISIBLE_DEVICES"] == "1"
    assert gpu["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_csv_neutralises_cells_a_spreadsheet_would_evaluate(tmp_path):
    import pandas as pd

    cfg = RunConfig()
    report = RunReport.from_events(cfg, [{"event": "step", "loss": 1.0, "step_ms": 2.0}],
                                   status="failed", failure_kind="crashed", message="=HYPERLINK(\"x\")")
    path = tmp_path / "r.csv"
    write_csv([report, report], path)
    frame = pd.read_csv(path)
    assert len(frame) == 2 and frame.loc[0, "message"] == "'=HYPERLINK(\"x\")"
    assert "step_ms_median" in frame.columns and "losses" not in frame.columns


def test_the_fp32_reference_computes_fp32_products_in_fp32(tmp_path):
    """The platform's default precision runs fp32 products as TF32 on compute capability 8.0+: the
    fp32 reference asks for `highest`, its worker gets JAX_DEFAULT_MATMUL_PRECISION, and the run
    records it."""
    from migration.service.orchestrate import RunOptions, plan_runs
    from migration.running.runner import run

    cfg = RunConfig(workload="mlp", preset="tiny", precision="bf16", steps=3, warmup_steps=1, platform="cpu")
    runs = dict(plan_runs(None, cfg, RunOptions(fp32_reference=True), tmp_path))
    ref = runs["fp32 reference"]
    assert (ref.precision, ref.matmul_precision) == ("fp32", "highest")
    assert runs["migrated"].matmul_precision == "default"
    assert worker_environment(ref, base={})["JAX_DEFAULT_MATMUL_PRECISION"] == "highest"
    assert "JAX_DEFAULT_MATMUL_PRECISION" not in worker_environment(cfg, base={})
    with pytest.raises(ConfigError, match="matmul_precision"):
        validate(RunConfig(matmul_precision="tf32"))
    report = run(ref)
    assert report.ok, report.message
    assert report.env.get("JAX_DEFAULT_MATMUL_PRECISION") == "highest" and report.fp32_matmul_precision == "fp32"


def test_fused_attention_is_refused_in_fp32_and_on_the_cpu_backend():
    from migration.running.runner import start_run

    cudnn = {"attention": "cudnn"}
    with pytest.raises(ConfigError, match="attention: cudnn .* with precision fp32 use attention xla"):
        validate(RunConfig(workload="transformer", preset="tiny", model=cudnn, precision="fp32"))
    with pytest.raises(ConfigError, match="attention: cudnn .* needs an NVIDIA GPU"):
        validate(RunConfig(workload="transformer", preset="tiny", model=cudnn, precision="bf16", platform="cpu"))
    validate(RunConfig(workload="transformer", preset="tiny", model=cudnn, precision="bf16", platform="gpu"))
    # "auto" resolves to the CPU on a machine without a GPU: refused before a worker starts
    from migration.running.worker_env import resolve_platform
    if resolve_platform("auto") == "cpu":
        with pytest.raises(ConfigError, match="needs an NVIDIA GPU"):
            start_run(RunConfig(workload="transformer", preset="tiny", model=cudnn, precision="bf16"))
