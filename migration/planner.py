"""The migration planner: from a TPU-style setup to the fastest GPU plan that fits.

Runs inside a planner worker. Fitting is a constraint, found by the compiler (`migration/memory.py`);
the choice among fitting (remat, per-device batch, accumulation) triples that keep the global batch
is by predicted step time (`migration/search.py`: model FLOPs x the policy's recompute factor over
the target's peak, with a penalty for micro-batches too small to fill the device). The winning
choice is compiled with its accumulation before it is accepted: a plan is never `ok` with a
predicted peak over the budget.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import jax

from migration.common import first_line, fmt_gib, is_oom
from migration.config import LIMITS, PlanRequest, RunConfig
from migration.hardware import MATMUL_UNITS, TPU_SPECS, fp32_matmul_precision
from migration.memory import STATE_BYTES_PER_PARAM, CompileFailed, MemoryPredictor, Target, compile_peak, resolve_target
from migration.report import Decision, Plan
from migration.search import (
    RECOMPUTE_NOTE,
    REMAT_ORDER,
    Choice,
    StepCostModel,
    batch_candidates,
    describe_choice,
    exact_candidates,
    largest_fitting,
    rank_choices,
    rule_of_thumb_batch,
)
from migration.train import TrainProgram, make_data_mesh
from workloads import get_workload

Emit = Callable[..., None]
RANKED_SHOWN = 10  # ranked choices kept in the plan
VERIFY_AT_MOST = 6  # ranked choices compiled with their accumulation before giving up


def plan_migration(req: PlanRequest, emit: Emit) -> Plan:
    """The plan, by compiles for the target; if a compile fails for a reason other than memory,
    the whole search is redone by the analytic estimate (never a mix of the two), labelled."""
    t0 = time.perf_counter()
    target = resolve_target(req)
    try:
        return _Planner(req, emit, target, MemoryPredictor(req, emit), t0).plan()
    except CompileFailed as exc:
        emit("fallback", message=str(exc))
        return _Planner(req, emit, target, MemoryPredictor(req, emit, estimate_because=str(exc)), t0).plan()


class _Planner:
    """One planning pass: precision, the per-policy search, the ranking, the verified choice."""

    def __init__(self, req: PlanRequest, emit: Emit, target: Target, predictor: MemoryPredictor, t0: float):
        self.req, self.emit, self.target, self.predictor, self.t0 = req, emit, target, predictor, t0
        w = get_workload(req.workload)
        cfg = w.config(req.preset)
        self.params = w.param_count(cfg)
        self.precision = req.precision or ("bf16" if target.bf16_native else "fp16")
        self.cost = StepCostModel(w.flops_per_example(cfg), w.rows_per_example(cfg), target.fill_rows,
                                  target.peak_flops(self.precision))
        self.needed = math.ceil(req.global_batch / req.gpus)
        self.limit = min(self.needed, req.max_per_device_batch)
        candidates = batch_candidates(self.limit, req.granularity)
        self.candidates = exact_candidates(candidates, req.global_batch, req.gpus) or candidates
        self.decisions = [Decision("precision", self.precision, self._precision_reason())]

    # -- stages ------------------------------------------------------------------------------
    def plan(self) -> Plan:
        budget = self.target.budget_bytes
        self.emit("plan_started", method=self.predictor.method, note=self.predictor.note, budget_bytes=budget)
        self.skipped: dict[str, float] = {}
        max_batch = self.search_policies(self.policies())
        ranked = self.rank(max_batch)
        chosen, peak, rejected = self.verify(ranked)
        if chosen is None and self.skipped:
            # The choices that ruled the other policies out did not fit with their accumulation:
            # search those policies too before giving up.
            max_batch.update(self.search_policies(list(self.skipped), known=max(max_batch.values(), default=0),
                                                  prune=False))
            self.skipped = {}
            ranked = self.rank(max_batch)
            chosen, peak, rejected = self.verify(ranked)
        if chosen is None:
            return self._infeasible(max_batch, ranked, rejected)
        return self._ok(chosen, peak, max_batch, ranked, rejected)

    def policies(self) -> list[str]:
        return [self.req.remat] if self.req.remat else list(REMAT_ORDER)

    def rank(self, max_batch: dict[str, int]) -> list[Choice]:
        return rank_choices(max_batch, self.candidates, self.req.global_batch, self.req.gpus, self.cost,
                            accumulation=self.req.accumulation_steps,
                            max_accumulation=int(LIMITS["accumulation_steps"][1]))

    def search_policies(self, policies: list[str], known: int = 0, prune: bool = True) -> dict[str, int]:
        """Largest fitting batch per remat policy, searching only policies that could still win.

        Policies go from least to most recompute; each search starts from the batch the previous
        policy reached (a policy that keeps less never needs more memory). With `prune`, a policy is
        skipped (and remembered in `self.skipped`) when even a perfectly filled device under it is
        slower than the best choice found so far that keeps the global batch.
        """
        found: dict[str, int] = {}
        best = math.inf
        for remat in policies:
            bound = self.cost.best_possible(remat, self.needed)
            if prune and bound >= best:
                self.skipped[remat] = bound
                self.emit("skip_policy", remat=remat, reason="cannot beat the best choice found so far")
                continue
            measure = lambda b, r=remat: self.predictor.predict(self.precision, r, b)
            # After a policy that fits nothing, the smallest batch is the likeliest boundary: probe it first.
            guess = self.candidates[0] if found and not known else self._guess(remat)
            found[remat] = largest_fitting(self.candidates, measure, self.target.budget_bytes, known_fit=known,
                                           first_guess=guess)
            known = max(known, found[remat])
            exact = [c for c in self.rank({remat: found[remat]}) if c.exact]
            if exact:
                best = min(best, exact[0].step_cost)
        return found

    def verify(self, ranked: list[Choice]) -> tuple[Choice | None, int | None, list[dict[str, Any]]]:
        """The first ranked choice whose compile with its accumulation fits the budget. A choice is
        not compiled when one with the same policy and a batch no larger already failed (its peak
        can only be larger)."""
        rejected: list[dict[str, Any]] = []
        failed: dict[str, int] = {}
        for choice in ranked:
            if choice.accumulation_steps > 1 and choice.per_device_batch >= failed.get(choice.remat, math.inf):
                continue
            peak = self.predictor.predict(self.precision, choice.remat, choice.per_device_batch,
                                          choice.accumulation_steps)
            if peak is not None and peak <= self.target.budget_bytes:
                return choice, peak, rejected
            failed[choice.remat] = min(failed.get(choice.remat, math.inf), choice.per_device_batch)
            rejected.append({**choice.to_dict(self.cost), "predicted_peak_bytes": peak})
        return None, None, rejected

    # -- helpers -----------------------------------------------------------------------------
    def _guess(self, remat: str) -> int | None:
        """The boundary under `remat` from an affine model of memory in the batch: the
        batch-independent part from 'none', the per-example part scaled by the estimate's ratio."""
        points = sorted((row["per_device_batch"], row["predicted_bytes"]) for row in self.predictor.table
                        if row["remat"] == "none" and row["predicted_bytes"] is not None
                        and row["accumulation_steps"] == 1)
        if remat == "none" or len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        (b0, m0), (b1, m1) = points[0], points[-1]
        slope = (m1 - m0) / (b1 - b0)
        est = self.predictor.estimate
        ratio = (est(self.precision, remat, 2) - est(self.precision, remat, 1)) / \
            max(1.0, est(self.precision, "none", 2) - est(self.precision, "none", 1))
        return int((self.target.budget_bytes - (m0 - slope * b0)) / max(1.0, slope * ratio))

    def _precision_reason(self) -> str:
        name = self.target.name
        if self.req.precision:
            return f"override: {self.req.precision}"
        if self.target.bf16_native:
            return f"{name} computes bf16 natively: bf16 compute with float32 parameters and AdamW state, no loss scaling"
        return (f"{name} has no native bf16: fp16 compute, float32 master weights, dynamic loss scaling "
                "(halve and skip on overflow)")

    def _remat_reason(self, chosen: Choice, max_batch: dict[str, int], ranked: list[Choice]) -> str:
        if self.req.remat:
            return f"override: {self.req.remat} (the planner did not compare policies)"
        searched = ", ".join(f"{r}: {b}" for r, b in max_batch.items())
        why = (f"fastest predicted step among the fitting choices ({RECOMPUTE_NOTE[chosen.remat]}); largest batch per "
               f"policy searched: {searched}")
        if self.skipped:
            why += "; not searched, since even a fully used GPU under them is slower: " + ", ".join(
                f"{r} (at least {self._step_text(b)})" for r, b in self.skipped.items())
        return why

    def _step_text(self, seconds: float | None) -> str:
        return "n/a (no peak for this device)" if seconds is None or not self.cost.peak_flops else f"{seconds * 1e3:.1f} ms"

    # -- results -----------------------------------------------------------------------------
    def _common(self, max_batch: dict[str, int], ranked: list[Choice], rejected: list[dict[str, Any]]) -> dict[str, Any]:
        req, t, source = self.req, self.target, TPU_SPECS[self.req.source]
        rot, rot_note = rule_of_thumb_batch(t.device_memory_bytes * req.memory_fraction, self.params)
        return dict(
            workload=req.workload, preset=req.preset, source=req.source, source_name=source.name,
            source_devices=source.devices, source_per_core_batch=req.source_per_core_batch,
            source_precision=req.source_precision, target=req.target, target_name=t.name, gpus=req.gpus,
            memory_fraction=req.memory_fraction, safety_margin=req.safety_margin, budget_bytes=t.budget_bytes,
            device_memory_bytes=int(t.device_memory_bytes), budget_source=t.budget_source,
            requested_global_batch=req.global_batch, precision=self.precision,
            prediction_method=self.predictor.method, prediction_note=self.predictor.note, param_count=self.params,
            compiles=self.predictor.compiles, cache_hits=self.predictor.cache_hits,
            search_seconds=round(time.perf_counter() - self.t0, 2), max_batch_by_remat=max_batch,
            table=self.predictor.table, candidates=self.candidates,
            ranked=[c.to_dict(self.cost) for c in ranked[:RANKED_SHOWN]],
            rule_of_thumb_batch=rot, rule_of_thumb_note=rot_note, matmul_precision=_matmul_precision_notes(t, self.precision),
            environment=_environment(req), jax_version=jax.__version__, planned_on=jax.default_backend(),
            planned_device_kind=t.device_kind,
        )

    def _ok(self, chosen: Choice, peak: int, max_batch: dict[str, int], ranked: list[Choice],
            rejected: list[dict[str, Any]]) -> Plan:
        req = self.req
        d = self.decisions
        d.append(Decision("remat", chosen.remat, self._remat_reason(chosen, max_batch, ranked)))
        d.append(Decision("per_device_batch", chosen.per_device_batch,
                          f"predicted peak {fmt_gib(peak)} of a {fmt_gib(self.target.budget_bytes)} budget per GPU "
                          f"(compiled with its {chosen.accumulation_steps} accumulation step(s)); predicted step "
                          f"{self._step_text(chosen.step_cost)}, device fill {chosen.fill:.0%}"
                          + (f"; {len(rejected)} faster choice(s) did not fit once accumulation was added" if rejected else "")))
        d.append(Decision("accumulation_steps", chosen.accumulation_steps,
                          (f"override: {req.accumulation_steps}; " if req.accumulation_steps else "")
                          + describe_choice(chosen, req.global_batch, req.gpus)))
        d.append(Decision("xla_flags", "no --xla_gpu_enable_triton_gemm=false", (
            "the guide disables Triton GEMMs 'for stability'; current XLA autotunes cuBLAS against Triton, "
            "so keep them unless a GEMM fails to compile")))
        tpu_setup = _tpu_setup_on_target(req, self.predictor, self.target.budget_bytes)
        source_compile = _compile_for_source_tpu(req) if req.compile_for_tpu else {"status": "not requested"}
        return Plan(status="ok", per_device_batch=chosen.per_device_batch, accumulation_steps=chosen.accumulation_steps,
                    global_batch=chosen.global_batch, global_batch_exact=chosen.exact, remat=chosen.remat,
                    remat_chosen_by="override" if req.remat else "search", predicted_peak_bytes=peak,
                    predicted_step_s=chosen.step_cost if self.cost.peak_flops else None,
                    tpu_setup_on_target=tpu_setup, source_tpu_compile=source_compile, decisions=d,
                    **self._common(max_batch, ranked, rejected))

    def _infeasible(self, max_batch: dict[str, int], ranked: list[Choice], rejected: list[dict[str, Any]]) -> Plan:
        req, budget = self.req, self.target.budget_bytes
        policy = req.remat or "full"
        if not ranked and any(max_batch.values()):
            floor = None
            why = (f"the batches that fit a budget of {{budget}} ({', '.join(f'{r}: {b}' for r, b in max_batch.items())} "
                   f"per GPU) would need more than {int(LIMITS['accumulation_steps'][1])} accumulation steps to reach "
                   f"the global batch {req.global_batch}")
            policy = req.remat or max(max_batch, key=max_batch.get)
        elif rejected:
            fastest = rejected[0]
            floor = fastest["predicted_peak_bytes"]
            why = (f"no choice fits once accumulation is added: the fastest, {fastest['per_device_batch']} per GPU x "
                   f"{fastest['accumulation_steps']} accumulation under remat {fastest['remat']}, needs {fmt_gib(floor)} "
                   "against a budget of {budget}")
            policy = fastest["remat"]
        else:
            floor = self.predictor.predict(self.precision, policy, 1)
            tried = ", ".join(max_batch) or policy
            why = (f"does not fit even at batch 1 with remat {policy} (policies tried: {tried}), because the step "
                   f"needs {fmt_gib(floor)} per GPU against a budget of {{budget}}")
        state_bytes = STATE_BYTES_PER_PARAM * self.params
        budget_text = (f"{fmt_gib(budget)} ({req.memory_fraction:.0%} of {fmt_gib(self.target.device_memory_bytes)} "
                       f"minus a {req.safety_margin:.0%} margin)")
        message = (why.format(budget=budget_text) + "; parameters, "
                   f"gradients and AdamW state alone take {fmt_gib(state_bytes)} ({self.params:,} parameters x 16 bytes). "
                   "What would help: " + "; ".join(_what_would_help(req)) + ".")
        self.emit("infeasible", message=message)
        return Plan(status="infeasible", per_device_batch=0, accumulation_steps=0, global_batch=0,
                    global_batch_exact=False, remat=policy, remat_chosen_by="override" if req.remat else "search",
                    predicted_peak_bytes=floor, predicted_step_s=None, tpu_setup_on_target={},
                    source_tpu_compile={"status": "not requested"}, decisions=self.decisions, message=message,
                    **self._common(max_batch, ranked, rejected))


def _what_would_help(req: PlanRequest) -> list[str]:
    helps = ["a GPU with more memory", "a smaller preset"]
    if req.memory_fraction < 0.95:
        helps.insert(0, "a larger memory share")
    if req.remat and req.remat != "full":
        helps.insert(0, "remat full (or let the planner choose the policy)")
    helps.append("sharding parameters and optimizer state over more GPUs (FSDP; this planner replicates them, "
                 "so more GPUs alone do not help)")
    return helps


def _matmul_precision_notes(target: Target, precision: str) -> dict[str, str]:
    fp32 = fp32_matmul_precision(target.platform, target.compute_capability, None)
    gpu = MATMUL_UNITS[precision if precision != "fp32" else fp32]
    if precision == "fp32" and fp32 == "tf32":
        gpu += "; set jax_default_matmul_precision='highest' for true fp32"
    return {"tpu": "bf16 passes on the MXU (TPUs run fp32 matrix products in bf16 by default)", "gpu": gpu}


def _environment(req: PlanRequest) -> dict[str, dict[str, str]]:
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
    if req.gpus > 1:
        env["XLA_FLAGS"] = {"value": "--xla_gpu_enable_latency_hiding_scheduler=true",
                            "why": "overlap the gradient all-reduce with compute across GPUs"}
    return env


def _tpu_setup_on_target(req: PlanRequest, predictor: MemoryPredictor, budget: int) -> dict[str, Any]:
    """How the unchanged TPU-style setup (per-core batch, source precision, no remat) fares on the target."""
    b = req.source_per_core_batch
    peak = predictor.predict(req.source_precision, "none", b, record=False)
    fits = peak is not None and peak <= budget
    return {"per_device_batch": b, "precision": req.source_precision, "remat": "none",
            "predicted_peak_bytes": peak, "budget_bytes": budget, "fits": fits,
            "summary": (f"the TPU-style setup ({b} per device, {req.source_precision}, no remat) "
                        + (f"fits: {fmt_gib(peak)} of {fmt_gib(budget)}" if fits else
                           f"does not fit: {fmt_gib(peak)} needed, {fmt_gib(budget)} available"
                           + (f" ({peak / budget:.1f}x)" if peak else "")))}


def _compile_for_source_tpu(req: PlanRequest) -> dict[str, Any]:
    """The TPU-style setup compiled for the source TPU, where libtpu is installed."""
    source = TPU_SPECS[req.source]
    try:
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(source.topology, "tpu")
    except Exception as exc:  # noqa: BLE001 - no TPU compiler here; JAX raises several types for it
        return {"status": "unavailable",
                "reason": 'no TPU compiler on this machine; to compare, install libtpu: pip install "jax[tpu]" '
                          "(Python 3.12+)",
                "detail": first_line(exc, 200)}
    try:
        cfg = RunConfig(workload=req.workload, preset=req.preset, per_device_batch=req.source_per_core_batch,
                        devices=source.devices, precision=req.source_precision, remat="none")
        peak = compile_peak(TrainProgram.from_config(cfg), make_data_mesh(topo.devices))
        return {"status": "ok", "peak_bytes_per_chip": peak,
                "hbm_bytes_per_device": source.hbm_bytes_per_device, "device_kind": topo.devices[0].device_kind}
    except Exception as exc:  # noqa: BLE001 - XLA raises several types; memory is told apart by its message
        text = first_line(exc, 400)
        if is_oom(text):
            # The TPU compiler itself says the unchanged setup exceeds the source's HBM.
            return {"status": "does-not-fit", "reason": text, "hbm_bytes_per_device": source.hbm_bytes_per_device,
                    "device_kind": topo.devices[0].device_kind}
        return {"status": "failed", "reason": text}

