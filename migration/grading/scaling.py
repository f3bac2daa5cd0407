"""Weak scaling of the step, before and after the migration: the TPU-era pmap step ("pmap") and the
migrated jit step ("jit"), each measured in its own worker process at several device counts.

Every run keeps the per-device batch, so the global batch is per-device batch x devices (weak
scaling), and the same steps, warm-up, seed and precision. For each device count n and style:

- samples/s, tokens/s and the median step time, as the run's report measured them;
- scaling efficiency: throughput at n / (n x throughput at 1 device), the same style;
- jit/pmap: the jit step's throughput over the pmap step's at the same n;
- losses match: both styles' per-step losses at the same n agree to `LOSS_RTOL` (same data, same
  initial state: they must, up to the order of floating-point sums).

Every row carries where it was measured (backend, device kind, JAX version, date). On the CPU
backend the XLA devices share the host's cores, so these are CPU-backend timings of the two step
styles, not a prediction of how a GPU box scales.

The runs themselves (one worker process each) are made by migration/service/scaling_runs.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from migration.results import RunReport

STYLES = ("pmap", "jit")  # before, after
# Relative loss tolerance between the two steps at the same device count, by compute precision:
# they sum in a different order, which float32 hides to about 1e-7 and 16-bit formats do not.
LOSS_RTOL = {"fp32": 1e-4, "bf16": 1e-2, "fp16": 1e-2}


def loss_tolerance(precision: str) -> float:
    return LOSS_RTOL.get(precision, LOSS_RTOL["fp32"])
def scaling_rows(reports: Sequence[RunReport], loss_rtol: float | None = None) -> list[dict[str, Any]]:
    """One row per report, in their order, with the figures that compare them (module docstring).
    A failed run keeps its row: status and message, no figures; what depends on it is None."""
    by_key = {(r.devices, r.step_style): r for r in reports}
    measured_on = time.strftime("%Y-%m-%d")
    rows = []
    for r in reports:
        one = by_key.get((1, r.step_style))
        pmap, jit = by_key.get((r.devices, "pmap")), by_key.get((r.devices, "jit"))
        rows.append({
            "devices": r.devices,
            "style": r.step_style,
            "status": r.status,
            "global_batch": r.global_batch,
            "per_device_batch": r.per_device_batch,
            "samples_per_s": _figure(r, "samples_per_s"),
            "tokens_per_s": _figure(r, "tokens_per_s"),
            "step_ms_median": _figure(r, "step_ms_median"),
            "scaling_efficiency": _ratio(_figure(r, "samples_per_s"),
                                         _times(r.devices, _figure(one, "samples_per_s"))),
            "jit_over_pmap": _ratio(_figure(jit, "samples_per_s"), _figure(pmap, "samples_per_s")),
            "losses_match": losses_match(pmap, jit, loss_rtol or loss_tolerance(r.precision)),
            "max_loss_rel_diff": max_loss_rel_diff(pmap, jit),
            "compile_s": _figure(r, "compile_s"),
            "recompilations": r.recompilations if r.ok else None,
            "workload": r.workload,
            "preset": r.preset,
            "steps": r.steps,
            "warmup_steps": r.warmup_steps,
            "backend": r.backend,
            "device_kind": r.device_kind,
            "jax_version": r.jax_version,
            "measured_on": measured_on,
            "message": r.message,
        })
    return rows


def losses_match(a: RunReport | None, b: RunReport | None, rtol: float | None = None) -> bool | None:
    """Whether two runs' per-step losses agree to `rtol` (default: `loss_tolerance` of b's precision);
    None where either run is missing or failed."""
    diff = max_loss_rel_diff(a, b)
    return None if diff is None else diff <= (rtol or loss_tolerance(b.precision))


def max_loss_rel_diff(a: RunReport | None, b: RunReport | None) -> float | None:
    """The largest |a - b| / |b| over the steps (inf where the step counts differ or a loss is not
    finite); None where either run is missing or failed."""
    if a is None or b is None or not (a.ok and b.ok):
        return None
    if len(a.losses) != len(b.losses) or not a.losses:
        return math.inf
    diffs = []
    for x, y in zip(a.losses, b.losses):
        if not (isinstance(x, (int, float)) and isinstance(y, (int, float)) and math.isfinite(x) and math.isfinite(y)):
            return math.inf
        diffs.append(abs(x - y) / max(abs(y), 1e-30))
    return max(diffs)


def _figure(r: RunReport | None, name: str) -> float | None:
    return getattr(r, name) if r is not None and r.ok else None


def _times(n: int, value: float | None) -> float | None:
    return None if value is None else n * value


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
