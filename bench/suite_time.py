"""The test suite's time, read from the JUnit XML file of one whole-suite run: the session's wall time (what
`python -m pytest` reports, pytest time without the installs), the number of tests, the sum of the tests'
own times (what the two workers share), and the files that cost most, each with its tests' summed time.

    python -m pytest --junitxml=/tmp/suite.xml
    python bench/suite_time.py /tmp/suite.xml [--before /tmp/before.xml] [--json bench/results/suite_time.json]

With `--before`, a second run's file (another commit, same machine) is read beside it, file by file. The
budget is the one `tests/budget.py` enforces (25 minutes of pytest time on the 2-core CI machine); the goal
is 20 minutes.
"""

from __future__ import annotations

import argparse
import collections
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from tests.budget import (  # noqa: E402
    REFERENCE_PARSE_S,
    SUITE_BUDGET_S as BUDGET_S,
    SUITE_GOAL_S as GOAL_S,
    machine_factor,
    parse_seconds,
)

SLOWEST = 10


def read(path: Path) -> dict:
    """{"wall_s", "tests", "test_s", "files": {file: seconds}} of one run's JUnit file."""
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as exc:
        raise SystemExit(f"{path}: not XML ({exc}); write a JUnit file with `python -m pytest --junitxml=PATH`")
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        raise SystemExit(f"{path}: no <testsuite> element; write one with `python -m pytest --junitxml=PATH`")
    files: dict[str, float] = collections.Counter()
    for case in suite.iter("testcase"):
        module = case.get("classname", "").split(".")
        name = module[1] if len(module) > 1 and module[0] == "tests" else module[0]
        files[f"tests/{name}.py"] += float(case.get("time") or 0)
    return {"wall_s": float(suite.get("time") or 0), "tests": int(suite.get("tests") or 0),
            "test_s": round(sum(files.values()), 1), "files": dict(files)}


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)} min {seconds % 60:02.0f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("junit", type=Path, help="the JUnit XML file of a whole-suite run")
    parser.add_argument("--before", type=Path, default=None, help="another run's file, read beside it")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the figures as a record")
    args = parser.parse_args(argv)
    for path in (args.junit, args.before):
        if path is not None and not path.is_file():
            raise SystemExit(f"{path}: no such file")
    after = read(args.junit)
    before = read(args.before) if args.before else None
    runs = [("before", before), ("after", after)] if before else [("this run", after)]
    totals = record.table(
        f"The whole suite on this machine (goal {minutes(GOAL_S)}, budget {minutes(BUDGET_S)})",
        ["run", "pytest time", "tests", "sum of the tests' times"],
        [[label, minutes(run["wall_s"]), f"{run['tests']:,}", minutes(run["test_s"])] for label, run in runs])
    slowest = sorted(after["files"].items(), key=lambda kv: -kv[1])[:SLOWEST]
    columns = ["file", "seconds"] + (["before"] if before else [])
    rows = [[name, f"{seconds:.0f}"] + ([f"{before['files'].get(name, 0):.0f}"] if before else [])
            for name, seconds in slowest]
    files = record.table(f"The {SLOWEST} slowest files (their tests' summed times)", columns, rows)
    data = {"after": {k: v for k, v in after.items() if k != "files"}, "slowest": dict(slowest)}
    if before:
        data["before"] = {k: v for k, v in before.items() if k != "files"}
    for table in (totals, files):
        print(table["title"])
        for row in table["rows"]:
            print("  " + " | ".join(row))
    # The machine's speed now, by the yardstick the budget is judged by (tests/budget.py): read right after the
    # run, on the same machine, it stands for the run's.
    parse = parse_seconds()
    factor = machine_factor(parse)
    data["parse_s"], data["factor"] = round(parse, 3), round(factor, 2)
    notes = [f"This machine parsed the yardstick (tests/fixtures/codecheck/real/) in {parse:.2f} s against "
             f"{REFERENCE_PARSE_S} s on the reference day ({factor:.2f}x): at the reference speed this run is "
             f"{minutes(after['wall_s'] / factor)} (budget {minutes(BUDGET_S)}, goal {minutes(GOAL_S)})."]
    print(notes[0])
    record.write(args.json, "suite_time", [totals, files], notes, data=data)
    return 0 if after["wall_s"] <= BUDGET_S * factor else 1


if __name__ == "__main__":
    sys.exit(main())
