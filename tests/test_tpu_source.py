"""The TPU side of a plan, compiled: libtpu (installed with the product) describes every catalog slice
without its chips, as many JAX devices as the catalog says, and one process compiles the same model
for a TPU slice and for a GPU target. Where libtpu cannot load, the plan says so in one line."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from migration.config.requests import PlanRequest, validate_plan_request
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
    # The TPU step, timed from the TPU program: never faster than its FLOPs at the chip's full peak.
    assert src["predicted_step_s"] > 0 and "from the compiled TPU program" in src["step_method"]
    flops = float(src["step_method"].split(" TFLOP per device")[0].rsplit(" ", 1)[1].replace(",", "")) * 1e12
    assert src["predicted_step_s"] >= flops / TPU_SPECS["tpu-v4-8"].peak_flops("bf16")


@pytest.mark.slow
def test_a_tpu_job_run_with_libtpus_all_gather_flag_has_its_weight_gathers_timed_as_all_gathers():
    """libtpu's default flags compile FSDP's weight gathers on TPU7x as all-reduces of each shard written into
    zeros; `--tpu-prefer-all-gather` (the job runs --xla_tpu_prefer_async_allgather_to_allreduce=true) times
    the same program's gathers as all-gathers, half the bytes, and the step says which it did."""
    base = dict(workload="llama", preset="tiny", model={"d_model": 512, "n_heads": 4, "n_kv_heads": 4, "d_ff": 2048},
                source="tpu7x-8", global_batch=64, target="h100-sxm", source_sharding="fsdp")
    default = compile_for_source_tpu(validate_plan_request(PlanRequest(**base)))
    flagged = compile_for_source_tpu(validate_plan_request(PlanRequest(**base, source_all_gathers=True)))
    assert default["status"] == flagged["status"] == "ok", (default, flagged)
    assert default["peak_bytes_per_chip"] == flagged["peak_bytes_per_chip"]  # one program, timed two ways
    gathered = re.search(r"; ([\d.,]+ [KMG]iB) a device a step of weight gathers compiled as all-reduces, timed as "
                         r"compiled", default["step_method"])
    assert gathered, default["step_method"]
    assert f"; {gathered.group(1)} a device a step of weight gathers compiled as all-reduces, timed as the " \
           "all-gathers --xla_tpu_prefer_async_allgather_to_allreduce=true compiles them to" in flagged["step_method"]
    assert flagged["predicted_step_s"] < default["predicted_step_s"]
    assert PlanRequest(**base).to_dict() == {k: v for k, v in PlanRequest(**base, source_all_gathers=True).to_dict()
                                             .items() if k != "source_all_gathers"}


def test_the_tpu_compiler_says_when_the_stated_setup_exceeds_the_chips_hbm():
    # Llama 3 8B dimensions, 64 per chip at 8,192 tokens on a v5e-4 (16 GB chips), no remat: far over; and its
    # float32 parameters and AdamW moments alone (24 GB a chip over 4) are over too, so no remat or smaller
    # batch is tried: the plan says a larger slice is the change.
    req = PlanRequest(workload="llama", preset="8b", source="tpu-v5e-4", global_batch=256, target="h100-sxm")
    src = compile_for_source_tpu(req)
    assert src["status"] == "does-not-fit", src
    assert src["hbm_bytes_per_device"] == TPU_SPECS["tpu-v5e-4"].hbm_bytes_per_device and src["reason"]
    assert "fitted" not in src and len(src["tried"]) == 1 and "a larger slice is the change" in src["tried"][0]


def test_without_libtpu_the_plan_says_the_tpu_compile_is_unavailable_and_why():
    code = ("import sys; sys.modules['libtpu'] = None; "  # as if libtpu were not installed
            "import json; from migration.config.requests import PlanRequest; "
            "from migration.planning.source import compile_for_source_tpu; "
            "print(json.dumps(compile_for_source_tpu(PlanRequest(workload='mlp', source='tpu-v5p-8'))))")
    # (JAX sets TPU_LIBRARY_PATH in a process that loaded libtpu, as this one has: not passed on)
    env = {**{k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["status"] == "unavailable"
    assert "libtpu" in out["reason"] and "requirements.txt" in out["reason"] and "\n" not in out["reason"]


def test_compiling_processes_keep_libtpus_log_off_the_disk_unless_the_caller_names_a_folder(tmp_path):
    """libtpu writes a log file to /tmp/tpu_logs each time a process loads it and never removes it; the
    compiling processes' environment turns that off, and a folder the caller names is honoured. Shown on
    libtpu itself: a process loading it with the variable set to a folder writes its log there."""
    from migration.running.worker_env import compile_environment

    env = compile_environment({"PATH": os.environ["PATH"]})
    assert env["TPU_LOG_DIR"] == "disabled"
    logs = tmp_path / "tpu-logs"
    env = {**compile_environment({**os.environ, "TPU_LOG_DIR": str(logs)}), "PYTHONPATH": str(ROOT)}
    env.pop("TPU_LIBRARY_PATH", None)
    code = ("from jax.experimental import topologies; "
            "print(len(topologies.get_topology_desc(topology_name='v5p:2x2x1', platform='tpu').devices))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "4", proc.stderr[-2000:]
    assert any(p.name.startswith("tpu_driver") for p in logs.iterdir())


def test_the_tpu_side_runs_splash_attention_and_the_reader_counts_its_products():
    """A model whose heads and sequence suit Pallas' splash kernel is compiled for the TPU with it (the TPU's
    fused attention, as MaxText runs it): three kernels (forward, dK/dV, dQ) whose FLOPs the program reader
    counts, and a peak below the same step with the scores materialised."""
    from migration.config.requests import RunConfig
    from migration.planning.hlo_cost import read_program
    from migration.planning.source import tpu_model
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    dims = {"n_layers": 2, "d_model": 256, "n_heads": 2, "n_kv_heads": 1, "d_ff": 512, "vocab_size": 1024,
            "seq_len": 512}
    req = PlanRequest(workload="llama", preset="tiny", model=dims, source="tpu-v5p-8", global_batch=8)
    assert tpu_model(req)["attention"] == "splash"
    assert tpu_model(PlanRequest(workload="llama", preset="tiny", model={**dims, "attention": "xla"},
                                 source="tpu-v5p-8"))["attention"] == "xla"
    topo = tpu_topology(TPU_SPECS["tpu-v5p-8"])
    peaks, attention_flops = {}, {}
    for attention in ("splash", "xla"):
        cfg = RunConfig(workload="llama", preset="tiny", model={**dims, "attention": attention}, per_device_batch=2,
                        devices=4, precision="bf16", remat="none", sharding="fsdp")
        program = TrainProgram.from_config(cfg)
        mesh = make_mesh(topo.devices, "fsdp")
        compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
        kernels = read_program(compiled.as_text())
        peaks[attention] = compiled.memory_analysis().temp_size_in_bytes
        attention_flops[attention] = sum(k.flops for k in kernels if k.kind == "attention")
    # 2 layers x (2 forward + 4 + 3 backward) products of 2 x B x H x T^2 x Dh, half of them masked.
    assert attention_flops["splash"] == pytest.approx(2 * 9 * 2 * 2 * 2 * 512**2 * 128 / 2)
    assert attention_flops["xla"] == 0 and peaks["splash"] < peaks["xla"]


def test_multi_head_latent_attention_on_the_tpu_side_runs_splash_with_its_values_padded():
    """DeepSeek's attention (queries and keys 128 + 64 wide, values 64 here) on a TPU slice: splash's kernels
    with the values padded to the queries' width, so the scores are never stored, where XLA's attention holds
    each layer's (B, H, T, T) scores in float32; its products counted as for any splash attention."""
    from migration.config.requests import RunConfig
    from migration.planning.hlo_cost import read_program
    from migration.planning.source import tpu_model
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    dims = {"n_layers": 2, "first_dense": 1, "d_model": 256, "n_heads": 4, "n_kv_heads": 4, "vocab_size": 1024,
            "seq_len": 512, "n_experts": 8, "top_k": 2, "expert_d_ff": 128, "d_ff": 512, "kv_lora_rank": 64,
            "q_lora_rank": 0, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 64}
    req = PlanRequest(workload="moe", preset="deepseek-v2-lite", model=dims, source="tpu-v5p-8", global_batch=8)
    assert tpu_model(req)["attention"] == "splash"
    topo = tpu_topology(TPU_SPECS["tpu-v5p-8"])
    peaks, attention_flops = {}, {}
    for attention in ("splash", "xla"):
        cfg = RunConfig(workload="moe", preset="deepseek-v2-lite", model={**dims, "attention": attention},
                        per_device_batch=2, devices=4, precision="bf16", remat="none", sharding="fsdp")
        program = TrainProgram.from_config(cfg)
        mesh = make_mesh(topo.devices, "fsdp")
        compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
        peaks[attention] = compiled.memory_analysis().temp_size_in_bytes
        attention_flops[attention] = sum(k.flops for k in read_program(compiled.as_text()) if k.kind == "attention")
    # 2 layers x 9 products of 2 x B x H x T^2 x Dh (Dh 192: the padded values too), half of them masked
    assert attention_flops["splash"] == pytest.approx(2 * 9 * 2 * 2 * 4 * 512**2 * 192 / 2)
    assert attention_flops["xla"] == 0 and peaks["splash"] < peaks["xla"]


def test_a_run_here_refuses_the_tpu_kernel_and_a_gpu_plan_takes_cudnns_for_it():
    from migration.common import ConfigError
    from migration.config.requests import RunConfig, validate
    from migration.planning.capability import planned_model
    from migration.planning.memory import resolve_target

    with pytest.raises(ConfigError, match="attention: splash .* runs on TPUs only"):
        validate(RunConfig(workload="llama", preset="tiny", model={"attention": "splash"}))
    req = PlanRequest(workload="llama", preset="tiny", model={"attention": "splash"}, target="h100-sxm")
    model, decision = planned_model(req, resolve_target(req), "bf16")
    assert model["attention"] == "cudnn" and "splash" in decision.reason


def test_a_multislice_job_compiles_over_its_slices_and_times_the_data_centre_network():
    """2 x v5p-16 against one v5p-32: the same 16 devices, the same per-core batch and replicated state; the
    gradient all-reduce that crosses the slices goes over the data-centre network (50 Gb/s per chip), so the
    two-slice job's collectives take longer; with FSDP the state is sharded inside each slice (hybrid)."""
    one = compile_for_source_tpu(PlanRequest(workload="transformer", preset="tiny", source="tpu-v5p-32",
                                             global_batch=64, source_sharding="replicated"))
    two = compile_for_source_tpu(PlanRequest(workload="transformer", preset="tiny", source="tpu-v5p-16",
                                             source_slices=2, global_batch=64, source_sharding="replicated"))
    assert one["status"] == two["status"] == "ok", (one, two)
    assert two["slices"] == 2 and "between the 2 slices, 50 Gb/s of data-centre network per chip" in two["step_method"]
    comm = [float(s["step_method"].split("collectives ")[1].split(" ")[0]) *
            {"µs": 1e-6, "ms": 1e-3, "s": 1.0}[s["step_method"].split("collectives ")[1].split(" ")[1]] for s in (one, two)]
    assert comm[1] > comm[0], comm
    fsdp = compile_for_source_tpu(PlanRequest(workload="transformer", preset="tiny", source="tpu-v5p-16",
                                              source_slices=2, global_batch=64, source_sharding="fsdp"))
    assert fsdp["status"] == "ok" and fsdp["layout"] == "hybrid:8"
