"""The migration planner: from a TPU-style setup to the fastest GPU plan that fits.

Runs inside a planner worker. Fitting is a constraint, found by the compiler (`migration/planning/memory.py`);
the choice among fitting (layout, remat, per-device batch, accumulation) choices that keep the global
batch is by the step time of each one's compiled program (`migration/planning/steptime.py`), the same
figure the plan reports. An analytic estimate (`migration/planning/search.py`: model FLOPs x the
policy's recompute factor over the target's peak, a penalty for micro-batches too small to fill the
device, what every micro-batch repeats, the collectives over the links they cross), scaled by the
compiled programs the search already has (`migration/planning/ranking.py`), only orders the candidates and
prunes those that cannot win; the first COMPILED_TOP_K that fit are compiled with their accumulation and
timed, and the fastest is chosen. A plan is never `ok` with a predicted peak over the budget.

Here: the pass itself (which layouts and policies, the largest batch each fits, the ranked choices
verified by compiles). What the target allows before the search: `capability.py`; the plan written from
what the pass found: `plan_record.py`; the mesh a plan hands over: `deployment.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from migration.common import ConfigError, fmt_count, fmt_gib, fmt_seconds
from migration.config.layouts import parse_layout
from migration.config.limits import FP8_PRECISIONS, LIMITS, REMAT_NAMED
from migration.config.requests import PlanRequest, check_fp8_target, remat_applies, remat_unavailable
from migration.hardware import host_link_bandwidth
from migration.planning import plan_record, steptime
from migration.planning.capability import fp8_recipe, planned_model
from migration.planning.memory import CompileFailed, MemoryPredictor, Target, resolve_target
from migration.planning.ranking import COMPILED_TOP_K, PRUNE_MARGIN, Ranking, full_key
from migration.planning.source import SourceCompile
from migration.planning.search import (
    REMAT_ORDER,
    Choice,
    Communication,
    StepCostModel,
    batch_candidates,
    exact_candidates,
    largest_fitting,
    rank_choices,
    recompute_factors,
)
from migration.results import Decision, Plan
from workloads import BUILTIN, get_workload
from workloads.base import Workload

Emit = Callable[..., None]
Key = tuple[str, str]  # (sharding, remat)


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
    workload = get_workload(req.workload)
    if precision in FP8_PRECISIONS and not workload.fp8_linears:
        raise ConfigError("precision", f"{precision} replaces nnx.Linear products, and {req.workload} has none (its "
                                       "style's products are its own): use bf16 or fp16")
    fp8, fp8_why = fp8_recipe(target) if req.allow_fp8 and not req.precision else (None, "")
    if fp8 is not None and not workload.fp8_linears:
        fp8, fp8_why = None, (f"allowed, but {req.workload}'s products are not nnx.Linear layers, which the fp8 "
                              "recipes replace")
    source = SourceCompile(req)
    source.start()  # the TPU side compiles beside the GPU search
    try:
        return _plan_precisions(req, emit, target, t0, precision, fp8, fp8_why, source)
    finally:
        source.close()


def _plan_precisions(req: PlanRequest, emit: Emit, target: Target, t0: float, precision: str, fp8: str | None,
                     fp8_why: str, source: SourceCompile) -> Plan:
    """The plan in the compute precision, or in fp8 where allowed and faster (then compared with the other)."""
    if fp8 is None:
        plan = _plan_in(req, emit, target, t0, precision, source)
        if req.allow_fp8:
            plan.decisions.append(Decision("fp8", "not used", fp8_why))
        return plan
    plan = _plan_in(req, emit, target, t0, fp8, source, compare=precision)
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
    plan = _plan_in(req, emit, target, t0, precision, source)
    plan.decisions.append(Decision("fp8", "not used", f"allowed: {fp8_why}; {why}, so {precision}"))
    return plan


def _plan_in(req: PlanRequest, emit: Emit, target: Target, t0: float, precision: str, source: SourceCompile,
             compare: str | None = None) -> Plan:
    """The plan in one precision, by compiles for the target (the analytic estimate, labelled, where a
    compile fails for a reason other than memory); with `compare`, the chosen step compiled in that
    precision too (step_time's `other_precision_s`)."""
    model, attention = planned_model(req, target, precision)
    predictor = MemoryPredictor(req, emit, model=model)
    try:
        return Planner(req, emit, target, predictor, t0, precision, attention, compare, source).plan()
    except CompileFailed as exc:
        emit("fallback", message=str(exc))
        predictor.close()
        predictor = MemoryPredictor(req, emit, estimate_because=str(exc), model=model)
        return Planner(req, emit, target, predictor, t0, precision, attention, compare, source).plan()
    finally:
        predictor.close()


class Planner:
    """One planning pass: precision, the per-(sharding, policy) search, the ranking, the verified choice."""

    def __init__(self, req: PlanRequest, emit: Emit, target: Target, predictor: MemoryPredictor, t0: float,
                 precision: str, attention: Decision | None, compare: str | None = None,
                 source: SourceCompile | None = None):
        self.req, self.emit, self.target, self.predictor, self.t0 = req, emit, target, predictor, t0
        self.source = source or SourceCompile(req)  # the TPU side's compile (started by plan_migration)
        self.compare = compare  # another precision to time the chosen step in (fp8 against bf16)
        w = get_workload(req.workload)
        cfg = w.config(req.preset, predictor.model)
        self.params = w.param_count(cfg)
        self.precision = precision
        self.cost = self._cost_model(w, cfg)
        # Policies that apply: the named ones only to a model that names their activations.
        self.policies = [r for r in REMAT_ORDER if remat_applies(w, r)]
        not_applied = {r: remat_unavailable(w, r) for r in REMAT_ORDER if r not in self.policies}
        predictor.budget = target.budget_bytes
        self.needed = math.ceil(req.global_batch / req.gpus)
        self.limit = min(self.needed, req.max_per_device_batch)
        candidates = batch_candidates(self.limit, req.granularity)
        self.candidates = exact_candidates(candidates, req.global_batch, req.gpus) or candidates
        self.decisions = [Decision("precision", self.precision, plan_record.precision_reason(req, target))]
        if attention:
            self.decisions.append(attention)
        self.decisions.extend(counts_decisions(w, cfg))
        if req.config_notes:
            self.decisions.append(Decision("imported_config", req.config_notes[0],
                                           " | ".join(req.config_notes[1:]) or "every key it gives is modelled"))
        if not_applied and not req.remat:
            self.decisions.append(Decision("remat_not_offered", ", ".join(not_applied), "; ".join(
                f"{r}: {why}" for r, why in not_applied.items())))
        self.per_node = req.domain  # layouts keep their groups inside a link domain (a node, or an NVL72 rack)
        self.replicated_note: str | None = None
        self.modes, self.sharding_forced = self._sharding_modes()
        # Compiled step times, the estimate that orders, and what became of each ranked choice.
        self.ranking = Ranking(predictor, target, precision, self.cost)
        self.searched: set[Key] = set()  # the (layout, policy) pairs whose largest batch was searched
        self.skipped: dict[Key, float] = {}  # pairs not searched: their fastest possible step (seconds)
        self.failed: dict[Key, str] = {}  # pairs whose compile failed for a reason other than memory: why

    def _cost_model(self, w: Any, cfg: Any) -> StepCostModel:
        """The analytic model that orders the choices: FLOPs at the calibrated share of the peak,
        collectives at the calibrated share of the link (planning/steptime.py); the chosen step is then
        timed from its compiled program where there is one (plan_record.step_time)."""
        req, target = self.req, self.target
        elem = 4 if self.precision == "fp32" else 2
        cal = steptime.CALIBRATION
        link = target.link_bytes_per_s * cal.link if target.link_bytes_per_s else None
        links = target.links
        comm = Communication(self.params, req.gpus, elem, link, req.domain,
                             links.intra if links else None, links.network if links else None,
                             w.routed_expert_params(cfg), w.dispatch_bytes_per_example(cfg, elem))
        prof = w.activation_profile(cfg)
        offloaded = prof.n_blocks * sum(prof.named.get(n, 0.0) for n in REMAT_NAMED["offload_dot_except_mlp"]) * elem
        peak = target.peak_flops(self.precision)
        factors = recompute_factors(w.forward_flops_by_part(cfg), w.flops_per_example(cfg),
                                    fused_attention=getattr(cfg, "attention", "") == "cudnn",
                                    convolutional=getattr(w, "convolutional", False))
        return StepCostModel(w.flops_per_example(cfg), w.rows_per_example(cfg), target.fill_rows,
                             peak * cal.matmul if peak else None, w.matmul_width(cfg), comm, factors, offloaded,
                             host_link_bandwidth(target.compute_capability, target.spec and target.spec.key),
                             target.spec.bandwidth_bytes_per_s * cal.memory if target.spec else None)

    # -- stages ------------------------------------------------------------------------------
    def plan(self) -> Plan:
        budget = self.target.budget_bytes
        self.emit("plan_started", method=self.predictor.method, note=self.predictor.note, budget_bytes=budget)
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
        if self.failed and set(self.failed) >= self.searched:
            raise CompileFailed(next(iter(self.failed.values())))  # no layout compiles: the analytic estimate
        plan = (plan_record.infeasible_plan(self, max_batch, ranked, rejected) if chosen is None
                else plan_record.ok_plan(self, chosen, peak, max_batch, ranked, rejected))
        if self.failed:
            plan.decisions.append(Decision("compile_failed", ", ".join(sorted({m for m, _ in self.failed})), "; ".join(
                f"{m}, remat {r}: not planned, {why}" for (m, r), why in sorted(self.failed.items()))))
        return plan

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
        per_param = self.predictor.state_per_param()
        state = per_param * self.params
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
            f"({self.params:,} parameters x {per_param} bytes), more than the {fmt_gib(budget)} budget")
        modes += self.expert_modes(modes)
        if len(modes) == 1:
            return modes, (f"{self.replicated_note}; sharded over {req.gpus} GPUs they need "
                           f"{fmt_gib(state / req.gpus)} each")
        return modes, None

    def expert_modes(self, modes: list[str]) -> list[str]:
        """Expert-parallel twins of the sharded layouts for a mixture-of-experts model: its routed experts split
        over the most GPUs of a link domain (a node, or an NVL72 rack) that divide them (MaxText's
        ici_expert_parallelism), the token slots sent to them inside the domain (by all-to-all under capacity
        dispatch, ragged all-to-all under dropless)."""
        w = get_workload(self.req.workload)
        cfg = w.config(self.req.preset, self.predictor.model)
        experts = w.routed_experts(cfg)
        if not experts or self.req.gpus == 1:
            return []
        e = max((n for n in range(2, min(self.per_node, self.req.gpus) + 1)
                 if experts % n == 0 and self.req.gpus % n == 0), default=1)
        if e == 1:
            return []
        out = []
        for m in modes:
            try:
                out.append(parse_layout(f"{m}+ep{e}").check(self.req.gpus, self.per_node).name)
            except ConfigError:
                continue
        return [m for m in out if not m.startswith("replicated")]

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
            bound = self.cost.best_possible(remat, self.needed, mode, self.limit) * self.ranking.least_ratio()
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
            try:
                found[(mode, remat)] = largest_fitting(self.candidates, measure, self.target.budget_bytes,
                                                       known_fit=kept, first_guess=guess)
            except CompileFailed as exc:  # this layout and policy only: the others are still planned
                self._compile_failed(mode, remat, exc)
                found[(mode, remat)] = 0
                continue
            known[mode] = max(kept, found[(mode, remat)])
            best = min(best, self._verified_best(mode, remat, found[(mode, remat)], best))
        return found

    def _verified_best(self, mode: str, remat: str, top: int, best: float) -> float:
        """The fastest choice under (mode, remat) that keeps the global batch and fits once compiled
        with its accumulation, when faster than `best`; else `best`. Its time is its compiled program's
        where the planner can time one (else the analytic estimate's): policies are pruned only
        against such a verified choice (`verify` finds the compile in the cache)."""
        for c in sorted((c for c in self.rank({(mode, remat): top}) if c.exact), key=self.ranking.estimate):
            if self.ranking.estimate(c) >= best:
                break
            peak = self.predictor.predict(self.precision, remat, c.per_device_batch, c.accumulation_steps,
                                          sharding=mode)
            if peak is not None and peak <= self.target.budget_bytes:
                seconds = self.ranking.compiled_seconds(c)
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
        order = sorted(ranked, key=lambda c: (not c.exact, self.ranking.estimate(c))) if self.ranking.timing else ranked
        for choice in order:
            key, full = (choice.sharding, choice.remat), full_key(choice)
            fastest = min((self.ranking.timed[full_key(c)] for c, _ in fitting), default=math.inf)
            if full in self.ranking.timed or self.ranking.timing and self.ranking.is_compiled(choice):
                pass  # compiled already: timing it costs nothing
            elif choice.accumulation_steps > 1 and choice.per_device_batch >= failed.get(key, math.inf):
                self.ranking.assess(choice, "not compiled: a batch no larger failed under the same layout and policy")
                continue
            elif self.ranking.timing and len(fitting) >= COMPILED_TOP_K:
                self.ranking.assess(choice, f"not compiled: {COMPILED_TOP_K} fitting choices were compiled and timed already")
                continue
            elif self.ranking.timing and fitting and self.ranking.estimate(choice) > PRUNE_MARGIN * fastest:
                self.ranking.assess(choice, f"not compiled: its estimate is over {PRUNE_MARGIN:g}x the fastest compiled choice")
                continue
            try:
                peak = self.predictor.predict(self.precision, choice.remat, choice.per_device_batch,
                                              choice.accumulation_steps, sharding=choice.sharding)
            except CompileFailed as exc:
                self._compile_failed(choice.sharding, choice.remat, exc)
                self.ranking.assess(choice, f"not planned: {exc}")
                continue
            if peak is None or peak > self.target.budget_bytes:
                failed[key] = min(failed.get(key, math.inf), choice.per_device_batch)
                rejected.append({**choice.to_dict(self.cost), "predicted_peak_bytes": peak})
                self.ranking.assess(choice, "compiled: does not fit", peak)
                continue
            if not self.ranking.timing:
                self.ranking.assess(choice, "chosen (first fitting choice by the analytic estimate)", peak)
                return choice, peak, rejected
            self.ranking.compiled_seconds(choice)
            self.ranking.assess(choice, "compiled and timed", peak)
            fitting.append((choice, peak))
        if not fitting:
            return None, None, rejected
        exact = [f for f in fitting if f[0].exact] or fitting
        chosen, peak = min(exact, key=lambda f: (self.ranking.timed[full_key(f[0])], f[0].accumulation_steps))
        self.ranking.assessed[full_key(chosen)]["status"] = "chosen: the fastest compiled choice"
        return chosen, peak, rejected

    # -- helpers -----------------------------------------------------------------------------
    def _compile_failed(self, mode: str, remat: str, exc: CompileFailed) -> None:
        """A compile of one layout and policy failed for a reason other than memory: that pair is left out
        of the plan (said in its decisions), the others are still planned."""
        self.failed.setdefault((mode, remat), str(exc))
        self.emit("compile_failed", sharding=mode, remat=remat, message=str(exc))

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


def counts_decisions(w: Workload, cfg: Any) -> list[Decision]:
    """Where the model's parameter count and FLOPs come from: read from its traced program (a model that
    gives neither), or the team's own counts checked against that program, a mismatch shown (the built-in
    families' counts are checked by the tests, not at every plan)."""
    derived = [m for m in ("param_count", "flops_per_example") if getattr(type(w), m) is getattr(Workload, m)]
    if w.name in BUILTIN:
        return []
    facts = w.facts(cfg)
    out = []
    loops = (f"; {facts.unknown_loops} while loop(s) of a length the program does not state counted once"
             if facts.unknown_loops else "")
    if "flops_per_example" in derived:
        out.append(Decision("model_flops", fmt_count(facts.train_flops, "FLOP"), (
            f"per example, read from the traced program: its matrix products ({fmt_count(facts.forward_flops, 'FLOP')} "
            f"forward) and the gradients the backward pass computes; elementwise work not counted{loops}")))
    for method, given, read, unit in (("param_count", w.param_count(cfg), facts.params, "parameters"),
                                      ("flops_per_example", w.flops_per_example(cfg), facts.train_flops, "FLOP")):
        if method in derived:
            continue
        gap = given / read - 1 if read else float("inf")
        same = abs(gap) <= 0.01
        out.append(Decision(f"{method}_check", "agrees" if same else f"{gap:+.1%}", (
            f"{w.name}'s {method} gives {fmt_count(given, unit)}; its traced program has {fmt_count(read, unit)}"
            + ("" if same else "; the plan uses the given count: check it (or drop the override and let the "
                               "program's count be used)"))))
    return out
