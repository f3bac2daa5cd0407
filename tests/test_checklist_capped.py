"""The checklist over a capped code check (`CodeCheck.capped`: what the app's worker returns): the items that
print how many findings a rule made count the ones left out too, and say there are more."""

from __future__ import annotations

from migration.codecheck import CodeCheck, Finding
from migration.grading.checklist import API_RULES, grade_apis, grade_host_sync


def _finding(rule: str, line: int, severity: str = "warning") -> Finding:
    return Finding("train.py", line, 1, rule, severity, "m", "r")


class Ev:
    """The two items read only the code check."""

    def __init__(self, code: CodeCheck):
        self.code = code

    def findings(self, rules):
        return [f for f in self.code.findings if f.rule in rules]

    def finding_count(self, rules, severity=None):
        return self.code.count(rules, severity)


def test_the_checklist_counts_findings_left_out_of_a_capped_check():
    rule = API_RULES[0]
    many = tuple([_finding(rule, i, "error") for i in range(1, 301)] + [_finding("SYNC001", 400 + i) for i in range(30)])
    code = CodeCheck(files=("train.py",), findings=many, env_settings=(), monitoring=(), jax_files=("train.py",))

    full, capped = Ev(code), Ev(code.capped(20))
    assert grade_apis(full)[:2] == grade_apis(capped)[:2] and "300 TPU-only" in grade_apis(capped)[1]
    status, evidence, _ = grade_host_sync(capped)
    assert status == grade_host_sync(full)[0] and "30 host sync" in evidence and evidence.endswith(" …"), evidence


def test_an_uncapped_check_reads_as_before():
    few = tuple(_finding("SYNC001", i) for i in range(3))
    code = CodeCheck(files=("train.py",), findings=few, env_settings=(), monitoring=(), jax_files=("train.py",))
    evidence = grade_host_sync(Ev(code))[1]
    assert "3 host sync(s)" in evidence and not evidence.endswith("…"), evidence
    nine = tuple(_finding("SYNC001", i) for i in range(9))
    code = CodeCheck(files=("train.py",), findings=nine, env_settings=(), monitoring=(), jax_files=("train.py",))
    assert grade_host_sync(Ev(code))[1].endswith(" …")
