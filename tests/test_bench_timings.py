"""The benches that record the suite's time and the code check's speed: real runs, read back."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_suite_time_bench_reads_a_real_runs_junit_file(tmp_path):
    """A small suite of two files run by pytest with --junitxml: the bench gives its wall time, its tests
    and each file's summed time, slowest first."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_slow.py").write_text(
        "import time\n\ndef test_a():\n    time.sleep(0.6)\n\ndef test_b():\n    time.sleep(0.3)\n")
    (tmp_path / "tests" / "test_quick.py").write_text("def test_c():\n    pass\n")
    junit = tmp_path / "suite.xml"
    ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=",
                          f"--junitxml={junit}", "tests"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout[-2000:]
    record = tmp_path / "suite_time.json"
    done = subprocess.run([sys.executable, "bench/suite_time.py", str(junit), "--json", str(record)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads(record.read_text())["data"]
    assert data["after"]["tests"] == 3 and data["after"]["wall_s"] >= 0.9
    assert list(data["slowest"]) == ["tests/test_slow.py", "tests/test_quick.py"]
    assert 0.9 <= data["slowest"]["tests/test_slow.py"] < 5
    # the machine's speed by the budget's yardstick, and the run's time at the reference speed beside the raw one
    assert data["parse_s"] > 0 and abs(data["factor"] - data["parse_s"] / 0.17) <= 0.02
    assert "at the reference speed this run is" in json.loads(record.read_text())["notes"][0]


def test_the_suite_time_bench_refuses_a_missing_or_foreign_file(tmp_path):
    missing = subprocess.run([sys.executable, "bench/suite_time.py", str(tmp_path / "none.xml")], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "no such file" in missing.stderr and "Traceback" not in missing.stderr
    other = tmp_path / "other.xml"
    other.write_text("<report><item/></report>")
    foreign = subprocess.run([sys.executable, "bench/suite_time.py", str(other)], cwd=ROOT, capture_output=True,
                             text=True, timeout=60)
    assert foreign.returncode != 0 and "testsuite" in foreign.stderr and "Traceback" not in foreign.stderr
    broken = tmp_path / "broken.xml"
    broken.write_text("<testsuite><testcase")
    bad = subprocess.run([sys.executable, "bench/suite_time.py", str(broken)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "not XML" in bad.stderr and "Traceback" not in bad.stderr


def test_the_speed_bench_runs_a_commits_linter_beside_this_checkouts(tmp_path):
    """--before HEAD: the committed linter checks the same corpus in the same loop; both finish and the ratio
    of their CPU times is recorded. An unknown commit is refused in one line."""
    record = tmp_path / "speed.json"
    done = subprocess.run([sys.executable, "bench/codecheck_speed.py", "--runs", "1", "--before", "HEAD",
                           "--json", str(record)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode in (0, 1), done.stderr[-2000:]  # 1: over the goal on a loaded machine
    data = json.loads(record.read_text())["data"]
    assert data["before"]["ref"] == "HEAD" and data["before"]["corpus_cpu_s"]["min"] > 0
    assert 0.2 < data["before"]["median_ratio"] < 5
    bad = subprocess.run([sys.executable, "bench/codecheck_speed.py", "--runs", "1", "--before", "no-such-ref-x"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--before no-such-ref-x" in bad.stderr and "Traceback" not in bad.stderr
