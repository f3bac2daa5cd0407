"""The project's import rules.

- `.importlinter` (checked by import-linter's `lint-imports`): the layers, top to bottom, and that the
  backend and the workloads never import the UI toolkit.
- An import graph built here from the source with `ast`, for what import-linter does not say: no
  import cycle between the project's modules (function-level imports included), no import inside a
  function (of the project, a package or the standard library) without a `# reason:` comment on its
  line or just above it (import-time cost, an optional dependency, JAX's environment read at import;
  never to dodge a cycle), and no private name (`_name`) of one project module used in another.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("migration", "workloads", "ui")  # the project's code; app.py only parses flags and launches
REASON = "# reason:"


def lint_imports() -> str:
    found = shutil.which("lint-imports") or shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("import-linter is not installed (requirements-dev.txt)")
    return found


def test_the_import_contracts_are_kept():
    done = subprocess.run([lint_imports(), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "broken" in done.stdout and "0 broken" in done.stdout
    assert "Layers" in done.stdout  # the layers contract is among those checked


def test_a_broken_contract_is_caught(tmp_path):
    """The same contracts on a copy of the tree where a backend module imports gradio, and one where
    the planner imports the job service (a layer above it): both refused."""
    for name in PACKAGES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    with open(tmp_path / "migration" / "service" / "history.py", "a") as f:
        f.write("\nimport gradio  # a backend module reaching for the UI\n")
    with open(tmp_path / "migration" / "planning" / "search.py", "a") as f:
        f.write("\nimport migration.service.jobs  # a lower layer reaching up\n")
    done = subprocess.run([lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0, done.stdout[-2000:]
    assert "migration.service.history -> gradio" in done.stdout, done.stdout[-2000:]
    assert "migration.planning.search -> migration.service.jobs" in done.stdout, done.stdout[-2000:]


# -- the import graph, from the source ------------------------------------------------------------


@dataclass
class Graph:
    modules: set[str] = field(default_factory=set)
    edges: dict[str, set[str]] = field(default_factory=dict)
    unexplained: list[str] = field(default_factory=list)  # function-level imports without a reason
    private: list[str] = field(default_factory=list)  # private names used across modules

    def cycles(self) -> list[list[str]]:
        """The strongly connected components of more than one module (Tarjan), each sorted."""
        index: dict[str, int] = {}
        low: dict[str, int] = {}
        stack: list[str] = []
        found: list[list[str]] = []

        def visit(v: str) -> None:
            index[v] = low[v] = len(index)
            stack.append(v)
            for w in self.edges.get(v, ()):
                if w not in index:
                    visit(w)
                    low[v] = min(low[v], low[w])
                elif w in stack:
                    low[v] = min(low[v], index[w])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1 or v in self.edges.get(v, ()):
                    found.append(sorted(component))

        for v in sorted(self.modules):
            if v not in index:
                visit(v)
        return found


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(node: ast.Import | ast.ImportFrom, here: str, is_package: bool, modules: set[str]) -> list[tuple[str, str | None]]:
    """(project module, name imported from it or None) for each project module `node` imports."""
    if isinstance(node, ast.Import):
        return [(a.name, None) for a in node.names if a.name in modules]
    base = node.module or ""
    if node.level:
        package = here.split(".") if is_package else here.split(".")[:-1]
        package = package[:len(package) - node.level + 1]
        base = ".".join([*package, *([base] if base else [])])
    out: list[tuple[str, str | None]] = []
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:  # `from package import module`
            out.append((f"{base}.{alias.name}", None))
        elif base in modules:
            out.append((base, alias.name))
    return out


def build_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> Graph:
    files = {module_name(root, p): p for pkg in packages if (root / pkg).is_dir() for p in (root / pkg).rglob("*.py")}
    graph = Graph(modules=set(files))
    for here, path in sorted(files.items()):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, filename=str(path))
        module_aliases: dict[str, str] = {}
        for node, in_function in walk_with_scope(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = imported_modules(node, here, path.name == "__init__.py", graph.modules)
                for target, name in targets:
                    if target != here:
                        graph.edges.setdefault(here, set()).add(target)
                    if name is not None and name.startswith("_") and target != here:
                        graph.private.append(f"{here}:{node.lineno} imports {target}.{name}")
                    if name is None:
                        for alias in node.names:
                            module_aliases[alias.asname or alias.name.split(".")[-1]] = target
                if in_function and not has_reason(lines, node.lineno):
                    graph.unexplained.append(f"{here}:{node.lineno}: {lines[node.lineno - 1].strip()}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in module_aliases):
                graph.private.append(f"{here}:{node.lineno} uses {module_aliases[node.value.id]}.{node.attr}")
    return graph


def walk_with_scope(tree: ast.AST):
    """Every node with whether it sits inside a function. Imports under `if TYPE_CHECKING:` are
    skipped: they never run."""
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, in_function = todo.pop()
        yield node, in_function
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        todo.extend((child, inner) for child in ast.iter_child_nodes(node))


def has_reason(lines: list[str], lineno: int) -> bool:
    """A `# reason:` comment on the import's line or just above it (above a block of imports: for all of them)."""
    if REASON in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("#", "from ", "import ")):
        if REASON in lines[i]:
            return True
        i -= 1
    return False


def test_no_import_cycles_no_unexplained_function_imports_no_private_names_across_modules():
    graph = build_graph(ROOT)
    assert len(graph.modules) > 40 and graph.edges, "the project's modules were not found"
    assert graph.cycles() == [], f"import cycles: {graph.cycles()}"
    assert graph.unexplained == [], "imports inside functions without a '# reason:' comment:\n" + \
        "\n".join(graph.unexplained)
    assert graph.private == [], "private names used outside their module:\n" + "\n".join(graph.private)


def test_the_graph_check_finds_a_cycle_a_hidden_import_and_a_private_name(tmp_path):
    """The checker itself, on a small made-up package: each fault is found, and the allowed forms pass."""
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import helper\n",
        "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",  # a -> b -> a, hidden in a function
        "pkg/c.py": "from pkg.a import _secret\nimport pkg.d as d\nd._inner()\n",
        "pkg/d.py": "def _inner():\n    pass\n\n\ndef heavy():\n    # reason: imports JAX, only here\n"
                    "    from pkg import e\n    return e\n",
        "pkg/e.py": "def late():\n    import json\n    return json\n",  # a standard-library import hidden too
        "pkg/f.py": "def optional():\n    import torch  # reason: optional dependency\n    return torch\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    graph = build_graph(tmp_path, ("pkg",))
    assert graph.cycles() == [["pkg.a", "pkg.b"]]
    assert graph.unexplained == ["pkg.b:2: from pkg import a", "pkg.e:2: import json"]
    assert graph.private == ["pkg.c:1 imports pkg.a._secret", "pkg.c:3 uses pkg.d._inner"]


# -- sizes a newcomer can read -----------------------------------------------------------------------

FUNCTION_LINES_MAX = 60  # a function longer than this is split into named steps
MODULE_LINES_MAX = 650  # a module longer than this is split by job (the catalogs' tables count too)


def project_files() -> list[Path]:
    return [ROOT / "app.py", *(p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py")))]


def long_functions(path: Path, root: Path = ROOT, limit: int = FUNCTION_LINES_MAX) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(root)}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > limit]


def test_no_function_or_module_past_its_size():
    files = project_files()
    assert len(files) > 40
    long = [line for path in files for line in long_functions(path)]
    assert long == [], f"functions over {FUNCTION_LINES_MAX} lines (split them into named steps):\n" + "\n".join(long)
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in files if (n := len(p.read_text().splitlines())) > MODULE_LINES_MAX]
    assert big == [], f"modules over {MODULE_LINES_MAX} lines (split them by job):\n" + "\n".join(big)


def test_the_size_check_finds_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(FUNCTION_LINES_MAX))
    path = tmp_path / "probe.py"
    path.write_text(f"def short():\n    return 1\n\n\ndef long():\n{body}\n    return x0\n")
    assert long_functions(path, tmp_path) == [f"probe.py:5 long: {FUNCTION_LINES_MAX + 2} lines"]
