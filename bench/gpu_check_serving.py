"""GPU check for serving: a decoder planned for the local GPU's catalog entry without the device
(`serve-plan`, in a subprocess: the deviceless compile needs its own JAX environment), then served
on the GPU with the same prompt and generation lengths at the same batch sizes (`serve_run` with
fixed lengths), printing predicted vs measured TTFT, TPOT and peak memory side by side.

Runs without gradio, from the working tree, in a few minutes on an H200:

    python bench/gpu_check_serving.py [--preset 1b] [--prompt-len 1024] [--gen-len 256] [--batches 1,8,32]

`--platform cpu --preset tiny --target l4 --prompt-len 16 --gen-len 8` tries the script on a machine
without a GPU: the measured side is then the CPU backend's (labelled), not comparable to the plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="llama")
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--gen-len", type=int, default=256)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--target", default="", help="catalog GPU to plan for (default: the local GPU's entry)")
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    args = parser.parse_args()
    os.environ["JAX_PLATFORMS"] = "cuda" if args.platform == "gpu" else "cpu"

    import jax  # noqa: PLC0415 (after the platform is chosen)

    from migration.config.serving import serve_run_request  # noqa: PLC0415
    from migration.hardware import gpu_spec_for_device_kind  # noqa: PLC0415
    from migration.running.serving import serve_run  # noqa: PLC0415

    device = jax.devices()[0]
    spec = gpu_spec_for_device_kind(device.device_kind)
    target = args.target or (spec.key if spec else "")
    if not target:
        print(f"{device.device_kind} is not in the GPU catalog; pass --target", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        plan_cmd = [sys.executable, "-m", "migration", "serve-plan", "--workload", args.workload, "--preset",
                    args.preset, "--target", target, "--precision", args.precision, "--prompt-len",
                    str(args.prompt_len), "--gen-len", str(args.gen_len), "--batches", args.batches, "--json", str(out)]
        env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
        done = subprocess.run(plan_cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        print(done.stdout[-3000:])
        if not out.exists():
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        plan = json.loads(out.read_text())
    sizes = [int(b) for b in args.batches.split(",")]
    req = serve_run_request(workload=args.workload, preset=args.preset, precision=args.precision,
                            requests=2 * max(sizes), batches=args.batches, prompt_min=args.prompt_len,
                            prompt_max=args.prompt_len, gen_min=args.gen_len, gen_max=args.gen_len)
    run = serve_run(req)
    where = f"{run['device_kind']} ({run['backend']} backend)"
    print(f"\n{args.workload}/{args.preset} {args.precision}, prompt {args.prompt_len}, generation {args.gen_len}: "
          f"predicted for {plan['target']} without the device vs measured on {where}, JAX {jax.__version__}")
    print(f"{'batch':>6} {'TTFT pred ms':>12} {'meas p50':>9} {'TPOT pred ms':>12} {'meas p50':>9} "
          f"{'peak pred GB':>12} {'meas GB':>8} {'compiles after':>14}")
    planned = {r["batch"]: r for r in plan["rows"]}
    for row in run["rows"]:
        p = planned.get(row["batch"], {})
        print(f"{row['batch']:>6} {p.get('predicted_ttft_s', float('nan')) * 1e3:>12.1f} "
              f"{row['ttft_p50_s'] * 1e3:>9.1f} {p.get('predicted_tpot_s', float('nan')) * 1e3:>12.2f} "
              f"{row['tpot_p50_s'] * 1e3:>9.2f} {p.get('predicted_peak_bytes', float('nan')) / 1e9:>12.2f} "
              f"{row['peak_memory_bytes'] / 1e9:>8.2f} {row['recompiles']:>14}")
    print(f"measured peak: {run['rows'][-1]['peak_memory_source']}; batches measured in ascending order")
    return 0 if run["recompiles"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
