"""The Serve tab through the launched app's API (/serve_plan, /serve_run), with gradio_client, on a server
with two users: a serving plan's rows for the batch sizes asked, a measured run labelled with its backend,
refusals that name the field, and bob attacking alice's box with bad values (none runs anything, none
answers with a traceback, none reaches alice's history)."""

from __future__ import annotations

import math
import re
import shutil
import pandas as pd
import pytest
from gradio_client.exceptions import AppError

from migration.config.forms import user_folder
from migration.hardware import GPU_SPECS
from tests.server import Server, value, wait_until
from tests.test_attacks import USERS, login_cookies
from tests.test_security_and_input import call_http
from ui.serve import PLAN_DEFAULTS, PLAN_INPUTS, RUN_DEFAULTS, RUN_INPUTS

pytestmark = pytest.mark.slow

PLAN = dict(workload="llama", preset="tiny", target="l4", precision="bf16", prompt_len=16, gen_len=8, batches="1,2")
RUN = dict(workload="transformer", preset="tiny", precision="fp32", requests=4, run_batches="1,2", prompt_min=4,
           prompt_max=8, gen_min=2, gen_max=4)
PATH_LABEL = "../../../etc/passwd"


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    server = Server(tmp_path_factory.mktemp("serve"), env={"MIGRATION_AUTH": ",".join(f"{u}:{p}" for u, p in
                                                                                        USERS.items())}, client=False)
    yield server
    server.close()


@pytest.fixture(scope="module")
def alice(box):
    return box.connect(("alice", USERS["alice"]))


@pytest.fixture(scope="module")
def bob(box):
    return box.connect(("bob", USERS["bob"]))


@pytest.fixture(scope="module")
def served(alice, bob):
    """Alice's serving plan and bob's serving run (labelled with a path), submitted together: the plan
    compiles in the CPU lane while the run measures in the GPU lane. Their outputs, as values."""
    plan = alice.submit(**PLAN | dict(n_layers=3), label="alice's plan", api_name="/serve_plan")  # the preset, deeper
    run = bob.submit(**RUN, label=PATH_LABEL, api_name="/serve_run")
    return [value(o) for o in plan.result(timeout=600)], [value(o) for o in run.result(timeout=600)]


def frame(table: dict) -> pd.DataFrame:
    return pd.DataFrame(table["data"], columns=table["headers"])


def test_a_serving_plan_has_a_row_per_batch_asked_and_is_in_the_history(alice, served):
    (status, table, latency, throughput, csv_path, checklist), _ = served
    assert "Serving plan" in status and GPU_SPECS["l4"].name in status and "not measured" in status
    # graded from the plan alone: predictions warn, what nothing showed is not checked
    assert "Serving checklist" in checklist and 'data-id="kv_headroom" data-status="warn"' in checklist
    assert 'data-id="serve_host_sync" data-status="not checked"' in checklist
    assert "n_layers=3" in status  # the model's dimensions from the form, over the preset's
    rows = frame(table)
    assert {1, 2} <= set(rows["running sequences"]) and "running sequences" in status
    assert "Engine modelled" in status
    assert {"KV cache", "predicted peak", "budget", "fits", "TTFT", "TPOT", "TPOT bandwidth limit", "throughput",
            "requests", "decode bytes / needed"} <= set(rows.columns)
    first = rows[rows["running sequences"] == 1].iloc[0]
    assert first["fits"] == "yes" and first["decode bytes / needed"].endswith("×")
    assert re.fullmatch(r"[0-9.]+ (µs|ms|s)", first["TTFT"]) and first["throughput"].endswith(" tokens/s")
    assert {"TTFT (predicted)", "TPOT (predicted)", "TPOT bandwidth limit"} <= {r[2] for r in latency["data"]}
    assert len(throughput["data"]) == len(rows)
    csv = pd.read_csv(csv_path)
    assert list(csv["batch"]) == list(rows["running sequences"])
    assert (csv["kv_cache_bytes_read"] == csv["kv_cache_bytes_compiled"]).all()
    history = frame(alice.predict("mine", "serve-plan", "all", "all", api_name="/history"))
    newest = history.iloc[0]
    assert (newest["kind"], newest["status"], newest["label"]) == ("serve-plan", "ok", "alice's plan")
    assert newest["device or target"] == GPU_SPECS["l4"].name and newest["config"].startswith("serving batch")


SYNCING = ("import jax\n\ndef serve(step, state, tokens):\n    for _ in range(8):\n"
           "        state, logits = step(state, tokens)\n        print(float(logits.sum()))\n    return state\n")


def test_the_checklist_grades_the_sessions_code_check_and_plan(box):
    """In one session (a page): the Code check tab's check of the user's serving loop grades host sync, and
    a later run is graded against the session's last plan; another session has neither."""
    page = box.connect(("alice", USERS["alice"]))
    # checked as the training job's (the default): the serving checklist does not grade from it
    summary, *_ = page.predict(SYNCING, None, api_name="/code_check")
    assert "Migrate tab's checklist" in summary
    planned = value(page.predict(**PLAN, api_name="/serve_plan")[5])
    assert 'data-id="serve_host_sync" data-status="not checked"' in planned and "SYNC001" not in planned
    summary, *_ = page.predict(SYNCING, None, "serving", api_name="/code_check")
    assert "Serve tab's checklist" in summary
    planned = value(page.predict(**PLAN, api_name="/serve_plan")[5])
    assert 'data-id="serve_host_sync" data-status="fail"' in planned and "SYNC001" in planned
    ran = value(page.predict(**RUN, api_name="/serve_run")[5])
    assert "predicted for L4" in ran and "the run was measured on" in ran  # the plan, with where the run was
    assert "SYNC001" in ran
    other = value(box.connect(("alice", USERS["alice"])).predict(**RUN, api_name="/serve_run")[5])
    assert "predicted for" not in other and "SYNC001" not in other


def test_a_serving_run_has_measured_rows_labelled_with_the_backend(box, bob, served):
    _, (status, table, latency, throughput, csv_path, checklist) = served
    assert "Serving run" in status and "CPU figures" in status
    # bob has no plan in his session: the run on the CPU backend warns, and says it is not a planned GPU
    assert 'data-id="kv_headroom" data-status="warn"' in checklist and "not on a GPU planned for" in checklist
    rows = frame(table)
    assert list(rows["batch"]) == [1, 2] and (rows["compiles after warm-up"] == "0").all()
    assert all(t.endswith(" tokens/s") and not t.startswith("0 ") for t in rows["throughput"])
    assert all("cpu backend" in m and "CPU figures" in m for m in rows["measured on"])
    assert all("RSS" in p for p in rows["peak memory"])  # the CPU backend's peak: the process's
    assert {"TTFT p50 (cpu)", "TPOT p90 (cpu)"} <= {r[2] for r in latency["data"]}
    assert {r[2] for r in throughput["data"]} == {"measured (cpu backend)"}
    csv = pd.read_csv(csv_path)
    assert list(csv["batch"]) == [1, 2] and set(csv["backend"]) == {"cpu"}
    # The label is text: the CSV went to bob's own exports folder, under a name this server chose.
    written = list((box.cache / "exports").rglob("serve-run-*.csv"))
    assert len([p for p in written if p.parent.name == user_folder("bob")]) == 1  # alice's runs: in her folder
    assert {p.parent.parent for p in written} == {box.cache / "exports"} and not any("passwd" in str(p) for p in written)
    history = frame(bob.predict("mine", "serve-run", "all", "all", api_name="/history"))
    assert (history.iloc[0]["status"], history.iloc[0]["label"]) == ("ok", PATH_LABEL)
    assert history.iloc[0]["throughput"].endswith(" tokens/s") and not history.iloc[0]["throughput"].startswith("0 ")
    csv = pd.read_csv(value(bob.predict("mine", api_name="/export_history_csv")))
    assert list(csv["kind"]) == ["serve-run"]  # bob's own, none of alice's


REFUSED = [
    ("/serve_plan", PLAN | dict(prompt_len=60, gen_len=10), "gen_len", "exceed the model's context"),
    ("/serve_run", RUN | dict(prompt_max=40, gen_max=40), "gen_max", "exceed the model's context"),
    ("/serve_plan", PLAN | dict(batches="0,4"), "batches", "from 1 to 4,096"),
    ("/serve_run", RUN | dict(run_batches="0"), "batches", "from 1 to 4,096"),
    ("/serve_plan", PLAN | dict(workload="mlp", precision="int8"), "workload", "has no decode path"),
    ("/serve_run", RUN | dict(workload="mlp", precision="int8"), "workload", "has no decode path"),
    ("/serve_plan", PLAN | dict(target="tpu-v5e-8"), "target", "h100-sxm"),
    ("/serve_plan", PLAN | dict(target="local"), "target", "h100-sxm"),
    ("/serve_plan", PLAN | dict(gpus=3), "gpus", "do not divide by 3"),
    ("/serve_plan", PLAN | dict(kv_cache="int4"), "kv_cache", "one of auto, fp8"),
    ("/serve_run", RUN | dict(kv_cache="fp4"), "kv_cache", "one of auto, fp8"),
    ("/serve_plan", PLAN | dict(chunk=0), "chunk", "from 16"),
    ("/serve_plan", PLAN | dict(chunk="$(reboot)"), "chunk", "whole number"),
    ("/serve_plan", PLAN | dict(mix="512:128; rm -rf /"), "mix", "is not a class"),
    ("/serve_plan", PLAN | dict(mix="1e9*5:5"), "mix", "shares above 0"),
    ("/serve_plan", PLAN | dict(mix=",".join(["8:8"] * 9)), "mix", "at most 8 classes"),
    ("/serve_plan", PLAN | dict(mix="x" * 5000), "mix", "must be text"),
    ("/serve_plan", PLAN | dict(mix="40:40"), "mix", "exceed the model's context"),
    ("/serve_plan", PLAN | dict(n_layers=-2), "n_layers", "whole number"),
    ("/serve_plan", PLAN | dict(d_model="4096; DROP TABLE"), "d_model", "whole number"),
    ("/serve_run", RUN | dict(n_heads=3), "n_heads", "must divide d_model"),
    ("/serve_run", RUN | dict(embeddings="shared"), "embeddings", "preset, tied, untied"),
]


@pytest.mark.parametrize("api,values,field,says", REFUSED, ids=[f"{a[7:]}-{f}-{i}" for i, (a, _, f, _) in
                                                                 enumerate(REFUSED)])
def test_a_refusal_names_the_field_in_one_line(alice, api, values, field, says):
    with pytest.raises(AppError) as err:
        alice.predict(**values, api_name=api)
    text = str(err.value)
    assert f"Invalid input — {field}: " in text and says in text, text
    assert "Traceback" not in text and "\n" not in text.strip()


# Bob's attempts: (endpoint, values, the field the refusal must name). None may start a job.
ATTACKS = [
    *(("/serve_plan", PLAN | {k: v}, f) for k, v, f in (
        ("label", "x" * 200_000, "label"), ("batches", "1," * 50_000, "batches"), ("workload", "A" * 100_000, "workload"),
        ("preset", "../" * 1000, "preset"), ("prompt_len", "abc", "prompt_len"), ("gen_len", "1e3", "gen_len"),
        ("memory_fraction", "most", "memory_fraction"), ("batches", ",".join(["1"] * 10_000), "batches"),
        ("batches", "../../etc/passwd", "batches"), ("target", "/etc/passwd", "target"),
        ("preset", PATH_LABEL, "preset"), ("prompt_len", -5, "prompt_len"), ("gen_len", -1, "gen_len"),
        ("memory_fraction", -0.5, "memory_fraction"), ("label", "two\nlines", "label"), ("gpus", 10**6, "gpus"),
        ("gpus", "all", "gpus"), ("kv_cache", "../../etc/passwd", "kv_cache"), ("kv_cache", "A" * 100_000, "kv_cache"))),
    *(("/serve_run", RUN | {k: v}, f) for k, v, f in (
        ("run_batches", ",".join(["1"] * 10_000), "batches"), ("requests", "ten", "requests"),
        ("requests", -3, "requests"), ("requests", 10**9, "requests"), ("seed", -1, "seed"),
        ("temperature", -1, "temperature"), ("temperature", "hot", "temperature"), ("gen_min", -2, "gen_min"),
        ("run_batches", "/etc/passwd", "batches"), ("run_batches", "", "batches"),
        ("memory_fraction", 2, "memory_fraction"), ("kv_cache", ["fp8"], "kv_cache"))),
]
# Non-finite numbers go by plain HTTP (gradio_client does not send them): (endpoint, parameter, value, field).
NON_FINITE = [("/serve_plan", "prompt_len", math.nan, "prompt_len"), ("/serve_plan", "gpus", math.inf, "gpus"), ("/serve_plan", "memory_fraction", math.inf,
                                                                       "memory_fraction"),
              ("/serve_run", "temperature", -math.inf, "temperature"), ("/serve_run", "requests", math.nan, "requests"),
              ("/serve_run", "memory_fraction", math.nan, "memory_fraction")]


def positional(api: str, **changes) -> list:
    """An endpoint's values in its parameters' order, the page's defaults where not given."""
    names, given = (PLAN_INPUTS, PLAN) if api == "/serve_plan" else (RUN_INPUTS, RUN)
    values = PLAN_DEFAULTS | RUN_DEFAULTS | given | changes
    return [values[name] for name in names]


def test_bob_attacking_alices_box_is_refused_field_by_field_and_reaches_nothing(box, alice, bob, served):
    alices = alice.predict("mine", "all", "all", "all", api_name="/history")["data"]
    bobs = bob.predict("mine", "all", "all", "all", api_name="/history")["data"]
    for api, values, field in ATTACKS:
        with pytest.raises(AppError) as err:
            bob.predict(**values, api_name=api)
        text = str(err.value)
        assert f"Invalid input — {field}: " in text, (api, field, text[:300])
        assert "Traceback" not in text and len(text) < 1000, (api, field)
    cookies = login_cookies(box, "bob")
    for api, name, number, field in NON_FINITE:
        event, out = call_http(box.url, api, positional(api, **{name: number}), cookies=cookies)
        assert event == "error" and f"{field}: " in str(out) and "Traceback" not in str(out), (api, field, out)
    # Nothing ran, nothing is left running, nobody's history changed; alice's stays hers.
    assert box.workers() == []
    assert bob.predict("mine", "all", "all", "all", api_name="/history")["data"] == bobs
    assert alice.predict("mine", "all", "all", "all", api_name="/history")["data"] == alices
    with pytest.raises(AppError, match="scope"):
        bob.predict("everyone", "all", "all", "all", api_name="/history")
    with pytest.raises(AppError, match="belongs to another user|not a current job"):
        bob.predict(str(alices[0][0]), api_name="/cancel_job")
    assert "Nothing of yours" in bob.predict(api_name="/serve_stop")


def test_a_run_sized_past_the_machines_memory_is_refused_before_it_allocates(box, bob):
    """Bob asks the shared box for 4,096 sequences of Llama 3.1 8B at 8,192 + 1,024 tokens (about 5 TB of KV
    cache): his worker refuses it from arithmetic, naming the field and the bytes, before the model or the
    cache is built, so the host memory the server and alice's jobs share is never pressed."""
    with pytest.raises(AppError) as err:
        bob.predict(**RUN | dict(workload="llama", preset="8b", precision="bf16", run_batches="4096", prompt_max=8192,
                                 gen_min=4, gen_max=1024, requests=4), api_name="/serve_run")
    text = str(err.value)
    assert "batches: batch 4,096 at 8,192 + 1,024 tokens needs 16.06 GB of weights" in text, text[:500]
    assert "KV cache, over the" in text and "Traceback" not in text and len(text) < 1000
    wait_until(lambda: not box.workers("serve-run"), 30, poll_s=0.2)
    failed = frame(bob.predict("mine", "serve-run", "all", "all", api_name="/history")).iloc[0]
    assert failed["status"] != "ok"


def test_stop_ends_a_serving_run_and_its_worker(box, alice):
    client = box.connect(("alice", USERS["alice"]))  # its own session: its own Stop
    job = client.submit(**RUN | dict(requests=1000, run_batches="1", prompt_max=16, gen_min=40, gen_max=48),
                        label="to stop", api_name="/serve_run")
    wait_until(lambda: box.workers("serve-run"), 120, poll_s=0.2)
    assert "Stopping job" in client.predict(api_name="/serve_stop")
    wait_until(lambda: not box.workers("serve-run"), 5, poll_s=0.1)
    wait_until(job.done, 30)

    def cancelled():
        return frame(alice.predict("mine", "serve-run", "all", "cancelled", api_name="/history"))

    wait_until(lambda: len(cancelled()), 15, 0.3)
    assert list(cancelled()["label"]) == ["to stop"]


def test_a_checkpoint_is_named_from_ones_own_folder_and_another_models_is_refused(box, alice, bob,
                                                                                  trained_llama_checkpoint):
    """Alice's trained llama/tiny, kept in her private checkpoint folder: named for another model it is
    refused naming the field; paths, and bob naming it, never reach it."""
    mine = box.cache / "checkpoints" / user_folder("alice") / "llama-trained"
    mine.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(trained_llama_checkpoint, mine)
    cases = [(alice, "/serve_plan", PLAN | dict(workload="transformer", checkpoint="llama-trained"),
              "checkpoint: the checkpoint is of another model: llama/tiny"),
             (alice, "/serve_run", RUN | dict(checkpoint="llama-trained"),
              "checkpoint: the checkpoint is of another model: llama/tiny"),
             (alice, "/serve_plan", PLAN | dict(checkpoint=f"/{mine.name}"), "absolute paths are not allowed"),
             (alice, "/serve_run", RUN | dict(checkpoint="../x/llama-trained"), "'..' is not allowed"),
             (bob, "/serve_plan", PLAN | dict(checkpoint="llama-trained"), "no checkpoint named 'llama-trained'"),
             (bob, "/serve_run", RUN | dict(checkpoint="/etc"), "absolute paths are not allowed")]
    for client, api, values, says in cases:
        with pytest.raises(AppError) as err:
            client.predict(**values, api_name=api)
        text = str(err.value)
        assert "Invalid input — checkpoint: " in text and says in text and "Traceback" not in text, (api, text)
    assert box.workers() == []
