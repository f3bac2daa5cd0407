"""The SQLite history: jobs recorded from submission, users, interrupted jobs, old stores, a full
store (a real SQLite size cap: the same error as a full disk), spreadsheet-safe CSV."""

import io
import json
import sqlite3

import pandas as pd
import pytest

from migration.config.requests import RunConfig
from migration.service.history import History, HistoryError
from migration.results import RunReport


def report(status="ok", message="", **events):
    cfg = RunConfig(workload="mlp", preset="tiny", steps=3, warmup_steps=1)
    evs = [{"event": "step", "index": i, "loss": 1.0 - 0.1 * i, "step_ms": 2.0} for i in range(3)]
    return RunReport.from_events(cfg, evs, status=status, message=message)


def test_a_job_is_recorded_when_submitted_then_completed_in_place(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry = h.open_entry("run", "mlp", "tiny", {"config": {"per_device_batch": 8, "steps": 3}}, label="mine",
                         user="alice")
    [queued] = h.entries(payload=False)
    assert (queued["status"], queued["user"], queued["per_device_batch"]) == ("queued", "alice", 8)
    h.set_status(entry, "running")
    h.complete(entry, report())
    [done] = h.entries()
    assert done["id"] == entry and done["status"] == "ok" and done["payload"]["losses"] == [1.0, 0.9, 0.8]
    assert h.run_report(entry).losses == [1.0, 0.9, 0.8]


def test_unfinished_jobs_are_marked_interrupted_and_finished_ones_kept(tmp_path):
    h = History(tmp_path / "h.sqlite")
    finished = h.add_run(report(), user="bob")
    queued = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="bob")
    running = h.open_entry("plan", "mlp", "tiny", {"config": {}}, user="alice")
    h.set_status(running, "running")
    assert sorted(History(tmp_path / "h.sqlite").interrupt_unfinished("interrupted: server stopped")) == \
        sorted([queued, running])
    status = {e["id"]: (e["status"], e["payload"].get("message")) for e in h.entries()}
    assert status[finished] == ("ok", "")
    assert status[queued] == status[running] == ("interrupted", "interrupted: server stopped")


def test_entries_filter_by_user(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(), user="alice")
    h.add_run(report(), user="bob")
    assert [e["user"] for e in h.entries(user="alice")] == ["alice"]
    assert len(h.entries()) == 2 and h.users() == ["alice", "bob"]


def test_a_store_written_before_users_and_summaries_opens_and_reads(tmp_path):
    path = tmp_path / "old.sqlite"
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE entries (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
        created_at TEXT NOT NULL, label TEXT NOT NULL DEFAULT '', workload TEXT NOT NULL, preset TEXT NOT NULL,
        status TEXT NOT NULL, payload TEXT NOT NULL);""")
    db.execute("INSERT INTO entries (kind, created_at, workload, preset, status, payload) VALUES (?,?,?,?,?,?)",
               ("run", "2026-11-01 10:00:00", "mlp", "tiny", "ok", json.dumps(report().to_dict())))
    db.commit()
    db.close()
    [old] = History(path).entries(payload=False)
    assert old["user"] == "" and old["per_device_batch"] == 8 and old["status"] == "ok"


def test_a_full_store_refuses_the_write_in_one_line_and_keeps_what_it_had(tmp_path):
    h = History(tmp_path / "h.sqlite", max_bytes=64 * 1024)
    stored = 0
    with pytest.raises(HistoryError) as err:
        for _ in range(1000):
            h.add_run(report(message="x" * 8000))
            stored += 1
    assert "full" in str(err.value) and "nothing already stored was changed" in str(err.value)
    assert "\n" not in str(err.value)
    assert stored >= 2 and len(h.entries(payload=False)) == stored and h.integrity() == "ok"
    # A new connection reads everything that was stored before the refusal.
    assert len(History(tmp_path / "h.sqlite").entries()) == stored


def test_an_unopenable_store_is_a_clear_error(tmp_path):
    (tmp_path / "not-a-db.sqlite").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(HistoryError, match="cannot open the history"):
        History(tmp_path / "not-a-db.sqlite")


def test_csv_neutralises_formulas_in_labels(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(), label='=HYPERLINK("http://evil.example","x")')
    frame = pd.read_csv(io.StringIO(h.to_csv()))
    assert frame.loc[0, "label"] == '\'=HYPERLINK("http://evil.example","x")'
    assert list(frame.columns[:6]) == ["id", "kind", "created_at", "user", "label", "workload"]
