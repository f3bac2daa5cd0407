"""`--fix` and `--diff` (migration/codecheck/fix.py): each rewrite on its own, what is left alone, and
every corpus file (synthetic and real) fixed: it still parses, the fixed findings are gone, every
other finding stays, and only the lines the check flagged changed (moved lines move whole).
`python -m pytest tests/test_codecheck_fix.py -s` prints the fixed findings per rule."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from migration.codecheck.engine import analyse
from migration.codecheck.fix import FIXABLE, fix_source
from migration.codecheck.renames import RENAMES

ROOT = Path(__file__).resolve().parent.parent
CORPUS = sorted((ROOT / "tests" / "fixtures" / "codecheck").glob("*.py")) \
    + sorted((ROOT / "tests" / "fixtures" / "codecheck" / "real").glob("*.py"))


def fixed(text: str) -> str:
    return fix_source(text, "t.py").after


def test_removed_tree_aliases_become_the_jax_tree_module_keeping_comments_and_layout():
    src = ("import jax\n\n"
           "def f(x):\n"
           "    y = jax.tree_map(  lambda a: a + 1,  # add one\n"
           "                     x)\n"
           "    return jax.tree_leaves(y), jax.tree_util.tree_multimap(max, y, y)\n")
    assert fixed(src) == src.replace("jax.tree_map(", "jax.tree.map(").replace("jax.tree_leaves", "jax.tree.leaves") \
        .replace("tree_util.tree_multimap", "tree_util.tree_map")


def test_an_aliased_module_keeps_its_alias():
    src = "import jax as J\nimport jax.experimental.pjit as pj\n\nJ.tree_flatten(x)\npj.with_sharding_constraint(x, s)\n"
    out = fixed(src)
    assert "J.tree.flatten(x)" in out and "J.lax.with_sharding_constraint(x, s)" in out


def test_imports_of_removed_names_import_them_from_where_they_live_now():
    src = ("import jax\n"
           "from jax import jit, tree_map  # both\n"
           "from jax.experimental import PartitionSpec as P\n"
           "from jax.experimental.maps import Mesh\n"
           "from jax import tree_multimap\n")
    out = fixed(src)
    assert out == ("import jax\n"
                   "from jax import jit  # both\n"
                   "from jax.tree_util import tree_map\n"
                   "from jax.sharding import PartitionSpec as P\n"
                   "from jax.sharding import Mesh\n"
                   "from jax.tree_util import tree_map as tree_multimap\n")
    assert not [f for f in analyse(out, "t.py").findings if f.rule == "REMOVED001"]


def test_an_import_with_a_name_that_has_no_successor_keeps_that_finding():
    out = fix_source("from jax import tree_map, xla_computation\n", "t.py")
    assert out.after == "from jax import xla_computation\nfrom jax.tree_util import tree_map\n"
    assert [f.rule for f in analyse(out.after, "t.py").findings] == ["REMOVED001"]
    assert out.fixed == Counter()  # one finding per import statement: it is still there


def test_pjit_keywords_are_renamed_with_their_comments():
    src = ("from jax.experimental.pjit import pjit\n"
           "step = pjit(f,\n"
           "            in_axis_resources=(None,),  # inputs\n"
           "            out_axis_resources=None, donate_argnums=0)\n")
    result = fix_source(src, "t.py")
    assert result.after == src.replace("in_axis_resources", "in_shardings").replace("out_axis_resources",
                                                                                     "out_shardings")
    assert result.fixed == Counter({"PJIT001": 1})


def test_an_environment_setting_moves_before_the_jax_import():
    src = ("import os\n"
           "import jax\n"
           "import numpy as np\n\n"
           "# keep the memory\n"
           "os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'\n")
    result = fix_source(src, "t.py")
    assert result.after == ("import os\n"
                            "# keep the memory\n"
                            "os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'\n"
                            "import jax\n"
                            "import numpy as np\n")
    assert result.fixed == Counter({"ENV001": 1})


@pytest.mark.parametrize("src", [
    # os is imported only after JAX: moving the line would break it
    "import jax\nimport os\nos.environ['XLA_FLAGS'] = '--xla_dump_to=/tmp'\n",
    # it reads a name bound after the JAX import
    "import os\nimport jax\nFLAGS = '--a'\nos.environ['XLA_FLAGS'] = FLAGS\n",
    # inside a function: runs after every import anyway; the finding stays with its suggestion
    "import os\nimport jax\ndef main():\n    os.environ['XLA_FLAGS'] = '--a'\n",
])
def test_an_environment_setting_that_cannot_move_safely_stays(src):
    result = fix_source(src, "t.py")
    assert result.after == src and result.fixed == Counter()
    assert [f.rule for f in analyse(src, "t.py").findings] == ["ENV001"]


def test_only_flagged_places_change():
    # a local function named tree_map shadows nothing of JAX: the check does not flag it, --fix leaves it
    src = "from mylib import tree_map\nimport jax\ntree_map(f, x)\nmy.jax.tree_map(f, x)\n"
    assert fixed(src) == src


def test_crlf_line_endings_and_a_clean_file_stay_as_they_are():
    src = "import jax\r\nx = jax.tree_map(f, y)\r\n"
    assert fixed(src) == "import jax\r\nx = jax.tree.map(f, y)\r\n"
    clean = "import jax\nx = jax.tree.map(f, y)\n"
    assert fixed(clean) == clean and not fix_source(clean, "t.py").changed


def test_every_rename_target_exists_in_the_installed_jax():
    import importlib
    for new in set(RENAMES.values()):
        module, _, name = new.rpartition(".")
        assert hasattr(importlib.import_module(module), name), new


def flagged_spans(text: str) -> set[int]:
    """Original lines a fix may touch: for each fixable finding, the innermost statement holding it."""
    lines = {f.line for f in analyse(text, "t.py").findings if f.rule in FIXABLE}
    spans: set[int] = set()
    for line in lines:
        holders = [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.stmt) and n.lineno <= line <= n.end_lineno]
        inner = min(holders, key=lambda n: n.end_lineno - n.lineno)
        spans |= set(range(inner.lineno, inner.end_lineno + 1))
    return spans


PRODUCTS = ("jax.tree.", "tree_util", "jax.sharding", "jax.Array", "lax.with_sharding_constraint", "in_shardings",
            "out_shardings", "import ")


def changes_outside(before: str, after: str) -> list[str]:
    """What changed beyond the flagged statements: a removed line that was not flagged, an added line
    that no rewrite makes, or the other lines (blank lines aside) out of their order."""
    spans = flagged_spans(before)
    old = [(n, line.strip()) for n, line in enumerate(before.splitlines(), 1) if line.strip()]
    new = [line.strip() for line in after.splitlines() if line.strip()]
    added = Counter(new) - Counter(text for _, text in old)
    wrong = [f"-{n}: {text}" for n, text in old if n not in spans and text not in new]
    wrong += [f"+ {text}" for text in added if not any(p in text for p in PRODUCTS)]
    remaining = iter(new)  # the other lines, in their order, are a subsequence of the fixed file
    if not all(any(text == line for line in remaining) for n, text in old if n not in spans):
        wrong.append("lines outside the flagged statements moved")
    return wrong


@pytest.fixture(scope="module")
def corpus_fixes() -> dict[str, Counter]:
    return {}


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_fix_on_every_corpus_file(path, corpus_fixes):
    text = path.read_bytes().decode("utf-8")
    result = fix_source(text, path.name)
    ast.parse(result.after)
    before = Counter(f.rule for f in analyse(text, path.name).findings)
    after = Counter(f.rule for f in analyse(result.after, path.name).findings)
    assert after == before - result.fixed, "a fix changed another finding"
    assert set(result.fixed) <= set(FIXABLE)
    assert changes_outside(text, result.after) == []
    again = fix_source(result.after, path.name)
    assert not again.changed, "a second --fix changed something: the first was incomplete"
    corpus_fixes[path.name] = result.fixed


def test_fix_counts_over_the_corpus(corpus_fixes, capsys):
    if len(corpus_fixes) < len(CORPUS):
        pytest.skip("runs after the per-file fixes")
    total = sum(corpus_fixes.values(), Counter())
    with capsys.disabled():
        print(f"\n--fix on {len(CORPUS)} corpus files ({sum(bool(c) for c in corpus_fixes.values())} changed): "
              + ", ".join(f"{rule} {n}" for rule, n in sorted(total.items())))
    assert set(total) == set(FIXABLE)


def test_the_command_line_diff_changes_nothing_and_fix_writes(tmp_path):
    target = tmp_path / "train.py"
    src = "import jax\nx = jax.tree_map(f, y)\n"
    target.write_text(src)
    run = lambda *a: subprocess.run([sys.executable, "-m", "migration.codecheck", *a, str(target)],  # noqa: E731
                                    capture_output=True, text=True, cwd=ROOT)
    diff = run("--diff")
    assert diff.returncode == 1 and "+x = jax.tree.map(f, y)" in diff.stdout
    assert "would fix 1 finding(s) in 1 file(s): REMOVED001 1" in diff.stderr
    assert target.read_text() == src
    fix = run("--fix")
    assert fix.returncode == 0 and "fixed 1 finding(s)" in fix.stderr and "0 finding(s)" in fix.stdout
    assert target.read_text() == "import jax\nx = jax.tree.map(f, y)\n"
    assert run("--diff").returncode == 0
    assert run("--fix", "--select", "PMAP").returncode == 0  # a rule not selected is not fixed


def test_without_libcst_fix_says_what_to_install(tmp_path):
    target = tmp_path / "train.py"
    target.write_text("import jax\nx = jax.tree_map(f, y)\n")
    blocker = tmp_path / "block" / "libcst"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not installed')\n")
    env = {"PYTHONPATH": f"{blocker.parent}:{ROOT}", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "migration.codecheck", "--fix", str(target)],
                         capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == 2 and "pip install libcst" in out.stderr
    assert "Traceback" not in out.stderr and "jax.tree_map" in target.read_text()


def test_the_corpus_comparison_sees_changes_beyond_the_flagged_statements():
    before = "import jax\nx = 1\ny = jax.tree_map(f, x)\nz = 2\n"
    assert changes_outside(before, before.replace("tree_map", "tree.map")) == []
    assert changes_outside(before, before.replace("x = 1", "x = 2").replace("tree_map", "tree.map"))
    assert changes_outside(before, "import jax\nz = 2\ny = jax.tree.map(f, x)\nx = 1\n")
    assert changes_outside(before, before + "w = 3\n")


def test_a_file_that_cannot_be_written_stays_as_it_was_and_is_reported(tmp_path, monkeypatch, capsys):
    from migration.codecheck import lint

    target, other = tmp_path / "train.py", tmp_path / "other.py"
    for f in (target, other):
        f.write_text("import jax\nx = jax.tree_map(f, y)\n")
    real = Path.write_bytes

    def full_disk(self, data):  # the disk refuses this one file (as root, a read-only mode would not)
        if self == target:
            raise OSError(28, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(Path, "write_bytes", full_disk)
    assert lint.main(["--fix", str(target), str(other)]) == 2
    err = capsys.readouterr().err
    assert f"{target}: could not be written (No space left on device)" in err and "fixed 1 finding(s) in 1 file" in err
    assert "jax.tree_map" in target.read_text() and "jax.tree.map" in other.read_text()


def test_the_share_of_real_findings_fix_rewrites_is_the_one_readme_gives():
    """README states which rules have a safe fix and how many of the real corpus's findings `--fix`
    rewrites; this recounts them, so the sentence cannot drift from the code."""
    real = sorted((ROOT / "tests" / "fixtures" / "codecheck" / "real").glob("*.py"))
    found, rewritten = Counter(), Counter()
    for path in real:
        text = path.read_text(encoding="utf-8")
        found.update(f.rule for f in analyse(text, path.name).findings if f.rule != "IGNORE001")
        rewritten.update(fix_source(text, path.name).fixed)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = " ".join(readme.split())
    match = re.search(r"`--fix` rewrites (\d+) of the (\d+) findings on the real corpus", readme)
    assert match, "README no longer says what --fix covers"
    assert (int(match[1]), int(match[2])) == (sum(rewritten.values()), sum(found.values()))
    for rule in FIXABLE:
        assert f"{rule} {rewritten[rule]} of {found[rule]}" in readme
