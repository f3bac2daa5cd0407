"""The whole suite's time budget, kept visible: a pytest plugin (tests/conftest.py loads it) that prints, at
the end of a whole-suite run, its time against the budget, and fails the run when it took longer.

The budget is the project's: 25 minutes of pytest time on CI's machine (2 cores, 24 GiB), the goal
20 (README "Benchmarks" keeps the latest time). Only a run of the whole suite is judged (the testpaths,
no -m, -k, --deselect or file selection, no --lf): a part of it says nothing of the whole.
$MIGRATION_SUITE_BUDGET_S replaces the budget (tests/test_docs.py runs a small suite against a budget of
zero to see the run fail).
"""

from __future__ import annotations

import os
import time

import pytest

SUITE_BUDGET_S = 25 * 60
SUITE_GOAL_S = 20 * 60


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


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    if not _controller(config) or not whole_suite(config) or _STARTED not in config.stash:
        return
    elapsed = time.monotonic() - config.stash[_STARTED]
    config.stash[_ELAPSED] = elapsed
    if elapsed > budget_s() and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    elapsed = config.stash.get(_ELAPSED, None)
    if elapsed is None:
        return
    budget = budget_s()
    line = (f"the whole suite took {elapsed / 60:.1f} min of pytest time: budget {budget / 60:.1f} min, "
            f"goal {SUITE_GOAL_S / 60:.0f} min on 2 cores")
    if elapsed > budget:
        terminalreporter.write_line(f"SUITE OVER ITS TIME BUDGET: {line}. Find where the time went "
                                    "(--durations, per-file totals) and make it cheaper.", red=True, bold=True)
    else:
        terminalreporter.write_line(line)


_STARTED = pytest.StashKey[float]()
_ELAPSED = pytest.StashKey[float]()
