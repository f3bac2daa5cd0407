"""The published mixture-of-experts rows (bench/published_moe.json) and what their scorer builds of them
(bench/moe_published.py): each row pinned to a commit with its quote, GPU and TPU rows in a tuning and a
held-out part, and each run as its recipe states it (the preset of the model, the expert parallel degree, the
capacity factor or dropless routing, the layout); the record bench/results keeps scores every row."""

import importlib
import json
import os
import re
from pathlib import Path

import pytest

from migration.config.layouts import parse_layout
from migration.config.requests import validate

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def moe_published():
    saved = dict(os.environ)  # the bench sets its compile environment when imported
    try:
        return importlib.import_module("bench.moe_published")
    finally:
        os.environ.clear()
        os.environ.update(saved)


def test_the_rows_cover_gpus_and_tpus_in_a_tuning_and_a_held_out_part(moe_published):
    rows = moe_published.entries()
    assert len(rows) >= 6 and len({r["id"] for r in rows}) == len(rows)
    assert {r["side"] for r in rows} == {"gpu", "tpu"} and {r["split"] for r in rows} == {"tune", "held-out"}
    assert {r["model"]["preset"] for r in rows} >= {"mixtral-8x7b", "deepseek-v3"}
    for r in rows:
        assert re.search(r"/blob/[0-9a-f]{40}/", r["source_url"]), r["id"]  # pinned to a commit
        assert str(r["measured"]["step_time_s"]) in r["quote"], r["id"]


def test_each_row_runs_with_its_recipes_experts_routing_and_layout(moe_published):
    """The expert split the recipe states (ici_expert_parallelism) is the layout's +epE; a capacity factor
    is the capacity dispatch at that factor, else dropless; the batch and the devices are the recipe's."""
    from bench import published_check, tpu_published

    for r in moe_published.entries():
        cfg = (published_check if r["side"] == "gpu" else tpu_published).run_config(r)
        lay = parse_layout(cfg.sharding)
        stated = tpu_published.parallelism(r).get("ici_expert_parallelism", 1)
        assert lay.expert == stated == r["moe"]["expert_parallelism"], r["id"]
        assert cfg.model["dispatch"] == r["moe"]["dispatch"] and cfg.workload == "moe"
        if r["moe"]["dispatch"] == "capacity":
            assert cfg.model["capacity_factor"] == r["moe"]["capacity_factor"] > 0
        assert cfg.per_device_batch == r["per_device_batch"]
        devices = r["gpus"] if r["side"] == "gpu" else tpu_published.spec_for(r).devices * r["slices"]
        assert cfg.devices == devices and r["global_batch"] == devices * r["per_device_batch"], r["id"]
        text = moe_published.setup_text(r, cfg)
        assert f"EP {stated}" in text and ("capacity factor" in text or "dropless" in text)


def test_the_gpu_row_is_a_valid_plan_of_this_product():
    from bench import published_check

    gpu = [r for r in json.loads((ROOT / "bench" / "published_moe.json").read_text()) if r["side"] == "gpu"]
    for r in gpu:
        cfg = validate(published_check.run_config(r))
        assert cfg.sharding == "hybrid:16+ep8" and cfg.remat.startswith("custom:")


def test_the_record_scores_every_row_with_its_layout_stated(moe_published):
    record = json.loads((ROOT / "bench" / "results" / "published_moe_check.json").read_text())
    table = record["tables"][0]
    scored = {row[0]: row for row in table["rows"]}
    skipped = " ".join(n for n in record["notes"] if n.startswith("Not scored"))
    for r in moe_published.entries():
        assert r["id"] in scored or r["id"] in skipped, r["id"]
        if r["id"] in scored:
            row = dict(zip(table["columns"], scored[r["id"]]))
            assert row["split"] == r["split"] and "EP " in row["layout, experts, routing"]
            assert row["published step"] == f"{r['measured']['step_time_s']:.3f}s"
