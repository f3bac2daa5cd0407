"""The typed result of one run, built from the worker's events; JSON and CSV export.

Every figure says where it was measured (`device_kind`, `platform`, `jax_version`, `host`) and how
(`peak_memory_source`, `peak_tflops_source`, `method`).
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import socket
from pathlib import Path
from typing import Any

from migration.config import RunConfig


class JsonExport:
    """`to_dict` / `to_json` for result dataclasses (non-finite floats made JSON-safe)."""

    def to_dict(self) -> dict[str, Any]:
        return json_safe(dataclasses.asdict(self))

    def to_json(self, path: str | Path | None = None) -> str:
        text = json.dumps(self.to_dict(), indent=2, allow_nan=False)
        if path is not None:
            Path(path).write_text(text + "\n")
        return text


@dataclasses.dataclass
class RunReport(JsonExport):
    status: str  # "ok", "failed" or "cancelled"
    failure_kind: str | None  # oom, crashed, timeout, invalid, cancelled; None when ok
    message: str
    # what ran
    workload: str
    preset: str
    precision: str
    remat: str
    per_device_batch: int
    devices: int
    accumulation_steps: int
    global_batch: int
    steps: int
    warmup_steps: int
    # where
    backend: str | None = None  # the JAX backend the run used: cpu or gpu
    device_kind: str | None = None
    device_count: int | None = None
    jax_version: str | None = None
    jaxlib_version: str | None = None
    flax_version: str | None = None
    optax_version: str | None = None
    python_version: str | None = None
    host: str = dataclasses.field(default_factory=socket.gethostname)
    started_at: str | None = None
    wall_s: float | None = None
    method: str = "measured"
    fp32_matmul_precision: str | None = None
    # what it cost
    param_count: int | None = None
    compile_s: float | None = None
    step_ms_median: float | None = None
    step_ms_p90: float | None = None
    step_ms_mean: float | None = None
    timed_steps: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    model_flops_per_step: float | None = None
    achieved_tflops: float | None = None
    peak_tflops: float | None = None
    peak_tflops_source: str | None = None
    mfu: float | None = None
    peak_memory_bytes: int | None = None
    peak_memory_source: str | None = None
    predicted_peak_bytes: int | None = None
    process_peak_rss_bytes: int | None = None
    device_memory_limit_bytes: int | None = None
    data_pool_batches: int | None = None
    data_pool_bytes: int | None = None
    recompilations: int | None = None
    # how training behaved
    loss_first: float | None = None
    loss_last: float | None = None
    skipped_steps: int | None = None
    final_loss_scale: float | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    step_ms: list[float] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    profile: dict[str, Any] | None = None  # summary of the profiled steps, when captured
    config: dict[str, Any] = dataclasses.field(default_factory=dict)
    stderr_tail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_events(
        cls,
        cfg: RunConfig,
        events: list[dict[str, Any]],
        *,
        status: str,
        failure_kind: str | None = None,
        message: str = "",
        stderr_tail: str = "",
        started_at: str | None = None,
        wall_s: float | None = None,
    ) -> "RunReport":
        explicit = {"status", "failure_kind", "message", "global_batch", "losses", "step_ms", "config",
                    "stderr_tail", "started_at", "wall_s", *RunConfig.__dataclass_fields__}
        names = {f.name for f in dataclasses.fields(cls)} - explicit
        fields: dict[str, Any] = {}
        for ev in events:
            if ev.get("event") in ("started", "compiled", "finished"):
                fields.update({k: v for k, v in ev.items() if k in names})
        steps = [ev for ev in events if ev.get("event") == "step"]
        losses = [ev["loss"] for ev in steps]
        return cls(
            **fields,
            status=status,
            failure_kind=failure_kind,
            message=message,
            workload=cfg.workload,
            preset=cfg.preset,
            precision=cfg.precision,
            remat=cfg.remat,
            per_device_batch=cfg.per_device_batch,
            devices=cfg.devices,
            accumulation_steps=cfg.accumulation_steps,
            global_batch=cfg.global_batch,
            steps=cfg.steps,
            warmup_steps=cfg.warmup_steps,
            losses=losses,
            step_ms=[ev["step_ms"] for ev in steps],
            loss_first=losses[0] if losses else None,
            loss_last=losses[-1] if losses else None,
            config=cfg.to_dict(),
            stderr_tail=stderr_tail,
            started_at=started_at,
            wall_s=wall_s,
        )

    # -- export ------------------------------------------------------------------------------
    def csv_row(self) -> dict[str, Any]:
        """Scalar fields only (per-step lists and nested dicts stay in the JSON); the same columns
        for every report."""
        return {k: v for k, v in self.to_dict().items() if k not in NON_SCALAR_FIELDS}


NON_SCALAR_FIELDS = ("losses", "step_ms", "env", "profile", "config")


def write_csv(reports: list[RunReport], path: str | Path | None = None) -> str:
    """One row per run, a header row, units in the column names. Spreadsheet-safe cells."""
    rows = [r.csv_row() for r in reports]
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else [], lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(v) for k, v in row.items()})
    if path is not None:
        Path(path).write_text(buf.getvalue())
    return buf.getvalue()


def csv_cell(value: Any) -> Any:
    # A text cell starting with = + - @ would be evaluated by a spreadsheet: neutralise it.
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def json_safe(value: Any) -> Any:
    """Non-finite floats as JSON can carry them: NaN -> null, infinities -> \"inf\" / \"-inf\"."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
