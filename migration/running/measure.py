"""One measured training run, inside a worker process whose JAX environment is already set.

Emits events through `emit(kind, **fields)`: started, compiled, step (one per step), finished.
Failures raise; the worker turns them into a `failed` event. The step timed is `cfg.step_style`'s:
the migrated jit step, or the TPU-era pmap step (the "before"; see migration/step/train.py), each with
its own state and batch placement, and every figure below taken the same way for both.
How figures are taken:

- compile: `step.lower(state, batch).compile()` (jit or pmap), timed on its own; the same
  executable then serves the calls (JAX's compile cache), and `memory_analysis()` of it is the
  predicted peak.
- step time: steps are dispatched one ahead; a step's time is the interval between the
  completions of consecutive steps (`block_until_ready` on its metrics), so the device never
  waits for the host and no host sync sits between two dispatches. Warm-up steps are excluded;
  median and p90 over the rest. Throughput is total examples over total time of the timed steps.
- recompilations: XLA backend compiles seen by `jax.monitoring` after the first step (must be 0).
- memory: GPU: `memory_stats()["peak_bytes_in_use"]`, max over devices. CPU: the compiled memory
  analysis (arguments + outputs - aliased + temporaries) and the process's peak RSS, labelled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
import optax

from migration.running import checkpoint
from migration.common import ConfigError, fmt_gib
from migration.config.requests import RunConfig
from migration.hardware import (
    MATMUL_UNITS,
    compute_capability,
    cpu_peak_flops,
    fp32_matmul_precision,
    gpu_spec_for_device_kind,
    matmul_unit,
)
from migration.running.profiling import summarise_trace
from migration.planning.compiled import compiled_peak_bytes
from migration.planning.hlo_cost import read_program
from migration.step.train import StepParts, TrainProgram, replicate_per_device, step_parts
from migration.running.worker_env import jax_env_in_effect

Emit = Callable[..., None]

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
# what a mixture-of-experts model's step reports of its router (workloads/moe.py `loss_and_metrics`)
ROUTER_METRICS = ("router_dropped", "router_load", "router_device_load")
DATA_POOL_BYTES = 64 * 2**20  # distinct batches kept on device, at most this many bytes


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def device_memory_stats(devices: list[Any]) -> tuple[int | None, int | None]:
    """(max peak_bytes_in_use, min bytes_limit) over devices; None where the backend has no stats."""
    peaks, limits = [], []
    for d in devices:
        stats = d.memory_stats() or {}
        if stats.get("peak_bytes_in_use") is not None:
            peaks.append(int(stats["peak_bytes_in_use"]))
        if stats.get("bytes_limit") is not None:
            limits.append(int(stats["bytes_limit"]))
    return (max(peaks) if peaks else None), (min(limits) if limits else None)


@contextlib.contextmanager
def stage(name: str):
    """Label any failure with the phase of the run it happened in (read by the worker)."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"stage: {name}")
        raise


def peak_flops_for(platform: str, device: Any, precision: str, fp32_matmul: str, devices: int) -> tuple[float | None, str]:
    """The dense peak the run's matrix products are measured against, and a label saying which
    unit it is (one table: hardware.MATMUL_UNITS), for all `devices` together."""
    if platform != "gpu":
        # XLA's CPU devices share the host's cores, so the host's peak is the peak of them all.
        peak, label = cpu_peak_flops(precision)
        return peak, label + ("; fp8 is emulated on the CPU (converted and computed as bf16): no fp8 units"
                              if precision in ("fp8", "mxfp8") else "")
    unit = matmul_unit(precision, fp32_matmul)
    spec = gpu_spec_for_device_kind(device.device_kind)
    if spec is None:
        return None, f"unknown GPU '{device.device_kind}': no catalog peak, MFU not computed"
    per_device = spec.peak_flops(unit)
    if per_device is None:
        return None, f"{spec.name} has no {unit} tensor cores: no peak for this precision, MFU not computed"
    return per_device * devices, f"datasheet dense peak of {spec.name} x {devices} for {MATMUL_UNITS[unit]}"


@dataclasses.dataclass
class _Timed:
    step_s: list[float]
    losses: list[float]
    skipped: int
    last_metrics: dict[str, Any]
    recompilations: int
    router: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # MoE: (dropped share, load)


def measured_run(cfg: RunConfig, emit: Emit) -> None:
    """The run's stages: where it runs, data, compile, the timed loop, profile, figures."""
    platform, devices = _devices(cfg)
    program = TrainProgram.from_config(cfg)
    fp32_matmul = _announce(cfg, emit, platform, devices, program)
    compiles = _count_compiles()
    parts = step_parts(program, devices, cfg.step_style)
    state, restored = _initial_state(cfg, emit, program, parts, platform)
    pool = _data_pool(cfg, parts, first=restored.get("restored_step", 0))
    step = parts.step
    with stage("compiling the train step"):
        t0 = time.perf_counter()
        compiled = step.lower(state, pool[0]).compile()
        compile_s = time.perf_counter() - t0
    predicted = compiled_peak_bytes(compiled)
    emit("compiled", compile_s=compile_s, predicted_peak_bytes=predicted, data_pool_batches=len(pool),
         data_pool_bytes=sum(x.nbytes for x in jax.tree.leaves(pool)), **_expert_products(program, compiled))
    state, timed = _timed_loop(cfg, emit, parts, state, pool, predicted, compiles)
    saved = _save_checkpoint(cfg, emit, program, state, platform, devices)
    profile = _profile(cfg, emit, step, state, pool)
    emit("finished", compile_s=compile_s, predicted_peak_bytes=predicted, profile=profile, **restored, **saved,
         **_figures(cfg, program, platform, devices, fp32_matmul, timed, predicted))


def _devices(cfg: RunConfig) -> tuple[str, list[Any]]:
    platform = jax.default_backend()
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    available = jax.devices()
    if jax.process_count() > 1 and len(available) != cfg.devices:
        # Every process of the job must hold devices of the mesh: it spans all of them.
        raise ConfigError(
            "devices",
            f"is the job's global device count: {cfg.devices} requested, but its {jax.process_count()} processes "
            f"have {len(available)} {platform} devices in all ({jax.local_device_count()} here); set devices to "
            f"{len(available)}, or make each process see {cfg.devices // jax.process_count()} (CUDA_VISIBLE_DEVICES)",
        )
    if len(available) < cfg.devices:
        raise ConfigError(
            "devices",
            f"{cfg.devices} requested but this machine's {platform} backend has {len(available)} "
            f"({available[0].device_kind}); allowed: 1 to {len(available)}",
        )
    return platform, available[: cfg.devices]


def _announce(cfg: RunConfig, emit: Emit, platform: str, devices: list[Any], program: TrainProgram) -> str:
    fp32_matmul = fp32_matmul_precision(platform, compute_capability(devices[0]), jax.config.jax_default_matmul_precision)
    emit(
        "started",
        backend=platform,
        device_kind=devices[0].device_kind,
        device_count=len(devices),
        process_index=jax.process_index(),  # of a multi-process job (migration/config/distributed.py); 0 of 1 otherwise
        process_count=jax.process_count(),
        jax_version=jax.__version__,
        jaxlib_version=jaxlib.__version__,
        flax_version=flax.__version__,
        optax_version=optax.__version__,
        python_version=sys.version.split()[0],
        param_count=program.workload.param_count(program.model_cfg),
        global_batch=program.global_batch,
        fp32_matmul_precision=fp32_matmul,
        env=jax_env_in_effect(),
    )
    return fp32_matmul


def _count_compiles() -> list[float]:
    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: compiles.append(secs) if name == BACKEND_COMPILE_EVENT else None
    )
    return compiles


def _initial_state(cfg: RunConfig, emit: Emit, program: TrainProgram, parts: StepParts,
                   platform: str) -> tuple[Any, dict[str, Any]]:
    """Fresh parameters, or the state in `cfg.restore_checkpoint` placed as this run holds it; with
    the report's fields saying what was restored (empty when nothing was)."""
    if not cfg.restore_checkpoint:
        with stage("initialising parameters"):
            return parts.init_state(), {}
    with stage(f"restoring the checkpoint {cfg.restore_checkpoint}"):
        state, meta = checkpoint.restore(cfg.restore_checkpoint, cfg, program, parts.mesh)
        if cfg.step_style == "pmap":  # the TPU-era "before" step takes a copy per device
            state = replicate_per_device(state, parts.mesh)
    onto = checkpoint.layout_text(cfg.devices, platform, cfg.sharding)
    emit("restored", path=cfg.restore_checkpoint, step=meta.step, from_layout=meta.layout, onto_layout=onto,
         from_precision=meta.precision, from_device_kind=meta.device_kind)
    return state, {"restored_step": meta.step,
                   "checkpoint_restored": (f"step {meta.step} from {cfg.restore_checkpoint} (saved on {meta.layout}, "
                                           f"{meta.precision}) onto {onto}")}


def _save_checkpoint(cfg: RunConfig, emit: Emit, program: TrainProgram, state: Any, platform: str,
                     devices: list[Any]) -> dict[str, Any]:
    """The state after the run's last step written to `cfg.save_checkpoint` (before any profiled
    steps); the report's fields saying what was saved (empty when nothing was)."""
    if not cfg.save_checkpoint:
        return {}
    with stage(f"saving the checkpoint {cfg.save_checkpoint}"):
        saved = checkpoint.save(cfg.save_checkpoint, state, cfg, program, platform, devices[0].device_kind)
    emit("saved", **saved)
    return {"checkpoint_saved": f"step {saved['step']} to {saved['path']} ({saved['layout']})",
            "checkpoint_saved_bytes": saved["bytes"]}


def _data_pool(cfg: RunConfig, parts: StepParts, first: int = 0) -> list[Any]:
    """Distinct batches kept on the device (at most DATA_POOL_BYTES), cycled through by the loop;
    global batch numbers from `first` (a restored run continues with the batches that follow)."""
    with stage("generating the synthetic data"):
        make = parts.make_batch
        head = make(first)
        batch_bytes = sum(x.nbytes for x in jax.tree.leaves(head))
        pool_size = max(1, min(cfg.steps, DATA_POOL_BYTES // max(batch_bytes, 1)))
        pool = [head] + [make(first + i) for i in range(1, pool_size)]
        jax.block_until_ready(pool)
    return pool


def _timed_loop(cfg: RunConfig, emit: Emit, parts: StepParts, state: Any, pool: list[Any], predicted: int | None,
                compiles: list[float]) -> tuple[Any, _Timed]:
    """Steps dispatched one ahead; each step's time is the interval between the completions of
    consecutive steps, read when its metrics arrive (the device never waits for the host)."""
    step = parts.step
    compiles_before = len(compiles)
    timed = _Timed([], [], 0, {}, 0)
    last_done = time.perf_counter()
    pending = None
    for i in range(cfg.steps + 1):
        if i < cfg.steps:
            with stage(f"running step {i + 1} (the compiled step needs {fmt_gib(predicted, missing='an unknown amount')} per device)"):
                state, metrics = step(state, pool[i % len(pool)])
        if pending is not None:  # complete step i-1 while step i runs
            with stage(f"running step {i} (the compiled step needs {fmt_gib(predicted, missing='an unknown amount')} per device)"):
                values = parts.host_metrics(jax.device_get(pending))
            done = time.perf_counter()
            timed.step_s.append(done - last_done)
            last_done = done
            _record_step(emit, timed, i - 1, values)
        pending = metrics if i < cfg.steps else None
    jax.block_until_ready(state)
    timed.recompilations = len(compiles) - compiles_before
    return state, timed


def _record_step(emit: Emit, timed: _Timed, index: int, values: dict[str, Any]) -> None:
    loss = float(values["loss"])
    skipped = bool(values.get("skipped", False))
    timed.losses.append(loss)
    timed.skipped += int(skipped)
    timed.last_metrics = values
    router = {}
    if "router_dropped" in values:  # a mixture-of-experts model: what its router did this step
        timed.router.append(tuple(float(values[k]) if k in values else None for k in ROUTER_METRICS))
        router = {k: v for k, v in zip(ROUTER_METRICS, timed.router[-1]) if v is not None}
    emit("step", index=index, loss=loss, step_ms=timed.step_s[-1] * 1e3, grad_norm=float(values["grad_norm"]),
         loss_scale=float(values["loss_scale"]), skipped=skipped, **router)


def _profile(cfg: RunConfig, emit: Emit, step: Any, state: Any, pool: list[Any]) -> dict[str, Any] | None:
    """Extra steps after the timed window under jax.profiler.trace, so tracing never perturbs the figures."""
    if not cfg.profile_steps:
        return None
    with stage("profiling"), jax.profiler.trace(cfg.profile_dir, create_perfetto_trace=True):
        for i in range(cfg.profile_steps):
            state, metrics = step(state, pool[(cfg.steps + i) % len(pool)])
            jax.block_until_ready(metrics)
    profile = summarise_trace(cfg.profile_dir, cfg.profile_steps)
    emit("profiled", profile=profile)
    return profile


def _figures(cfg: RunConfig, program: TrainProgram, platform: str, devices: list[Any], fp32_matmul: str,
             timed: _Timed, predicted: int | None) -> dict[str, Any]:
    """Throughput, MFU and memory from the timed window (warm-up excluded)."""
    window = timed.step_s[cfg.warmup_steps:]
    total = sum(window)
    workload, mcfg = program.workload, program.model_cfg
    samples_per_s = program.global_batch * len(window) / total
    tokens = workload.tokens_per_example(mcfg)
    flops_per_step = workload.flops_per_example(mcfg) * program.global_batch
    achieved = flops_per_step * len(window) / total
    peak, peak_source = peak_flops_for(platform, devices[0], cfg.precision, fp32_matmul, len(devices))
    measured_peak, bytes_limit = device_memory_stats([d for d in devices if d.process_index == jax.process_index()])
    if measured_peak is not None:
        peak_bytes, source = measured_peak, "measured: memory_stats() peak_bytes_in_use (max over devices)"
    else:
        peak_bytes = predicted
        source = "cpu: XLA memory_analysis of the compiled step (CPU backend figure, not a GPU prediction)"
    return dict(
        step_ms_median=statistics.median(window) * 1e3,
        step_ms_p90=percentile(window, 90) * 1e3,
        step_ms_mean=total / len(window) * 1e3,
        timed_steps=len(window),
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens if tokens else None,
        model_flops_per_step=flops_per_step,
        achieved_tflops=achieved / 1e12,
        peak_tflops=peak / 1e12 if peak else None,
        peak_tflops_source=peak_source,
        mfu=achieved / peak if peak else None,
        peak_memory_bytes=peak_bytes,
        peak_memory_source=source,
        process_peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux reports KiB
        device_memory_limit_bytes=bytes_limit,
        recompilations=timed.recompilations,
        skipped_steps=timed.skipped,
        final_loss_scale=float(timed.last_metrics["loss_scale"]) if cfg.precision == "fp16" else None,
        **_router_figures(timed.router[cfg.warmup_steps:]),
    )


def _expert_products(program: TrainProgram, compiled: Any) -> dict[str, Any]:
    """For a mixture-of-experts model: the matrix-product FLOPs of the compiled step per device, read from its
    program as the planner reads a target's (migration/planning/hlo_cost.py), beside the model's own FLOPs per
    device and step; a compiler that turns the experts into a loop of dense products over every row shows
    n_experts / top_k times the experts' FLOPs there."""
    workload, cfg = program.workload, program.model_cfg
    if not workload.routed_experts(cfg):
        return {}
    kernels = read_program(compiled.as_text())
    return {"compiled_matmul_flops": sum(k.flops for k in kernels if k.kind in ("matmul", "attention")),
            "model_flops_per_device_step": workload.flops_per_example(cfg) * program.per_device_batch
            * program.accumulation_steps}


def _router_figures(router: list[tuple[float | None, ...]]) -> dict[str, Any]:
    """A mixture-of-experts run's router over the timed steps: the mean and the largest share of token slots
    dropped past the experts' capacity, and the mean and largest load of the busiest expert and of the busiest
    device (under expert parallelism) over an even share (each step's figure the mean over the model's MoE
    layers)."""
    if not router:
        return {}
    out = {}
    for i, name in enumerate(ROUTER_METRICS):  # a workload's own step may report only some of them
        values = [r[i] for r in router if r[i] is not None]
        if values:
            out.update({f"{name}_mean": statistics.fmean(values), f"{name}_max": max(values)})
    return out
