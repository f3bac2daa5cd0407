"""One format for every benchmark's figures: the JSON a benchmark writes with `--json PATH`, committed under
`bench/results/NAME.json` and rendered into the documentation's benchmark page by `docs/generate.py`.

    {"bench": "load", "command": "python bench/load.py ...", "machine": "2 cores, 23.4 GiB, no GPU (...)",
     "date": "2026-12-02", "tables": [{"title": "...", "columns": [...], "rows": [[...], ...]}], "notes": [...]}

Cells are written as the benchmark prints them (strings, with their units), so that the page shows what the
terminal showed. `machine` and `date` are read when the figures are written; a table carried over from an
earlier record keeps its own date in `notes`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def table(title: str, columns: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    if any(len(row) != len(columns) for row in rows):
        raise ValueError(f"{title}: every row needs {len(columns)} cells")
    return {"title": title, "columns": [str(c) for c in columns], "rows": [[str(c) for c in row] for row in rows]}


def gpu_names() -> list[str]:
    if not shutil.which("nvidia-smi"):
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def machine() -> str:
    """This machine in one line: cores, memory, GPUs, Python and JAX versions (JAX's only if already imported)."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpus = gpu_names()
    gpu = f"{len(gpus)} x {gpus[0]}" if gpus else "no GPU"
    parts = [f"{os.cpu_count()} cores", f"{memory:.0f} GiB", gpu, f"Python {platform.python_version()}"]
    jax = sys.modules.get("jax")
    if jax is not None:
        parts.append(f"JAX {jax.__version__}")
    return ", ".join(parts)


def command() -> str:
    """The command line that ran this benchmark, as a reader would retype it."""
    script = Path(sys.argv[0])
    name = f"bench/{script.name}" if script.parent.name == "bench" else str(script)
    return " ".join(["python", name, *sys.argv[1:]])


def write(path: str | Path | None, bench: str, tables: list[dict[str, Any]], notes: list[str] = (),
          **extra: Any) -> dict[str, Any]:
    """The record of this run (written to `path` when one is given): the tables, the command, machine and date."""
    record = {"bench": bench, "command": command(), "machine": machine(),
              "date": datetime.date.today().isoformat(), "tables": tables, "notes": list(notes), **extra}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return record
