"""One measured training run, inside a worker process whose JAX environment is already set.

Emits events through `emit(kind, **fields)`: started, compiled, step (one per step), finished.
Failures raise; the worker turns them into a `failed` event. How figures are taken:

- compile: `jit(step).lower(state, batch).compile()`, timed on its own; the same executable then
  serves the calls (JAX's compile cache), and `memory_analysis()` of it is the predicted peak.
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
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import flax
import jax
import numpy as np
import optax

from migration.config import ConfigError, RunConfig
from migration.hardware import cpu_peak_flops, gpu_spec_for_device_kind
from migration.profiling import summarise_trace
from migration.environment import jax_env_in_effect
from migration.train import TrainProgram, batch_maker, init_state_on, jit_step, make_data_mesh

Emit = Callable[..., None]

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
DATA_POOL_BYTES = 64 * 2**20  # distinct batches kept on device, at most this many bytes


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def fp32_matmul_precision(platform: str, device: Any) -> str:
    """How fp32 matrix products actually run here (XLA's default unless JAX is told otherwise)."""
    setting = jax.config.jax_default_matmul_precision
    if setting in ("highest", "float32"):
        return "fp32"
    if platform == "gpu":
        cc = getattr(device, "compute_capability", "0.0")
        major = int(str(cc).split(".")[0] or 0)
        if setting in ("bfloat16", "default", "fastest"):
            return "bf16" if setting != "default" or major >= 8 else "fp32"
        return "tf32" if major >= 8 else "fp32"
    return "fp32"  # the CPU backend computes fp32 products in fp32


def compiled_peak_bytes(compiled: Any) -> int | None:
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
               - stats.alias_size_in_bytes + stats.temp_size_in_bytes)


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


def measured_run(cfg: RunConfig, emit: Emit) -> None:
    platform = jax.default_backend()
    platform = "gpu" if platform in ("gpu", "cuda", "rocm") else platform
    available = jax.devices()
    if len(available) < cfg.devices:
        raise ConfigError(
            "devices",
            f"{cfg.devices} requested but this machine's {platform} backend has {len(available)} "
            f"({available[0].device_kind}); allowed: 1 to {len(available)}",
        )
    devices = available[: cfg.devices]
    kind = devices[0].device_kind
    program = TrainProgram.from_config(cfg)
    workload, mcfg = program.workload, program.model_cfg
    matmul = fp32_matmul_precision(platform, devices[0])
    emit(
        "started",
        backend=platform,
        device_kind=kind,
        device_count=len(devices),
        jax_version=jax.__version__,
        jaxlib_version=getattr(jax.lib, "__version__", None) or _jaxlib_version(),
        flax_version=flax.__version__,
        optax_version=optax.__version__,
        python_version=sys.version.split()[0],
        param_count=workload.param_count(mcfg),
        global_batch=program.global_batch,
        fp32_matmul_precision=matmul,
        env=jax_env_in_effect(),
    )

    compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda name, secs, **_: compiles.append(secs) if name == BACKEND_COMPILE_EVENT else None
    )

    mesh = make_data_mesh(devices)
    with stage("initialising parameters"):
        state = init_state_on(program, mesh)
    with stage("generating the synthetic data"):
        make = batch_maker(program, mesh)
        first = make(0)
        batch_bytes = sum(x.nbytes for x in jax.tree.leaves(first))
        pool_size = max(1, min(cfg.steps, DATA_POOL_BYTES // max(batch_bytes, 1)))
        pool = [first] + [make(i) for i in range(1, pool_size)]
        jax.block_until_ready(pool)

    step = jit_step(program, mesh)
    with stage("compiling the train step"):
        t0 = time.perf_counter()
        compiled = step.lower(state, pool[0]).compile()
        compile_s = time.perf_counter() - t0
    predicted = compiled_peak_bytes(compiled)
    emit("compiled", compile_s=compile_s, predicted_peak_bytes=predicted,
         data_pool_batches=pool_size, data_pool_bytes=batch_bytes * pool_size)

    compiles_before = len(compiles)
    step_s: list[float] = []
    losses: list[float] = []
    skipped = 0
    last_done = time.perf_counter()
    pending = None
    for i in range(cfg.steps + 1):
        if i < cfg.steps:
            with stage(f"running step {i + 1} (the compiled step needs {_gib(predicted)} per device)"):
                state, metrics = step(state, pool[i % pool_size])
        if pending is not None:  # complete step i-1 while step i runs
            with stage(f"running step {i} (the compiled step needs {_gib(predicted)} per device)"):
                values = jax.device_get(pending)
            done = time.perf_counter()
            step_s.append(done - last_done)
            last_done = done
            loss = float(values["loss"])
            losses.append(loss)
            skipped += int(bool(values.get("skipped", False)))
            emit("step", index=i - 1, loss=loss, step_ms=step_s[-1] * 1e3,
                 grad_norm=float(values["grad_norm"]), loss_scale=float(values["loss_scale"]),
                 skipped=bool(values.get("skipped", False)))
        pending = metrics if i < cfg.steps else None
    jax.block_until_ready(state)
    recompilations = len(compiles) - compiles_before

    profile = None
    if cfg.profile_steps:
        # Extra steps after the timed window, so tracing never perturbs the figures above.
        with stage("profiling"), jax.profiler.trace(cfg.profile_dir, create_perfetto_trace=True):
            for i in range(cfg.profile_steps):
                state, metrics = step(state, pool[(cfg.steps + i) % pool_size])
                jax.block_until_ready(metrics)
        profile = summarise_trace(cfg.profile_dir, cfg.profile_steps)
        emit("profiled", profile=profile)

    timed = step_s[cfg.warmup_steps:]
    total = sum(timed)
    samples_per_s = program.global_batch * len(timed) / total
    tokens = workload.tokens_per_example(mcfg)
    flops_per_step = workload.flops_per_example(mcfg) * program.global_batch
    achieved = flops_per_step * len(timed) / total

    if platform == "gpu":
        spec = gpu_spec_for_device_kind(kind)
        per_device = spec.peak_flops(cfg.precision, matmul) if spec else None
        peak = per_device * len(devices) if per_device else None
        peak_source = f"datasheet dense {cfg.precision if cfg.precision != 'fp32' else matmul} peak of {spec.name} x {len(devices)}" if spec else f"unknown GPU '{kind}': no datasheet peak"
    else:
        # XLA's CPU devices share the host's cores, so the host's peak is the peak of them all.
        peak, peak_source = cpu_peak_flops(cfg.precision)
    measured_peak, bytes_limit = device_memory_stats(devices)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    if measured_peak is not None:
        peak_bytes, source = measured_peak, "measured: memory_stats() peak_bytes_in_use (max over devices)"
    else:
        peak_bytes = predicted
        source = "cpu: XLA memory_analysis of the compiled step (CPU backend figure, not a GPU prediction)"

    emit(
        "finished",
        compile_s=compile_s,
        step_ms_median=statistics.median(timed) * 1e3,
        step_ms_p90=percentile(timed, 90) * 1e3,
        step_ms_mean=total / len(timed) * 1e3,
        timed_steps=len(timed),
        samples_per_s=samples_per_s,
        tokens_per_s=samples_per_s * tokens if tokens else None,
        model_flops_per_step=flops_per_step,
        achieved_tflops=achieved / 1e12,
        peak_tflops=peak / 1e12 if peak else None,
        peak_tflops_source=peak_source,
        mfu=achieved / peak if peak else None,
        peak_memory_bytes=peak_bytes,
        peak_memory_source=source,
        predicted_peak_bytes=predicted,
        process_peak_rss_bytes=rss,
        device_memory_limit_bytes=bytes_limit,
        recompilations=recompilations,
        skipped_steps=skipped,
        final_loss_scale=float(values["loss_scale"]) if cfg.precision == "fp16" else None,
        profile=profile,
    )


def _gib(n: int | None) -> str:
    return "an unknown amount" if n is None else f"{n / 2**30:.2f} GiB"


def _jaxlib_version() -> str | None:
    try:
        import jaxlib

        return jaxlib.__version__
    except (ImportError, AttributeError):
        return None
