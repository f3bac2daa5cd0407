"""Serving plans against published serving measurements (bench/published_serving.json: engine benchmark
pages of TensorRT-LLM, SGLang, vLLM, LMDeploy and NVIDIA NIM, each with its pinned source and quote).

For every entry this product can plan (its GPU in the catalog, its precision one of the serving precisions:
bf16 and fp16 now, fp8 once serving plans fp8 weights), plan the model of the entry's dimensions on its GPUs
at its prompt and output lengths (migration/planning/serving.py, compiled for the target without the
device) and compare what the entry measured:

- at a stated concurrency, the plan's row at that many running sequences;
- at "max throughput" (no concurrency stated), the plan's row at the concurrency it sizes the engine for.

Figures: output tokens/s of the whole server, TPOT, TTFT; the error is predicted / published - 1. No
serving constant was fitted on these entries: every one is held out (the step-time calibration they use is
the training one, planning/steptime.py). Static-batch entries (TensorRT-LLM 0.9, LMDeploy) ran without
chunked prefill; the plan models an engine with it: their notes say so.

    python bench/published_serving_check.py            # the table (plans cached under the cache folder while
                                                        # the planning code is unchanged)
    python bench/published_serving_check.py --only ID
    python bench/published_serving_check.py --json bench/results/published_serving_check.json
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from migration.running.worker_env import compile_environment, with_serving_flags  # noqa: E402  (no JAX)

os.environ.update(with_serving_flags(compile_environment()))  # before JAX is imported: a serving process's

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import record  # noqa: E402
from migration.common import cache_dir, read_json, write_json_atomic  # noqa: E402
from migration.config.serving import SERVE_PRECISIONS  # noqa: E402
from migration.hardware import GPU_SPECS  # noqa: E402

PUBLISHED = Path(__file__).with_name("published_serving.json")
FIGURES = (("output_tokens_per_s", "output tokens/s"), ("tpot_s", "TPOT"), ("ttft_s", "TTFT"))


def plannable(entry: dict[str, Any]) -> str | None:
    """Why an entry cannot be planned yet, or None."""
    if entry["gpu"] not in GPU_SPECS:
        return f"{entry['gpu']} is not a catalog GPU"
    if entry["precision"] not in SERVE_PRECISIONS:
        return f"{entry['precision']} weights are not a serving precision yet"
    return None


def request_of(entry: dict[str, Any]) -> dict[str, Any]:
    m = entry["model"]
    if m.get("workload"):  # a family's preset at its published dimensions (the mixture-of-experts rows)
        return {"workload": m["workload"], "preset": m["preset"], "model": {}, "target": entry["gpu"],
                "gpus": entry["gpus"], "precision": entry["precision"], "prompt_len": entry["input_len"],
                "gen_len": entry["output_len"], "batches": [entry["concurrency"]] if entry["concurrency"] else [],
                "kv_cache": "fp8" if entry.get("kv_cache") == "fp8" else "auto"}
    model = {"n_layers": m["n_layers"], "d_model": m["d_model"], "n_heads": m["n_heads"], "n_kv_heads": m["n_kv_heads"],
             "d_ff": m["d_ff"], "vocab_size": m["vocab_size"], "tied_embeddings": m["tied_embeddings"],
             "context": max(131072, entry["input_len"] + entry["output_len"])}
    return {"workload": "llama", "preset": "8b", "model": model, "target": entry["gpu"], "gpus": entry["gpus"],
            "precision": entry["precision"], "prompt_len": entry["input_len"], "gen_len": entry["output_len"],
            "batches": [entry["concurrency"]] if entry["concurrency"] else [],
            "kv_cache": "fp8" if entry.get("kv_cache") == "fp8" else "auto"}


def code_version() -> str:
    """A digest of the code a serving plan comes from (the planner, the hardware table, the workloads, the
    serving processes' flags): a cached plan is reused only while that code is unchanged."""
    files = sorted([*(ROOT / "migration" / "planning").glob("*.py"), *(ROOT / "workloads").glob("*.py"),
                    ROOT / "migration" / "hardware.py", ROOT / "migration" / "running" / "worker_env.py",
                    ROOT / "migration" / "config" / "serving.py"])
    return hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]


def plan_for(entry: dict[str, Any], cache: dict[str, Any]) -> tuple[dict[str, Any], float]:
    from migration.config.serving import serve_request
    from migration.planning.serving import serve_plan

    request = request_of(entry)
    key = hashlib.sha256(json.dumps([request, code_version()], sort_keys=True).encode()).hexdigest()[:16]
    if key not in cache:
        start = time.perf_counter()
        plan = serve_plan(serve_request(**request))
        cache[key] = {"plan": plan, "seconds": time.perf_counter() - start}
        write_json_atomic(cache_dir() / "published_serving_plans.json", cache)
    return cache[key]["plan"], cache[key]["seconds"]


def predicted(entry: dict[str, Any], plan: dict[str, Any]) -> tuple[dict[str, float], int]:
    n = entry["concurrency"] or plan["largest_batch"]
    row = next(r for r in plan["rows"] if r["batch"] == n)
    return {"output_tokens_per_s": row["tokens_per_s_per_gpu"] * plan["gpus"], "tpot_s": row["predicted_tpot_s"],
            "ttft_s": row["predicted_ttft_s"]}, n


def fmt(name: str, value: float) -> str:
    return f"{value:,.0f}" if name == "output_tokens_per_s" else f"{value * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one entry by id")
    parser.add_argument("--json", metavar="PATH", help="write the table as a record")
    args = parser.parse_args(argv)
    entries = [e for e in json.loads(PUBLISHED.read_text()) if not args.only or e["id"] == args.only]
    cache = read_json(cache_dir() / "published_serving_plans.json", {})
    rows, errors, skipped, moe_errors = [], [], [], []
    for entry in entries:
        why = plannable(entry)
        if why:
            skipped.append(f"{entry['id']}: {why}")
            continue
        plan, seconds = plan_for(entry, cache)
        got, n = predicted(entry, plan)
        for name, label in FIGURES:
            published = entry["measured"].get(name)
            if not published:
                continue
            error = got[name] / published - 1
            errors.append((entry["precision"], name, error))
            if entry["model"].get("workload") == "moe":
                moe_errors.append(error)
            rows.append([entry["id"], entry["engine"], f"{entry['gpus']} x {entry['gpu']}", entry["precision"],
                         f"{entry['input_len']}/{entry['output_len']}",
                         f"{entry['concurrency'] or 'max'} (plan {n})", label, fmt(name, published),
                         fmt(name, got[name]), f"{error:+.1%}", f"{seconds:.0f} s"])
            print("  ".join(rows[-1]), flush=True)
    notes = []
    half = [abs(e) for p, _, e in errors if p in ("bf16", "fp16")]
    if half:
        notes.append(f"Median error, bf16/fp16 figures: {statistics.median(half):.1%} ({len(half)} figures); "
                     f"worst {max(half):.1%}. Every entry held out: no serving constant was fitted on them.")
    if moe_errors:
        notes.append(f"Mixture-of-experts entries (routed experts priced apart: planning/routed_experts.py): median "
                     f"error {statistics.median(abs(e) for e in moe_errors):.1%} ({len(moe_errors)} figures); worst "
                     f"{max(abs(e) for e in moe_errors):.1%}.")
    for name, label in FIGURES:
        some = [abs(e) for p, n, e in errors if n == name and p in ("bf16", "fp16")]
        if some:
            notes.append(f"{label}: median error {statistics.median(some):.1%} ({len(some)} figures).")
    notes += [f"Not planned: {s}." for s in skipped]
    for note in notes:
        print(note)
    record.write(args.json, "published_serving_check", [record.table(
        f"Serving plans against {len(entries) - len(skipped)} published serving measurements "
        "(predicted / published - 1)", ["entry", "engine", "GPUs", "precision", "in/out", "concurrency", "figure",
                                         "published", "predicted", "error", "plan time"], rows)], notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
