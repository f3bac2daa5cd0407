"""The migration plan (a typed result) and the planner's pure arithmetic.

Nothing here imports JAX: the search strategy (`largest_fitting`), the batch candidates, the
accumulation that keeps the global batch, and the guide's rule-of-thumb batch are plain functions,
tested on their own. `migration/planner.py` feeds them memory figures from the compiler.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from migration.report import JsonExport

MiB = 2**20
# Least recompute first: the planner takes the first policy that reaches the batch it needs.
REMAT_ORDER = ("none", "dots", "dots_no_batch", "full")


def exact_candidates(candidates: list[int], global_batch: int, gpus: int) -> list[int] | None:
    """The candidates that keep the global batch exactly (batch x gpus divides it), when they form
    a chain with no gap wider than 2x up to the largest candidate; else None. Searching these
    first costs fewer compiles and gives an exact plan that loses at most half the largest fit."""
    exact = [c for c in candidates if global_batch % (c * gpus) == 0]
    if not exact or exact[-1] != candidates[-1] or any(b > 2 * a for a, b in zip(exact, exact[1:])):
        return None
    return exact


def batch_candidates(limit: int, granularity: str) -> list[int]:
    """Allowed per-device batches up to `limit`, ascending.

    multiple8: 1, 2, 4, then multiples of 8; pow2: powers of two. `limit` itself is always a
    candidate, so the batch that keeps the global batch without accumulation can be chosen.
    """
    small = [b for b in (1, 2, 4) if b <= limit]
    if granularity == "pow2":
        out = [2**k for k in range(int(math.log2(limit)) + 1)] if limit >= 1 else []
    else:
        out = small + list(range(8, limit + 1, 8))
    return sorted(set(out) | {limit})


def largest_fitting(
    candidates: list[int],
    measure: Callable[[int], float | None],
    budget: float,
    known_fit: int = 0,
    first_guess: int | None = None,
) -> int:
    """The largest candidate c with measure(c) <= budget (0 if none), for a measure that grows
    with c (peak bytes of a compile at batch c; None = does not fit at all).

    A bracketed search over the sorted candidates: the top first (the batch needed often fits),
    then the bottom, then, while the bracket is open, a guess interpolated linearly between the
    two measured ends (memory is close to affine in the batch), or the midpoint when an end was
    not measured. Each probe shrinks the bracket, so it never takes more probes than the
    candidates, and usually three or four. `known_fit` is a batch already known to fit (for
    example under a policy that keeps more): candidates up to it are not measured. `first_guess`
    (a model's prediction of the boundary) replaces the first probe at the top.
    """
    values: dict[int, float | None] = {}

    def probe(i: int) -> bool:
        c = candidates[i]
        if c not in values:
            values[c] = measure(c)
        v = values[c]
        return v is not None and v <= budget

    n = len(candidates)
    if n == 0:
        return 0
    lo = max((i for i, c in enumerate(candidates) if c <= known_fit), default=-1)
    if lo == n - 1:
        return candidates[-1]
    hi = n
    if first_guess is not None:
        g = max((i for i, c in enumerate(candidates) if c <= first_guess), default=0)
        g = min(max(g, lo + 1), n - 1)
        if probe(g):
            lo = g
            if lo == n - 1:
                return candidates[-1]
            if probe(lo + 1):  # the guess is usually right: check the next candidate up first
                lo += 1
            else:
                return candidates[lo]
        else:
            hi = g
    if hi == n:
        if probe(n - 1):
            return candidates[-1]
        hi = n - 1
    if lo < 0:
        if not probe(0):
            return 0
        lo = 0
    while hi - lo > 1:
        v_lo, v_hi = values.get(candidates[lo]), values.get(candidates[hi])
        guess = (lo + hi) // 2
        if v_lo is not None and v_hi is not None and v_hi > v_lo:
            b_lo, b_hi = candidates[lo], candidates[hi]
            boundary = b_lo + (budget - v_lo) * (b_hi - b_lo) / (v_hi - v_lo)
            guess = max((i for i in range(lo + 1, hi) if candidates[i] <= boundary), default=lo + 1)
        if probe(guess):
            lo = guess
        else:
            hi = guess
    return candidates[lo]


@dataclasses.dataclass(frozen=True)
class Accumulation:
    per_device_batch: int
    accumulation_steps: int
    global_batch: int
    exact: bool
    reason: str


def keep_global_batch(global_batch: int, gpus: int, max_batch: int, candidates: list[int]) -> Accumulation:
    """Per-device batch <= max_batch and accumulation steps with batch * gpus * steps == global.

    Prefers the largest allowed batch that divides the global batch exactly, as long as it is at
    least half of the largest batch that fits; otherwise keeps the largest batch and says what the
    global batch becomes.
    """
    if max_batch < 1:
        raise ValueError("max_batch must be >= 1")
    for b in sorted((c for c in candidates if c <= max_batch), reverse=True):
        if b * 2 < max_batch:
            break
        if global_batch % (b * gpus) == 0:
            steps = global_batch // (b * gpus)
            return Accumulation(b, steps, global_batch, True,
                                f"{b} per device x {gpus} GPU(s) x {steps} accumulation step(s) = {global_batch}, the TPU global batch exactly")
    steps = max(1, math.ceil(global_batch / (max_batch * gpus)))
    effective = max_batch * gpus * steps
    return Accumulation(max_batch, steps, effective, False,
                        f"no allowed per-device batch near {max_batch} divides {global_batch} over {gpus} GPU(s): "
                        f"{max_batch} x {gpus} x {steps} = {effective} instead of {global_batch} "
                        f"({(effective - global_batch) / global_batch:+.1%}); scale the learning rate accordingly "
                        "or choose a global batch divisible by the GPU count x 8")


def rule_of_thumb_batch(memory_bytes: float, param_count: int) -> tuple[int, str]:
    """The guide's `adaptive_batch_size` formula: 80% of the memory limit, minus twice the model
    size (parameters + gradients), over 10% of the model size per sample, capped to 1..64, with
    the model size taken as float32 parameters in MB."""
    memory_mb = memory_bytes / MiB
    model_mb = param_count * 4 / MiB
    usable = memory_mb * 0.8 - 2 * model_mb
    per_sample = model_mb * 0.1
    raw = int(usable / per_sample) if per_sample > 0 else 64
    batch = max(1, min(raw, 64))
    return batch, (f"guide's formula: (0.8 x {memory_mb:,.0f} MB - 2 x {model_mb:,.1f} MB) / (0.1 x {model_mb:,.1f} MB)"
                   f" = {raw}, capped to 1..64 -> {batch}; it ignores sequence length, activations, precision and remat")


@dataclasses.dataclass
class Decision:
    decision: str
    value: Any
    reason: str


@dataclasses.dataclass
class Plan(JsonExport):
    """A GPU plan for a TPU-style setup: every decision with its reason, and the evidence."""

    status: str  # "ok" or "infeasible"
    workload: str
    preset: str
    source: str
    source_name: str
    source_devices: int
    source_per_core_batch: int
    source_precision: str
    target: str
    target_name: str
    gpus: int
    memory_fraction: float
    safety_margin: float
    budget_bytes: int
    device_memory_bytes: int
    # the plan
    per_device_batch: int
    accumulation_steps: int
    global_batch: int
    requested_global_batch: int
    global_batch_exact: bool
    precision: str
    remat: str
    predicted_peak_bytes: int | None
    prediction_method: str  # compiled-for-target, compiled-local or estimate
    prediction_note: str
    # evidence
    param_count: int
    compiles: int
    cache_hits: int
    search_seconds: float
    max_batch_by_remat: dict[str, int]
    candidates: list[int]  # the per-device batches the search chose among
    table: list[dict[str, Any]]  # one row per (batch, remat) evaluated: predicted bytes, fits
    rule_of_thumb_batch: int
    rule_of_thumb_note: str
    tpu_setup_on_target: dict[str, Any]
    source_tpu_compile: dict[str, Any]
    matmul_precision: dict[str, str]
    environment: dict[str, dict[str, str]]  # variable -> {value, why}
    decisions: list[Decision]
    message: str = ""  # for infeasible plans: why, and what would help
    jax_version: str | None = None
    planned_on: str | None = None  # backend of the machine that planned (e.g. cpu)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        data = dict(data)
        data["decisions"] = [Decision(**d) for d in data.get("decisions", [])]
        return cls(**data)

    @classmethod
    def from_json(cls, path: str | Path) -> "Plan":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def reasons(self) -> dict[str, str]:
        return {d.decision: d.reason for d in self.decisions}
