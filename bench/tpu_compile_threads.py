"""How the TPU side's compile time depends on the cores it is given: libtpu's compile of a plan's stated TPU setup
(llama 8B, one sequence per chip, as `migration plan` compiles it: migration/planning/source.py compile_setup), in a
fresh process with an empty cache of compiled figures, once on one compile thread (libtpu's
`--xla_jf_internal_num_threads=1`) and once as libtpu sets itself up on this machine, alternating over the repeats
so that drift hits both. The figures (peak per chip, predicted step) must be the same both ways.

Baseline: the same compile on one thread. A ratio well under 1 says the TPU compile is spread over the machine's
cores, so that a cold plan's TPU side shortens on a machine with more of them (the hosted box has 16); on a
2-core machine the best it can do is 0.5. Then the same compile with XLA's attention in place of Pallas' splash
kernels: whether the simpler attention would compile faster.

    python bench/tpu_compile_threads.py [--sources v5p-8 v5p-1024] [--repeats 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from migration.planning.memory import usable_cores  # noqa: E402
from migration.running.worker_env import LIBTPU_COMPILE_ONLY  # noqa: E402

ONE_THREAD = "--xla_jf_internal_num_threads=1"


def compile_once(source: str, attention: str = "splash") -> dict:
    """In this process: the stated setup of llama 8B on `source` compiled cold (with `attention` "xla": its
    scores materialised by XLA instead of Pallas' splash kernels); its seconds and figures."""
    from migration.config.requests import PlanRequest
    from migration.planning import source as tpu_side

    req = PlanRequest(workload="llama", preset="8b", source=f"tpu-{source}", target="h100-sxm", gpus=8,
                      model={"attention": "xla"} if attention == "xla" else {},
                      global_batch=tpu_side.TPU_SPECS[f"tpu-{source}"].devices)
    topo = tpu_side.tpu_topology(tpu_side.TPU_SPECS[req.source], 1)
    found = tpu_side.compile_setup(req, topo, tpu_side.stated_setup(req))
    return {key: found[key] for key in ("compile_s", "peak_bytes_per_chip", "predicted_step_s")}


def timed(source: str, threads_flag: str, attention: str = "splash") -> dict:
    """One compile in a fresh process, libtpu given `threads_flag` (or nothing: its own setting)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if k != "MIGRATION_COMPILE_STORE"}
        env = {**LIBTPU_COMPILE_ONLY, **env}  # as a planner's compiling process (libtpu's log kept off the disk)
        env.update(MIGRATION_CACHE_DIR=tmp, MIGRATION_COMPILE_CACHE_DIR=tmp, JAX_PLATFORMS="cpu",
                   LIBTPU_INIT_ARGS=" ".join(f for f in (env.get("LIBTPU_INIT_ARGS", ""), threads_flag) if f))
        done = subprocess.run([sys.executable, __file__, "--one", source, attention], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{source} ({threads_flag or 'libtpu default'}) failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sources", nargs="+", default=["v5p-8", "v5p-1024"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--one", nargs=2, metavar=("SOURCE", "ATTENTION"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(compile_once(*args.one)))
        return 0
    rows, same = [], True
    for source in args.sources:
        runs: dict[str, list[dict]] = {"one": [], "default": []}
        for r in range(args.repeats):
            for name, flag in (("one", ONE_THREAD), ("default", "")):
                runs[name].append(timed(source, flag))
                print(f"{source} repeat {r + 1}, {name}: {runs[name][-1]['compile_s']:.1f} s", flush=True)
        figures = {json.dumps({k: v for k, v in run.items() if k != "compile_s"}) for v_ in runs.values()
                   for run in v_}
        same = same and len(figures) == 1
        one = statistics.median(run["compile_s"] for run in runs["one"])
        default = statistics.median(run["compile_s"] for run in runs["default"])
        rows.append([source, f"{one:.1f} s", f"{default:.1f} s", f"{default / one:.2f}x",
                     "yes" if len(figures) == 1 else "NO"])
    table = record.table(f"libtpu's compile of llama 8B's stated TPU setup (1 sequence per chip), cold: median of "
                         f"{args.repeats} alternating runs on {usable_cores()} cores",
                         ["TPU source", "one compile thread", "libtpu's default", "ratio", "same figures"], rows)
    kernels = attention_table(args)
    notes = ["One thread: LIBTPU_INIT_ARGS=--xla_jf_internal_num_threads=1. libtpu's default spreads the work over "
             "this machine's cores; a machine with more cores was not measured.",
             "Attention: the same stated setup with the scores materialised by XLA (the model's `attention: xla`) "
             "instead of Pallas' splash kernels, libtpu's default threads. A ratio near 1 says that compiling XLA's "
             "attention costs about what the kernels' code generation does: swapping one for the other would not "
             "shorten a cold plan (and would change its figures)."]
    print(json.dumps([table, kernels], indent=1))
    record.write(args.json, "tpu_compile_threads", [table, kernels], notes)
    return 0 if same else 1


def attention_table(args: argparse.Namespace) -> dict:
    """The stated setup compiled with splash's kernels and with XLA's attention, alternating: the seconds each."""
    rows = []
    for source in args.sources:
        runs: dict[str, list[dict]] = {"splash": [], "xla": []}
        for r in range(args.repeats):
            for attention in runs:
                runs[attention].append(timed(source, "", attention))
                print(f"{source} repeat {r + 1}, {attention}: {runs[attention][-1]['compile_s']:.1f} s", flush=True)
        splash, xla = (statistics.median(run["compile_s"] for run in runs[a]) for a in ("splash", "xla"))
        rows.append([source, f"{splash:.1f} s", f"{xla:.1f} s", f"{xla / splash:.2f}x",
                     f"{runs['splash'][0]['peak_bytes_per_chip'] / 2**30:.1f} / "
                     f"{runs['xla'][0]['peak_bytes_per_chip'] / 2**30:.1f} GiB"])
    return record.table(f"The same compile with splash's kernels and with XLA's attention: median of {args.repeats} "
                        f"alternating runs on {usable_cores()} cores",
                        ["TPU source", "splash kernels", "XLA attention", "ratio", "peak per chip, splash / XLA"],
                        rows)


if __name__ == "__main__":
    sys.exit(main())
