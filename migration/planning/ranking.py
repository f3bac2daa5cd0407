"""The ranking of a planning pass: the compiled step time of each choice, the estimate that orders the
choices not compiled yet, and what became of each ranked choice.

The planner (`planner.py`) compiles choices for the target; each compiled program's step time is read
from its kernels (`steptime.py`) and kept by (layout, remat, per-device batch, accumulation). A choice
not compiled yet is ordered by the analytic estimate (`search.py`) scaled by the compiled figures the
search already has; ordering only: the choice is made on compiled figures. Every choice the planner
looked at is assessed (compiled and timed, did not fit, not compiled and why) for the plan's table.
"""

from __future__ import annotations

from typing import Any

from migration.config.layouts import parse_layout
from migration.planning import steptime
from migration.planning.hlo_cost import Kernel
from migration.planning.memory import MemoryPredictor, Target
from migration.planning.routed_experts import tile_padding
from migration.planning.search import RECOMPUTES, Choice, StepCostModel
from workloads import get_workload

RANKED_SHOWN = 10  # ranked choices kept in the plan
# Fitting choices timed from their compiled programs before the fastest is chosen (each compile with its
# accumulation: 3-20 s for 7B-70B models on two cores; those the search compiled already are free).
COMPILED_TOP_K = 4
# A choice whose ordering estimate is this much slower than the fastest compiled one is not compiled:
# the estimate, scaled by the search's own compiles, is within this of the compiled figure.
PRUNE_MARGIN = 1.25

FullKey = tuple[str, str, int, int]  # (sharding, remat, per-device batch, accumulation steps)


def full_key(c: Choice) -> FullKey:
    return c.sharding, c.remat, c.per_device_batch, c.accumulation_steps


class Ranking:
    """Compiled step times (seconds) by FullKey, and what became of each ranked choice, for one
    precision of one planning pass."""

    def __init__(self, predictor: MemoryPredictor, target: Target, precision: str, cost: StepCostModel):
        self.predictor, self.target, self.precision, self.cost = predictor, target, precision, cost
        self.timed: dict[FullKey, float] = {}
        self.assessed: dict[FullKey, dict[str, Any]] = {}
        # Choices are timed from their programs only where the compile is for a GPU with known figures.
        self.timing = predictor.reads_kernels and target.spec is not None

    # -- the compiled step time ------------------------------------------------------------------
    def is_compiled(self, c: Choice) -> bool:
        return (*full_key(c), self.precision) in self.predictor.programs

    def kernels(self, sharding: str, remat: str, batch: int, accum: int,
                precision: str | None = None) -> list[Kernel] | None:
        """The kernels a choice's step is timed by (in the pass's precision, or `precision`): its compiled
        program's, and where capacity dispatch leaves each expert fewer rows than a tensor-core tile, the
        padding's work (routed_experts.tile_padding)."""
        kernels = self.predictor.programs.get((sharding, remat, batch, accum, precision or self.precision))
        if not kernels:
            return None
        cfg = get_workload(self.predictor.req.workload).config(self.predictor.req.preset, self.predictor.model)
        layout = parse_layout(sharding)
        products = [k for k in kernels if k.kind == "matmul" and k.flops]
        padding = tile_padding(cfg, batch, layout.expert, layout.tensor, accum,
                               bool({"mlp", "block"} & set(RECOMPUTES.get(remat, ("block",)))),
                               max(products, key=lambda k: k.flops).unit if products else None)
        return kernels + [padding] if padding else kernels

    def program_seconds(self, sharding: str, remat: str, batch: int, accum: int) -> float | None:
        key = (sharding, remat, batch, accum)
        if key not in self.timed:
            kernels = self.kernels(*key)
            if not kernels or self.target.spec is None:
                return None
            self.timed[key] = steptime.predict(kernels, self.target.spec, self.links()).seconds
        return self.timed[key]

    def links(self) -> Any:
        """What the step-time model times collectives over: the target's link domains, else its link."""
        return self.target.links or self.target.link_bytes_per_s

    def compiled_seconds(self, c: Choice) -> float | None:
        """The step time of the choice's compiled program (steptime.py), or None when it has none."""
        return self.program_seconds(*full_key(c))

    def all_timed(self) -> list[tuple[FullKey, float]]:
        out = []
        for (s, r, b, a, precision) in list(self.predictor.programs):
            if precision == self.precision:
                seconds = self.program_seconds(s, r, b, a)
                if seconds is not None:
                    out.append(((s, r, b, a), seconds))
        return out

    # -- the estimate that orders ----------------------------------------------------------------
    def least_ratio(self) -> float:
        """The smallest ratio of a compiled step time to the analytic estimate of the same choice seen so
        far (1 before any): the analytic bound times it stays a bound in the compiled figures' scale."""
        ratios = [seconds / self.cost.step_seconds(r, b, a, s) for (s, r, b, a), seconds in self.all_timed()
                  if self.cost.step_seconds(r, b, a, s) > 0]
        return min(ratios, default=1.0)

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
        points = sorted((b, t) for (s, r, b, a), t in self.all_timed()
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
        return c.step_cost * self.least_ratio()

    # -- what became of each choice --------------------------------------------------------------
    def assess(self, c: Choice, status: str, peak: int | None = None) -> None:
        seconds = self.compiled_seconds(c)
        analytic = c.step_cost if self.cost.peak_flops else None
        self.assessed[full_key(c)] = {
            "status": status, "compiled_step_s": seconds, "estimate_s": self.estimate(c) if analytic else None,
            "analytic_s": analytic, "predicted_peak_bytes": peak,
            "disagreement": None if seconds is None or not analytic else round(analytic / seconds - 1, 4)}

    def rows(self, ranked: list[Choice]) -> list[dict[str, Any]]:
        """The ranked choices as the plan shows them: compiled ones first, fastest first, then the rest
        in the order of their estimate; each with its compiled and analytic figures and what became of it."""
        def order(c: Choice) -> tuple:
            seconds = self.timed.get(full_key(c))
            chosen = self.assessed.get(full_key(c), {}).get("status", "").startswith("chosen")
            return (not c.exact, seconds is None, seconds if seconds is not None else self.estimate(c), not chosen)

        rows = []
        for c in sorted(ranked, key=order)[:RANKED_SHOWN]:
            row = c.to_dict(self.cost)
            found = self.assessed.get(full_key(c)) or {"status": "not compiled: not reached", "compiled_step_s":
                                                        self.compiled_seconds(c), "analytic_s": row["predicted_step_s"]}
            row.update({k: v for k, v in found.items() if k != "predicted_peak_bytes"})
            if found.get("compiled_step_s") is not None:
                row["predicted_step_s"] = found["compiled_step_s"]
            rows.append(row)
        return rows

    def summary(self, layouts: list[str], not_searched: list[str]) -> dict[str, Any]:
        """How the choice was made, for the plan: the method, how many choices were timed, and why the
        others were not."""
        timed = sum(1 for a in self.assessed.values() if a.get("compiled_step_s") is not None
                    and a["status"].startswith(("compiled and timed", "chosen")))
        why: dict[str, int] = {}
        for status in (a["status"] for a in self.assessed.values()):
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
                "not_timed": why, "candidates": len(self.assessed), "layouts": list(layouts),
                "layouts_not_searched": not_searched}
