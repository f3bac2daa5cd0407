"""Predicted step time against published measurements of JAX/XLA training on NVIDIA GPUs.

For every entry of bench/published.json (model, GPUs, batch, sequence, precision, remat, measured
step time, sequences/s or TFLOP/s per device, with its source): compile this product's train step
for that configuration and target without the devices (the planner's deviceless XLA GPU compile),
read the program (migration/planning/hlo_cost.py), predict its step time
(migration/planning/steptime.py) and print it beside the published figure, with the error of each
and the worst. Each entry says how its stated setup maps onto this product's (`MAPPING`): remat
policy, attention kernel, how the state is held.

The calibration (steptime.CALIBRATION) is fitted on the entries marked "tune" (`--fit` searches a
grid for the least root-mean-square log error and prints the best); the entries marked "held-out" were frozen before any fit and are scored
apart, never used to choose a constant.

    python bench/published_check.py            # the table (compiles cached under the cache folder)
    python bench/published_check.py --fit      # search the calibration on the tuning entries
    python bench/published_check.py --only ID  # one entry
    python bench/published_check.py --picked   # also plan each entry as a user would and score the picked plan
    python bench/published_check.py --tpu      # the TPU side against bench/published_tpu.json (tpu_published.py)
    python bench/published_check.py --moe      # mixture-of-experts rows, GPU and TPU (moe_published.py)

Compiles take 5-60 s each on two cores (the first run); later runs read them from the cache.
"""

from __future__ import annotations

import os

import argparse
import dataclasses
import gzip
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migration.running.worker_env import (  # noqa: E402  (imports no JAX)
    DISABLE_XLA_REMAT,
    LIBTPU_COMPILE_ONLY,
    NO_CODEGEN_OPTIMISATION,
)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
# The step compiled as the planner compiles it (XLA's rematerialisation off), by XLA's default pipeline
# otherwise: a caller's NO_CODEGEN_OPTIMISATION and CPU-backend flags (the test suite's processes carry both;
# the programs here are GPU and TPU programs, which no --xla_cpu_ flag shapes) are dropped, so that the stored
# programs and their keys are the same whoever starts this script.
os.environ["XLA_FLAGS"] = " ".join(
    [f for f in os.environ.get("XLA_FLAGS", "").split()
     if f not in (NO_CODEGEN_OPTIMISATION, DISABLE_XLA_REMAT) and not f.startswith("--xla_cpu_")]
    + [DISABLE_XLA_REMAT])
for _name, _value in LIBTPU_COMPILE_ONLY.items():  # libtpu compiles only, in any number of processes
    os.environ.setdefault(_name, _value)

from bench import record  # noqa: E402
from migration.common import cache_dir, read_json, write_json_atomic  # noqa: E402
from migration.hardware import GPU_SPECS, Links  # noqa: E402
from migration.planning import steptime  # noqa: E402
from migration.planning.hlo_cost import Kernel  # noqa: E402

PUBLISHED = Path(__file__).with_name("published.json")

# How each published setup runs as this product's step: remat policy (ours closest to theirs),
# attention kernel, state sharding, and whether the entry tunes the calibration or is held out.
# MaxText's minimal_flash saves the dots without batch dimensions (and the flash output): ours
# dots_no_batch. Pax SAVE_DOT_WITH_NO_BATCH_DIM is dots_no_batch, SAVE_NOTHING full, SAVE_DOT_ONLY
# dots; MaxText's save_qkv_proj and the custom qkv policy are save_qkv. Flash / TE attention is
# cuDNN's fused attention; Pax's 126M ran without it, and with its layers unrolled (GPT126MBase:
# USE_REPEATED_LAYER=False, in the entries' notes since they were recorded): `UNROLLED`. DP-only jobs
# hold the state replicated; FSDP (and FSDP within nodes with data parallelism between them up to 256
# GPUs, which this product runs as FSDP over every GPU) is fsdp.
MAPPING = {
    "jaxtoolbox-maxtext-llama2-7b-8xh100-bf16": ("dots_no_batch", "cudnn", "fsdp", "tune"),
    "maxtext-a3-llama2-7b-1node-h100-bf16": ("dots_no_batch", "cudnn", "fsdp", "tune"),
    "maxtext-a3-llama2-7b-2node-h100-bf16": ("dots_no_batch", "cudnn", "fsdp", "tune"),
    "maxtext-a3-llama2-7b-16node-h100-bf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "pax-gpt126m-64xa100-bf16": ("none", "xla", "replicated", "tune"),
    "pax-gpt5b-256xa100-bf16": ("dots_no_batch", "cudnn", "fsdp", "tune"),
    "pax-gpt175b-256xa100-tebf16": ("full", "cudnn", "fsdp", "held-out"),
    "pax-gpt126m-64xh100-tebf16": ("none", "xla", "replicated", "held-out"),
    "pax-gpt5b-256xh100-tebf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "pax-gpt175b-256xh100-tebf16": ("full", "cudnn", "fsdp", "held-out"),
    "pax-llama2-7b-sft-16xh100-bf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "dgxc-paxml-gpt5b-16xh100-bf16": ("dots", "cudnn", "fsdp", "tune"),
    "dgxc-maxtext-llama2-70b-64xh100-bf16": ("save_qkv", "cudnn", "fsdp", "tune"),
    "dgxc-maxtext-llama3-70b-128xh100-bf16": ("save_qkv", "cudnn", "fsdp", "held-out"),
    # Added after the calibration was fitted, and never used to choose a constant: more rows of the same
    # tables at 32 to 128 GPUs, and Google's GPU recipes at 256 H100 / H200 (MaxText's save_dot_except_mlp
    # is ours by name).
    "maxtext-a3-llama2-7b-4node-bf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "maxtext-a3-llama2-7b-8node-bf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "dgxc-maxtext-llama2-70b-128xh100-bf16": ("save_qkv", "cudnn", "fsdp", "held-out"),
    "dgxc-paxml-gpt5b-128xh100-bf16": ("dots", "cudnn", "fsdp", "held-out"),
    "gpurecipes-a3mega-llama2-7b-256gpu-bf16": ("dots_no_batch", "cudnn", "fsdp", "held-out"),
    "gpurecipes-a3ultra-llama3.1-70b-256gpu-bf16": ("save_dot_except_mlp", "cudnn", "fsdp", "held-out"),
    # Added with hybrid layouts, never used to choose a constant: the other columns of the same DGX Cloud 70B
    # tables, 256 to 2,048 H100s. From 512 GPUs the recipe runs FSDP over 128 GPUs (16 nodes: ici_fsdp 8 x
    # dcn_fsdp 16) and data parallelism across those groups (dcn_data): this product's hybrid:128.
    **{f"dgxc-maxtext-{family}-70b-{gpus}xh100-bf16": ("save_qkv", "cudnn", "fsdp" if gpus == 256 else "hybrid:128",
                                                        "held-out")
       for family in ("llama2", "llama3") for gpus in (256, 512, 1024, 2048)},
    # fp8, added with the fp8 policy and all held out (no constant was refitted for fp8): the DGX Cloud tables'
    # fp8 columns on H100 (MaxText and Paxml, Transformer Engine's per-tensor scaling: this product's fp8) and
    # Google's GPU recipes on 256 B200 (MaxText fp8, per-tensor: fp8 here too, not mxfp8). Remat by name as
    # above (Pax SAVE_QKV_OUT_PROJ keeps q, k, v and the output projection: save_dot_except_mlp); Pax's DCN mesh
    # [N, 1, 1] with FSDP 8 inside a node is hybrid:8, MaxText's FSDP over 128 GPUs with dcn_data hybrid:128.
    "dgxc-maxtext-llama2-70b-64xh100-fp8": ("save_dot_except_mlp", "cudnn", "fsdp", "held-out"),
    "dgxc-maxtext-llama2-70b-512xh100-fp8": ("save_dot_except_mlp", "cudnn", "hybrid:128", "held-out"),
    "dgxc-maxtext-llama2-70b-2048xh100-fp8": ("save_dot_except_mlp", "cudnn", "hybrid:128", "held-out"),
    "dgxc-maxtext-llama3-70b-128xh100-fp8": ("save_qkv", "cudnn", "fsdp", "held-out"),
    "dgxc-maxtext-llama3-70b-2048xh100-fp8": ("save_qkv", "cudnn", "hybrid:128", "held-out"),
    "dgxc-paxml-gpt5b-16xh100-fp8": ("dots", "cudnn", "hybrid:8", "held-out"),
    "dgxc-paxml-gpt5b-128xh100-fp8": ("dots", "cudnn", "hybrid:8", "held-out"),
    "dgxc-paxml-gpt175b-128xh100-fp8": ("save_dot_except_mlp", "cudnn", "fsdp", "held-out"),
    "dgxc-paxml-gpt175b-2048xh100-fp8": ("save_dot_except_mlp", "cudnn", "hybrid:128", "held-out"),
    "gpurecipes-a4-llama3.1-70b-256gpu-fp8": ("full", "cudnn", "fsdp", "held-out"),
    "gpurecipes-a4-llama3.1-405b-256gpu-fp8": ("full", "cudnn", "hybrid:128", "held-out"),
}


# Entries whose model runs its layers as a Python loop, not one scan over stacked layers.
UNROLLED = {"pax-gpt126m-64xa100-bf16", "pax-gpt126m-64xh100-tebf16"}


def run_config(entry: dict):
    from migration.config.requests import RunConfig

    if "moe" in entry:  # a mixture-of-experts entry (bench/published_moe.json)
        from bench.moe_published import gpu_config

        return gpu_config(entry)
    remat, attention, sharding, _ = MAPPING[entry["id"]]
    m = entry["model"]
    swiglu = m["mlp"] == "swiglu"
    model = {"n_layers": m["n_layers"], "d_model": m["d_model"], "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"],
             "d_ff": m["d_ff"], "vocab_size": m["vocab_size"], "seq_len": m["seq_len"], "attention": attention,
             "tied_embeddings": m["tied_embeddings"]}
    if entry["id"] in UNROLLED:
        model["layer_loop"] = "unrolled"
    if swiglu:
        model["rope_scaling"] = 1.0  # Llama 2 and Llama 3 70B (3.0): no frequency scaling
    return RunConfig(workload="llama" if swiglu else "transformer", preset="8b" if swiglu else "gpt2-small",
                     model=model, per_device_batch=entry["per_device_batch"], devices=entry["gpus"],
                     precision=entry["precision"], remat=remat, sharding=sharding)


def program_cache_key(entry: dict) -> str:
    from migration.planning.compile_cache import code_fingerprint, package_versions

    cfg = run_config(entry)
    parts = [cfg.to_dict(), entry["gpu"], entry["nodes"], code_fingerprint(), package_versions(), os.environ["XLA_FLAGS"],
             (ROOT / "migration/planning/hlo_cost.py").read_text()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def compile_text(entry: dict) -> tuple[str, float]:
    """This product's step for the entry, compiled for its target without the devices: the optimized HLO
    text, and the seconds the compile took."""
    from jax.experimental import topologies

    from migration.hardware import gpu_target_config
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    spec = GPU_SPECS[entry["gpu"]]
    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(spec),
                                        topology=f"1x{entry['nodes']}x{per_node(entry)}")
    program = TrainProgram.from_config(run_config(entry))
    mesh = make_mesh(topo.devices, program.sharding)
    t0 = time.perf_counter()
    compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
    seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
    return compiled.as_text(), seconds


def per_node(entry: dict) -> int:
    return entry["gpus"] // entry["nodes"]


def compile_kernels(entry: dict) -> tuple[list[Kernel], float]:
    """The kernels of this product's step for the entry, compiled for its target without the devices."""
    from migration.planning.hlo_cost import read_program

    text, seconds = compile_text(entry)
    return read_program(text, per_node=per_node(entry)), seconds


# -- the entries the test suite checks ---------------------------------------------------------------
# One per model family and GPU (and fp8 on both fp8 GPUs): tests/test_published_ci.py reads their compiled
# programs, stored gzip'd in tests/fixtures/published/ with the key of what built them, predicts each step and
# asserts the error band the product states and the error bench/results records. A program whose key is not
# this checkout's (the model or step code, JAX or the flags changed) is compiled again there: slower, still
# right. `--write-fixtures` stores this checkout's.
CI_ENTRIES = ("jaxtoolbox-maxtext-llama2-7b-8xh100-bf16", "pax-gpt126m-64xa100-bf16",
              "gpurecipes-a3ultra-llama3.1-70b-256gpu-bf16", "dgxc-paxml-gpt5b-16xh100-fp8",
              "gpurecipes-a4-llama3.1-70b-256gpu-fp8")
FIXTURES = ROOT / "tests" / "fixtures" / "published"
# The code that builds the compiled step (not the reader or the step-time model: the stored program is read by them)
PROGRAM_SOURCES = ("workloads", "migration/step", "migration/config", "migration/hardware.py")
XLA_FLAGS = os.environ["XLA_FLAGS"]  # as set above, when this module was first imported


def program_key(entry: dict) -> str:
    """What decides the entry's compiled program: its configuration and target, the packages' versions, the
    XLA flags and the code that builds the step."""
    from migration.planning.compile_cache import package_versions

    parts = [run_config(entry).to_dict(), entry["gpu"], entry["nodes"], package_versions(), XLA_FLAGS,
             program_sources_digest()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def program_sources_digest() -> str:
    """sha256 over PROGRAM_SOURCES: the code that builds a compiled step (a stored program's text stays valid
    across changes to the reader and the step-time model, which read it)."""
    digest = hashlib.sha256()
    for source in PROGRAM_SOURCES:
        path = ROOT / source
        for file in sorted([path] if path.is_file() else path.rglob("*.py")):
            digest.update(file.relative_to(ROOT).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def stored_program(entry: dict, folder: Path = FIXTURES) -> str | None:
    """The entry's stored HLO text when it was built by what this checkout would build it with, else None."""
    meta = read_json(folder / f"{entry['id']}.json", {})
    if meta.get("key") != program_key(entry):
        return None
    return gzip.decompress((folder / f"{entry['id']}.hlo.gz").read_bytes()).decode()


def write_fixture(entry: dict, folder: Path = FIXTURES) -> float:
    """Compile the entry and store its program and key in `folder`; the compile's seconds."""
    text, seconds = compile_text(entry)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{entry['id']}.hlo.gz").write_bytes(gzip.compress(text.encode(), 9, mtime=0))
    write_json_atomic(folder / f"{entry['id']}.json", {"key": program_key(entry), "compile_s": round(seconds, 1)})
    return seconds


def kernels_for(entry: dict, cache: dict) -> list[Kernel]:
    key = program_cache_key(entry)
    if key not in cache:
        kernels, seconds = compile_kernels(entry)
        cache[key] = [dataclasses.asdict(k) for k in kernels]
        write_json_atomic(cache_dir() / "published_programs.json", cache)
        print(f"  compiled {entry['id']} in {seconds:.0f} s", file=sys.stderr)
    return [Kernel(**k) for k in cache[key]]


def source_flops_per_device(entry: dict) -> float:
    """The FLOPs per device per step by the source's own definition (entries that print TFLOP/s)."""
    m, b = entry["model"], entry["per_device_batch"]
    d, s, layers, heads = m["d_model"], m["seq_len"], m["n_layers"], m["n_heads"]
    dh = d // heads
    kv = m["n_kv_heads"] * dh
    mlp = (3 if m["mlp"] == "swiglu" else 2) * d * m["d_ff"]
    block = 2 * d * d + 2 * d * kv + mlp
    if "WITHOUT causal halving" in (entry.get("tflops_definition") or ""):
        attention = 12 * heads * layers * dh * s * s * b  # no causal halving
        return 6 * (layers * block + m["vocab_size"] * d) * s * b + attention
    params = layers * block + m["vocab_size"] * d * (1 if m["tied_embeddings"] else 2)
    return 6 * params * s * b + 12 * heads * layers * dh * s * s * b / 2


def published_step(entry: dict) -> tuple[float, str]:
    measured = entry["measured"]
    if measured.get("step_time_s"):
        return measured["step_time_s"], "step time as published"
    if measured.get("sequences_per_s_total"):
        return entry["global_batch"] / measured["sequences_per_s_total"], \
            f"global batch {entry['global_batch']} / {measured['sequences_per_s_total']} sequences/s"
    tflops = measured["tflops_per_device"]
    return source_flops_per_device(entry) / (tflops * 1e12), f"the source's FLOPs per device / {tflops} TFLOP/s"


def predict(entry: dict, kernels: list[Kernel], cal: steptime.Calibration) -> steptime.StepPrediction:
    spec = GPU_SPECS[entry["gpu"]]
    return steptime.predict(kernels, spec, Links.of(spec.key, entry["nodes"]), cal)


def error(predicted: float, published: float) -> float:
    return predicted / published - 1


def table(entries: list[dict], programs: dict[str, list[Kernel]], cal: steptime.Calibration,
          rows: list[list[str]] | None = None) -> dict[str, float]:
    """Prints each entry's published and predicted step time (and appends them to `rows` for the record)."""
    from workloads import get_workload

    print(f"{'entry':<42} {'split':<8} {'GPUs':>9} {'batch':>9} {'published':>10} {'predicted':>10} {'error':>7} "
          f"{'TFLOP/s/GPU pub':>15} {'pred':>6}  exposed comm")
    worst: dict[str, float] = {}
    for e in entries:
        published, how = published_step(e)
        p = predict(e, programs[e["id"]], cal)
        err = error(p.seconds, published)
        split = MAPPING[e["id"]][3]
        for group in (f"{split} entries", f"entries with {MAPPING[e['id']][1]} attention"):
            worst[group] = max(worst.get(group, 0.0), abs(err))
        cfg = run_config(e)
        w = get_workload(cfg.workload)
        model_flops = w.flops_per_example(w.config(cfg.preset, cfg.model)) * e["per_device_batch"]
        print(f"{e['id']:<42} {split:<8} {e['gpus']:>4}x{e['gpu']:<4.4} {e['global_batch']:>4}/{e['per_device_batch']:<4} "
              f"{published:>9.3f}s {p.seconds:>9.3f}s {err:>+7.1%} {model_flops / published / 1e12:>15.0f} "
              f"{model_flops / p.seconds / 1e12:>6.0f}  {p.exposed_communication_s * 1e3:,.0f} ms")
        if rows is not None:
            rows.append([e["id"], split, f"{e['gpus']}x{e['gpu']}", f"{e['global_batch']}/{e['per_device_batch']}",
                         f"{published:.3f}s", f"{p.seconds:.3f}s", f"{err:+.1%}"])
    print("\nTFLOP/s per GPU: this product's model FLOPs (workload.flops_per_example, PaLM's convention: no remat, "
          "full attention) over the published and the predicted step time.")
    for group, value in sorted(worst.items()):
        print(f"worst error, {group}: {value:.1%}")
    return worst


def fit(entries: list[dict], programs: dict[str, list[Kernel]]) -> steptime.Calibration:
    from bench.calibration import search

    tune = [e for e in entries if MAPPING[e["id"]][3] == "tune"]
    grid = ((0.55, 0.6, 0.65, 0.7, 0.75, 0.8), (0.35, 0.45, 0.55, 0.65), (0.6, 0.7, 0.8, 0.9), (2e-6, 4e-6, 8e-6),
            (0.6, 0.7, 0.8, 0.9))
    return search(tune, lambda e, cal: predict(e, programs[e["id"]], cal).seconds, lambda e: published_step(e)[0],
                  grid, steptime.CALIBRATION)


def picked_plan(entry: dict):
    """The plan this product picks for the entry's job, as a user would ask for it: the model, the GPUs and
    nodes, the global batch and the attention kernel the run used; layout, remat, per-device batch and
    accumulation left to the planner (deviceless compiles, the compile cache shared with the planner)."""
    from migration.config.requests import PlanRequest
    from migration.planning.planner import plan_migration

    cfg = run_config(entry)
    req = PlanRequest(workload=cfg.workload, preset=cfg.preset, model=dict(cfg.model), source="tpu-v5p-64",
                      global_batch=entry["global_batch"], target=entry["gpu"], gpus=entry["gpus"],
                      gpus_per_node=entry["gpus"] // entry["nodes"], compile_for_tpu=False)
    t0 = time.perf_counter()
    plan = plan_migration(req, lambda *a, **k: None)
    return plan, time.perf_counter() - t0


def picked_table(entries: list[dict]) -> tuple[list[list[str]], list[str]]:
    """Each entry's picked plan beside the published run: its layout, its predicted step against the
    published one, and whether the published layout (forced, `predict`) would be faster by this product's
    own compiled figures."""
    print(f"\n{'entry':<44} {'split':<8} {'picked':<44} {'published':>10} {'predicted':>10} {'error':>7} {'plan s':>7}")
    rows, notes = [], []
    for e in entries:
        plan, seconds = picked_plan(e)
        published, _ = published_step(e)
        if plan.status != "ok" or plan.predicted_step_s is None:
            print(f"{e['id']:<44} no plan: {plan.message}")
            rows.append([e["id"], MAPPING[e["id"]][3], "no plan", f"{published:.3f}s", "", "", f"{seconds:.0f}"])
            continue
        picked = f"{plan.sharding} {plan.remat} {plan.per_device_batch}x{plan.accumulation_steps}"
        err = error(plan.predicted_step_s, published)
        print(f"{e['id']:<44} {MAPPING[e['id']][3]:<8} {picked:<44} {published:>9.3f}s {plan.predicted_step_s:>9.3f}s "
              f"{err:>+7.1%} {seconds:>7.0f}")
        rows.append([e["id"], MAPPING[e["id"]][3], picked, f"{published:.3f}s", f"{plan.predicted_step_s:.3f}s",
                     f"{err:+.1%}", f"{seconds:.0f}"])
    for split in ("tune", "held-out"):
        errors = [abs(float(r[5].rstrip("%"))) for r in rows if r[1] == split and r[5]]
        if errors:
            notes.append(f"Picked plans, {split} entries: median error {statistics.median(errors):.1f}%, worst "
                         f"{max(errors):.1f}% ({len(errors)} entries).")
    for n in notes:
        print(n)
    return rows, notes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--moe" in argv:  # mixture-of-experts rows, GPU and TPU (bench/moe_published.py)
        from bench import moe_published

        return moe_published.main([a for a in argv if a != "--moe"])
    if "--tpu" in argv:  # the TPU side against published TPU measurements (bench/tpu_published.py)
        from bench import tpu_published

        return tpu_published.main([a for a in argv if a != "--tpu"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="search the calibration on the tuning entries")
    parser.add_argument("--only", help="one entry by id")
    parser.add_argument("--match", help="the entries whose id contains this text (e.g. fp8)")
    parser.add_argument("--json", metavar="PATH", help="write the table as a record (bench/results/published_check.json)")
    parser.add_argument("--picked", action="store_true", help="also score the plan the product picks for each entry")
    parser.add_argument("--write-fixtures", metavar="DIR", nargs="?", const=str(FIXTURES),
                        help=f"compile the entries the test suite checks and store their programs (default {FIXTURES})")
    args = parser.parse_args(argv)
    if args.write_fixtures:
        entries = {e["id"]: e for e in json.loads(PUBLISHED.read_text())}
        for entry_id in ([args.only] if args.only else CI_ENTRIES):
            if entry_id not in entries:
                parser.error(f"--only {entry_id}: no such entry in {PUBLISHED.name}")
            seconds = write_fixture(entries[entry_id], Path(args.write_fixtures))
            print(f"{entry_id}: compiled in {seconds:.0f} s, stored in {args.write_fixtures}")
        return 0
    entries = [e for e in json.loads(PUBLISHED.read_text()) if (not args.only or e["id"] == args.only)
               and (not args.match or args.match in e["id"])]
    cache = read_json(cache_dir() / "published_programs.json", {})
    programs = {e["id"]: kernels_for(e, cache) for e in entries}
    cal = fit(entries, programs) if args.fit else steptime.CALIBRATION
    print(f"calibration: {cal}\n")
    rows: list[list[str]] = []
    worst = table(entries, programs, cal, rows)
    for e in entries:
        print(f"  {e['id']}: {published_step(e)[1]}; {e['source_url']}")
    notes = [f"Worst error, {group}: {value:.1%}." for group, value in sorted(worst.items())]
    for split in ("tune", "held-out"):
        errors = [abs(float(r[6].rstrip("%"))) for r in rows if r[1] == split]
        if errors:
            notes.append(f"Median error, {split} entries: {statistics.median(errors):.1f}% ({len(errors)} entries).")
    for split in ("tune", "held-out"):
        errors = [abs(float(r[6].rstrip("%"))) for r in rows if r[1] == split]
        if errors:
            print(f"median error, {split} entries (published layout forced): {statistics.median(errors):.1f}%")
    tables = [record.table(
        f"Predicted step time with the published layout forced, against {len(entries)} published measurements "
        f"(calibration: {cal})", ["entry", "split", "GPUs", "global / per GPU", "published step", "predicted", "error"],
        rows)]
    if args.picked:
        picked_rows, picked_notes = picked_table(entries)
        notes += picked_notes
        tables.append(record.table("The plan the product picks for each published job (layout, remat, per GPU x "
                                   "accumulation), its predicted step against the published one, and its planning time",
                                   ["entry", "split", "picked", "published step", "predicted", "error", "planning s"],
                                   picked_rows))
    record.write(args.json, "published_check", tables, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
