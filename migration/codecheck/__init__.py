"""Code check: reads Python source with `ast` (never runs it) and finds what will not carry over from a
TPU-era JAX training script to GPUs, with the replacement to write.

The rules and their metadata are in `rules` (`RULES`); `engine` analyses a file with the context and
value tracking (`context`, `values`), the rule families (`device_rules`, `shape_rules`,
`settings_rules`, `env_rules`), the host-sync and timing walks (`sync`, `timing`), the monitoring
facts (`monitoring`) and the silencing comments (`ignores`); `inputs` refuses what cannot be checked.

The package imports only the standard library: no JAX (it must run where JAX is not installed) and
nothing else of `migration`.
"""

from migration.codecheck.engine import check_files, check_paths, check_source, check_sources
from migration.codecheck.findings import CodeCheck, CodeCheckError, EnvSetting, Finding, MonitoringUse, has_errors
from migration.codecheck.inputs import FINDINGS_KEPT, MAX_BYTES, MAX_FILES, MAX_SOURCE_BYTES, check_pasted, read_upload
from migration.codecheck.rules import MIN_REASON_WORDS, RULES, SEVERITIES, Rule, rules_markdown

__all__ = [
    "FINDINGS_KEPT", "MAX_BYTES", "MAX_FILES", "MAX_SOURCE_BYTES", "MIN_REASON_WORDS", "RULES", "SEVERITIES",
    "CodeCheck", "CodeCheckError", "EnvSetting", "Finding", "MonitoringUse", "Rule",
    "check_files", "check_pasted", "check_paths", "check_source", "check_sources", "has_errors", "read_upload",
    "rules_markdown",
]
