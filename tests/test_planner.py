"""The planner end to end, with real compiles: deviceless for catalog GPUs, or the estimate."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from migration.common import ConfigError
from migration.config.requests import PlanRequest
from migration.planning.memory import MemoryPredictor
from migration.planning.planner import plan_migration
from migration.running.runner import plan
from migration.planning.search import batch_candidates
from tests.concurrent_plans import cli_plan, start_cli_plans, start_plans, stop_cli_plans
from workloads import get_workload

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA_PLUGIN = ROOT / "tests" / "fixtures" / "no_cuda_plugin"
pytestmark = pytest.mark.slow


def tiny(**change) -> PlanRequest:
    base = dict(workload="transformer", preset="tiny", compile_for_tpu=False, timeout_s=600)
    return PlanRequest(**{**base, **change})


GRANULARITIES = ["multiple8", "pow2"]


@pytest.fixture(scope="module")
def bisection_plans(tmp_path_factory):
    # A T4 with a 5% share and a 50% margin leaves ~0.37 GB: the tiny model's boundary falls mid-range.
    return start_plans({g: tiny(target="t4", memory_fraction=0.05, safety_margin=0.5, global_batch=4000,
                                max_per_device_batch=4000, remat="none", granularity=g) for g in GRANULARITIES},
                       tmp_path_factory.mktemp("bisection"))


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_bisection_finds_the_boundary_with_real_compiles(bisection_plans, granularity):
    p = bisection_plans[granularity].result()
    assert p.status == "ok" and p.prediction_method == "compiled-for-target"
    assert 8 < p.max_batch_by_remat["none"] < 4000
    probed = {row["per_device_batch"]: row["predicted_bytes"] for row in p.table
              if row["remat"] == "none" and row["accumulation_steps"] == 1}
    found = p.max_batch_by_remat["none"]
    assert set(p.candidates) <= set(batch_candidates(4000, granularity))
    above = p.candidates[p.candidates.index(found) + 1]
    assert probed[found] <= p.budget_bytes < probed[above]  # it fits; the next step up does not
    assert p.predicted_peak_bytes <= p.budget_bytes
    assert p.compiles <= 8  # not a linear scan of the candidates


def test_the_cache_avoids_repeated_compiles(cold_caches):
    req = tiny(target="a100-80gb", global_batch=64)
    first = plan(req)
    second = plan(req)
    assert first.compiles > 0 and second.compiles == 0
    assert second.cache_hits >= first.compiles
    assert (second.per_device_batch, second.remat, second.predicted_peak_bytes) == \
           (first.per_device_batch, first.remat, first.predicted_peak_bytes)


PRECISION_BY_TARGET = [("v100-32gb", "fp16"), ("t4", "fp16"), ("a100-40gb", "bf16"), ("h100-sxm", "bf16"),
                       ("h200", "bf16")]


@pytest.fixture(scope="module")
def precision_plans(tmp_path_factory):
    return start_plans({target: tiny(target=target, global_batch=32) for target, _ in PRECISION_BY_TARGET},
                       tmp_path_factory.mktemp("precision"))


@pytest.mark.parametrize("target,precision", PRECISION_BY_TARGET)
def test_fp16_with_loss_scaling_where_bf16_is_missing(precision_plans, target, precision):
    p = precision_plans[target].result()
    assert p.precision == precision
    reason = p.reasons["precision"]
    assert ("loss scaling" in reason and "no native bf16" in reason) if precision == "fp16" else "natively" in reason


@pytest.fixture(scope="module")
def independent_plans(tmp_path_factory):
    """Plans of the tests below that need nothing but their own plan, started together: tiny on two
    L4s; the small preset on 5% of a T4 with a 50% margin, the planner's choice and remat none
    forced; tiny for an H100 from a v5e-8 (the TPU setup and the rule of thumb)."""
    small_on_a_t4 = dict(workload="transformer", preset="small", target="t4", memory_fraction=0.05, safety_margin=0.5,
                         global_batch=64, compile_for_tpu=False)
    return start_plans({"two L4s": tiny(target="l4", gpus=2, global_batch=96, max_per_device_batch=16),
                        "small, chosen": PlanRequest(**small_on_a_t4),
                        "small, remat none": PlanRequest(**small_on_a_t4, remat="none"),
                        "tpu setup": tiny(target="h100-sxm", global_batch=256)},
                       tmp_path_factory.mktemp("independent"))


def test_accumulation_keeps_the_global_batch_on_several_gpus(independent_plans):
    p = independent_plans["two L4s"].result()
    assert p.per_device_batch * p.gpus * p.accumulation_steps == 96 == p.global_batch and p.global_batch_exact


def test_a_model_larger_than_the_budget_is_infeasible_with_what_would_help(independent_plans):
    p = independent_plans["small, chosen"].result()
    assert p.status == "infeasible"
    assert "does not fit even at batch 1 with remat full" in p.message
    assert "parameters, gradients and AdamW state alone" in p.message
    assert "more memory" in p.message and "smaller model" in p.message and "several GPUs with the state sharded" in p.message
    assert p.predicted_peak_bytes > p.budget_bytes


def test_an_infeasible_forced_policy_is_named_and_full_remat_suggested(independent_plans):
    p = independent_plans["small, remat none"].result()
    assert p.status == "infeasible" and "remat none" in p.message and p.remat == "none"
    assert "remat full (or let the planner choose the policy)" in p.message


def noop(*_, **__):
    return None


def test_a_plan_is_never_ok_over_its_budget_once_accumulation_is_added():
    """Batch 1 fits, but batch 1 x 64 accumulation (the accumulator, 64 stacked micro-batches) does
    not: the plan is infeasible and says so, instead of ok over budget."""
    probe = MemoryPredictor(tiny(target="t4"), noop)
    alone, accumulated = probe.predict("fp16", "none", 1), probe.predict("fp16", "none", 1, 64)
    assert accumulated > alone
    budget = (alone + accumulated) / 2
    fraction = budget / (16e9 * 0.9)  # the T4 entry: 16 GB datasheet; 10% safety margin
    p = plan_migration(tiny(target="t4", memory_fraction=fraction, global_batch=64, max_per_device_batch=1,
                            remat="none"), noop)
    assert p.status == "infeasible", (p.predicted_peak_bytes, p.budget_bytes)
    assert "once accumulation is added" in p.message and "remat none" in p.message


def test_plans_choose_the_fastest_fitting_choice_and_show_the_ranking():
    """gpt2-style tiny model for an H100 with a budget that fits 32 per GPU without remat: the
    plan keeps the global batch with accumulation rather than recomputing, and shows the ranking."""
    p = plan_migration(tiny(target="h100-sxm", global_batch=512, max_per_device_batch=512), noop)
    assert p.ok and p.remat_chosen_by == "search" and p.predicted_peak_bytes <= p.budget_bytes
    first = p.ranked[0]
    assert (first["remat"], first["per_device_batch"], first["accumulation_steps"]) == \
        (p.remat, p.per_device_batch, p.accumulation_steps)
    timed = [c["compiled_step_s"] for c in p.ranked if c["exact"] and c.get("compiled_step_s") is not None
             and c["status"] != "compiled: does not fit"]
    assert timed and timed == sorted(timed)
    # the choice is the fastest compiled program; the analytic model only ordered the candidates
    assert p.predicted_step_s == pytest.approx(timed[0])
    assert p.step_time["analytic_s"] == pytest.approx(first["analytic_s"])
    assert p.step_time["source"] == "compiled program" and p.predicted_step_s == p.step_time["seconds"]
    assert "fastest predicted step" in p.reasons["remat"]


def test_a_policy_is_pruned_only_against_a_choice_verified_with_its_accumulation():
    """Global batch 512 at most 32 per GPU: every choice accumulates. A policy may be skipped (slower
    even on a full GPU than the best so far) only once that best choice was compiled with its
    accumulation and fitted; pruning against a compile at accumulation 1 alone could lose the
    policy that fits when the best does not."""
    events = []
    p = plan_migration(tiny(target="h100-sxm", global_batch=512, max_per_device_batch=32),
                       lambda event, **fields: events.append((event, fields)))
    assert p.ok
    skips = [i for i, (event, _) in enumerate(events) if event == "skip_policy"]
    assert skips, "the tiny model's slower policies are pruned"
    for i in skips:
        verified = [f for event, f in events[:i] if event == "candidate" and f["accumulation_steps"] > 1
                    and f["predicted_bytes"] is not None and f["predicted_bytes"] <= p.budget_bytes]
        assert verified, f"{events[i][1]} was pruned against a choice never compiled with its accumulation"


def meminfo_total_bytes() -> int:
    """MemTotal of /proc/meminfo, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "MemTotal":
            number, unit = value.split()
            assert unit == "kB", line
            return int(number) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_the_local_budget_comes_from_what_this_machine_reports():
    """The local plan's memory is this machine's own figure, read here independently of the planner:
    the device's bytes_limit where it reports one, else (the CPU backend) the host's MemTotal,
    within 1%."""
    req = tiny(target="local", global_batch=8)
    p = plan_migration(req, noop)
    assert p.ok and "host memory" in p.budget_source and p.planned_device_kind == "cpu"
    assert p.budget_bytes == int(p.device_memory_bytes * p.memory_fraction * (1 - p.safety_margin))
    assert (p.memory_fraction, p.safety_margin) == (req.memory_fraction, req.safety_margin)
    host = meminfo_total_bytes()
    limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
    device_total = limit / p.memory_fraction if limit else host  # a device limit is already the job's share
    assert p.device_memory_bytes == pytest.approx(device_total, rel=0.01), (p.device_memory_bytes, device_total)
    assert p.device_memory_bytes == pytest.approx(host, rel=0.01), (p.device_memory_bytes, host)  # CPU: host memory
    assert p.budget_bytes == pytest.approx(host * req.memory_fraction * (1 - req.safety_margin), rel=0.01)


def test_without_the_cuda_plugin_the_plan_is_an_estimate_and_says_so(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(NO_CUDA_PLUGIN))
    p = plan(PlanRequest(workload="transformer", preset="gpt2-small", target="h100-sxm", global_batch=256,
                         compile_for_tpu=False))
    assert p.prediction_method == "estimate" and p.compiles == 0
    assert p.prediction_note.startswith("analytic estimate")
    assert p.predicted_peak_bytes <= p.budget_bytes


def test_the_plan_compares_the_tpu_setup_and_the_rule_of_thumb(independent_plans):
    p = independent_plans["tpu setup"].result()
    assert p.tpu_setup_on_target["per_device_batch"] == 32  # 256 over a v5e-8's 8 chips
    assert p.tpu_setup_on_target["fits"] is True
    assert p.rule_of_thumb_batch == 64 and "capped to 1..64" in p.rule_of_thumb_note  # a tiny model hits the cap
    assert p.environment["XLA_PYTHON_CLIENT_MEM_FRACTION"]["value"] == "0.80"
    assert "MXU" in p.matmul_precision["tpu"]


def test_invalid_plan_requests_name_the_field():
    with pytest.raises(ConfigError, match="target"):
        plan(PlanRequest(target="a200"))
    with pytest.raises(ConfigError, match="global_batch"):
        plan(PlanRequest(global_batch=0))


CLI_PLANS = {
    # The command.
    "gpt2-small": ["--workload", "transformer", "--preset", "gpt2-small", "--source", "tpu-v5e-8", "--global-batch",
                   "256", "--target", "h100-sxm", "--gpus", "1"],
    # A plan to run here.
    "tiny-a10": ["--preset", "tiny", "--target", "a10", "--global-batch", "32", "--no-tpu-compile", "--quiet"],
}


@pytest.fixture(scope="module")
def cli_plans(tmp_path_factory):
    """The command lines of CLI_PLANS, started together."""
    started = start_cli_plans(CLI_PLANS, tmp_path_factory.mktemp("cli"))
    yield started
    stop_cli_plans(started)


def test_cli_plans_gpt2_small_for_an_h100_by_compiling_for_it(cli_plans):
    """The issue's command: a compiled-for-target plan that fits, under 3 minutes on 2 cores."""
    p, _, _ = cli_plan(cli_plans["gpt2-small"])
    for key in ("per_device_batch", "accumulation_steps", "global_batch", "precision", "remat",
                "predicted_peak_bytes", "budget_bytes", "prediction_method", "compiles", "search_seconds", "decisions"):
        assert key in p
    assert p["prediction_method"] == "compiled-for-target"
    assert p["predicted_peak_bytes"] <= p["budget_bytes"]
    assert p["per_device_batch"] * p["accumulation_steps"] == p["global_batch"] == 256
    assert p["precision"] == "bf16"
    assert all(d["reason"] for d in p["decisions"])


def test_cli_runs_a_saved_plan_on_the_local_devices(cli_plans, tmp_path):
    saved, _, out = cli_plan(cli_plans["tiny-a10"])
    report = tmp_path / "run.json"
    proc = subprocess.run([sys.executable, "-m", "migration", "run", "--plan", str(out), "--steps", "4",
                           "--warmup", "1", "--quiet", "--json", str(report), "--tpu-step-ms", "250",
                           "--checklist", str(tmp_path / "checklist.csv")],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "note: the plan was made for A10" in proc.stdout
    # the benchmark item compares with the TPU figure given (32 samples in 250 ms: 128 samples/s)
    assert "job 128 samples/s (250 ms per step at a global batch of 32" in (tmp_path / "checklist.csv").read_text()
    r = json.loads(report.read_text())
    assert r["status"] == "ok" and r["precision"] == saved["precision"] and r["global_batch"] == 32


def test_an_infeasible_dropless_moe_on_a_gpu_is_told_of_capacity_dispatch():
    """XLA compiles a dropless MoE layer's grouped products for a GPU as a loop over the experts, each over every
    routed row (docs/moe.md: a 4-layer Qwen3-30B-A3B at batch 1 peaks at 55 GiB a GPU dropless, 7 GiB at
    capacity): where the state fits but the step does not, the plan names capacity dispatch among what would
    help; not for capacity dispatch, another family or the CPU."""
    from migration.planning.plan_record import dropless_on_gpu, what_would_help

    req = PlanRequest(workload="moe", preset="qwen3-30b-a3b", target="h100-sxm", gpus=16)
    assert dropless_on_gpu(req, {}, "gpu") and not dropless_on_gpu(req, {"dispatch": "capacity"}, "gpu")
    assert not dropless_on_gpu(req, {}, "cpu")
    assert not dropless_on_gpu(PlanRequest(workload="llama", preset="8b", target="h100-sxm"), {}, "gpu")
    assert any(h.startswith("capacity dispatch (--dim dispatch=capacity") for h in what_would_help(req, "fsdp", True))
    assert not any("capacity" in h for h in what_would_help(req, "fsdp", False))


def test_capacity_rows_below_a_tensor_core_tile_count_the_padding():
    """DeepSeek-V3 at a capacity factor of 0.2 over 1,024 tokens: ceil(0.2 x 1,024 x 8 / 256) = 7 rows an expert a
    sequence; at 4 sequences a GPU, 28 rows, and the tensor core computes 64: 36 missing rows of every expert's
    up, gate and down products (7,168 x 3 x 2,048), 256 experts, 58 MoE layers, 4 passes under full remat (3
    without). Under +ep4 an expert's rows come from 4 GPUs (112 rows): nothing added; nor for dropless routing."""
    from migration.planning.routed_experts import tile_padding

    cfg = get_workload("moe").config("deepseek-v3", {"dispatch": "capacity", "capacity_factor": 0.2, "seq_len": 1024})
    padding = tile_padding(cfg, 4, 1, 1, 1, True, "bf16")
    assert (padding.kind, padding.unit, padding.bytes, padding.count) == ("matmul", "bf16", 0.0, 0.0)
    assert padding.flops == 2 * 36 * 7168 * (3 * 2048) * 256 * 58 * 4
    assert tile_padding(cfg, 4, 1, 2, 3, False, "bf16").flops == 2 * 36 * 7168 * (3 * 1024) * 256 * 58 * 3 * 3
    assert tile_padding(cfg, 4, 4, 1, 1, True, "bf16") is None
    assert tile_padding(get_workload("moe").config("deepseek-v3", {"seq_len": 1024}), 4, 1, 1, 1, True, "bf16") is None


def test_a_capacity_plan_with_few_rows_an_expert_times_the_padding_it_chose_by():
    """The tiny MoE at capacity dispatch (ceil(1.25 x 64 x 2 / 4) = 40 rows an expert a sequence) at one sequence a
    GPU: the step is timed, and chosen, with the padding to 64 rows counted, and its method says so."""
    req = PlanRequest(workload="moe", preset="tiny", model={"dispatch": "capacity"}, target="h100-sxm", gpus=2,
                      global_batch=2, max_per_device_batch=1, remat="none", sharding="fsdp", compile_for_tpu=False)
    p = plan_migration(req, noop)
    assert p.ok and p.per_device_batch == 1, p.message
    method = {d.decision: d.reason for d in p.decisions}["step_time"]
    assert "have 40 rows an expert a micro-batch at capacity dispatch, fewer than a 64-row tensor-core tile" in method
    # 24 missing rows x d_model 64 x (gate, up, down: 3 x 64) x 4 experts x 2 MoE layers x 3 passes (no remat)
    assert p.step_time["tile_padding_flops"] == 2 * 24 * 64 * (3 * 64) * 4 * 2 * 3
    chosen = [r for r in p.ranked if r["status"].startswith("chosen")]
    assert chosen and chosen[0]["compiled_step_s"] == pytest.approx(p.predicted_step_s)


def test_a_layout_whose_compile_fails_is_left_out_and_the_others_still_planned(cold_caches, monkeypatch):
    """XLA refusing one layout (an error that is not memory: the form a jaxlib bug takes) leaves that layout out
    of the plan, said in its decisions, and the plan is still compiled for the target with the others; only when
    every layout fails does the plan fall back to the analytic estimate."""
    from migration.planning import memory

    real = memory.compile_memory

    def refusing(refused):
        def compile_memory(program, mesh, **kw):
            if refused(program.sharding):
                raise RuntimeError(f"INTERNAL: no kernel for this {program.sharding} program")
            return real(program, mesh, **kw)
        return compile_memory

    monkeypatch.setenv("MIGRATION_COMPILE_WORKERS", "0")  # compiles in this process, where the failure is made
    req = tiny(target="h100-sxm", gpus=2, global_batch=64, max_per_device_batch=32, remat="none")
    first = plan_migration(req, noop)
    assert first.ok and not [d for d in first.decisions if d.decision == "compile_failed"]
    monkeypatch.setattr(memory, "compile_memory", refusing(lambda layout: layout == first.sharding))
    monkeypatch.setenv("MIGRATION_COMPILE_CACHE_DIR", str(cold_caches / "second"))  # compiled again, not read back
    events = []
    p = plan_migration(req, lambda kind, **kw: events.append((kind, kw)))
    assert p.ok and p.prediction_method == "compiled-for-target" and p.sharding != first.sharding
    assert p.step_time["source"] == "compiled program"
    (failed,) = [d for d in p.decisions if d.decision == "compile_failed"]
    assert failed.value == first.sharding
    assert f"INTERNAL: no kernel for this {first.sharding} program" in failed.reason
    assert any(kind == "compile_failed" and kw["sharding"] == first.sharding for kind, kw in events)
    monkeypatch.setattr(memory, "compile_memory", refusing(lambda layout: True))
    monkeypatch.setenv("MIGRATION_COMPILE_CACHE_DIR", str(cold_caches / "third"))
    everything = plan_migration(req, noop)
    assert everything.prediction_method == "estimate" and "INTERNAL: no kernel" in everything.prediction_note
