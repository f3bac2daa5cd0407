"""What the checklists are graded from, and the words of a grade: the statuses, the migrated job's evidence,
an item's declared statuses and grade function, and how a measurement says where it was made."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from migration.codecheck import CodeCheck
from migration.hardware import gpu_spec_for_device_kind
from migration.results import Plan, RunReport

PASS, WARN, FAIL, NA, NOT_CHECKED = "pass", "warn", "fail", "n/a", "not checked"


@dataclasses.dataclass(frozen=True)
class ChecklistItem:
    id: str
    item: str
    status: str
    evidence: str
    action: str


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What the checklist is graded from.

    `run` is the migrated run as it actually ran; `ran_plan` the plan for the machine it ran on
    when that differs from `plan` (a plan made for another GPU, re-fitted or checked here)."""

    plan: Plan
    run: RunReport | None = None
    ran_plan: Plan | None = None
    code: CodeCheck | None = None
    fp32_reference: RunReport | None = None
    bf16_reference: RunReport | None = None  # an fp8 run's: the same config in bf16
    tpu_style_run: RunReport | None = None
    pmap_run: RunReport | None = None  # the TPU-era pmap step on the same config, devices and data
    scaling_runs: tuple[RunReport, ...] = ()
    tpu_step_ms: float | None = None  # the user's measured TPU step time at the requested global batch

    def __post_init__(self) -> None:
        if self.code is not None and self.code.role == "serving":  # a server's code says nothing of the training job
            object.__setattr__(self, "code", None)

    @property
    def ran(self) -> bool:
        return self.run is not None and self.run.ok

    @property
    def budget_plan(self) -> Plan:
        """The plan whose budget applies to the run: the one for the machine it ran on."""
        return self.ran_plan or self.plan

    def on_target(self, r: RunReport | None) -> bool:
        """Whether `r` ran on the plan's target GPU (same catalog entry, or the planned local GPU)."""
        if r is None or r.backend != "gpu" or not r.device_kind:
            return False
        if self.plan.target == "local":
            return self.plan.planned_device_kind == r.device_kind
        spec = gpu_spec_for_device_kind(r.device_kind)
        return spec is not None and spec.key == self.plan.target

    def findings(self, rules: tuple[str, ...]) -> list:
        """The findings of these rules that the check kept (a check from the app keeps the first ones)."""
        return [f for f in (self.code.findings if self.code else ()) if f.rule in rules]

    def finding_count(self, rules: tuple[str, ...], severity: str | None = None) -> int:
        """How many findings of these rules the check made, kept or only counted."""
        return self.code.count(rules, severity) if self.code else 0


NO_CODE = "your training code was not checked"
CHECK_CODE = "check your training script (Code check tab, or python -m migration check train.py) and grade again"


def code_scope(code: CodeCheck) -> str:
    """"code check of 2 file(s) (train.py, model.py)": what a code-graded item read."""
    return f"code check of {len(code.files)} file(s) ({', '.join(Path(f).name for f in code.files[:4])})"


Grade = tuple[str, str, str]  # status, evidence, action


def device_count(r: RunReport) -> int:
    """The devices a run measured: as the run reported them, else as it was configured."""
    return r.device_count or r.devices


def where(r: RunReport) -> str:
    return f"measured on {r.device_kind} x{device_count(r)} ({r.backend} backend), JAX {r.jax_version}"


def elsewhere(ev: Evidence, r: RunReport) -> str:
    """Why a measurement is not the target's, for a warn."""
    if r.backend != "gpu":
        return f"measured on the CPU backend ({r.device_kind}), not on {ev.plan.target_name}"
    return f"measured on {r.device_kind}, not on the target {ev.plan.target_name}"


@dataclasses.dataclass(frozen=True)
class ItemSpec:
    title: str
    statuses: tuple[str, ...]  # every status the function can return
    grade: Callable[[Any], Grade]  # of an Evidence (or the serving checklist's ServingEvidence)
