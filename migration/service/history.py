"""Run and plan history in SQLite (stdlib, embedded, one file), kept across restarts.

Each entry stores its full JSON (a RunReport, a Plan, or a serving plan's or run's dict), its summary
(the table's columns, small, read by listings without parsing payloads) and a few indexed columns for
filters, with the user who made it. A job is recorded when it is submitted (`open_entry`, status
`queued`), marked `running`, and completed in place; entries a stopped server left `queued` or
`running` are marked `interrupted` when the next server opens the store (`interrupt_unfinished`), so
nothing is lost silently.

Connections are opened per call (safe from a server's threads); WAL journaling lets readers
proceed while a run is written; every write is one transaction, so a failed write (disk full, an
unwritable file, the configured size cap) changes nothing already stored and raises HistoryError
with one line a person can act on.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from migration.common import write_csv
from migration.planning.compare import summary as comparison_summary
from migration.results import Plan, RunReport

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,            -- KINDS
    created_at TEXT NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    workload TEXT NOT NULL,
    preset TEXT NOT NULL,
    status TEXT NOT NULL,
    payload TEXT NOT NULL          -- the RunReport, Plan or serving result as JSON
);
CREATE INDEX IF NOT EXISTS entries_kind ON entries(kind, id);
"""
# Columns added since the first schema: (name, definition). Added in place to older stores.
ADDED_COLUMNS = (("user", "TEXT NOT NULL DEFAULT ''"), ("summary", "TEXT"), ("payload_bytes", "INTEGER"))

KINDS = ("run", "plan", "serve-plan", "serve-run")  # training runs and plans; serving plans and measured runs
SERVING_KINDS = ("serve-plan", "serve-run")
UNFINISHED = ("queued", "running")
STATUSES = ("queued", "running", "ok", "failed", "cancelled", "infeasible", "interrupted")

# Columns of the history table (and the first CSV columns), with units in the names.
SUMMARY_COLUMNS = [
    "id", "kind", "created_at", "user", "label", "workload", "preset", "status", "precision", "remat",
    "per_device_batch", "devices", "accumulation_steps", "global_batch", "device_kind", "backend",
    "step_ms_median", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "peak_memory_source",
    "predicted_peak_bytes",
    "compile_s", "recompilations", "prediction_method", "target",
]
# What only an entry's owner sees: the worker's output, messages that may quote paths, checkpoint
# folders, the run's environment and config (profile folders), the request as typed.
OWNER_ONLY_FIELDS = frozenset({"stderr_tail", "message", "checkpoint_restored", "checkpoint_saved", "env", "config",
                               "profile", "request", "host"})
EXPORT_MAX_ROWS = 2000  # newest entries in one CSV export (the server parses each one)
_STORED = ("id", "kind", "created_at", "user", "label", "workload", "preset", "status")


class HistoryError(RuntimeError):
    """The history could not be read or written; `str()` is one line saying why and what to do."""


class History:
    def __init__(self, path: str | Path, max_bytes: int | None = None):
        """`max_bytes` caps the store's size (SQLite's max_page_count): past it, writes fail as on a
        full disk, with nothing already stored changed."""
        self.path = Path(path)
        self.max_bytes = max_bytes
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._connect() as db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)
                have = {row["name"] for row in db.execute("PRAGMA table_info(entries)")}
                for name, definition in ADDED_COLUMNS:
                    if name not in have:
                        db.execute(f"ALTER TABLE entries ADD COLUMN {name} {definition}")
                db.execute("CREATE INDEX IF NOT EXISTS entries_user ON entries(user, id)")
                # Sizes of entries written before they were stored, once (quotas read the column alone).
                db.execute("UPDATE entries SET payload_bytes = LENGTH(payload) WHERE payload_bytes IS NULL")
                # Summaries of entries written before they were stored, once.
                for row in db.execute("SELECT id, kind, payload FROM entries WHERE summary IS NULL").fetchall():
                    summary = _summary_of(row["kind"], json.loads(row["payload"]))
                    db.execute("UPDATE entries SET summary = ? WHERE id = ?", (json.dumps(summary), row["id"]))
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(_why(exc, f"cannot open the history at {self.path}")) from exc

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        db.row_factory = sqlite3.Row
        try:
            if self.max_bytes:
                page = db.execute("PRAGMA page_size").fetchone()[0]
                db.execute(f"PRAGMA max_page_count={max(2, int(self.max_bytes) // page)}")
            with db:  # one transaction: committed on success, rolled back on any error
                yield db
        finally:
            db.close()

    @contextlib.contextmanager
    def _write(self, what: str) -> Iterator[sqlite3.Connection]:
        try:
            with self._connect() as db:
                yield db
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(_why(exc, f"could not record {what}")) from exc

    def _read(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        try:
            with self._connect() as db:
                return db.execute(sql, args).fetchall()
        except (sqlite3.Error, OSError) as exc:
            raise HistoryError(_why(exc, "could not read the history")) from exc

    # -- writing -----------------------------------------------------------------------------------

    def _insert(self, kind: str, workload: str, preset: str, status: str, payload: dict[str, Any], label: str,
                user: str) -> int:
        with self._write(f"the {kind}") as db:
            text = json.dumps(payload)
            cur = db.execute(
                "INSERT INTO entries (kind, created_at, label, workload, preset, status, payload, user, summary, "
                "payload_bytes) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (kind, time.strftime("%Y-%m-%d %H:%M:%S"), label, workload, preset, status, text,
                 user, json.dumps(_summary_of(kind, payload)), len(text)),
            )
            return int(cur.lastrowid)

    def add_run(self, report: RunReport, label: str = "", user: str = "") -> int:
        return self._insert("run", report.workload, report.preset, report.status, report.to_dict(), label, user)

    def add_plan(self, plan: Plan, label: str = "", user: str = "") -> int:
        return self._insert("plan", plan.workload, plan.preset, plan.status, plan.to_dict(), label, user)

    def open_entry(self, kind: str, workload: str, preset: str, payload: dict[str, Any], label: str = "",
                   user: str = "") -> int:
        """Record a submitted job before it starts (status `queued`); complete it with `complete`."""
        return self._insert(kind, workload, preset, "queued", payload, label, user)

    def set_status(self, entry_id: int, status: str, message: str | None = None) -> None:
        """Change an unfinished entry's status (running, or a final one without a result, such as
        cancelled while queued); `message` goes into its payload."""
        with self._write(f"entry {entry_id}") as db:
            row = db.execute("SELECT kind, payload FROM entries WHERE id = ?", (entry_id,)).fetchone()
            if row is None:
                return
            payload = json.loads(row["payload"])
            if message is not None:
                payload["message"] = message
            payload["status"] = status
            text = json.dumps(payload)
            db.execute("UPDATE entries SET status = ?, payload = ?, summary = ?, payload_bytes = ? WHERE id = ?",
                       (status, text, json.dumps(_summary_of(row["kind"], payload)), len(text), entry_id))

    def complete(self, entry_id: int, result: RunReport | Plan) -> None:
        """Store a job's result in the entry opened for it."""
        payload = result.to_dict()
        kind = "plan" if isinstance(result, Plan) else "run"
        text = json.dumps(payload)
        with self._write(f"the {kind} (entry {entry_id})") as db:
            db.execute("UPDATE entries SET status = ?, payload = ?, summary = ?, workload = ?, preset = ?, "
                       "payload_bytes = ? WHERE id = ?", (result.status, text, json.dumps(_summary_of(kind, payload)),
                                                          result.workload, result.preset, len(text), entry_id))

    def complete_serving(self, entry_id: int, status: str, payload: dict[str, Any]) -> None:
        """Store a serving job's end in the entry opened for it: its result (a serving plan's or run's
        dict) or its failure, with `status` (ok, infeasible, failed)."""
        if status not in STATUSES:
            raise ValueError(f"unknown status {status!r}")
        payload = {**payload, "status": status}
        text = json.dumps(payload)
        with self._write(f"entry {entry_id}") as db:
            row = db.execute("SELECT kind FROM entries WHERE id = ?", (entry_id,)).fetchone()
            if row is None:
                return
            db.execute("UPDATE entries SET status = ?, payload = ?, summary = ?, payload_bytes = ? WHERE id = ?",
                       (status, text, json.dumps(_summary_of(row["kind"], payload)), len(text), entry_id))

    def interrupt_unfinished(self, message: str) -> list[int]:
        """Mark every entry still `queued` or `running` as `interrupted` (a stopped server's jobs)."""
        with self._write("the interrupted jobs") as db:
            rows = db.execute(f"SELECT id FROM entries WHERE status IN ({','.join('?' * len(UNFINISHED))})",
                              UNFINISHED).fetchall()
        ids = [int(r["id"]) for r in rows]
        for entry_id in ids:
            self.set_status(entry_id, "interrupted", message)
        return ids

    # -- reading -----------------------------------------------------------------------------------

    def entries(self, kind: str | None = None, workload: str | None = None, status: str | None = None,
                ids: list[int] | None = None, user: str | None = None, limit: int = 1000,
                payload: bool = True) -> list[dict[str, Any]]:
        """Entries newest first as flat summary dicts (SUMMARY_COLUMNS), plus `payload` (the full
        report or plan) unless `payload=False` (listings: the summary alone is much cheaper)."""
        where, args = [], []
        for column, value in (("kind", kind), ("workload", workload), ("status", status), ("user", user)):
            if value is not None and value != "":
                where.append(f"{column} = ?")
                args.append(value)
        if ids is not None:
            if not ids:
                return []
            where.append(f"id IN ({','.join('?' * len(ids))})")
            args.extend(int(i) for i in ids)
        columns = "*" if payload else ", ".join((*_STORED, "summary"))
        sql = f"SELECT {columns} FROM entries" + (" WHERE " + " AND ".join(where) if where else "") \
            + " ORDER BY id DESC LIMIT ?"
        return [_row(dict(r)) for r in self._read(sql, (*args, int(limit)))]

    def usage(self, user: str) -> tuple[int, int]:
        """(entries, bytes of their payloads) that `user` holds."""
        [(rows, nbytes)] = self._read("SELECT COUNT(*), COALESCE(SUM(payload_bytes), 0) FROM entries WHERE user = ?",
                                      (user,))
        return int(rows), int(nbytes)

    def worker_seconds_since(self, since: str) -> dict[str, float]:
        """user -> seconds of worker time recorded since `since` (runs' wall time, plans' search time)."""
        rows = self._read("SELECT user, COALESCE(SUM(COALESCE(json_extract(payload, '$.wall_s'), 0) + "
                          "COALESCE(json_extract(payload, '$.search_seconds'), 0)), 0) FROM entries "
                          "WHERE created_at >= ? GROUP BY user", (since,))
        return {user: float(seconds) for user, seconds in rows}

    def prune(self, older_than_days: float, user: str | None = None) -> int:
        """Delete finished entries older than `older_than_days` (of `user`, or everyone's); returns how many."""
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() - older_than_days * 86400))
        where, args = "created_at <= ? AND status NOT IN ('queued', 'running')", [since]
        if user is not None:
            where, args = where + " AND user = ?", [*args, user]
        with self._write("the pruning") as db:
            removed = db.execute(f"DELETE FROM entries WHERE {where}", args).rowcount
        with contextlib.closing(sqlite3.connect(self.path)) as db:
            db.execute("VACUUM")
        return int(removed)

    def users(self) -> list[str]:
        return [r[0] for r in self._read("SELECT DISTINCT user FROM entries ORDER BY user")]

    def run_report(self, entry_id: int) -> RunReport | None:
        found = self.entries(kind="run", ids=[entry_id])
        if not found:
            return None
        try:
            return RunReport(**found[0]["payload"])
        except TypeError:  # a job that never produced a report (cancelled while queued, interrupted)
            return None

    def integrity(self) -> str:
        """SQLite's own integrity check: "ok" when the store is undamaged."""
        return str(self._read("PRAGMA integrity_check")[0][0])

    def to_csv(self, ids: list[int] | None = None, path: str | Path | None = None, user: str | None = None,
               viewer: str | None = None, limit: int = EXPORT_MAX_ROWS) -> str:
        """One row per entry (the newest `limit`): the summary columns first, then every other scalar
        field of the run or plan. Cells a spreadsheet would evaluate are neutralised. With `viewer`,
        entries of other users lose what is private to their owner (`redacted`)."""
        entries = self.entries(ids=ids, user=user, limit=limit)
        rows = []
        for e in entries:
            payload = e["payload"] if viewer is None else redacted(e, viewer)["payload"]
            row = {k: e.get(k) for k in SUMMARY_COLUMNS}
            for k, v in payload.items():
                if k not in row and not isinstance(v, (list, dict)):
                    row[k] = v
            if isinstance(payload.get("comparison"), dict) and payload["comparison"]:
                row.update(comparison_summary(payload["comparison"]))  # a plan: the TPU job beside it
            rows.append(row)
        fields = list(SUMMARY_COLUMNS)
        for row in rows:
            fields.extend(k for k in row if k not in fields)
        return write_csv(rows, fields, path)


def redacted(entry: dict[str, Any], viewer: str) -> dict[str, Any]:
    """`entry` as another user may see it: without its owner's paths, messages and worker output."""
    if entry.get("user", "") == viewer or "payload" not in entry:
        return entry
    payload = {k: v for k, v in entry["payload"].items() if k not in OWNER_ONLY_FIELDS}
    return {**entry, "payload": payload}


def _summary_of(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """The table's columns of one entry, from its payload (a report, a plan, or a queued job's
    `config`)."""
    source = {**payload.get("config", {}), **payload}
    if kind in SERVING_KINDS:
        source.update(_serving_figures(kind, payload))
    out = {c: source.get(c) for c in SUMMARY_COLUMNS if c not in _STORED}
    if kind == "plan":
        out["devices"] = source.get("gpus")
        out["device_kind"] = source.get("target_name")
    return out


def _serving_figures(kind: str, payload: dict[str, Any]) -> dict[str, Any]:
    """A serving result's line in the table: its one GPU and precision; for a plan, the largest batch
    that fits with its predicted peak and tokens/s; for a run, the batch measured fastest with its
    tokens/s, the largest peak measured, the compiles after the warm-up, and where. Only what the
    payload has (a queued job's `config` stays as it was)."""
    rows = [r for r in payload.get("rows") or [] if isinstance(r, dict)]
    request = payload.get("request") if isinstance(payload.get("request"), dict) else {}
    out: dict[str, Any] = {"devices": 1, "precision": request.get("precision")}
    if kind == "serve-plan":
        largest = [r for r in rows if r.get("batch") == payload.get("largest_batch")]
        out |= {"target": request.get("target"), "device_kind": payload.get("target"),
                "prediction_method": "compiled-for-target" if rows else None,
                "per_device_batch": payload.get("largest_batch")}
        if largest:
            out |= {"predicted_peak_bytes": largest[0].get("predicted_peak_bytes"),
                    "tokens_per_s": largest[0].get("tokens_per_s_per_gpu")}
        return {k: v for k, v in out.items() if v is not None}
    out |= {"backend": payload.get("backend"), "device_kind": payload.get("device_kind"),
            "recompilations": payload.get("recompiles")}
    measured = [r for r in rows if isinstance(r.get("tokens_per_s"), (int, float))]
    if measured:
        best = max(measured, key=lambda r: r["tokens_per_s"])
        peaks = [r["peak_memory_bytes"] for r in rows if isinstance(r.get("peak_memory_bytes"), (int, float))]
        out |= {"per_device_batch": best.get("batch"), "tokens_per_s": best["tokens_per_s"],
                "peak_memory_bytes": max(peaks) if peaks else None}
    return {k: v for k, v in out.items() if v is not None}


def _row(row: dict[str, Any]) -> dict[str, Any]:
    payload_text = row.pop("payload", None)
    summary_text = row.pop("summary", None)
    payload = json.loads(payload_text) if payload_text is not None else None
    summary = json.loads(summary_text) if summary_text else {}
    out = {**summary, **row}
    if payload is not None:
        out["payload"] = payload
    return out


def _why(exc: BaseException, what: str) -> str:
    text = str(exc).strip() or type(exc).__name__
    hint = ""
    if "full" in text.lower():
        hint = " — the disk or the history's size limit is full; free space or raise --history-max-mb"
    elif "readonly" in text.lower() or "read-only" in text.lower() or "permission" in text.lower():
        hint = " — the history file or its folder is not writable by the server's user"
    return f"history: {what} ({text}){hint}; nothing already stored was changed"
