"""The TPU side's step time against published TPU measurements (`bench/published_check.py --tpu`).

For every entry of bench/published_tpu.json (and the later held-out part, bench/published_tpu_heldout.json)
this product can compile as published, compile this product's train step for the slice without its chips
(libtpu; over several slices, the multislice mesh), read the program (migration/planning/hlo_cost.py: loop
trips from the conditions, convolutions exact, splash attention's products) and predict its step time
(migration/planning/steptime.py with the TPU calibration: FLOPs at the chip's peak, bytes at its HBM
bandwidth, collectives over its inter-chip links and, between slices, the data-centre network). The entries
marked "tune" fit the TPU calibration (`--fit`); the "held-out" ones were fixed before any fit and never
choose a constant; the "held-out-new" ones (the second file) were gathered after the calibration was fixed.

Each entry runs as published: its MLP (ReLU, GELU, SwiGLU, GeGLU), its remat policy in MaxText's names
(translated by migration/config/limits.py, `custom (...)` policies tensor by tensor), tensor parallelism
inside a slice, FSDP or data parallelism across slices. Not scored (and why, printed): int8 (AQT)
training, context parallelism (a fraction of a sequence per device), sliding-window attention, fp8 where
the chip has no fp8 units.

Each compiled program's text is kept in the cache folder (`tpu_programs/<key>.hlo.gz`, or `<key>.error` for a
compile that failed), keyed by what builds it (the setup, the slices, the packages, the XLA flags, the model
and step code), not by the reader: a change to hlo_cost.py or steptime.py re-reads the stored programs.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.published_check import XLA_FLAGS  # noqa: E402  (sets the compile environment the bench compiles in)
from migration.common import cache_dir, first_line, read_json, write_json_atomic  # noqa: E402
from migration.config.limits import check_remat_name, maxtext_custom  # noqa: E402
from migration.hardware import TPU_SPECS, Links, TpuSpec  # noqa: E402
from migration.planning import steptime  # noqa: E402
from migration.planning.hlo_collectives import PREFER_ALL_GATHER  # noqa: E402
from migration.planning.hlo_cost import Kernel  # noqa: E402

PUBLISHED_TPU = Path(__file__).with_name("published_tpu.json")
# Gathered after the TPU calibration and this check's mapping were fixed (2026-12-05): scored apart.
HELD_OUT_FILES = (Path(__file__).with_name("published_tpu_heldout.json"),
                  Path(__file__).with_name("published_tpu_heldout_more.json"))

# Fixed before any fit: which entries tune the TPU calibration. One of each model family and generation
# in the tuning part, the other sizes and slices of the same tables held out.
TUNE = {
    "tpurecipes-v6e-llama3.1-8b-v6e-8-bf16", "tpurecipes-v6e-llama3.1-8b-v6e-128-bf16",
    "tpurecipes-v6e-llama3.1-70b-v6e-32-bf16", "tpurecipes-v6e-llama3.1-70b-v6e-128-bf16",
    "tpurecipes-v6e-llama2-70b-v6e-256-bf16", "tpurecipes-tpu7x-llama3.1-70b-64chips-bf16",
    "maxtext-tiering-v5p-llama2-70b-512chips-bf16",
}
# Model families whose attention layers are not all alike (sliding-window local layers beside global ones)
SLIDING_WINDOW = ("gemma2", "gemma3", "gemma4")


def entries(held_out_too: bool = True) -> list[dict]:
    """Every published entry, each with its split: tune, held-out (first file), held-out-new (later files)."""
    out = [{**e, "split": "tune" if e["id"] in TUNE else "held-out"} for e in json.loads(PUBLISHED_TPU.read_text())]
    if held_out_too:
        for path in HELD_OUT_FILES:
            if path.exists():
                out += [{**e, "split": "held-out-new"} for e in json.loads(path.read_text())]
    return out


def remat_of(entry: dict) -> str:
    """The run's remat policy as this product's: MaxText's name, or its custom policy tensor by tensor."""
    found = re.fullmatch(r"custom \((.*)\)", entry["remat"])
    if found:
        return maxtext_custom(dict(part.strip().split("=") for part in found.group(1).split(",")))
    return check_remat_name("remat", entry["remat"], maxtext=True)


def parallelism(entry: dict) -> dict[str, int]:
    """MaxText's axes the entry states (ici_tensor_parallelism=4, dcn_fsdp_parallelism=2, ...)."""
    return {k: int(v) for k, v in re.findall(r"(\w+_parallelism)=(-?\d+)", entry.get("parallelism", ""))}


def not_scored(entry: dict) -> str | None:
    """Why the entry is not compiled as published here (None: it is)."""
    from workloads.transformer import MLPS

    axes = parallelism(entry)
    name = entry["model"]["name"].lower()
    if entry["precision"] == "int8":
        return "int8 training (AQT) is not modelled"
    if entry["per_device_batch"] and entry["per_device_batch"] < 1 or axes.get("ici_context_parallelism", 1) > 1:
        return "context parallelism (a fraction of a sequence per device) is not modelled"
    if any(f in name.replace(" ", "").replace("-", "") for f in SLIDING_WINDOW):
        return "sliding-window attention layers are not modelled (the decoder attends over the whole sequence)"
    if entry["model"]["mlp"] not in MLPS:
        return f"{entry['model']['mlp']} MLP (no decoder of this product has it)"
    if entry["precision"] == "fp8" and not TPU_SPECS[spec_for(entry).key].chip.fp8_tflops:
        return f"fp8 on {entry['tpu']} (no fp8 units)"
    if spec_for(entry) is None:
        return f"no catalog slice of {entry['chips'] // entry['slices']} {entry['tpu']} chips"
    return None


def spec_for(entry: dict) -> TpuSpec | None:
    """The catalog slice of one of the entry's slices."""
    chips = entry["chips"] // entry["slices"]
    return next((s for s in TPU_SPECS.values() if s.generation == entry["tpu"] and s.chips == chips), None)


def layout_for(entry: dict) -> str:
    """The published layout: FSDP over the slice (over every slice with dcn_fsdp_parallelism, else FSDP inside
    each and data parallelism across them), tensor parallelism inside a slice where stated."""
    from migration.planning.source import source_layout

    axes = parallelism(entry)
    return source_layout("fsdp", spec_for(entry), entry["slices"], axes.get("dcn_fsdp_parallelism", 1) > 1,
                         max(1, axes.get("ici_tensor_parallelism", 1)), max(1, axes.get("ici_expert_parallelism", 1)))


def run_config(entry: dict):
    from migration.config.requests import RunConfig

    if "moe" in entry:  # a mixture-of-experts entry (bench/published_moe.json)
        from bench.moe_published import tpu_config

        return tpu_config(entry)
    m = entry["model"]
    gated = m["mlp"] in ("swiglu", "geglu")
    modern = gated or m["mlp"] in ("relu", "squared_relu")  # MaxText's decoders: RMSNorm, rotary, no biases
    head = m.get("head_dim") or 0
    model = {"n_layers": m["n_layers"], "d_model": m["d_model"], "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"],
             "d_ff": m["d_ff"], "vocab_size": m["vocab_size"], "seq_len": m["seq_len"], "attention": "splash",
             "tied_embeddings": m["tied_embeddings"], "mlp": m["mlp"],
             "head_size": 0 if head * m["n_heads"] == m["d_model"] else head}
    if modern:
        model["rope_scaling"] = 1.0
    if "+tp" in layout_for(entry):  # MaxText shards the residual stream's embedding over the tensor axis
        model["residual_over_tensor"] = True
    spec = spec_for(entry)
    devices = spec.devices * entry["slices"]
    per_device = entry["per_device_batch"] or entry["global_batch"] // devices
    return RunConfig(workload="llama" if modern else "transformer", preset="8b" if modern else "gpt2-small",
                     model=model, per_device_batch=max(1, int(per_device)), devices=devices,
                     precision="fp8" if entry["precision"] == "fp8" else "bf16", remat=remat_of(entry),
                     sharding=layout_for(entry))


PROGRAMS = "tpu_programs"  # the cache's folder of compiled TPU programs: <key>.hlo.gz, or <key>.error


def _key(entry: dict, cfg=None) -> str:
    """What decides the entry's compiled TPU program (of `cfg`, another setup of it): its configuration, the
    slices, the packages' versions, the XLA flags and the code that builds the step (not the reader, which
    reads the stored text again)."""
    from bench.published_check import program_sources_digest
    from migration.planning.compile_cache import package_versions

    parts = ["tpu", (cfg or run_config(entry)).to_dict(), spec_for(entry).topology, entry["slices"],
             package_versions(), XLA_FLAGS, program_sources_digest()]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def compile_text(entry: dict, cfg=None) -> str:
    """The entry's step (or `cfg`, another setup of it) compiled for its slices (libtpu, without the chips):
    the optimized HLO text. Raises CompileError with XLA's first line."""
    from migration.planning.source import tpu_topology
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_multislice_mesh

    spec, slices = spec_for(entry), entry["slices"]
    try:
        program = TrainProgram.from_config(cfg or run_config(entry))
        mesh = make_multislice_mesh(tpu_topology(spec, slices).devices, program.sharding, slices)
        compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
    except Exception as exc:  # noqa: BLE001 - XLA raises several types; the message says which
        raise CompileError(first_line(exc, 300)) from None
    return compiled.as_text()


def program_text(entry: dict, cfg=None, folder: Path | None = None) -> str:
    """The compiled program's text from the cache (`folder`, the cache's by default), compiled and stored
    there when missing; a compile that failed is stored too and raises its CompileError again."""
    folder = folder or cache_dir() / PROGRAMS
    key = _key(entry, cfg)
    text, error = folder / f"{key}.hlo.gz", folder / f"{key}.error"
    if text.exists():
        return gzip.decompress(text.read_bytes()).decode()
    if error.exists():
        raise CompileError(error.read_text())
    if not COMPILE:
        raise NotCompiled(entry["id"])
    t0 = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    try:
        hlo = compile_text(entry, cfg)
    except CompileError as exc:
        error.write_text(str(exc))
        raise
    finally:
        seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
        what = "" if cfg is None else f" ({cfg.per_device_batch} x {cfg.accumulation_steps}, remat {cfg.remat})"
        print(f"  compiled {entry['id']}{what} for {entry['slices']} x {spec_for(entry).topology} in {seconds:.0f} s",
              file=sys.stderr, flush=True)
    partial = text.with_suffix(f".{os.getpid()}.part")
    partial.write_bytes(gzip.compress(hlo.encode(), 6, mtime=0))
    partial.replace(text)
    return hlo


def cached(entry: dict, cfg=None) -> bool:
    folder = cache_dir() / PROGRAMS
    return any((folder / f"{_key(entry, cfg)}{suffix}").exists() for suffix in (".hlo.gz", ".error"))


def read_kernels(entry: dict, text: str) -> list[Kernel]:
    from migration.planning.hlo_cost import read_program

    return read_program(text, fp32_unit="bf16", per_node=spec_for(entry).devices)


def kernels_for(entry: dict, cfg=None) -> list[Kernel]:
    return read_kernels(entry, program_text(entry, cfg))


def fitted_kernels(entry: dict) -> tuple[list[Kernel], Any]:
    """Where the published setup does not fit here: the product's own answer (migration/planning/source.py's
    `cheapest_fit`: the faster predicted step of the first remat policy keeping less and the first smaller
    micro-batch with accumulation that fit, the same global batch), its kernels and its RunConfig. Raises
    CompileError where none fits."""
    from migration.planning.source import TpuSetup, cheapest_fit, tpu_fit_ladders
    from workloads import get_workload

    cfg = run_config(entry)
    stated = TpuSetup(cfg.sharding, cfg.remat, cfg.per_device_batch, 1)

    def compile_one(setup: TpuSetup) -> dict:
        other = dataclasses.replace(cfg, sharding=setup.layout, remat=setup.remat, per_device_batch=setup.batch,
                                    accumulation_steps=setup.accumulation)
        kernels = kernels_for(entry, other)
        return {"kernels": kernels, "cfg": other,
                "predicted_step_s": predict(entry, kernels, steptime.TPU_CALIBRATION).seconds}

    setup, found, tried, _ = cheapest_fit(tpu_fit_ladders(stated, get_workload(cfg.workload), spec_for(entry)),
                                          compile_one)
    if setup is None:
        raise CompileError("no setup the product tries fits either (" + "; ".join(tried[-2:]) + ")")
    return found["kernels"], found["cfg"]


class CompileError(RuntimeError):
    """This product's step for the entry does not compile for its slice (e.g. it needs more HBM)."""


class NotCompiled(RuntimeError):
    """A --cached-only run: the program is not in the cache."""


COMPILE = True  # False in a --cached-only run: a program not in the cache is NotCompiled


def source_flops_per_device(entry: dict) -> float:
    """The FLOPs per device of a step by the table's own count (MaxText's calculate_training_tflops at the
    publishing commit, as the entry's tflops_definition states it): 6 x parameters x tokens, plus the
    attention's 12 x heads x layers x head size x seq^2 per sequence, halved where that commit halved it."""
    from workloads import get_workload

    cfg_run = run_config(entry)
    w = get_workload(cfg_run.workload)
    cfg = w.config(cfg_run.preset, cfg_run.model)
    seq, b = cfg.seq_len, entry["per_device_batch"]
    attention = 12 * cfg.n_heads * cfg.n_layers * cfg.head_dim * seq * seq * b
    halved = "/2" in entry["tflops_definition"].replace(" ", "")
    return 6 * w.param_count(cfg) * seq * b + attention / (2 if halved else 1)


def published_step(entry: dict) -> tuple[float, str]:
    measured = entry["measured"]
    if measured.get("step_time_s"):
        return measured["step_time_s"], "step time as published"
    if measured.get("tokens_per_s_per_chip"):
        tokens = entry["global_batch"] * entry["model"]["seq_len"]
        per_chip = measured["tokens_per_s_per_chip"]
        return tokens / (per_chip * entry["chips"]), (f"{tokens:,} tokens / ({per_chip} tokens/s per chip x "
                                                       f"{entry['chips']})")
    flops = source_flops_per_device(entry)
    return flops / (measured["tflops_per_device"] * 1e12), (
        f"{flops / 1e12:,.1f} TFLOP per device by the table's count / {measured['tflops_per_device']} TFLOP/s")


def tpu_needs(reason: str) -> str:
    from migration.planning.source import tpu_needs_text

    return tpu_needs_text(reason)


def links_for(entry: dict) -> Links | float | None:
    spec = spec_for(entry)
    return spec.ici_bytes_per_s if entry["slices"] == 1 else Links(spec.ici_bytes_per_s, spec.dcn_bytes_per_s)


def predict(entry: dict, kernels: list[Kernel], cal: steptime.Calibration) -> steptime.StepPrediction:
    """The step time of the entry's program, compiled with libtpu's default flags; where the recipe runs with
    `--xla_tpu_prefer_async_allgather_to_allreduce=true` (its `libtpu_flags`), the all-reduces that gather
    weights are priced as the all-gathers that flag compiles them to."""
    if PREFER_ALL_GATHER in entry.get("libtpu_flags", []):
        kernels = steptime.as_all_gathers(kernels)
    return steptime.predict(kernels, spec_for(entry), links_for(entry), cal)


def fit(entries: list[dict], programs: dict[str, list[Kernel]]) -> steptime.Calibration:
    from bench.calibration import search

    tune = [e for e in entries if e["split"] == "tune"]
    grid = ((0.5, 0.55, 0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9), (0.3, 0.4, 0.5, 0.6, 0.7, 0.8), (0.6, 0.7, 0.8, 0.9),
            (2e-6, 5e-6, 1e-5), (0.3, 0.45, 0.6, 0.75, 0.9, 1.0))
    return search(tune, lambda e, cal: predict(e, programs[e["id"]], cal).seconds, lambda e: published_step(e)[0],
                  grid, steptime.TPU_CALIBRATION)


# -- the entries the test suite checks ---------------------------------------------------------------
# One per TPU generation and kind of job: tests/test_published_ci.py reads their programs' kernels, stored
# gzip'd in tests/fixtures/published_tpu/ with the key of what built them, predicts each step and asserts the
# error this check records for it. `--write-fixtures` (with --tpu) stores this checkout's.
CI_ENTRIES = ("tpurecipes-v6e-mistral-7b-v6e-8-bf16", "tpurecipes-tpu7x-llama3.1-70b-64chips-bf16",
              "maxtext-v5p-32b-1xv5p-128-64chips-bf16", "maxtext-v4-22b-8xv4-128-512chips-bf16")
FIXTURES = ROOT / "tests" / "fixtures" / "published_tpu"


def stored_program(entry: dict, folder: Path = FIXTURES) -> tuple[list[Kernel], dict, str] | None:
    """The entry's stored program read into kernels, the setup (RunConfig fields) it is of and how that was
    chosen, when this checkout would build the same program; else None."""
    from migration.config.requests import RunConfig

    meta = read_json(folder / f"{entry['id']}.json", {})
    path = folder / f"{entry['id']}.hlo.gz"
    if not meta or not path.exists() or meta.get("key") != _key(entry, RunConfig(**meta["config"])):
        return None
    return read_kernels(entry, gzip.decompress(path.read_bytes()).decode()), meta["config"], meta["how"]


def write_fixture(entry: dict, folder: Path = FIXTURES) -> float:
    """Store the entry's program (as published, or the product's fitting answer) and its key in `folder`; the
    seconds it took (compiles included, where the cache had none)."""
    t0 = time.perf_counter()
    _, cfg, how = program_for(entry)
    text = program_text(entry, cfg)
    seconds = time.perf_counter() - t0  # migration: ignore[TIME001] compile() returns when compiled: nothing runs
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{entry['id']}.hlo.gz").write_bytes(gzip.compress(text.encode(), 9, mtime=0))
    write_json_atomic(folder / f"{entry['id']}.json", {"key": _key(entry, cfg), "config": cfg.to_dict(), "how": how})
    return seconds


def program_for(entry: dict) -> tuple[list[Kernel], Any, str]:
    """The entry's kernels, the setup they are of and how it was chosen: as published, or where that needs
    more HBM than the chip has here, the product's fitting answer (`fitted_kernels`). Raises CompileError
    saying why neither compiles."""
    try:
        return kernels_for(entry), run_config(entry), "as published"
    except CompileError as exc:
        print(f"  {entry['id']}: {exc}", file=sys.stderr)
        if "memory" not in str(exc).lower():
            raise CompileError(f"this product's step does not compile for the slice as published ({str(exc)[:120]})"
                               ) from None
        try:
            kernels, cfg = fitted_kernels(entry)
        except CompileError as again:
            raise CompileError(f"over the chip's HBM as published ({tpu_needs(str(exc))}) and {again}") from None
        return kernels, cfg, f"assumed: as published it {tpu_needs(str(exc))} here"


SPLITS = ("tune", "held-out", "held-out-new")


def skipped_note(skipped: dict[str, str], total: int) -> str:
    """The record's note of the entries not scored, each with why."""
    return f"Not scored ({len(skipped)} of {total}): " + "; ".join(f"{k}: {v}" for k, v in skipped.items()) + "."


def main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="bench/published_check.py --tpu")
    parser.add_argument("--fit", action="store_true")
    parser.add_argument("--only")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--write-fixtures", metavar="DIR", nargs="?", const=str(FIXTURES))
    parser.add_argument("--cached-only", action="store_true",
                        help="score only the entries whose programs are in the cache (a partial run's); the others "
                             "are listed as not compiled in this run")
    args = parser.parse_args(argv)
    everything = [e for e in entries() if not args.only or e["id"] in args.only.split(",")]
    if args.write_fixtures:
        for e in everything:
            if e["id"] in CI_ENTRIES:
                print(f"{e['id']}: compiled in {write_fixture(e, Path(args.write_fixtures)):.0f} s")
        return 0
    skipped = {e["id"]: not_scored(e) for e in everything if not_scored(e)}
    scored = [e for e in everything if e["id"] not in skipped]
    for e in scored:  # the suite's stored programs answer for their entries too
        fixture = FIXTURES / f"{e['id']}.hlo.gz"
        if e["id"] in CI_ENTRIES and stored_program(e) is not None and not cached(e):
            meta = read_json(FIXTURES / f"{e['id']}.json", {})
            if meta.get("how") == "as published":
                (cache_dir() / PROGRAMS).mkdir(parents=True, exist_ok=True)
                (cache_dir() / PROGRAMS / f"{_key(e)}.hlo.gz").write_bytes(fixture.read_bytes())
    global COMPILE
    COMPILE = not args.cached_only
    programs, configs, how = {}, {}, {}
    for e in scored:
        try:
            programs[e["id"]], configs[e["id"]], how[e["id"]] = program_for(e)
        except CompileError as exc:
            skipped[e["id"]] = str(exc)
        except NotCompiled:
            skipped[e["id"]] = "not compiled in this run (--cached-only)"
    scored = [e for e in scored if e["id"] in programs]
    cal = fit([e for e in scored if how[e["id"]] == "as published"], programs) if args.fit else steptime.TPU_CALIBRATION
    print(f"TPU calibration: {cal}\n")
    columns = ["entry", "split", "slices", "global / per device x accumulation", "layout", "remat", "setup",
               "published step", "predicted", "error"]
    rows = []
    for e in scored:
        published, _ = published_step(e)
        p = predict(e, programs[e["id"]], cal)
        cfg = configs[e["id"]]
        rows.append([e["id"], e["split"], spec_for(e).named(e["slices"]),
                     f"{e['global_batch']}/{cfg.per_device_batch}x{cfg.accumulation_steps}", cfg.sharding, cfg.remat,
                     how[e["id"]], f"{published:.3f}s", f"{p.seconds:.3f}s", f"{p.seconds / published - 1:+.1%}"])
        print(" | ".join(rows[-1]), f"| compute {p.compute_s:.3f}s (memory-bound {p.memory_s:.3f}s), "
              f"collectives {p.communication_s:.3f}s ({p.exposed_communication_s:.3f}s exposed)", flush=True)
    notes = []
    for split in SPLITS:
        errors = [abs(float(r[-1].rstrip("%"))) for r in rows if r[1] == split]
        total = sum(1 for e in everything if e["split"] == split)
        if errors:
            notes.append(f"{split} entries: median error {statistics.median(errors):.1f}%, worst {max(errors):.1f}% "
                         f"({len(errors)} of {total} scored).")
        # Entries marked low-confidence when they were gathered (before any scoring) stay in the figures
        # above; the part without them is shown beside, never instead.
        low = {e["id"] for e in everything if e["split"] == split and e.get("confidence", "").startswith("low")}
        sure = [abs(float(r[-1].rstrip("%"))) for r in rows if r[1] == split and r[0] not in low]
        if low and sure and len(sure) < len(errors):
            notes.append(f"{split} entries without the {len(errors) - len(sure)} marked low-confidence when gathered "
                         f"({', '.join(sorted(low & {r[0] for r in rows}))}): median error "
                         f"{statistics.median(sure):.1f}%, worst {max(sure):.1f}% ({len(sure)} scored).")
    notes.append(skipped_note(skipped, len(everything)))
    for n in notes:
        print(n)
    record.write(args.json, "published_tpu_check", [record.table(
        f"TPU step time predicted from the compiled TPU program, the published layout and remat forced, against "
        f"{len(scored)} published TPU measurements (TPU calibration: {cal})", columns, rows)], notes)
    return 0
