"""The launched app's API as a client sees it (`view_api`): every parameter has a default, so a keyword call
names only what it changes, and every output is named by its component's label."""

import re

import pytest

gradio_client = pytest.importorskip("gradio_client")

from tests.server import value  # noqa: E402

ENDPOINTS = ("/plan", "/run", "/autotune", "/code_check", "/history", "/compare", "/export_csv", "/export_history_csv")
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
    assert [p["parameter_name"] for p in api["/plan"]["parameters"]] == [*FORM, "label"]
    assert [p["parameter_name"] for p in api["/run"]["parameters"]] == [
        "plan_file", "steps", "learning_rate", "compare_tpu", "profile", "fp32_reference", "pmap_before", "scaling",
        *FORM, "label", "save_checkpoint", "restore_checkpoint"]


def test_every_output_is_named_by_a_label(api):
    unnamed = {name: [r["label"] for r in endpoint["returns"] if re.fullmatch(r"value_\d+", str(r["label"]))]
               for name, endpoint in api.items()}
    assert unnamed == {name: [] for name in api}
    assert [r["label"] for r in api["/plan"]["returns"]][:3] == ["Progress", "Plan", "Predicted peak memory per GPU"]
    assert len(api["/run"]["returns"]) == 11 and len(api["/plan"]["returns"]) == 5  # the tab's states are not sent


@pytest.mark.slow
def test_a_keyword_plan_call_names_only_what_it_changes(app_server):
    client = app_server.connect()  # its own session
    progress, markdown, memory, ranked, decisions = [
        value(o) for o in client.predict(global_batch=32, preset="tiny", api_name="/plan")]
    assert "Plan:" in markdown and "transformer/tiny" in markdown and "global batch 32" in markdown  # others: defaults
    assert any(row[2] == "budget" for row in memory["data"])
    assert ranked["data"][0][-1] == "✔"
