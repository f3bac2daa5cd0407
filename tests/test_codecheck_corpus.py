"""Precision and recall of the code check on a labelled corpus.

Every `.py` file under tests/fixtures/codecheck/ is TPU-era training code or modern code full of
look-alikes. An expected finding is marked on its line with a trailing `# expect: RULE` (several:
`# expect: RULE1, RULE2`); a file without marks is clean. Findings are compared with the marks as
(file, line, rule) triples, so several findings of one rule on one line count once.

The table (per rule and overall: TP, FP, FN, precision, recall) is printed (shown with `pytest -s`)
and written to the terminal summary at the end of the run. Besides the overall precision and recall,
every rule has a recall floor of its own (`RECALL_FLOORS`): one rule that stops finding anything would
hardly move the overall figures.
"""

from __future__ import annotations

import dataclasses
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest

from migration.codecheck import RULES, check_source

CORPUS_DIR = Path(__file__).resolve().parent / "fixtures" / "codecheck"
EXPECT = re.compile(r"#\s*expect:\s*(.*)")
RULE_ID = re.compile(r"\b[A-Z][A-Z0-9]*[0-9]{3}\b")
MIN_FILES, MIN_CLEAN_FILES, MIN_MARKS_PER_RULE = 40, 15, 2
MIN_PRECISION, MIN_RECALL = 0.95, 0.90
# Each rule's recall on the corpus must reach its floor: the measured recall less 0.1 (all 1.000 but
# SYNC001, 27 of 28). With a handful of marks per rule, a floor of 0.9 means none may be missed.
RECALL_FLOORS = {
    "ATTN001": 0.9, "BATCH001": 0.9, "BF16OPT001": 0.9, "ENV001": 0.9, "FP16001": 0.9, "GCS001": 0.9, "IGNORE001": 0.9,
    "PJIT001": 0.9, "PMAP001": 0.9, "PMAP002": 0.9, "PMAP003": 0.9, "PREC001": 0.9, "REMOVED001": 0.9,
    "REMOVED002": 0.9, "SHAPE001": 0.9, "SYNC001": 0.85, "TIME001": 0.9, "TOPO001": 0.9, "TPU001": 0.9,
    "TPUENV001": 0.9, "TRACE001": 0.9, "ROUTER001": 0.9,
}


def expected_marks(text: str) -> set[tuple[int, str]]:
    """(line, rule) for every `# expect:` mark in the comments of one source text."""
    marks: set[tuple[int, str]] = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT and (m := EXPECT.search(tok.string)):
            marks |= {(tok.start[0], rule) for rule in RULE_ID.findall(m.group(1))}
    return marks


@dataclasses.dataclass
class Score:
    tp: int = 0
    fp: int = 0
    fn: int = 0

    @property
    def precision(self) -> float:
        return self.tp / (self.tp + self.fp) if self.tp + self.fp else 1.0

    @property
    def recall(self) -> float:
        return self.tp / (self.tp + self.fn) if self.tp + self.fn else 1.0


@dataclasses.dataclass
class CorpusResult:
    files: list[str]
    clean_files: list[str]
    expected: set[tuple[str, int, str]]
    found: set[tuple[str, int, str]]
    clean_findings: list[str]  # the product's findings on files without marks

    @property
    def misses(self) -> list[tuple[str, int, str]]:
        return sorted(self.expected - self.found)

    @property
    def false_alarms(self) -> list[tuple[str, int, str]]:
        return sorted(self.found - self.expected)

    def score(self, rule: str | None = None) -> Score:
        keep = lambda triples: {t for t in triples if rule is None or t[2] == rule}
        expected, found = keep(self.expected), keep(self.found)
        return Score(len(expected & found), len(found - expected), len(expected - found))

    def table(self) -> str:
        rows = [f"{'rule':<11} {'TP':>4} {'FP':>4} {'FN':>4} {'precision':>9} {'recall':>7}"]
        for rule in [*sorted(RULES), None]:
            s = self.score(rule)
            rows.append(f"{rule or 'overall':<11} {s.tp:>4} {s.fp:>4} {s.fn:>4} {s.precision:>9.3f} {s.recall:>7.3f}")
        rows.append(f"{len(self.files)} files: {len(self.files) - len(self.clean_files)} with expected findings, "
                    f"{len(self.clean_files)} clean")
        return "\n".join(rows)

    def listing(self) -> str:
        fmt = lambda triples: "\n".join(f"  {f}:{line} {rule}" for f, line, rule in triples) or "  none"
        return f"misses:\n{fmt(self.misses)}\nfalse alarms:\n{fmt(self.false_alarms)}"


@cache
def corpus_result() -> CorpusResult:
    files, clean, expected, found, clean_findings = [], [], set(), set(), []
    for path in sorted(CORPUS_DIR.glob("*.py")):
        text = path.read_text(encoding="utf-8")
        marks = expected_marks(text)
        findings = check_source(text, path.name)
        files.append(path.name)
        expected |= {(path.name, line, rule) for line, rule in marks}
        found |= {(f.file, f.line, f.rule) for f in findings}
        if not marks:
            clean.append(path.name)
            clean_findings += [f"{f.file}:{f.line} {f.rule} ({f.severity})" for f in findings]
    return CorpusResult(files, clean, expected, found, clean_findings)


class _SummaryPlugin:
    """Writes the corpus table into pytest's terminal summary (registered at run time)."""

    def __init__(self, text: str):
        self.text = text

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.section("code check corpus: precision and recall")
        terminalreporter.write_line(self.text)


@pytest.fixture(scope="module")
def result(request) -> CorpusResult:
    res = corpus_result()
    manager = request.config.pluginmanager
    if not manager.has_plugin("codecheck-corpus-summary"):
        manager.register(_SummaryPlugin(res.table()), "codecheck-corpus-summary")
    return res


def test_every_mark_names_a_known_rule(result):
    unknown = sorted(t for t in result.expected if t[2] not in RULES)
    assert not unknown, unknown


def test_every_rule_is_expected_at_least_twice(result):
    counts = {rule: sum(t[2] == rule for t in result.expected) for rule in RULES}
    assert all(n >= MIN_MARKS_PER_RULE for n in counts.values()), counts


def test_no_finding_on_a_clean_file(result):
    """A file without marks is clean: the check finds nothing in it, whatever the severity."""
    assert len(result.clean_files) >= MIN_CLEAN_FILES, result.clean_files
    assert not result.clean_findings, "\n".join(result.clean_findings)


def test_precision_and_recall(result):
    print("\n" + result.table())
    assert len(result.files) >= MIN_FILES and len(result.clean_files) >= MIN_CLEAN_FILES, \
        f"{len(result.files)} files, {len(result.clean_files)} clean"
    overall = result.score()
    assert overall.precision >= MIN_PRECISION and overall.recall >= MIN_RECALL, \
        f"precision {overall.precision:.3f} (need {MIN_PRECISION}), recall {overall.recall:.3f} " \
        f"(need {MIN_RECALL})\n{result.listing()}"
    # Every rule has a floor and marks to meet it with: a rule of the product without either fails.
    assert set(RECALL_FLOORS) == set(RULES), sorted(set(RECALL_FLOORS) ^ set(RULES))
    unmarked = sorted(rule for rule in RULES if not any(t[2] == rule for t in result.expected))
    assert not unmarked, f"rules with no expected mark in the corpus: {unmarked}"
    below = {rule: f"{s.recall:.3f} < {RECALL_FLOORS[rule]}" for rule in sorted(RULES)
             if (s := result.score(rule)).recall < RECALL_FLOORS[rule]}
    assert not below, f"per-rule recall under its floor: {below}\n{result.listing()}"
