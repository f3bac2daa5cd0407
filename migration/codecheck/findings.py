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
class CodeCheck:
    files: tuple[str, ...]
    findings: tuple[Finding, ...]
    env_settings: tuple[EnvSetting, ...]
    monitoring: tuple[MonitoringUse, ...]
    # the files that use JAX (import it, Flax, Optax, ... or name jnp / lax); code items of the
    # checklist grade only these: a file without JAX says nothing about a JAX job
    jax_files: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"files": list(self.files), "jax_files": list(self.jax_files),
                "findings": [f.to_dict() for f in self.findings],
                "env_settings": [dataclasses.asdict(e) for e in self.env_settings],
                "monitoring": [dataclasses.asdict(m) for m in self.monitoring]}

    @classmethod
    def from_dict(cls, d) -> CodeCheck:
        return cls(files=tuple(d.get("files", ())),
                   findings=tuple(Finding(**f) for f in d.get("findings", ())),
                   env_settings=tuple(EnvSetting(**e) for e in d.get("env_settings", ())),
                   monitoring=tuple(MonitoringUse(**m) for m in d.get("monitoring", ())),
                jax_files=tuple(d.get("jax_files", ())))


class CodeCheckError(ValueError):
    """The input cannot be checked (too large, not Python); the message says why."""


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
