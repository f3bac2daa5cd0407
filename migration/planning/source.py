"""The TPU job a plan starts from: how it held its state, how its unchanged setup fares on the target
GPU, and what the TPU compiler (libtpu, compiling for the slice without its chips) says of it on the
source TPU.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from collections.abc import Callable
from typing import Any

from jax.experimental import topologies

from migration.common import first_line, fmt_bytes, fmt_gib, fmt_seconds, is_oom
from migration.config.layouts import parse_layout
from migration.config.limits import custom_remat, remat_named, state_bytes_per_param
from migration.config.requests import PlanRequest, RunConfig
from migration.hardware import TPU_SPECS, Links, TpuSpec
from migration.planning import steptime
from migration.planning.compare import tpu_needs_bytes
from migration.planning.compile_cache import CompileCache, cache_key, workload_fingerprint
from migration.planning.hlo_collectives import ALL_REDUCE_GATHER
from migration.planning.hlo_cost import unpack
from migration.planning.memory import (
    CompileFailed,
    MemoryPredictor,
    compile_memory,
    compile_pool,
    usable_cores,
)
from migration.step.train import TrainProgram, make_multislice_mesh
from workloads import get_workload


def source_sharding(req: PlanRequest, params: int) -> str:
    """How the TPU job held its state: as given, else replicated (pmap) when its state (16 bytes per
    parameter, 14 with a bfloat16 first moment) fits 90% of a chip's HBM, else sharded over the slice."""
    hbm = TPU_SPECS[req.source].hbm_bytes_per_device
    if req.source_tensor > 1 or req.source_expert > 1:  # model parallelism on the TPU side: state sharded (MaxText)
        return "fsdp"
    return req.source_sharding or ("replicated" if state_bytes_per_param(req.mu_dtype) * params <= 0.9 * hbm
                                   else "fsdp")


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
    if req.source_tensor > 1 and hasattr(cfg, "residual_over_tensor"):
        model["residual_over_tensor"] = True  # MaxText shards the residual stream's embedding over the tensor axis
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


def source_layout(sharding: str, source: TpuSpec, slices: int, across_slices: bool = False, tensor: int = 1,
                  expert: int = 1) -> str:
    """The TPU job's layout: its state replicated, or sharded over its slice (FSDP; over several slices,
    FSDP inside each and data parallelism across them, MaxText's default for multislice, or with
    `across_slices` FSDP over every slice's devices, MaxText's dcn_fsdp_parallelism); with `tensor`, each
    block's weights split over that many devices of a slice (MaxText's ici_tensor_parallelism); with `expert`,
    the routed experts over that many (ici_expert_parallelism)."""
    base = f"hybrid:{source.devices}" if sharding == "fsdp" and slices > 1 and not across_slices else sharding
    return base + (f"+ep{expert}" if expert > 1 else "") + (f"+tp{tensor}" if tensor > 1 else "")


def tpu_links(source: TpuSpec, slices: int) -> Links | float | None:
    """What the TPU job's collectives cross: the inter-chip links, and between slices the data-centre
    network (each device's share)."""
    return source.ici_bytes_per_s if slices == 1 else Links(source.ici_bytes_per_s, source.dcn_bytes_per_s)


def tpu_cache_key(cfg: RunConfig, source: TpuSpec, layout: str, slices: int) -> str:
    """Where a TPU setup's compiled figures are kept in the cache of compiled figures (compile_cache.py)."""
    return cache_key("tpu", workload_fingerprint(get_workload(cfg.workload)), source.topology, slices, layout,
                     cfg.to_dict(), os.environ.get("XLA_FLAGS", ""))


def compile_for_tpu(cfg: RunConfig, topo: Any, source: TpuSpec, layout: str, slices: int) -> tuple[dict[str, Any], bool]:
    """The TPU step's compiled figures (peak, kernels, how long the compile took) and whether they came
    from the cache of compiled figures (compile_cache.py), where they are kept under the same kind of key
    as a GPU candidate's. Raises what XLA raises."""
    cache = CompileCache()
    key = tpu_cache_key(cfg, source, layout, slices)
    found = cache.get(key)
    if found is not None:
        return found, True
    found = compile_memory(TrainProgram.from_config(cfg), make_multislice_mesh(topo.devices, layout, slices),
                           kernels=True, fp32_unit="bf16", per_node=source.devices, target=(source.topology, slices),
                           where="compiled-for-tpu", cache=cache)
    found = {**found, "where": "compiled-for-tpu"}  # with the compile's own seconds (compiled.figures_of_program)
    cache.put(key, found)
    return found, False


# 1: the TPU side compiles in a process beside the GPU search; 0: in the planner's own process after it.
# Unset: beside it wherever there are two cores or more. With the GPU search's figure options
# (compiled.GPU_FIGURE_OPTIONS) two cores overlap the two for the plans that take longest and lose a few seconds to
# the second process's start on the short ones: bench/plan_scale.py on 2 cores, 2026-12-07, after then beside,
# v5p-8 32 -> 36 s, v5p-1024 59 -> 63 s, 2 x v5p-1024 65 -> 68 s, 2 x v6e-256 111 -> 96 s, tpu7x-128 93 -> 82 s
# (two runs, not alternated). It costs a second process's memory for the length of the plan.
SIDE_ENV = "MIGRATION_TPU_COMPILE_BESIDE"


def compile_beside() -> bool:
    given = os.environ.get(SIDE_ENV, "").strip()
    if given in ("0", "1"):
        return given == "1"
    return usable_cores() >= 2

# The remat policies the product tries, in this order, when the TPU compiler says the stated setup needs more
# HBM than a chip has: keeping less for the backward pass (MaxText's policies, from saving every product
# without a batch dimension to offloading the layer inputs as the TPU recipes do). Beside them, a smaller
# per-chip batch with gradient accumulation (the same global batch); `cheapest_fit` takes the faster.
TPU_FIT_REMATS = ("dots_no_batch", "save_dot_except_mlp", "save_qkv",
                  custom_remat({"decoder_layer_input": "offload", "query_proj": "offload", "kv_proj": "offload",
                                "attention_out": "offload", "attention_proj": "offload"}),
                  "full", custom_remat({"decoder_layer_input": "offload"}))


def compile_for_source_tpu(req: PlanRequest) -> dict[str, Any]:
    """The TPU job's setup compiled for the source TPU (libtpu, installed with the product): its peak per
    device and predicted step; where the compiler says it needs more HBM than a chip has, that, and the
    cheapest setup that fits (`cheapest_fit`), compiled and predicted the same way ("fitted")."""
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
    if req.source_tensor > 1 and not w.tensor_parallel:
        return {"status": "failed", "reason": f"source_tensor {req.source_tensor}: the workload {req.workload} splits no "
                                              "weight over a tensor axis (only the decoders do); leave it at 1"}
    stated = stated_setup(req)
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
    floor = state_bytes_per_param(req.mu_dtype, gradients=False) * w.param_count(w.config(req.preset, req.model)) \
        / req.source_devices
    if floor > source.hbm_bytes_per_device:
        out["tried"].append(f"none: the parameters and AdamW moments alone need {fmt_gib(floor)} per device "
                            f"sharded over all {req.source_devices} devices, more than its HBM; a larger slice is "
                            "the change that fits")
        return out
    setup, fitted, tried, other = cheapest_fit(tpu_fit_ladders(stated, w, source),
                                               lambda s: compile_setup(req, topo, s))
    out["tried"] = tried
    if setup is not None:
        out["fitted"] = {**fitted, "setup": setup.describe(), "remat": setup.remat, "layout": setup.layout,
                         "per_core_batch": setup.batch, "accumulation_steps": setup.accumulation,
                         "assumed": f"the product's assumption: {FIT_RULE}", "other": other}
    return out


FIT_RULE = ("of the changes the TPU compiler fits (the state sharded over the slice; else the first remat policy "
            "keeping less at the stated per-chip batch, or the first smaller per-chip batch with accumulation at "
            "the stated policy, the same global batch), the one with the faster predicted step")


def cheapest_fit(ladders: "FitLadders", compile_one: Callable[[TpuSetup], dict[str, Any]]
                 ) -> tuple[TpuSetup | None, dict[str, Any] | None, list[str], str | None]:
    """The cheapest setup that fits, by the step model that reports it: the layout change alone where there is
    one and it fits (it recomputes nothing and keeps the batch); else the first fit of each ladder, remat
    policies keeping less at the stated batch and smaller per-chip batches at the stated policy, and of the
    two the faster predicted step (`compile_one` compiles a setup and predicts its step, raising what XLA
    raises); where neither fits, smaller batches under the last policy. Returns the setup, its figures, each
    setup tried with what became of it, and the other ladder's fit (as text) where there was one."""
    tried: list[str] = []

    def first_fit(ladder: list[TpuSetup]) -> tuple[TpuSetup | None, dict[str, Any] | None, bool]:
        for setup in ladder:
            try:
                return setup, compile_one(setup), True
            except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
                reason = first_line(exc, 400)
                if not is_oom(reason):
                    tried.append(f"{setup.describe()}: does not compile ({reason})")
                    return None, None, False
                tried.append(f"{setup.describe()}: does not fit ({tpu_needs_text(reason)})")
        return None, None, True

    setup, found, going = first_fit(ladders.layout)
    if setup is not None or not going:
        return setup, found, tried, None
    fits = []
    for ladder in (ladders.remat, ladders.batch):
        setup, found, going = first_fit(ladder)
        if setup is not None:
            fits.append((found["predicted_step_s"], setup, found))
        if not going:
            break
    if not fits and going:
        setup, found, _ = first_fit(ladders.fallback)
        return setup, found, tried, None
    if not fits:
        return None, None, tried, None
    fits.sort(key=lambda f: f[0])
    other = (f"{fits[1][1].describe()}: also fits, predicted step {fmt_seconds(fits[1][0])} against "
             f"{fmt_seconds(fits[0][0])}" if len(fits) > 1 else None)
    return fits[0][1], fits[0][2], tried, other


class SourceCompile:
    """The TPU side of a plan (compile_for_source_tpu), started when the plan starts. When the stated
    setup's figures are not in the cache, it compiles in a process of its own while the GPU side is
    searched, so that libtpu and the GPU compiles overlap on the machine's cores; `result` collects it
    (or compiles here, when no process could start or its figures were cached)."""

    def __init__(self, req: PlanRequest):
        self.req = req
        self._pool: ProcessPoolExecutor | None = None
        self._future: Future[dict[str, Any]] | None = None
        self._done: dict[str, Any] | None = None if req.compile_for_tpu else {"status": "not requested"}
        self.beside = False  # whether it compiles in a process beside the search

    def start(self) -> None:
        if self._done is not None or self._future is not None or not compile_beside():
            return
        try:
            cached = CompileCache().get(tpu_cache_key(setup_config(self.req, stated := stated_setup(self.req)),
                                                      TPU_SPECS[self.req.source], stated.layout,
                                                      self.req.source_slices)) is not None
        except Exception:  # noqa: BLE001 - a request the compile itself will explain: compile it here, later
            return
        if cached:
            return
        try:
            self._pool = compile_pool(1, self.req.workload)
            self._future = self._pool.submit(compile_for_source_tpu, self.req)
            self.beside = True
        except (OSError, RuntimeError, BrokenProcessPool):
            self.close()

    def result(self) -> dict[str, Any]:
        if self._done is None and self._future is not None:
            try:
                self._done = self._future.result()
            except (BrokenProcessPool, OSError):  # the process died (memory, a signal): compile here instead
                self.beside = False
            self.close()
        if self._done is None:
            self._done = compile_for_source_tpu(self.req)
        return self._done

    def close(self) -> None:
        """Stop the process (a compile nobody will collect is abandoned, not waited for)."""
        if self._pool is not None:
            running = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for process in running:
                if process.is_alive():
                    process.terminate()
            self._pool = None
        self._future = None


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


@dataclasses.dataclass(frozen=True)
class FitLadders:
    """The setups tried when the stated one does not fit (`cheapest_fit` walks them): the state sharded over
    the slice where it was replicated; each of TPU_FIT_REMATS the model has the tags for, after the stated
    policy, at the stated batch; the per-device batch halved with accumulation keeping the global batch, at
    the stated policy; and, where neither of those fits, halved under the last policy."""

    layout: list[TpuSetup]
    remat: list[TpuSetup]
    batch: list[TpuSetup]
    fallback: list[TpuSetup]


def tpu_fit_ladders(stated: TpuSetup, workload: Any, source: TpuSpec) -> FitLadders:
    layout = stated.layout if parse_layout(stated.layout).shards_state() else "fsdp"
    usable = [r for r in TPU_FIT_REMATS if workload.remat_unavailable(r, remat_named(r)) is None]
    later = usable[usable.index(stated.remat) + 1:] if stated.remat in usable else usable
    remat = [TpuSetup(layout, r, stated.batch, 1) for r in later]
    halves = []
    batch, accum = stated.batch, 1
    while batch > 1 and batch % 2 == 0:
        batch, accum = batch // 2, accum * 2
        halves.append((batch, accum))
    last = remat[-1].remat if remat else stated.remat
    return FitLadders(layout=[] if layout == stated.layout else [dataclasses.replace(stated, layout=layout)],
                      remat=remat, batch=[TpuSetup(layout, stated.remat, b, a) for b, a in halves],
                      fallback=[] if last == stated.remat else [TpuSetup(layout, last, b, a) for b, a in halves])


def stated_setup(req: PlanRequest) -> TpuSetup:
    """The TPU job's setup as the user states it: its layout, remat policy and per-device batch."""
    w = get_workload(req.workload)
    sharding = source_sharding(req, w.param_count(w.config(req.preset, req.model)))
    return TpuSetup(source_layout(sharding, TPU_SPECS[req.source], req.source_slices, req.source_dcn_fsdp,
                                  req.source_tensor, req.source_expert),
                    req.tpu_remat, req.source_per_core_batch, 1)


def setup_config(req: PlanRequest, setup: TpuSetup) -> RunConfig:
    """The run configuration the TPU side compiles for one setup."""
    return RunConfig(workload=req.workload, preset=req.preset, model=tpu_model(req), per_device_batch=setup.batch,
                     devices=req.source_devices, precision=req.source_precision, remat=setup.remat,
                     accumulation_steps=setup.accumulation, sharding=setup.layout, mu_dtype=req.mu_dtype)


def compile_setup(req: PlanRequest, topo: Any, setup: TpuSetup) -> dict[str, Any]:
    """One TPU setup compiled for the source slice and its step predicted. Raises what XLA raises."""
    source, slices = TPU_SPECS[req.source], req.source_slices
    cfg = setup_config(req, setup)
    found, cached = compile_for_tpu(cfg, topo, source, setup.layout, slices)
    kernels = unpack(found["kernels"])
    gathers = sum(k.bytes for k in kernels if k.kind == ALL_REDUCE_GATHER)
    if req.source_all_gathers:
        kernels = steptime.as_all_gathers(kernels)
    step = steptime.predict(kernels, source, tpu_links(source, slices), steptime.TPU_CALIBRATION)
    return {"peak_bytes_per_chip": found["peak_bytes"], "hbm_bytes_per_device": source.hbm_bytes_per_device,
            "device_kind": topo.devices[0].device_kind, "topology": source.topology, "compile_s": found["compile_s"],
            "cached": cached, "attention": cfg.model.get("attention"), "predicted_step_s": step.seconds,
            "step_method": tpu_step_method(step, source, slices) + gathers_text(gathers, req.source_all_gathers)
            + steptime.exchange_text(kernels, "chip"),
            "slices": slices, "layout": setup.layout, "remat": setup.remat}


def gathers_text(gathered_bytes: float, as_all_gathers: bool) -> str:
    """What the TPU program's all-reduces that gather weights were timed as (hlo_collectives)."""
    if not gathered_bytes:
        return ""
    how = ("timed as the all-gathers --xla_tpu_prefer_async_allgather_to_allreduce=true compiles them to"
           if as_all_gathers else
           "timed as compiled, as libtpu's default flags send them (--tpu-prefer-all-gather: as all-gathers, half the "
           "bytes)")
    return f"; {fmt_bytes(gathered_bytes)} a device a step of weight gathers compiled as all-reduces, {how}"


def tpu_needs_text(reason: str) -> str:
    need = tpu_needs_bytes(reason)
    return f"needs {fmt_gib(need)}" if need else "needs more HBM"
