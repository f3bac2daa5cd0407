"""The project's import contracts (`.importlinter`), checked by import-linter's `lint-imports` on the
source tree: the backend and the workloads never import the UI toolkit, and the workloads import
nothing of the migration backend."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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


def test_a_broken_contract_is_caught(tmp_path):
    """The same contracts on a copy of the tree where a backend module imports gradio: refused."""
    for name in ("migration", "workloads"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", tmp_path / ".importlinter")
    with open(tmp_path / "migration" / "history.py", "a") as f:
        f.write("\nimport gradio  # a backend module reaching for the UI\n")
    done = subprocess.run([lint_imports(), "--no-cache"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          check=False, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "migration.history -> gradio" in done.stdout, done.stdout[-2000:]
