"""The TPU side's step time against published TPU measurements (`bench/published_check.py --tpu`).

For every entry of bench/published_tpu.json this product can compile as published (one slice; a gated
(SwiGLU) or GELU MLP; a remat policy of its own close to the run's), compile this product's train step
for the slice without its chips (libtpu), read the program (migration/planning/hlo_cost.py: loop trips from
the conditions, convolutions exact, splash attention's products) and predict its step time
(migration/planning/steptime.py with the TPU calibration: FLOPs at the chip's peak, bytes at its HBM
bandwidth, collectives over its inter-chip links). The entries marked "tune" fit the TPU calibration
(`--fit`); the "held-out" ones were fixed before any fit and never choose a constant.

Not scored (and why, printed): MaxText's 2023 default decoder (a ReLU MLP this product's workloads do not
have; all but one of the multi-slice runs use it), FSDP across slices, fp8 runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from migration.common import cache_dir, first_line, read_json, write_json_atomic  # noqa: E402
from migration.hardware import TPU_SPECS, TpuSpec  # noqa: E402
from migration.planning import steptime  # noqa: E402
from migration.planning.hlo_cost import Kernel  # noqa: E402

PUBLISHED_TPU = Path(__file__).with_name("published_tpu.json")

# MaxText's remat policies (and the custom ones of Google's TPU recipes) as this product's: what each saves
# or offloads, recomputing the rest. Offloading the projections and the layer input to the host is ours
# offload_dot_except_mlp; saving q/k/v (and the attention output) on the device is save_qkv; keeping only
# the layer input is full.
REMAT = {
    "full": "full",
    "save_dot_except_mlpwi": "save_dot_except_mlp",
    "qkv_proj_offloaded": "offload_dot_except_mlp",
    "custom (decoder_layer_input=offload, out_proj=offload, query_proj=offload, key_proj=offload, "
    "value_proj=offload)": "offload_dot_except_mlp",
    "custom (decoder_layer_input=offload, query_proj=offload, key_proj=offload, value_proj=offload)":
        "offload_dot_except_mlp",
    "custom (decoder_layer_input=offload)": "full",
    "custom (context=offload, mlpwo=offload)": "full",
    "custom (decoder_layer_input=device, context=device, query_proj=device, key_proj=device, value_proj=device, "
    "qkv_proj=device)": "save_qkv",
    "custom (decoder_layer_input=offload, mlpwo=offload, key_proj=device, value_proj=device)": "full",
}
# Fixed before any fit: which entries tune the TPU calibration. One of each model family and generation
# in the tuning part, the other sizes and slices of the same tables held out.
TUNE = {
    "tpurecipes-v6e-llama3.1-8b-v6e-8-bf16", "tpurecipes-v6e-llama3.1-8b-v6e-128-bf16",
    "tpurecipes-v6e-llama3.1-70b-v6e-32-bf16", "tpurecipes-v6e-llama3.1-70b-v6e-128-bf16",
    "tpurecipes-v6e-llama2-70b-v6e-256-bf16", "tpurecipes-tpu7x-llama3.1-70b-64chips-bf16",
    "maxtext-tiering-v5p-llama2-70b-512chips-bf16",
}


def not_scored(entry: dict) -> str | None:
    """Why the entry is not compiled as published here (None: it is)."""
    multislice = entry.get("slices", 1) != 1
    if multislice and "dcn_fsdp" in entry.get("parallelism", ""):
        return "FSDP across slices (dcn_fsdp_parallelism; the product's multislice job is data parallel across them)"
    if entry["model"]["mlp"] not in ("swiglu", "gelu"):
        return f"{entry['model']['mlp']} MLP (no workload of this product has it)"
    if multislice:
        return "multi-slice (the product times the data-centre network; this check does not compile multislice yet)"
    if entry["precision"] != "bf16":
        return f"{entry['precision']} (the TPU side compiles bf16)"
    if entry.get("remat") not in REMAT:
        return f"remat {entry.get('remat')!r} has no counterpart here"
    if spec_for(entry) is None:
        return f"no catalog slice of {entry['chips']} {entry['tpu']} chips"
    return None


def spec_for(entry: dict) -> TpuSpec | None:
    return next((s for s in TPU_SPECS.values() if s.generation == entry["tpu"] and s.chips == entry["chips"]), None)


def run_config(entry: dict):
    from migration.config.requests import RunConfig

    m = entry["model"]
    swiglu = m["mlp"] == "swiglu"
    model = {"n_layers": m["n_layers"], "d_model": m["d_model"], "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"],
             "d_ff": m["d_ff"], "vocab_size": m["vocab_size"], "seq_len": m["seq_len"], "attention": "splash",
             "tied_embeddings": m["tied_embeddings"]}
    if swiglu:
        model["rope_scaling"] = 1.0
    per_device = entry["per_device_batch"] or entry["global_batch"] // spec_for(entry).devices
    return RunConfig(workload="llama" if swiglu else "transformer", preset="8b" if swiglu else "gpt2-small",
                     model=model, per_device_batch=max(1, int(per_device)),
                     devices=spec_for(entry).devices, precision="bf16", remat=REMAT[entry["remat"]], sharding="fsdp")


def _key(entry: dict) -> str:
    from migration.planning.compile_cache import code_fingerprint, package_versions

    parts = ["tpu", run_config(entry).to_dict(), spec_for(entry).topology, code_fingerprint(), package_versions(),
             os.environ.get("XLA_FLAGS", ""), (ROOT / "migration/planning/hlo_cost.py").read_text()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def kernels_for(entry: dict, cache: dict) -> list[Kernel]:
    from migration.planning.hlo_cost import read_program
    from migration.planning.source import tpu_topology
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh

    key = _key(entry)
    if key not in cache:
        spec = spec_for(entry)
        program = TrainProgram.from_config(run_config(entry))
        mesh = make_mesh(tpu_topology(spec).devices, program.sharding)
        t0 = time.perf_counter()
        try:
            compiled = jit_step(program, mesh).lower(abstract_state(program, mesh),
                                                     abstract_batch(program, mesh)).compile()
            cache[key] = [dataclasses.asdict(k) for k in read_program(compiled.as_text(), fp32_unit="bf16")]
        except Exception as exc:  # noqa: BLE001 - XLA raises several types; the message says which
            cache[key] = {"error": first_line(exc, 300)}
        seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
        write_json_atomic(cache_dir() / "published_programs.json", cache)
        print(f"  compiled {entry['id']} for {spec.topology} in {seconds:.0f} s", file=sys.stderr, flush=True)
    if isinstance(cache[key], dict):
        raise CompileError(cache[key]["error"])
    return [Kernel(**k) for k in cache[key]]


class CompileError(RuntimeError):
    """This product's step for the entry does not compile for its slice (e.g. it needs more HBM)."""


def published_step(entry: dict) -> tuple[float, str]:
    measured = entry["measured"]
    if measured.get("step_time_s"):
        return measured["step_time_s"], "step time as published"
    tokens = entry["global_batch"] * entry["model"]["seq_len"]
    per_chip = measured["tokens_per_s_per_chip"]
    return tokens / (per_chip * entry["chips"]), f"{tokens:,} tokens / ({per_chip} tokens/s per chip x {entry['chips']})"


def predict(entry: dict, kernels: list[Kernel], cal: steptime.Calibration) -> steptime.StepPrediction:
    spec = spec_for(entry)
    return steptime.predict(kernels, spec, spec.ici_bytes_per_s, cal)


def fit(entries: list[dict], programs: dict[str, list[Kernel]]) -> steptime.Calibration:
    from bench.calibration import search

    tune = [e for e in entries if e["id"] in TUNE]
    grid = ((0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9), (0.3, 0.4, 0.5, 0.6, 0.7, 0.8), (0.6, 0.7, 0.8, 0.9),
            (2e-6, 5e-6, 1e-5), (0.3, 0.45, 0.6, 0.75, 0.9, 1.0))
    return search(tune, lambda e, cal: predict(e, programs[e["id"]], cal).seconds, lambda e: published_step(e)[0],
                  grid, steptime.TPU_CALIBRATION)


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="bench/published_check.py --tpu")
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--only")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    everything = [e for e in json.loads(PUBLISHED_TPU.read_text()) if not args.only or e["id"] == args.only]
    skipped = {e["id"]: not_scored(e) for e in everything if not_scored(e)}
    entries = [e for e in everything if e["id"] not in skipped]
    cache = read_json(cache_dir() / "published_programs.json", {})
    programs = {}
    for e in entries:
        try:
            programs[e["id"]] = kernels_for(e, cache)
        except CompileError as exc:
            skipped[e["id"]] = "this product's step does not compile for the slice as published (" + (
                "over the chip's HBM" if "memory" in str(exc).lower() else str(exc)[:80]) + ")"
            print(f"  {e['id']}: {exc}", file=sys.stderr)
    entries = [e for e in entries if e["id"] in programs]
    cal = fit(entries, programs) if args.fit else steptime.TPU_CALIBRATION
    print(f"TPU calibration: {cal}\n")
    columns = ["entry", "split", "slice", "global / per device", "remat", "published step", "predicted", "error"]
    rows = []
    for e in entries:
        published, _ = published_step(e)
        p = predict(e, programs[e["id"]], cal)
        cfg = run_config(e)
        rows.append([e["id"], "tune" if e["id"] in TUNE else "held-out", spec_for(e).key,
                     f"{e['global_batch']}/{cfg.per_device_batch}", cfg.remat, f"{published:.3f}s", f"{p.seconds:.3f}s",
                     f"{p.seconds / published - 1:+.1%}"])
        print(" | ".join(rows[-1]), f"| compute {p.compute_s:.3f}s (memory-bound {p.memory_s:.3f}s), "
              f"collectives {p.communication_s:.3f}s ({p.exposed_communication_s:.3f}s exposed)")
    notes = []
    for split in ("tune", "held-out"):
        errors = [abs(float(r[7].rstrip("%"))) for r in rows if r[1] == split]
        if errors:
            notes.append(f"{split} entries: median error {statistics.median(errors):.1f}%, worst {max(errors):.1f}% "
                         f"({len(errors)} entries).")
    notes.append(f"Not scored ({len(skipped)} of {len(everything)}): " + "; ".join(
        f"{reason}: {sum(1 for r in skipped.values() if r == reason)}" for reason in sorted(set(skipped.values()))) + ".")
    for n in notes:
        print(n)
    record.write(args.json, "published_tpu_check", [record.table(
        f"TPU step time predicted from the compiled TPU program, the published layout forced, against "
        f"{len(entries)} published TPU measurements (TPU calibration: {cal})", columns, rows)], notes)
    return 0
