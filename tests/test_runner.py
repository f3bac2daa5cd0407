"""The runner and the CLI end to end: real worker processes, real compiles, real failures."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from migration.common import ConfigError
from migration.config.requests import RunConfig
from migration.running.runner import probe_environment, run, start_run

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


def _gone(pid):
    """The process no longer runs: it does not exist, or it is a zombie nobody has reaped yet (a
    worker whose parent died is re-parented, and not every container's init reaps)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    state = next(line.split()[1] for line in status.splitlines() if line.startswith("State:"))
    return state in ("Z", "X")


def _wait_gone(pid, within_s):
    deadline = time.monotonic() + within_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# Starts a long run, reads to its first step, then hands a copy of the events pipe's read end to a
# helper that outlives this process: the worker's writes never fail, so only the lifeline can stop it
# (and the helper, started after the worker, must not have inherited the lifeline's write end).
PARENT_SCRIPT = textwrap.dedent("""
    import os, subprocess, sys, time
    from migration.config.requests import RunConfig
    from migration.running.runner import start_run

    handle = start_run(RunConfig(workload="mlp", preset="tiny", steps=100_000, timeout_s=600))
    events = handle.events()
    for event in events:
        if event["event"] == "step":
            break
    holder = subprocess.Popen(["sleep", "600"], pass_fds=(handle._fd,), start_new_session=True)
    print(handle.pid, holder.pid, flush=True)
    if sys.argv[1] == "exit":
        sys.stdin.readline()
        sys.exit(0)  # a normal exit, with the run unfinished
    time.sleep(600)
""")


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_a_worker_dies_with_the_process_that_started_it(how):
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, how], cwd=ROOT, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    worker_pid = holder_pid = None
    try:
        worker_pid, holder_pid = map(int, parent.stdout.readline().split())
        assert not _gone(worker_pid)
        time.sleep(0.5)
        assert not _gone(worker_pid), "the worker stopped while its parent was still there"
        if how == "exit":
            parent.stdin.write("exit\n")
            parent.stdin.flush()
        else:
            parent.send_signal(getattr(signal, how))
        parent.wait(timeout=5)  # an exiting parent does not wait for its worker either
        assert _wait_gone(worker_pid, 2.0), f"the worker outlived its parent ({how})"
    finally:
        for pid in (worker_pid, holder_pid):
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
        parent.wait()
        parent.stdin.close()
        parent.stdout.close()


def test_a_silent_worker_is_stopped_as_hung_with_its_steps_kept():
    handle = start_run(RunConfig(workload="mlp", preset="tiny", steps=100_000, timeout_s=300, silence_timeout_s=3))
    stopped_at = None
    try:
        for event in handle.events():
            if event["event"] == "step" and stopped_at is None:
                os.kill(handle.pid, signal.SIGSTOP)  # hung: neither steps nor heartbeats any more
                stopped_at = time.monotonic()
    finally:
        if handle.outcome is None:
            handle.cancel()
    waited = time.monotonic() - stopped_at
    report = handle.report
    assert report.status == "failed" and report.failure_kind == "timeout", report.message
    assert "sent nothing for 3 s" in report.message and "silence_timeout_s=3" in report.message
    # Not before the 3 s of silence; after them, the runner's next look (it waits for the worker's
    # output at most until the silence limit) and the kill, with 9 s to spare for a loaded 2-core box.
    assert 2.5 < waited < 3 + 9
    assert report.losses
    with pytest.raises(ProcessLookupError):
        os.kill(handle.pid, 0)  # killed although stopped, and reaped


def test_heartbeats_are_not_events_and_no_descriptor_is_left_open():
    fds_before = sorted(os.listdir("/proc/self/fd"))
    # Start-up and compile take longer than 2 s: the run only succeeds because `alive` kept coming.
    handle = start_run(RunConfig(workload="mlp", preset="tiny", steps=3, warmup_steps=1, silence_timeout_s=2))
    seen = [event["event"] for event in handle.events(heartbeat_s=0.25)]
    report = handle.report
    assert report.ok, report.message + report.stderr_tail
    assert "alive" not in seen and "alive" not in [e["event"] for e in handle.events_so_far]
    assert "heartbeat" in seen  # the host-side heartbeat still comes while the worker is busy
    assert [e for e in seen if e != "heartbeat"] == ["started", "compiled", "step", "step", "step", "finished"]
    assert len(report.losses) == 3
    assert sorted(os.listdir("/proc/self/fd")) == fds_before


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


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_a_worker_moves_to_the_worker_cpus_from_a_server_pinned_elsewhere():
    """The server may be pinned to its own core (taskset); its workers inherit that affinity and must
    still move to --worker-cpus, or they compete with the server on its one core."""
    server_cpu, worker_cpu = sorted(os.sched_getaffinity(0))[:2]
    script = ("import os; from migration.running.worker import pin_to_worker_cpus; "
              f"os.sched_setaffinity(0, {{{server_cpu}}}); pin_to_worker_cpus('{worker_cpu}'); "
              "a = os.sched_getaffinity(0); pin_to_worker_cpus('4096-4099'); "
              "print(sorted(a), sorted(os.sched_getaffinity(0)))")
    done = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).resolve().parent.parent,
                          capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split("] [") == [f"[{worker_cpu}", f"{worker_cpu}]\n"], done.stdout


def test_a_worker_ends_as_python_ends_without_tearing_down_its_modules():
    """`leave`, the last call of a worker and of the command line, does what a normal exit does, in its order: a thread still working
    finishes, a thread pool's queued task is done, then the exit handlers run and buffered output reaches the
    pipe; the code given is the exit status, and nothing after the call runs."""
    script = textwrap.dedent("""
        import atexit, concurrent.futures, threading, time
        from migration.common import leave
        atexit.register(lambda: print("exit handler"))
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
        pool = concurrent.futures.ThreadPoolExecutor(1)
        pool.submit(lambda: (time.sleep(0.3), print("pool task finished")))
        print("buffered", end="|")
        leave(3)
        print("after leave")
    """)
    buffered = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe's output waits in a buffer
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=buffered)
    assert proc.returncode == 3, proc.stderr
    out = proc.stdout
    assert out.startswith("buffered|") and "after leave" not in out, out
    assert out.index("thread finished") < out.index("exit handler"), out
    assert out.index("pool task finished") < out.index("exit handler"), out


def test_the_command_lines_code_check_and_help_never_import_jax(tmp_path):
    """Only a command that reads a model config or starts a worker pays for JAX: `check` (a team's pre-commit
    hook) and `--help` answer without it."""
    script = tmp_path / "train.py"
    script.write_text("import jax\nparams = jax.tree_map(lambda x: x, {})\n")
    code = ("import sys; from migration.cli.commands import main; status = main(['check', sys.argv[1]]); "
            "print(status, 'jax' in sys.modules, 'flax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, str(script)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert "jax.tree_map" in out and out.split()[-3:] == ["1", "False", "False"], out
    code = ("import sys; from migration.cli.commands import main\ntry: main(['--help'])\nexcept SystemExit: pass\n"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         check=True).stdout
    assert "usage:" in out and out.split()[-1] == "False", out
