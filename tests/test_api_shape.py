"""The launched app's API as a client sees it (`view_api`): every parameter has a default, so a keyword call
names only what it changes, and every output is named by its component's label."""

import re

import pytest

gradio_client = pytest.importorskip("gradio_client")

from migration.config.forms import MODEL_DIMENSIONS  # noqa: E402
from tests.server import value  # noqa: E402

ENDPOINTS = ("/plan", "/run", "/autotune", "/code_check", "/history", "/compare", "/export_csv", "/export_history_csv",
             "/serve_plan", "/serve_run")
FORM = ["workload", "preset", "source", "global_batch", "per_core_batch", "source_precision", "target", "gpus",
        "memory_fraction", "granularity", "remat", "precision", "accumulation", "n_layers", "d_model", "n_heads",
        "n_kv_heads", "d_ff", "vocab_size", "seq_len", "embeddings", "sharding", "gpus_per_node"]


@pytest.fixture(scope="module")
def api(app_server):
    return app_server.client.view_api(return_format="dict", print_info=False)["named_endpoints"]


def test_no_parameter_is_required(api):
    required = {name: [p["parameter_name"] for p in api[name]["parameters"] if not p["parameter_has_default"]]
                for name in ENDPOINTS}
    assert required == {name: [] for name in ENDPOINTS}


def test_the_form_parameters_keep_their_names_and_order(api):
    assert [p["parameter_name"] for p in api["/plan"]["parameters"]] == [*FORM, "label", "network_gbps", "attention",
                                                                            "layer_loop", "train_tokens", "prices",
                                                                            "source_slices", "tpu_step_ms",
                                                                            "allow_fp8", "mu_dtype", "config_file"]
    assert [p["parameter_name"] for p in api["/run"]["parameters"]] == [
        "plan_file", "steps", "learning_rate", "compare_tpu", "profile", "fp32_reference", "pmap_before", "scaling",
        *FORM, "label", "save_checkpoint", "restore_checkpoint", "seed", "network_gbps",
        "attention", "layer_loop", "train_tokens", "prices", "source_slices", "tpu_step_ms",
        "allow_fp8", "mu_dtype", "config_file"]  # new fields, then the uploads that are not fields, go last
    assert [p["parameter_name"] for p in api["/autotune"]["parameters"]] == ["plan_file", "top", "timed_steps", "label"]
    assert [p["parameter_name"] for p in api["/serve_plan"]["parameters"]] == [
        "workload", "preset", "target", "precision", "prompt_len", "gen_len", "batches", "memory_fraction", "label",
        "checkpoint", "gpus", "kv_cache", "chunk", "mix", *MODEL_DIMENSIONS]
    assert [p["parameter_name"] for p in api["/serve_run"]["parameters"]] == [
        "workload", "preset", "precision", "requests", "run_batches", "prompt_min", "prompt_max", "gen_min", "gen_max",
        "temperature", "seed", "memory_fraction", "label", "checkpoint", "kv_cache", *MODEL_DIMENSIONS]


def test_every_output_is_named_by_a_label(api):
    unnamed = {name: [r["label"] for r in endpoint["returns"] if re.fullmatch(r"value_\d+", str(r["label"]))]
               for name, endpoint in api.items()}
    assert unnamed == {name: [] for name in api}
    assert [r["label"] for r in api["/plan"]["returns"]] == [
        "Progress", "Before and after", "Time to train", "Cost to train", "Before and after (CSV)", "Plan",
        "Predicted peak memory per GPU", "Choices that fit, fastest predicted step first", "Decisions with their reasons"]
    assert len(api["/run"]["returns"]) == 11  # the tab's states are not sent


@pytest.mark.slow
def test_a_keyword_plan_call_names_only_what_it_changes(app_server):
    client = app_server.connect()  # its own session
    progress, comparison, _, _, _, markdown, memory, ranked, decisions = [
        value(o) for o in client.predict(global_batch=32, preset="tiny", api_name="/plan")]
    assert "Before and after" in comparison and "time to train 1T tokens" in comparison
    assert "Plan:" in markdown and "transformer/tiny" in markdown and "global batch 32" in markdown  # others: defaults
    assert any(row[2] == "budget" for row in memory["data"])
    assert ranked["data"][0][-1] == "✔"


def test_every_field_of_the_table_is_a_component_of_the_page_and_a_parameter(app_server, api):
    """The form is built from the field table: each field with a place on the page is a component with
    its label, and a parameter of each endpoint that takes it, with the table's default (`seed`, the
    last field added, included)."""
    import httpx

    from migration.config.fields import FIELDS

    config = httpx.get(app_server.url + "config", headers=app_server.headers, timeout=30).json()
    labels = {c.get("props", {}).get("label") for c in config["components"]}
    assert [f.name for f in FIELDS if f.section and f.label not in labels] == []
    for f in FIELDS:
        for endpoint in f.endpoints:
            params = {p["parameter_name"]: p for p in api[f"/{endpoint}"]["parameters"]}
            assert params[f.name]["parameter_has_default"], (endpoint, f.name)
            if f.name != "target":  # the page's own default: local where it has a GPU
                assert params[f.name]["parameter_default"] == f.default, (endpoint, f.name)


@pytest.mark.slow
def test_the_seed_field_reaches_the_run(app_server):
    """`seed`, one line of the field table, set by keyword through the API: the same seed gives the same
    first loss (same initial parameters and data), another seed another."""
    client = app_server.connect()

    def first_loss(seed):
        out = client.predict(workload="mlp", global_batch=16, target="local", steps=2, seed=seed, api_name="/run")
        assert "Run finished" in value(out[0]), value(out[0])
        return value(out[2])["data"][0][1]  # the loss plot's rows: step, loss, run

    a, b, c = first_loss(1), first_loss(1), first_loss(2)
    assert a == b and a != c


def test_a_raw_call_may_leave_out_trailing_parameters(app_server):
    """A positional HTTP call that leaves out the last parameters (a client written before a field was
    added) gets their defaults; one that gives them all still works."""
    from tests.test_security_and_input import call_http

    event, out = call_http(app_server.url, "/history", ["mine"], headers=app_server.headers)
    assert event == "complete" and out[0]["headers"][0] == "id", (event, out)
    event, out = call_http(app_server.url, "/history", ["mine", "all", "all", "all"], headers=app_server.headers)
    assert event == "complete", (event, out)
    event, out = call_http(app_server.url, "/history", ["mine", "runs"], headers=app_server.headers)
    assert event == "error" and "kind" in out, (event, out)
