"""What an MoE layer's experts cost once XLA has compiled them for a GPU (without the GPU): the matrix
products' FLOPs in the compiled train step (read as the planner reads them, migration/planning/hlo_cost.py)
against the FLOPs of the products the model asks for (workloads/moe.py `flops_per_example`: each token's
k experts, the attention, the output head), for the two dispatches; and the compiled step's peak memory a GPU
for Qwen3-30B-A3B's layers (4 of them) over 16 GPUs, under FSDP and with the experts split over 8 (+ep8).

    python bench/moe_kernels.py [--target h100-sxm] [--json OUT]

Baseline: the same model's analytic count, a grouped GEMM's work (each slot computed once). A ratio near 1
means the compiled experts do the work a grouped GEMM does; `n_experts` / `top_k` times more means every
expert multiplies every slot's row (a dense loop over the experts).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")

# One MoE layer of Mixtral's shape family, small enough to compile in seconds: 8 experts, top 2.
MODEL = {"n_layers": 1, "first_dense": 0, "n_shared_experts": 0, "d_model": 1024, "n_heads": 8, "n_kv_heads": 8,
         "d_ff": 2048, "expert_d_ff": 2048, "n_experts": 8, "top_k": 2, "seq_len": 512, "vocab_size": 1024}
BATCH = 8


def measure(target: str, dispatch: str) -> dict:
    from migration.config.requests import RunConfig
    from migration.hardware import GPU_SPECS
    from migration.planning.hlo_cost import read_program
    from migration.planning.memory import deviceless_devices
    from migration.step.train import TrainProgram, abstract_batch, abstract_state, jit_step, make_mesh
    from workloads import WORKLOADS

    model = {**MODEL, "dispatch": dispatch, "capacity_factor": 1.25}
    mesh = make_mesh(deviceless_devices(GPU_SPECS[target], 1, 1), "replicated")
    program = TrainProgram.from_config(RunConfig(workload="moe", preset="tiny", model=model, per_device_batch=BATCH,
                                                 precision="bf16"))
    compiled = jit_step(program, mesh).lower(abstract_state(program, mesh), abstract_batch(program, mesh)).compile()
    kernels = read_program(compiled.as_text())
    compiled_flops = sum(k.flops for k in kernels if k.kind in ("matmul", "attention"))
    w = WORKLOADS["moe"]
    asked = w.flops_per_example(w.config("tiny", model)) * BATCH
    return {"dispatch": dispatch, "compiled_matmul_flops": compiled_flops, "model_flops": asked,
            "ratio": compiled_flops / asked}


# Qwen3-30B-A3B's layer shapes (128 experts of 768, top 8, d_model 2048), 4 layers: 16 GPUs, 1 sequence each
QWEN_LAYERS = {"n_layers": 4, "attention": "cudnn"}


def peak(target: str, sharding: str, dispatch: str) -> dict:
    from migration.config.requests import RunConfig
    from migration.hardware import GPU_SPECS
    from migration.planning.memory import compile_memory, deviceless_devices
    from migration.step.train import TrainProgram, make_mesh

    cfg = RunConfig(workload="moe", preset="qwen3-30b-a3b", model={**QWEN_LAYERS, "dispatch": dispatch},
                    per_device_batch=1, devices=16, sharding=sharding, precision="bf16", remat="full")
    mesh = make_mesh(deviceless_devices(GPU_SPECS[target], 2, 8), sharding)
    found = compile_memory(TrainProgram.from_config(cfg), mesh)
    return {"sharding": sharding, "dispatch": dispatch, "peak_bytes": found["peak_bytes"],
            "state_bytes": found["state_bytes"]}


def main() -> None:
    from bench import record

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="h100-sxm")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows = [measure(args.target, d) for d in ("dropless", "capacity")]
    title = (f"One MoE layer (d_model 1024, 8 experts x 2048, top 2, {BATCH} x 512 tokens, bf16) compiled for "
             f"{args.target} without the device: matrix-product FLOPs of the train step")
    table = record.table(title, ["dispatch", "compiled matmul TFLOP", "model TFLOP", "compiled / model"],
                         [[r["dispatch"], f"{r['compiled_matmul_flops'] / 1e12:.3f}", f"{r['model_flops'] / 1e12:.3f}",
                           f"{r['ratio']:.2f}"] for r in rows])
    print(table["title"])
    print(f"{'dispatch':<10} {'compiled matmul TFLOP':>22} {'model TFLOP':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['dispatch']:<10} {r['compiled_matmul_flops'] / 1e12:>22.3f} {r['model_flops'] / 1e12:>12.3f} "
              f"{r['ratio']:>7.2f}")
    peaks = [peak(args.target, lay, d) for lay in ("fsdp", "fsdp+ep8") for d in ("dropless", "capacity")]
    memory = record.table(
        f"Qwen3-30B-A3B's layers (4 of 48: 128 experts x 768, top 8, d_model 2048, 4,096 tokens) on 16 x "
        f"{args.target} (2 nodes), 1 sequence a GPU, bf16, remat full, compiled without the devices: peak a GPU",
        ["layout", "dispatch", "peak GiB", "state GiB"],
        [[r["sharding"], r["dispatch"], f"{r['peak_bytes'] / 2**30:.1f}", f"{r['state_bytes'] / 2**30:.1f}"]
         for r in peaks])
    print(memory["title"])
    for r in peaks:
        print(f"{r['sharding']:<10} {r['dispatch']:<10} peak {r['peak_bytes'] / 2**30:>7.1f} GiB  state "
              f"{r['state_bytes'] / 2**30:>5.1f} GiB")
    notes = ["Baseline: the model's own count (workloads/moe.py flops_per_example: each token's k experts, once). "
             "dropless: XLA lowers jax.lax.ragged_dot as a loop over the experts, each multiplying every sorted row; "
             "capacity (factor 1.25): the experts' slots plus the dispatch and combine products."]
    notes.append("Peak: the compiled step's (migration/planning/memory.py compile_memory, the planner's figure). Baseline: "
                 "capacity dispatch (factor 1.25) at the same layout; dropless under +ep8 sends the slots by ragged "
                 "all-to-all into a worst-case receive buffer (workloads/expert_parallel.py).")
    record.write(args.json, "moe_kernels", [table, memory], notes, target=args.target, model=MODEL, batch=BATCH,
                 memory_model=QWEN_LAYERS)


if __name__ == "__main__":
    main()
