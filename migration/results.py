"""The backend's typed results: a run (`RunReport`, built from the worker's events) and a plan
(`Plan`, built once by the planner); JSON and CSV export.

Every figure says where it was measured (`device_kind`, `backend`, `jax_version`, `host`) and how
(`peak_memory_source`, `peak_tflops_source`, `method`, `prediction_method`).
"""

from __future__ import annotations

import dataclasses
import json
import socket
from pathlib import Path
from typing import Any

from migration.common import fmt_model, fmt_seconds, json_safe, write_csv as write_csv_rows
from migration.config.requests import RunConfig


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
    sharding: str = "replicated"
    step_style: str = "jit"  # the step timed: "jit" (migrated) or "pmap" (the TPU-era "before")
    model: str = ""  # the preset's dimensions that were overridden, as "name=value ..." (see fmt_model)
    # where
    backend: str | None = None  # the JAX backend the run used: cpu or gpu
    device_kind: str | None = None
    device_count: int | None = None
    process_index: int | None = None  # this process of a multi-process job (0 writes the job's exports)
    process_count: int | None = None
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
    # executables (parameter init, data, train step) JAX's persistent compilation cache served; None: cache off
    compile_cache_hits: int | None = None
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
    # a mixture-of-experts run's router over the timed steps (None for other models): the share of token slots
    # dropped past the experts' capacity, the busiest expert's slots over an even share (1: evenly spread), and
    # the busiest device's (the slots of the experts it holds; 1 without expert parallelism)
    router_dropped_mean: float | None = None
    router_dropped_max: float | None = None
    router_load_mean: float | None = None
    router_load_max: float | None = None
    router_device_load_mean: float | None = None
    router_device_load_max: float | None = None
    # ... and its compiled step's matrix-product FLOPs per device against the model's (migration/running/measure.py)
    compiled_matmul_flops: float | None = None
    model_flops_per_device_step: float | None = None
    losses: list[float] = dataclasses.field(default_factory=list)
    step_ms: list[float] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    profile: dict[str, Any] | None = None  # summary of the profiled steps, when captured
    # checkpoints (migration/running/checkpoint.py): the step the run started from and where from; what it wrote
    restored_step: int | None = None
    checkpoint_restored: str | None = None
    checkpoint_saved: str | None = None
    checkpoint_saved_bytes: int | None = None
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
            sharding=cfg.sharding,
            step_style=cfg.step_style,
            model=fmt_model(cfg.model),
            losses=losses,
            step_ms=[ev["step_ms"] for ev in steps],
            loss_first=losses[0] if losses else None,
            loss_last=losses[-1] if losses else None,
            config=cfg.to_dict(),
            stderr_tail=stderr_tail,
            started_at=started_at,
            wall_s=wall_s,
        )

    @property
    def peak_memory_provenance(self) -> str | None:
        """Where the peak memory figure comes from: `memory_provenance` of its source; None without one."""
        return None if self.peak_memory_bytes is None else memory_provenance(self.peak_memory_source)

    # -- export ------------------------------------------------------------------------------
    def csv_row(self) -> dict[str, Any]:
        """Scalar fields only (per-step lists and nested dicts stay in the JSON), and where the peak memory
        comes from; the same columns for every report."""
        row = {k: v for k, v in self.to_dict().items() if k not in NON_SCALAR_FIELDS}
        return row | {"peak_memory_provenance": self.peak_memory_provenance}


NON_SCALAR_FIELDS = ("losses", "step_ms", "env", "profile", "config")


def memory_provenance(source: str | None) -> str:
    """"measured" when a peak memory figure's source says the device reported it (memory_stats(), a serving
    run's device peak), else "compiled": XLA's analysis of the compiled program, on a backend that reports no
    peak (the CPU's), or a host figure standing in for one."""
    return "measured" if (source or "").startswith("measured") else "compiled"


def write_csv(reports: list[RunReport], path: str | Path | None = None) -> str:
    """One row per run, a header row, units in the column names. Spreadsheet-safe cells."""
    return write_csv_rows([r.csv_row() for r in reports], path=path)


@dataclasses.dataclass
class Decision:
    decision: str
    value: Any
    reason: str

    def shown(self) -> str:
        """The value as people read it: a step time in the unit that fits it, a saving as a percentage."""
        number = isinstance(self.value, (int, float)) and not isinstance(self.value, bool)
        if self.decision == "step_time":
            return fmt_seconds(self.value) if number else "n/a"
        if self.decision == "attention_saving" and number:
            return f"{self.value:+.0%} time"
        return str(self.value)


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
    budget_source: str  # where the device memory figure comes from
    # the plan
    per_device_batch: int
    accumulation_steps: int
    global_batch: int
    requested_global_batch: int
    global_batch_exact: bool
    precision: str
    remat: str
    remat_chosen_by: str  # "search" (ranked by predicted step time) or "override"
    predicted_peak_bytes: int | None
    predicted_step_s: float | None
    prediction_method: str  # compiled-for-target, compiled-local or estimate
    prediction_note: str
    # evidence
    param_count: int
    compiles: int
    cache_hits: int
    search_seconds: float
    max_batch_by_remat: dict[str, int]
    candidates: list[int]  # the per-device batches the search chose among
    ranked: list[dict[str, Any]]  # fitting (remat, batch, accumulation) choices, fastest first
    table: list[dict[str, Any]]  # one row per (batch, remat, accumulation) evaluated: predicted bytes
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
    planned_device_kind: str | None = None  # for target "local": the device the plan was made for
    model: dict[str, Any] = dataclasses.field(default_factory=dict)  # dimension overrides as planned
    sharding: str = "replicated"  # how parameters, gradients and optimizer state live on the GPUs
    nodes: int = 1
    gpus_per_node: int = 1
    # GPUs whose collectives stay on the fast link (an HGX node's NVLink, an NVL72 rack's 72); 0: not recorded
    domain_gpus: int = 0
    max_batch_by_sharding: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    source_job: dict[str, Any] = dataclasses.field(default_factory=dict)  # how the TPU job held its state
    interconnect: str = ""  # the link the step-time model assumed between GPUs
    state: dict[str, Any] = dataclasses.field(default_factory=dict)  # state bytes per GPU: compiled vs arithmetic
    ruled_out_by_bound: int = 0  # candidates not compiled: their analytic lower bound exceeded the budget
    parallel_compiles: int = 0  # of `compiles`, those that ran in a compile worker beside the search
    # the predicted step time's method and parts (planning/steptime.py): compiled program or analytic
    step_time: dict[str, Any] = dataclasses.field(default_factory=dict)
    # how the choice was ranked: by compiled step time (how many candidates were compiled and why the others
    # were not) or by the analytic estimate where no program could be timed
    ranking: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the layout's mesh: axes and sizes, the PartitionSpecs of its state and batch, how to launch it
    mesh: dict[str, Any] = dataclasses.field(default_factory=dict)
    # the TPU job and this plan side by side (planning/compare.py): memory, step, throughput, MFU, time and
    # cost to train, the GPUs that match the TPU job's throughput, which TPU step to trust
    comparison: dict[str, Any] = dataclasses.field(default_factory=dict)
    source_slices: int = 1  # slices of `source` the TPU job ran on (multislice)
    mu_dtype: str = "float32"  # AdamW's first moment, as the TPU job keeps it (PlanRequest.mu_dtype)

    @property
    def measured_tpu_step_ms(self) -> float | None:
        """The TPU step time the user measured, as the plan was given it (None: not given)."""
        tpu = (self.comparison or {}).get("tpu") or {}
        measured = tpu.get("measured_step_s")
        return measured * 1e3 if isinstance(measured, (int, float)) and not isinstance(measured, bool) else None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Plan":
        """A plan from its JSON; a plan written by an older version (fields missing) or something
        else raises ValueError saying so."""
        if not isinstance(data, dict):
            raise ValueError("not a plan: expected a JSON object")
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"missing {', '.join(missing[:4])}{' …' if len(missing) > 4 else ''}: made by an older "
                             "version or not a plan; make it again with `python -m migration plan`")
        data = dict(data)
        data["decisions"] = [Decision(**d) for d in data.get("decisions", [])]
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def step_label(self) -> str:
        """The predicted step time with where it comes from and its expected error, e.g.
        "537.0 ms (compiled program, expected error ±25%)"; "" without a prediction."""
        if self.predicted_step_s is None:
            return ""
        st = self.step_time or {}
        error = st.get("expected_error")
        error = error if isinstance(error, (int, float)) and not isinstance(error, bool) else None
        source = st.get("source") if isinstance(st.get("source"), str) else None
        how = ", ".join(x for x in (source, f"expected error ±{error:.0%}" if error else "") if x)
        return fmt_seconds(self.predicted_step_s) + (f" ({how})" if how else "")

    @property
    def reasons(self) -> dict[str, str]:
        return {d.decision: d.reason for d in self.decisions}

    def ranked_rows(self) -> list[dict[str, Any]]:
        """The ranked choices for display: the predicted step as text (relative where the target
        has no known peak), whether it keeps the global batch, and which one the plan is."""
        rows = []
        for c in self.ranked:
            step = (fmt_seconds(c["predicted_step_s"]) if c["predicted_step_s"] is not None
                    else f"{c['relative_cost']:.3g} (relative)")
            if c.get("compiled_step_s") is None and c.get("estimate_s") is not None:
                step = f"~{fmt_seconds(c['estimate_s'])}"  # not compiled: the estimate that ordered it
            rows.append({"remat": c["remat"], "per_device_batch": c["per_device_batch"],
                         "accumulation_steps": c["accumulation_steps"], "global_batch": c["global_batch"],
                         "device_fill": f"{c['fill']:.0%}", "predicted_step": step,
                         "state": c.get("sharding", "replicated"),
                         "how": "compiled" if c.get("compiled_step_s") is not None else "estimate",
                         "status": c.get("status", ""),
                         "chosen": "✔" if (c["remat"], c["per_device_batch"], c["accumulation_steps"],
                                          c.get("sharding", "replicated")) ==
                                         (self.remat, self.per_device_batch, self.accumulation_steps,
                                          self.sharding) else ""})
        return rows
