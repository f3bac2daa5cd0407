"""The checklist graded from evidence: every status that every item can return, from a real plan
(a deviceless compile for an A100), real runs on this machine's CPU backend, and real code checks.

No GPU is at hand here, so the "on the target GPU" cases take a real CPU report and relabel where
it ran (backend, device kind, measured peak): the grading reads exactly those fields.
"""

import csv
import dataclasses
import io
import json
import math
import os
from pathlib import Path

import pytest

from migration.grading import checklist, serving

from migration.planning import deployment
from migration.grading.checklist import FAIL, ITEMS, NA, NOT_CHECKED, PASS, WARN, Evidence
from migration.codecheck import check_sources
from migration.config.requests import PlanRequest, RunConfig
from migration.planning.planner import plan_migration
from migration.running.runner import run
from tests.conftest import reused

pytestmark = pytest.mark.slow
TARGET_KIND = "NVIDIA A100-SXM4-40GB"  # the device kind of the a100-40gb catalog entry

CLEAN = '''import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.8"
import jax
import jax.numpy as jnp


@jax.jit
def train_step(state, batch):
    return state + 1, jnp.mean(batch)


def train(state, batches, log_every=100):
    history = []
    for step, batch in enumerate(batches):
        state, loss = train_step(state, batch)
        history.append(loss)
        if step % log_every == 0:
            stats = jax.local_devices()[0].memory_stats()
            print(step, jax.device_get(history[-1]), stats["bytes_in_use"])
    return state
'''
TPU_ERA = '''import jax
import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
devices = jax.devices("tpu")
params = jax.device_put_replicated(params, devices)
p_step = jax.pmap(train_step, axis_name="batch")
for batch in data:
    params, loss = p_step(params, batch)
    print(float(loss))
'''
PMAP_ONLY = '''import jax

step = jax.pmap(lambda x: x * 2)
'''
PREALLOC_ON = '''import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
import jax
'''
TPU_ENV = '''import os
os.environ["JAX_PLATFORMS"] = "tpu"
import jax
'''
NO_JAX = "x = 1\n"
# the clean script plus what only a TPU job needs: libtpu's variables, a fixed slice shape, bf16 optimizer state
LIBTPU_TUNED = CLEAN.replace("import jax\n", "import jax\nimport optax\n", 1) \
    + 'os.environ.get("LIBTPU_INIT_ARGS", "")\n'
SLICE_SHAPED = CLEAN + "assert jax.device_count() == 8\n"
BF16_STATE = CLEAN + "import optax\ntx = optax.adam(1e-3, mu_dtype=jnp.bfloat16)\n"
FRACTION_ONLY = '''import os
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.95"
import jax
'''
COMPUTED = '''import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(0.8)
import jax
'''
SMALL_SHARE = '''import os
os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.4"
import jax
'''
ANNOTATED = '''import jax

for step, batch in enumerate(data):
    with jax.profiler.StepTraceAnnotation("train", step_num=step):
        state = train_step(state, batch)
'''
TRACED = '''import jax

jax.profiler.start_trace("/tmp/trace")
'''


def code(text: str):
    return check_sources([("train.py", text)])


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A real compiled-for-target plan, and real CPU runs of it (one with a profile)."""
    return reused("checklist_world", make_world, tmp_path_factory)


def make_world(tmp):
    plan = plan_migration(PlanRequest(workload="transformer", preset="tiny", target="a100-40gb", global_batch=16,
                                      compile_for_tpu=False), lambda *a, **k: None)
    assert plan.ok and plan.prediction_method == "compiled-for-target"
    cfg = RunConfig(workload="transformer", preset="tiny", per_device_batch=plan.per_device_batch,
                    accumulation_steps=plan.accumulation_steps, precision=plan.precision, remat=plan.remat,
                    steps=5, warmup_steps=1, profile_steps=2, profile_dir=str(tmp / "trace"))
    run_cpu = run(cfg)
    reference = run(dataclasses.replace(cfg, precision="fp32", profile_steps=0, profile_dir=""))
    two_devices = run(dataclasses.replace(cfg, devices=2, per_device_batch=max(1, plan.per_device_batch // 2),
                                          profile_steps=0, profile_dir=""))
    for r in (run_cpu, reference, two_devices):
        assert r.ok, r.message + r.stderr_tail
    return {"plan": plan, "run": run_cpu, "ref": reference, "two": two_devices}


def on_gpu(r, **change):
    """The report as if measured on the plan's target GPU."""
    peak = change.pop("peak_memory_bytes", r.predicted_peak_bytes)
    return dataclasses.replace(r, backend="gpu", device_kind=TARGET_KIND, peak_memory_bytes=peak,
                               peak_memory_source="measured: memory_stats() peak_bytes_in_use", **change)


def full(plan):
    """The plan with its predicted peak at its whole budget: a smaller memory share cannot hold it."""
    return dataclasses.replace(plan, predicted_peak_bytes=plan.budget_bytes)


def gpus(plan, n, nodes=1):
    return dataclasses.replace(plan, gpus=n, nodes=nodes, gpus_per_node=n // nodes)


def infeasible(plan):
    return dataclasses.replace(plan, status="infeasible", message="does not fit even at batch 1 with remat full")


# (item, expected status, evidence builder, a phrase the evidence must contain)
CASES = [
    ("profile", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"])), "ms/step"),
    ("profile", WARN, lambda w: Evidence(w["plan"], w["run"]), "CPU backend"),
    ("profile", NOT_CHECKED, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], profile=None)), "no profile"),
    ("batch", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"])), "measured peak"),
    ("batch", FAIL, lambda w: Evidence(w["plan"], on_gpu(w["run"], peak_memory_bytes=w["plan"].budget_bytes + 1)),
     "measured peak"),
    ("batch", FAIL, lambda w: Evidence(infeasible(w["plan"])), "does not fit"),
    ("batch", FAIL, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], status="failed", failure_kind="oom",
                                                                     message="out of memory while running step 1")),
     "ran out of memory"),
    ("batch", WARN, lambda w: Evidence(w["plan"], w["run"]), "CPU backend"),
    ("batch", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], accumulation_steps=w["run"].accumulation_steps * 2,
                                                         per_device_batch=max(1, w["run"].per_device_batch // 2))),
     "re-fitted"),
    ("batch", WARN, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], status="failed", failure_kind="timeout",
                                                                     message="timeout")), "timeout"),
    ("batch", WARN, lambda w: Evidence(w["plan"]), "not run yet"),
    ("apis", PASS, lambda w: Evidence(w["plan"], code=code(CLEAN)), "no TPU-only"),
    ("apis", WARN, lambda w: Evidence(w["plan"], code=code(PMAP_ONLY)), "PMAP001"),
    ("apis", FAIL, lambda w: Evidence(w["plan"], code=code(TPU_ERA)), "REMOVED001"),
    ("apis", WARN, lambda w: Evidence(w["plan"], code=code(SLICE_SHAPED)), "TOPO001"),
    ("apis", NOT_CHECKED, lambda w: Evidence(w["plan"]), "not checked"),
    ("apis", NOT_CHECKED, lambda w: Evidence(w["plan"], code=code(NO_JAX)), "none of them uses JAX"),
    ("remat", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"])), "peaked at"),
    ("remat", WARN, lambda w: Evidence(w["plan"], w["run"]), "not yet measured on the target"),
    ("remat", WARN, lambda w: Evidence(dataclasses.replace(w["plan"], remat_chosen_by="override"), on_gpu(w["run"])),
     "override"),
    ("remat", WARN, lambda w: Evidence(dataclasses.replace(w["plan"], prediction_method="estimate"), on_gpu(w["run"])),
     "analytic estimate"),
    ("remat", NA, lambda w: Evidence(infeasible(w["plan"])), "no remat policy"),
    ("scaling", PASS, lambda w: Evidence(gpus(w["plan"], 2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), on_gpu(w["two"], device_count=2, samples_per_s=190.0))),
     "2 device(s) 95.0"),
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 2), w["run"], scaling_runs=(w["run"], w["two"])),
     "share the host"),
    # 1 and 2 GPUs measured, the plan spans two nodes: the count it runs at was never reached
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 16, nodes=2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), on_gpu(w["two"], device_count=2, samples_per_s=190.0))),
     "links between nodes not measured"),
    # measured on the target at every count, but per-device throughput drops to 60% from 1 to 2 GPUs
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), on_gpu(w["two"], device_count=2, samples_per_s=120.0))),
     "efficiency 60% from 1 to 2 (under 80%)"),
    ("scaling", NOT_CHECKED, lambda w: Evidence(gpus(w["plan"], 2), w["run"], scaling_runs=(w["run"],)),
     "one device count"),
    ("scaling", NA, lambda w: Evidence(w["plan"], w["run"], scaling_runs=(w["run"], w["two"])), "one A100"),
    # the plan's requested global batch is 16: 160 ms per step on the TPU is 100 samples/s
    ("benchmark", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"], samples_per_s=200.0), tpu_step_ms=160.0),
     "2.00x"),
    ("benchmark", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], samples_per_s=50.0), tpu_step_ms=160.0),
     "0.50x"),
    ("benchmark", WARN, lambda w: Evidence(w["plan"], w["run"], tpu_step_ms=160.0), "CPU backend"),
    ("benchmark", WARN, lambda w: Evidence(gpus(w["plan"], 8), on_gpu(w["run"], samples_per_s=50.0),
                                           tpu_step_ms=160.0), "linear scaling 4.00x"),
    # the TPU-style setup on the same GPU is not the user's TPU job: no pass from it
    ("benchmark", NOT_CHECKED, lambda w: Evidence(w["plan"], on_gpu(w["run"], samples_per_s=200.0),
                                                  tpu_style_run=on_gpu(w["ref"], samples_per_s=100.0)),
     "no measured figure of your TPU job"),
    ("benchmark", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "no measured figure of your TPU job"),
    ("benchmark", NOT_CHECKED, lambda w: Evidence(w["plan"]), "no successful run"),
    ("monitoring", PASS, lambda w: Evidence(w["plan"], w["run"], code=code(CLEAN)), "memory_stats"),
    ("monitoring", WARN, lambda w: Evidence(w["plan"], w["run"], code=code(TPU_ERA)), "no memory_stats()"),
    ("monitoring", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "not checked"),
    ("monitoring", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"], code=code(NO_JAX)), "none of them uses JAX"),
    ("monitoring", WARN, lambda w: Evidence(w["plan"], w["run"], code=code(ANNOTATED)), "no memory_stats()"),
    ("monitoring", WARN, lambda w: Evidence(w["plan"], w["run"], code=code(TRACED)), "captures profiler traces"),
    ("deployment", PASS, lambda w: Evidence(w["plan"], code=code(CLEAN)),
     "XLA_PYTHON_CLIENT_MEM_FRACTION: yours 0.8 (line 3), the plan's 0.80: as planned"),
    ("deployment", WARN, lambda w: Evidence(w["plan"], code=code(PMAP_ONLY)), "XLA_PYTHON_CLIENT_PREALLOCATE: yours not set"),
    ("deployment", WARN, lambda w: Evidence(w["plan"], code=code(FRACTION_ONLY)), "JAX preallocates by default"),
    ("deployment", WARN, lambda w: Evidence(w["plan"], code=code(COMPUTED)), "cannot compare with the plan"),
    ("deployment", FAIL, lambda w: Evidence(full(w["plan"]), code=code(SMALL_SHARE)), "under the plan's predicted peak"),
    ("deployment", NOT_CHECKED, lambda w: Evidence(w["plan"], code=code(NO_JAX)), "no JAX and no environment"),
    ("deployment", FAIL, lambda w: Evidence(w["plan"], code=code(TPU_ERA)), "ENV001"),
    ("deployment", FAIL, lambda w: Evidence(w["plan"], code=code(TPU_ENV)), "JAX_PLATFORMS=tpu"),
    ("deployment", WARN, lambda w: Evidence(w["plan"], code=code(LIBTPU_TUNED)), "TPU-only variables"),
    ("deployment", NOT_CHECKED, lambda w: Evidence(w["plan"]), "not checked"),
    ("recompilation", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"]), code=code(CLEAN)), "0 XLA compile(s)"),
    ("recompilation", WARN, lambda w: Evidence(w["plan"], w["run"]), "not checked"),
    ("recompilation", WARN, lambda w: Evidence(w["plan"], w["run"], code=code(CLEAN)), "CPU backend"),
    ("recompilation", FAIL, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], recompilations=2)),
     "2 XLA compile(s)"),
    ("recompilation", NOT_CHECKED, lambda w: Evidence(w["plan"]), "no successful run"),
    ("host_sync", PASS, lambda w: Evidence(w["plan"], code=code(CLEAN)), "no host sync"),
    ("host_sync", WARN, lambda w: Evidence(w["plan"], code=code(TPU_ERA)), "SYNC001"),
    ("host_sync", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "not checked"),
    ("host_sync", NOT_CHECKED, lambda w: Evidence(w["plan"], code=code(NO_JAX)), "none of them uses JAX"),
    ("preallocation", PASS, lambda w: Evidence(w["plan"], code=code(CLEAN)),
     "XLA_PYTHON_CLIENT_PREALLOCATE: yours false (line 2), the plan's false: as planned"),
    ("preallocation", WARN, lambda w: Evidence(w["plan"], code=code(PREALLOC_ON)), "preallocation on"),
    ("preallocation", WARN, lambda w: Evidence(w["plan"], code=code(PMAP_ONLY)), "JAX preallocates by default"),
    # only the fraction set, at 0.95: preallocation stays on, at 95%, and the plan assumed 0.80
    ("preallocation", WARN, lambda w: Evidence(w["plan"], code=code(FRACTION_ONLY)), "JAX preallocates by default"),
    ("preallocation", WARN, lambda w: Evidence(w["plan"], code=code(FRACTION_ONLY)),
     "0.95 lets the job take more of a shared GPU than the plan's 0.80"),
    ("preallocation", WARN, lambda w: Evidence(w["plan"], code=code(COMPUTED)), "computed at run time"),
    ("preallocation", FAIL, lambda w: Evidence(full(w["plan"]), code=code(SMALL_SHARE)),
     "0.40 leaves"),
    ("preallocation", NOT_CHECKED, lambda w: Evidence(w["plan"], code=code(NO_JAX)), "no JAX"),
    ("preallocation", FAIL, lambda w: Evidence(w["plan"], code=code(TPU_ERA)), "after `import jax`"),
    ("preallocation", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "not checked"),
    ("numerics", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0]),
                                          fp32_reference=on_gpu(w["ref"], losses=[4.0, 3.05])), "fp32 3.0500"),
    ("numerics", WARN, lambda w: Evidence(w["plan"], w["run"], fp32_reference=w["ref"]), "fp32"),
    ("numerics", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0]), fp32_reference=on_gpu(
        w["ref"], losses=[4.0, 3.05], fp32_matmul_precision="tf32")), "computed its fp32 products as tf32"),
    ("numerics", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 2.0]),
                                          fp32_reference=on_gpu(w["ref"], losses=[4.0, 3.0])), "tolerance"),
    ("numerics", FAIL, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, math.nan]),
                                          fp32_reference=w["ref"]), "nan"),
    ("numerics", NA, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], precision="fp32")), "fp32"),
    ("numerics", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "no fp32 reference"),
    ("numerics", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0]), code=code(BF16_STATE),
                                          fp32_reference=on_gpu(w["ref"], losses=[4.0, 3.05])), "BF16OPT001"),
    ("numerics", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"], fp32_reference=dataclasses.replace(
        w["ref"], losses=[4.0, None])), "no reference to compare"),
    ("pmap", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0], samples_per_s=200.0),
                                      pmap_run=on_gpu(w["run"], losses=[4.0, 3.0001], samples_per_s=160.0),
                                      code=code(CLEAN)), "1.25x"),
    # equal losses on the target, but the user's code still calls jax.pmap
    ("pmap", FAIL, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0], samples_per_s=200.0),
                                      pmap_run=on_gpu(w["run"], losses=[4.0, 3.0001], samples_per_s=160.0),
                                      code=code(PMAP_ONLY)), "still uses pmap"),
    ("pmap", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0], samples_per_s=200.0),
                                      pmap_run=on_gpu(w["run"], losses=[4.0, 3.0001], samples_per_s=160.0)),
     "for pmap-era calls"),
    ("pmap", WARN, lambda w: Evidence(w["plan"], w["run"], pmap_run=w["run"], code=code(CLEAN)), "CPU backend"),
    ("pmap", FAIL, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0]),
                                      pmap_run=on_gpu(w["run"], losses=[4.0, 3.5])), "largest relative loss difference"),
    ("pmap", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"]), "was not run"),
    ("pmap", NOT_CHECKED, lambda w: Evidence(w["plan"], w["run"], pmap_run=dataclasses.replace(
        w["run"], status="failed", failure_kind="oom", losses=[])), "pmap step failed"),
    # the mixture-of-experts items (tests/test_moe_checklist.py grades them from real MoE runs)
    ("moe_dropped", NA, lambda w: Evidence(w["plan"], w["run"]), "not a mixture-of-experts model"),
    ("moe_dropped", NA, lambda w: Evidence(moe(w["plan"], dispatch="dropless")), "dropless dispatch"),
    ("moe_dropped", NOT_CHECKED, lambda w: Evidence(moe(w["plan"])), "no run measured"),
    ("moe_dropped", PASS, lambda w: Evidence(moe(w["plan"]), routed(on_gpu(w["run"]), 0.004)), "0.40% of token slots"),
    ("moe_dropped", WARN, lambda w: Evidence(moe(w["plan"]), routed(w["run"], 0.004)), "CPU backend"),
    ("moe_dropped", FAIL, lambda w: Evidence(moe(w["plan"]), routed(on_gpu(w["run"]), 0.2)), "20.00% of token slots"),
    ("moe_grouped_gemm", NA, lambda w: Evidence(w["plan"], w["run"]), "not a mixture-of-experts model"),
    ("moe_grouped_gemm", NOT_CHECKED, lambda w: Evidence(moe(w["plan"])), "no run read"),
    ("moe_grouped_gemm", PASS, lambda w: Evidence(moe(w["plan"]), products(on_gpu(w["run"]), 1.3)), "1.30x the model"),
    ("moe_grouped_gemm", FAIL, lambda w: Evidence(moe(w["plan"]), products(on_gpu(w["run"]), 1.9)), "dense products"),
    ("moe_grouped_gemm", WARN, lambda w: Evidence(moe(w["plan"]), products(w["run"], 1.9)), "made a dense loop"),
    ("moe_all_to_all", NA, lambda w: Evidence(moe(w["plan"], sharding="fsdp")), "no expert parallelism"),
    ("moe_all_to_all", NOT_CHECKED, lambda w: Evidence(moe(w["plan"])), "no run"),
    ("moe_all_to_all", PASS, lambda w: Evidence(moe(w["plan"]), routed(on_gpu(w["run"]), 0.0)), "ran that expert split"),
    ("moe_all_to_all", WARN, lambda w: Evidence(moe(w["plan"]), routed(w["run"], 0.0)), "CPU backend"),
    # the router's type, from the user's code only (this product's float32 router is no evidence)
    ("moe_router_fp32", NA, lambda w: Evidence(w["plan"], code=code(ROUTER_FP32)), "not a mixture-of-experts"),
    ("moe_router_fp32", NOT_CHECKED, lambda w: Evidence(moe(w["plan"]), routed(on_gpu(w["run"]), 0.0)),
     "was not checked"),
    ("moe_router_fp32", NOT_CHECKED, lambda w: Evidence(moe(w["plan"]), code=code(CLEAN)), "no router found"),
    ("moe_router_fp32", PASS, lambda w: Evidence(moe(w["plan"]), code=code(ROUTER_FP32)), "softmax train.py:"),
    ("moe_router_fp32", FAIL, lambda w: Evidence(moe(w["plan"]), code=code(ROUTER_BF16)), "ROUTER001"),
    ("moe_router_fp32", WARN, lambda w: Evidence(moe(w["plan"]), code=code(ROUTER_UNSAID)), "does not say"),
]
ROUTER = CLEAN + "\ndef route(x, router_w):\n    router_logits = x @ router_w\n    return jax.nn.softmax({})\n"
ROUTER_FP32 = ROUTER.format("router_logits.astype(jnp.float32)")
ROUTER_BF16 = ROUTER.format("router_logits.astype(jnp.bfloat16)")
ROUTER_UNSAID = ROUTER.format("router_logits")


def moe(plan, dispatch="capacity", sharding="fsdp+ep2"):
    """The world's plan as a tiny capacity-dispatch MoE plan over 2 GPUs of a node with expert parallelism."""
    return dataclasses.replace(plan, workload="moe", preset="tiny", model={"dispatch": dispatch}, sharding=sharding,
                               gpus=2, gpus_per_node=8, domain_gpus=8)


def products(r, ratio):
    """The world's run as the MoE run whose compiled step's matrix products are `ratio` x the model's FLOPs."""
    return dataclasses.replace(routed(r, 0.0), compiled_matmul_flops=ratio * 1e9, model_flops_per_device_step=1e9,
                               remat="none")


def routed(r, dropped):
    """The world's run as a 2-device fsdp+ep2 MoE run whose router dropped `dropped` of its slots."""
    return dataclasses.replace(r, workload="moe", preset="tiny", devices=2, device_count=2, sharding="fsdp+ep2",
                               config={**r.config, "model": {"dispatch": "capacity"}}, router_dropped_mean=dropped,
                               router_dropped_max=dropped, router_load_mean=1.2, router_load_max=1.4)


@pytest.mark.parametrize("item,status,build,phrase", CASES, ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_each_item_grades_its_evidence(world, item, status, build, phrase):
    graded = {i.id: i for i in checklist.evaluate(build(world))}[item]
    assert graded.status == status, graded
    assert phrase in graded.evidence, graded.evidence
    assert graded.action


def test_every_status_every_item_can_return_is_covered(world):
    """Grading every case's evidence produces exactly the statuses the items declare: each declared
    status at least once, and none other (the grading itself refuses an undeclared one)."""
    produced = set()
    for item, status, build, _ in CASES:
        graded = {i.id: i.status for i in checklist.evaluate(build(world))}
        assert graded[item] == status, (item, status, graded[item])
        produced |= set(graded.items())
    declared = {(item, status) for item, spec in ITEMS.items() for status in spec.statuses}
    assert produced == declared, (sorted(declared - produced), sorted(produced - declared))


@pytest.mark.parametrize("items,item_id,evaluate,evidence", [
    (ITEMS, "host_sync", checklist.evaluate, lambda w: Evidence(w["plan"], code=code(CLEAN))),
    (serving.ITEMS, "export", serving.serving_checklist, lambda w: serving.ServingEvidence()),
], ids=["training", "serving"])
def test_a_grade_returning_an_undeclared_status_is_refused(world, monkeypatch, items, item_id, evaluate, evidence):
    spec = items[item_id]
    undeclared = next(s for s in (PASS, WARN, FAIL, NA, NOT_CHECKED) if s not in spec.statuses)
    ev = evidence(world)
    assert {i.id: i for i in evaluate(ev)}[item_id].status in spec.statuses
    monkeypatch.setitem(items, item_id, dataclasses.replace(spec, grade=lambda e: (undeclared, "evidence", "action")))
    with pytest.raises(checklist.UndeclaredStatus) as refused:
        evaluate(ev)
    assert str(refused.value) == (f"checklist item {item_id!r} graded {undeclared!r}, which it does not declare "
                                  f"(its statuses: {', '.join(spec.statuses)})")


def test_nothing_passes_on_this_tools_own_settings(world):
    """A real CPU run and a compiled prediction, without the user's code: no item passes."""
    items = checklist.evaluate(Evidence(world["plan"], world["run"], fp32_reference=world["ref"]))
    assert [i.id for i in items if i.status == PASS] == []


def test_the_batch_item_grades_the_configuration_that_ran(world):
    """A re-fit: the run is graded against the budget of the plan for the machine it ran on."""
    plan, run_cpu = world["plan"], world["run"]
    local = dataclasses.replace(plan, target="local", budget_bytes=plan.budget_bytes // 2,
                                per_device_batch=max(1, plan.per_device_batch // 2))
    ran = on_gpu(run_cpu, peak_memory_bytes=plan.budget_bytes // 2 + 1)
    item = {i.id: i for i in checklist.evaluate(Evidence(plan, ran, ran_plan=local))}["batch"]
    assert item.status == FAIL and f"ran {ran.per_device_batch} per device" in item.evidence
    assert TARGET_KIND in item.evidence  # which machine the figure comes from


def test_csv_has_one_row_per_item_and_the_snippet_sets_the_environment(world, tmp_path):
    """The CSV holds each item as the report has it: id, title, status, evidence and action, row by row."""
    items = checklist.evaluate(Evidence(world["plan"], on_gpu(world["run"]), code=code(TPU_ERA)))
    statuses = {i.id: i.status for i in items}
    assert {PASS, WARN, FAIL, NA, NOT_CHECKED} <= set(statuses.values()), statuses
    text = checklist.to_csv(items, tmp_path / "c.csv")
    assert (tmp_path / "c.csv").read_text() == text
    header, *rows = list(csv.reader(io.StringIO(text)))
    assert header == ["id", "item", "status", "evidence", "action"]
    assert [i.id for i in items] == list(ITEMS)
    assert len(rows) == len(items)
    for row, i in zip(rows, items):
        assert dict(zip(header, row)) == {"id": i.id, "item": ITEMS[i.id].title, "status": i.status,
                                          "evidence": i.evidence, "action": i.action}, i.id
    snippet = deployment.deployment_snippet(world["plan"])
    assert "export XLA_PYTHON_CLIENT_PREALLOCATE=false" in snippet and snippet.startswith("#!/usr/bin/env bash")


def test_an_empty_checklist_exports_its_header():
    assert checklist.to_csv([]) == "id,item,status,evidence,action\n"


def test_a_plan_from_an_older_version_is_refused_with_a_clear_message(world):
    from migration.results import Plan

    data = world["plan"].to_dict()
    for field in ("ranked", "budget_source", "remat_chosen_by"):
        data.pop(field)
    with pytest.raises(ValueError, match="older version"):
        Plan.from_dict(data)
    assert Plan.from_dict(world["plan"].to_dict()) == world["plan"]


# -- the words, case by case ----------------------------------------------------------------------

GOLDEN = Path(__file__).parent / "golden" / "checklist_texts.json"
UPDATE = "MIGRATION_UPDATE_GOLDEN"


def pinned(w):
    """The world with every figure a grade prints fixed (measured and compiled figures vary with the
    machine and the JAX version), so that each case's evidence and action compare word for word."""
    plan = dataclasses.replace(w["plan"], per_device_batch=8, accumulation_steps=2, global_batch=16,
                               source_per_core_batch=2, predicted_peak_bytes=3 * 2**30, remat="dots",
                               max_batch_by_remat={"none": 24, "dots": 40, "full": 64}, precision="bf16")
    profile = {"steps": 2, "path": "/runs/trace", "top_ops": [
        {"name": "fusion.3", "total_ms": 9.0}, {"name": "dot.1", "total_ms": 5.0}]}
    common = dict(jax_version="0.10.2", compile_s=2.5, step_ms_median=40.0, peak_memory_bytes=5 * 2**29,
                  peak_memory_source="compiled: memory_analysis()", predicted_peak_bytes=3 * 2**30,
                  recompilations=0, remat="dots", peak_tflops=50.0, backend="cpu", device_kind="cpu",
                  accumulation_steps=2, global_batch=16, fp32_matmul_precision=None)
    run = dataclasses.replace(w["run"], **common, precision="bf16", per_device_batch=8, devices=1, device_count=1,
                              samples_per_s=400.0, losses=[4.5, 4.0, 3.5, 3.25], profile=profile)
    ref = dataclasses.replace(w["ref"], **common, precision="fp32", per_device_batch=8, devices=1, device_count=1,
                              samples_per_s=300.0, losses=[4.5, 4.0, 3.5, 3.3], profile=None)
    two = dataclasses.replace(w["two"], **common, precision="bf16", per_device_batch=4, devices=2, device_count=2,
                              samples_per_s=700.0, losses=[4.5, 4.0, 3.5, 3.25], profile=None)
    return {"plan": plan, "run": run, "ref": ref, "two": two}


def many(line: str, n: int) -> str:
    return "import jax\n" + "\n".join([line] * n) + "\n"


# Branches the status cases above leave out, and the edges of what a text lists.
TEXT_CASES = CASES + [
    ("profile", NOT_CHECKED, lambda w: Evidence(w["plan"]), "no profile"),
    ("profile", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"], profile={
        "steps": 1, "path": "/runs/one", "top_ops": [{"name": f"op.{i}", "total_ms": 6.0 - i} for i in range(6)]})),
     "op.0 6.00 ms/step"),
    ("batch", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], global_batch=17)), "global batch changed"),
    ("batch", WARN, lambda w: Evidence(dataclasses.replace(w["plan"], prediction_method="estimate")), "estimate"),
    ("batch", WARN, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], accumulation_steps=4)),
     "re-fitted to this machine"),
    ("apis", FAIL, lambda w: Evidence(w["plan"], code=code(many('d = jax.devices("tpu")', 9))), "TPU001"),
    ("remat", WARN, lambda w: Evidence(dataclasses.replace(w["plan"], prediction_method="compiled-local",
                                                           planned_on="cpu")), "CPU-backend compile"),
    ("scaling", NOT_CHECKED, lambda w: Evidence(gpus(w["plan"], 16, nodes=2), w["run"], scaling_runs=(w["run"],)),
     "over 2 nodes"),
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 16, nodes=2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), on_gpu(w["two"], device_count=4, samples_per_s=390.0),
        on_gpu(w["two"], device_count=8, samples_per_s=760.0))), "from 1 to 8"),
    ("benchmark", NOT_CHECKED, lambda w: Evidence(w["plan"], on_gpu(w["run"], peak_tflops=None), tpu_style_run=dataclasses.replace(
        w["ref"], status="failed", failure_kind="oom")), "the TPU-style setup run here failed (oom)"),
    ("benchmark", WARN, lambda w: Evidence(gpus(w["plan"], 2), on_gpu(w["run"], device_count=None, samples_per_s=50.0),
                                           tpu_step_ms=160.0), "linear scaling 1.00x"),
    ("monitoring", PASS, lambda w: Evidence(w["plan"], code=code(many("s = jax.devices()[0].memory_stats()", 7))),
     "memory_stats"),
    ("monitoring", WARN, lambda w: Evidence(w["plan"], code=code(many('jax.profiler.start_trace("/tmp/t")', 7))),
     "captures profiler traces"),
    ("preallocation", PASS, lambda w: Evidence(dataclasses.replace(w["plan"], environment={
        **w["plan"].environment, "XLA_FLAGS": {"value": "--xla_gpu_enable_latency_hiding_scheduler=true",
                                               "why": "overlap"}}), code=code(CLEAN)), "as planned"),
    ("recompilation", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"]), code=code(
        "import jax\nds = ds.batch(32)\n")), "SHAPE001"),
    ("recompilation", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"]), code=code(NO_JAX)), "none of them uses JAX"),
    ("numerics", PASS, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[0.6, 0.52]),
                                          fp32_reference=on_gpu(w["ref"], losses=[0.6, 0.5])), "4.0% apart"),
    ("pmap", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], losses=[4.0, 3.0], samples_per_s=200.0),
                                      pmap_run=on_gpu(w["run"], losses=[4.0, 3.0001], samples_per_s=160.0),
                                      code=code(NO_JAX)), "found no JAX"),
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), w["two"])), "(cpu), not on"),
    ("scaling", WARN, lambda w: Evidence(gpus(w["plan"], 2), on_gpu(w["run"]), scaling_runs=(
        on_gpu(w["run"], device_count=1, samples_per_s=100.0), dataclasses.replace(
            on_gpu(w["two"], samples_per_s=190.0), device_kind="NVIDIA H100 80GB HBM3"))), "not on the target"),
    ("benchmark", NOT_CHECKED, lambda w: Evidence(w["plan"], on_gpu(w["run"], device_count=None, devices=2),
                                                  tpu_style_run=on_gpu(w["ref"], samples_per_s=None)),
     "the TPU-style setup run here ok (no throughput)"),
    ("monitoring", PASS, lambda w: Evidence(w["plan"], code=code(
        "import jax\nimport subprocess\nsubprocess.run(['nvidia-smi'])\n")), "nvidia-smi"),
    ("deployment", FAIL, lambda w: Evidence(w["plan"], code=code(
        'import os\nos.environ["JAX_PLATFORMS"] = "tpu"\nos.environ["JAX_PLATFORM_NAME"] = "tpu"\nimport jax\n')),
     "JAX_PLATFORM_NAME=tpu line 3"),
    ("preallocation", FAIL, lambda w: Evidence(w["plan"], code=code(
        'import jax\nimport os\nos.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"\n'
        'os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.8"\n')), "ignored"),
    ("pmap", NOT_CHECKED, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], status="failed",
                                                                         failure_kind="timeout"), pmap_run=w["run"]),
     "the migrated step failed (timeout)"),
    ("pmap", NOT_CHECKED, lambda w: Evidence(w["plan"], pmap_run=w["run"]), "the migrated step has not run"),
    ("pmap", NOT_CHECKED, lambda w: Evidence(w["plan"], dataclasses.replace(w["run"], losses=[]), pmap_run=w["run"]),
     "the migrated step ok (no losses)"),
    ("batch", WARN, lambda w: Evidence(w["plan"], on_gpu(w["run"], peak_memory_bytes=None)), "reported no peak memory"),
]


def texts(w) -> dict[str, list[str]]:
    out = {}
    for i, (item, status, build, phrase) in enumerate(TEXT_CASES):
        graded = ITEMS[item].grade(build(w))
        assert graded[0] == status and phrase in graded[1], (i, item, graded)
        out[f"{i:03d} {item} {status}"] = list(graded)
    return out


def test_every_case_reads_word_for_word_as_reviewed(world):
    """Each case's status, evidence and action, against tests/golden/checklist_texts.json: what a user
    reads is reviewed like code. After a deliberate change of wording, rewrite the file with
    `MIGRATION_UPDATE_GOLDEN=1 python -m pytest tests/test_checklist.py -k word_for_word` and read its diff."""
    got = texts(pinned(world))
    if os.environ.get(UPDATE):
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(got, indent=1, ensure_ascii=False) + "\n")
    want = json.loads(GOLDEN.read_text())
    assert list(got) == list(want), "the cases changed: rewrite the golden file and review it"
    for key in want:
        assert got[key] == want[key], key
