"""Weak scaling runs: the TPU-era pmap step and the migrated jit step at several device counts, each run
in its own worker process, one after another; migration/grading/scaling.py compares them.

`scaling_events` is a generator of progress events for a UI (closing it stops the current worker);
`scaling_table` runs it to the end and returns the rows.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from migration.config.requests import RunConfig, validate
from migration.grading.scaling import STYLES, scaling_rows
from migration.results import RunReport
from migration.running.runner import start_run

# Worker events passed on as progress (a step event per step would flood a UI for nothing).
PROGRESS_EVENTS = ("started", "compiled")


def scaling_configs(workload: str = "transformer", preset: str = "tiny", devices: Sequence[int] = (1, 2, 4, 8), *,
                    per_device_batch: int = 8, steps: int = 20, warmup_steps: int = 3, platform: str = "cpu",
                    **fields: Any) -> list[RunConfig]:
    """One validated RunConfig per (device count, style), pmap before jit at each count. `fields`:
    any other RunConfig field (precision, seed, timeout_s...), the same for every run."""
    configs = [RunConfig(workload=workload, preset=preset, devices=n, step_style=style,
                         per_device_batch=per_device_batch, steps=steps, warmup_steps=warmup_steps,
                         platform=platform, **fields)
               for n in devices for style in STYLES]
    return [validate(cfg) for cfg in configs]


def scaling_events(workload: str = "transformer", preset: str = "tiny", devices: Sequence[int] = (1, 2, 4, 8),
                   **options: Any) -> Iterator[dict[str, Any]]:
    """Runs `scaling_configs(...)` one after another. Yields {"event": "progress", "message", ...}
    while a run goes, {"event": "report", "report": RunReport, ...} after each run, and last
    {"event": "result", "rows": [...]} (see `scaling_rows`). Raises ConfigError before any run
    starts when a setting is invalid."""
    configs = scaling_configs(workload, preset, devices, **options)
    reports: list[RunReport] = []
    for index, cfg in enumerate(configs, start=1):
        where = {"devices": cfg.devices, "style": cfg.step_style, "index": index, "runs": len(configs)}
        name = f"[{index}/{len(configs)}] {cfg.step_style} step on {cfg.devices} device(s)"
        handle = start_run(cfg)
        with contextlib.closing(handle.events()) as events:  # closed early: the worker is killed
            for ev in events:
                if ev["event"] in PROGRESS_EVENTS:
                    yield {"event": "progress", **where, "message": f"{name}: {_describe(ev)}"}
        report = handle.report
        reports.append(report)
        yield {"event": "report", **where, "report": report, "message": f"{name}: {_outcome(report)}"}
    yield {"event": "result", "rows": scaling_rows(reports)}


def scaling_table(workload: str = "transformer", preset: str = "tiny", devices: Sequence[int] = (1, 2, 4, 8), *,
                  on_progress: Callable[[dict[str, Any]], None] | None = None, **options: Any) -> list[dict[str, Any]]:
    """The rows of `scaling_events` (one per device count and style); `on_progress` gets every
    other event as it comes."""
    for ev in scaling_events(workload, preset, devices, **options):
        if ev["event"] == "result":
            return ev["rows"]
        if on_progress is not None:
            on_progress(ev)
    raise RuntimeError("the scaling runs ended without a result")


def _describe(ev: dict[str, Any]) -> str:
    if ev["event"] == "started":
        return f"started on {ev['device_kind']} x{ev['device_count']} ({ev['backend']}); compiling"
    return f"compiled in {ev['compile_s']:.1f} s; timing"


def _outcome(r: RunReport) -> str:
    if not r.ok:
        return f"{r.status} ({r.failure_kind}): {r.message}"
    return f"{r.samples_per_s:,.1f} samples/s, median step {r.step_ms_median:.1f} ms, loss {r.loss_last:.4f}"
