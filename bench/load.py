"""Load test of the app on loopback: many signed-in users queueing runs while browsing the history.

Starts `app.py` with an auth file (one user per client) and a fresh history, then:

1. idle baseline: with nothing queued, one client calls the light endpoints (`/history`,
   `/export_history_csv`) N times each, one after the other, and the wall time of each call is kept;
2. load: every client (a thread, its own user) plans once on `/plan` (target: this machine) as a
   user of the app does, then submits its runs of that plan on `/run` and,
   while they are queued or running, keeps calling `/history`, `/export_history_csv` and
   `/export_csv` (the ids of its own runs it can see) about every 0.5 s, timing each call; the final
   output of every run is kept ("Run finished" in its headline: success);
3. verification: the history database (read-only) and each user's own `/history` must hold every
   submitted run exactly once under its label.

Clients allow each HTTP request 120 s (gradio_client's default, httpx's 5 s, would count a slow
answer as an error). The report gives runs submitted / finished ok / failed (with their kinds) /
lost / duplicated, the total wall time, p50/p95/max latency of the light endpoints idle and under
load with the ratio p95 under load / p95 idle (target: within 3x; reported, not asserted), and
where the CPU went (server process, the load's clients, the whole machine) in each phase. Exit
status 0 when every run finished ok and none is lost or duplicated, 1 otherwise (or when --timeout-s runs out: a hard bound
on the whole benchmark, server start and shutdown included).

    python bench/load.py [--clients 16] [--runs-per-client 2] [--steps 4] [--timeout-s 1500]
                         [--port 0] [--json out.json] [--keep-tmp]

On the 2-core development VM a 4-step tiny run takes 10-60 s (worker start, compile, steps), one at
a time; 32 of them need --timeout-s 2400 or more there.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import secrets
import shutil
import sqlite3
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server import Server  # noqa: E402  (the launcher the app's tests use)

# The tiny preset, target "local": the plan is a local CPU compile inside the job (no deviceless GPU
# compile). Order of the app's form inputs.
FORM = ["transformer", "tiny", "tpu-v5e-8", 32, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0, 0, 0, "preset", "auto", 8]
LEARNING_RATE = 0.003
HISTORY_ARGS = ("mine", "all", "all", "all")  # scope, kind, workload, status
LIGHT_SLEEP_S = 0.5
IDLE_CALLS = 20
WARMUP_CALLS = 2
LIGHT_CALL_LIMIT_S = 120.0  # one light call longer than this is recorded as an error
# Each HTTP request of a client (gradio_client's default is httpx's 5 s, which would turn a slow
# answer into an error); the event streams get the same read limit (the server sends heartbeats).
HTTP_TIMEOUT = {"timeout": 120.0, "connect": 30.0}
COMPARED = ("/history", "/export_history_csv")  # the endpoints measured both idle and under load


class Deadline:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def passed(self) -> bool:
        return self.left() <= 0


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (q in 0..100)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50_s": percentile(values, 50), "p95_s": percentile(values, 95),
            "max_s": max(values) if values else None}


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(cannot read {path}: {exc})"


# -- where the CPU went (the load is on the same machine as the server) ----------------------------

def process_cpu_s(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    except (OSError, IndexError, ValueError):
        return None


def machine_cpu() -> tuple[float, float] | None:
    """(busy, total) jiffies of the whole machine."""
    try:
        values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = values[3] + (values[4] if len(values) > 4 else 0)
        return float(sum(values) - idle), float(sum(values))
    except (OSError, IndexError, ValueError):
        return None


class Meter:
    """CPU of the server process (the Gradio process itself, not its workers), of this benchmark
    process (the clients) and of the whole machine between two points."""

    def __init__(self, server_pid: int):
        self.server_pid = server_pid

    def snapshot(self) -> dict[str, Any]:
        t = os.times()
        return {"t": time.monotonic(), "server": process_cpu_s(self.server_pid), "bench": t.user + t.system,
                "machine": machine_cpu(), "loadavg": os.getloadavg()}

    @staticmethod
    def between(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        wall = max(1e-9, b["t"] - a["t"])
        server = None if a["server"] is None or b["server"] is None else b["server"] - a["server"]
        busy = None
        if a["machine"] and b["machine"] and b["machine"][1] > a["machine"][1]:
            busy = (b["machine"][0] - a["machine"][0]) / (b["machine"][1] - a["machine"][1])
        return {"wall_s": wall, "server_cpu_s": server, "server_cores": None if server is None else server / wall,
                "bench_cpu_s": b["bench"] - a["bench"], "bench_cores": (b["bench"] - a["bench"]) / wall,
                "machine_busy_fraction": busy, "cores": os.cpu_count(),
                "loadavg_1m_start": a["loadavg"][0], "loadavg_1m_end": b["loadavg"][0]}


# -- the server ---------------------------------------------------------------------------------

def start_server(tmp: Path, port: int, users: list[tuple[str, str]]) -> Server:
    """The app with an auth file (one line per user), a fresh history and room for every client's
    jobs; not waited for (the caller waits within its deadline)."""
    auth = tmp / "users.txt"
    auth.write_text("".join(f"{u}:{p}\n" for u, p in users))
    os.chmod(auth, 0o600)
    return Server(tmp, "--host", "127.0.0.1", "--auth-file", str(auth), "--jobs-per-user", "4", "--queue-size", "64",
                  port=port, wait=False, client=False)


def server_log_tail(server: Server) -> str:
    return f"stdout:\n{tail(server.stdout_path)}\nstderr:\n{tail(server.stderr_path)}"


# -- clients ------------------------------------------------------------------------------------

class Recorder:
    """Latency samples from every thread: (endpoint, phase, seconds, error or None, start time in
    seconds since the benchmark began)."""

    def __init__(self) -> None:
        self.samples: list[tuple[str, str, float, str | None, float]] = []
        self.t0 = time.monotonic()
        self._lock = threading.Lock()

    def call(self, client: Any, endpoint: str, args: tuple, phase: str, deadline: Deadline) -> Any:
        limit = min(LIGHT_CALL_LIMIT_S, max(1.0, deadline.left()))
        at = time.monotonic() - self.t0
        t0 = time.perf_counter()
        out, error = None, None
        try:
            out = client.submit(*args, api_name=endpoint).result(timeout=limit)
        except Exception as exc:  # noqa: BLE001 - any failure of a light call is part of the report
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        dt = time.perf_counter() - t0
        if phase:
            with self._lock:
                self.samples.append((endpoint, phase, dt, error, at))
        return out if error is None else None

    def values(self, endpoint: str | None, phase: str) -> list[float]:
        with self._lock:
            return [s for e, p, s, err, _ in self.samples if p == phase and err is None
                    and (e == endpoint if endpoint else e in COMPARED)]

    def errors(self) -> list[tuple[str, str, str]]:
        with self._lock:
            return [(e, p, err) for e, p, _, err, _ in self.samples if err is not None]


def make_client(url: str, user: str, password: str, downloads: Path) -> Any:
    import httpx
    from gradio_client import Client
    return Client(url, auth=(user, password), verbose=False, download_files=str(downloads / user),
                  analytics_enabled=False,
                  httpx_kwargs={"timeout": httpx.Timeout(HTTP_TIMEOUT["timeout"], connect=HTTP_TIMEOUT["connect"])})


def outcome_of(text: str) -> tuple[str, str, str]:
    """(ok | failed | cancelled, failure kind, headline line) from a run's final progress text (a
    note may come before the headline)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    headline = next((line for line in lines if line.startswith(("Run finished", "Run failed", "Run stopped"))),
                    lines[0] if lines else "")
    if headline.startswith("Run finished"):
        return "ok", "", headline
    if headline.startswith("Run stopped"):
        return "cancelled", "cancelled", headline
    if "does not fit" in headline:
        return "failed", "oom", headline
    if headline.startswith("Run failed ("):
        return "failed", headline[len("Run failed ("):].split(")", 1)[0], headline
    return "failed", "unexpected final output", headline


class LoadClient(threading.Thread):
    def __init__(self, user: str, password: str, server: Server, args: argparse.Namespace, rec: Recorder,
                 deadline: Deadline, stop: threading.Event, downloads: Path):
        super().__init__(name=f"client-{user}", daemon=True)
        self.user, self.password = user, password
        self.server, self.args, self.rec, self.deadline, self.stop = server, args, rec, deadline, stop
        self.downloads = downloads
        self.client: Any = None
        self.runs: dict[str, dict[str, Any]] = {}  # label -> submitted_at, job, outcome, ...
        self.error: str | None = None

    def run(self) -> None:
        try:
            self.client = make_client(self.server.url, self.user, self.password, self.downloads)
            # As in the app: plan first (the plan stays in this client's session), then run it.
            self.client.submit(*FORM, f"load-{self.user}-plan", api_name="/plan").result(timeout=self.deadline.left())
            for i in range(self.args.runs_per_client):
                label = f"load-{self.user}-{i}"
                t0 = time.monotonic()
                job = self.client.submit(None, self.args.steps, LEARNING_RATE, False, False, False, False, False, *FORM, label,
                                         api_name="/run")
                self.runs[label] = {"label": label, "user": self.user, "t_submit": t0, "job": job, "outcome": None}
            ids = ""
            cycle = 0
            while not self.stop.is_set() and not self.deadline.passed():
                self.collect()
                if self.pending() == []:
                    break
                endpoint = ("/history", "/export_history_csv", "/export_csv")[cycle % 3]
                cycle += 1
                if endpoint == "/history":
                    frame = self.rec.call(self.client, endpoint, HISTORY_ARGS, "load", self.deadline)
                    if frame:
                        cols = frame.get("headers") or []
                        if "id" in cols and "kind" in cols:
                            ids = ",".join(str(r[cols.index("id")]) for r in frame.get("data") or []
                                           if r[cols.index("kind")] == "run")
                elif endpoint == "/export_history_csv":
                    self.rec.call(self.client, endpoint, ("mine",), "load", self.deadline)
                elif ids:
                    self.rec.call(self.client, endpoint, (ids, "mine"), "load", self.deadline)
                else:
                    continue
                self.stop.wait(LIGHT_SLEEP_S)
            self.collect()
        except Exception as exc:  # noqa: BLE001 - reported, never silently dropped
            self.error = f"{type(exc).__name__}: {exc}"

    def pending(self) -> list[str]:
        return [label for label, r in self.runs.items() if r["outcome"] is None]

    def collect(self) -> None:
        for r in self.runs.values():
            job = r["job"]
            if r["outcome"] is not None or not job.done():
                continue
            r["t_done"] = time.monotonic()
            try:
                result = job.result(timeout=5)
                text = str(result[0] if isinstance(result, (list, tuple)) else result)
                r["outcome"], r["kind"], headline = outcome_of(text)
            except Exception as exc:  # noqa: BLE001 - a refused or failed job (gr.Error) ends here
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                headline = f"{type(exc).__name__}: {first}"
                r["outcome"], r["kind"] = "failed", "error: " + (first[:120] or type(exc).__name__)
            r["headline"] = headline[:300]
            r["streamed_outputs"] = len(job.outputs())

    def describe_pending(self) -> list[str]:
        out = []
        for label in self.pending():
            job = self.runs[label]["job"]
            try:
                status = job.status()
                code = getattr(status.code, "name", str(status.code))
                extra = f", queue rank {status.rank}" if getattr(status, "rank", None) is not None else ""
            except Exception as exc:  # noqa: BLE001
                code, extra = f"unknown ({type(exc).__name__})", ""
            outputs = job.outputs()
            last = str(outputs[-1][0]).strip().splitlines()[0][:160] if outputs and outputs[-1] else "(no output yet)"
            out.append(f"{label}: client status {code}{extra}; last output: {last}")
        return out


# -- verification -------------------------------------------------------------------------------

def expected_labels(clients: list[LoadClient], runs_per_client: int) -> dict[str, str]:
    return {f"load-{c.user}-{i}": c.user for c in clients for i in range(runs_per_client)}


def verify_db(db: Path, expected: dict[str, str]) -> dict[str, Any]:
    """The history database, read-only: every expected label exactly once among the runs."""
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=30)
    try:
        rows = con.execute("SELECT id, user, label, status FROM entries WHERE kind='run'").fetchall()
    finally:
        con.close()
    counts = collections.Counter(label for _, _, label, _ in rows)
    db_status: dict[str, list[str]] = collections.defaultdict(list)
    wrong_user = []
    for entry_id, user, label, status in rows:
        db_status[label].append(status)
        if label in expected and user != expected[label]:
            wrong_user.append(f"#{entry_id} {label} recorded for user {user!r}")
    return {
        "db_run_entries": len(rows),
        "db_status_counts": dict(collections.Counter(status for _, _, _, status in rows)),
        "db_status_of_label": {label: db_status.get(label, []) for label in sorted(expected)},
        "lost_db": sorted(set(expected) - set(counts)),
        "duplicated_db": sorted(label for label, n in counts.items() if n > 1 and label in expected),
        "unexpected_db": sorted(label for label in counts if label not in expected),
        "wrong_user_db": wrong_user,
    }


def verify_history_view(clients: list[LoadClient], expected: dict[str, str], deadline: Deadline,
                        rec: Recorder) -> dict[str, Any]:
    """Each user's own view: /history "mine", runs only: their labels exactly once, nobody else's."""
    lost, dup, foreign, errors = [], [], [], []
    for c in clients:
        mine = {label for label, u in expected.items() if u == c.user}
        frame = rec.call(c.client, "/history", ("mine", "run", "all", "all"), "", deadline) if c.client else None
        if not frame:
            errors.append(f"{c.user}: /history did not answer")
            lost += sorted(mine)
            continue
        try:
            cols = frame["headers"]
            seen = collections.Counter(r[cols.index("label")] for r in frame["data"])
            foreign += [f"{c.user} sees a run of {r[cols.index('user')]!r}" for r in frame["data"]
                        if r[cols.index("user")] != c.user]
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            errors.append(f"{c.user}: unexpected /history table ({type(exc).__name__}: {exc})")
            lost += sorted(mine)
            continue
        lost += sorted(mine - set(seen))
        dup += sorted(label for label in mine if seen[label] > 1)
    return {"lost_history_view": sorted(set(lost)), "duplicated_history_view": sorted(set(dup)),
            "foreign_rows_history_view": foreign, "history_view_errors": errors}


# -- report -------------------------------------------------------------------------------------

def fmt_s(x: float | None) -> str:
    return "     n/a" if x is None else f"{x * 1e3:7.0f}ms"


def latency_report(rec: Recorder) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, endpoint in (("/history", "/history"), ("/export_history_csv", "/export_history_csv"),
                           ("/export_csv", "/export_csv"), ("overall (/history + /export_history_csv)", None)):
        idle, load = summary(rec.values(endpoint, "idle")), summary(rec.values(endpoint, "load"))
        ratio = load["p95_s"] / idle["p95_s"] if idle["p95_s"] and load["p95_s"] is not None else None
        out[name] = {"idle": idle, "load": load, "p95_ratio_load_over_idle": ratio,
                     "within_3x": None if ratio is None else ratio <= 3.0}
    return out


def print_report(r: dict[str, Any]) -> None:
    p = print
    p("")
    p("=== load benchmark ===")
    p(f"clients {r['clients']} × runs {r['runs_per_client']} ({r['steps']} steps, tiny preset, target local); "
      f"server {r['url']}")
    p(f"total wall time: {r['wall_s']:.1f} s (load phase {r['load_wall_s']:.1f} s)"
      + ("  ** TIMED OUT **" if r["timed_out"] else ""))
    runs = r["runs"]
    p(f"runs submitted: {runs['submitted']}   finished ok: {runs['ok']}   failed: {runs['failed']}   "
      f"cancelled: {runs['cancelled']}   no outcome: {runs['no_outcome']}")
    if runs["failure_kinds"]:
        p("  failure kinds: " + ", ".join(f"{k} ×{n}" for k, n in runs["failure_kinds"].items()))
        for line in runs["failures"][:10]:
            p(f"    {line}")
    if runs["run_seconds"]["n"]:
        s = runs["run_seconds"]
        p(f"  submit → final output per run: p50 {s['p50_s']:.1f} s, p95 {s['p95_s']:.1f} s, max {s['max_s']:.1f} s")
    v = r["verification"]
    if v:
        p(f"history DB: {v['db_run_entries']} run entries; statuses "
          + ", ".join(f"{k} {n}" for k, n in sorted(v["db_status_counts"].items())))
        view = "lost_history_view" in v
        p(f"lost (submitted, not in history): DB {len(v['lost_db'])}, /history "
          f"{len(v['lost_history_view']) if view else 'not checked'}   duplicated: DB {len(v['duplicated_db'])}, "
          f"/history {len(v['duplicated_history_view']) if view else 'not checked'}")
        for key in ("lost_db", "duplicated_db", "unexpected_db", "wrong_user_db", "lost_history_view",
                    "duplicated_history_view", "foreign_rows_history_view", "history_view_errors"):
            if v.get(key):
                p(f"  {key}: {', '.join(map(str, v[key][:20]))}" + (" …" if len(v[key]) > 20 else ""))
        not_ok = {label: s for label, s in v["db_status_of_label"].items() if s != ["ok"]}
        if not_ok:
            p("  labels whose DB status is not exactly ['ok']: "
              + ", ".join(f"{label} {s}" for label, s in list(not_ok.items())[:20]))
    else:
        p("history verification: not done")
    p("light endpoints (successful calls; idle: nothing queued, one client; load: while runs were queued/running):")
    p(f"  {'endpoint':42s} {'phase':5s} {'n':>5s} {'p50':>9s} {'p95':>9s} {'max':>9s}   p95 load/idle")
    for name, d in r["latency"].items():
        for phase in ("idle", "load"):
            s = d[phase]
            ratio = ""
            if phase == "load":
                ratio = ("n/a" if d["p95_ratio_load_over_idle"] is None else
                         f"{d['p95_ratio_load_over_idle']:.2f}x ({'within' if d['within_3x'] else 'OVER'} 3x)")
            p(f"  {name:42s} {phase:5s} {s['n']:5d} {fmt_s(s['p50_s'])} {fmt_s(s['p95_s'])} {fmt_s(s['max_s'])}   "
              f"{ratio}")
    if r["cpu"]:
        p(f"CPU ({r['cpu'].get('idle', {}).get('cores')} cores; the machine may be shared with other work):")
        for phase, c in r["cpu"].items():
            busy = "n/a" if c["machine_busy_fraction"] is None else f"{100 * c['machine_busy_fraction']:.0f}%"
            server = "n/a" if c["server_cores"] is None else f"{c['server_cores']:.2f} cores"
            p(f"  {phase:5s} {c['wall_s']:7.1f} s: server process {server}, load clients {c['bench_cores']:.2f} cores, "
              f"machine busy {busy}, load average {c['loadavg_1m_start']:.1f} → {c['loadavg_1m_end']:.1f}")
    errs = r["light_call_errors"]
    p(f"light-endpoint errors: {len(errs)}")
    for e in errs[:10]:
        p(f"    {e}")
    if r["client_errors"]:
        p("client thread errors: " + "; ".join(r["client_errors"]))
    if r["pending"]:
        p("pending at the end:")
        for line in r["pending"]:
            p(f"    {line}")
    p(f"RESULT: {'PASS' if r['passed'] else 'FAIL'}"
      + ("" if r["passed"] else f" ({'; '.join(r['fail_reasons'])})"))


# -- main ---------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--runs-per-client", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--timeout-s", type=float, default=1500.0, help="hard wall-clock bound on the whole benchmark")
    parser.add_argument("--port", type=int, default=0, help="0: a free port")
    parser.add_argument("--json", help="also write the figures as JSON here")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the temporary folder (kept anyway on failure)")
    args = parser.parse_args()
    if not 1 <= args.clients <= 64 or not 1 <= args.runs_per_client <= 4 or not 1 <= args.steps <= 1000:
        parser.error("bounded load only: 1-64 clients, 1-4 runs per client (the per-user limit), 1-1000 steps")

    t_start = time.monotonic()
    # Stop a little before the bound: shutting the server down and reporting take some seconds.
    hard = Deadline(args.timeout_s)
    deadline = Deadline(max(1.0, args.timeout_s - 45))
    os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"
    tmp = Path(tempfile.mkdtemp(prefix="migration-load-"))
    downloads = tmp / "downloads"
    users = [(f"load{i:02d}", secrets.token_hex(8)) for i in range(args.clients)]
    baseline_user = ("baseline", secrets.token_hex(8))
    rec = Recorder()
    stop = threading.Event()
    clients: list[LoadClient] = []
    report: dict[str, Any] = {"clients": args.clients, "runs_per_client": args.runs_per_client, "steps": args.steps,
                              "timeout_s": args.timeout_s, "tmp_dir": str(tmp), "timed_out": False, "pending": [],
                              "verification": None, "client_errors": [], "load_wall_s": 0.0, "cpu": {},
                              "http_timeout": HTTP_TIMEOUT}
    server = start_server(tmp, args.port, [*users, baseline_user])
    report["url"] = server.url
    print(f"server logs: {server.stdout_path}, {server.stderr_path}", flush=True)
    setup_error = None
    history_view: dict[str, Any] | None = None
    try:
        try:
            server.wait_ready(min(180.0, deadline.left()))
            # 1. idle baseline
            base = make_client(server.url, *baseline_user, downloads)
            meter = Meter(server.proc.pid)
            marks = {"idle_start": meter.snapshot()}
            for phase, n in (("", WARMUP_CALLS), ("idle", IDLE_CALLS)):
                for _ in range(n):
                    for endpoint, call_args in (("/history", HISTORY_ARGS), ("/export_history_csv", ("mine",))):
                        if deadline.passed():
                            raise TimeoutError("the time ran out during the idle baseline")
                        rec.call(base, endpoint, call_args, phase, deadline)
                        time.sleep(LIGHT_SLEEP_S)
            marks["idle_end"] = meter.snapshot()
            report["cpu"]["idle"] = Meter.between(marks["idle_start"], marks["idle_end"])
            print(f"idle baseline done: {len(rec.values(None, 'idle'))} calls", flush=True)
            # 2. load
            t_load = time.monotonic()
            marks["load_start"] = meter.snapshot()
            clients = [LoadClient(u, pw, server, args, rec, deadline, stop, downloads) for u, pw in users]
            for c in clients:
                c.start()
            last_note = 0.0
            while any(c.is_alive() for c in clients) and not deadline.passed():
                time.sleep(1.0)
                if time.monotonic() - last_note > 30:
                    last_note = time.monotonic()
                    done = sum(r["outcome"] is not None for c in clients for r in list(c.runs.values()))
                    print(f"  {time.monotonic() - t_load:6.0f} s: {done}/{args.clients * args.runs_per_client} runs "
                          f"finished, {len(rec.values(None, 'load'))} light calls timed, "
                          f"load average {os.getloadavg()[0]:.1f}", flush=True)
            report["load_wall_s"] = time.monotonic() - t_load
            report["cpu"]["load"] = Meter.between(marks["load_start"], meter.snapshot())
            for c in clients:
                c.collect()
            if any(c.is_alive() or c.pending() for c in clients):
                report["timed_out"] = True
                stop.set()
                report["pending"] = [line for c in clients for line in c.describe_pending()]
                report["pending"] += [f"{c.user}: thread still running" for c in clients if c.is_alive()]
            else:
                # 3a. verification through each user's own /history (the server still up)
                history_view = verify_history_view(clients, expected_labels(clients, args.runs_per_client),
                                                   deadline, rec)
        except Exception as exc:  # noqa: BLE001 - reported as the reason of the failure
            setup_error = f"{type(exc).__name__}: {exc}"
            report["timed_out"] = report["timed_out"] or isinstance(exc, TimeoutError)
            if clients:
                stop.set()
                report["pending"] = [line for c in clients for line in c.describe_pending()]
    finally:
        stop.set()
        server.close()
    # 3b. verification from the database, once the server is down (unfinished jobs: interrupted)
    if clients and server.db.exists():
        try:
            report["verification"] = {**verify_db(server.db, expected_labels(clients, args.runs_per_client)),
                                      **(history_view or {})}
        except sqlite3.Error as exc:
            setup_error = (setup_error + "; " if setup_error else "") + f"history DB unreadable: {exc}"

    # -- figures --
    outcomes = [r for c in clients for r in c.runs.values()]
    submitted = len(outcomes)
    kinds = collections.Counter(r.get("kind") or r["outcome"] for r in outcomes if r["outcome"] in ("failed",
                                                                                                    "cancelled"))
    durations = [r["t_done"] - r["t_submit"] for r in outcomes if "t_done" in r]
    report["runs"] = {
        "expected": args.clients * args.runs_per_client, "submitted": submitted,
        "ok": sum(r["outcome"] == "ok" for r in outcomes), "failed": sum(r["outcome"] == "failed" for r in outcomes),
        "cancelled": sum(r["outcome"] == "cancelled" for r in outcomes),
        "no_outcome": sum(r["outcome"] is None for r in outcomes),
        "failure_kinds": dict(kinds),
        "failures": [f"{r['label']}: {r.get('headline', '')}" for r in outcomes if r["outcome"] not in ("ok", None)],
        "run_seconds": summary(durations),
        "per_run": [{k: v for k, v in r.items() if k not in ("job", "t_submit", "t_done")}
                    | {"seconds": r["t_done"] - r["t_submit"] if "t_done" in r else None} for r in outcomes],
    }
    report["latency"] = latency_report(rec)
    report["light_call_errors"] = [f"{e} ({p}): {err}" for e, p, err in rec.errors()]
    report["client_errors"] = [f"{c.user}: {c.error}" for c in clients if c.error]
    report["wall_s"] = time.monotonic() - t_start
    reasons = []
    if setup_error:
        reasons.append(setup_error)
    if report["timed_out"]:
        reasons.append("timed out")
    expected = args.clients * args.runs_per_client
    if report["runs"]["ok"] != expected:
        reasons.append(f"{report['runs']['ok']}/{expected} runs finished ok")
    v = report["verification"]
    if v is None:
        reasons.append("history not verified")
    else:
        if history_view is None:
            reasons.append("the users' /history views not checked")
        for key in ("lost_db", "duplicated_db", "wrong_user_db", "lost_history_view", "duplicated_history_view",
                    "foreign_rows_history_view"):
            if v.get(key):
                reasons.append(f"{len(v[key])} {key}")
    if report["client_errors"]:
        reasons.append(f"{len(report['client_errors'])} client error(s)")
    report["passed"] = not reasons
    report["fail_reasons"] = reasons
    report["server_log_tail"] = server_log_tail(server) if not report["passed"] else ""
    report["latency_samples"] = [{"endpoint": e, "phase": p, "seconds": s, "error": err, "at_s": at}
                                 for e, p, s, err, at in rec.samples]

    print_report(report)
    if not report["passed"]:
        print(f"\nserver log tails ({server.tmp}):\n{report['server_log_tail']}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"figures written to {args.json}")
    if report["passed"] and not args.keep_tmp:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        print(f"temporary folder kept: {tmp}")
    sys.stdout.flush()
    sys.stderr.flush()
    if hard.passed():
        print("warning: the hard time bound was exceeded while shutting down", file=sys.stderr, flush=True)
    # Client connections may still be open on a timeout: leave without waiting for their threads.
    os._exit(0 if report["passed"] else 1)


if __name__ == "__main__":
    main()
