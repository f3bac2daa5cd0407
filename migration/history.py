"""Run and plan history in SQLite (stdlib, embedded, one file), kept across restarts.

Each entry stores its full JSON (a RunReport or a Plan) plus a few indexed columns for filters.
Connections are opened per call, so the store is safe to use from a server's worker threads;
WAL journaling lets readers proceed while a run is being written.
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
from migration.report import Plan, RunReport

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    kind TEXT NOT NULL,            -- 'run' or 'plan'
    created_at TEXT NOT NULL,
    label TEXT NOT NULL DEFAULT '',
    workload TEXT NOT NULL,
    preset TEXT NOT NULL,
    status TEXT NOT NULL,
    payload TEXT NOT NULL          -- the RunReport or Plan as JSON
);
CREATE INDEX IF NOT EXISTS entries_kind ON entries(kind, id);
"""

# Columns of the history table (and the first CSV columns), with units in the names.
SUMMARY_COLUMNS = [
    "id", "kind", "created_at", "label", "workload", "preset", "status", "precision", "remat",
    "per_device_batch", "devices", "accumulation_steps", "global_batch", "device_kind", "backend",
    "step_ms_median", "samples_per_s", "tokens_per_s", "mfu", "peak_memory_bytes", "predicted_peak_bytes",
    "compile_s", "recompilations", "prediction_method", "target",
]


class History:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=30)
        db.row_factory = sqlite3.Row
        try:
            with db:  # commit on success, roll back on error
                yield db
        finally:
            db.close()

    def _add(self, kind: str, workload: str, preset: str, status: str, payload: dict[str, Any], label: str) -> int:
        with self._connect() as db:
            cur = db.execute(
                "INSERT INTO entries (kind, created_at, label, workload, preset, status, payload) VALUES (?,?,?,?,?,?,?)",
                (kind, time.strftime("%Y-%m-%d %H:%M:%S"), label, workload, preset, status, json.dumps(payload)),
            )
            return int(cur.lastrowid)

    def add_run(self, report: RunReport, label: str = "") -> int:
        return self._add("run", report.workload, report.preset, report.status, report.to_dict(), label)

    def add_plan(self, plan: Plan, label: str = "") -> int:
        return self._add("plan", plan.workload, plan.preset, plan.status, plan.to_dict(), label)

    def entries(self, kind: str | None = None, workload: str | None = None, status: str | None = None,
                ids: list[int] | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """Entries newest first as flat summary dicts (SUMMARY_COLUMNS) plus `payload`."""
        where, args = [], []
        for column, value in (("kind", kind), ("workload", workload), ("status", status)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        if ids is not None:
            if not ids:
                return []
            where.append(f"id IN ({','.join('?' * len(ids))})")
            args.extend(int(i) for i in ids)
        sql = "SELECT * FROM entries" + (" WHERE " + " AND ".join(where) if where else "") + " ORDER BY id DESC LIMIT ?"
        with self._connect() as db:
            rows = db.execute(sql, (*args, int(limit))).fetchall()
        return [_summary(dict(r)) for r in rows]

    def run_report(self, entry_id: int) -> RunReport | None:
        found = self.entries(kind="run", ids=[entry_id])
        if not found:
            return None
        payload = found[0]["payload"]
        return RunReport(**payload)

    def to_csv(self, ids: list[int] | None = None, path: str | Path | None = None) -> str:
        """One row per entry: the summary columns first, then every other scalar field of the run
        or plan. Cells a spreadsheet would evaluate are neutralised."""
        entries = self.entries(ids=ids, limit=1_000_000)
        rows = []
        for e in entries:
            row = {k: e.get(k) for k in SUMMARY_COLUMNS}
            for k, v in e["payload"].items():
                if k not in row and not isinstance(v, (list, dict)):
                    row[k] = v
            rows.append(row)
        fields = list(SUMMARY_COLUMNS)
        for row in rows:
            fields.extend(k for k in row if k not in fields)
        return write_csv(rows, fields, path)

def _summary(row: dict[str, Any]) -> dict[str, Any]:
    payload = json.loads(row.pop("payload"))
    out = {**row, "payload": payload}
    for column in SUMMARY_COLUMNS:
        if column not in out:
            out[column] = payload.get(column)
    if row["kind"] == "plan":
        out["devices"] = payload.get("gpus")
        out["device_kind"] = payload.get("target_name")
    return out
