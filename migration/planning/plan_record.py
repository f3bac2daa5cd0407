"""The plan record: what a planning pass (`planner.py`) found, written as the `Plan` a user reads. Each
decision with its reason (precision, layout, remat policy, per-device batch, accumulation, link domains,
the cuDNN recommendation), the chosen step's time from its compiled program, the state per GPU, the TPU
job it starts from and the comparison with it (`compare.py`), or, where nothing fits, why and what would
help. A few figures here need one more compile of the chosen choice (another precision, cuDNN's
attention, the TPU side): by the same predictor and step-time model that chose it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

import jax

from migration.common import fmt_gib, fmt_seconds
from migration.config.layouts import parse_layout
from migration.config.limits import FP8_PRECISIONS, LIMITS, state_bytes_per_param
from migration.config.requests import PlanRequest
from migration.hardware import MATMUL_UNITS, TPU_SPECS, fp32_matmul_precision, matmul_unit
from migration.planning import steptime
from migration.planning.capability import planned_model
from migration.planning.compare import compare
from migration.planning.deployment import block_params, mesh_of, plan_environment
from migration.planning.hlo_cost import Kernel
from migration.planning.memory import CompileFailed, MemoryPredictor, Target
from migration.planning.ranking import full_key
from migration.planning.routed_experts import TENSOR_CORE_ROWS, capacity_rows
from migration.planning.search import RECOMPUTE_NOTE, Choice, describe_choice, rule_of_thumb_batch
from migration.planning.source import source_sharding, tpu_setup_on_target
from migration.results import Decision, Plan
from migration.step.policies import PRECISION_POLICIES
from workloads import get_workload

if TYPE_CHECKING:
    from migration.planning.planner import Key, Planner


def precision_reason(req: PlanRequest, target: Target) -> str:
    name = target.name
    if req.precision in FP8_PRECISIONS:
        emulated = " (emulated on the CPU backend: converted and computed wider, no fp8 speed)" \
            if target.platform == "cpu" else ""
        return f"override: {req.precision}: {PRECISION_POLICIES[req.precision].description}{emulated}"
    if req.precision:
        return f"override: {req.precision}"
    if target.bf16_native:
        return f"{name} computes bf16 natively: bf16 compute with float32 parameters and AdamW state, no loss scaling"
    return (f"{name} has no native bf16: fp16 compute, float32 master weights, dynamic loss scaling "
            "(halve and skip on overflow)")


# -- a plan that fits ----------------------------------------------------------------------------
def ok_plan(p: Planner, chosen: Choice, peak: int, max_batch: dict[Key, int], ranked: list[Choice],
            rejected: list[dict[str, Any]]) -> Plan:
    req, d = p.req, p.decisions
    d.append(Decision("sharding", chosen.sharding, sharding_reason(p, chosen, ranked)))
    d.append(Decision("remat", chosen.remat, remat_reason(p, chosen, max_batch)))
    d.append(Decision("per_device_batch", chosen.per_device_batch, batch_reason(p, chosen, peak, rejected)))
    d.append(Decision("accumulation_steps", chosen.accumulation_steps,
                      (f"override: {req.accumulation_steps}; " if req.accumulation_steps else "")
                      + describe_choice(chosen, req.global_batch, req.gpus)))
    d.append(Decision("xla_flags", "no --xla_gpu_enable_triton_gemm=false", (
        "the guide disables Triton GEMMs 'for stability'; current XLA autotunes cuBLAS against Triton, "
        "so keep them unless a GEMM fails to compile")))
    if req.nodes > 1:
        d.append(nodes_decision(p))
    tpu_setup = tpu_setup_on_target(req, p.predictor, p.target.budget_bytes, chosen.sharding)
    source_compile = p.source.result()
    step = step_time(p, chosen)
    if p.compare and step.get("source") == "compiled program":
        step["other_precision"], step["other_precision_s"] = p.compare, seconds_in(p, chosen, p.compare)
    if req.domains > 1:
        d.append(domains_decision(p, chosen))
    saving = cudnn_saving(p, chosen, peak, step.get("seconds"))
    if saving:
        d.append(saving)
    d.append(Decision("step_time", None if step["seconds"] is None else round(step["seconds"], 6), step["method"]))
    return compared(p, Plan(
        status="ok", per_device_batch=chosen.per_device_batch, accumulation_steps=chosen.accumulation_steps,
        global_batch=chosen.global_batch, global_batch_exact=chosen.exact, remat=chosen.remat,
        remat_chosen_by="override" if req.remat else "search", predicted_peak_bytes=peak,
        predicted_step_s=step["seconds"], step_time=step,
        tpu_setup_on_target=tpu_setup, source_tpu_compile=source_compile, decisions=d,
        state=state_per_gpu(p, chosen), **common_fields(p, max_batch, ranked, rejected, chosen.sharding)))


def batch_reason(p: Planner, chosen: Choice, peak: int, rejected: list[dict[str, Any]]) -> str:
    seconds = p.ranking.compiled_seconds(chosen)
    summary = ranking_summary(p)
    timed = (f"compiled step {step_text(p, seconds)}, the fastest of {summary['timed']} fitting choice(s) "
             f"compiled and timed (analytic estimate {step_text(p, chosen.step_cost)})" if seconds is not None
             else f"predicted step {step_text(p, chosen.step_cost)} (analytic: no compiled program to time)")
    return (f"predicted peak {fmt_gib(peak)} of a {fmt_gib(p.target.budget_bytes)} budget per GPU "
            f"(compiled with its {chosen.accumulation_steps} accumulation step(s)); {timed}, device fill "
            f"{chosen.fill:.0%}"
            + (f"; {len(rejected)} choice(s) ranked before it did not fit once accumulation was added"
               if rejected else ""))


def nodes_decision(p: Planner) -> Decision:
    req, target = p.req, p.target
    over = (f"collectives cross nodes over {target.link_note}" if req.domains > 1 or req.domain <= req.node_gpus
            else f"the nodes share one NVLink domain: collectives between them stay on {target.link_note}")
    host = target.spec.gpus_per_host if target.spec else None
    return Decision("nodes", req.nodes, (
        f"{req.gpus} GPUs as {req.nodes} nodes of {min(req.gpus, req.node_gpus)}"
        + (f" ({target.name} hosts hold {host} GPUs)" if host and req.gpus_per_node > host else "")
        + ": one process per node calls jax.distributed.initialize() before anything else, and the mesh "
        f"spans every GPU; {over}"))


def compared(p: Planner, plan: Plan) -> Plan:
    """The plan with the TPU job beside it (planning/compare.py), from the two sides' step times."""
    req = p.req
    w = get_workload(req.workload)
    cfg = w.config(req.preset, p.predictor.model)
    plan.comparison = compare(
        plan, train=req.train_tokens, prices=req.prices,
        measured_tpu_step_s=req.tpu_step_ms / 1e3 if req.tpu_step_ms else None,
        flops_per_example=w.flops_per_example(cfg), tokens_per_example=w.tokens_per_example(cfg),
        gpu_peak_flops=p.target.peak_flops(p.precision),
        local_key=p.target.spec.key if p.target.spec else None)
    if plan.comparison.get("tpu_fit"):
        plan.decisions.append(Decision("tpu_setup", "does not fit the TPU", plan.comparison["tpu_fit"]))
    if (plan.comparison.get("trust") or {}).get("text"):
        plan.decisions.append(Decision("tpu_step", "measured", plan.comparison["trust"]["text"]))
    return plan


# -- a plan where nothing fits -------------------------------------------------------------------
def infeasible_plan(p: Planner, max_batch: dict[Key, int], ranked: list[Choice], rejected: list[dict[str, Any]]) -> Plan:
    req, budget = p.req, p.target.budget_bytes
    policy = req.remat or "full"
    mode = p.modes[-1]
    if not ranked and any(max_batch.values()):
        floor = None
        why = (f"the batches that fit a budget of {{budget}} ({', '.join(f'{key_name(p, k)}: {b}' for k, b in max_batch.items())} "
               f"per GPU) would need more than {int(LIMITS['accumulation_steps'][1])} accumulation steps to reach "
               f"the global batch {req.global_batch}")
        mode, policy = max(max_batch, key=max_batch.get)
    elif rejected:
        fastest = rejected[0]
        floor = fastest["predicted_peak_bytes"]
        why = (f"no choice fits once accumulation is added: the fastest, {fastest['per_device_batch']} per GPU x "
               f"{fastest['accumulation_steps']} accumulation under remat {fastest['remat']}, needs {fmt_gib(floor)} "
               "against a budget of {budget}")
        policy, mode = fastest["remat"], fastest["sharding"]
    else:
        floor = p.predictor.predict(p.precision, policy, 1, sharding=mode)
        tried = ", ".join(key_name(p, k) for k in max_batch) or policy
        why = (f"does not fit even at batch 1 with remat {policy} (policies tried: {tried}), because the step "
               f"needs {fmt_gib(floor)} per GPU against a budget of {{budget}}")
    shards = round(1 / p.predictor.state_fraction(mode))
    per_param = p.predictor.state_per_param()
    state_bytes = per_param * p.params * p.predictor.state_fraction(mode)
    budget_text = (f"{fmt_gib(budget)} ({req.memory_fraction:.0%} of {fmt_gib(p.target.device_memory_bytes)} "
                   f"minus a {req.safety_margin:.0%} margin)")
    message = (why.format(budget=budget_text) + "; parameters, "
               f"gradients and AdamW state alone take {fmt_gib(state_bytes)} per GPU ({p.params:,} parameters x {per_param} "
               f"bytes{f' / {shards} GPUs ({mode})' if shards > 1 else ''}). "
               "What would help: " + "; ".join(what_would_help(req, mode, state_bytes < budget and dropless_on_gpu(req, p.predictor.model, p.target.platform))) + ".")
    p.emit("infeasible", message=message)
    return compared(p, Plan(
        status="infeasible", per_device_batch=0, accumulation_steps=0, global_batch=0,
        global_batch_exact=False, remat=policy, remat_chosen_by="override" if req.remat else "search",
        predicted_peak_bytes=floor, predicted_step_s=None, tpu_setup_on_target={},
        source_tpu_compile={"status": "not requested", "reason": "the plan is infeasible: the TPU side is compiled "
                                                                "for a feasible plan only"},
        decisions=p.decisions, message=message, **common_fields(p, max_batch, ranked, rejected, mode)))


def dropless_on_gpu(req: PlanRequest, model: dict[str, Any], platform: str) -> bool:
    """Whether the plan is a dropless mixture-of-experts model's (its dimension overrides `model`) for a GPU
    target (whose XLA compiles the grouped products as a loop over the experts: docs/moe.md)."""
    cfg = get_workload(req.workload).config(req.preset, model)
    return platform == "gpu" and getattr(cfg, "dispatch", "") == "dropless"


def what_would_help(req: PlanRequest, mode: str, dropless_on_gpu: bool = False) -> list[str]:
    helps = ["a GPU with more memory", "a smaller model"]
    if dropless_on_gpu:
        helps.insert(0, "capacity dispatch (--dim dispatch=capacity, MaxText's sparse_matmul false): this XLA "
                        "compiles the dropless grouped products for a GPU as a loop over the experts, each over every "
                        "routed row, in many times the memory and FLOPs of grouped products (docs/moe.md)")
    if req.memory_fraction < 0.95:
        helps.insert(0, "a larger memory share")
    if req.remat and req.remat != "full":
        helps.insert(0, "remat full (or let the planner choose the policy)")
    if parse_layout(mode).shards_state():
        helps.append(f"more GPUs than {req.gpus} (FSDP shares parameters, gradients and optimizer state among them)")
    elif req.sharding == "replicated":
        helps.append("sharding the state over the GPUs (leave sharding to the planner, or FSDP)")
    else:
        helps.append(f"several GPUs with the state sharded over them (FSDP: "
                     f"{state_bytes_per_param(req.mu_dtype)} bytes per parameter / GPUs)")
    return helps


# -- the fields every plan has -------------------------------------------------------------------
def common_fields(p: Planner, max_batch: dict[Key, int], ranked: list[Choice], rejected: list[dict[str, Any]],
                  sharding: str) -> dict[str, Any]:
    req, t, source = p.req, p.target, TPU_SPECS[p.req.source]
    by_sharding: dict[str, dict[str, int]] = {}
    for (mode, remat), b in max_batch.items():
        by_sharding.setdefault(mode, {})[remat] = b
    rot, rot_note = rule_of_thumb_batch(t.device_memory_bytes * req.memory_fraction, p.params)
    w = get_workload(req.workload)
    return dict(
        workload=req.workload, preset=req.preset, source=req.source, source_name=source.named(req.source_slices),
        source_devices=req.source_devices, source_slices=req.source_slices, mu_dtype=req.mu_dtype,
        source_per_core_batch=req.source_per_core_batch,
        source_precision=req.source_precision, target=req.target, target_name=t.name, gpus=req.gpus,
        memory_fraction=req.memory_fraction, safety_margin=req.safety_margin, budget_bytes=t.budget_bytes,
        device_memory_bytes=int(t.device_memory_bytes), budget_source=t.budget_source,
        requested_global_batch=req.global_batch, precision=p.precision,
        prediction_method=p.predictor.method, prediction_note=p.predictor.note, param_count=p.params,
        compiles=p.predictor.compiles, cache_hits=p.predictor.cache_hits,
        ruled_out_by_bound=p.predictor.ruled_out, parallel_compiles=p.predictor.parallel,
        search_seconds=round(time.perf_counter() - p.t0, 2), max_batch_by_remat=by_sharding.get(sharding, {}),
        max_batch_by_sharding=by_sharding, model=p.predictor.model, sharding=sharding, nodes=req.nodes,
        gpus_per_node=min(req.gpus, req.node_gpus), domain_gpus=req.domain, source_job=source_job(p),
        interconnect=t.link_note,
        table=p.predictor.table, candidates=p.candidates,
        ranked=p.ranking.rows(ranked), ranking=ranking_summary(p),
        mesh=mesh_of(sharding, req.gpus, p.per_node, req.nodes),
        rule_of_thumb_batch=rot, rule_of_thumb_note=rot_note, matmul_precision=matmul_precision_notes(t, p.precision),
        environment=plan_environment(memory_fraction=req.memory_fraction, gpus=req.gpus, nodes=req.nodes,
                                     gpus_per_node=req.node_gpus, sharding=sharding, precision=p.precision,
                                     compute_capability=t.compute_capability,
                                     block_params=block_params(w, w.config(req.preset, p.predictor.model))),
        jax_version=jax.__version__,
        planned_on=jax.default_backend(),
        planned_device_kind=t.device_kind,
    )


def ranking_summary(p: Planner) -> dict[str, Any]:
    not_searched = sorted({k[0] for k in p.skipped} - {k[0] for k in p.searched})
    return p.ranking.summary(p.modes, not_searched)


def matmul_precision_notes(target: Target, precision: str) -> dict[str, str]:
    fp32 = fp32_matmul_precision(target.platform, target.compute_capability, None)
    gpu = MATMUL_UNITS[matmul_unit(precision, fp32)]
    if precision == "fp32" and fp32 == "tf32":
        gpu += "; set jax_default_matmul_precision='highest' for true fp32"
    return {"tpu": "bf16 passes on the MXU (TPUs run fp32 matrix products in bf16 by default)", "gpu": gpu}


def state_per_gpu(p: Planner, chosen: Choice) -> dict[str, Any]:
    """Bytes of the state per GPU: the compiled step's state arguments (parameters and AdamW's two
    moments) against 12 bytes per parameter (10 with a bfloat16 first moment) over the GPUs holding a
    share, and with the gradients (4 bytes per parameter, same share) against 16 (14) bytes per parameter."""
    share = 1 / p.predictor.state_fraction(chosen.sharding)  # GPUs a parameter's bytes are shared by, on average
    share = round(share) if abs(share - round(share)) < 1e-6 else round(share, 2)
    compiled = p.predictor.state_bytes.get((*full_key(chosen), p.precision))
    per_param = p.predictor.state_per_param()
    arithmetic = per_param * p.params / share
    with_grads = None if compiled is None else compiled + 4 * p.params / share
    return {"sharding": chosen.sharding, "shared_by": share, "param_count": p.params,
            "compiled_state_bytes_per_gpu": compiled, "arithmetic_state_bytes_per_gpu": (per_param - 4) * p.params / share,
            "state_with_gradients_bytes_per_gpu": with_grads, "arithmetic_bytes_per_gpu": arithmetic,
            "difference": None if with_grads is None else round(with_grads / arithmetic - 1, 4),
            "how": f"compiled arguments of the step ({p.predictor.method}) plus float32 gradients "
                   f"(4 bytes x {p.params:,} / {share}), against {per_param} bytes x {p.params:,} / {share}"
                   + ("" if p.req.mu_dtype == "float32" else " (AdamW's first moment in bfloat16: mu_dtype)"),
            "mu_dtype": p.req.mu_dtype}


def source_job(p: Planner) -> dict[str, Any]:
    """How the TPU job held its state on the source slice."""
    req = p.req
    src = TPU_SPECS[req.source]
    state = p.predictor.state_per_param() * p.params
    sharding = source_sharding(req, p.params)
    per_chip = state / (src.devices if sharding == "fsdp" else 1)
    across = "" if req.source_slices == 1 else f", data parallel across its {req.source_slices} slices"
    split = [f"{n} over {v} chips ({k})" for n, v, k in (("tensor parallelism", req.source_tensor, "ici_tensor_parallelism"),
                                                         ("expert parallelism", req.source_expert, "ici_expert_parallelism"))
             if v > 1]
    why = (f"given: {sharding}{across}" if req.source_sharding else
           f"given: {' and '.join(split)}, with the state sharded over the slice{across}" if split else
           "replicated under pmap: the state fits one chip" + across if sharding == "replicated" else
           f"the state ({fmt_gib(state)}) exceeds one chip's {fmt_gib(src.hbm_bytes_per_device)}: it must have been "
           f"sharded over the slice's {src.devices} devices{across}")
    return {"devices": req.source_devices, "hbm_bytes_per_device": src.hbm_bytes_per_device, "sharding": sharding,
            "slices": req.source_slices,
            "state_bytes_per_device": int(per_chip), "why": why, "pod_slice": src.is_pod_slice}


# -- the reasons ---------------------------------------------------------------------------------
def step_text(p: Planner, seconds: float | None) -> str:
    return "n/a (no peak for this device)" if seconds is None or not p.cost.peak_flops else fmt_seconds(seconds)


def key_name(p: Planner, key: Key) -> str:
    """A (sharding, remat) pair as text: the remat name alone when one sharding was searched."""
    return key[1] if len(p.modes) == 1 else f"{key[0]}/{key[1]}"


def remat_reason(p: Planner, chosen: Choice, max_batch: dict[Key, int]) -> str:
    if p.req.remat:
        return f"override: {p.req.remat} (the planner did not compare policies)"
    searched = ", ".join(f"{key_name(p, k)}: {b}" for k, b in max_batch.items())
    why = (f"fastest predicted step among the fitting choices ({RECOMPUTE_NOTE[chosen.remat]}); largest batch per "
           f"policy searched: {searched}")
    if p.skipped:
        why += "; not searched, since even their fastest possible step (the largest micro-batch allowed) is slower: " + ", ".join(
            f"{key_name(p, k)} (at least {step_text(p, b)})" for k, b in p.skipped.items())
    return why


def sharding_reason(p: Planner, chosen: Choice, ranked: list[Choice]) -> str:
    lay = parse_layout(chosen.sharding)
    what = lay.describe(p.req.gpus, p.per_node)
    if p.sharding_forced:
        why = p.sharding_forced
    else:
        others = {}
        for c in ranked:
            seconds = p.ranking.timed.get(full_key(c))
            if c.sharding != chosen.sharding and c.exact and seconds is not None:
                if c.sharding not in others or seconds < others[c.sharding][0]:
                    others[c.sharding] = (seconds, c)
        mine = p.ranking.compiled_seconds(chosen)
        if not others:
            why = (f"{what}: the only layout searched that fits the global batch"
                   if not any(k[0] != chosen.sharding for k in p.skipped) else
                   f"{what}: the other layouts cannot beat it even at their fastest possible step (not searched)")
        else:
            why = f"{what}: fastest compiled step, {step_text(p, mine)} against " + ", ".join(
                f"{name} {step_text(p, t)} ({c.per_device_batch} per GPU x {c.accumulation_steps})"
                for name, (t, c) in sorted(others.items(), key=lambda kv: kv[1][0]))
        if p.replicated_note:
            why += f"; not replicated: {p.replicated_note}"
    comm = p.cost.communication
    if comm and p.req.gpus > 1:
        moved = comm.bytes_per_micro_batch(chosen.sharding, chosen.remat)
        why += (f"; collectives move {fmt_gib(moved)} per GPU per micro-batch"
                + (f", {step_text(p, p.cost.comm_seconds(chosen.sharding, chosen.accumulation_steps, chosen.remat))} "
                   f"per step over {p.target.link_note}" if p.target.link_bytes_per_s else "")
                + " (analytic; overlapped with compute by XLA's latency-hiding scheduler)")
    return why


# -- the chosen step's figures -------------------------------------------------------------------
def step_time(p: Planner, chosen: Choice) -> dict[str, Any]:
    """The chosen step's predicted time: from its compiled program where the planner compiled it
    for a GPU (steptime.py), else the analytic model's (FLOPs at the calibrated share of the peak,
    collectives over the link), saying which and how far off it is expected to be."""
    analytic = chosen.step_cost if p.cost.peak_flops else None
    kernels = p.ranking.kernels(*full_key(chosen))
    spec = p.target.spec
    if kernels and spec is not None:
        found = steptime.predict(kernels, spec, p.ranking.links())
        model = get_workload(p.req.workload).config(p.req.preset, p.predictor.model)
        error = (steptime.EXPECTED_ERROR_XLA_ATTENTION if getattr(model, "attention", "") == "xla"
                 and getattr(model, "seq_len", 0) >= 1024 and getattr(model, "layer_loop", "") == "scan"
                 else steptime.EXPECTED_ERROR_FP8 if p.precision in FP8_PRECISIONS else steptime.EXPECTED_ERROR)
        return {"seconds": found.seconds, "method": found.method(spec, p.target.link_note or "no link", error)
                + steptime.exchange_text(kernels) + capacity_rows_text(model, chosen, kernels),
                "source": "compiled program", "expected_error": error, "compute_s": found.compute_s,
                "matmul_s": found.matmul_s, "memory_bound_s": found.memory_s, "communication_s": found.communication_s,
                "exposed_communication_s": found.exposed_communication_s, "compiled_flops": found.flops,
                "kernels": found.kernels, "analytic_s": analytic,
                "tile_padding_flops": sum(k.flops for k in kernels if k.name == "expert_tile_padding")}
    if analytic is None:
        return {"seconds": None, "method": "no step time: this device has no known peak", "source": "none",
                "expected_error": None, "analytic_s": None}
    return {"seconds": analytic, "source": "analytic", "expected_error": None, "analytic_s": analytic,
            "method": (f"analytic: the model's FLOPs at {steptime.CALIBRATION.matmul:.0%} of the dense peak, scaled "
                       f"by the device fill and the policy's recompute, collectives over the link; not checked "
                       f"against a compiled program ({p.predictor.method})")}


def capacity_rows_text(model: Any, chosen: Choice, kernels: list[Kernel]) -> str:
    """Where capacity dispatch leaves each expert fewer rows a micro-batch than a tensor-core tile, what the
    step time counts for it (routed_experts.tile_padding; docs/moe.md)."""
    padding = sum(k.flops for k in kernels if k.name == "expert_tile_padding")
    if not padding:
        return ""
    rows = capacity_rows(model, chosen.per_device_batch, parse_layout(chosen.sharding).expert)
    return (f"; the experts' products have {rows} rows an expert a micro-batch at capacity dispatch, fewer than a "
            f"{TENSOR_CORE_ROWS}-row tensor-core tile: the padding's {padding / 1e12:,.2f} TFLOP a GPU counted")


def cudnn_saving(p: Planner, chosen: Choice, peak: int, seconds: float | None) -> Decision | None:
    """Where the user's code runs XLA's attention on a GPU that runs cuDNN's fused kernel: the same
    choice compiled with the fused kernel, its step time and peak beside the plan's (one more compile,
    by the same model that times the plan), as a recommendation."""
    if p.predictor.model.get("attention") != "xla" or not p.ranking.timing or seconds is None:
        return None
    fused_model, fused = planned_model(dataclasses.replace(p.req, model={
        k: v for k, v in p.req.model.items() if k != "attention"}), p.target, p.precision)
    if fused is None or fused.value != "cudnn":
        return None
    other = MemoryPredictor(p.req, lambda *a, **k: None, model=fused_model, workers=0)
    try:
        other_peak = other.predict(p.precision, chosen.remat, chosen.per_device_batch,
                                   chosen.accumulation_steps, record=False, sharding=chosen.sharding)
        kernels = other.programs.get((*full_key(chosen), p.precision))
    except CompileFailed:
        return None
    finally:
        other.close()
    if not kernels or other_peak is None:
        return None
    fused_s = steptime.predict(kernels, p.target.spec, p.ranking.links()).seconds
    return Decision("attention_saving", round(1 - fused_s / seconds, 4), (
        f"recommendation: cuDNN's fused attention (jax.nn.dot_product_attention(..., implementation='cudnn')) "
        f"for the same choice: compiled step {fmt_seconds(fused_s)} instead of {fmt_seconds(seconds)} "
        f"({1 - fused_s / seconds:+.0%} time saved), peak {fmt_gib(other_peak)} instead of {fmt_gib(peak)} per GPU; "
        "the scores are never stored, so a larger batch or a cheaper remat policy may then fit (plan again "
        "with attention cudnn)"))


def seconds_in(p: Planner, chosen: Choice, precision: str) -> float | None:
    """The chosen step compiled in another precision (same layout, policy, batch and accumulation) and
    timed by the same model; None where it does not fit or cannot be timed."""
    try:
        peak = p.predictor.predict(precision, chosen.remat, chosen.per_device_batch, chosen.accumulation_steps,
                                   record=False, sharding=chosen.sharding)
    except CompileFailed:
        return None
    kernels = p.ranking.kernels(*full_key(chosen), precision)
    if peak is None or not kernels or p.target.spec is None:
        return None
    return steptime.predict(kernels, p.target.spec, p.ranking.links()).seconds


def domains_decision(p: Planner, chosen: Choice) -> Decision:
    """The link domains the job spans (nodes, or NVLink domains that span nodes) and what crossing them
    costs the chosen step: its cross-domain collectives over the network against the same ones over the
    link inside a domain, timed from the compiled program by the model that times the step."""
    req, t = p.req, p.target
    full, rest = divmod(req.gpus, req.domain)
    sizes = " + ".join(str(n) for n in [req.domain] * full + ([rest] if rest else []))
    nvlink = t.spec is not None and t.spec.nvlink_domain > req.node_gpus
    text = f"{req.gpus} GPUs span {req.domains} {'NVLink domains' if nvlink else 'nodes'} ({sizes} GPUs)"
    if nvlink and rest:
        text += f", not a multiple of the {t.spec.nvlink_domain}-GPU NVLink domain: the last one is partly filled"
    kernels = p.ranking.kernels(*full_key(chosen))
    links = t.links
    if kernels and t.spec is not None and links is not None and links.network:
        cross, inside = steptime.cross_domain_seconds(kernels, links)
        whole = steptime.predict(kernels, t.spec, links).seconds
        one = steptime.predict(kernels, t.spec, links.intra).seconds
        text += (f"; the step's collectives that cross them take {fmt_seconds(cross)} over the network "
                 f"({links.network * 8 / 1e9:,.0f} Gb/s per GPU) where the link inside a domain would take "
                 f"{fmt_seconds(inside)}: predicted step {fmt_seconds(whole)}, {fmt_seconds(one)} were every "
                 f"collective inside a domain ({whole / one - 1:+.1%})")
    else:
        text += "; collectives between them cross the network (no compiled program to time them)"
    return Decision("link_domains", req.domains, text)
