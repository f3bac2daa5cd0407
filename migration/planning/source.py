"""The TPU job a plan starts from: how it held its state, how its unchanged setup fares on the target
GPU, and what the TPU compiler (libtpu, compiling for the slice without its chips) says of it on the
source TPU.
"""

from __future__ import annotations

import os
import time
from typing import Any

from jax.experimental import topologies

from migration.common import first_line, fmt_gib, fmt_seconds, is_oom
from migration.config.requests import PlanRequest, RunConfig
from migration.hardware import TPU_SPECS, Links, TpuSpec
from migration.planning import steptime
from migration.planning.compile_cache import CompileCache, cache_key, workload_fingerprint
from migration.planning.hlo_cost import unpack
from migration.planning.memory import STATE_BYTES_PER_PARAM, CompileFailed, MemoryPredictor, compile_memory
from migration.step.train import TrainProgram, make_multislice_mesh
from workloads import get_workload


def source_sharding(req: PlanRequest, params: int) -> str:
    """How the TPU job held its state: as given, else replicated (pmap) when 16 bytes per parameter
    fit 90% of a chip's HBM, else sharded over the slice."""
    hbm = TPU_SPECS[req.source].hbm_bytes_per_device
    return req.source_sharding or ("replicated" if STATE_BYTES_PER_PARAM * params <= 0.9 * hbm else "fsdp")


def tpu_setup_on_target(req: PlanRequest, predictor: MemoryPredictor, budget: int, sharding: str) -> dict[str, Any]:
    """How the unchanged TPU-style setup (per-core batch, source precision, no remat) fares on the
    target, with the plan's way of holding the state."""
    b = req.source_per_core_batch
    try:
        peak = predictor.predict(req.source_precision, "none", b, record=False, sharding=sharding)
    except CompileFailed as exc:  # e.g. bf16 matrix products on a GPU without them (before Ampere)
        return {"per_device_batch": b, "precision": req.source_precision, "remat": "none",
                "predicted_peak_bytes": None, "budget_bytes": budget, "fits": False,
                "summary": (f"the TPU-style setup ({b} per device, {req.source_precision}, no remat) does not compile "
                            f"for the target: {exc}")}
    fits = peak is not None and peak <= budget
    at_least = (sharding, "none", b, 1, req.source_precision) in predictor.bounded
    return {"per_device_batch": b, "precision": req.source_precision, "remat": "none",
            "predicted_peak_bytes": peak, "budget_bytes": budget, "fits": fits,
            "summary": (f"the TPU-style setup ({b} per device, {req.source_precision}, no remat) "
                        + (f"fits: {fmt_gib(peak)} of {fmt_gib(budget)}" if fits else
                           f"does not fit: {'at least ' if at_least else ''}{fmt_gib(peak)} needed, "
                           f"{fmt_gib(budget)} available"
                           + (f" ({peak / budget:.1f}x)" if peak else "")))}


SPLASH_BLOCK = 128


def tpu_model(req: PlanRequest) -> dict[str, Any]:
    """The model as the TPU job runs it: with a choice of attention, Pallas' splash kernel (the TPU's fused
    attention, MaxText's) unless the user's code materialises the scores (attention xla) or the shapes do
    not suit the kernel (a sequence of whole 128-token blocks, heads of a multiple of 128)."""
    cfg = get_workload(req.workload).config(req.preset, req.model)
    if not hasattr(cfg, "attention"):
        return dict(req.model)
    model = {k: v for k, v in req.model.items() if k != "attention"}
    xla = req.model.get("attention") == "xla" or cfg.seq_len % SPLASH_BLOCK or cfg.head_dim % SPLASH_BLOCK
    return {**model, "attention": "xla" if xla else "splash"}


def tpu_step_method(step: steptime.StepPrediction, source: TpuSpec, slices: int = 1) -> str:
    cal = steptime.TPU_CALIBRATION
    dcn = ("" if slices == 1 else
           f" and, between the {slices} slices, {source.chip.dcn_bytes_per_s * 8 / 1e9:,.0f} Gb/s of data-centre "
           "network per chip" if source.dcn_bytes_per_s else
           f"; collectives between the {slices} slices not timed (no data-centre network figure for this chip)")
    ici = (f"collectives {fmt_seconds(step.communication_s)} over {source.ici_bytes_per_s * 2 / 1e9:,.0f} GB/s of "
           f"inter-chip links per device{dcn} ({fmt_seconds(step.exposed_communication_s)} not hidden)"
           if source.ici_bytes_per_s else "collectives not timed (no inter-chip bandwidth stated for this chip)")
    return (f"from the compiled TPU program: {step.kernels:,} kernels, {step.flops / 1e12:,.3g} TFLOP per device, each "
            f"at the longer of its FLOPs at {cal.matmul:.0%} of {source.chip.name}'s bf16 peak and its HBM bytes at "
            f"{cal.memory:.0%} of the bandwidth; {ici}; expected error about ±{steptime.EXPECTED_ERROR_TPU:.0%} "
            "(bench/published_check.py --tpu)")


def tpu_topology(source: TpuSpec, slices: int = 1) -> Any:
    """The source slice (`slices` of them, joined by the data-centre network) described for a compile
    without its chips (libtpu's compile-only devices), with the chip configuration that live Cloud TPU
    hosts use: one JAX device per chip (megacore) on v4 and v5p, one per TensorCore on TPU7x. Raises
    where libtpu is not installed."""
    return topologies.get_topology_desc(topology_name=source.topology, platform="tpu",
                                        **{**source.compile_options, "num_slices": slices})


def source_layout(sharding: str, source: TpuSpec, slices: int) -> str:
    """The TPU job's layout: its state replicated, or sharded over its slice (FSDP; over several slices,
    FSDP inside each and data parallelism across them, MaxText's default for multislice)."""
    return f"hybrid:{source.devices}" if sharding == "fsdp" and slices > 1 else sharding


def tpu_links(source: TpuSpec, slices: int) -> Links | float | None:
    """What the TPU job's collectives cross: the inter-chip links, and between slices the data-centre
    network (each device's share)."""
    return source.ici_bytes_per_s if slices == 1 else Links(source.ici_bytes_per_s, source.dcn_bytes_per_s)


def compile_for_tpu(cfg: RunConfig, topo: Any, source: TpuSpec, layout: str, slices: int) -> tuple[dict[str, Any], bool]:
    """The TPU step's compiled figures (peak, kernels, how long the compile took) and whether they came
    from the cache of compiled figures (compile_cache.py), where they are kept under the same kind of key
    as a GPU candidate's. Raises what XLA raises."""
    cache = CompileCache()
    key = cache_key("tpu", workload_fingerprint(get_workload(cfg.workload)), source.topology, slices, layout,
                    cfg.to_dict(), os.environ.get("XLA_FLAGS", ""))
    found = cache.get(key)
    if found is not None:
        return found, True
    t0 = time.perf_counter()
    found = compile_memory(TrainProgram.from_config(cfg), make_multislice_mesh(topo.devices, layout, slices),
                           kernels=True, fp32_unit="bf16", per_node=source.devices)
    seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
    found = {**found, "compile_s": round(seconds, 2), "where": "compiled-for-tpu"}
    cache.put(key, found)
    return found, False


def compile_for_source_tpu(req: PlanRequest) -> dict[str, Any]:
    """The TPU-style setup compiled for the source TPU (libtpu, installed with the product)."""
    source, slices = TPU_SPECS[req.source], req.source_slices
    try:
        topo = tpu_topology(source, slices)
    except Exception as exc:  # noqa: BLE001 - no TPU compiler here; JAX raises several types for it
        return {"status": "unavailable",
                "reason": "no TPU compiler on this machine: libtpu is not installed or cannot load (pip install -r "
                          'requirements.txt installs it, through jax[tpu]; for JAX 0.10.2 it is libtpu 0.0.42.x)',
                "detail": first_line(exc, 200)}
    if len(topo.devices) != req.source_devices:
        return {"status": "failed", "reason": f"libtpu describes {slices} x {source.topology} with {len(topo.devices)} "
                                              f"devices, the catalog {req.source_devices}"}
    try:
        w = get_workload(req.workload)
        sharding = source_sharding(req, w.param_count(w.config(req.preset, req.model)))
        model = tpu_model(req)
        layout = source_layout(sharding, source, slices)
        cfg = RunConfig(workload=req.workload, preset=req.preset, model=model,
                        per_device_batch=req.source_per_core_batch, devices=req.source_devices,
                        precision=req.source_precision, remat="none", sharding=layout)
        found, cached = compile_for_tpu(cfg, topo, source, layout, slices)
        step = steptime.predict(unpack(found["kernels"]), source, tpu_links(source, slices), steptime.TPU_CALIBRATION)
        return {"status": "ok", "peak_bytes_per_chip": found["peak_bytes"],
                "hbm_bytes_per_device": source.hbm_bytes_per_device, "device_kind": topo.devices[0].device_kind,
                "topology": source.topology, "compile_s": found["compile_s"], "cached": cached,
                "attention": model.get("attention"), "predicted_step_s": step.seconds,
                "step_method": tpu_step_method(step, source, slices), "slices": slices, "layout": layout}
    except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
        text = first_line(exc, 400)
        if is_oom(text):
            # The TPU compiler itself says the unchanged setup exceeds the source's HBM.
            return {"status": "does-not-fit", "reason": text, "hbm_bytes_per_device": source.hbm_bytes_per_device,
                    "device_kind": topo.devices[0].device_kind, "topology": source.topology}
        return {"status": "failed", "reason": text}
