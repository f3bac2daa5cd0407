"""The whole suite's time budget, kept visible: a pytest plugin (tests/conftest.py loads it) that prints, at
the end of a whole-suite run, its time against the budget, and fails the run when it took longer.

The budget is the project's: 25 minutes of pytest time on CI's machine (2 cores, 24 GiB), the goal
20 (README "Benchmarks" keeps the latest time). Only a run of the whole suite is judged (the testpaths,
no -m, -k, --deselect or file selection, no --lf): a part of it says nothing of the whole.
$MIGRATION_SUITE_BUDGET_S replaces the budget (tests/test_docs.py runs a small suite against a budget of
zero to see the run fail).

CI's machine is a shared VM whose speed drifts (Python's own parser read the code check's frozen corpus in
0.17 s on the day the budget's figures were taken, 0.32 s on a later one, the suite 1.8x slower with it). The
budget is therefore kept at that day's speed: once the tests are done, the run times the same yardstick
(`ast.parse` of tests/fixtures/codecheck/real/, the best of five, as bench/codecheck_speed.py does) and
scales the 25 minutes by the ratio, which it prints with the raw time. A budget given in seconds is not
scaled.
"""

from __future__ import annotations

import ast
import os
import time
from pathlib import Path

import pytest

SUITE_BUDGET_S = 25 * 60
SUITE_GOAL_S = 20 * 60
# The yardstick: Python's parser over the code check's frozen corpus, best of five. REFERENCE_PARSE_S is its
# time on CI's machine when the budget's figures were taken (bench/results/codecheck_speed.json, 2026-12-05).
# The corpus then held 34,280 lines: a corpus grown since is timed per line of that size, so that adding
# scripts to it never loosens the budget.
YARDSTICK = Path(__file__).resolve().parent / "fixtures" / "codecheck" / "real"
REFERENCE_PARSE_S = 0.17
REFERENCE_LINES = 34_280


def parse_seconds(runs: int = 5) -> float:
    """The best of `runs` timings of ast.parse over the yardstick corpus (seconds of this process's CPU),
    scaled to the reference corpus's size."""
    texts = [p.read_text(encoding="utf-8") for p in sorted(YARDSTICK.glob("*.py"))]
    lines = sum(text.count("\n") + 1 for text in texts) or 1  # as bench/codecheck_speed.py counts them
    best = float("inf")
    for _ in range(runs):
        t0 = time.process_time()
        for text in texts:
            ast.parse(text)
        best = min(best, time.process_time() - t0)
    return best * REFERENCE_LINES / lines


def machine_factor(parse_s: float) -> float:
    """How much slower (>1) or faster (<1) this machine parses the yardstick than on the reference day."""
    return parse_s / REFERENCE_PARSE_S


def budget_s() -> float:
    """The budget in seconds: $MIGRATION_SUITE_BUDGET_S when set (a number of seconds, 0 or more), else 25 min."""
    given = os.environ.get("MIGRATION_SUITE_BUDGET_S", "").strip()
    if not given:
        return float(SUITE_BUDGET_S)
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise pytest.UsageError(f"MIGRATION_SUITE_BUDGET_S={given!r}: the suite's time budget is a number of "
                                "seconds, 0 or more (unset: 1500, 25 minutes)")
    return value


def whole_suite(config: pytest.Config) -> bool:
    """The run collects the whole suite: nothing selected or deselected on the command line."""
    opt = config.option
    paths = [a for a in config.args if not a.startswith("-")]
    testpaths = config.getini("testpaths") or []
    chosen = not paths or sorted(os.path.normpath(p) for p in paths) == sorted(os.path.normpath(p) for p in testpaths)
    return (chosen and not getattr(opt, "markexpr", "") and not getattr(opt, "keyword", "")
            and not getattr(opt, "deselect", None) and not getattr(opt, "lf", False)
            and not getattr(opt, "failedfirst", False) and not getattr(opt, "exitfirst", False))


def _controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")  # pytest-xdist's workers carry workerinput; the controller not


def pytest_sessionstart(session: pytest.Session) -> None:
    budget_s()  # a budget that is not a number is refused before the run, not after it
    session.config.stash[_STARTED] = time.monotonic()


def judged_budget_s(config: pytest.Config) -> float:
    """The budget this run is judged by: the given one, or 25 minutes scaled by this machine's speed."""
    return budget_s() * config.stash.get(_FACTOR, 1.0)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _controller(config) or not whole_suite(config) or _STARTED not in config.stash:
        return
    elapsed = time.monotonic() - config.stash[_STARTED]
    config.stash[_ELAPSED] = elapsed
    if not os.environ.get("MIGRATION_SUITE_BUDGET_S", "").strip():
        # Timed once the tests are done: at the start, the workers' own start-up shares the cores with it
        # (2.35x measured there against 1.74x after the same run).
        config.stash[_FACTOR] = machine_factor(parse_seconds())
    if elapsed > judged_budget_s(config) and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    elapsed = config.stash.get(_ELAPSED, None)
    if elapsed is None:
        return
    budget = judged_budget_s(config)
    factor = config.stash.get(_FACTOR, None)
    line = (f"the whole suite took {elapsed / 60:.1f} min of pytest time: budget {budget / 60:.1f} min, "
            f"goal {SUITE_GOAL_S / 60:.0f} min on 2 cores")
    if factor is not None:
        line += (f" (at the reference speed: {elapsed / factor / 60:.1f} min against {budget_s() / 60:.0f}; this "
                 f"machine parsed the yardstick in {factor * REFERENCE_PARSE_S:.2f} s against {REFERENCE_PARSE_S} s, "
                 f"{factor:.2f}x)")
    if elapsed > budget:
        terminalreporter.write_line(f"SUITE OVER ITS TIME BUDGET: {line}. Find where the time went "
                                    "(--durations, per-file totals) and make it cheaper.", red=True, bold=True)
    else:
        terminalreporter.write_line(line)


_STARTED = pytest.StashKey[float]()
_ELAPSED = pytest.StashKey[float]()
_FACTOR = pytest.StashKey[float]()
