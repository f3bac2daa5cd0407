"""Load test of the app on loopback with Locust: many signed-in users queueing runs while others
browse the history.

Starts `app.py` with an auth file (16 users who run, 4 who browse), `--worker-cpus` set aside for
the workers, and a fresh history; then runs Locust headless (bench/locustfile.py) twice:

1. idle: the 4 browsers alone call the light endpoints (`/history`, `/export_history_csv`) about
   every half second for `--idle-s` seconds;
2. load: the 16 runners each plan once (target: this machine) and submit `--runs-per-user` runs of
   `--steps` steps of transformer/tiny, each followed to its end, while the 4 browsers go on; Locust
   stops when every runner is done.

Where the CPU goes, so that the load generator is not charged to the server: the server is pinned
to CPU 0 (taskset), its workers to the other CPUs (`--worker-cpus`, at nice 19 as always) and
Locust to those too, so the server's core serves the server alone (on a GPU box a worker's host
side barely needs the CPU; on this CPU-only box the runs themselves use the other cores). Verified
after: every submitted run is in the history database exactly once under its label, `ok`.

The report: runs submitted / ok / failed / refused / lost / duplicated (refused: the server answered with an
error and recorded nothing; lost: recorded nothing and said nothing); p50 / p95 / max of each light
endpoint idle and under load (Locust's percentiles, the POST and the event stream of a call timed
together) and the ratio p95 under load / p95 idle (target: within 3x). Exit 0 when every run is ok,
1 otherwise. `--users 2 --browsers 1 --runs-per-user 1 --steps 2 --idle-s 3` is the smoke size the
suite runs (tests/test_benches.py).

    python bench/load.py [--users 16] [--browsers 4] [--runs-per-user 2] [--steps 4] [--idle-s 60]
                         [--timeout-s 2400] [--json out.json] [--keep folder]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from tests.server import Server, users_file  # noqa: E402  (the launcher the app's tests use)

LIGHT = ("/history", "/export_history_csv")
SERVER_CPU = "0"
ARRIVALS_PER_S = 4  # users who open the page and sign in each second (a sign-in is 50 ms of scrypt)


def worker_cpus() -> str:
    others = sorted(os.sched_getaffinity(0) - {int(SERVER_CPU)})
    return ",".join(map(str, others)) or SERVER_CPU


def locust(tmp: Path, server: Server, users: list[tuple[str, str]], runners: int, run_time_s: float, prefix: str,
           extra_env: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Locust headless with `len(users)` users (the first `runners` run, the rest browse); its stats rows by name."""
    env = {**os.environ, "LOAD_USERS": ",".join(f"{u}:{p}" for u, p in users), "LOAD_RUNNERS": str(runners),
           "LOAD_OUTCOMES": str(tmp / "outcomes.jsonl"), **extra_env}
    classes = (["Runner"] if runners else []) + (["Browser"] if len(users) > runners else [])
    command = ["taskset", "-c", worker_cpus(), sys.executable, "-m", "locust", "-f", str(ROOT / "bench" / "locustfile.py"),
               "--headless", "-H", server.url.rstrip("/"), "-u", str(len(users)), "-r", str(ARRIVALS_PER_S),
               "--run-time", f"{int(run_time_s)}s", "--csv", str(tmp / prefix), "--only-summary",
               "--stop-timeout", "120", "--csv-full-history", *classes]
    subprocess.run(command, env=env, cwd=ROOT, check=False, stdout=subprocess.DEVNULL,
                   stderr=open(tmp / f"{prefix}.log", "w"))  # noqa: SIM115
    with open(tmp / f"{prefix}_stats.csv") as f:
        return {row["Name"]: row for row in csv.DictReader(f)}


def figure(row: dict[str, Any] | None, key: str) -> float | None:
    value = (row or {}).get(key)
    return None if value in (None, "", "N/A") else float(value)


def verify(db: Path, expected: set[str], outcomes: Path) -> dict[str, Any]:
    """Each submitted run, told apart: ok (recorded ok once), failed (recorded, not ok), refused (the server
    said no: an error answer and no record), lost (no record, and no refusal either), duplicated."""
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
        rows = con.execute("SELECT label, status FROM entries WHERE kind = 'run'").fetchall()
    seen: dict[str, list[str]] = {}
    for label, status in rows:
        seen.setdefault(label, []).append(status)
    answered = {}
    if outcomes.exists():
        for line in outcomes.read_text().splitlines():
            o = json.loads(line)
            answered[o["label"]] = o
    refused = {label for label in expected if label not in seen and answered.get(label, {}).get("event") == "error"}
    return {"submitted": len(expected), "ok": sum(seen.get(label) == ["ok"] for label in expected),
            "failed": sum(bool(seen.get(label)) and seen[label] != ["ok"] for label in expected),
            "refused": len(refused), "lost": sum(label not in seen and label not in refused for label in expected),
            "duplicated": sum(len(seen.get(label, [])) > 1 for label in expected),
            "refusals": sorted({str(answered[label]["headline"])[:200] for label in refused})[:5]}


def _n(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=16, help="users who each plan and queue runs")
    parser.add_argument("--browsers", type=int, default=4, help="users who browse the history meanwhile")
    parser.add_argument("--runs-per-user", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--idle-s", type=float, default=60)
    parser.add_argument("--timeout-s", type=float, default=2400)
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write the figures as a record (bench/results/load.json), the raw counts under data")
    parser.add_argument("--keep", default=None, help="a folder to copy Locust's CSVs (with each second's "
                                                    "percentiles) and logs into")
    args = parser.parse_args()
    if shutil.which("taskset") is None or len(os.sched_getaffinity(0)) < 2:
        print("needs taskset and two CPUs or more (the server's core and the others)", file=sys.stderr)
        return 2
    runners = [(f"user{i:02d}", f"pw-{i}-load") for i in range(args.users)]
    browsers = [(f"viewer{i}", f"pw-{i}-view") for i in range(args.browsers)]
    with tempfile.TemporaryDirectory(prefix="load-") as tmp_name:
        tmp = Path(tmp_name)
        auth = users_file(tmp / "users.txt", dict(runners + browsers))
        server = Server(tmp, "--auth-file", str(auth), "--jobs-per-user", "4", "--queue-size", "64",
                        "--worker-cpus", worker_cpus(), client=False, wait=False, taskset=SERVER_CPU)
        try:
            server.wait_ready()
            idle = locust(tmp, server, browsers, 0, args.idle_s, "idle", {})
            t0 = time.monotonic()
            load = locust(tmp, server, runners + browsers, len(runners), args.timeout_s, "load",
                          {"LOAD_RUNS": str(args.runs_per_user), "LOAD_STEPS": str(args.steps)})
            wall = time.monotonic() - t0
        finally:
            server.close()
        expected = {f"load {u} run {i}" for u, _ in runners for i in range(args.runs_per_user)}
        runs = verify(server.db, expected, tmp / "outcomes.jsonl")
        if args.keep:
            shutil.copytree(tmp, args.keep, dirs_exist_ok=True,
                            ignore=lambda _, names: [n for n in names if not n.endswith((".csv", ".log", ".jsonl"))])
    rows = []
    for name in LIGHT:
        i, u = idle.get(name), load.get(name)
        p95_idle, p95_load = figure(i, "95%"), figure(u, "95%")
        rows.append({"endpoint": name, "idle_n": figure(i, "Request Count"), "idle_p50_ms": figure(i, "50%"),
                     "idle_p95_ms": p95_idle, "load_n": figure(u, "Request Count"), "load_p50_ms": figure(u, "50%"),
                     "load_p95_ms": p95_load, "load_max_ms": figure(u, "100%"),
                     "failures": figure(u, "Failure Count"),
                     "ratio": p95_load / p95_idle if p95_idle and p95_load else None})
    print(f"runs: {runs['submitted']} submitted, {runs['ok']} ok, {runs['failed']} failed, {runs['refused']} refused, "
          f"{runs['lost']} lost, {runs['duplicated']} duplicated; load phase {wall:.0f} s")
    for text in runs["refusals"]:
        print(f"  refused: {text}")
    print("| endpoint | idle calls | idle p50 / p95 ms | load calls | load p50 / p95 / max ms | failures | p95 load / idle |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['endpoint']} | {_n(r['idle_n'])} | {_n(r['idle_p50_ms'])} / {_n(r['idle_p95_ms'])} | "
              f"{_n(r['load_n'])} | {_n(r['load_p50_ms'])} / {_n(r['load_p95_ms'])} / {_n(r['load_max_ms'])} | "
              f"{_n(r['failures'])} | {_n(r['ratio'], '.2f')}x |")
    record.write(args.json, "load", [record.table(
        f"{args.users} users planning and queueing {args.runs_per_user} runs of {args.steps} steps each, {args.browsers} "
        f"browsing; baseline: the {args.browsers} browsing for {args.idle_s:g} s with nothing queued",
        ["endpoint", "idle calls", "idle p50 / p95 ms", "calls under load", "load p50 / p95 / max ms", "failures",
         "p95 load / idle"],
        [[r["endpoint"], _n(r["idle_n"]), f"{_n(r['idle_p50_ms'])} / {_n(r['idle_p95_ms'])}", _n(r["load_n"]),
          f"{_n(r['load_p50_ms'])} / {_n(r['load_p95_ms'])} / {_n(r['load_max_ms'])}", _n(r["failures"]),
          f"{_n(r['ratio'], '.2f')}x"] for r in rows])],
        [f"Runs: {runs['submitted']} submitted, {runs['ok']} ok, {runs['failed']} failed, {runs['refused']} refused, "
         f"{runs['lost']} lost, {runs['duplicated']} duplicated; load phase {wall:.0f} s."],
        data={"runs": runs, "light": rows, "load_wall_s": wall})
    return 0 if runs["ok"] == runs["submitted"] else 1


if __name__ == "__main__":
    sys.exit(main())
