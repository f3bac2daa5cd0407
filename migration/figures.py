"""The figures of a run and of a plan as the page, the CSV and the command line show them, each with
where it comes from as part of the value.

A `Figure` carries its number, its unit and its provenance: measured on a device, compiled (XLA's
analysis of a program compiled for a device, without running it), predicted (a model of the step from a
compiled program or an estimate), yours (a figure the user gave) or a setting. Its label is made from the
provenance, so a compiled number cannot be printed as measured, and its text from the one formatter of
each unit (`migration.common`), so no figure is shown as a raw float or without its unit.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from migration.common import fmt_bytes, fmt_count, fmt_loss, fmt_number, fmt_percent, fmt_seconds
from migration.results import Plan, RunReport

MEASURED, COMPILED, PREDICTED, YOURS, SETTING = "measured", "compiled", "predicted", "yours", "setting"
# How each provenance reads in a label: "peak memory, measured on NVIDIA H100 80GB HBM3".
PROVENANCE_WORDS = {MEASURED: "measured", COMPILED: "compiled", PREDICTED: "predicted", YOURS: "as you gave it",
                    SETTING: "set"}


def _fmt_rate(unit: str):
    return lambda x: fmt_count(x, unit)


FORMATS = {"bytes": fmt_bytes, "s": fmt_seconds, "fraction": fmt_percent, "count": fmt_number,
           "samples/s": _fmt_rate("samples/s"), "tokens/s": _fmt_rate("tokens/s"), "loss": fmt_loss,
           "x even": lambda x: f"{x:.2f}x an even share"}


@dataclasses.dataclass(frozen=True)
class Figure:
    key: str  # a stable name: the CSV's column stem, the test's handle
    name: str  # what it is, in words: "peak memory per device"
    value: Any  # in the unit's base: bytes, seconds, a fraction, a count
    unit: str  # a key of FORMATS
    provenance: str  # a key of PROVENANCE_WORDS
    where: str = ""  # "on cpu ×1 (cpu backend)", "for H100 SXM5 80GB"
    how: str = ""  # the method, shown after the value: "XLA's memory analysis of the compiled step"

    def __post_init__(self) -> None:
        if self.provenance not in PROVENANCE_WORDS or self.unit not in FORMATS:
            raise ValueError(f"figure {self.key}: unknown provenance {self.provenance!r} or unit {self.unit!r}")

    def label(self) -> str:
        """The name with its provenance: "peak memory per device, compiled for cpu"."""
        return f"{self.name}, {PROVENANCE_WORDS[self.provenance]}" + (f" {self.where}" if self.where else "")

    def text(self) -> str:
        """The value in its unit, scaled for reading: "214 MiB", "3.1 ms", "5.28M tokens/s", "9.5%"."""
        return FORMATS[self.unit](self.value)

    def shown(self) -> str:
        return self.text() + (f" ({self.how})" if self.how else "")

    def row(self) -> dict[str, str]:
        return {"figure": self.label(), "value": self.shown(), "provenance": self.provenance}


def _device(r: RunReport) -> str:
    return f"{r.device_kind} ×{r.device_count or r.devices} ({r.backend} backend)"


def run_figures(r: RunReport, budget_bytes: int | None = None, budget_of: str = "") -> list[Figure]:
    """A run's figures, in the order a report shows them. The peak memory is `measured` only when the
    device reported it (memory_stats()); on a backend without that figure it is XLA's analysis of the
    compiled step, labelled compiled, and shown once. `budget_of` names what the budget bounds (this
    machine's device, or the plan's target)."""
    on = f"on {_device(r)}"
    figures: list[Figure] = []
    source = r.peak_memory_source or ""
    if r.peak_memory_bytes is not None:
        measured = r.peak_memory_provenance == MEASURED
        how = source.split(":", 1)[1].strip() if ":" in source else source
        figures.append(Figure("peak_memory", "peak memory per device", r.peak_memory_bytes, "bytes",
                              MEASURED if measured else COMPILED, on if measured else f"for {_device(r)}", how))
        if measured and r.predicted_peak_bytes is not None:
            figures.append(Figure("predicted_peak_memory", "peak memory per device", r.predicted_peak_bytes, "bytes",
                                  COMPILED, f"for {_device(r)}", "XLA's memory analysis of the compiled step"))
    elif r.predicted_peak_bytes is not None:
        figures.append(Figure("predicted_peak_memory", "peak memory per device", r.predicted_peak_bytes, "bytes",
                              COMPILED, f"for {_device(r)}", "XLA's memory analysis of the compiled step"))
    if budget_bytes:
        figures.append(Figure("memory_budget", "memory budget per device", budget_bytes, "bytes", SETTING,
                              f"for {budget_of}" if budget_of else ""))
    figures += [
        Figure("step_time_median", "step time, median", _s(r.step_ms_median), "s", MEASURED, on,
               f"{r.timed_steps} timed steps" if r.timed_steps else ""),
        Figure("step_time_p90", "step time, 90th percentile", _s(r.step_ms_p90), "s", MEASURED, on),
        Figure("samples_per_s", "throughput", r.samples_per_s, "samples/s", MEASURED, on),
    ]
    if r.tokens_per_s is not None:
        figures.append(Figure("tokens_per_s", "throughput", r.tokens_per_s, "tokens/s", MEASURED, on))
    if r.mfu is not None:
        figures.append(Figure("mfu", "model FLOPs utilisation", r.mfu, "fraction", MEASURED, on,
                              f"peak: {r.peak_tflops_source}" if r.peak_tflops_source else ""))
    figures += [Figure("compile_time", "compile time", r.compile_s, "s", MEASURED, on),
                Figure("recompilations", "compiles after the first step", r.recompilations, "count", MEASURED, on,
                       "jax.monitoring")]
    if r.router_dropped_mean is not None:
        figures += [Figure("router_dropped", "MoE token slots dropped, mean", r.router_dropped_mean, "fraction", MEASURED,
                           on, f"largest step {fmt_percent(r.router_dropped_max)}; the router's capacity dispatch"),
                    Figure("router_load", "MoE busiest expert's slots, mean", r.router_load_mean, "x even", MEASURED, on,
                           f"largest step {r.router_load_max:.2f}x")]
        if r.router_device_load_mean is not None and "+ep" in r.sharding:
            figures.append(Figure("router_device_load", "MoE busiest GPU's slots (expert parallel), mean",
                                  r.router_device_load_mean, "x even", MEASURED, on,
                                  f"largest step {r.router_device_load_max:.2f}x; the experts each GPU holds"))
    if r.loss_last is not None:
        figures.append(Figure("loss_last", f"loss after {len(r.losses)} steps", r.loss_last, "loss", MEASURED, on,
                              f"first step {fmt_loss(r.loss_first)}"))
    return figures


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1e3


def plan_figures(p: Plan) -> list[Figure]:
    """A plan's figures: the GPU side (compiled for the target, or estimated), the budget, and the TPU
    job's side as the plan's comparison has it (its step predicted, or yours where you measured it)."""
    target = f"for {p.target_name}"
    compiled = p.prediction_method.startswith("compiled")
    figures: list[Figure] = []
    if p.predicted_peak_bytes is not None:
        figures.append(Figure("predicted_peak_memory", "peak memory per GPU", p.predicted_peak_bytes, "bytes",
                              COMPILED if compiled else PREDICTED, target,
                              "XLA's memory analysis of the step compiled for it" if compiled else "an analytic estimate"))
    figures.append(Figure("memory_budget", "memory budget per GPU", p.budget_bytes, "bytes", SETTING, target,
                          f"{fmt_percent(p.memory_fraction)} of {fmt_bytes(p.device_memory_bytes)} less a "
                          f"{fmt_percent(p.safety_margin)} margin; device memory: {p.budget_source}"))
    if p.predicted_step_s is not None:
        st = p.step_time or {}
        error = st.get("expected_error")
        figures.append(Figure("predicted_step", "step time", p.predicted_step_s, "s", PREDICTED, target,
                              ", ".join(x for x in (str(st.get("source") or ""),
                                                    f"expected error ±{fmt_percent(error)}" if error else "") if x)))
    c = p.comparison or {}
    unit = c.get("unit")
    rate_unit = "tokens/s" if unit == "tokens" else "samples/s"
    for side, where in (("tpu", f"for {p.source_name}"), ("gpu", target)):
        s = c.get(side) or {}
        yours = side == "tpu" and bool(s.get("measured_step_s"))
        provenance = YOURS if yours else PREDICTED
        if s.get("step_s") is not None and side == "tpu":
            figures.append(Figure("tpu_step", "TPU step time", s["step_s"], "s", provenance, where, s.get("step_source", "")))
        if s.get("throughput_per_s") is not None:
            figures.append(Figure(f"{side}_throughput", f"{side.upper()} throughput", s["throughput_per_s"], rate_unit,
                                  provenance, where,
                                  "from your measured step" if yours else ""))
        if s.get("mfu") is not None:
            figures.append(Figure(f"{side}_mfu", f"{side.upper()} model FLOPs utilisation", s["mfu"], "fraction",
                                  provenance, where))
    return figures


def tpu_samples_per_s(p: Plan) -> Figure | None:
    """The TPU job's throughput in samples a second as the plan's comparison has it (your measured step, or
    the step predicted from the TPU compile): the one TPU figure a report compares a run with."""
    c = p.comparison or {}
    s = c.get("tpu") or {}
    if not s.get("step_s") or not s.get("global_batch"):
        return None
    yours = bool(s.get("measured_step_s"))
    return Figure("tpu_samples_per_s", "TPU throughput", s["global_batch"] / s["step_s"], "samples/s",
                  YOURS if yours else PREDICTED, f"for {p.source_name}",
                  f"{s['global_batch']} samples a {fmt_seconds(s['step_s'])} step, "
                  + ("your measured step" if yours else s.get("step_source", "predicted")))
