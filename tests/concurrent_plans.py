"""Plans started together, for tests whose plans do not depend on each other.

A plan of a small model spends most of its time in process start-up and compiles that keep about
one core busy: on a 2-core machine two of them side by side take little more wall time than one.
(Not so for real-size models, whose compiles keep both cores busy: plan those one at a time.)
Each plan here has its own cold compile cache, as when it was made alone.

- `start_plans`: planner workers, the ones the app and the CLI start (`migration.running.runner.start_plan`),
  each read to its end by a thread of its own (so its deadline and silence limit are judged as
  usual, whenever the test asks for the plan);
- `start_cli_plans` / `cli_plan`: `python -m migration plan ... --json` as a user runs it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Hashable, Mapping
from concurrent.futures import Future
from pathlib import Path

from migration.config.requests import PlanRequest
from migration.results import Plan
from migration.running.runner import start_plan

ROOT = Path(__file__).resolve().parent.parent


def start_plans(requests: Mapping[Hashable, PlanRequest], cache_root: Path) -> dict[Hashable, Future[Plan]]:
    """Start a planner worker for every request now; {key: future of its Plan} (the future raises
    what `PlanHandle.wait` raises). The worker of `key` compiles into `cache_root / str(key)`."""
    futures: dict[Hashable, Future[Plan]] = {}
    before = os.environ.get("MIGRATION_CACHE_DIR")
    try:
        for key, req in requests.items():
            # The worker's environment is copied from this process's when it starts.
            os.environ["MIGRATION_CACHE_DIR"] = str(cache_root / str(key))
            handle = start_plan(req)
            future: Future[Plan] = Future()
            threading.Thread(target=_read_to_the_end, args=(handle, future), daemon=True,
                             name=f"plan-{key}").start()
            futures[key] = future
    finally:
        if before is None:
            os.environ.pop("MIGRATION_CACHE_DIR", None)
        else:
            os.environ["MIGRATION_CACHE_DIR"] = before
    return futures


def _read_to_the_end(handle, future: Future) -> None:
    try:
        future.set_result(handle.wait())
    except BaseException as exc:  # noqa: BLE001 - handed to the test that asks for this plan
        future.set_exception(exc)


def start_cli_plans(flags: Mapping[Hashable, list[str]], root: Path) -> dict[Hashable, tuple[subprocess.Popen, Path]]:
    """`python -m migration plan *flags --json` for every key now, each in its own folder under
    `root` (plan.json, stdout.txt, stderr.txt, and its compile cache): {key: (process, folder)}.
    Kill what is left with `stop_cli_plans`."""
    started = {}
    for key, args in flags.items():
        folder = root / str(key)
        folder.mkdir(parents=True)
        env = {**os.environ, "MIGRATION_CACHE_DIR": str(folder / "cache")}
        with open(folder / "stdout.txt", "w") as out, open(folder / "stderr.txt", "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "migration", "plan", *args, "--json",
                                     str(folder / "plan.json")], cwd=ROOT, stdout=out, stderr=err, env=env)
        started[key] = (proc, folder)
    return started


def cli_plan(started: tuple[subprocess.Popen, Path], timeout_s: float = 900) -> tuple[dict, str, Path]:
    """(the plan's JSON, the command's stdout, the JSON's path) once the command has ended; fails
    the test with its output when it did not end well."""
    proc, folder = started
    proc.wait(timeout=timeout_s)
    stdout, stderr = (folder / "stdout.txt").read_text(), (folder / "stderr.txt").read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    return json.loads((folder / "plan.json").read_text()), stdout, folder / "plan.json"


def stop_cli_plans(started: Mapping[Hashable, tuple[subprocess.Popen, Path]]) -> None:
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
