"""What a check returns: findings, the facts the migration checklist grades from (where JAX/XLA
environment variables are set, where device memory or utilisation is read), and the error raised
for input that cannot be checked."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Finding:
    file: str
    line: int
    col: int
    rule: str
    severity: str
    message: str
    replacement: str

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class EnvSetting:
    """One place where the code sets an XLA_/JAX_/CUDA_VISIBLE_DEVICES/TF_CPP_/NCCL_ variable."""
    file: str
    line: int
    name: str            # e.g. XLA_PYTHON_CLIENT_PREALLOCATE
    value: str | None    # the constant assigned, or None when it is not a literal (or is appended to)
    before_import: bool  # set before the first `import jax` of that file (or the file imports no JAX)


@dataclasses.dataclass(frozen=True)
class MonitoringUse:
    """One read of device memory or utilisation, or a profiler trace."""
    file: str
    line: int
    call: str            # e.g. "memory_stats", "pynvml.nvmlDeviceGetMemoryInfo", "jax.profiler.trace", "nvidia-smi"
    kind: str = "memory"  # "memory", "utilisation" or "trace" (codecheck/monitoring.py)


@dataclasses.dataclass(frozen=True)
class RouterSite:
    """One place where the code scores a mixture-of-experts router's experts (codecheck/router_rules.py)."""
    file: str
    line: int
    call: str   # softmax, log_softmax, top_k, approx_max_k or sigmoid
    dtype: str  # "float32" or "16-bit" as the code states it, or "not said"


@dataclasses.dataclass(frozen=True)
class CodeCheck:
    files: tuple[str, ...]
    findings: tuple[Finding, ...]
    env_settings: tuple[EnvSetting, ...]
    monitoring: tuple[MonitoringUse, ...]
    # the files that use JAX (import it, Flax, Optax, ... or name jnp / lax); code items of the
    # checklist grade only these: a file without JAX says nothing about a JAX job
    jax_files: tuple[str, ...] = ()
    # findings left out of `findings` by `capped`: (rule, severity, how many), one entry per rule
    omitted: tuple[tuple[str, str, int], ...] = ()
    # what the code is, as its user said: "training" (the training checklist grades from it), "serving" (the
    # serving checklist does), or "" (not said: either may); neither checklist grades from the other kind
    role: str = ""
    routers: tuple[RouterSite, ...] = ()  # where the code scores a router's experts, and in which type

    @property
    def total(self) -> int:
        """Every finding of the check, kept or left out."""
        return len(self.findings) + sum(n for _, _, n in self.omitted)

    def count(self, rules: tuple[str, ...], severity: str | None = None) -> int:
        """Findings of these rules (of that severity), kept or left out."""
        kept = sum(f.rule in rules and severity in (None, f.severity) for f in self.findings)
        return kept + sum(n for rule, sev, n in self.omitted if rule in rules and severity in (None, sev))

    def capped(self, most: int) -> CodeCheck:
        """At most `most` findings kept (in order), and at least the first of every rule, so that what a
        rule found still shows; the others counted per rule in `omitted`. A check's size then no longer
        grows with the code's (a server keeps only this)."""
        if len(self.findings) <= most:
            return self
        kept = list(self.findings[:most])
        ruled = {f.rule for f in kept}
        left: dict[tuple[str, str], int] = {}
        for f in self.findings[most:]:
            if f.rule not in ruled:
                kept.append(f)
                ruled.add(f.rule)
            else:
                left[(f.rule, f.severity)] = left.get((f.rule, f.severity), 0) + 1
        for rule, severity, n in self.omitted:
            left[(rule, severity)] = left.get((rule, severity), 0) + n
        return dataclasses.replace(self, findings=tuple(kept),
                                   omitted=tuple((r, sev, n) for (r, sev), n in sorted(left.items())))

    def to_dict(self) -> dict:
        return {"files": list(self.files), "jax_files": list(self.jax_files),
                "findings": [f.to_dict() for f in self.findings],
                "env_settings": [dataclasses.asdict(e) for e in self.env_settings],
                "monitoring": [dataclasses.asdict(m) for m in self.monitoring],
                "omitted": [list(o) for o in self.omitted], "role": self.role,
                "routers": [dataclasses.asdict(r) for r in self.routers]}

    @classmethod
    def from_dict(cls, d) -> CodeCheck:
        return cls(files=tuple(d.get("files", ())),
                   findings=tuple(Finding(**f) for f in d.get("findings", ())),
                   env_settings=tuple(EnvSetting(**e) for e in d.get("env_settings", ())),
                   monitoring=tuple(MonitoringUse(**m) for m in d.get("monitoring", ())),
                   jax_files=tuple(d.get("jax_files", ())),
                   omitted=tuple((str(r), str(s), int(n)) for r, s, n in d.get("omitted", ())),
                   role=str(d.get("role") or ""),
                   routers=tuple(RouterSite(**r) for r in d.get("routers", ())))


class CodeCheckError(ValueError):
    """The input cannot be checked (too large, not Python); the message says why."""


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
