"""The user's environment settings (as the code check read them) against the plan's environment.

The plan's batch was sized for its memory share (XLA_PYTHON_CLIENT_MEM_FRACTION) with preallocation
off, on the GPUs it names, with the XLA flags it lists. A setting that differs changes the job the
plan was made for: a smaller memory share can leave the planned batch without room, preallocation
takes the card at start-up, fewer visible GPUs run another job. Each setting is compared on its own
(`compare`), and the checklist grades from the verdicts.

JAX's behaviour assumed here (its GPU memory documentation): preallocation is on unless
XLA_PYTHON_CLIENT_PREALLOCATE is false; the memory fraction defaults to 0.75 and caps the allocator
whether or not it preallocates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from migration.codecheck import EnvSetting
from migration.results import Plan

JAX_DEFAULT_FRACTION = 0.75
PREALLOCATE, FRACTION, VISIBLE = "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_PYTHON_CLIENT_MEM_FRACTION", "CUDA_VISIBLE_DEVICES"
MEMORY_VARS = (PREALLOCATE, FRACTION)
# Verdicts, worst first: `unsafe` fails the item, the rest below `same` warn.
UNSAFE, UNREAD, MISSING, DIFFERS, SAME = "unsafe", "not a literal", "missing", "differs", "same"
ORDER = (UNSAFE, UNREAD, MISSING, DIFFERS, SAME)


@dataclasses.dataclass(frozen=True)
class EnvCheck:
    name: str
    planned: str | None  # the plan's value; None where the plan sets none
    yours: str | None  # the value the code sets (None: not a literal, or not set)
    line: int | None  # where the code sets it; None: not set
    verdict: str  # one of ORDER
    note: str

    def text(self) -> str:
        at = f" (line {self.line})" if self.line else ""
        yours = "not set" if self.line is None else (self.yours if self.yours is not None else "a computed value")
        return f"{self.name}: yours {yours}{at}, the plan's {self.planned or 'none'}: {self.note}"


def _last(settings: Sequence[EnvSetting], name: str) -> EnvSetting | None:
    found = [s for s in settings if s.name == name]
    return found[-1] if found else None


def _float(text: str | None) -> float | None:
    try:
        value = float(text or "")
    except ValueError:
        return None
    return value if 0 < value <= 1 else None


def _preallocate(planned: str, s: EnvSetting | None) -> EnvCheck:
    if s is None:
        return EnvCheck(PREALLOCATE, planned, None, None, MISSING,
                        "JAX preallocates by default: the job takes its memory fraction of the card at start-up")
    if s.value is None:
        return EnvCheck(PREALLOCATE, planned, None, s.line, UNREAD, "computed at run time: cannot compare with the plan")
    off = s.value.strip().lower() in ("false", "0")
    if off == (planned == "false"):
        return EnvCheck(PREALLOCATE, planned, s.value, s.line, SAME, "as planned")
    return EnvCheck(PREALLOCATE, planned, s.value, s.line, DIFFERS,
                    "preallocation on: the job takes its memory fraction of the card at start-up, which a shared GPU "
                    "cannot spare")


def _fraction(plan: Plan, planned: str, s: EnvSetting | None) -> EnvCheck:
    want = float(planned)
    if s is not None and s.value is None:
        return EnvCheck(FRACTION, planned, None, s.line, UNREAD, "computed at run time: cannot compare with the plan")
    yours = JAX_DEFAULT_FRACTION if s is None else _float(s.value)
    value, line = (None, None) if s is None else (s.value, s.line)
    default = " (JAX's default 0.75 applies)" if s is None else ""
    if yours is None:
        return EnvCheck(FRACTION, planned, value, line, UNSAFE, "not a number in (0, 1]: JAX will not start with it")
    if abs(yours - want) < 0.005:
        return EnvCheck(FRACTION, planned, value, line, SAME if s is not None else MISSING, "as planned" + default)
    if yours > want:
        return EnvCheck(FRACTION, planned, value, line, DIFFERS if s is not None else MISSING,
                        f"{yours:.2f} lets the job take more of a shared GPU than the plan's {want:.2f}{default}")
    budget = int(plan.budget_bytes * yours / want)
    peak = plan.predicted_peak_bytes
    if peak is not None and peak > budget:
        return EnvCheck(FRACTION, planned, value, line, UNSAFE,
                        f"{yours:.2f} leaves {budget / 2**30:.1f} GiB, under the plan's predicted peak "
                        f"{peak / 2**30:.1f} GiB{default}")
    return EnvCheck(FRACTION, planned, value, line, DIFFERS if s is not None else MISSING,
                    f"{yours:.2f} is less than the plan's {want:.2f}; the predicted peak still fits{default}")


def _visible(plan: Plan, planned: str, s: EnvSetting | None) -> EnvCheck | None:
    if s is None:
        return None  # a scheduler (SLURM, Kubernetes) usually sets it: not required
    if s.value is None:
        return EnvCheck(VISIBLE, planned, None, s.line, UNREAD, "computed at run time: cannot compare with the plan")
    ids = [i for i in s.value.split(",") if i.strip()]
    per_node = plan.gpus_per_node if plan.nodes > 1 else plan.gpus
    if len(ids) < per_node:
        return EnvCheck(VISIBLE, planned, s.value, s.line, UNSAFE,
                        f"{len(ids)} GPU(s) visible; the plan runs {per_node} per node")
    return EnvCheck(VISIBLE, planned, s.value, s.line, SAME if len(ids) == per_node else DIFFERS,
                    "as planned" if len(ids) == per_node else f"{len(ids)} GPUs visible; the plan uses {per_node}")


def _flags(planned: str, s: EnvSetting | None) -> EnvCheck:
    if s is None:
        return EnvCheck("XLA_FLAGS", planned, None, None, MISSING, "the plan's collective flags are not set")
    if s.value is None:
        return EnvCheck("XLA_FLAGS", planned, None, s.line, UNREAD, "computed at run time: cannot compare with the plan")
    yours = set(s.value.split())
    missing = [f for f in planned.split() if f not in yours]
    if missing:
        return EnvCheck("XLA_FLAGS", planned, s.value, s.line, DIFFERS, "lacks " + " ".join(missing))
    return EnvCheck("XLA_FLAGS", planned, s.value, s.line, SAME, "has every flag of the plan")


def _exact(name: str, planned: str, s: EnvSetting | None) -> EnvCheck:
    if s is None:
        return EnvCheck(name, planned, None, None, MISSING, "not set")
    if s.value is None:
        return EnvCheck(name, planned, None, s.line, UNREAD, "computed at run time: cannot compare with the plan")
    same = s.value.strip() == planned
    return EnvCheck(name, planned, s.value, s.line, SAME if same else DIFFERS, "as planned" if same else "differs")


def compare(plan: Plan, settings: Sequence[EnvSetting], names: Sequence[str] | None = None) -> list[EnvCheck]:
    """One check per variable of the plan's environment (or of `names`), worst first. Settings made
    after `import jax` are the caller's to refuse; the last literal assignment in the code counts."""
    checks = []
    for name, item in plan.environment.items():
        if names is not None and name not in names:
            continue
        s = _last(settings, name)
        planned = item["value"]
        if name == PREALLOCATE:
            checks.append(_preallocate(planned, s))
        elif name == FRACTION:
            checks.append(_fraction(plan, planned, s))
        elif name == VISIBLE:
            found = _visible(plan, planned, s)
            checks += [found] if found else []
        elif name == "XLA_FLAGS":
            checks.append(_flags(planned, s))
        else:
            checks.append(_exact(name, planned, s))
    return sorted(checks, key=lambda c: ORDER.index(c.verdict))


def worst(checks: Sequence[EnvCheck]) -> str:
    return min((c.verdict for c in checks), key=ORDER.index, default=SAME)
