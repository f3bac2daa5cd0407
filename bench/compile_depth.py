"""Compile time against depth: the train step of a decoder with 4 and with 32 layers, compiled
side by side in one process for the same target, same width and same batch.

Layers are stacked and run by one `lax.scan`, so XLA compiles one block body whatever the depth:
the ratio of the two compile times should stay near 1 (an unrolled model grows about linearly).
Default: the Llama 3.1 8B layout at sequence 4096, bf16, remat full, FSDP over 8 H100s, compiled
without the devices (the planner's own path), batch 2 per GPU.

    python bench/compile_depth.py [--target h100-sxm] [--gpus 8] [--depths 4,32] [--repeat 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import record  # noqa: E402
from migration.config.requests import PlanRequest, RunConfig  # noqa: E402
from migration.running.worker_env import planner_environment  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--preset", default="8b")
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--depths", default="4,32")
    parser.add_argument("--repeat", type=int, default=2, help="compiles per depth, interleaved; the best is kept")
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/compile_depth.json)")
    args = parser.parse_args()
    os.environ.update(planner_environment(PlanRequest(target=args.target, gpus=args.gpus)))

    import jax
    from jax.experimental import topologies

    from migration.hardware import GPU_SPECS, gpu_target_config
    from migration.planning.memory import compile_memory
    from migration.step.train import TrainProgram, make_data_mesh

    spec = GPU_SPECS[args.target]
    topo = topologies.get_topology_desc(platform="cuda", target_config=gpu_target_config(spec),
                                        topology=f"1x1x{args.gpus}")
    mesh = make_data_mesh(topo.devices)
    depths = [int(d) for d in args.depths.split(",")]
    best: dict[int, float] = {}
    peaks: dict[int, int | None] = {}
    for _ in range(args.repeat):
        for depth in depths:  # interleaved, so that load on a shared host hits both alike
            cfg = RunConfig(workload="llama", preset=args.preset,
                            model={"n_layers": depth, "seq_len": args.seq, "attention": "cudnn"},
                            per_device_batch=args.batch, devices=args.gpus, precision="bf16", remat="full",
                            sharding="fsdp")
            program = TrainProgram.from_config(cfg)
            t0 = time.perf_counter()
            peaks[depth] = compile_memory(program, mesh)["peak_bytes"]
            best[depth] = min(best.get(depth, float("inf")), time.perf_counter() - t0)
    print(f"lower + compile of the train step, llama {args.preset} layout at sequence {args.seq}, bf16, remat full, "
          f"FSDP over {args.gpus} x {spec.name} (deviceless), batch {args.batch}; JAX {jax.__version__}, "
          f"{os.cpu_count()} CPU cores, best of {args.repeat}")
    for depth in depths:
        print(f"  {depth:>3} layers: {best[depth]:6.1f} s   predicted peak {peaks[depth] / 2**30:6.2f} GiB per GPU")
    print(f"ratio {depths[-1]} / {depths[0]} layers: {best[depths[-1]] / best[depths[0]]:.2f}x compile time "
          f"for {depths[-1] / depths[0]:.0f}x the layers")
    record.write(args.json, "compile_depth", [record.table(
        f"Lower and compile of the train step: llama {args.preset} layout at sequence {args.seq}, bf16, remat full, "
        f"FSDP over {args.gpus} x {spec.name} without the devices, batch {args.batch} per GPU, best of {args.repeat}",
        ["layers", "compile", "predicted peak per GPU"],
        [[str(d), f"{best[d]:.1f} s", f"{peaks[d] / 2**30:.2f} GiB"] for d in depths])],
        [f"Ratio {depths[-1]} / {depths[0]} layers: {best[depths[-1]] / best[depths[0]]:.2f}x the compile time for "
         f"{depths[-1] / depths[0]:.0f}x the layers (the layers are one `lax.scan`)."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
