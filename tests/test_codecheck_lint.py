"""The code check as a linter, `python -m migration.codecheck PATH...`: no JAX (or anything beyond the
standard library) on its path, folders searched, the documented exit codes, the four formats,
`--select` / `--ignore` and the `[tool.migration-check]` table of a pyproject.toml."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "codecheck"

CLEAN = "import jax\n\n\ndef f(x):\n    return jax.numpy.sum(x)\n"
ERROR = "import jax\nx = jax.tree_map(lambda a: a, {})\n"  # REMOVED001, an error
WARNING = "import jax\nstep = jax.pmap(lambda x: x)\n"  # PMAP001, a warning

# Refuses the import of anything heavy: the linter must run where none of them is installed.
NO_HEAVY = """
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "flax", "optax", "numpy", "gradio", "pandas", "libcst"):
            raise ImportError("the linter imported " + name)
sys.meta_path.insert(0, Refuse())
sys.argv = ["migration.codecheck", *sys.argv[1:]]
runpy.run_module("migration.codecheck", run_name="__main__")
"""


def lint(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_HEAVY, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


@pytest.fixture
def files(tmp_path):
    for name, text in (("clean.py", CLEAN), ("error.py", ERROR), ("warning.py", WARNING)):
        (tmp_path / name).write_text(text)
    return tmp_path


def test_exit_codes_follow_the_worst_severity_and_fail_on(files):
    assert lint(str(files / "clean.py")).returncode == 0
    assert lint(str(files / "warning.py")).returncode == 0  # warnings do not fail by default
    assert lint(str(files / "warning.py"), "--fail-on", "warning").returncode == 1
    done = lint(str(files / "error.py"))
    assert done.returncode == 1 and "REMOVED001" in done.stdout and done.stderr == ""


def test_a_path_that_cannot_be_checked_exits_2_and_the_others_are_still_reported(files):
    (files / "broken.py").write_text("def (:\n")
    done = lint(str(files), str(files / "missing.py"))
    assert done.returncode == 2
    assert "missing.py: no such file or folder" in done.stderr and "broken.py: not valid Python" in done.stderr
    assert "REMOVED001" in done.stdout and "PMAP001" in done.stdout  # the readable files were checked
    assert lint(str(files), "--select", "NOSUCH").returncode == 2


def test_folders_are_searched_and_virtual_environments_skipped(files):
    (files / "pkg").mkdir()
    (files / "pkg" / "more.py").write_text(ERROR)
    (files / ".venv" / "lib").mkdir(parents=True)
    (files / ".venv" / "lib" / "dep.py").write_text(ERROR)
    found = json.loads(lint(str(files), "--format", "json").stdout)
    assert sorted({Path(f["file"]).relative_to(files).as_posix() for f in found}) == \
        ["error.py", "pkg/more.py", "warning.py"]


def test_select_and_ignore_take_rule_ids_and_prefixes(files):
    only_pmap = json.loads(lint(str(files), "--format", "json", "--select", "PMAP").stdout)
    assert {f["rule"] for f in only_pmap} == {"PMAP001"}
    no_removed = json.loads(lint(str(files), "--format", "json", "--ignore", "REMOVED001").stdout)
    assert "REMOVED001" not in {f["rule"] for f in no_removed} and no_removed


def test_the_pyproject_table_configures_the_check_and_flags_win(files):
    (files / "pyproject.toml").write_text('[tool.migration-check]\nignore = ["PMAP"]\nexclude = ["error.py"]\n')
    found = json.loads(lint(".", "--format", "json", cwd=files).stdout)
    assert found == []  # error.py excluded, PMAP ignored
    again = json.loads(lint(".", "--format", "json", "--ignore", "REMOVED", cwd=files).stdout)
    assert {f["rule"] for f in again} == {"PMAP001"}  # --ignore replaces the table's list
    (files / "pyproject.toml").write_text("[tool.migration-check\n")
    assert lint(".", cwd=files).returncode == 2
    for table, message in (('select = "PMAP"', "select must be a list of strings"),
                           ('selct = ["PMAP"]', "has no key 'selct'; the keys are select, ignore, exclude")):
        (files / "pyproject.toml").write_text(f"[tool.migration-check]\n{table}\n")
        done = lint(".", cwd=files)
        assert done.returncode == 2 and message in done.stderr and done.stdout == "", done.stderr


def test_sarif_is_version_2_1_0_with_the_rule_table_and_a_result_per_finding(files, tmp_path):
    out = tmp_path / "report.sarif"
    done = lint(str(files), "--format", "sarif", "--output", str(out))
    assert done.returncode == 1 and done.stdout == ""
    log = json.loads(out.read_text())
    assert log["version"] == "2.1.0" and "sarif-2.1.0" in log["$schema"]
    run = log["runs"][0]
    rules = run["tool"]["driver"]["rules"]
    assert {r["id"] for r in rules} >= {"REMOVED001", "PMAP001"}
    found = json.loads(lint(str(files), "--format", "json").stdout)
    assert len(run["results"]) == len(found)
    for result in run["results"]:
        assert rules[result["ruleIndex"]]["id"] == result["ruleId"]
        assert result["level"] in ("error", "warning", "note")
        region = result["locations"][0]["physicalLocation"]["region"]
        assert region["startLine"] >= 1 and region["startColumn"] >= 1


def test_github_annotations_escape_what_the_format_reserves(tmp_path):
    odd = tmp_path / "a,b:c.py"
    odd.write_text(ERROR)
    lines = lint(str(odd), "--format", "github").stdout.splitlines()
    assert lines and all(line.startswith("::error file=") for line in lines)
    assert "a%2Cb%3Ac.py" in lines[0] and ",line=2,col=" in lines[0] and "title=REMOVED001 " in lines[0]


def test_the_fixture_corpus_is_checked_without_jax_and_finds_what_the_app_finds(tmp_path):
    import shutil

    from migration.codecheck import check_paths

    files = sorted(FIXTURES.glob("*.py"))  # the labelled corpus (the real scripts have their own test)
    for path in files:
        shutil.copy(path, tmp_path / path.name)
    done = lint(str(tmp_path), "--format", "json")
    assert done.returncode in (0, 1), done.stderr
    found = json.loads(done.stdout)
    assert len(found) > 50
    assert sorted((Path(f["file"]).name, f["line"], f["rule"]) for f in found) == \
        sorted((Path(f.file).name, f.line, f.rule) for f in check_paths(files).findings)


def _copy_project(dest: Path) -> Path:
    """The project's tracked sources (no virtual environment, no build output) in `dest`."""
    import shutil

    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(".venv", ".git", "runs", "__pycache__", "build",
                                                              "*.egg-info", ".pytest_cache"))
    return dest


@pytest.mark.slow
def test_pip_install_without_dependencies_gives_the_linter_and_no_jax(tmp_path, files):
    import venv

    project = _copy_project(tmp_path / "project")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    pip = subprocess.run([str(env_dir / "bin" / "pip"), "install", "--no-deps", "-q", str(project)],
                         capture_output=True, text=True, timeout=600)
    assert pip.returncode == 0, pip.stderr[-2000:]
    python = str(env_dir / "bin" / "python")
    assert subprocess.run([python, "-c", "import jax"], capture_output=True).returncode != 0  # nothing else came
    sarif = tmp_path / "out.sarif"
    done = subprocess.run([str(env_dir / "bin" / "migration-check"), str(files), "--format", "sarif", "--output",
                           str(sarif)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    assert json.loads(sarif.read_text())["version"] == "2.1.0"
    module = subprocess.run([python, "-m", "migration.codecheck", str(files / "clean.py")], capture_output=True,
                            text=True, timeout=120, cwd=tmp_path)
    assert module.returncode == 0 and "0 finding(s) in 1 file(s)" in module.stdout


@pytest.mark.slow
def test_the_pre_commit_hook_stops_a_commit_with_tpu_era_code(tmp_path):
    """The hook from .pre-commit-hooks.yaml, installed by pre-commit from a git copy of this project,
    in a throwaway repository: a clean file commits, one calling a removed API does not."""
    import os

    project = _copy_project(tmp_path / "project")
    git = lambda *args, cwd: subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True,  # noqa: E731
                                            timeout=120, env={**os.environ, "GIT_AUTHOR_NAME": "t",
                                                              "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                                              "GIT_COMMITTER_EMAIL": "t@t"})
    for args in (("init", "-q"), ("add", "-A"), ("commit", "-qm", "project")):
        assert git(*args, cwd=project).returncode == 0
    rev = git("rev-parse", "HEAD", cwd=project).stdout.strip()
    repo = tmp_path / "team"
    repo.mkdir()
    git("init", "-q", cwd=repo)
    (repo / ".pre-commit-config.yaml").write_text(
        f"repos:\n  - repo: {project}\n    rev: {rev}\n    hooks:\n      - id: migration-check\n")
    (repo / "train.py").write_text(CLEAN)
    run = lambda: subprocess.run([sys.executable, "-m", "pre_commit", "run", "--all-files"], cwd=repo,  # noqa: E731
                                 capture_output=True, text=True, timeout=900,
                                 env={**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "cache")})
    git("add", "-A", cwd=repo)
    clean = run()
    assert clean.returncode == 0, clean.stdout[-3000:] + clean.stderr[-3000:]
    (repo / "train.py").write_text(ERROR)
    git("add", "-A", cwd=repo)
    stopped = run()
    assert stopped.returncode == 1 and "REMOVED001" in stopped.stdout, stopped.stdout[-3000:]


def test_the_linter_frees_each_files_trees_and_gives_the_collector_back(tmp_path, capsys):
    """The linter turns automatic collection off while it runs and collects after each file. Three files
    checked in this process: no Module tree of theirs is left alive afterwards, and the collector is on
    and unfrozen again."""
    import ast
    import gc
    import weakref

    from migration.codecheck import lint

    made: list[weakref.ref] = []
    parse = ast.parse

    def tracked_parse(*args, **kwargs):
        tree = parse(*args, **kwargs)
        made.append(weakref.ref(tree))
        return tree

    for i in range(3):
        (tmp_path / f"f{i}.py").write_text("import jax\nfor s in range(3):\n    loss = step(s)\n    print(float(loss))\n")
    assert gc.isenabled()
    ast.parse = tracked_parse
    try:
        rc = lint.main([str(tmp_path), "--format", "json"])
    finally:
        ast.parse = parse
    assert rc == 0 and len(json.loads(capsys.readouterr().out)) == 3  # one SYNC001 (a warning) per file
    assert len(made) == 3 and all(ref() is None for ref in made)
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_checking_the_real_corpus_leaves_no_reference_cycles():
    """A file's trees and the facts read from them hold no reference cycles (a node keeping its own walk,
    a checker keeping its bound methods): reference counting frees them as each file is done, and the
    collection after each file finds nothing to do. Every file of the real corpus, checked in this process
    with the collector saving what it would free: nothing."""
    import gc

    from migration.codecheck.engine import analyse

    files = sorted((ROOT / "tests" / "fixtures" / "codecheck" / "real").glob("*.py"))
    assert len(files) >= 70
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        findings = sum(len(analyse(f.read_text(encoding="utf-8"), f.name).findings) for f in files)
        gc.collect()
        cyclic = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert findings > 500  # the corpus was checked, not skipped
    assert cyclic == [], f"{len(cyclic)} objects in cycles, e.g. {sorted(set(cyclic))[:10]}"


def test_the_cached_children_are_the_nodes_ast_walks(tmp_path):
    """`children` reads each node type's fields by a layout worked out once per type (no test of each
    value): over every node of the corpus, this project and a file using every kind of statement and
    pattern, the same nodes, in the same order, as `ast.iter_child_nodes` less the operator and
    load/store markers."""
    import ast

    from migration.codecheck.ast_helpers import children

    every_kind = """
from __future__ import annotations
import os.path as p, sys
from . import x as y
global_var: int = 1
def f(a, /, b=1, *args, c, d=2, **kw) -> None:
    global g
    def h():
        nonlocal a
    return (yield from [lambda q=1: q])
async def g():
    async with x as (a, b), y:
        async for i in z:
            await i
    return {**a, 'k': 1}, {1, *b}, [i async for i in z if i], f'{a!r:>{w}}'
class C(B, metaclass=M):
    @dec
    def m(self): del self.x[1:2:3]; assert x, 'm'; raise E from e
try:
    pass
except* (A, B) as e:
    x += 1
else:
    x @= y
finally:
    x = -y if not a and b or c else ~z
match command:
    case [1, 2, *rest]: pass
    case {"k": v, **others}: pass
    case Point(x=0, y=_) | Point(1, 2) as pt if pt: pass
    case None | True | 'str' | -1 | 1 + 2j: pass
    case (a, b, *_): pass
with open(f) as fh: print(*a, sep='', **k)
while (n := next(it)) is not None and 0 < n <= 9: break
else: continue
type_ignored = 1  # type: ignore[misc]
"""
    markers = (ast.expr_context, ast.operator, ast.cmpop, ast.boolop, ast.unaryop)
    sources = [every_kind] + [f.read_text(encoding="utf-8") for f in
                              sorted((ROOT / "tests" / "fixtures" / "codecheck").rglob("*.py"))
                              + sorted((ROOT / "migration").rglob("*.py"))]
    kinds = set()
    for text in sources:
        for node in ast.walk(ast.parse(text, type_comments=True)):
            kinds.add(type(node))
            assert children(node) == [c for c in ast.iter_child_nodes(node) if not isinstance(c, markers)], \
                ast.dump(node)[:300]
    assert {ast.MatchMapping, ast.MatchClass, ast.MatchStar, ast.Global, ast.Nonlocal, ast.TryStar,
            ast.TypeIgnore, ast.Dict, ast.arguments} <= kinds
