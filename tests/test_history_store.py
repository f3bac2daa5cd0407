"""The history store through its public API, on a real SQLite file: what each kind of entry keeps and
shows, the filters, one user's entries against another's, pruning by age, usage and worker-time sums,
the CSV export row by row, and the one-line errors of a full, read-only or unopenable store.

The store stamps `created_at` itself (local time, to the second). Tests that need older entries write
them through the store and then set that column with a plain SQL UPDATE on the same file."""

import csv
import io
import json
import re
import sqlite3
import time

import pytest

from migration.config.requests import RunConfig
from migration.results import Decision, Plan, RunReport
from migration.service.history import History, HistoryError, redacted

STAMP = "%Y-%m-%d %H:%M:%S"
FULL_HINT = " — the disk or the history's size limit is full; free space or raise --history-max-mb"
READONLY_HINT = " — the history file or its folder is not writable by the server's user"
UNCHANGED = "; nothing already stored was changed"


def report(status="ok", message="", wall_s=None, **finished) -> RunReport:
    cfg = RunConfig(workload="mlp", preset="tiny", steps=3, warmup_steps=1, precision="bf16", per_device_batch=16,
                    accumulation_steps=2)
    evs = [{"event": "started", "backend": "cpu", "device_kind": "cpu"},
           {"event": "compiled", "compile_s": 1.5},
           *({"event": "step", "index": i, "loss": 1.0 - 0.1 * i, "step_ms": 2.0} for i in range(3)),
           {"event": "finished", **finished}]
    return RunReport.from_events(cfg, evs, status=status, message=message, wall_s=wall_s,
                                 stderr_tail="Traceback in /home/alice/job.py", started_at="2026-11-30 09:00:00")


def plan(status="ok", workload="mlp", preset="tiny", search_seconds=2.5, **fields) -> Plan:
    values = dict(
        status=status, workload=workload, preset=preset, source="v4-8", source_name="TPU v4-8", source_devices=4,
        source_per_core_batch=8, source_precision="bf16", target="h100", target_name="NVIDIA H100 80GB", gpus=8,
        memory_fraction=0.9, safety_margin=0.1, budget_bytes=70 * 10**9, device_memory_bytes=80 * 10**9,
        budget_source="spec", per_device_batch=32, accumulation_steps=1, global_batch=256, requested_global_batch=256,
        global_batch_exact=True, precision="bf16", remat="none", remat_chosen_by="search",
        predicted_peak_bytes=12_000_000, predicted_step_s=0.25, prediction_method="compiled-for-target",
        prediction_note="", param_count=1000, compiles=4, cache_hits=1, search_seconds=search_seconds,
        max_batch_by_remat={"none": 64}, candidates=[16, 32], ranked=[], table=[], rule_of_thumb_batch=32,
        rule_of_thumb_note="", tpu_setup_on_target={}, source_tpu_compile={}, matmul_precision={},
        environment={}, decisions=[Decision("batch", 32, "fits")], message="")
    values.update(fields)
    return Plan(**values)


def serve_request(precision="bf16") -> dict:
    return {"workload": "transformer", "preset": "small", "precision": precision, "target": "h100", "gpus": 1}


def set_created(path, entry_id, stamp):
    with sqlite3.connect(path) as db:
        db.execute("UPDATE entries SET created_at = ? WHERE id = ?", (stamp, entry_id))
    db.close()


def ago(seconds):
    return time.strftime(STAMP, time.localtime(time.time() - seconds))


def read_csv(text):
    return list(csv.DictReader(io.StringIO(text)))


def make_read_only(path):
    """Mark the file as written by a newer SQLite: SQLite then opens it for reading only."""
    data = bytearray(path.read_bytes())
    data[18] = 3  # the file format's write version
    path.write_bytes(bytes(data))


# -- what is stored and read back ---------------------------------------------------------------------------


def test_a_run_is_read_back_with_its_columns_and_full_report(tmp_path):
    h = History(tmp_path / "h.sqlite")
    r = report(wall_s=4.0, step_ms_median=2.0, samples_per_s=4000.0, tokens_per_s=12.5, mfu=0.31,
               peak_memory_bytes=123456, predicted_peak_bytes=120000, recompilations=0)
    before = time.time()
    entry_id = h.add_run(r, label="first try", user="alice")
    [e] = h.entries()
    created = time.mktime(time.strptime(e.pop("created_at"), STAMP))
    assert before - 2 <= created <= time.time() + 1
    payload = e.pop("payload")
    assert e == {
        "id": entry_id, "kind": "run", "user": "alice", "label": "first try", "workload": "mlp", "preset": "tiny",
        "status": "ok", "precision": "bf16", "remat": "none", "per_device_batch": 16, "devices": 1,
        "accumulation_steps": 2, "global_batch": 32, "device_kind": "cpu", "backend": "cpu", "step_ms_median": 2.0,
        "samples_per_s": 4000.0, "tokens_per_s": 12.5, "mfu": 0.31, "peak_memory_bytes": 123456,
        "peak_memory_source": None, "predicted_peak_bytes": 120000, "compile_s": 1.5, "recompilations": 0, "prediction_method": None,
        "target": None, "payload_bytes": len(json.dumps(r.to_dict()))}
    assert payload == json.loads(json.dumps(r.to_dict()))
    assert h.run_report(entry_id) == r


def test_a_listing_without_payloads_has_the_same_columns(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(tokens_per_s=9.0), label="x", user="bob")
    [full] = h.entries()
    [listed] = h.entries(payload=False)
    assert "payload" not in listed
    del full["payload"], full["payload_bytes"]
    assert listed == full


def test_a_plan_shows_its_gpus_and_target_as_the_device_columns(tmp_path):
    h = History(tmp_path / "h.sqlite")
    p = plan()
    entry_id = h.add_plan(p, label="to h100", user="carol")
    [e] = h.entries()
    assert (e["id"], e["kind"], e["label"], e["user"], e["status"]) == (entry_id, "plan", "to h100", "carol", "ok")
    assert (e["workload"], e["preset"], e["precision"], e["remat"]) == ("mlp", "tiny", "bf16", "none")
    assert (e["devices"], e["device_kind"], e["target"]) == (8, "NVIDIA H100 80GB", "h100")
    assert (e["per_device_batch"], e["accumulation_steps"], e["global_batch"]) == (32, 1, 256)
    assert (e["predicted_peak_bytes"], e["prediction_method"]) == (12_000_000, "compiled-for-target")
    assert e["backend"] is None and e["step_ms_median"] is None
    assert Plan.from_dict(e["payload"]) == p
    # a plan is not a run
    assert h.run_report(entry_id) is None


def test_an_infeasible_plan_is_listed_as_infeasible(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_plan(plan(status="infeasible", message="nothing fits"), user="carol")
    [e] = h.entries(status="infeasible")
    assert e["status"] == "infeasible" and e["payload"]["message"] == "nothing fits"


def test_a_queued_job_shows_its_config_until_its_own_fields_say_otherwise(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("run", "cnn", "small", {"config": {"per_device_batch": 8, "precision": "fp32",
                                                               "devices": 2}, "precision": "bf16"},
                            label="queued one", user="dave")
    [e] = h.entries(payload=False)
    assert (e["id"], e["kind"], e["workload"], e["preset"], e["status"]) == (entry_id, "run", "cnn", "small", "queued")
    assert (e["per_device_batch"], e["devices"], e["precision"], e["label"]) == (8, 2, "bf16", "queued one")


def test_set_status_changes_the_status_and_records_the_message(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("run", "mlp", "tiny", {"config": {"per_device_batch": 4}}, user="erin")
    h.set_status(entry_id, "running")
    [e] = h.entries()
    assert e["status"] == e["payload"]["status"] == "running" and "message" not in e["payload"]
    assert e["per_device_batch"] == 4
    h.set_status(entry_id, "cancelled", "cancelled while queued by erin")
    [e] = h.entries()
    assert e["status"] == "cancelled" and e["payload"]["message"] == "cancelled while queued by erin"
    assert e["payload"]["config"] == {"per_device_batch": 4} and e["per_device_batch"] == 4
    assert h.usage("erin") == (1, len(json.dumps(e["payload"])))
    # a later status without a message keeps the message
    h.set_status(entry_id, "failed")
    [e] = h.entries()
    assert e["status"] == "failed" and e["payload"]["message"] == "cancelled while queued by erin"
    assert h.run_report(entry_id) is None  # no report was ever made


def test_set_status_of_an_unknown_entry_changes_nothing(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="erin")
    h.set_status(entry_id + 1, "running", "x")
    [e] = h.entries()
    assert e["status"] == "queued" and len(h.entries()) == 1


def test_completing_a_run_stores_its_report_columns_and_size(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("run", "mlp", "", {"config": {"per_device_batch": 1}}, label="job", user="frank")
    r = report(status="failed", message="oom at step 2", tokens_per_s=3.0)
    h.complete(entry_id, r)
    [e] = h.entries()
    assert (e["status"], e["workload"], e["preset"], e["label"]) == ("failed", "mlp", "tiny", "job")
    assert (e["per_device_batch"], e["devices"], e["tokens_per_s"]) == (16, 1, 3.0)
    assert h.run_report(entry_id) == r
    assert h.usage("frank") == (1, len(json.dumps(r.to_dict())))


def test_completing_a_plan_stores_it_as_a_plan(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("plan", "mlp", "tiny", {"config": {}}, user="gina")
    p = plan(workload="cnn", preset="small")
    h.complete(entry_id, p)
    [e] = h.entries(kind="plan")
    assert (e["status"], e["workload"], e["preset"]) == ("ok", "cnn", "small")
    assert (e["devices"], e["device_kind"]) == (8, "NVIDIA H100 80GB")
    assert Plan.from_dict(e["payload"]) == p
    assert h.usage("gina") == (1, len(json.dumps(p.to_dict())))


# -- serving entries ----------------------------------------------------------------------------------------


def serve_plan_result():
    rows = [{"batch": b, "predicted_peak_bytes": 1000 * b, "tokens_per_s_per_gpu": 50.0 * b, "fits": b <= 4}
            for b in (1, 2, 4, 8)]
    return {"request": serve_request(), "target": "NVIDIA H100 80GB", "largest_batch": 4, "rows": rows,
            "wall_s": 7.0}


def test_a_serving_plan_shows_its_largest_fitting_batch(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-plan", "transformer", "small", {"request": serve_request()}, user="hana")
    [queued] = h.entries(payload=False)
    assert (queued["status"], queued["devices"], queued["precision"], queued["target"]) == \
        ("queued", 1, "bf16", "h100")
    assert queued["per_device_batch"] is None and queued["prediction_method"] is None
    result = serve_plan_result()
    h.complete_serving(entry_id, "ok", result)
    [e] = h.entries()
    assert e["status"] == "ok" and e["payload"] == {**result, "status": "ok"}
    assert (e["devices"], e["precision"], e["target"], e["device_kind"]) == (1, "bf16", "h100", "NVIDIA H100 80GB")
    assert (e["per_device_batch"], e["predicted_peak_bytes"], e["tokens_per_s"]) == (4, 4000, 200.0)
    assert e["prediction_method"] == "compiled-for-target"
    assert h.usage("hana") == (1, len(json.dumps({**result, "status": "ok"})))
    assert h.run_report(entry_id) is None


def test_an_infeasible_serving_plan_has_no_predicted_figures(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-plan", "transformer", "small", {"request": serve_request("fp32")}, user="hana")
    h.complete_serving(entry_id, "infeasible", {"request": serve_request("fp32"), "target": "NVIDIA L4",
                                                "largest_batch": 0,
                                                "rows": [{"batch": 1, "predicted_peak_bytes": 9, "fits": False,
                                                          "tokens_per_s_per_gpu": 1.0}]})
    [e] = h.entries(status="infeasible")
    assert (e["per_device_batch"], e["precision"], e["device_kind"]) == (0, "fp32", "NVIDIA L4")
    assert e["predicted_peak_bytes"] is None and e["tokens_per_s"] is None


def test_a_serving_run_shows_its_fastest_batch_and_largest_peak(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-run", "transformer", "small", {"request": serve_request()}, user="ivan")
    rows = [{"batch": 1, "tokens_per_s": 100.0, "peak_memory_bytes": 500, "recompiles": 0},
            {"batch": 4, "tokens_per_s": 300.0, "peak_memory_bytes": 900, "recompiles": 0},
            {"batch": 8, "tokens_per_s": 250.0, "peak_memory_bytes": 2000, "recompiles": 0},
            {"batch": 16, "tokens_per_s": None, "peak_memory_bytes": None, "recompiles": 0}]
    result = {"request": serve_request(), "backend": "gpu", "device_kind": "NVIDIA H200", "rows": rows,
              "recompiles": 2, "wall_s": 30.0}
    h.complete_serving(entry_id, "ok", result)
    [e] = h.entries(kind="serve-run")
    assert (e["status"], e["devices"], e["precision"], e["backend"], e["device_kind"]) == \
        ("ok", 1, "bf16", "gpu", "NVIDIA H200")
    assert (e["per_device_batch"], e["tokens_per_s"], e["peak_memory_bytes"], e["recompilations"]) == \
        (4, 300.0, 2000, 2)
    assert e["target"] is None and e["prediction_method"] is None


def test_a_serving_run_without_measured_rows_shows_no_figures(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-run", "transformer", "small", {"request": serve_request()}, user="ivan")
    h.complete_serving(entry_id, "ok", {"request": serve_request(), "backend": "gpu", "device_kind": "NVIDIA H200",
                                        "rows": [{"batch": 2, "peak_memory_bytes": 10}], "recompiles": 0})
    [e] = h.entries()
    assert e["per_device_batch"] is None and e["tokens_per_s"] is None and e["peak_memory_bytes"] is None
    assert (e["recompilations"], e["device_kind"]) == (0, "NVIDIA H200")


def test_a_failed_serving_job_keeps_its_request_and_message(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-run", "transformer", "small", {"request": serve_request("fp16")}, user="ivan")
    h.complete_serving(entry_id, "failed", {"request": serve_request("fp16"), "failure_kind": "oom",
                                            "message": "out of memory", "stderr_tail": "...", "rows": None})
    [e] = h.entries(status="failed")
    assert (e["precision"], e["devices"], e["backend"], e["per_device_batch"]) == ("fp16", 1, None, None)
    assert e["payload"]["message"] == "out of memory" and e["payload"]["status"] == "failed"


def test_a_serving_end_with_an_unknown_status_is_refused_and_changes_nothing(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-plan", "transformer", "small", {"request": serve_request()}, user="hana")
    with pytest.raises(ValueError, match="unknown status 'done'"):
        h.complete_serving(entry_id, "done", serve_plan_result())
    [e] = h.entries()
    assert e["status"] == "queued" and e["payload"] == {"request": serve_request()}


def test_a_serving_end_for_an_unknown_entry_adds_nothing(tmp_path):
    h = History(tmp_path / "h.sqlite")
    entry_id = h.open_entry("serve-plan", "transformer", "small", {"request": serve_request()}, user="hana")
    h.complete_serving(entry_id + 5, "ok", serve_plan_result())
    [e] = h.entries()
    assert e["id"] == entry_id and e["status"] == "queued"


# -- interrupted jobs ---------------------------------------------------------------------------------------


def test_interrupting_marks_only_unfinished_jobs_once(tmp_path):
    h = History(tmp_path / "h.sqlite")
    done = h.add_plan(plan(), user="a")
    failed = h.add_run(report(status="failed"), user="a")
    queued = h.open_entry("serve-run", "transformer", "small", {"request": serve_request()}, user="b")
    running = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="b")
    h.set_status(running, "running")
    assert sorted(h.interrupt_unfinished("server restarted")) == [queued, running]
    assert h.interrupt_unfinished("again") == []
    by_id = {e["id"]: e for e in h.entries()}
    assert [by_id[i]["status"] for i in (done, failed, queued, running)] == ["ok", "failed", "interrupted",
                                                                               "interrupted"]
    assert by_id[queued]["payload"]["message"] == by_id[running]["payload"]["message"] == "server restarted"
    assert by_id[queued]["precision"] == "bf16"


# -- filters ------------------------------------------------------------------------------------------------


@pytest.fixture
def mixed(tmp_path):
    h = History(tmp_path / "h.sqlite")
    ids = {
        "alice-run": h.add_run(report(), user="alice"),
        "alice-plan": h.add_plan(plan(workload="cnn"), user="alice"),
        "bob-run": h.add_run(report(status="failed"), user="bob"),
        "bob-serve": h.open_entry("serve-plan", "transformer", "small", {"request": serve_request()}, user="bob"),
        "carol-plan": h.add_plan(plan(status="infeasible"), user="carol"),
    }
    return h, ids


def test_entries_are_newest_first_and_filter_by_each_column(mixed):
    h, ids = mixed
    ordered = [ids[k] for k in ("carol-plan", "bob-serve", "bob-run", "alice-plan", "alice-run")]
    assert [e["id"] for e in h.entries()] == ordered
    assert [e["id"] for e in h.entries(kind="plan")] == [ids["carol-plan"], ids["alice-plan"]]
    assert [e["id"] for e in h.entries(workload="cnn")] == [ids["alice-plan"]]
    assert [e["id"] for e in h.entries(status="failed")] == [ids["bob-run"]]
    assert [e["id"] for e in h.entries(user="bob")] == [ids["bob-serve"], ids["bob-run"]]
    assert [e["id"] for e in h.entries(kind="run", user="alice")] == [ids["alice-run"]]
    assert [e["id"] for e in h.entries(kind="run", status="ok", workload="mlp", user="bob")] == []
    assert h.entries(user="nobody") == []


def test_empty_filters_mean_everything(mixed):
    h, ids = mixed
    assert len(h.entries(kind="", workload="", status="", user="")) == 5


def test_entries_by_id_and_limit(mixed):
    h, ids = mixed
    assert [e["id"] for e in h.entries(ids=[ids["alice-run"], ids["carol-plan"]])] == \
        [ids["carol-plan"], ids["alice-run"]]
    assert [e["id"] for e in h.entries(ids=[str(ids["bob-run"])])] == [ids["bob-run"]]
    assert h.entries(ids=[]) == []
    assert [e["id"] for e in h.entries(ids=[ids["alice-run"]], user="bob")] == []
    assert [e["id"] for e in h.entries(limit=2)] == [ids["carol-plan"], ids["bob-serve"]]
    assert [e["id"] for e in h.entries(user="alice", limit=1)] == [ids["alice-plan"]]


def test_users_lists_each_user_once_in_order(mixed):
    h, _ = mixed
    h.add_run(report(), user="alice")
    assert h.users() == ["alice", "bob", "carol"]


def test_run_report_is_none_for_what_is_not_a_finished_run(mixed):
    h, ids = mixed
    assert h.run_report(ids["alice-plan"]) is None
    assert h.run_report(ids["bob-serve"]) is None
    assert h.run_report(max(ids.values()) + 1) is None
    assert h.run_report(ids["bob-run"]).status == "failed"


# -- ownership ----------------------------------------------------------------------------------------------

PRIVATE = {"stderr_tail": "Traceback /home/alice/x.py", "message": "failed reading /data/alice",
           "checkpoint_restored": "/ckpt/a", "checkpoint_saved": "/ckpt/b", "env": {"HOME": "/home/alice"},
           "config": {"profile_dir": "/tmp/p"}, "profile": {"dir": "/tmp/p"}, "request": {"checkpoint": "/c"},
           "host": "alice-laptop"}


def test_another_user_sees_an_entry_without_its_owners_private_fields(tmp_path):
    entry = {"id": 3, "user": "alice", "label": "mine", "status": "failed", "tokens_per_s": 5.0,
             "payload": {"status": "failed", "workload": "mlp", "wall_s": 2.0, **PRIVATE}}
    original = json.loads(json.dumps(entry))
    seen = redacted(entry, "bob")
    assert seen["payload"] == {"status": "failed", "workload": "mlp", "wall_s": 2.0}
    assert {k: v for k, v in seen.items() if k != "payload"} == {k: v for k, v in entry.items() if k != "payload"}
    assert entry == original  # the stored entry itself is untouched
    assert redacted(entry, "alice") == original
    assert redacted(entry, "")["payload"] == seen["payload"]


def test_a_listing_without_payloads_is_shown_as_it_is(tmp_path):
    listed = {"id": 3, "user": "alice", "label": "mine", "status": "ok"}
    assert redacted(listed, "bob") == listed


def test_redaction_of_stored_entries_hides_only_from_others(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(status="failed", message="cannot read /home/alice/data"), user="alice")
    [e] = h.entries()
    assert redacted(e, "alice")["payload"] == e["payload"]
    seen = redacted(e, "bob")["payload"]
    assert {"message", "stderr_tail", "host", "env", "config"}.isdisjoint(seen)
    assert seen["losses"] == [1.0, 0.9, 0.8] and seen["status"] == "failed"


# -- usage and worker time ----------------------------------------------------------------------------------


def test_usage_counts_each_users_entries_and_bytes(tmp_path):
    h = History(tmp_path / "h.sqlite")
    r, p = report(), plan()
    h.add_run(r, user="alice")
    h.add_plan(p, user="alice")
    h.open_entry("run", "mlp", "tiny", {"config": {"steps": 3}}, user="bob")
    assert h.usage("alice") == (2, len(json.dumps(r.to_dict())) + len(json.dumps(p.to_dict())))
    assert h.usage("bob") == (1, len(json.dumps({"config": {"steps": 3}})))
    assert h.usage("nobody") == (0, 0)


def test_worker_seconds_sum_run_time_and_search_time_per_user_since_a_time(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    h.add_run(report(wall_s=10.0), user="alice")
    h.add_plan(plan(search_seconds=2.5), user="alice")
    old = h.add_run(report(wall_s=1000.0), user="alice")
    at_edge = h.add_run(report(wall_s=4.0), user="bob")
    h.open_entry("run", "mlp", "tiny", {"config": {}}, user="carol")  # not started: no time yet
    serve = h.open_entry("serve-run", "transformer", "small", {"request": serve_request()}, user="bob")
    h.complete_serving(serve, "ok", {"request": serve_request(), "rows": [], "wall_s": 6.0})
    since = ago(86400)
    set_created(path, old, ago(2 * 86400))
    set_created(path, at_edge, since)
    assert h.worker_seconds_since(since) == {"alice": 12.5, "bob": 10.0, "carol": 0.0}
    assert h.worker_seconds_since(ago(-3600)) == {}


# -- pruning ------------------------------------------------------------------------------------------------


def test_prune_deletes_finished_entries_older_than_the_age(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    days = 400
    old_run = h.add_run(report(), user="alice")
    old_plan = h.add_plan(plan(), user="bob")
    just_newer = h.add_run(report(), user="alice")
    old_queued = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="alice")
    old_running = h.open_entry("plan", "mlp", "tiny", {"config": {}}, user="bob")
    h.set_status(old_running, "running")
    new = h.add_run(report(), user="bob")
    for entry_id in (old_run, old_plan, old_queued, old_running):
        set_created(path, entry_id, ago(days * 86400 + 200))
    set_created(path, just_newer, ago(days * 86400 - 200))
    assert h.prune(days) == 2
    assert sorted(e["id"] for e in h.entries()) == sorted([just_newer, old_queued, old_running, new])
    assert h.integrity() == "ok"


def test_a_users_prune_leaves_other_users_entries(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    alice_old = h.add_run(report(), user="alice")
    bob_old = h.add_run(report(), user="bob")
    alice_new = h.add_run(report(), user="alice")
    for entry_id in (alice_old, bob_old):
        set_created(path, entry_id, ago(10 * 86400))
    assert h.prune(5, user="alice") == 1
    assert sorted(e["id"] for e in h.entries()) == [bob_old, alice_new]
    assert h.prune(5, user="alice") == 0
    assert h.prune(5) == 1
    assert [e["id"] for e in h.entries()] == [alice_new]


def test_prune_gives_the_space_back(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    ids = [h.add_run(report(message="x" * 20000), user="alice") for _ in range(10)]
    for entry_id in ids:
        set_created(path, entry_id, ago(3 * 86400))
    before = path.stat().st_size
    assert h.prune(1, user="alice") == 10
    assert path.stat().st_size < before / 4
    assert h.usage("alice") == (0, 0)


# -- CSV export ---------------------------------------------------------------------------------------------


def test_csv_has_a_row_per_entry_with_summary_columns_then_scalar_fields(tmp_path):
    h = History(tmp_path / "h.sqlite")
    r = report(wall_s=3.0, tokens_per_s=7.0)
    run_id = h.add_run(r, label="=1+2", user="alice")
    plan_id = h.add_plan(plan(), label="@SUM(A1)", user="bob")
    text = h.to_csv()
    header = next(csv.reader(io.StringIO(text)))
    assert header[:8] == ["id", "kind", "created_at", "user", "label", "workload", "preset", "status"]
    assert header[8:27] == ["precision", "remat", "per_device_batch", "devices", "accumulation_steps",
                            "global_batch", "device_kind", "backend", "step_ms_median", "samples_per_s",
                            "tokens_per_s", "mfu", "peak_memory_bytes", "peak_memory_source", "predicted_peak_bytes",
                            "compile_s", "recompilations", "prediction_method", "target"]
    # then the plan's own scalar fields (newest first), then the run's that the plan has not
    assert header[27:30] == ["source", "source_name", "source_devices"]
    assert header.index("message") < header.index("failure_kind") < header.index("wall_s")
    assert not {"losses", "step_ms", "env", "config", "decisions", "candidates", "ranked", "payload"} & set(header)
    assert len(header) == len(set(header))
    plan_row, run_row = read_csv(text)
    assert (plan_row["id"], plan_row["kind"], plan_row["label"], plan_row["user"]) == \
        (str(plan_id), "plan", "'@SUM(A1)", "bob")
    assert (plan_row["devices"], plan_row["device_kind"], plan_row["source"], plan_row["wall_s"]) == \
        ("8", "NVIDIA H100 80GB", "v4-8", "")
    assert (run_row["id"], run_row["kind"], run_row["label"], run_row["user"]) == (str(run_id), "run", "'=1+2", "alice")
    assert (run_row["tokens_per_s"], run_row["wall_s"], run_row["source"], run_row["precision"]) == \
        ("7.0", "3.0", "", "bf16")
    assert (run_row["host"], run_row["started_at"]) == (r.host, "2026-11-30 09:00:00")


def test_csv_neutralises_formulas_in_every_text_cell(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(status="failed", message="-cmd|' /C calc'!A0"), label="+1", user="alice")
    [row] = read_csv(h.to_csv())
    assert (row["label"], row["message"]) == ("'+1", "'-cmd|' /C calc'!A0")


def test_csv_for_another_viewer_leaves_out_the_owners_private_fields(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(status="failed", message="cannot read /home/alice"), user="alice")
    h.add_run(report(status="failed", message="cannot read /home/bob"), user="bob")
    bob_row, alice_row = read_csv(h.to_csv(viewer="bob"))
    assert (bob_row["message"], bob_row["stderr_tail"]) == ("cannot read /home/bob", "Traceback in /home/alice/job.py")
    assert (alice_row["user"], alice_row["message"], alice_row["stderr_tail"], alice_row["host"]) == \
        ("alice", "", "", "")
    assert alice_row["status"] == "failed" and alice_row["wall_s"] == ""
    # without a viewer (the owner's own export, or an admin's) nothing is left out
    bob_row, alice_row = read_csv(h.to_csv())
    assert alice_row["message"] == "cannot read /home/alice"


def test_csv_of_chosen_entries_one_user_and_a_limit(tmp_path):
    h = History(tmp_path / "h.sqlite")
    a1 = h.add_run(report(), user="alice")
    b1 = h.add_run(report(), user="bob")
    a2 = h.add_plan(plan(), user="alice")
    assert [r["id"] for r in read_csv(h.to_csv(ids=[a1, b1]))] == [str(b1), str(a1)]
    assert [r["id"] for r in read_csv(h.to_csv(user="alice"))] == [str(a2), str(a1)]
    assert [r["id"] for r in read_csv(h.to_csv(limit=1))] == [str(a2)]
    assert [r["id"] for r in read_csv(h.to_csv(ids=[b1], user="alice"))] == []


def test_csv_is_written_to_a_file_when_given_a_path(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(), user="alice")
    out = tmp_path / "export.csv"
    text = h.to_csv(path=out)
    assert out.read_text() == text and len(read_csv(text)) == 1


def test_csv_of_an_empty_history_is_its_header(tmp_path):
    text = History(tmp_path / "h.sqlite").to_csv()
    assert text.splitlines() == [text.strip()] and text.startswith("id,kind,created_at,user,label,")


# -- opening, old stores, limits, errors --------------------------------------------------------------------


def test_a_store_in_a_new_folder_is_made_and_opens_again(tmp_path):
    path = tmp_path / "a" / "b" / "h.sqlite"
    h = History(path)
    entry_id = h.add_run(report(), user="alice")
    again = History(path)
    assert [e["id"] for e in again.entries()] == [entry_id]
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_an_old_store_gains_users_sizes_and_summaries(tmp_path):
    path = tmp_path / "old.sqlite"
    run_payload, plan_payload = json.dumps(report().to_dict()), json.dumps(plan().to_dict())
    db = sqlite3.connect(path)
    db.executescript("""CREATE TABLE entries (id INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL,
        created_at TEXT NOT NULL, label TEXT NOT NULL DEFAULT '', workload TEXT NOT NULL, preset TEXT NOT NULL,
        status TEXT NOT NULL, payload TEXT NOT NULL);""")
    for kind, payload in (("run", run_payload), ("plan", plan_payload)):
        db.execute("INSERT INTO entries (kind, created_at, workload, preset, status, payload) VALUES (?,?,?,?,?,?)",
                   (kind, "2026-11-01 10:00:00", "mlp", "tiny", "ok", payload))
    db.commit()
    db.close()
    h = History(path)
    old_plan, old_run = h.entries(payload=False)
    assert (old_run["user"], old_run["per_device_batch"], old_run["precision"]) == ("", 16, "bf16")
    assert (old_plan["devices"], old_plan["device_kind"]) == (8, "NVIDIA H100 80GB")
    assert h.usage("") == (2, len(run_payload) + len(plan_payload))
    h.add_run(report(), user="alice")
    assert History(path).usage("") == (2, len(run_payload) + len(plan_payload))
    assert h.users() == ["", "alice"]


def test_a_size_limit_keeps_the_store_within_it(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path, max_bytes=96 * 1024)
    with pytest.raises(HistoryError) as err:
        for _ in range(100):
            h.add_run(report(message="y" * 6000), user="alice")
    assert str(err.value) == f"history: could not record the run (database or disk is full){FULL_HINT}{UNCHANGED}"
    stored = len(h.entries())
    assert stored >= 5
    with sqlite3.connect(path) as db:
        pages, page_size = db.execute("PRAGMA page_count").fetchone()[0], db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    assert pages * page_size <= 96 * 1024
    # the same store without the limit takes more
    History(path).add_run(report(message="y" * 6000), user="alice")
    assert len(h.entries()) == stored + 1


def test_a_result_too_large_for_the_store_leaves_the_entry_queued(tmp_path):
    h = History(tmp_path / "h.sqlite", max_bytes=64 * 1024)
    entry_id = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="alice")
    with pytest.raises(HistoryError) as err:
        h.complete(entry_id, report(message="z" * 200_000))
    assert str(err.value) == (f"history: could not record the run (entry {entry_id}) (database or disk is full)"
                              f"{FULL_HINT}{UNCHANGED}")
    plan_entry = h.open_entry("plan", "mlp", "tiny", {"config": {}}, user="alice")
    with pytest.raises(HistoryError, match=rf"^history: could not record the plan \(entry {plan_entry}\) "):
        h.complete(plan_entry, plan(prediction_note="z" * 200_000))
    with pytest.raises(HistoryError, match=rf"^history: could not record entry {entry_id} \(database or disk"):
        h.set_status(entry_id, "cancelled", "z" * 200_000)
    with pytest.raises(HistoryError, match=rf"^history: could not record entry {entry_id} \(database or disk"):
        h.complete_serving(entry_id, "failed", {"message": "z" * 200_000})
    assert [e["status"] for e in h.entries()] == ["queued", "queued"]


def test_a_read_only_store_refuses_writes_naming_the_cause(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    entry_id = h.open_entry("run", "mlp", "tiny", {"config": {}}, user="alice")
    make_read_only(path)
    cause = f" (attempt to write a readonly database){READONLY_HINT}{UNCHANGED}"
    with pytest.raises(HistoryError) as err:
        h.add_plan(plan(), user="alice")
    assert str(err.value) == "history: could not record the plan" + cause
    with pytest.raises(HistoryError) as err:
        h.set_status(entry_id, "running")
    assert str(err.value) == f"history: could not record entry {entry_id}" + cause
    with pytest.raises(HistoryError) as err:
        h.interrupt_unfinished("stopped")
    assert str(err.value) == f"history: could not record entry {entry_id}" + cause
    with pytest.raises(HistoryError) as err:
        h.prune(0)
    assert str(err.value) == "history: could not record the pruning" + cause
    with pytest.raises(HistoryError) as err:
        History(path)
    assert str(err.value) == f"history: cannot open the history at {path}" + cause
    # what it holds can still be read
    assert [e["status"] for e in h.entries()] == ["queued"] and h.usage("alice")[0] == 1


def test_a_path_under_a_file_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    path = tmp_path / "file" / "h.sqlite"
    with pytest.raises(HistoryError) as err:
        History(path)
    text = str(err.value)
    assert text.startswith(f"history: cannot open the history at {path} (") and text.endswith(UNCHANGED)
    assert "File exists" in text and "\n" not in text


def test_a_damaged_store_is_a_clear_error_on_every_read(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    h.add_run(report(), user="alice")
    path.write_bytes(b"garbage, not sqlite " * 400)
    for wal in (tmp_path / "h.sqlite-wal", tmp_path / "h.sqlite-shm"):
        wal.unlink(missing_ok=True)
    expected = f"history: could not read the history (file is not a database){UNCHANGED}"
    for read in (h.entries, lambda: h.usage("alice"), lambda: h.worker_seconds_since("2026-01-01 00:00:00"),
                 h.users, h.integrity):
        with pytest.raises(HistoryError) as err:
            read()
        assert str(err.value) == expected


def test_entries_on_a_store_are_unchanged_by_reads(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report(), user="alice")
    first = h.entries()
    h.to_csv(viewer="bob")
    assert h.entries() == first and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$", first[0]["created_at"])


def test_an_entry_made_without_a_user_or_label_is_nobodys_and_unlabelled(tmp_path):
    h = History(tmp_path / "h.sqlite")
    h.add_run(report())
    h.add_plan(plan())
    h.open_entry("run", "mlp", "tiny", {"config": {}})
    assert [(e["user"], e["label"]) for e in h.entries()] == [("", "")] * 3
    assert h.users() == [""] and h.usage("")[0] == 3


def test_a_serving_entry_without_a_request_or_measured_peaks_still_lists(tmp_path):
    h = History(tmp_path / "h.sqlite")
    failed = h.open_entry("serve-plan", "transformer", "small", {"request": serve_request()}, user="ivan")
    h.complete_serving(failed, "failed", {"failure_kind": "crashed", "message": "the worker ended without a result"})
    cpu = h.open_entry("serve-run", "transformer", "small", {"request": serve_request()}, user="ivan")
    h.complete_serving(cpu, "ok", {"request": serve_request(), "backend": "cpu", "device_kind": "cpu",
                                   "rows": [{"batch": 2, "tokens_per_s": 40.0, "peak_memory_bytes": None},
                                            {"batch": 4, "tokens_per_s": 60.0}], "recompiles": 0})
    on_cpu, no_request = h.entries()
    assert (no_request["status"], no_request["devices"], no_request["precision"]) == ("failed", 1, None)
    assert (on_cpu["per_device_batch"], on_cpu["tokens_per_s"], on_cpu["peak_memory_bytes"]) == (4, 60.0, None)


def test_listings_hold_the_newest_thousand_and_exports_the_newest_two_thousand(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    h.add_run(report(), user="alice")
    # Many entries at once: copies of the stored one, made in SQL (one transaction) to keep this fast.
    with sqlite3.connect(path) as db:
        for _ in range(11):
            db.execute("INSERT INTO entries (kind, created_at, label, workload, preset, status, payload, user, "
                       "summary, payload_bytes) SELECT kind, created_at, label, workload, preset, status, payload, "
                       "user, summary, payload_bytes FROM entries")
    db.close()
    newest = 2 ** 11
    listed = h.entries(payload=False)
    assert len(listed) == 1000 and listed[0]["id"] == newest and listed[-1]["id"] == newest - 999
    rows = read_csv(h.to_csv())
    assert len(rows) == 2000 and rows[-1]["id"] == str(newest - 1999)


def test_interrupting_jobs_in_a_damaged_store_is_a_clear_error(tmp_path):
    path = tmp_path / "h.sqlite"
    h = History(path)
    h.open_entry("run", "mlp", "tiny", {"config": {}}, user="alice")
    path.write_bytes(b"garbage, not sqlite " * 400)
    for side in (tmp_path / "h.sqlite-wal", tmp_path / "h.sqlite-shm"):
        side.unlink(missing_ok=True)
    with pytest.raises(HistoryError) as err:
        h.interrupt_unfinished("stopped")
    assert str(err.value) == f"history: could not record the interrupted jobs (file is not a database){UNCHANGED}"
