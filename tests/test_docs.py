"""The documentation stays true: its generated parts are what the code makes now, every benchmark record is on
a page, the screenshots show the app's tabs, the README's two commands are CI's, and one version number is
reported everywhere."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.server import ROOT

sys.path.insert(0, str(ROOT / "docs"))
import generate  # noqa: E402  (docs/generate.py)

README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
SCREENSHOTS = ROOT / "docs" / "img" / "screenshots.json"


def test_every_generated_part_of_the_docs_is_current():
    stale = generate.stale()
    assert stale == [], f"out of date: {stale}; run `python docs/generate.py` and commit the pages"


def test_a_changed_source_makes_its_region_stale():
    page = "intro\n<!-- generated:layers -->\nwhat it said last year\n<!-- /generated:layers -->\nafter\n"
    made: dict[str, str] = {}
    new = generate.regenerate(page, made)
    assert new != page and new.startswith("intro\n<!-- generated:layers -->\n") and new.endswith(
        "<!-- /generated:layers -->\nafter\n")
    assert "`migration.codecheck`" in new and "what it said last year" not in new
    assert generate.regenerate(new, made) == new  # regenerating a current page changes nothing
    with pytest.raises(KeyError, match="no generator for the region 'nonsense'"):
        generate.regenerate("<!-- generated:nonsense -->\n<!-- /generated:nonsense -->", {})


def test_the_reference_pages_hold_every_flag_field_rule_and_endpoint():
    from migration.cli.parser import build_parser
    from migration.codecheck.rules import RULES
    from migration.config.fields import FIELDS

    pages = {name: (ROOT / "docs" / "reference" / f"{name}.md").read_text(encoding="utf-8")
             for name in ("cli", "fields", "rules", "api")}
    for name, sub in generate.subcommands(build_parser()):
        assert f"## `{name}`" in pages["cli"]
        for action in sub._actions:
            for flag in action.option_strings:
                assert flag in pages["cli"], f"{name} {flag}"
    for flag in ("--auth-file", "--worker-cpus", "--ray-address", "--fail-on", "--fix"):
        assert flag in pages["cli"]
    assert all(f"| `{f.name}` |" in pages["fields"] for f in FIELDS)
    assert all(f"`{rule}`" in pages["rules"] for rule in RULES)
    for endpoint in ("/plan", "/run", "/code_check", "/serve_plan", "/history", "/export_history_csv"):
        assert f"### `{endpoint}`" in pages["api"]


def test_every_benchmark_record_is_complete_and_on_the_benchmarks_page():
    page = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    records = sorted((ROOT / "bench" / "results").glob("*.json"))
    assert len(records) >= 10
    for path in records:
        record = json.loads(path.read_text(encoding="utf-8"))
        assert {"bench", "command", "machine", "date", "tables", "notes"} <= set(record), path.name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", record["date"]) and record["tables"], path.name
        assert record["command"].startswith(("python bench/", "bash bench/")), path.name
        for t in record["tables"]:
            assert t["rows"] and all(len(row) == len(t["columns"]) for row in t["rows"]), path.name
        assert f"<!-- generated:bench:{path.stem} -->" in page, f"{path.name} is on no page"


def test_the_readme_is_a_front_page_whose_two_commands_are_what_ci_runs():
    assert len(README.splitlines()) <= 150
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    app = next(b for b in blocks if "python app.py" in b).strip()
    tests = next(b for b in blocks if "python -m pytest" in b).strip()
    assert app.endswith("pip install -r requirements.txt -c constraints.txt && python app.py")
    steps = [s.strip() for s in tests.split("&&")]
    assert steps == ["python3 -m venv .venv", ". .venv/bin/activate",
                     "pip install -r requirements-dev.txt -c constraints.txt", "python -m pytest"]
    lines = [line.strip() for line in CI.splitlines()]
    at = [next(i for i, line in enumerate(lines) if line == s or line.startswith(s + " ")) for s in steps]
    assert at == sorted(at), "CI runs the README's steps in another order"
    assert "mkdocs build --strict" in CI and "lint-imports" in CI
    getting_started = (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")
    assert app in getting_started and tests in getting_started


def test_the_readmes_defaults_are_the_forms():
    """The front page's description of the form's defaults names the values the form starts at."""
    from migration.config.fields import FIELD
    from migration.hardware import TPU_SPECS
    from workloads import WORKLOADS

    said = re.search(r"defaults describe a TPU job \(`(\w+)` / `([\w-]+)` from a ([\w-]+), global batch (\d+),\s+"
                     r"(\w+), no remat\)", README)
    assert said, "README no longer describes the form's defaults in the sentence this test reads"
    workload, preset, source, batch, precision = said.groups()
    assert workload == FIELD["workload"].default and preset == FIELD["preset"].default
    assert "tiny" in WORKLOADS[workload].presets  # the preset the form picks for the workload (ui.migrate.presets_of)
    assert FIELD["source"].default.endswith(source) and FIELD["source"].default in TPU_SPECS
    assert int(batch) == FIELD["global_batch"].default and precision == FIELD["source_precision"].default


def test_constraints_pin_every_requirement_that_ci_installs():
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==(\S+)", line)
        if m:
            pinned[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2]
    required = set()
    for name in ("requirements.txt", "requirements-dev.txt", "requirements-ray.txt", "requirements-docs.txt",
                 "requirements-fix.txt", "requirements-export.txt"):
        for line in (ROOT / name).read_text(encoding="utf-8").splitlines():
            m = re.match(r"^([A-Za-z][A-Za-z0-9_.\-]*)", line.split("#")[0].strip())  # not -r lines
            if m:
                required.add(re.sub(r"[-_.]+", "-", m[1]).lower())
    assert required - {"torch"} <= set(pinned), sorted(required - set(pinned))  # torch: its own == in requirements
    assert pinned["jax"] == "0.10.2"
    command = "uv pip compile requirements-dev.txt --python-version 3.11 --no-emit-package torch -o constraints.txt"
    assert command in (ROOT / "constraints.txt").read_text(encoding="utf-8").split("\n", 3)[1]  # uv's header
    assert command in (ROOT / "docs" / "getting-started.md").read_text(encoding="utf-8")


def version_lines() -> dict[str, str]:
    commands = {"cli": [sys.executable, "-m", "migration", "--version"],
                "linter": [sys.executable, "-m", "migration.codecheck", "--version"],
                "app": [sys.executable, "app.py", "--version"]}
    return {k: subprocess.run(c, cwd=ROOT, capture_output=True, text=True, timeout=120).stdout.strip()
            for k, c in commands.items()}


@pytest.mark.slow
def test_one_version_in_pyproject_changelog_and_every_command():
    from migration import version

    number = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["version"]
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", changelog, re.M)
    assert "## [Unreleased]" in changelog and releases[0][0] == number
    assert version() == number
    assert version_lines() == {"cli": f"python -m migration {number}",
                               "linter": f"python -m migration.codecheck {number}",
                               "app": f"python app.py {number}"}


def test_the_screenshots_show_the_tabs_the_app_has():
    """The browser test takes the screenshots and writes this manifest (MIGRATION_UPDATE_SCREENSHOTS=1); a tab
    added, renamed or removed since makes them stale."""
    manifest = json.loads(SCREENSHOTS.read_text(encoding="utf-8"))
    assert manifest["tabs"] == generate.app_tabs()
    for name in manifest["images"]:
        image = ROOT / "docs" / "img" / name
        assert image.is_file() and image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert f"img/{name}" in (ROOT / "docs" / "app.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mkdocs") is None and not (ROOT / ".venv" / "bin" / "mkdocs").exists(),
                    reason="mkdocs is not installed (requirements-docs.txt)")
def test_the_site_builds_strict(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "reference" / "cli" / "index.html").is_file()


def bare_python_calls(source: str) -> list[int]:
    """Lines of `source` that start a process with a bare `python` / `python3` (found on PATH, so not the
    environment running the tests when it is not activated), as a list's first item or a command string."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if name not in {"run", "Popen", "check_call", "check_output", "call", "create_subprocess_exec"}:
            continue
        first = node.args[0]
        head = first.elts[0] if isinstance(first, (ast.List, ast.Tuple)) and first.elts else first
        if isinstance(head, ast.Constant) and isinstance(head.value, str) and \
                re.match(r"python3?(\s|$)", head.value):
            lines.append(node.lineno)
    return lines


def test_the_tests_start_the_projects_python_never_a_bare_one():
    assert bare_python_calls('subprocess.run(["python", "-m", "x"])\nsubprocess.Popen("python3 app.py", shell=True)\n'
                             'subprocess.run([sys.executable, "-m", "x"])\nsubprocess.run(["pythonic"])') == [1, 2]
    found = {p.name: bare_python_calls(p.read_text(encoding="utf-8")) for p in sorted((ROOT / "tests").glob("*.py"))}
    assert {name: lines for name, lines in found.items() if lines} == {}


BUDGET_SUITE = {
    "pytest.ini": "[pytest]\ntestpaths = t\n",
    "t/conftest.py": "from tests.budget import pytest_sessionfinish, pytest_sessionstart, pytest_terminal_summary\n",
    # one test that takes a known time: the run past a budget below it fails, one within a budget above it passes
    "t/test_one.py": "import time\n\ndef test_one():\n    start = time.monotonic()\n    time.sleep(0.5)\n"
                     "    assert time.monotonic() - start >= 0.5\n",
}


def _budget_suite(tmp_path, budget_s: str) -> dict[str, str]:
    """The one-test suite written under `tmp_path`; the environment that runs it under `budget_s`."""
    for name, text in BUDGET_SUITE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "MIGRATION_SUITE_BUDGET_S": budget_s}


@pytest.mark.parametrize("budget_s,over", [("0.3", True), ("3600", False)])
def test_the_whole_suite_fails_past_its_time_budget(tmp_path, budget_s, over):
    """tests/budget.py on a suite of one half-second test: past the budget (here 0.3 s) the whole run fails and
    says so;
    within it, it passes and prints its time against the budget; a selection (-k) is never judged."""
    env = _budget_suite(tmp_path, budget_s)
    whole = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)
    assert "1 passed" in whole.stdout, whole.stdout[-2000:] + whole.stderr[-2000:]
    assert "the whole suite took" in whole.stdout and "budget" in whole.stdout
    assert (whole.returncode != 0) == over, whole.stdout[-2000:]
    assert ("SUITE OVER ITS TIME BUDGET" in whole.stdout) == over
    part = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist", "-k", "one"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    assert part.returncode == 0 and "the whole suite took" not in part.stdout, part.stdout[-2000:]


def test_without_a_given_budget_the_run_is_judged_at_the_reference_speed(tmp_path):
    """No budget given: the run times the yardstick (Python's parser over the code check's frozen corpus) and
    judges its time by 25 minutes scaled by this machine's speed against the reference day's, printing both."""
    from tests.budget import REFERENCE_PARSE_S, machine_factor, parse_seconds

    measured = parse_seconds(runs=2)
    assert 0 < measured < 60 and machine_factor(REFERENCE_PARSE_S) == 1.0 and machine_factor(2 * REFERENCE_PARSE_S) == 2.0
    env = _budget_suite(tmp_path, "")
    whole = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)
    assert whole.returncode == 0 and "1 passed" in whole.stdout, whole.stdout[-2000:] + whole.stderr[-2000:]
    line = next(x for x in whole.stdout.splitlines() if "the whole suite took" in x)
    factor = float(re.search(r"([0-9.]+)x\)", line).group(1))
    budget = float(re.search(r"budget ([0-9.]+) min", line).group(1))
    assert "at the reference speed" in line and budget == pytest.approx(25 * factor, abs=0.2), line


@pytest.mark.parametrize("budget_s", ["abc", "-5", "inf", "nan"])
def test_a_budget_that_is_not_a_number_of_seconds_is_refused_before_the_run(tmp_path, budget_s):
    env = _budget_suite(tmp_path, budget_s)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    out = done.stdout + done.stderr
    assert done.returncode != 0 and "MIGRATION_SUITE_BUDGET_S" in out and "number of seconds" in out, out[-2000:]
    assert "Traceback" not in out and "1 passed" not in out  # refused before any test ran


def test_your_model_shows_each_style_with_the_example_the_suite_runs():
    """docs/your-model.md includes each style's example from tests/fixtures/your_models/ (snippets), and those
    are the files tests/test_your_model.py plans, runs and counts: a page example cannot drift from code that
    works."""
    from tests.test_your_model import STYLES

    page = (ROOT / "docs" / "your-model.md").read_text(encoding="utf-8")
    included = re.findall(r'--8<-- "([^"]+)"', page)
    assert sorted(included) == sorted(f"tests/fixtures/your_models/{name}.py" for name in STYLES.values())
    assert all((ROOT / path).is_file() for path in included)
    sections = {"functional": "Plain functions", "linen": "Flax Linen", "haiku": "Haiku", "equinox": "Equinox",
                "nnx": "Flax NNX"}
    assert set(sections) == set(STYLES)
    for title in sections.values():  # each style has its section
        assert re.search(rf"^## {title}$", page, re.M), title
