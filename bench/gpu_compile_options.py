"""What the figure options save a GPU search (migration/planning/compiled.py, GPU_FIGURE_OPTIONS and a kernel
cache of the process's own): the candidates a cold plan of llama 8B for 256 H100s compiles (FSDP; no remat at
per-GPU batches 4, 1 and 2; `dots` at 2 and 4; `dots_no_batch` at 4), each lowered afresh and compiled for the
deviceless target in one process, once plainly and once with the options (a new kernel cache for each pass over
the candidates), the passes alternating over the repeats so that drift hits both. Every candidate's figures (peak,
state bytes, kernels) must be the same both ways; the ratio is the options' total over the plain total.

Baseline: the same compiles without options (XLA's defaults, as before the options).

    python bench/gpu_compile_options.py [--repeats 2] [--json bench/results/gpu_compile_options.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from bench import record  # noqa: E402
from migration.config.requests import RunConfig  # noqa: E402
from migration.hardware import GPU_SPECS  # noqa: E402
from migration.planning import compiled as compiled_figures  # noqa: E402
from migration.planning.memory import deviceless_devices  # noqa: E402
from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh  # noqa: E402

CANDIDATES = (("none", 4), ("none", 1), ("none", 2), ("dots", 2), ("dots", 4), ("dots_no_batch", 4))


def one_pass(mesh, options: bool) -> tuple[list[float], list[str]]:
    """Each candidate lowered afresh and compiled: its seconds and its figures (as JSON)."""
    if options:
        compiled_figures.new_kernel_cache()  # each pass starts cold
    seconds, figures = [], []
    for remat, batch in CANDIDATES:
        cfg = RunConfig(workload="llama", preset="8b", per_device_batch=batch, devices=256, precision="bf16",
                        remat=remat, sharding="fsdp")
        program = TrainProgram.from_config(cfg)
        lowered = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh))
        t0 = time.perf_counter()
        done = lowered.compile(compiled_figures.figure_compile_options(mesh.devices) if options else None)
        seconds.append(time.perf_counter() - t0)
        figures.append(json.dumps(compiled_figures.train_step_figures(done, 0, True, 8, "tf32"), sort_keys=True))
    return seconds, figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    mesh = make_mesh(deviceless_devices(GPU_SPECS["h100-sxm"], 1, 256), "fsdp")
    plain: list[list[float]] = []
    fast: list[list[float]] = []
    same = True
    for r in range(args.repeats):
        for options in (False, True):
            seconds, figures = one_pass(mesh, options)
            (fast if options else plain).append(seconds)
            if options:
                same = same and figures == reference
            else:
                reference = figures
            print(f"repeat {r + 1}, {'options' if options else 'plain'}: " + ", ".join(f"{s:.2f}" for s in seconds)
                  + f" = {sum(seconds):.1f} s", flush=True)
    rows = []
    for i, (remat, batch) in enumerate(CANDIDATES):
        a, b = statistics.median(p[i] for p in plain), statistics.median(f[i] for f in fast)
        rows.append([f"remat {remat}, batch {batch}", f"{a:.2f} s", f"{b:.2f} s", f"{b / a:.2f}x"])
    a, b = statistics.median(sum(p) for p in plain), statistics.median(sum(f) for f in fast)
    rows.append(["the six, in order", f"{a:.1f} s", f"{b:.1f} s", f"{b / a:.2f}x"])
    table = record.table(f"llama 8B for 256 x H100 (FSDP), deviceless compiles: median of {args.repeats} alternating "
                         "passes", ["candidate", "plain", "with the figure options", "ratio"], rows)
    notes = [f"Figures (peak, state bytes, kernels) the same with and without the options for every candidate: "
             f"{'yes' if same else 'NO'}."]
    print(json.dumps(table, indent=1))
    print(notes[0])
    record.write(args.json, "gpu_compile_options", [table], notes)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
