"""The app as a server process (`python app.py`) on a free port, for the tests and the load benchmark.

One launcher for every caller: its own history, cache (and so private exports folder) and logs under
a temporary folder; extra CLI flags and environment as given. The caller's MIGRATION_* variables and
GRADIO_TEMP_DIR are not passed on, so the server runs on its flags alone. Imports nothing from the
app (and gradio_client only when a client is asked for): `bench/load.py` uses it too.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 180.0  # a loaded 2-core box takes a while to import gradio and JAX


def users_file(path: Path, users: dict[str, str]) -> Path:
    """A users file for --auth-file: salted hashes, private (as `python -m migration add-user` writes)."""
    from migration.service.accounts import add_user

    for user, password in users.items():
        add_user(path, user, password)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate: Any, within_s: float, poll_s: float = 0.05) -> None:
    """Poll `predicate` until it holds; fail the test after `within_s` seconds."""
    deadline = time.monotonic() + within_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {within_s:g} s"
        time.sleep(poll_s)


def holds_within(predicate: Any, within_s: float, poll_s: float = 0.05) -> bool:
    """Whether `predicate` comes to hold within `within_s` seconds (polled); the caller asserts."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(poll_s)
    return bool(predicate())


def job_is_stepping(job: Any) -> bool:
    """Whether a job-service job's worker has reported a training step."""
    return any(e.get("event") == "progress" and e["worker_event"]["event"] == "step" for e in job.events_since(0))


def value(output: Any) -> Any:
    """A component's value whether the app sent it plain or as an update (visibility changes)."""
    return output.get("value") if isinstance(output, dict) and "__type__" in output else output


SHARED_SETTINGS = ("MIGRATION_COMPILE_CACHE_DIR", "MIGRATION_COMPILE_STORE")


class Server:
    """`python app.py --port P --history-db DB *args` with MIGRATION_CACHE_DIR under `tmp`.

    wait: return once the port listens (else call `wait_ready`); client: then also connect a
    gradio_client as `self.client` (a server with auth needs `connect(auth)` instead);
    pre_create_cache: make the cache folders first, readable by everyone (the app must tighten them);
    python: the interpreter that runs it; root: the checkout whose app.py it runs;
    db: the history database (default `tmp/history.sqlite`); cache: MIGRATION_CACHE_DIR (default
    `tmp/cache`: compile figures, Gradio's files, exports); port: 0 for a free one.
    `close()` then `start()` restarts it on the same port with the same history.
    """

    def __init__(self, tmp: Path, *args: str, env: dict[str, str] | None = None, db: Path | None = None,
                 cache: Path | None = None, port: int = 0, wait: bool = True, client: bool = True,
                 pre_create_cache: bool = False, taskset: str = "", python: str = sys.executable, root: Path = ROOT):
        tmp.mkdir(parents=True, exist_ok=True)
        self.tmp = tmp
        self.args = args
        self.taskset = taskset  # CPUs to pin the server to (the load benchmark keeps a core for it)
        self.python = python  # the interpreter (another environment's, for a before/after benchmark)
        self.root = root  # the checkout whose app.py runs (another commit's, for a before/after benchmark)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.db = db or tmp / "history.sqlite"
        self.cache = cache or tmp / "cache"
        if pre_create_cache:
            for folder in (self.cache, self.cache / "gradio", self.cache / "exports"):
                folder.mkdir(parents=True, exist_ok=True)
                os.chmod(folder, 0o755)
        self.stdout_path = tmp / f"app-{self.port}.out.log"
        self.stderr_path = tmp / f"app-{self.port}.err.log"
        # The app's own settings come from the arguments, never from the caller's environment; the compiled
        # figures it shares with every other process of the test session do (tests/conftest.py shared_caches).
        self.env = {k: v for k, v in os.environ.items() if (not k.startswith("MIGRATION_") or k in SHARED_SETTINGS)
                    and k != "GRADIO_TEMP_DIR"}
        # Without auth the server asks for its token (the printed URL carries it); clients send it.
        self.token = secrets.token_urlsafe(16)
        self.env.update({"MIGRATION_CACHE_DIR": str(self.cache), "GRADIO_ANALYTICS_ENABLED": "False",
                         "HF_HUB_OFFLINE": "1", "MIGRATION_TOKEN": self.token})
        self.env.update(env or {})
        self.client: Any = None
        self.start(wait=wait, client=client)

    def start(self, wait: bool = True, client: bool = True) -> None:
        self._out = open(self.stdout_path, "a")  # noqa: SIM115  (closed in close())
        self._err = open(self.stderr_path, "a")  # noqa: SIM115
        self._first_line_at = self.stdout_path.stat().st_size  # a restart's first line comes after the last run's
        self.proc = subprocess.Popen(
            [*(["taskset", "-c", self.taskset] if self.taskset else []),
             self.python, "app.py", "--port", str(self.port), "--history-db", str(self.db), *self.args],
            cwd=self.root, stdout=self._out, stderr=self._err, env=self.env, start_new_session=True)
        if wait:
            self.wait_ready()
            self.client = self.connect() if client else None

    def logs(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr_path.read_text(errors="replace")

    def wait_ready(self, limit_s: float = START_TIMEOUT_S) -> None:
        """Until the port listens; RuntimeError with the logs if the server exits first, TimeoutError
        if it does not listen within `limit_s`."""
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {self.proc.returncode}:\n{self.logs()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.3)
        raise TimeoutError(f"the server did not listen on port {self.port} within {limit_s:.0f} s:\n{self.logs()}")

    def first_line(self, timeout_s: float = START_TIMEOUT_S) -> str:
        """The first line the server (this start of it) wrote to stdout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(self.stdout_path, errors="replace") as f:
                f.seek(self._first_line_at)
                text = f.read()
            if "\n" in text:
                return text.splitlines()[0]
            assert self.proc.poll() is None, f"the server exited:\n{self.logs()}"
            time.sleep(0.2)
        raise AssertionError(f"no line on stdout within {timeout_s} s:\n{self.logs()}")

    @property
    def headers(self) -> dict[str, str]:
        """Headers that carry the server's token (what its printed URL gives a browser)."""
        return {"X-Migration-Token": self.token}

    def connect(self, auth: tuple[str, str] | None = None, **kwargs: Any) -> Any:
        """A new gradio_client session (its own session state: plan, code check, jobs)."""
        from gradio_client import Client
        headers = {**self.headers, **kwargs.pop("headers", {})}
        return Client(self.url, auth=auth, verbose=False, headers=headers, **kwargs)

    def workers(self, mode: str = "") -> list[int]:
        """This server's worker processes (its children), not anyone else's; of one mode (run, plan,
        check, probe-env) when given."""
        pattern = f"migration.running.worker .*--mode {mode}( |$)" if mode else "migration.running.worker"
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid), "-f", pattern],
                             check=False, capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def wait_for_worker(self, within_s: float = 120, mode: str = "run") -> int:
        """A run's worker (plans of queued runs may compile beside it)."""
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            found = self.workers(mode)
            if found:
                return found[0]
            time.sleep(0.2)
        raise AssertionError("no worker started")

    def close(self, sig: int = signal.SIGTERM) -> None:
        """`sig` to the server's process group (SIGTERM: it marks unfinished jobs interrupted and
        stops its workers), then SIGKILL to whatever of the group is left."""
        for s, wait_s in ((sig, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, s)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        self._out.close()
        self._err.close()
