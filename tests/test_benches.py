"""The benchmarks that drive the app, run at a smoke size of seconds: a change to the form, the API or the
web guard that breaks one of them fails here, not months later when someone reruns it for the docs' benchmark page.
Each is run as its command line (`python bench/NAME.py ...`) and must exit 0 and print its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server import ROOT

pytestmark = pytest.mark.slow


def bench(name: str, *args: str, timeout_s: float = 400, **env_given: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MIGRATION_")} | env_given
    done = subprocess.run([sys.executable, f"bench/{name}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=env)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return done.stdout


def test_the_load_bench_at_smoke_size_runs_every_run_ok():
    out = bench("load.py", "--users", "1", "--browsers", "1", "--runs-per-user", "1", "--steps", "2",
                "--idle-s", "3", "--timeout-s", "300")
    assert "runs: 1 submitted, 1 ok, 0 failed, 0 refused, 0 lost, 0 duplicated" in out, out
    assert "| /history |" in out


def test_the_soak_at_smoke_size_soaks_runs_and_code_checks():
    out = bench("soak.py", "--runs", "2", "--steps", "3", "--checks", "2", "--findings", "500", "--every", "1",
                "--timeout-s", "300")
    assert "runs: growth from 1 to 2 runs" in out and "runs failed: 0; ok" in out, out
    assert "checks: growth from 1 to 2 checks" in out and "checks failed: 0; ok" in out, out


def test_the_worst_paste_bench_at_smoke_size(tmp_path):
    out = bench("worst_paste.py", "--size", "2000", "--uploads", "2", "--baseline-s", "1",
                "--json", str(tmp_path / "worst.json"))
    assert "server alive after: True" in out, out
    assert "| nothing (baseline) |" in rendered(tmp_path / "worst.json")
    assert "| 2 uploads of 0.002 MB |" in out and "| 0.002 MB training script |" in out, out


def own_folders(tmp_path):
    """A temporary folder and a home of the bench's own, both empty: a bench that builds the app in its own
    process keeps the app's files in a temporary folder it removes, and never writes to the user's ~/.cache."""
    (tmp := tmp_path / "tmp").mkdir()
    (home := tmp_path / "home").mkdir()
    return tmp, home


def test_the_stream_update_cost_bench_at_smoke_size(tmp_path):
    tmp, home = own_folders(tmp_path)
    out = bench("stream_update_cost.py", "--updates", "5", TMPDIR=str(tmp), HOME=str(home))
    assert "gr.skip()" in out
    assert list(tmp.iterdir()) == [] and not (home / ".cache" / "tpu-gpu-migration").exists()


def test_the_guard_overhead_bench_at_smoke_size(tmp_path):
    tmp, home = own_folders(tmp_path)
    out = bench("guard_overhead.py", "--requests", "5", "--json", str(tmp_path / "guard.json"), TMPDIR=str(tmp),
                HOME=str(home))
    assert list(tmp.iterdir()) == [] and not (home / ".cache" / "tpu-gpu-migration").exists()
    assert "POST /gradio_api/run/history" in out and "x  (status" in out, out
    page = rendered(tmp_path / "guard.json")  # the record renders as the docs' benchmark page would show it
    assert "| GET /config |" in page and "`python bench/guard_overhead.py --requests 5 --json" in page, page


def rendered(path) -> str:
    sys.path.insert(0, str(ROOT / "docs"))
    import generate  # docs/generate.py

    return generate.render_record(json.loads(path.read_text(encoding="utf-8")))
