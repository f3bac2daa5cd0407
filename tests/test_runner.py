"""The runner and the CLI end to end: real worker processes, real compiles, real failures."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from migration.config import ConfigError, RunConfig
from migration.runner import probe_environment, run, start_run

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow

REQUIRED_KEYS = {
    "status", "compile_s", "step_ms_median", "step_ms_p90", "samples_per_s", "tokens_per_s", "mfu",
    "peak_memory_bytes", "peak_memory_source", "recompilations", "device_kind", "jax_version", "losses",
}


def cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "migration", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_cli_run_writes_a_complete_json_report(tmp_path):
    out = tmp_path / "out.json"
    csv_path = tmp_path / "out.csv"
    proc = cli("run", "--workload", "transformer", "--preset", "tiny", "--batch", "8", "--steps", "10",
               "--json", str(out), "--csv", str(csv_path))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert REQUIRED_KEYS <= set(report)
    assert report["status"] == "ok" and report["recompilations"] == 0
    assert len(report["losses"]) == 10 and report["losses"][-1] < report["losses"][0]
    assert report["step_ms_p90"] >= report["step_ms_median"] > 0
    assert report["tokens_per_s"] == pytest.approx(report["samples_per_s"] * 64)
    assert 0 < report["mfu"] < 1
    assert report["peak_memory_source"].startswith("cpu:") and report["peak_memory_bytes"] > 0
    assert report["device_kind"] == "cpu" and report["backend"] == "cpu"
    assert "run: step 10 of 10, loss" in proc.stdout and "CPU backend" in proc.stdout
    import pandas as pd

    assert pd.read_csv(csv_path).loc[0, "status"] == "ok"


def test_cli_rejects_a_bad_batch_in_one_line_without_traceback():
    proc = cli("run", "--workload", "transformer", "--preset", "tiny", "--batch", "0", timeout=60)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr + proc.stdout
    assert "per_device_batch" in lines[0] and "1 to 65536" in lines[0] and "--batch" in lines[0]


def test_cli_rejects_a_non_integer_in_one_line():
    proc = cli("run", "--batch", "eight", timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_invalid_config_is_refused_before_any_worker_starts(monkeypatch):
    started = []
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError):
        start_run(RunConfig(per_device_batch=-1))
    assert started == []


def test_four_device_run_with_accumulation_and_bf16():
    report = run(RunConfig(workload="mlp", preset="tiny", per_device_batch=4, devices=4, accumulation_steps=2,
                           precision="bf16", remat="full", steps=6))
    assert report.ok, report.message + report.stderr_tail
    assert report.device_count == 4 and report.global_batch == 32 and report.recompilations == 0


def test_a_worker_killed_mid_run_is_crashed_with_events_kept():
    handle = start_run(RunConfig(workload="transformer", preset="tiny", steps=100_000, warmup_steps=1, timeout_s=300))
    seen = []
    for event in handle.events():
        seen.append(event)
        if event["event"] == "step" and event["index"] == 2:
            os.kill(handle.pid, signal.SIGKILL)
    report = handle.report
    assert report.status == "failed" and report.failure_kind == "crashed"
    assert "SIGKILL" in report.message
    assert [e["event"] for e in seen[:3]] == ["started", "compiled", "step"]
    assert len(report.losses) >= 3


def test_a_run_past_its_timeout_is_stopped_as_timeout():
    report = run(RunConfig(workload="transformer", preset="tiny", steps=100_000, timeout_s=8))
    assert report.status == "failed" and report.failure_kind == "timeout"
    assert "timeout_s=8" in report.message
    assert report.wall_s < 30


def test_cancel_kills_and_reaps_the_worker():
    handle = start_run(RunConfig(workload="transformer", preset="tiny", steps=100_000, timeout_s=300))
    for event in handle.events():
        if event["event"] == "step":
            handle.cancel()
    assert handle.report.status == "cancelled" and handle.report.failure_kind == "cancelled"
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)  # reaped: the process no longer exists


def test_an_impossible_allocation_is_oom_and_the_next_run_succeeds():
    # ~34 TB of logits: the CPU backend raises RESOURCE_EXHAUSTED at the first step.
    report = run(RunConfig(workload="transformer", preset="small", per_device_batch=65536, steps=2, warmup_steps=0))
    assert report.status == "failed" and report.failure_kind == "oom"
    assert "out of memory while running step 1" in report.message and "per-device batch" in report.message
    assert report.predicted_peak_bytes > 10**13  # the compiled step said so before it ran
    after = run(RunConfig(workload="mlp", preset="tiny", steps=3, warmup_steps=1))
    assert after.ok, after.message + after.stderr_tail


def test_environment_probe_reports_backend_and_versions():
    info = probe_environment(RunConfig(platform="cpu", devices=2))
    assert info["backend"] == "cpu" and info["device_count"] == 2
    assert info["versions"]["jax"].startswith("0.")
    assert info["env"]["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert any("CPU backend" in w for w in info["warnings"])


def test_cli_env_prints_backend_and_variables():
    proc = cli("env", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "backend: cpu" in proc.stdout and "XLA_PYTHON_CLIENT_PREALLOCATE=false" in proc.stdout


def test_a_profile_capture_is_summarised_and_kept(tmp_path):
    report = run(RunConfig(workload="mlp", preset="tiny", steps=4, warmup_steps=1, profile_steps=2,
                           profile_dir=str(tmp_path / "trace")))
    assert report.ok, report.message
    profile = report.profile
    assert profile["steps"] == 2 and profile["top_ops"] and Path(profile["path"]).exists()
    assert profile["path"].endswith("perfetto_trace.json.gz")
    assert report.timed_steps == 3  # the profiled steps are extra, outside the timed window
