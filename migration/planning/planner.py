"""The migration planner: from a TPU-style setup to the fastest GPU plan that fits.

Runs inside a planner worker. Fitting is a constraint, found by the compiler (`migration/planning/memory.py`);
the choice among fitting (layout, remat, per-device batch, accumulation) choices that keep the global
batch is by the step time of each one's compiled program (`migration/planning/steptime.py`), the same
figure the plan reports. An analytic estimate (`migration/planning/search.py`: model FLOPs x the
policy's recompute factor over the target's peak, a penalty for micro-batches too small to fill the
device, what every micro-batch repeats, the collectives over the links they cross), scaled by the
compiled programs the search already has, only orders the candidates and prunes those that cannot
win; the first COMPILED_TOP_K that fit are compiled with their accumulation and timed, and the
fastest is chosen. A plan is never `ok` with a predicted peak over the budget.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax

from migration.common import fmt_gib, fmt_seconds
from migration.config.layouts import parse_layout
from migration.config.limits import FP8_PRECISIONS, LIMITS, REMAT_NAMED, ConfigError
from migration.config.requests import PlanRequest, check_fp8_target, remat_applies
from migration.planning.deployment import block_params, plan_environment
from migration.hardware import MATMUL_UNITS, TPU_SPECS, fp32_matmul_precision, host_link_bandwidth, matmul_unit
from migration.planning.memory import STATE_BYTES_PER_PARAM, CompileFailed, MemoryPredictor, Target, resolve_target
from migration.results import Decision, Plan
from migration.planning.source import compile_for_source_tpu, source_sharding, tpu_setup_on_target
from migration.planning import steptime
from migration.planning.compare import compare
from migration.step.policies import PRECISION_POLICIES
from migration.planning.search import (
    RECOMPUTE_NOTE,
    REMAT_ORDER,
    recompute_factors,
    Choice,
    Communication,
    StepCostModel,
    batch_candidates,
    describe_choice,
    exact_candidates,
    largest_fitting,
    rank_choices,
    rule_of_thumb_batch,
)
from workloads import get_workload
from workloads.transformer import CUDNN_HEAD_DIM_MAX

Emit = Callable[..., None]
RANKED_SHOWN = 10  # ranked choices kept in the plan
# Fitting choices timed from their compiled programs before the fastest is chosen (each compile with its
# accumulation: 3-20 s for 7B-70B models on two cores; those the search compiled already are free).
COMPILED_TOP_K = 4
# A choice whose ordering estimate is this much slower than the fastest compiled one is not compiled:
# the estimate, scaled by the search's own compiles, is within this of the compiled figure.
PRUNE_MARGIN = 1.25


def plan_migration(req: PlanRequest, emit: Emit) -> Plan:
    """The plan, by compiles for the target; if a compile fails for a reason other than memory,
    the whole search is redone by the analytic estimate (never a mix of the two), labelled."""
    t0 = time.perf_counter()
    target = resolve_target(req)
    precision = req.precision or ("bf16" if target.bf16_native else "fp16")
    if target.platform == "gpu" and req.target == "local":
        check_fp8_target(precision, target.spec, target.name, target.compute_capability)
    elif precision == "mxfp8" and target.platform == "cpu":
        raise ConfigError("precision", "mxfp8 (block-scaled, cuDNN) needs a Blackwell GPU; this machine plans on the "
                                       "CPU backend: use fp8 (per-tensor scaling, emulated there)")
    fp8, fp8_why = fp8_recipe(target) if req.allow_fp8 and not req.precision else (None, "")
    if fp8 is None:
        plan = _plan_in(req, emit, target, t0, precision)
        if req.allow_fp8:
            plan.decisions.append(Decision("fp8", "not used", fp8_why))
        return plan
    plan = _plan_in(req, emit, target, t0, fp8, compare=precision)
    other = (plan.step_time or {}).get("other_precision_s")
    mine = plan.predicted_step_s
    if plan.status == "ok" and other is not None and mine is not None and mine <= other:
        plan.decisions.append(Decision("fp8", fp8, (
            f"allowed: {fp8_why}; the chosen step compiled in {fp8}: {fmt_seconds(mine)}, in {precision} "
            f"{fmt_seconds(other)} for the same choice ({mine / other - 1:+.0%}). fp8 changes the numerics: run the "
            "plan with the fp32 reference (or beside a bf16 run) and compare the losses")))
        return plan
    # fp8 did not fit, could not be timed, or was no faster: the plan in the compute dtype, saying why
    why = ("no fitting choice in fp8" if plan.status != "ok" else
           f"no compiled step to compare ({plan.step_time.get('source', 'none')})" if mine is None or other is None else
           f"the chosen step compiled in {fp8}: {fmt_seconds(mine)}, in {precision} {fmt_seconds(other)}: no faster")
    plan = _plan_in(req, emit, target, t0, precision)
    plan.decisions.append(Decision("fp8", "not used", f"allowed: {fp8_why}; {why}, so {precision}"))
    return plan


def fp8_recipe(target: Target) -> tuple[str | None, str]:
    """The fp8 precision a plan may take where the user allows fp8 (MXFP8 on Blackwell, per-tensor fp8 on
    Ada and Hopper), and why; None with the reason where the target has no fp8 units."""
    cc = target.compute_capability
    if target.platform != "gpu" or cc is None:
        return None, "allowed, but this plan is for the CPU backend, which has no fp8 units"
    if cc >= (10, 0):
        return "mxfp8", f"{target.name} (compute capability {cc[0]}.{cc[1]}) has block-scaled fp8 tensor cores"
    if cc >= (8, 9):
        return "fp8", f"{target.name} (compute capability {cc[0]}.{cc[1]}) has fp8 tensor cores (per-tensor scaling)"
    return None, f"allowed, but {target.name} (compute capability {cc[0]}.{cc[1]}) has no fp8 tensor cores"


def _plan_in(req: PlanRequest, emit: Emit, target: Target, t0: float, precision: str,
             compare: str | None = None) -> Plan:
    """The plan in one precision, by compiles for the target (the analytic estimate, labelled, where a
    compile fails for a reason other than memory); with `compare`, the chosen step compiled in that
    precision too (step_time's `other_precision_s`)."""
    model, attention = planned_model(req, target, precision)
    predictor = MemoryPredictor(req, emit, model=model)
    try:
        return _Planner(req, emit, target, predictor, t0, precision, attention, compare).plan()
    except CompileFailed as exc:
        emit("fallback", message=str(exc))
        predictor.close()
        predictor = MemoryPredictor(req, emit, estimate_because=str(exc), model=model)
        return _Planner(req, emit, target, predictor, t0, precision, attention, compare).plan()
    finally:
        predictor.close()


def planned_model(req: PlanRequest, target: Target, precision: str) -> tuple[dict[str, Any], Decision | None]:
    """The model's dimension overrides as planned: the request's, plus the attention kernel for a
    model that has a choice of one (the fused cuDNN kernel on NVIDIA GPUs of compute capability 8.0+
    in bf16 or fp16: it never stores the T x T scores; plain XLA attention elsewhere)."""
    w = get_workload(req.workload)
    cfg = w.config(req.preset, req.model)
    if "attention" not in {f.name for f in dataclasses.fields(cfg)}:
        return dict(req.model), None
    head_ok = cfg.head_dim % 8 == 0 and cfg.head_dim <= CUDNN_HEAD_DIM_MAX
    fused = (target.platform == "gpu" and (target.compute_capability or (0, 0)) >= (8, 0)
             and precision in ("bf16", "fp16", *FP8_PRECISIONS) and head_ok)
    tpu_kernel = req.model.get("attention") == "splash"
    if tpu_kernel:  # the TPU code's fused kernel: its GPU counterpart is cuDNN's, where the GPU allows
        req = dataclasses.replace(req, model={k: v for k, v in req.model.items() if k != "attention"})
    if "attention" in req.model:
        value = req.model["attention"]
        why = "override: the attention your code runs"
        if value == "xla":
            why += (": XLA's implementation, which stores the T x T scores per head; the plan compiles and times "
                    "the step with it" + (" (cuDNN's fused kernel would run here: see the attention_saving "
                                          "decision)" if fused else ""))
        return dict(req.model), Decision("attention", value, why)
    if fused:
        why = (f"{target.name} runs cuDNN's fused attention (jax.nn.dot_product_attention, implementation='cudnn') "
               f"in {'bf16' if precision in FP8_PRECISIONS else precision} with head size {cfg.head_dim}: memory "
               f"linear in the sequence ({cfg.seq_len}), the "
               "scores are never stored. Planned without the GPU, the compile keeps cuDNN's call and its workspace "
               "in the peak; the kernel itself is chosen when the step first runs on the GPU")
    else:
        why = ("jax.nn.dot_product_attention with XLA's implementation, which stores the T x T scores per head: "
               "cuDNN's fused kernel needs an NVIDIA GPU of compute capability 8.0+, bf16 or fp16 compute and a head "
               f"size that is a multiple of 8 up to {CUDNN_HEAD_DIM_MAX} (here: {target.name}, {precision}, head size "
               f"{cfg.head_dim})")
    value = "cudnn" if fused else "xla"
    if tpu_kernel:
        why = "your TPU code runs Pallas' splash attention (the TPU's fused kernel); on the GPU: " + why
    return {**req.model, "attention": value}, Decision("attention", value, why)


Key = tuple[str, str]  # (sharding, remat)


class _Planner:
    """One planning pass: precision, the per-(sharding, policy) search, the ranking, the verified choice."""

    def __init__(self, req: PlanRequest, emit: Emit, target: Target, predictor: MemoryPredictor, t0: float,
                 precision: str, attention: Decision | None, compare: str | None = None):
        self.req, self.emit, self.target, self.predictor, self.t0 = req, emit, target, predictor, t0
        self.compare = compare  # another precision to time the chosen step in (fp8 against bf16)
        w = get_workload(req.workload)
        cfg = w.config(req.preset, predictor.model)
        self.params = w.param_count(cfg)
        self.precision = precision
        elem = 4 if precision == "fp32" else 2
        # The analytic model ranks the choices: FLOPs at the calibrated share of the peak, collectives at
        # the calibrated share of the link (planning/steptime.py); the chosen step is then timed from
        # its compiled program where there is one (`_step_time`).
        cal = steptime.CALIBRATION
        link = target.link_bytes_per_s * cal.link if target.link_bytes_per_s else None
        links = target.links
        comm = Communication(self.params, req.gpus, elem, link, req.domain,
                             links.intra if links else None, links.network if links else None)
        prof = w.activation_profile(cfg)
        offloaded = prof.n_blocks * sum(prof.named.get(n, 0.0) for n in REMAT_NAMED["offload_dot_except_mlp"]) * elem
        peak = target.peak_flops(self.precision)
        factors = recompute_factors(w.forward_flops_by_part(cfg), w.flops_per_example(cfg),
                                    fused_attention=getattr(cfg, "attention", "") == "cudnn",
                                    convolutional=getattr(w, "convolutional", False))
        self.cost = StepCostModel(w.flops_per_example(cfg), w.rows_per_example(cfg), target.fill_rows,
                                  peak * cal.matmul if peak else None, w.matmul_width(cfg), comm, factors,
                                  offloaded,
                                  host_link_bandwidth(target.compute_capability, target.spec and target.spec.key),
                                  target.spec.bandwidth_bytes_per_s * cal.memory if target.spec else None)
        # Policies that apply: the named ones only to a model that names their activations.
        self.policies = [r for r in REMAT_ORDER if remat_applies(w, r)]
        predictor.budget = target.budget_bytes
        self.needed = math.ceil(req.global_batch / req.gpus)
        self.limit = min(self.needed, req.max_per_device_batch)
        candidates = batch_candidates(self.limit, req.granularity)
        self.candidates = exact_candidates(candidates, req.global_batch, req.gpus) or candidates
        self.decisions = [Decision("precision", self.precision, self._precision_reason())]
        if attention:
            self.decisions.append(attention)
        self.per_node = req.domain  # layouts keep their groups inside a link domain (a node, or an NVL72 rack)
        self.replicated_note: str | None = None
        self.modes, self.sharding_forced = self._sharding_modes()
        # Compiled step times (seconds) by (layout, remat, batch, accumulation), and what became of each
        # ranked choice (compiled and timed, did not fit, not compiled and why).
        self.timed: dict[tuple[str, str, int, int], float] = {}
        self.assessed: dict[tuple[str, str, int, int], dict[str, Any]] = {}
        self.timing = self.predictor.reads_kernels and target.spec is not None
        self.searched: set[Key] = set()

    # -- stages ------------------------------------------------------------------------------
    def plan(self) -> Plan:
        budget = self.target.budget_bytes
        self.emit("plan_started", method=self.predictor.method, note=self.predictor.note, budget_bytes=budget)
        self.skipped: dict[Key, float] = {}
        if len(self.modes) == 1:  # the unchanged TPU-style setup is compiled at the end: start it now, elsewhere
            self.predictor.prefetch(self.req.source_precision, "none", self.req.source_per_core_batch, 1, self.modes[0])
        max_batch = self.search_policies(self.keys())
        ranked = self.rank(max_batch)
        chosen, peak, rejected = self.verify(ranked)
        if chosen is None and self.skipped:
            # The choices that ruled the other policies out did not fit with their accumulation:
            # search those policies too before giving up.
            max_batch.update(self.search_policies(list(self.skipped), prune=False))
            self.skipped = {}
            ranked = self.rank(max_batch)
            chosen, peak, rejected = self.verify(ranked)
        if chosen is None and self.tensor_modes():
            # Nothing fits with whole weights on every GPU of a group: split each block's weights.
            self.modes = self.modes + self.tensor_modes()
            policies = [self.req.remat] if self.req.remat else self.policies
            max_batch.update(self.search_policies([(m, r) for m in self.tensor_modes() for r in policies]))
            ranked = self.rank(max_batch)
            chosen, peak, rejected = self.verify(ranked)
        if chosen is None:
            return self._infeasible(max_batch, ranked, rejected)
        return self._ok(chosen, peak, max_batch, ranked, rejected)

    def keys(self) -> list[Key]:
        policies = [self.req.remat] if self.req.remat else self.policies
        return [(mode, remat) for mode in self.modes for remat in policies]

    def _sharding_modes(self) -> tuple[list[str], str | None]:
        """The layouts worth searching, and the reason when only one is. Replicated while the state fits
        a GPU; FSDP over every GPU; on several nodes FSDP inside a node with data parallelism across
        nodes (MaxText's ici_fsdp x dcn_data, Paxml's FSDP + DP), or, where a node's share of the state
        would take more than half the budget, FSDP over the fewest whole nodes whose share does not
        (dcn_fsdp). Tensor parallelism is searched only when none of these fits (`plan`)."""
        req, budget = self.req, self.target.budget_bytes
        if req.sharding:
            lay = parse_layout(req.sharding)
            return [req.sharding], f"override: {req.sharding} ({lay.describe(req.gpus, self.per_node)})"
        if req.gpus == 1:
            return ["replicated"], "one GPU: nothing to shard over (FSDP over one device is the same program)"
        state = STATE_BYTES_PER_PARAM * self.params
        modes = ["replicated"] if state <= budget else []
        modes.append("fsdp")
        if req.nodes > 1:
            group = self.per_node
            while group < req.gpus and state / group > budget / 2:
                group *= 2
            if group < req.gpus and req.gpus % group == 0:
                modes.append(f"hybrid:{group}")
        self.replicated_note = None if state <= budget else (
            f"replicated, the float32 parameters, gradients and AdamW state need {fmt_gib(state)} on every GPU "
            f"({self.params:,} parameters x 16 bytes), more than the {fmt_gib(budget)} budget")
        if len(modes) == 1:
            return modes, (f"{self.replicated_note}; sharded over {req.gpus} GPUs they need "
                           f"{fmt_gib(state / req.gpus)} each")
        return modes, None

    def tensor_modes(self) -> list[str]:
        """Tensor-parallel layouts for a model whose layers fit no other way: FSDP over the groups, the
        weights of each block split over 2, 4 or 8 GPUs of a node (Megatron's split)."""
        if self.req.sharding or not get_workload(self.req.workload).tensor_parallel:
            return []
        return [f"fsdp+tp{t}" for t in (2, 4, 8) if t <= self.per_node and self.req.gpus % t == 0]

    def rank(self, max_batch: dict[Key, int]) -> list[Choice]:
        return rank_choices(max_batch, self.candidates, self.req.global_batch, self.req.gpus, self.cost,
                            accumulation=self.req.accumulation_steps,
                            max_accumulation=int(LIMITS["accumulation_steps"][1]))

    def search_policies(self, keys: list[Key], prune: bool = True) -> dict[Key, int]:
        """Largest fitting batch per (sharding, remat policy), searching only those that could still win.

        Per sharding, policies go from least to most recompute; each search starts from the batch
        the previous policy reached (a policy that keeps less never needs more memory). With
        `prune`, a pair is skipped (and remembered in `self.skipped`) when even a perfectly filled
        device under it is slower than the best verified choice found so far that keeps the global
        batch (compiled with its accumulation and within the budget, `_verified_best`).
        """
        found: dict[Key, int] = {}
        best = math.inf
        known: dict[str, int] = {}
        for mode, remat in keys:
            bound = self.cost.best_possible(remat, self.needed, mode, self.limit) * self._least_ratio()
            if prune and bound >= best:
                self.skipped[(mode, remat)] = bound
                self.emit("skip_policy", remat=remat, sharding=mode, reason="cannot beat the best verified choice found so far")
                continue
            measure = lambda b, r=remat, m=mode: self.predictor.predict(self.precision, r, b, sharding=m)
            kept = known.get(mode, 0)
            # After a policy that fits nothing, the smallest batch is the likeliest boundary: probe it first.
            tried = any(k[0] == mode for k in found)
            guess = self.candidates[0] if tried and not kept else self._guess(mode, remat)
            self._prefetch_second_probe(mode, remat, kept, guess)
            self.searched.add((mode, remat))
            found[(mode, remat)] = largest_fitting(self.candidates, measure, self.target.budget_bytes,
                                                   known_fit=kept, first_guess=guess)
            known[mode] = max(kept, found[(mode, remat)])
            best = min(best, self._verified_best(mode, remat, found[(mode, remat)], best))
        return found

    def _verified_best(self, mode: str, remat: str, top: int, best: float) -> float:
        """The fastest choice under (mode, remat) that keeps the global batch and fits once compiled
        with its accumulation, when faster than `best`; else `best`. Its time is its compiled program's
        where the planner can time one (else the analytic estimate's): policies are pruned only
        against such a verified choice (`verify` finds the compile in the cache)."""
        for c in sorted((c for c in self.rank({(mode, remat): top}) if c.exact), key=self.estimate):
            if self.estimate(c) >= best:
                break
            peak = self.predictor.predict(self.precision, remat, c.per_device_batch, c.accumulation_steps,
                                          sharding=mode)
            if peak is not None and peak <= self.target.budget_bytes:
                seconds = self.compiled_seconds(c)
                return min(best, seconds if seconds is not None else c.step_cost)
        return best

    def verify(self, ranked: list[Choice]) -> tuple[Choice | None, int | None, list[dict[str, Any]]]:
        """The chosen choice: of the ranked ones that fit once compiled with their accumulation, the one
        whose compiled program is fastest. Choices are compiled in the order of `estimate` until
        COMPILED_TOP_K fit, skipping one whose estimate is over PRUNE_MARGIN times the fastest compiled
        so far, and one whose layout and policy already failed at a batch no larger (its peak can only
        be larger); every choice whose program the search compiled already is timed too (free). An
        exact choice (the global batch kept) always wins over an inexact one. Without a program to
        time (an analytic estimate, or this machine's CPU backend) the first fitting choice by the
        analytic estimate wins, as before."""
        rejected: list[dict[str, Any]] = []
        failed: dict[Key, int] = {}
        fitting: list[tuple[Choice, int]] = []
        order = sorted(ranked, key=lambda c: (not c.exact, self.estimate(c))) if self.timing else ranked
        for choice in order:
            key, full = (choice.sharding, choice.remat), self._full_key(choice)
            fastest = min((self.timed[self._full_key(c)] for c, _ in fitting), default=math.inf)
            if full in self.timed or self.timing and self._compiled(choice):
                pass  # compiled already: timing it costs nothing
            elif choice.accumulation_steps > 1 and choice.per_device_batch >= failed.get(key, math.inf):
                self._assess(choice, "not compiled: a batch no larger failed under the same layout and policy")
                continue
            elif self.timing and len(fitting) >= COMPILED_TOP_K:
                self._assess(choice, f"not compiled: {COMPILED_TOP_K} fitting choices were compiled and timed already")
                continue
            elif self.timing and fitting and self.estimate(choice) > PRUNE_MARGIN * fastest:
                self._assess(choice, f"not compiled: its estimate is over {PRUNE_MARGIN:g}x the fastest compiled choice")
                continue
            peak = self.predictor.predict(self.precision, choice.remat, choice.per_device_batch,
                                          choice.accumulation_steps, sharding=choice.sharding)
            if peak is None or peak > self.target.budget_bytes:
                failed[key] = min(failed.get(key, math.inf), choice.per_device_batch)
                rejected.append({**choice.to_dict(self.cost), "predicted_peak_bytes": peak})
                self._assess(choice, "compiled: does not fit", peak)
                continue
            if not self.timing:
                self._assess(choice, "chosen (first fitting choice by the analytic estimate)", peak)
                return choice, peak, rejected
            self.compiled_seconds(choice)
            self._assess(choice, "compiled and timed", peak)
            fitting.append((choice, peak))
        if not fitting:
            return None, None, rejected
        exact = [f for f in fitting if f[0].exact] or fitting
        chosen, peak = min(exact, key=lambda f: (self.timed[self._full_key(f[0])], f[0].accumulation_steps))
        self.assessed[self._full_key(chosen)]["status"] = "chosen: the fastest compiled choice"
        return chosen, peak, rejected

    # -- the compiled step time and the estimate that orders ------------------------------------
    @staticmethod
    def _full_key(c: Choice) -> tuple[str, str, int, int]:
        return c.sharding, c.remat, c.per_device_batch, c.accumulation_steps

    def _compiled(self, c: Choice) -> bool:
        return (c.sharding, c.remat, c.per_device_batch, c.accumulation_steps, self.precision) in self.predictor.programs

    def _program_seconds(self, sharding: str, remat: str, batch: int, accum: int) -> float | None:
        key = (sharding, remat, batch, accum)
        if key not in self.timed:
            kernels = self.predictor.programs.get((*key, self.precision))
            if not kernels or self.target.spec is None:
                return None
            links = self.target.links or self.target.link_bytes_per_s
            self.timed[key] = steptime.predict(kernels, self.target.spec, links).seconds
        return self.timed[key]

    def compiled_seconds(self, c: Choice) -> float | None:
        """The step time of the choice's compiled program (steptime.py), or None when it has none."""
        return self._program_seconds(*self._full_key(c))

    def _least_ratio(self) -> float:
        """The smallest ratio of a compiled step time to the analytic estimate of the same choice seen so
        far (1 before any): the analytic bound times it stays a bound in the compiled figures' scale."""
        ratios = [seconds / self.cost.step_seconds(r, b, a, s) for (s, r, b, a), seconds in self._all_timed()
                  if self.cost.step_seconds(r, b, a, s) > 0]
        return min(ratios, default=1.0)

    def _all_timed(self) -> list[tuple[tuple[str, str, int, int], float]]:
        out = []
        for (s, r, b, a, precision) in list(self.predictor.programs):
            if precision == self.precision:
                seconds = self._program_seconds(s, r, b, a)
                if seconds is not None:
                    out.append(((s, r, b, a), seconds))
        return out

    def estimate(self, c: Choice) -> float:
        """The figure that orders the candidates: with programs of the same layout and policy at one
        micro-batch compiled already, their step times as a line in the batch (what a micro-batch costs
        whatever its size, and per example) times the micro-batches; with one such program, the analytic
        estimate scaled by that program's ratio to it; else the analytic estimate scaled by the smallest
        ratio seen. Ordering only: the choice is made on compiled figures."""
        if not self.cost.peak_flops:
            return c.step_cost
        seconds = self.compiled_seconds(c)
        if seconds is not None:
            return seconds
        points = sorted((b, t) for (s, r, b, a), t in self._all_timed()
                        if (s, r, a) == (c.sharding, c.remat, 1))
        if len(points) >= 2:
            n = len(points)
            mean_b, mean_t = sum(b for b, _ in points) / n, sum(t for _, t in points) / n
            spread = sum((b - mean_b) ** 2 for b, _ in points)
            slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / spread if spread else 0.0
            per_micro = mean_t + slope * (c.per_device_batch - mean_b)
            if per_micro > 0:
                return c.accumulation_steps * per_micro
        if points:
            b0, t0 = points[-1]
            return c.step_cost * t0 / self.cost.step_seconds(c.remat, b0, 1, c.sharding)
        return c.step_cost * self._least_ratio()

    def _assess(self, c: Choice, status: str, peak: int | None = None) -> None:
        seconds = self.compiled_seconds(c)
        analytic = c.step_cost if self.cost.peak_flops else None
        self.assessed[self._full_key(c)] = {
            "status": status, "compiled_step_s": seconds, "estimate_s": self.estimate(c) if analytic else None,
            "analytic_s": analytic, "predicted_peak_bytes": peak,
            "disagreement": None if seconds is None or not analytic else round(analytic / seconds - 1, 4)}

    def ranked_rows(self, ranked: list[Choice]) -> list[dict[str, Any]]:
        """The ranked choices as the plan shows them: compiled ones first, fastest first, then the rest
        in the order of their estimate; each with its compiled and analytic figures and what became of it."""
        def order(c: Choice) -> tuple:
            seconds = self.timed.get(self._full_key(c))
            chosen = self.assessed.get(self._full_key(c), {}).get("status", "").startswith("chosen")
            return (not c.exact, seconds is None, seconds if seconds is not None else self.estimate(c), not chosen)

        rows = []
        for c in sorted(ranked, key=order)[:RANKED_SHOWN]:
            row = c.to_dict(self.cost)
            found = self.assessed.get(self._full_key(c)) or {"status": "not compiled: not reached", "compiled_step_s":
                                                             self.compiled_seconds(c), "analytic_s": row["predicted_step_s"]}
            row.update({k: v for k, v in found.items() if k != "predicted_peak_bytes"})
            if found.get("compiled_step_s") is not None:
                row["predicted_step_s"] = found["compiled_step_s"]
            rows.append(row)
        return rows

    def ranking_summary(self) -> dict[str, Any]:
        statuses = [a["status"] for a in self.assessed.values()]
        timed = sum(1 for a in self.assessed.values() if a.get("compiled_step_s") is not None
                    and a["status"].startswith(("compiled and timed", "chosen")))
        why: dict[str, int] = {}
        for status in statuses:
            if status.startswith("not compiled") or status == "compiled: does not fit":
                why[status] = why.get(status, 0) + 1
        if not self.timing:
            method = ("analytic: no compiled program to time here (" + self.predictor.method + "); the first fitting "
                      "choice by the analytic estimate")
        else:
            method = (f"compiled step time: the fitting choices compiled with their accumulation and timed from their "
                      f"programs (steptime.py); the analytic estimate, scaled by the search's compiles, only ordered "
                      f"them (at most {COMPILED_TOP_K} compiled beyond those the search had)")
        return {"method": method, "timed": timed, "top_k": COMPILED_TOP_K, "prune_margin": PRUNE_MARGIN,
                "not_timed": why, "candidates": len(self.assessed), "layouts": list(self.modes),
                "layouts_not_searched": sorted({k[0] for k in self.skipped} - {k[0] for k in self.searched})}

    # -- helpers -----------------------------------------------------------------------------
    def _prefetch_second_probe(self, mode: str, remat: str, kept: int, guess: int | None) -> None:
        """The bracketed search's second probe does not depend on its first when nothing fits yet:
        the bottom candidate after the top, or the candidate after a guess. Compile it meanwhile."""
        above = [c for c in self.candidates if c > kept]
        if len(above) < 2:
            return
        if guess is None:
            second = above[0] if not kept else None
        else:
            second = next((c for c in above if c > guess), None)
        if second is not None:
            self.predictor.prefetch(self.precision, remat, second, 1, mode)

    def _block_param_count(self) -> int:
        """Parameters per block (a layer of the scan; the model's parameters over its blocks, so an
        upper figure), for the collectives' combine thresholds."""
        w = get_workload(self.req.workload)
        return block_params(w, w.config(self.req.preset, self.predictor.model))

    def _guess(self, mode: str, remat: str) -> int | None:
        """The boundary under `remat` from an affine model of memory in the batch: the
        batch-independent part from 'none', the per-example part scaled by the estimate's ratio."""
        points = sorted((row["per_device_batch"], row["predicted_bytes"]) for row in self.predictor.table
                        if row["remat"] == "none" and row["predicted_bytes"] is not None
                        and row["accumulation_steps"] == 1 and row["sharding"] == mode)
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
        if self.req.precision in FP8_PRECISIONS:
            emulated = " (emulated on the CPU backend: converted and computed wider, no fp8 speed)" \
                if self.target.platform == "cpu" else ""
            return f"override: {self.req.precision}: {PRECISION_POLICIES[self.req.precision].description}{emulated}"
        if self.req.precision:
            return f"override: {self.req.precision}"
        if self.target.bf16_native:
            return f"{name} computes bf16 natively: bf16 compute with float32 parameters and AdamW state, no loss scaling"
        return (f"{name} has no native bf16: fp16 compute, float32 master weights, dynamic loss scaling "
                "(halve and skip on overflow)")

    def _remat_reason(self, chosen: Choice, max_batch: dict[Key, int], ranked: list[Choice]) -> str:
        if self.req.remat:
            return f"override: {self.req.remat} (the planner did not compare policies)"
        searched = ", ".join(f"{self._name(k)}: {b}" for k, b in max_batch.items())
        why = (f"fastest predicted step among the fitting choices ({RECOMPUTE_NOTE[chosen.remat]}); largest batch per "
               f"policy searched: {searched}")
        if self.skipped:
            why += "; not searched, since even their fastest possible step (the largest micro-batch allowed) is slower: " + ", ".join(
                f"{self._name(k)} (at least {self._step_text(b)})" for k, b in self.skipped.items())
        return why

    def _name(self, key: Key) -> str:
        """A (sharding, remat) pair as text: the remat name alone when one sharding was searched."""
        return key[1] if len(self.modes) == 1 else f"{key[0]}/{key[1]}"

    def _sharding_reason(self, chosen: Choice, ranked: list[Choice]) -> str:
        lay = parse_layout(chosen.sharding)
        what = lay.describe(self.req.gpus, self.per_node)
        if self.sharding_forced:
            why = self.sharding_forced
        else:
            others = {}
            for c in ranked:
                seconds = self.timed.get(self._full_key(c))
                if c.sharding != chosen.sharding and c.exact and seconds is not None:
                    if c.sharding not in others or seconds < others[c.sharding][0]:
                        others[c.sharding] = (seconds, c)
            mine = self.compiled_seconds(chosen)
            if not others:
                why = (f"{what}: the only layout searched that fits the global batch"
                       if not any(k[0] != chosen.sharding for k in self.skipped) else
                       f"{what}: the other layouts cannot beat it even at their fastest possible step (not searched)")
            else:
                why = f"{what}: fastest compiled step, {self._step_text(mine)} against " + ", ".join(
                    f"{name} {self._step_text(t)} ({c.per_device_batch} per GPU x {c.accumulation_steps})"
                    for name, (t, c) in sorted(others.items(), key=lambda kv: kv[1][0]))
            if self.replicated_note:
                why += f"; not replicated: {self.replicated_note}"
        comm = self.cost.communication
        if comm and self.req.gpus > 1:
            moved = comm.bytes_per_micro_batch(chosen.sharding, chosen.remat)
            why += (f"; collectives move {fmt_gib(moved)} per GPU per micro-batch"
                    + (f", {self._step_text(self.cost.comm_seconds(chosen.sharding, chosen.accumulation_steps, chosen.remat))} "
                       f"per step over {self.target.link_note}" if self.target.link_bytes_per_s else "")
                    + " (analytic; overlapped with compute by XLA's latency-hiding scheduler)")
        return why

    def _state(self, chosen: Choice) -> dict[str, Any]:
        """Bytes of the state per GPU: the compiled step's state arguments (parameters and AdamW's two
        moments) against 12 bytes per parameter over the GPUs holding a share, and with the
        gradients (4 bytes per parameter, same share) against the usual 16 bytes per parameter."""
        share = parse_layout(chosen.sharding).state_shards(self.req.gpus)
        compiled = self.predictor.state_bytes.get((chosen.sharding, chosen.remat, chosen.per_device_batch,
                                                   chosen.accumulation_steps, self.precision))
        arithmetic = STATE_BYTES_PER_PARAM * self.params / share
        with_grads = None if compiled is None else compiled + 4 * self.params / share
        return {"sharding": chosen.sharding, "shared_by": share, "param_count": self.params,
                "compiled_state_bytes_per_gpu": compiled, "arithmetic_state_bytes_per_gpu": 12 * self.params / share,
                "state_with_gradients_bytes_per_gpu": with_grads, "arithmetic_bytes_per_gpu": arithmetic,
                "difference": None if with_grads is None else round(with_grads / arithmetic - 1, 4),
                "how": f"compiled arguments of the step ({self.predictor.method}) plus float32 gradients "
                       f"(4 bytes x {self.params:,} / {share}), against 16 bytes x {self.params:,} / {share}"}

    def _source_job(self) -> dict[str, Any]:
        """How the TPU job held its state on the source slice."""
        src, req = TPU_SPECS[self.req.source], self.req
        state = STATE_BYTES_PER_PARAM * self.params
        sharding = source_sharding(req, self.params)
        per_chip = state / (src.devices if sharding == "fsdp" else 1)
        across = "" if req.source_slices == 1 else f", data parallel across its {req.source_slices} slices"
        why = (f"given: {sharding}{across}" if req.source_sharding else
               "replicated under pmap: the state fits one chip" + across if sharding == "replicated" else
               f"the state ({fmt_gib(state)}) exceeds one chip's {fmt_gib(src.hbm_bytes_per_device)}: it must have been "
               f"sharded over the slice's {src.devices} devices{across}")
        return {"devices": req.source_devices, "hbm_bytes_per_device": src.hbm_bytes_per_device, "sharding": sharding,
                "slices": req.source_slices,
                "state_bytes_per_device": int(per_chip), "why": why, "pod_slice": src.is_pod_slice}

    def _step_time(self, chosen: Choice) -> dict[str, Any]:
        """The chosen step's predicted time: from its compiled program where the planner compiled it
        for a GPU (steptime.py), else the analytic model's (FLOPs at the calibrated share of the peak,
        collectives over the link), saying which and how far off it is expected to be."""
        analytic = chosen.step_cost if self.cost.peak_flops else None
        kernels = self.predictor.programs.get((chosen.sharding, chosen.remat, chosen.per_device_batch,
                                               chosen.accumulation_steps, self.precision))
        spec = self.target.spec
        if kernels and spec is not None:
            p = steptime.predict(kernels, spec, self.target.links or self.target.link_bytes_per_s)
            model = get_workload(self.req.workload).config(self.req.preset, self.predictor.model)
            error = (steptime.EXPECTED_ERROR_XLA_ATTENTION if getattr(model, "attention", "") == "xla"
                     and getattr(model, "seq_len", 0) >= 1024 and getattr(model, "layer_loop", "") == "scan"
                     else steptime.EXPECTED_ERROR_FP8 if self.precision in FP8_PRECISIONS else steptime.EXPECTED_ERROR)
            return {"seconds": p.seconds, "method": p.method(spec, self.target.link_note or "no link", error),
                    "source": "compiled program", "expected_error": error, "compute_s": p.compute_s,
                    "matmul_s": p.matmul_s, "memory_bound_s": p.memory_s, "communication_s": p.communication_s,
                    "exposed_communication_s": p.exposed_communication_s, "compiled_flops": p.flops,
                    "kernels": p.kernels, "analytic_s": analytic}
        if analytic is None:
            return {"seconds": None, "method": "no step time: this device has no known peak", "source": "none",
                    "expected_error": None, "analytic_s": None}
        return {"seconds": analytic, "source": "analytic", "expected_error": None, "analytic_s": analytic,
                "method": (f"analytic: the model's FLOPs at {steptime.CALIBRATION.matmul:.0%} of the dense peak, scaled "
                           f"by the device fill and the policy's recompute, collectives over the link; not checked "
                           f"against a compiled program ({self.predictor.method})")}

    def _cudnn_saving(self, chosen: Choice, peak: int, seconds: float | None) -> Decision | None:
        """Where the user's code runs XLA's attention on a GPU that runs cuDNN's fused kernel: the same
        choice compiled with the fused kernel, its step time and peak beside the plan's (one more compile,
        by the same model that times the plan), as a recommendation."""
        if self.predictor.model.get("attention") != "xla" or not self.timing or seconds is None:
            return None
        fused_model, fused = planned_model(dataclasses.replace(self.req, model={
            k: v for k, v in self.req.model.items() if k != "attention"}), self.target, self.precision)
        if fused is None or fused.value != "cudnn":
            return None
        other = MemoryPredictor(self.req, lambda *a, **k: None, model=fused_model, workers=0)
        try:
            other_peak = other.predict(self.precision, chosen.remat, chosen.per_device_batch,
                                       chosen.accumulation_steps, record=False, sharding=chosen.sharding)
            kernels = other.programs.get(self._full_key(chosen) + (self.precision,))
        except CompileFailed:
            return None
        finally:
            other.close()
        if not kernels or other_peak is None:
            return None
        links = self.target.links or self.target.link_bytes_per_s
        fused_s = steptime.predict(kernels, self.target.spec, links).seconds
        return Decision("attention_saving", round(1 - fused_s / seconds, 4), (
            f"recommendation: cuDNN's fused attention (jax.nn.dot_product_attention(..., implementation='cudnn')) "
            f"for the same choice: compiled step {fmt_seconds(fused_s)} instead of {fmt_seconds(seconds)} "
            f"({1 - fused_s / seconds:+.0%} time saved), peak {fmt_gib(other_peak)} instead of {fmt_gib(peak)} per GPU; "
            "the scores are never stored, so a larger batch or a cheaper remat policy may then fit (plan again "
            "with attention cudnn)"))

    def _seconds_in(self, chosen: Choice, precision: str) -> float | None:
        """The chosen step compiled in another precision (same layout, policy, batch and accumulation) and
        timed by the same model; None where it does not fit or cannot be timed."""
        try:
            peak = self.predictor.predict(precision, chosen.remat, chosen.per_device_batch, chosen.accumulation_steps,
                                          record=False, sharding=chosen.sharding)
        except CompileFailed:
            return None
        kernels = self.predictor.programs.get(self._full_key(chosen) + (precision,))
        if peak is None or not kernels or self.target.spec is None:
            return None
        return steptime.predict(kernels, self.target.spec, self.target.links or self.target.link_bytes_per_s).seconds

    def _domains(self, chosen: Choice) -> Decision:
        """The link domains the job spans (nodes, or NVLink domains that span nodes) and what crossing them
        costs the chosen step: its cross-domain collectives over the network against the same ones over the
        link inside a domain, timed from the compiled program by the model that times the step."""
        req, t = self.req, self.target
        full, rest = divmod(req.gpus, req.domain)
        sizes = " + ".join(str(n) for n in [req.domain] * full + ([rest] if rest else []))
        nvlink = t.spec is not None and t.spec.nvlink_domain > req.node_gpus
        text = f"{req.gpus} GPUs span {req.domains} {'NVLink domains' if nvlink else 'nodes'} ({sizes} GPUs)"
        if nvlink and rest:
            text += f", not a multiple of the {t.spec.nvlink_domain}-GPU NVLink domain: the last one is partly filled"
        kernels = self.predictor.programs.get(self._full_key(chosen) + (self.precision,))
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

    def _step_text(self, seconds: float | None) -> str:
        return "n/a (no peak for this device)" if seconds is None or not self.cost.peak_flops else fmt_seconds(seconds)

    # -- results -----------------------------------------------------------------------------
    def _common(self, max_batch: dict[Key, int], ranked: list[Choice], rejected: list[dict[str, Any]],
                sharding: str) -> dict[str, Any]:
        req, t, source = self.req, self.target, TPU_SPECS[self.req.source]
        by_sharding: dict[str, dict[str, int]] = {}
        for (mode, remat), b in max_batch.items():
            by_sharding.setdefault(mode, {})[remat] = b
        rot, rot_note = rule_of_thumb_batch(t.device_memory_bytes * req.memory_fraction, self.params)
        return dict(
            workload=req.workload, preset=req.preset, source=req.source, source_name=source.named(req.source_slices),
            source_devices=req.source_devices, source_slices=req.source_slices,
            source_per_core_batch=req.source_per_core_batch,
            source_precision=req.source_precision, target=req.target, target_name=t.name, gpus=req.gpus,
            memory_fraction=req.memory_fraction, safety_margin=req.safety_margin, budget_bytes=t.budget_bytes,
            device_memory_bytes=int(t.device_memory_bytes), budget_source=t.budget_source,
            requested_global_batch=req.global_batch, precision=self.precision,
            prediction_method=self.predictor.method, prediction_note=self.predictor.note, param_count=self.params,
            compiles=self.predictor.compiles, cache_hits=self.predictor.cache_hits,
            ruled_out_by_bound=self.predictor.ruled_out, parallel_compiles=self.predictor.parallel,
            search_seconds=round(time.perf_counter() - self.t0, 2), max_batch_by_remat=by_sharding.get(sharding, {}),
            max_batch_by_sharding=by_sharding, model=self.predictor.model, sharding=sharding, nodes=req.nodes,
            gpus_per_node=min(req.gpus, req.node_gpus), domain_gpus=req.domain, source_job=self._source_job(),
            interconnect=t.link_note,
            table=self.predictor.table, candidates=self.candidates,
            ranked=self.ranked_rows(ranked), ranking=self.ranking_summary(),
            mesh=mesh_of(sharding, req.gpus, self.per_node, req.nodes),
            rule_of_thumb_batch=rot, rule_of_thumb_note=rot_note, matmul_precision=_matmul_precision_notes(t, self.precision),
            environment=plan_environment(memory_fraction=req.memory_fraction, gpus=req.gpus, nodes=req.nodes,
                                         gpus_per_node=req.node_gpus, sharding=sharding, precision=self.precision,
                                         compute_capability=t.compute_capability,
                                         block_params=self._block_param_count()),
            jax_version=jax.__version__,
            planned_on=jax.default_backend(),
            planned_device_kind=t.device_kind,
        )

    def _ok(self, chosen: Choice, peak: int, max_batch: dict[Key, int], ranked: list[Choice],
            rejected: list[dict[str, Any]]) -> Plan:
        req = self.req
        d = self.decisions
        d.append(Decision("sharding", chosen.sharding, self._sharding_reason(chosen, ranked)))
        d.append(Decision("remat", chosen.remat, self._remat_reason(chosen, max_batch, ranked)))
        seconds = self.compiled_seconds(chosen)
        summary = self.ranking_summary()
        timed = (f"compiled step {self._step_text(seconds)}, the fastest of {summary['timed']} fitting choice(s) "
                 f"compiled and timed (analytic estimate {self._step_text(chosen.step_cost)})" if seconds is not None
                 else f"predicted step {self._step_text(chosen.step_cost)} (analytic: no compiled program to time)")
        d.append(Decision("per_device_batch", chosen.per_device_batch,
                          f"predicted peak {fmt_gib(peak)} of a {fmt_gib(self.target.budget_bytes)} budget per GPU "
                          f"(compiled with its {chosen.accumulation_steps} accumulation step(s)); {timed}, device fill "
                          f"{chosen.fill:.0%}"
                          + (f"; {len(rejected)} choice(s) ranked before it did not fit once accumulation was added"
                             if rejected else "")))
        d.append(Decision("accumulation_steps", chosen.accumulation_steps,
                          (f"override: {req.accumulation_steps}; " if req.accumulation_steps else "")
                          + describe_choice(chosen, req.global_batch, req.gpus)))
        d.append(Decision("xla_flags", "no --xla_gpu_enable_triton_gemm=false", (
            "the guide disables Triton GEMMs 'for stability'; current XLA autotunes cuBLAS against Triton, "
            "so keep them unless a GEMM fails to compile")))
        if req.nodes > 1:
            over = (f"collectives cross nodes over {self.target.link_note}" if req.domains > 1 or req.domain <= req.node_gpus
                    else f"the nodes share one NVLink domain: collectives between them stay on {self.target.link_note}")
            host = self.target.spec.gpus_per_host if self.target.spec else None
            d.append(Decision("nodes", req.nodes, (
                f"{req.gpus} GPUs as {req.nodes} nodes of {min(req.gpus, req.node_gpus)}"
                + (f" ({self.target.name} hosts hold {host} GPUs)" if host and req.gpus_per_node > host else "")
                + ": one process per node calls jax.distributed.initialize() before anything else, and the mesh "
                f"spans every GPU; {over}")))
        tpu_setup = tpu_setup_on_target(req, self.predictor, self.target.budget_bytes, chosen.sharding)
        source_compile = compile_for_source_tpu(req) if req.compile_for_tpu else {"status": "not requested"}
        step = self._step_time(chosen)
        if self.compare and step.get("source") == "compiled program":
            step["other_precision"], step["other_precision_s"] = self.compare, self._seconds_in(chosen, self.compare)
        if req.domains > 1:
            d.append(self._domains(chosen))
        saving = self._cudnn_saving(chosen, peak, step.get("seconds"))
        if saving:
            d.append(saving)
        d.append(Decision("step_time", None if step["seconds"] is None else round(step["seconds"], 6), step["method"]))
        return self._compared(Plan(
            status="ok", per_device_batch=chosen.per_device_batch, accumulation_steps=chosen.accumulation_steps,
            global_batch=chosen.global_batch, global_batch_exact=chosen.exact, remat=chosen.remat,
            remat_chosen_by="override" if req.remat else "search", predicted_peak_bytes=peak,
            predicted_step_s=step["seconds"], step_time=step,
            tpu_setup_on_target=tpu_setup, source_tpu_compile=source_compile, decisions=d,
            state=self._state(chosen), **self._common(max_batch, ranked, rejected, chosen.sharding)))

    def _compared(self, plan: Plan) -> Plan:
        """The plan with the TPU job beside it (planning/compare.py), from the two sides' step times."""
        req = self.req
        w = get_workload(req.workload)
        cfg = w.config(req.preset, self.predictor.model)
        plan.comparison = compare(
            plan, train=req.train_tokens, prices=req.prices,
            measured_tpu_step_s=req.tpu_step_ms / 1e3 if req.tpu_step_ms else None,
            flops_per_example=w.flops_per_example(cfg), tokens_per_example=w.tokens_per_example(cfg),
            gpu_peak_flops=self.target.peak_flops(self.precision),
            local_key=self.target.spec.key if self.target.spec else None)
        if plan.comparison.get("tpu_fit"):
            plan.decisions.append(Decision("tpu_setup", "does not fit the TPU", plan.comparison["tpu_fit"]))
        if (plan.comparison.get("trust") or {}).get("text"):
            plan.decisions.append(Decision("tpu_step", "measured", plan.comparison["trust"]["text"]))
        return plan

    def _infeasible(self, max_batch: dict[Key, int], ranked: list[Choice], rejected: list[dict[str, Any]]) -> Plan:
        req, budget = self.req, self.target.budget_bytes
        policy = req.remat or "full"
        mode = self.modes[-1]
        if not ranked and any(max_batch.values()):
            floor = None
            why = (f"the batches that fit a budget of {{budget}} ({', '.join(f'{self._name(k)}: {b}' for k, b in max_batch.items())} "
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
            floor = self.predictor.predict(self.precision, policy, 1, sharding=mode)
            tried = ", ".join(self._name(k) for k in max_batch) or policy
            why = (f"does not fit even at batch 1 with remat {policy} (policies tried: {tried}), because the step "
                   f"needs {fmt_gib(floor)} per GPU against a budget of {{budget}}")
        shards = parse_layout(mode).state_shards(req.gpus)
        state_bytes = STATE_BYTES_PER_PARAM * self.params / shards
        budget_text = (f"{fmt_gib(budget)} ({req.memory_fraction:.0%} of {fmt_gib(self.target.device_memory_bytes)} "
                       f"minus a {req.safety_margin:.0%} margin)")
        message = (why.format(budget=budget_text) + "; parameters, "
                   f"gradients and AdamW state alone take {fmt_gib(state_bytes)} per GPU ({self.params:,} parameters x 16 "
                   f"bytes{f' / {shards} GPUs ({mode})' if shards > 1 else ''}). "
                   "What would help: " + "; ".join(_what_would_help(req, mode)) + ".")
        self.emit("infeasible", message=message)
        return self._compared(Plan(
            status="infeasible", per_device_batch=0, accumulation_steps=0, global_batch=0,
            global_batch_exact=False, remat=policy, remat_chosen_by="override" if req.remat else "search",
            predicted_peak_bytes=floor, predicted_step_s=None, tpu_setup_on_target={},
            source_tpu_compile={"status": "not requested", "reason": "the plan is infeasible: the TPU side is compiled "
                                                                    "for a feasible plan only"},
            decisions=self.decisions, message=message, **self._common(max_batch, ranked, rejected, mode)))


def _what_would_help(req: PlanRequest, mode: str) -> list[str]:
    helps = ["a GPU with more memory", "a smaller model"]
    if req.memory_fraction < 0.95:
        helps.insert(0, "a larger memory share")
    if req.remat and req.remat != "full":
        helps.insert(0, "remat full (or let the planner choose the policy)")
    if parse_layout(mode).shards_state():
        helps.append(f"more GPUs than {req.gpus} (FSDP shares parameters, gradients and optimizer state among them)")
    elif req.sharding == "replicated":
        helps.append("sharding the state over the GPUs (leave sharding to the planner, or FSDP)")
    else:
        helps.append("several GPUs with the state sharded over them (FSDP: 16 bytes per parameter / GPUs)")
    return helps


def mesh_of(layout: str, gpus: int, per_node: int, nodes: int) -> dict[str, Any]:
    """What the plan file and the deployment snippet say of the layout: the mesh's axes and sizes, the
    specs of the state and the batch, and how the job launches."""
    lay = parse_layout(layout)
    axes = lay.axes(gpus) if lay.kind == "hybrid" or lay.tensor > 1 else {"data": gpus}
    state_axis = "fsdp" if "fsdp" in axes else "data"
    batch = [a for a in axes if a != "tensor"]
    return {
        "layout": layout, "axes": axes, "describe": lay.describe(gpus, per_node),
        "mesh": f"jax.make_mesh({tuple(axes.values())}, {tuple(axes)})",
        "batch_spec": f"P(None, {tuple(batch) if len(batch) > 1 else repr(batch[0])})",
        "state_spec": ("P() (whole on every GPU)" if not lay.shards_state() else
                       f"each array's largest dimension divisible by {axes.get(state_axis, gpus)} over {state_axis!r}")
                      + ("; block weights split over 'tensor' (q, kv, up: outputs; out, down: inputs)"
                         if lay.tensor > 1 else ""),
        "maxtext": maxtext_parallelism(lay, gpus, per_node),
        "launch": (f"{nodes} processes, one per node, each calling jax.distributed.initialize() first; devices in "
                   "node order, so the innermost mesh axes stay inside a node" if nodes > 1 else
                   "one process over the node's GPUs"),
        "code": "migration/step/train.py make_mesh, state_shardings, batch_sharding",
    }


def maxtext_parallelism(lay: Any, gpus: int, per_node: int) -> dict[str, int]:
    """The layout in MaxText's settings: ici_* inside a node, dcn_* across nodes."""
    nodes = max(1, gpus // per_node)
    inside = per_node // lay.tensor
    if lay.kind == "replicated":
        return {"ici_data_parallelism": inside, "dcn_data_parallelism": nodes, "ici_tensor_parallelism": lay.tensor}
    if lay.kind == "fsdp":
        return {"ici_fsdp_parallelism": inside, "dcn_fsdp_parallelism": nodes, "ici_tensor_parallelism": lay.tensor}
    group_nodes = max(1, lay.group // per_node)
    return {"ici_fsdp_parallelism": min(lay.group, per_node) // lay.tensor,
            "ici_data_parallelism": max(1, per_node // lay.group),
            "dcn_fsdp_parallelism": group_nodes, "dcn_data_parallelism": nodes // group_nodes,
            "ici_tensor_parallelism": lay.tensor}


def _matmul_precision_notes(target: Target, precision: str) -> dict[str, str]:
    fp32 = fp32_matmul_precision(target.platform, target.compute_capability, None)
    gpu = MATMUL_UNITS[matmul_unit(precision, fp32)]
    if precision == "fp32" and fp32 == "tf32":
        gpu += "; set jax_default_matmul_precision='highest' for true fp32"
    return {"tpu": "bf16 passes on the MXU (TPUs run fp32 matrix products in bf16 by default)", "gpu": gpu}
