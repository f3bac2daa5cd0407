"""Mixture-of-experts training against published measurements (`bench/published_check.py --moe`).

For every entry of bench/published_moe.json (MaxText's MoE recipes on GPUs and TPUs, each with its pinned
source and quote): build this product's MoE model at the preset of the published dimensions, with the run's
dispatch (dropless grouped products, or the capacity factor's dropping), expert parallelism, tensor and FSDP
layout, remat policy and batch; compile the train step for the target without its devices (the GPU side as
bench/published_check.py compiles it, the TPU side as bench/tpu_published.py does, a setup over the chip's
HBM replaced by the product's fitting answer and said so); read the program and predict the step time with
the calibrations the dense rows fixed. No constant is fitted on these rows: the "tune" entries were chosen,
before any was scored, as the ones an MoE constant would be fitted on; the "held-out" ones never choose one.

    python bench/published_check.py --moe [--only ID] [--json bench/results/published_moe_check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import published_check, record, tpu_published  # noqa: E402  (sets the compile environment)
from migration.common import cache_dir, read_json  # noqa: E402
from migration.hardware import GPU_SPECS, Links  # noqa: E402
from migration.planning import steptime  # noqa: E402

PUBLISHED_MOE = Path(__file__).with_name("published_moe.json")
SPLITS = ("tune", "held-out")


def entries() -> list[dict]:
    return json.loads(PUBLISHED_MOE.read_text())


def model_fields(entry: dict) -> dict:
    """The run's model as overrides of its preset: its sequence, attention kernel and dispatch."""
    moe = entry["moe"]
    kernel = "splash" if entry["side"] == "tpu" else "cudnn"
    if entry["model"]["attention_type"] == "mla" and entry["side"] == "gpu":  # cuDNN's takes one head width
        kernel = "xla"
    model = {"seq_len": entry["model"]["seq_len"], "dispatch": moe["dispatch"], "attention": kernel}
    if moe["dispatch"] == "capacity":
        model["capacity_factor"] = moe["capacity_factor"]
    return model


def gpu_layout(entry: dict) -> str:
    """MaxText's GPU axes as this product's layout: the expert axis inside a node, FSDP over the GPUs the
    ici and dcn FSDP axes span (an FSDP group of that many with data parallelism across, where dcn_data > 1)."""
    axes = tpu_published.parallelism(entry)
    per_node = entry["gpus"] // entry["nodes"]
    expert = max(1, axes.get("ici_expert_parallelism", 1))
    group = per_node * max(1, axes.get("dcn_fsdp_parallelism", 1))
    base = f"hybrid:{group}" if axes.get("dcn_data_parallelism", 1) > 1 else "fsdp"
    return base + (f"+ep{expert}" if expert > 1 else "")


def gpu_config(entry: dict):
    """The GPU entry's RunConfig (bench/published_check.py `run_config` answers with it for an MoE entry)."""
    from migration.config.requests import RunConfig

    return RunConfig(workload="moe", preset=entry["model"]["preset"], model=model_fields(entry),
                     per_device_batch=entry["per_device_batch"], devices=entry["gpus"], precision=entry["precision"],
                     remat=tpu_published.remat_of(entry), sharding=gpu_layout(entry), mu_dtype=mu_dtype(entry))


def tpu_config(entry: dict):
    """The TPU entry's RunConfig (bench/tpu_published.py `run_config` answers with it for an MoE entry)."""
    from migration.config.requests import RunConfig

    spec = tpu_published.spec_for(entry)
    layout = tpu_published.layout_for(entry)
    model = model_fields(entry)
    if "+tp" in layout:  # MaxText shards the residual stream's embedding over the tensor axis
        model["residual_over_tensor"] = True
    return RunConfig(workload="moe", preset=entry["model"]["preset"], model=model,
                     per_device_batch=entry["per_device_batch"], devices=spec.devices * entry["slices"],
                     precision=entry["precision"], remat=tpu_published.remat_of(entry), sharding=layout,
                     mu_dtype=mu_dtype(entry))


def mu_dtype(entry: dict) -> str:
    """AdamW's first moment as the recipe keeps it: its mu_dtype, or MaxText's default, the weight_dtype (the
    weights themselves are compiled here in float32 either way)."""
    return entry.get("mu_dtype", "float32")


def setup_text(entry: dict, cfg) -> str:
    """The row's layout as stated: expert parallel degree and capacity."""
    moe = entry["moe"]
    routing = (f"capacity factor {moe['capacity_factor']:g} (dropping)" if moe["dispatch"] == "capacity"
               else "dropless")
    flags = ", weight gathers as all-gathers (libtpu flag)" if tpu_published.PREFER_ALL_GATHER in entry.get(
        "libtpu_flags", []) else ""
    return f"{cfg.sharding}, EP {moe['expert_parallelism']}, {routing}" + (
        f", AdamW mu {cfg.mu_dtype}" if cfg.mu_dtype != "float32" else "") + flags


def score(entry: dict, cache: dict) -> dict:
    """The entry's prediction: {setup, how, published, predicted, prediction} (CompileError raised where
    neither the published setup nor the product's fitting answer compiles)."""
    published = entry["measured"]["step_time_s"]
    if entry["side"] == "gpu":
        if not tpu_published.COMPILE and published_check.program_cache_key(entry) not in cache:
            raise tpu_published.NotCompiled(entry["id"])
        kernels = published_check.kernels_for(entry, cache)
        spec = GPU_SPECS[entry["gpu"]]
        p = steptime.predict(kernels, spec, Links.of(spec.key, entry["nodes"]), steptime.CALIBRATION)
        return {"cfg": gpu_config(entry), "how": "as published", "published": published, "prediction": p,
                "where": f"{entry['gpus']} x {entry['gpu']}"}
    kernels, cfg, how = tpu_published.program_for(entry)
    p = tpu_published.predict(entry, kernels, steptime.TPU_CALIBRATION)
    return {"cfg": cfg, "how": how, "published": published, "prediction": p,
            "where": tpu_published.spec_for(entry).named(entry["slices"])}


def summary(rows: list[list[str]], everything: list[dict]) -> list[str]:
    notes = []
    for split in SPLITS:
        for side in ("all", "gpu", "tpu"):
            errors = [abs(float(r[-1].rstrip("%"))) for r, e in zip(rows, everything)
                      if r[1] == split and (side == "all" or e["side"] == side)]
            if errors and (side == "all" or len(errors) < sum(1 for r in rows if r[1] == split)):
                notes.append(f"{split} entries{'' if side == 'all' else ' on ' + side.upper() + 's'}: median error "
                             f"{statistics.median(errors):.1f}%, worst {max(errors):.1f}% ({len(errors)} scored).")
    return notes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench/published_check.py --moe")
    parser.add_argument("--only", help="entry ids, comma-separated")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--cached-only", action="store_true",
                        help="score only the rows whose programs are in the cache (the others listed as not compiled)")
    args = parser.parse_args(argv)
    tpu_published.COMPILE = not args.cached_only
    everything = [e for e in entries() if not args.only or e["id"] in args.only.split(",")]
    cache = read_json(cache_dir() / "published_programs.json", {})
    columns = ["entry", "split", "hardware", "global / per device", "layout, experts, routing", "setup",
               "published step", "predicted", "error"]
    rows, scored, skipped = [], [], {}
    for e in everything:
        try:
            s = score(e, cache)
        except tpu_published.CompileError as exc:
            skipped[e["id"]] = str(exc)
            print(f"{e['id']}: not scored ({exc})", flush=True)
            continue
        except tpu_published.NotCompiled:
            skipped[e["id"]] = "not compiled in this run (--cached-only)"
            continue
        p = s["prediction"]
        rows.append([e["id"], e["split"], s["where"], f"{e['global_batch']}/{s['cfg'].per_device_batch}x"
                     f"{s['cfg'].accumulation_steps}", setup_text(e, s["cfg"]), s["how"], f"{s['published']:.3f}s",
                     f"{p.seconds:.3f}s", f"{p.seconds / s['published'] - 1:+.1%}"])
        scored.append(e)
        print(" | ".join(rows[-1]), f"| compute {p.compute_s:.3f}s, collectives {p.communication_s:.3f}s "
              f"({p.exposed_communication_s:.3f}s exposed)", flush=True)
    notes = summary(rows, scored)
    if skipped:
        notes.append(tpu_published.skipped_note(skipped, len(everything)))
    notes.append("Calibrations as the dense rows fixed them (GPU: steptime.CALIBRATION, TPU: steptime.TPU_CALIBRATION); "
                 "no constant fitted on these rows.")
    for n in notes:
        print(n)
    record.write(args.json, "published_moe_check", [record.table(
        f"MoE training step time predicted from the compiled program, the published layout, routing and remat "
        f"forced, against {len(rows)} published MaxText measurements on GPUs and TPUs", columns, rows)], notes)
    return 0

