"""The step time predicted from the compiled program: the HLO reader (kernels, FLOPs, bytes, loops,
collectives) on a written program and on real deviceless GPU compiles, the roofline and overlap of
the time model, and the planner's use of both; the analytic model's corrections (recompute factors,
FSDP transfers) and the budget of a shared local GPU."""

import dataclasses
import math
import re

import pytest

from migration.hardware import GPU_SPECS, link_bandwidth
from migration.planning import steptime
from migration.planning.hlo_cost import Kernel, pack, read_program, unpack
from migration.planning.search import RECOMPUTES, Communication, recompute_factors

H100 = GPU_SPECS["h100-sxm"]

PROGRAM = """\
HloModule step

%body_fusion_computation (p0: bf16[64,128,256], p1: s32[]) -> bf16[128,256] {
  %p0 = bf16[64,128,256]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c = s32[] constant(0)
  ROOT %ds = bf16[1,128,256]{2,1,0} dynamic-slice(%p0, %p1, %c, %c), dynamic_slice_sizes={1,128,256}
}

%gemm_computation (a: bf16[512,256], b: bf16[256,1024]) -> bf16[512,1024] {
  %a = bf16[512,256]{1,0} parameter(0)
  %b = bf16[256,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[512,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%body (state: (s32[], bf16[64,128,256], bf16[512,256])) -> (s32[], bf16[64,128,256], bf16[512,256]) {
  %state = (s32[], bf16[64,128,256]{2,1,0}, bf16[512,256]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %stack = bf16[64,128,256]{2,1,0} get-tuple-element(%state), index=1
  %x = bf16[512,256]{1,0} get-tuple-element(%state), index=2
  %layer = bf16[128,256]{2,1,0} fusion(%stack, %i), kind=kLoop, calls=%body_fusion_computation
  %w = bf16[256,1024]{1,0} bitcast(%layer)
  %y = bf16[512,1024]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm_computation
  %ag = (bf16[16,256]{1,0}, bf16[128,256]{1,0}) all-gather-start(%x), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}
  %agd = bf16[128,256]{1,0} all-gather-done(%ag)
  ROOT %out = (s32[], bf16[64,128,256]{2,1,0}, bf16[512,256]{1,0}) tuple(%i, %stack, %x)
}

%cond (state: (s32[], bf16[64,128,256], bf16[512,256])) -> pred[] {
  %state = (s32[], bf16[64,128,256]{2,1,0}, bf16[512,256]{1,0}) parameter(0)
  ROOT %t = pred[] constant(true)
}

ENTRY %main (stack: bf16[64,128,256], x: bf16[512,256]) -> bf16[512,256] {
  %stack = bf16[64,128,256]{2,1,0} parameter(0)
  %x = bf16[512,256]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,128,256]{2,1,0}, bf16[512,256]{1,0}) tuple(%zero, %stack, %x)
  %loop = (s32[], bf16[64,128,256]{2,1,0}, bf16[512,256]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"64"}}
  %ar = f32[1000]{0} all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %r = bf16[512,256]{1,0} get-tuple-element(%loop), index=2
}
"""


def test_the_reader_counts_loop_trips_slices_and_collectives():
    kernels = {k.name: k for k in read_program(PROGRAM)}
    gemm = kernels["y"]
    # 64 trips of a 512 x 256 x 1024 product
    assert gemm.kind == "matmul" and gemm.unit == "bf16" and gemm.count == 64
    assert gemm.flops == 64 * 2 * 512 * 1024 * 256
    assert gemm.bytes == 64 * 2 * (512 * 256 + 256 * 1024 + 512 * 1024)
    # the layer slice reads one layer of the stack (128 x 256), not the 64-layer stack
    assert kernels["layer"].bytes == 64 * (2 * 128 * 256 + 4 + 2 * 128 * 256)  # slice read, index, slice written
    gather = kernels["ag"]
    assert (gather.kind, gather.group, gather.asynchronous, gather.count) == ("all-gather", 8, True, 64)
    assert gather.bytes == 64 * 2 * 128 * 256  # the gathered result
    reduce = kernels["ar"]
    assert (reduce.kind, reduce.group, reduce.asynchronous, reduce.count) == ("all-reduce", 4, False, 1)
    assert set(kernels) == {"layer", "y", "ag", "ar"}  # tuples, bitcasts, constants, the done halves are free


def test_packing_keeps_every_figure():
    kernels = read_program(PROGRAM)
    again = unpack(pack(kernels))
    for field in ("flops", "bytes", "count"):
        assert sum(getattr(k, field) for k in again) == pytest.approx(sum(getattr(k, field) for k in kernels))


def test_the_roofline_takes_the_longer_of_compute_and_memory_and_overlap_hides_async_collectives():
    cal = steptime.Calibration(matmul=0.5, attention=0.5, memory=0.5, launch_s=1e-6, link=0.5, collective_s=1e-5)
    peak, bandwidth = H100.peak_flops("bf16"), H100.bandwidth_bytes_per_s
    dense = Kernel("dense", "matmul", flops=peak * 0.5 * 0.010, bytes=1e6, unit="bf16", count=1)  # 10 ms of compute
    stream = Kernel("stream", "memory", flops=0.0, bytes=bandwidth * 0.5 * 0.004, unit=None, count=1)  # 4 ms of bytes
    hidden = Kernel("ag", "all-gather", 0.0, bytes=450e9 * 0.5 * 0.008, unit=None, count=1, group=2, asynchronous=True)
    p = steptime.predict([dense, stream, hidden], H100, 450e9, cal)
    assert p.compute_s == pytest.approx(0.014 + 2e-6)
    assert p.communication_s == pytest.approx(0.004 + 1e-5)  # (n-1)/n = 1/2 of 8 ms
    assert p.exposed_communication_s == 0 and p.seconds == pytest.approx(p.compute_s)
    exposed = dataclasses.replace(hidden, asynchronous=False)
    q = steptime.predict([dense, stream, exposed], H100, 450e9, cal)
    assert q.seconds == pytest.approx(q.compute_s + q.communication_s)
    across = dataclasses.replace(hidden, bytes=hidden.bytes * 100)
    r = steptime.predict([dense, stream, across], H100, 450e9, cal)
    assert r.seconds == pytest.approx(r.communication_s)  # longer than the compute: the step waits for it


def test_collectives_across_nodes_move_at_the_rings_over_every_nic():
    one, _ = link_bandwidth("h100-sxm", 1)
    two, note = link_bandwidth("h100-sxm", 2, 8)
    assert one == 450e9 and two == 400e9 and "8 rings" in note  # 8 NICs x 50 GB/s, under NVLink's 450
    assert link_bandwidth("h100-sxm", 2, 2)[0] == 100e9


@pytest.fixture(scope="module")
def compiled_llama():
    """A deviceless compile of the tiny Llama (GQA, SwiGLU, cuDNN attention) for 8 H100s, FSDP."""
    import subprocess
    import sys

    code = """
import json, os
from jax.experimental import topologies
from migration.hardware import GPU_SPECS, gpu_target_config
from migration.config.requests import RunConfig
from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_data_mesh
topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(GPU_SPECS["h100-sxm"]), topology="1x1x8")
mesh = make_data_mesh(topo.devices)
cfg = RunConfig(workload="llama", preset="tiny", per_device_batch=4, devices=8, precision="bf16", sharding="fsdp",
                remat="none", model={"attention": "cudnn", "n_layers": 3})
p = TrainProgram.from_config(cfg)
print(jit_step(p, mesh).lower(abstract_state(p, mesh), abstract_batch(p, mesh)).compile().as_text())
"""
    import os
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK": "1",
           "XLA_FLAGS": "--xla_disable_hlo_passes=rematerialization"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    if proc.returncode != 0 and "topolog" in proc.stderr.lower():
        pytest.skip("no deviceless GPU compile here (CUDA plugin missing)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_a_real_gpu_program_has_the_models_flops_and_its_fsdp_collectives(compiled_llama):
    from workloads import get_workload

    kernels = read_program(compiled_llama)
    w = get_workload("llama")
    cfg = w.config("tiny", {"attention": "cudnn", "n_layers": 3})
    # per device: 4 examples; cuDNN skips the masked half of causal attention, the formula counts it all
    t, d = cfg.seq_len, cfg.d_model
    expected = (w.flops_per_example(cfg) - 0.5 * 12 * cfg.n_layers * d * t * t) * 4
    matmul = sum(k.flops for k in kernels)
    assert matmul == pytest.approx(expected, rel=0.05)
    assert sum(k.count for k in kernels if k.kind == "attention") == 2 * 3  # forward and backward per layer
    kinds = {k.kind for k in kernels if k.group == 8}
    assert {"all-gather", "reduce-scatter"} <= kinds
    p = steptime.predict(kernels, H100, 450e9)
    assert 0 < p.seconds < 0.01 and p.kernels > 10


def test_recompute_factors_charge_what_each_policy_recomputes():
    parts = {"qkv": 3.0, "attention": 2.0, "attention_proj": 1.0, "mlp": 4.0}
    step = 3 * sum(parts.values())
    plain = recompute_factors(parts, step)
    fused = recompute_factors(parts, step, fused_attention=True)
    # fused attention's backward needs the forward's statistics: every policy but none re-runs it
    for name in ("dots", "save_dot_except_mlp", "full"):
        extra = 0 if name == "full" else parts["attention"] / step
        assert fused[name] == pytest.approx(plain[name] + extra), name
    assert fused["none"] == plain["none"] == 1.0
    # full recomputes the block and its elementwise work: never cheaper than save_qkv
    assert plain["full"] == pytest.approx(1 + sum(parts.values()) / step + 0.05)
    assert plain["save_qkv"] <= plain["full"] and fused["save_qkv"] <= fused["full"]
    conv = recompute_factors({"block": 1.0}, 3.0, convolutional=True)
    assert conv["dots"] == conv["dots_no_batch"] == conv["full"] == pytest.approx(1 + 1 / 3 + 0.05)
    assert set(plain) == set(RECOMPUTES)


def test_fsdp_gathers_twice_when_remat_none_keeps_the_gathered_weights():
    comm = Communication(param_count=1_000_000, devices=8, compute_bytes=2, link_bytes_per_s=1e9)
    share = 7 / 8
    assert comm.bytes_per_micro_batch("fsdp", "none") == pytest.approx(2 * share * 2e6)
    assert comm.bytes_per_micro_batch("fsdp", "full") == pytest.approx(3 * share * 2e6)
    assert comm.bytes_per_micro_batch("replicated", "none") == pytest.approx(2 * share * 4e6)


def test_the_estimate_counts_fsdps_gathered_weights():
    from migration.config.requests import PlanRequest
    from migration.planning.memory import MemoryPredictor

    req = PlanRequest(workload="llama", preset="8b", target="h100-sxm", gpus=8, global_batch=64)
    predictor = MemoryPredictor(req, lambda *a, **k: None, estimate_because="this test")
    none = predictor.gathered_weights("bf16", "none", "fsdp")
    assert 13e9 < none < 17e9  # every block's bf16 copy: about 14 GB for 8B
    assert predictor.gathered_weights("bf16", "full", "fsdp") < none / 8
    assert predictor.gathered_weights("bf16", "none", "replicated") == 0
    from workloads import get_workload

    params = get_workload("llama").param_count(predictor._model_cfg())
    # sharded state (16 bytes per parameter over 8 GPUs) plus the gathered copies, plus activations
    assert predictor.estimate("bf16", "none", 1, 1, "fsdp") > 16 * params / 8 + none


def test_a_shared_gpus_budget_is_capped_by_its_free_memory():
    from migration.planning.memory import free_share

    gpus = [{"index": 0, "free_bytes": 30 * 2**30, "used_bytes": 50 * 2**30, "used_by_other_processes_bytes": 49 * 2**30},
            {"index": 1, "free_bytes": 79 * 2**30, "used_bytes": 1 * 2**30, "used_by_other_processes_bytes": 0}]
    share, note = free_share(64 * 2**30, "bytes_limit 64 GiB", gpus, 0)
    assert share == 30 * 2**30 and "capped at the 30.00 GiB NVML reports free on GPU 0" in note
    assert free_share(64 * 2**30, "x", gpus, 1) == (64 * 2**30, "x; 79.00 GiB free on GPU 1 (NVML)")
    share, note = free_share(64 * 2**30, "x", [], 0)
    assert share == 64 * 2**30 and "not known" in note


def test_a_plan_for_a_catalog_gpu_times_its_chosen_step_from_the_compiled_program():
    from migration.common import fmt_seconds
    from migration.config.requests import PlanRequest
    from migration.planning.planner import plan_migration

    plan = plan_migration(PlanRequest(workload="transformer", preset="tiny", target="a100-40gb", global_batch=64,
                                      compile_for_tpu=False), lambda *a, **k: None)
    assert plan.ok and plan.prediction_method == "compiled-for-target"
    step = plan.step_time
    assert step["source"] == "compiled program" and plan.predicted_step_s == step["seconds"] > 0
    assert "from the compiled program" in step["method"] and "expected error about" in step["method"]
    assert step["kernels"] > 0 and step["compiled_flops"] > 0 and step["analytic_s"] > 0
    assert {d.decision: d.value for d in plan.decisions}["step_time"] == pytest.approx(step["seconds"], rel=1e-3)
    assert math.isfinite(step["seconds"])
    assert plan.step_label() == f"{fmt_seconds(step['seconds'])} (compiled program, expected error ±25%)"
    assert re.fullmatch(r"[0-9.]+ (µs|ms|s) \(compiled program, expected error ±25%\)", plan.step_label())


def test_a_model_given_by_its_dimensions_is_not_named_as_its_preset():
    from migration.common import model_name

    assert model_name("llama", "8b", {}) == "llama/8b"
    assert model_name("llama", "8b", {"attention": "cudnn"}) == "llama/8b (attention=cudnn)"  # the planner's choice
    custom = model_name("llama", "8b", {"n_layers": 80, "d_model": 8192, "attention": "cudnn"})
    assert custom == "llama custom (attention=cudnn d_model=8192 n_layers=80; from 8b)"
    assert "llama/8b" not in custom


SCATTER_PROGRAM = """\
HloModule decode

%scatter_fusion (p0: bf16[16,8,1280,8,64], p1: s32[8,1,3], p2: bf16[8,1,8,64]) -> bf16[16,8,1280,8,64] {
  %p0 = bf16[16,8,1280,8,64]{4,3,2,1,0} parameter(0)
  %p1 = s32[8,1,3]{2,1,0} parameter(1)
  %p2 = bf16[8,1,8,64]{3,2,1,0} parameter(2)
  ROOT %s = bf16[16,8,1280,8,64]{4,3,2,1,0} scatter(%p0, %p1, %p2), update_window_dims={2,3}, inserted_window_dims={0,1,2}, scatter_dims_to_operand_dims={0,1,2}, index_vector_dim=2, to_apply=%assign
}

%zeros_scatter (p0: s32[8,1,1], p1: f32[8,1,64]) -> f32[1000,64] {
  %p0 = s32[8,1,1]{2,1,0} parameter(0)
  %p1 = f32[8,1,64]{2,1,0} parameter(1)
  %z = f32[] constant(0)
  %b = f32[1000,64]{1,0} broadcast(%z), dimensions={}
  ROOT %s = f32[1000,64]{1,0} scatter(%b, %p0, %p1), update_window_dims={2}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=2, to_apply=%add
}

ENTRY %main (cache: bf16[16,8,1280,8,64], idx: s32[8,1,3], new: bf16[8,1,8,64], ids: s32[8,1,1], g: f32[8,1,64]) -> bf16[16,8,1280,8,64] {
  %cache = bf16[16,8,1280,8,64]{4,3,2,1,0} parameter(0)
  %idx = s32[8,1,3]{2,1,0} parameter(1)
  %new = bf16[8,1,8,64]{3,2,1,0} parameter(2)
  %ids = s32[8,1,1]{2,1,0} parameter(3)
  %g = f32[8,1,64]{2,1,0} parameter(4)
  %update = bf16[16,8,1280,8,64]{4,3,2,1,0} fusion(%cache, %idx, %new), kind=kLoop, calls=%scatter_fusion
  %grad = f32[1000,64]{1,0} fusion(%ids, %g), kind=kLoop, calls=%zeros_scatter
  ROOT %r = bf16[16,8,1280,8,64]{4,3,2,1,0} copy(%update)
}
"""


def test_a_scatter_into_a_buffer_from_outside_costs_its_updates_and_one_made_inside_costs_it_whole():
    kernels = {k.name: k for k in read_program(SCATTER_PROGRAM)}
    # a decode step writing one token's keys into the KV cache: the indices and the update, not the cache
    assert kernels["update"].bytes == 8 * 3 * 4 + 2 * (8 * 8 * 64) * 2
    # an embedding gradient scattered into zeros made in the fusion: the whole table is written
    assert kernels["grad"].bytes == 8 * 4 + 8 * 64 * 4 + 1000 * 64 * 4


_TPU_TEXTS: dict = {}


def _tpu_program(fn, *shapes) -> str:
    """`fn` compiled for one chip of a TPU v5p slice without the chip (libtpu), as optimized HLO text. Kept
    per (code, captured values, shapes): bench/mutation.py forks a process per mutant after one run of the
    tests in the parent, and a fork cannot compile (XLA's threads are not copied; the compile waits for
    ever), so the mutants read the parent's texts."""
    try:
        key = (fn.__code__, tuple(c.cell_contents for c in fn.__closure__ or ()), shapes)
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _TPU_TEXTS:
        return _TPU_TEXTS[key]
    text = _compile_for_tpu(fn, *shapes)
    if key is not None:
        _TPU_TEXTS[key] = text
    return text


def _compile_for_tpu(fn, *shapes) -> str:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from migration.hardware import TPU_SPECS
    from migration.planning.source import tpu_topology

    mesh = Mesh(np.array(tpu_topology(TPU_SPECS["tpu-v5p-8"]).devices[:1]), ("x",))
    args = [jax.ShapeDtypeStruct(s, "bfloat16", sharding=NamedSharding(mesh, PartitionSpec())) for s in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


def test_a_tpu_programs_loops_run_as_often_as_their_condition_says():
    import jax
    import jax.numpy as jnp

    def ten_products(x, w):
        return jax.lax.fori_loop(0, 10, lambda i, x: jnp.tanh(x @ w), x)

    text = _tpu_program(ten_products, (512, 512), (512, 512))
    assert "known_trip_count" not in text  # the TPU compiler does not write it: the condition says it
    flops = sum(k.flops for k in read_program(text))
    assert flops == pytest.approx(10 * 2 * 512**3, rel=0.01)


@pytest.mark.parametrize("case", ["batched", "conv"])
def test_a_tpu_programs_convolutions_count_the_products_they_are(case):
    """The TPU compiler writes batched products as convolutions whose batch dimension is a window over
    padding; a real 2D convolution with SAME padding has fewer taps at its borders. Both counted exactly."""
    import jax

    if case == "batched":
        b, i, j, k = 16, 256, 128, 512
        text = _tpu_program(lambda x, y: jax.numpy.einsum("bij,bjk->bik", x, y), (b, i, j), (b, j, k))
        expected = 2 * b * i * j * k
    else:
        n, h, w, cin, cout, kh = 8, 32, 32, 64, 128, 3
        text = _tpu_program(lambda x, f: jax.lax.conv_general_dilated(
            x, f, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), (n, h, w, cin), (kh, kh, cin, cout))
        taps_per_dim = sum(sum(1 for t in range(kh) if 0 <= o + t - 1 < h) for o in range(h))  # SAME pads 1 each side
        expected = 2 * n * cout * cin * taps_per_dim**2
        assert taps_per_dim < h * kh
    assert sum(k.flops for k in read_program(text)) == pytest.approx(expected, rel=0.01)


TPU_PROGRAM = """\
HloModule step

%negate (p: bf16[4000,1024]) -> bf16[4000,1024] {
  %p = bf16[4000,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  ROOT %n = bf16[4000,1024]{1,0:T(8,128)(2,1)} negate(%p)
}

ENTRY %main (a: bf16[4000,1024], stack: bf16[8,4000,1024], u: bf16[1,4000,1024]) -> bf16[4000,1024] {
  %a = bf16[4000,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %stack = bf16[8,4000,1024]{2,1,0:T(8,128)(2,1)S(5)} parameter(1)
  %u = bf16[1,4000,1024]{2,1,0:T(8,128)(2,1)} parameter(2)
  %i = s32[] constant(0)
  %cs = (bf16[4000,1024]{1,0:T(8,128)(2,1)}, bf16[4000,1024]{1,0:T(8,128)(2,1)S(1)}, u32[]{:S(2)}) copy-start(%a)
  %cd = bf16[4000,1024]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  %f = bf16[4000,1024]{1,0:T(8,128)(2,1)} fusion(%cd), kind=kLoop, calls=%negate
  %ds = ((bf16[8,4000,1024]{2,1,0:T(8,128)(2,1)S(5)}, bf16[1,4000,1024]{2,1,0:T(8,128)(2,1)}, s32[], s32[], s32[]), bf16[8,4000,1024]{2,1,0:T(8,128)(2,1)S(5)}, u32[]{:S(2)}) dynamic-update-slice-start(%stack, %u, %i, %i, %i)
  %dd = bf16[8,4000,1024]{2,1,0:T(8,128)(2,1)S(5)} dynamic-update-slice-done(%ds)
  ROOT %r = bf16[4000,1024]{1,0:T(8,128)(2,1)} copy(%f)
}
"""


def test_a_tpu_programs_bytes_leave_out_vector_memory_and_move_offloaded_layers_once():
    """On a TPU, an operand prefetched into the core's vector memory (S(1)) is read from HBM once, by the
    copy that brings it; the kernel reading it there costs no HBM traffic. An activation offloaded to the
    host (an asynchronous dynamic-update-slice into an S(5) stack) moves its own bytes, not the stack's."""
    layer = 4000 * 1024 * 2
    kernels = {k.name: k for k in read_program(TPU_PROGRAM)}
    assert kernels["cs"].bytes == layer  # HBM -> VMEM, once
    assert kernels["f"].bytes == layer  # reads VMEM (free), writes HBM
    assert kernels["ds"].bytes == 2 * layer  # the update read and written, not the 8-layer stack


SPARSECORE_PROGRAM = """\
HloModule step

%called_computation.1 (param_0: bf16[1,1024,64], param_1: token[]) -> bf16[1,1024,1024] {
  %param_1 = token[] parameter(1)
  %param_0 = bf16[1,1024,64]{1,2,0:T(16,128)(2,1)} parameter(0)
  ROOT %all-gather.1 = bf16[1,1024,1024]{1,2,0:T(16,128)(2,1)} all-gather(%param_0), channel_id=1, replica_groups=mesh['axis_0'=1,'axis_1'=16] {'axis_1'}, dimensions={2}, use_global_device_ids=true
}, execution_thread="sparsecore"

ENTRY %main (w: bf16[1,1024,64]) -> bf16[1,1024,1024] {
  %w = bf16[1,1024,64]{1,2,0:T(16,128)(2,1)} parameter(0)
  %prep = s32[]{:S(2)} custom-call(), custom_call_target="PrepareAsyncCallStart"
  %prepd = token[] custom-call(%prep), custom_call_target="PrepareAsyncCallDone"
  %ag.call-start = ((bf16[1,1024,64]{1,2,0:T(16,128)(2,1)}, token[]), bf16[1,1024,1024]{1,2,0:T(16,128)(2,1)}) call-start(%w, %prepd), async_execution_thread="sparsecore", to_apply=%called_computation.1
  ROOT %ag.call-done = bf16[1,1024,1024]{1,2,0:T(16,128)(2,1)} call-done(%ag.call-start)
}
"""


def test_collectives_a_tpu7x_program_offloads_to_its_sparsecore_are_timed_and_overlap():
    """TPU7x runs FSDP's gathers on its SparseCore: a `call-start` on the "sparsecore" thread whose computation
    is the collective. The reader counts it (the gathered bytes, its 16-device group) as asynchronous."""
    gathers = [k for k in read_program(SPARSECORE_PROGRAM, "bf16") if k.kind == "all-gather"]
    assert len(gathers) == 1
    assert gathers[0].bytes == 1024 * 1024 * 2 and gathers[0].group == 16 and gathers[0].asynchronous
