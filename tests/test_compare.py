"""The comparison a team decides on (migration/planning/compare.py): throughput, time and cost on both sides
follow from the two step times; the GPUs that match the TPU job's throughput are consistent with them; the
user's measured TPU step is checked against the prediction; prices come from the dated table or the user."""

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from migration.config import forms
from migration.common import ConfigError
from migration.config.requests import PlanRequest
from migration.hardware import GPU_SPECS, TPU_SPECS
from migration.planning.compare import compare, headline, rows, shown_rows, summary, tpu_needs_bytes, trust
from migration.prices import PRICES, parse_prices, read_prices_file

ROOT = Path(__file__).resolve().parent.parent


def fake_plan(*, tpu_step, gpu_step, gpus=8, source="tpu-v5p-64", target="h100-sxm", batch=256, gpu_batch=None,
              status="ok", src_status="ok"):
    """The parts of a `results.Plan` the comparison reads."""
    src = {"status": src_status, "predicted_step_s": tpu_step, "peak_bytes_per_chip": 10 * 2**30}
    if src_status == "does-not-fit":
        src = {"status": "does-not-fit", "reason": "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory "
                                                   "required for HLO temporaries (1.29T) exceeds available HBM (15.75G)."}
    return SimpleNamespace(source=source, source_tpu_compile=src, predicted_step_s=gpu_step, status=status,
                           step_time={"source": "compiled program", "expected_error": 0.25}, predicted_peak_bytes=2**30,
                           budget_bytes=60 * 2**30, target_name=GPU_SPECS[target].name, gpus=gpus, target=target,
                           global_batch=gpu_batch or batch, requested_global_batch=batch, gpus_per_node=8,
                           source_per_core_batch=batch // TPU_SPECS[source].devices)


def of(plan, **kw):
    args = dict(train=1e12, prices={}, measured_tpu_step_s=None, flops_per_example=6 * 1e9 * 2048,
                tokens_per_example=2048, gpu_peak_flops=989e12)
    return compare(plan, **{**args, **kw})


@settings(max_examples=200, deadline=None)
@given(tpu_step=st.floats(1e-3, 100), gpu_step=st.floats(1e-3, 100), gpus=st.sampled_from([1, 2, 4, 8, 16, 64, 512]),
       batch=st.sampled_from([64, 256, 1024, 4096]), source=st.sampled_from(["tpu-v5p-64", "tpu-v5e-256", "tpu7x-8",
                                                                              "tpu-v6e-8", "tpu-v4-8"]))
def test_the_matching_gpu_count_follows_from_the_two_step_times(tpu_step, gpu_step, gpus, batch, source):
    c = of(fake_plan(tpu_step=tpu_step, gpu_step=gpu_step, gpus=gpus, batch=batch, source=source))
    tpu_rate = batch * 2048 / tpu_step  # tokens/s of the TPU job, from its step alone
    per_gpu = batch * 2048 / gpu_step / gpus  # tokens/s of one GPU of the plan
    n = c["matching_gpus"]
    assert n == max(1, math.ceil(tpu_rate / per_gpu - 1e-9))
    assert n * per_gpu >= tpu_rate * (1 - 1e-9)  # enough GPUs...
    assert n == 1 or (n - 1) * per_gpu < tpu_rate  # ...and not one more than enough
    # time and cost: the same tokens at each side's rate, chips (or GPUs) x hours x price
    tpu, gpu = c["tpu"], c["gpu"]
    assert tpu["time_s"] == pytest.approx(1e12 / tpu_rate) and gpu["time_s"] == pytest.approx(1e12 / (per_gpu * gpus))
    chips = TPU_SPECS[source].chips
    if tpu["price"]:
        assert tpu["cost_usd"] == pytest.approx(tpu["time_s"] / 3600 * chips * tpu["price"]["usd_per_hour"])
    assert gpu["cost_usd"] == pytest.approx(gpu["time_s"] / 3600 * gpus * PRICES["h100-sxm"].usd_per_hour)
    assert c["speedup"] == pytest.approx(tpu["time_s"] / gpu["time_s"])


def test_mfu_and_throughput_per_chip_use_chips_not_devices():
    # TPU7x: two JAX devices per chip; a tpu7x-8 slice is 4 chips, each 2,307 TFLOP/s (bf16).
    c = of(fake_plan(tpu_step=1.0, gpu_step=1.0, gpus=8, source="tpu7x-8", batch=64))
    tpu = c["tpu"]
    assert (tpu["devices"], tpu["chips"]) == (8, 4)
    assert tpu["throughput_per_chip_per_s"] == pytest.approx(64 * 2048 / 4)
    assert tpu["mfu"] == pytest.approx(6e9 * 2048 * 64 / (4 * 2307e12))
    assert c["gpu"]["mfu"] == pytest.approx(6e9 * 2048 * 64 / (8 * 989e12))


def test_a_multislice_tpu_job_counts_every_slices_chips():
    plan = fake_plan(tpu_step=1.0, gpu_step=1.0, source="tpu-v5p-16", batch=256)
    plan.source_slices = 4  # 4 x v5p-16: 32 chips
    c = of(plan)
    assert (c["tpu"]["name"], c["tpu"]["chips"], c["tpu"]["devices"]) == ("4 × TPU v5p-16", 32, 32)
    assert c["tpu"]["cost_usd"] == pytest.approx(c["tpu"]["time_s"] / 3600 * 32 * 4.2)
    req = PlanRequest(source="tpu-v5p-16", source_slices=4, global_batch=256)
    assert req.source_devices == 32 and req.source_per_core_batch == 8


def test_the_history_export_row_of_a_plan_carries_the_comparison():
    c = of(fake_plan(tpu_step=2.0, gpu_step=1.0, gpus=8))
    row = summary(c)
    assert row["tpu_step_s"] == 2.0 and row["gpu_step_s"] == 1.0 and row["comparison_matching_gpus"] == 4
    assert row["gpu_usd_per_hour"] == PRICES["h100-sxm"].usd_per_hour and row["gpu_cost_usd"] == c["gpu"]["cost_usd"]
    assert all(not isinstance(v, (dict, list)) for v in row.values())


def test_a_workload_without_tokens_counts_examples():
    c = of(fake_plan(tpu_step=0.1, gpu_step=0.1), tokens_per_example=None)
    assert c["unit"] == "examples" and c["tpu"]["throughput_per_s"] == pytest.approx(2560)
    assert any(r[""] == "examples/s" for r in shown_rows(c))


@pytest.mark.parametrize("measured,predicted,agrees,use_ratio", [
    (0.10, 0.10, True, 1.0), (0.124, 0.10, True, 1.24), (0.081, 0.10, True, 0.81),
    (0.20, 0.10, False, 2.0), (0.05, 0.10, False, 0.5)])
def test_the_measured_tpu_step_is_checked_against_the_prediction(measured, predicted, agrees, use_ratio):
    t = trust(measured, predicted, 0.04)
    assert t["use"] == "measured" and t["agrees"] is agrees and t["ratio"] == pytest.approx(use_ratio)
    if agrees:
        assert "agree within the prediction's expected error (±25%)" in t["text"]
    elif measured > predicted:  # slower than predicted: what the compiled program misses may move to the GPUs
        assert t["adjusted_gpu_step_s"] == pytest.approx(0.04 * use_ratio) and "2.00x slower" in t["text"]
    else:  # faster: the description is probably not the job
        assert "2.00x faster" in t["text"] and "check the description" in t["text"]
    assert trust(None, predicted, 0.04) is None
    assert "no compiled TPU prediction" in trust(measured, None, 0.04)["text"]


def test_the_measured_step_replaces_the_prediction_on_the_tpu_side():
    c = of(fake_plan(tpu_step=0.5, gpu_step=0.4), measured_tpu_step_s=1.0)
    assert c["tpu"]["step_s"] == 1.0 and c["tpu"]["step_source"] == "measured by you"
    assert c["tpu"]["expected_error"] is None and c["tpu"]["predicted_step_s"] == 0.5
    assert "measured step" in headline(c)


def test_the_tpu_compilers_out_of_memory_says_the_setup_is_not_the_job():
    assert tpu_needs_bytes("the total memory required for HLO temporaries (1.29T) exceeds available HBM "
                           "(15.75G).") == int(1.29 * 2**40)
    assert tpu_needs_bytes("RESOURCE_EXHAUSTED: something else") is None
    c = of(fake_plan(tpu_step=None, gpu_step=0.4, source="tpu-v5e-8", src_status="does-not-fit"))
    assert c["tpu"]["fits"] is False and c["tpu"]["step_s"] is None and c["matching_gpus"] is None
    assert "needs 1.29 TiB per device" in c["tpu_fit"] and "must differ from this description" in c["tpu_fit"]
    assert "give your measured TPU step" in headline(c)
    # with the user's measured step the TPU side has its figures again
    c = of(fake_plan(tpu_step=None, gpu_step=0.4, source="tpu-v5e-8", src_status="does-not-fit"),
           measured_tpu_step_s=2.0)
    assert c["tpu"]["time_s"] and c["matching_gpus"]


def test_prices_come_from_the_table_with_their_source_or_from_the_user():
    c = of(fake_plan(tpu_step=1.0, gpu_step=1.0))
    assert c["tpu"]["price"]["usd_per_hour"] == 4.2 and c["tpu"]["price"]["unit"] == "chip-hour"
    assert c["tpu"]["price"]["source"].startswith("https://") and c["tpu"]["price"]["as_of"]
    c = of(fake_plan(tpu_step=1.0, gpu_step=1.0), prices={"tpu-v5p": 2.0, "h100-sxm": 3.0})
    assert (c["tpu"]["price"]["usd_per_hour"], c["gpu"]["price"]["usd_per_hour"]) == (2.0, 3.0)
    assert c["tpu"]["price"]["source"] == "yours"
    # no public price for TPU7x: its cost is n/a, and the headline says how to give one
    c = of(fake_plan(tpu_step=1.0, gpu_step=1.0, source="tpu7x-64"))
    assert c["tpu"]["cost_usd"] is None and c["missing_prices"] == ["tpu7x"] and "--price tpu7x=" in headline(c)


def test_every_table_price_is_a_quoted_candidate_with_its_url():
    """Each price the product uses is one of the quoted public prices (bench/prices_candidates.json: the
    catalog line, its URL, when it was read), divided as its note says."""
    data = json.loads((ROOT / "bench" / "prices_candidates.json").read_text())
    quoted = {(round(e["usd"], 4), e["url"]) for e in data["entries"]}
    for key, price in PRICES.items():
        assert (round(price.usd_per_hour, 4), price.source) in quoted, key
        assert key in GPU_SPECS or key.startswith("tpu"), key


@pytest.mark.parametrize("text,prices", [
    ("", {}), ("tpu-v5p=4.2", {"tpu-v5p": 4.2}), (" tpu-v5p=4.2, h100-sxm=3.99 ", {"tpu-v5p": 4.2, "h100-sxm": 3.99}),
    ("tpu7x=6 local=2.5", {"tpu7x": 6.0, "local": 2.5})])
def test_prices_parse_from_the_form_and_the_flag(text, prices):
    assert parse_prices(text) == prices
    assert forms.plan_request(prices=text).prices == prices


@pytest.mark.parametrize("text,says", [
    ("tpu-v5p=0", "positive number of dollars per chip-hour"), ("h100-sxm=-3", "per GPU-hour"),
    ("h100-sxm=1e12", "up to 10,000"), ("h100-sxm=nan", "positive"), ("h100-sxm=inf", "positive"),
    ("tpu-v9=1", "has no price: the keys are"), ("h100-sxm", "key=dollars"), ("a=b=c", "has no price")])
def test_a_bad_price_is_refused_in_one_line_naming_the_field(text, says):
    with pytest.raises(ConfigError) as err:
        parse_prices(text)
    assert err.value.field == "prices" and says in str(err.value) and "\n" not in str(err.value)


def test_a_plan_request_from_json_checks_its_prices_tokens_and_measured_step():
    with pytest.raises(ConfigError, match="prices: 'tpu-v9' has no price"):
        PlanRequest.from_dict({"prices": {"tpu-v9": 1.0}})
    with pytest.raises(ConfigError, match="prices: h100-sxm: a price must be a positive number"):
        PlanRequest.from_dict({"prices": {"h100-sxm": True}})
    with pytest.raises(ConfigError, match="train_tokens: must be a number from 1e\\+06 to 1e\\+16"):
        PlanRequest.from_dict({"train_tokens": 10})
    with pytest.raises(ConfigError, match="tpu_step_ms"):
        PlanRequest.from_dict({"tpu_step_ms": -1})


def test_a_prices_file_is_json_or_lines(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps({"tpu-v5p": 3.1, "h100-sxm": 2.5}))
    (tmp_path / "p.txt").write_text("# our contract\ntpu-v5p = 3.1\nh100-sxm,2.5  # per GPU-hour\n")
    assert read_prices_file(tmp_path / "p.json") == read_prices_file(tmp_path / "p.txt") == {"tpu-v5p": 3.1,
                                                                                            "h100-sxm": 2.5}
    (tmp_path / "bad.json").write_text(json.dumps({"h100-sxm": -1}))
    with pytest.raises(ConfigError, match="h100-sxm: a price must be a positive number"):
        read_prices_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="could not be read"):
        read_prices_file(tmp_path / "missing.json")
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="could not be read"):
        read_prices_file(tmp_path / "bin")


def test_a_real_plan_compares_two_compiled_steps_consistently():
    """Both sides compiled in one process (the TPU program for a v5p-8 slice, the GPU program for 8 H100s):
    the comparison's figures follow from the two predicted steps the plan reports."""
    from migration.planning.planner import plan_migration

    plan = plan_migration(PlanRequest(workload="transformer", preset="tiny", source="tpu-v5p-8", global_batch=256,
                                      target="h100-sxm", gpus=8, train_tokens=2e9), lambda *a, **k: None)
    c = plan.comparison
    tpu_s, gpu_s = plan.source_tpu_compile["predicted_step_s"], plan.predicted_step_s
    assert c["tpu"]["step_s"] == tpu_s and c["gpu"]["step_s"] == gpu_s
    tokens = 256 * 64  # the tiny preset's 64-token sequences
    need = (tokens / tpu_s) / (plan.global_batch * 64 / gpu_s / 8)
    assert c["matching_gpus"] == max(1, math.ceil(need - 1e-9))
    assert c["tpu"]["time_s"] == pytest.approx(2e9 / (tokens / tpu_s))
    assert {r["metric"] for r in rows(c)} >= {"step time", "tokens/s", "MFU", "time to train 2B tokens",
                                               "cost to train 2B tokens"}
    assert json.loads(plan.to_json())["comparison"]["gpu"]["price"]["key"] == "h100-sxm"


@pytest.mark.slow
def test_the_command_line_prints_the_table_and_writes_the_csv(tmp_path):
    (tmp_path / "prices.json").write_text(json.dumps({"tpu-v5e": 1.0, "h100-sxm": 2.0}))
    proc = subprocess.run(
        [sys.executable, "-m", "migration", "plan", "--workload", "mlp", "--source", "tpu-v5e-8", "--target",
         "h100-sxm", "--global-batch", "64", "--prices-file", str(tmp_path / "prices.json"), "--price", "h100-sxm=3",
         "--train-tokens", "1e9", "--tpu-step-ms", "50", "--csv", str(tmp_path / "c.csv"), "--quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "before and after" in proc.stdout and "time to train 1B examples" in proc.stdout
    assert "$1.00 per chip-hour (yours)" in proc.stdout and "$3.00 per GPU-hour (yours)" in proc.stdout  # flag wins
    assert "your measured 50 ms against the predicted" in proc.stdout
    lines = (tmp_path / "c.csv").read_text().splitlines()
    assert lines[0] == "metric,tpu,gpu,unit" and any(line.startswith("price,1.0,3.0,") for line in lines)
    bad = subprocess.run([sys.executable, "-m", "migration", "plan", "--price", "h100-sxm=-1"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "prices: h100-sxm" in bad.stderr
