"""The TPU job a plan starts from: how it held its state, how its unchanged setup fares on the target
GPU, and what the TPU compiler (libtpu, compiling for the slice without its chips) says of it on the
source TPU.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

from jax.experimental import topologies

from migration.common import first_line, fmt_gib, fmt_seconds, is_oom
from migration.config.layouts import parse_layout
from migration.config.limits import custom_remat, remat_named
from migration.config.requests import PlanRequest, RunConfig
from migration.hardware import TPU_SPECS, Links, TpuSpec
from migration.planning import steptime
from migration.planning.compare import tpu_needs_bytes
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
    """How the unchanged TPU-style setup (per-core batch, source precision, the TPU job's remat) fares on
    the target, with the plan's way of holding the state."""
    b, remat = req.source_per_core_batch, req.tpu_remat
    what = f"the TPU-style setup ({b} per device, {req.source_precision}, " + (
        "no remat)" if remat == "none" else f"remat {remat})")
    try:
        peak = predictor.predict(req.source_precision, remat, b, record=False, sharding=sharding)
    except CompileFailed as exc:  # e.g. bf16 matrix products on a GPU without them (before Ampere)
        return {"per_device_batch": b, "precision": req.source_precision, "remat": remat,
                "predicted_peak_bytes": None, "budget_bytes": budget, "fits": False,
                "summary": f"{what} does not compile for the target: {exc}"}
    fits = peak is not None and peak <= budget
    at_least = (sharding, remat, b, 1, req.source_precision) in predictor.bounded
    return {"per_device_batch": b, "precision": req.source_precision, "remat": remat,
            "predicted_peak_bytes": peak, "budget_bytes": budget, "fits": fits,
            "summary": (f"{what} "
                        + (f"fits: {fmt_gib(peak)} of {fmt_gib(budget)}" if fits else
                           f"does not fit: {'at least ' if at_least else ''}{fmt_gib(peak)} needed, "
                           f"{fmt_gib(budget)} available"
                           + (f" ({peak / budget:.1f}x)" if peak else "")))}


SPLASH_BLOCK = 128


def tpu_model(req: PlanRequest) -> dict[str, Any]:
    """The model as the TPU job runs it: with a choice of attention, Pallas' splash kernel (the TPU's fused
    attention, MaxText's) unless the user's code materialises the scores (attention xla) or the sequence is
    not a whole number of the kernel's 128-token blocks. Any head size compiles (a head narrower than 128
    lanes takes its whole width as the block, as GPT-2's 64 does)."""
    cfg = get_workload(req.workload).config(req.preset, req.model)
    if not hasattr(cfg, "attention"):
        return dict(req.model)
    model = {k: v for k, v in req.model.items() if k != "attention"}
    xla = req.model.get("attention") == "xla" or cfg.seq_len % SPLASH_BLOCK
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


def source_layout(sharding: str, source: TpuSpec, slices: int, across_slices: bool = False) -> str:
    """The TPU job's layout: its state replicated, or sharded over its slice (FSDP; over several slices,
    FSDP inside each and data parallelism across them, MaxText's default for multislice, or with
    `across_slices` FSDP over every slice's devices, MaxText's dcn_fsdp_parallelism)."""
    return f"hybrid:{source.devices}" if sharding == "fsdp" and slices > 1 and not across_slices else sharding


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


# What the product tries, in this order, when the TPU compiler says the stated setup needs more HBM than a chip
# has: keep less for the backward pass (MaxText's policies, from saving every product without a batch
# dimension to offloading the layer inputs as the TPU recipes do), then a smaller per-chip batch with
# gradient accumulation (the same global batch). The first that fits is the product's assumed TPU setup.
TPU_FIT_REMATS = ("dots_no_batch", "save_dot_except_mlp", "save_qkv",
                  custom_remat({"decoder_layer_input": "offload", "query_proj": "offload", "kv_proj": "offload",
                                "attention_out": "offload", "attention_proj": "offload"}),
                  "full", custom_remat({"decoder_layer_input": "offload"}))


def compile_for_source_tpu(req: PlanRequest) -> dict[str, Any]:
    """The TPU job's setup compiled for the source TPU (libtpu, installed with the product): its peak per
    device and predicted step; where the compiler says it needs more HBM than a chip has, that, and the
    first setup of `tpu_fit_candidates` that fits, compiled and predicted the same way ("fitted")."""
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
    w = get_workload(req.workload)
    sharding = source_sharding(req, w.param_count(w.config(req.preset, req.model)))
    stated = TpuSetup(source_layout(sharding, source, slices, req.source_dcn_fsdp), req.tpu_remat,
                      req.source_per_core_batch, 1)
    try:
        return {"status": "ok", **compile_setup(req, topo, stated)}
    except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
        text = first_line(exc, 400)
        if not is_oom(text):
            return {"status": "failed", "reason": text}
    # The TPU compiler itself says the stated setup exceeds the source's HBM.
    out = {"status": "does-not-fit", "reason": text, "hbm_bytes_per_device": source.hbm_bytes_per_device,
           "device_kind": topo.devices[0].device_kind, "topology": source.topology, "stated": stated.describe(),
           "tried": []}
    # float32 parameters and AdamW's two moments, sharded over every device: no remat or batch makes it less
    floor = 12 * w.param_count(w.config(req.preset, req.model)) / req.source_devices
    if floor > source.hbm_bytes_per_device:
        out["tried"].append(f"none: the float32 parameters and AdamW moments alone need {fmt_gib(floor)} per device "
                            f"sharded over all {req.source_devices} devices, more than its HBM; a larger slice is "
                            "the change that fits")
        return out
    for setup in tpu_fit_candidates(stated, w, source):
        try:
            fitted = compile_setup(req, topo, setup)
        except Exception as exc:  # noqa: BLE001 - as above
            reason = first_line(exc, 400)
            if not is_oom(reason):
                out["tried"].append(f"{setup.describe()}: does not compile ({reason})")
                break
            out["tried"].append(f"{setup.describe()}: does not fit ({tpu_needs_text(reason)})")
            continue
        out["fitted"] = {**fitted, "setup": setup.describe(), "remat": setup.remat, "layout": setup.layout,
                         "per_core_batch": setup.batch, "accumulation_steps": setup.accumulation,
                         "assumed": "the product's assumption: the first setup in its order (remat policies keeping "
                                    "less, then a smaller per-chip batch with accumulation, the same global batch) "
                                    "that the TPU compiler fits"}
        break
    return out


@dataclasses.dataclass(frozen=True)
class TpuSetup:
    """How the TPU job runs its step: the state's layout, the remat policy, the per-device batch of one
    micro-batch and how many micro-batches make a step."""

    layout: str
    remat: str
    batch: int
    accumulation: int

    def describe(self) -> str:
        accum = f" x {self.accumulation} accumulated" if self.accumulation > 1 else ""
        return f"{self.batch} per device{accum}, remat {self.remat}, {self.layout} state"


def tpu_fit_candidates(stated: TpuSetup, workload: Any, source: TpuSpec) -> list[TpuSetup]:
    """The setups tried, in order, when the stated one does not fit: the state sharded over the slice
    where it was replicated; each of TPU_FIT_REMATS the model has the tags for (after the stated policy);
    then the per-device batch halved, with accumulation keeping the global batch, under the last policy."""
    layout = stated.layout if parse_layout(stated.layout).shards_state() else "fsdp"
    out = [] if layout == stated.layout else [dataclasses.replace(stated, layout=layout)]
    usable = [r for r in TPU_FIT_REMATS if workload.remat_unavailable(r, remat_named(r)) is None]
    later = usable[usable.index(stated.remat) + 1:] if stated.remat in usable else usable
    out += [TpuSetup(layout, r, stated.batch, 1) for r in later]
    last = out[-1].remat if out else stated.remat
    batch, accum = stated.batch, 1
    while batch > 1 and batch % 2 == 0:
        batch, accum = batch // 2, accum * 2
        out.append(TpuSetup(layout, last, batch, accum))
    return out


def compile_setup(req: PlanRequest, topo: Any, setup: TpuSetup) -> dict[str, Any]:
    """One TPU setup compiled for the source slice and its step predicted. Raises what XLA raises."""
    source, slices = TPU_SPECS[req.source], req.source_slices
    model = tpu_model(req)
    cfg = RunConfig(workload=req.workload, preset=req.preset, model=model, per_device_batch=setup.batch,
                    devices=req.source_devices, precision=req.source_precision, remat=setup.remat,
                    accumulation_steps=setup.accumulation, sharding=setup.layout)
    found, cached = compile_for_tpu(cfg, topo, source, setup.layout, slices)
    step = steptime.predict(unpack(found["kernels"]), source, tpu_links(source, slices), steptime.TPU_CALIBRATION)
    return {"peak_bytes_per_chip": found["peak_bytes"], "hbm_bytes_per_device": source.hbm_bytes_per_device,
            "device_kind": topo.devices[0].device_kind, "topology": source.topology, "compile_s": found["compile_s"],
            "cached": cached, "attention": model.get("attention"), "predicted_step_s": step.seconds,
            "step_method": tpu_step_method(step, source, slices), "slices": slices, "layout": setup.layout,
            "remat": setup.remat}


def tpu_needs_text(reason: str) -> str:
    need = tpu_needs_bytes(reason)
    return f"needs {fmt_gib(need)}" if need else "needs more HBM"
