"""The migration planner: from a TPU-style setup to a GPU plan that fits, found by the compiler.

Runs inside a planner worker (JAX's environment set before import; see `migration/runner.py`).
Memory is predicted by compiling the real train step (`migration/train.py`, the same code a run
uses) on abstract inputs and reading `memory_analysis()`: for a catalog GPU through a deviceless
compile (the CUDA plugin compiles for an XLA description of that GPU), for "local" on this
machine's devices. XLA's own rematerialisation pass is disabled for these compiles (the worker
sets `--xla_disable_hlo_passes=rematerialization`), so a "fits" never hides recomputation the
user did not choose. Where no compile for the target is possible, an analytic estimate is used
and labelled so. Results are cached on disk, keyed by everything that changes the compile.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax

from migration.config import PlanRequest, RunConfig
from migration.hardware import GPU_SPECS, TPU_SPECS, GpuSpec, gpu_target_config, gpu_spec_for_device_kind
from migration.plan import (
    REMAT_ORDER,
    Decision,
    Plan,
    batch_candidates,
    exact_candidates,
    keep_global_batch,
    largest_fitting,
    rule_of_thumb_batch,
)
from migration.train import TrainProgram, abstract_batch, abstract_state, jit_step
from workloads import get_workload

Emit = Callable[..., None]
OOM_MARKERS = ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")
REMAT_RECOMPUTE = {"none": "no recompute", "dots": "recomputes elementwise work only",
                   "dots_no_batch": "recomputes elementwise work and attention-score matmuls",
                   "full": "recomputes each block's forward pass (about a third more compute)"}


def _cache_path() -> Path:
    root = Path(os.environ.get("MIGRATION_CACHE_DIR", Path.home() / ".cache" / "tpu-gpu-migration"))
    return root / "compile_memory.json"


class CompileCache:
    """Predicted peaks on disk, one JSON file; a lost race only loses an entry."""

    def __init__(self, path: Path | None = None):
        self.path = path or _cache_path()
        try:
            self.data: dict[str, Any] = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.data = {}

    def get(self, key: str) -> Any:
        return self.data.get(key)

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.data))
            tmp.replace(self.path)
        except OSError:
            pass


class CompileFailed(RuntimeError):
    """Compiling for the target failed for a reason other than memory."""


class MemoryPredictor:
    """Per-device peak bytes of the train step for (precision, remat, batch, accumulation)."""

    def __init__(self, req: PlanRequest, emit: Emit, cache: CompileCache | None = None,
                 estimate_because: str | None = None):
        self.req = req
        self.emit = emit
        self.cache = cache or CompileCache()
        self.compiles = 0
        self.cache_hits = 0
        self.table: list[dict[str, Any]] = []
        if estimate_because:
            self.method, self.note, self.mesh, self.target_id = (
                "estimate", f"analytic estimate: {estimate_because}", None, f"estimate:{req.target}")
        else:
            self.method, self.note, self.mesh, self.target_id = self._setup()

    # -- where we compile ------------------------------------------------------------------
    def _setup(self) -> tuple[str, str, Any, str]:
        req = self.req
        if req.target == "local":
            devices = jax.devices()
            if len(devices) < req.gpus:
                raise ValueError(f"gpus: {req.gpus} requested but this machine has {len(devices)} "
                                 f"{devices[0].platform} device(s)")
            from migration.train import make_data_mesh

            kind = devices[0].device_kind
            note = f"compiled for this machine's {kind} ({jax.default_backend()} backend)"
            if jax.default_backend() == "cpu":
                note += ("; a CPU-backend compile is not a GPU prediction (on CPU, remat savings do not "
                         "show in the memory analysis)")
            return "compiled-local", note, make_data_mesh(devices[: req.gpus]), f"local:{kind}"
        spec = GPU_SPECS[req.target]
        text = gpu_target_config(spec)
        try:
            from jax.experimental import topologies

            topo = topologies.get_topology_desc(platform="cuda", target_config=text, topology=f"1x1x{req.gpus}")
            from jax.sharding import AxisType

            mesh = jax.make_mesh((req.gpus,), ("data",), axis_types=(AxisType.Auto,), devices=topo.devices)
            return ("compiled-for-target", f"compiled for {spec.name} without the device (deviceless XLA GPU compile)",
                    mesh, hashlib.sha256(text.encode()).hexdigest()[:16])
        except Exception as exc:  # plugin missing or unable to describe the target: estimate instead
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            return ("estimate", f"analytic estimate: no compile for {spec.name} was possible here ({reason})",
                    None, f"estimate:{spec.key}")

    def _key(self, precision: str, remat: str, batch: int, accum: int) -> str:
        parts = [jax.__version__, self.method, self.target_id, self.req.workload, self.req.preset, precision,
                 remat, batch, accum, self.req.gpus, os.environ.get("XLA_FLAGS", "")]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()

    # -- prediction ------------------------------------------------------------------------
    def predict(self, precision: str, remat: str, batch: int, accum: int = 1, record: bool = True) -> int | None:
        """Peak bytes per device, or None when the compiler says it cannot fit at all."""
        key = self._key(precision, remat, batch, accum)
        hit = self.cache.get(key)
        t0 = time.perf_counter()
        if hit is not None:
            self.cache_hits += 1
            peak = hit["peak_bytes"]
        else:
            peak = self._estimate(precision, remat, batch, accum) if self.method == "estimate" else \
                self._compile(precision, remat, batch, accum)
            self.cache.put(key, {"peak_bytes": peak})
        if record:
            row = {"per_device_batch": batch, "remat": remat, "precision": precision, "accumulation_steps": accum,
                   "predicted_bytes": peak, "cached": hit is not None, "seconds": round(time.perf_counter() - t0, 3)}
            self.table.append(row)
            self.emit("candidate", **row)
        return peak

    def _compile(self, precision: str, remat: str, batch: int, accum: int) -> int | None:
        cfg = RunConfig(workload=self.req.workload, preset=self.req.preset, per_device_batch=batch,
                        devices=self.req.gpus, precision=precision, remat=remat, accumulation_steps=accum)
        program = TrainProgram.from_config(cfg)
        self.compiles += 1
        try:
            lowered = jit_step(program, self.mesh).lower(abstract_state(program, self.mesh),
                                                         abstract_batch(program, self.mesh))
            stats = lowered.compile().memory_analysis()
        except Exception as exc:
            if any(m in str(exc) for m in OOM_MARKERS):
                return None
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise CompileFailed(f"compiling for the target failed ({type(exc).__name__}: {first})") from exc
        return int(stats.argument_size_in_bytes + stats.output_size_in_bytes
                   - stats.alias_size_in_bytes + stats.temp_size_in_bytes)

    def estimate(self, precision: str, remat: str, batch: int, accum: int = 1) -> int:
        return self._estimate(precision, remat, batch, accum)

    def _estimate(self, precision: str, remat: str, batch: int, accum: int) -> int:
        """Parameters, gradients and AdamW state in float32 (16 bytes per parameter), a gradient
        accumulator when accumulating, and activations by precision and remat policy."""
        w = get_workload(self.req.workload)
        cfg = w.config(self.req.preset)
        p = w.param_count(cfg)
        state = 16 * p + (4 * p if accum > 1 else 0)
        prof = w.activation_profile(cfg)
        elem = 4 if precision == "fp32" else 2
        kept = {"none": prof.n_blocks * prof.per_block,
                "dots": 0.6 * prof.n_blocks * prof.per_block,
                "dots_no_batch": 0.45 * prof.n_blocks * prof.per_block,
                "full": prof.n_blocks * prof.block_input + prof.per_block}[remat]
        activations = batch * (kept * elem + prof.head_fp32 * 4)
        return int(state + activations)


def _matmul_precision_notes(spec: GpuSpec | None, precision: str) -> dict[str, str]:
    gpu = "bf16 tensor cores" if precision == "bf16" else ("fp16 tensor cores" if precision == "fp16" else "")
    if precision == "fp32":
        gpu = ("TF32 tensor cores (XLA's default for fp32 products on compute capability 8.0+; set "
               "jax_default_matmul_precision='highest' for true fp32)" if spec and spec.compute_capability >= (8, 0)
               else "fp32 CUDA cores (no TF32 below compute capability 8.0)")
    return {
        "tpu": "bf16 passes on the MXU (TPUs run fp32 matrix products in bf16 by default)",
        "gpu": gpu,
    }


def _environment(req: PlanRequest, spec: GpuSpec | None) -> dict[str, dict[str, str]]:
    env = {
        "XLA_PYTHON_CLIENT_PREALLOCATE": {
            "value": "false",
            "why": "allocate on demand: on a shared GPU a job should not take 75% of the card at start-up",
        },
        "XLA_PYTHON_CLIENT_MEM_FRACTION": {
            "value": f"{req.memory_fraction:.2f}",
            "why": f"cap this job at {req.memory_fraction:.0%} of each GPU; the plan's budget is computed from it",
        },
        "CUDA_VISIBLE_DEVICES": {
            "value": ",".join(str(i) for i in range(req.gpus)),
            "why": "pin the job to its GPUs (set before JAX is imported)",
        },
    }
    flags = []
    why = []
    if req.gpus > 1:
        flags.append("--xla_gpu_enable_latency_hiding_scheduler=true")
        why.append("overlap the gradient all-reduce with compute across GPUs")
    if flags:
        env["XLA_FLAGS"] = {"value": " ".join(flags), "why": "; ".join(why)}
    return env


def plan_migration(req: PlanRequest, emit: Emit) -> Plan:
    """The plan, by compiles for the target; if a compile fails for a reason other than memory,
    the whole search is redone by the analytic estimate (never a mix of the two), labelled."""
    t0 = time.perf_counter()
    try:
        return _plan(req, emit, MemoryPredictor(req, emit), t0)
    except CompileFailed as exc:
        emit("fallback", message=str(exc))
        return _plan(req, emit, MemoryPredictor(req, emit, estimate_because=str(exc)), t0)


def _plan(req: PlanRequest, emit: Emit, predictor: MemoryPredictor, t0: float) -> Plan:
    w = get_workload(req.workload)
    cfg = w.config(req.preset)
    params = w.param_count(cfg)
    source = TPU_SPECS[req.source]

    if req.target == "local":
        local = jax.devices()[0]
        spec = gpu_spec_for_device_kind(local.device_kind) if local.platform == "gpu" else None
        stats = local.memory_stats() or {}
        device_memory = (spec.memory_bytes if spec else None) or stats.get("bytes_limit") or _host_memory()
        target_name = f"this machine: {local.device_kind} ({local.platform})"
    else:
        spec = GPU_SPECS[req.target]
        device_memory = spec.memory_bytes
        target_name = spec.name
    budget = int(device_memory * req.memory_fraction * (1 - req.safety_margin))
    emit("plan_started", method=predictor.method, note=predictor.note, budget_bytes=budget)

    decisions: list[Decision] = []
    bf16_ok = spec.bf16_native if spec else True
    precision = req.precision or ("bf16" if bf16_ok else "fp16")
    decisions.append(Decision("precision", precision, (
        f"override: {req.precision}" if req.precision else
        f"{target_name} computes bf16 natively: bf16 compute with float32 parameters and AdamW state, no loss scaling"
        if bf16_ok else
        f"{target_name} has no native bf16: fp16 compute, float32 master weights, dynamic loss scaling "
        "(halve and skip on overflow)")))

    needed = math.ceil(req.global_batch / req.gpus)
    limit = min(needed, req.max_per_device_batch)
    candidates = batch_candidates(limit, req.granularity)
    measure = lambda remat: (lambda b: predictor.predict(precision, remat, b))

    exact = exact_candidates(candidates, req.global_batch, req.gpus)
    search_set = exact or candidates
    max_batch = _search_policies(req, predictor, precision, search_set, limit, budget, measure)
    best = max(max_batch.values()) if max_batch else 0
    if best == 0:
        return _infeasible(req, predictor, precision, budget, device_memory, target_name, params, decisions, t0, emit, spec)

    if req.remat:
        remat = req.remat
        reason = f"override: {remat}"
    else:
        reaching = [r for r in REMAT_ORDER if max_batch.get(r) == limit]
        if reaching:
            remat = reaching[0]
            reason = (f"the cheapest policy that fits the needed per-device batch {limit} "
                      f"({REMAT_RECOMPUTE[remat]})")
        else:
            remat = next(r for r in REMAT_ORDER if r in max_batch and max_batch[r] * 2 >= best)
            reason = (f"no policy fits {limit} per device; the largest batches are "
                      + ", ".join(f"{r}: {b}" for r, b in max_batch.items())
                      + f". {remat} is the cheapest within a factor 2 of the largest "
                      f"({REMAT_RECOMPUTE[remat]}); accumulation makes up the rest")
    decisions.append(Decision("remat", remat, reason))

    if req.accumulation_steps:
        steps = req.accumulation_steps
        b = min(max_batch[remat], math.ceil(req.global_batch / (req.gpus * steps)))
        from migration.plan import Accumulation

        acc = Accumulation(b, steps, b * req.gpus * steps, b * req.gpus * steps == req.global_batch,
                           f"override: {steps} accumulation steps")
    else:
        acc = keep_global_batch(req.global_batch, req.gpus, max_batch[remat], search_set)
    peak = predictor.predict(precision, remat, acc.per_device_batch, acc.accumulation_steps)
    while (peak is None or peak > budget) and acc.per_device_batch > 1:
        # the accumulator and the stacked micro-batches need room too: step down and re-check
        smaller = max(c for c in search_set if c < acc.per_device_batch)
        acc = keep_global_batch(req.global_batch, req.gpus, smaller, search_set)
        peak = predictor.predict(precision, remat, acc.per_device_batch, acc.accumulation_steps)
    decisions.append(Decision("per_device_batch", acc.per_device_batch,
                              f"largest allowed ({req.granularity}) batch that fits {_gib(budget)} under remat {remat}: "
                              f"{max_batch[remat]}; predicted peak {_gib(peak)} per GPU"))
    decisions.append(Decision("accumulation_steps", acc.accumulation_steps, acc.reason))
    decisions.append(Decision("xla_flags", "no --xla_gpu_enable_triton_gemm=false", (
        "the guide disables Triton GEMMs 'for stability'; current XLA autotunes cuBLAS against Triton, "
        "so keep them unless a GEMM fails to compile")))

    rot, rot_note = rule_of_thumb_batch(device_memory * req.memory_fraction, params)
    tpu_setup = _tpu_setup_on_target(req, predictor, budget)
    source_compile = _compile_for_source_tpu(req) if req.compile_for_tpu else {"status": "not requested"}
    plan = Plan(
        status="ok", workload=req.workload, preset=req.preset, source=req.source, source_name=source.name,
        source_devices=source.devices, source_per_core_batch=req.source_per_core_batch,
        source_precision=req.source_precision, target=req.target, target_name=target_name, gpus=req.gpus,
        memory_fraction=req.memory_fraction, safety_margin=req.safety_margin, budget_bytes=budget,
        device_memory_bytes=int(device_memory), per_device_batch=acc.per_device_batch,
        accumulation_steps=acc.accumulation_steps, global_batch=acc.global_batch,
        requested_global_batch=req.global_batch, global_batch_exact=acc.exact, precision=precision, remat=remat,
        predicted_peak_bytes=peak, prediction_method=predictor.method, prediction_note=predictor.note,
        param_count=params, compiles=predictor.compiles, cache_hits=predictor.cache_hits,
        search_seconds=round(time.perf_counter() - t0, 2), max_batch_by_remat=max_batch, table=predictor.table,
        candidates=search_set,
        rule_of_thumb_batch=rot, rule_of_thumb_note=rot_note, tpu_setup_on_target=tpu_setup,
        source_tpu_compile=source_compile, matmul_precision=_matmul_precision_notes(spec, precision),
        environment=_environment(req, spec), decisions=decisions, jax_version=jax.__version__,
        planned_on=jax.default_backend(),
    )
    return plan


def _search_policies(req, predictor, precision, candidates, limit, budget, measure) -> dict[str, int]:
    """Largest fitting batch per remat policy, evaluating only the policies the decision needs.

    'none' first (if it reaches the needed batch, nothing else is compiled); then 'full', the
    policy that keeps least; the intermediate policies only when 'full' at least doubles the
    batch, cheapest first, stopping at the first that comes within a factor 2 of 'full'. After
    'none', each search starts from a boundary predicted by an affine model of memory in the
    batch: the batch-independent part from 'none', the per-example part scaled by the analytic
    estimate's ratio between policies.
    """
    if req.remat:
        return {req.remat: largest_fitting(candidates, measure(req.remat), budget)}
    found = {"none": largest_fitting(candidates, measure("none"), budget)}
    if found["none"] == limit:
        return found
    points = sorted((row["per_device_batch"], row["predicted_bytes"]) for row in predictor.table
                    if row["remat"] == "none" and row["predicted_bytes"] is not None)
    model = None
    if len(points) >= 2 and points[-1][0] > points[0][0]:
        (b0, m0), (b1, m1) = points[0], points[-1]
        slope = (m1 - m0) / (b1 - b0)
        model = (m0 - slope * b0, slope)

    def guess(policy: str) -> int | None:
        if model is None:
            return None
        intercept, slope = model
        ratio = (predictor.estimate(precision, policy, 2) - predictor.estimate(precision, policy, 1)) / \
                max(1.0, predictor.estimate(precision, "none", 2) - predictor.estimate(precision, "none", 1))
        return int((budget - intercept) / max(1.0, slope * ratio))

    found["full"] = largest_fitting(candidates, measure("full"), budget, known_fit=found["none"],
                                    first_guess=guess("full"))
    if found["full"] < 2 * max(1, found["none"]) and found["full"] < limit:
        return found
    known = found["none"]
    for mid in ("dots", "dots_no_batch"):
        found[mid] = largest_fitting(candidates, measure(mid), budget, known_fit=known, first_guess=guess(mid))
        known = found[mid]
        if found[mid] == limit or found[mid] * 2 >= found["full"]:
            break
    return found


def _tpu_setup_on_target(req: PlanRequest, predictor: MemoryPredictor, budget: int) -> dict[str, Any]:
    """How the unchanged TPU-style setup (per-core batch, source precision, no remat) fares on the target."""
    b = req.source_per_core_batch
    peak = predictor.predict(req.source_precision, "none", b, record=False)
    fits = peak is not None and peak <= budget
    return {"per_device_batch": b, "precision": req.source_precision, "remat": "none",
            "predicted_peak_bytes": peak, "budget_bytes": budget, "fits": fits,
            "summary": (f"the TPU-style setup ({b} per device, {req.source_precision}, no remat) "
                        + (f"fits: {_gib(peak)} of {_gib(budget)}" if fits else
                           f"does not fit: {_gib(peak)} needed, {_gib(budget)} available"
                           + (f" ({peak / budget:.1f}x)" if peak else "")))}


def _compile_for_source_tpu(req: PlanRequest) -> dict[str, Any]:
    """The TPU-style setup compiled for the source TPU, where libtpu is installed."""
    source = TPU_SPECS[req.source]
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(source.topology, "tpu")
    except Exception as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        return {"status": "unavailable", "reason": f"no TPU compiler here (libtpu not installed?): {first}"}
    try:
        from jax.sharding import AxisType

        mesh = jax.make_mesh((source.devices,), ("data",), axis_types=(AxisType.Auto,), devices=topo.devices)
        cfg = RunConfig(workload=req.workload, preset=req.preset, per_device_batch=req.source_per_core_batch,
                        devices=source.devices, precision=req.source_precision, remat="none")
        program = TrainProgram.from_config(cfg)
        stats = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile().memory_analysis()
        peak = int(stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes
                   + stats.temp_size_in_bytes)
        return {"status": "ok", "peak_bytes_per_chip": peak, "hbm_bytes_per_device": source.hbm_bytes_per_device,
                "device_kind": topo.devices[0].device_kind}
    except Exception as exc:
        text = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else type(exc).__name__
        if any(m in text for m in OOM_MARKERS):
            # The TPU compiler itself says the unchanged setup exceeds the source's HBM.
            return {"status": "does-not-fit", "reason": text, "hbm_bytes_per_device": source.hbm_bytes_per_device,
                    "device_kind": topo.devices[0].device_kind}
        return {"status": "failed", "reason": text}


def _infeasible(req, predictor, precision, budget, device_memory, target_name, params, decisions, t0, emit, spec) -> Plan:
    floor = predictor.predict(precision, "full", 1)
    state_bytes = 16 * params
    why = (f"does not fit even at batch 1, because the step needs {_gib(floor)} per GPU with full remat "
           f"against a budget of {_gib(budget)} ({req.memory_fraction:.0%} of {_gib(device_memory)} minus a "
           f"{req.safety_margin:.0%} margin); parameters, gradients and AdamW state alone take "
           f"{_gib(state_bytes)} ({params:,} parameters x 16 bytes).")
    helps = ["a GPU with more memory", "a smaller preset"]
    if req.memory_fraction < 0.95:
        helps.insert(0, "a larger memory share")
    helps.append("sharding parameters and optimizer state over more GPUs (FSDP; this planner replicates them, "
                 "so more GPUs alone do not help)")
    message = why + " What would help: " + "; ".join(helps) + "."
    emit("infeasible", message=message)
    return Plan(
        status="infeasible", workload=req.workload, preset=req.preset, source=req.source,
        source_name=TPU_SPECS[req.source].name, source_devices=TPU_SPECS[req.source].devices,
        source_per_core_batch=req.source_per_core_batch, source_precision=req.source_precision, target=req.target,
        target_name=target_name, gpus=req.gpus, memory_fraction=req.memory_fraction,
        safety_margin=req.safety_margin, budget_bytes=budget, device_memory_bytes=int(device_memory),
        per_device_batch=0, accumulation_steps=0, global_batch=0, requested_global_batch=req.global_batch,
        global_batch_exact=False, precision=precision, remat="full", predicted_peak_bytes=floor,
        prediction_method=predictor.method, prediction_note=predictor.note, param_count=params,
        compiles=predictor.compiles, cache_hits=predictor.cache_hits,
        search_seconds=round(time.perf_counter() - t0, 2), max_batch_by_remat={}, table=predictor.table, candidates=[],
        rule_of_thumb_batch=rule_of_thumb_batch(device_memory * req.memory_fraction, params)[0],
        rule_of_thumb_note=rule_of_thumb_batch(device_memory * req.memory_fraction, params)[1],
        tpu_setup_on_target={}, source_tpu_compile={"status": "not requested"},
        matmul_precision=_matmul_precision_notes(spec, precision), environment=_environment(req, spec),
        decisions=decisions, message=message, jax_version=jax.__version__, planned_on=jax.default_backend(),
    )


def _host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 2**30


def _gib(n: int | float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"
