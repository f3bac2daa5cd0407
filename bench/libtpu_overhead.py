"""What installing libtpu (the TPU compiler, through jax[tpu]) costs what does not use it: the server's
start-up, a run on this machine, a plan for a GPU target without the TPU compile. Each is timed in two
environments that differ only by libtpu, alternating (without, with, without, with, ...) so that drift
on a shared machine hits both; the median of the repeats of each is compared, and every line either
writes to stderr that names libtpu or a TPU is counted. The environment with libtpu also times the plan
with the TPU side compiled (what the TPU compile adds).

    python -m venv /tmp/nolibtpu && /tmp/nolibtpu/bin/pip install -r <requirements.txt with jax[cuda12]> \\
        -c constraints.txt
    python bench/libtpu_overhead.py --without /tmp/nolibtpu/bin/python [--repeats 3] [--json PATH]

Baseline: the same commands in the environment without libtpu. Goal: ratios within noise (about 1.00)
and no TPU line on stderr.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from tests.server import Server  # noqa: E402

TPU_LINE = re.compile(r"libtpu|TPU_|InitGoogle|tpu", re.IGNORECASE)
PLAN = ["-m", "migration", "plan", "--workload", "transformer", "--preset", "tiny", "--target", "h100-sxm",
        "--global-batch", "64"]
COMMANDS = {  # name: arguments after the interpreter
    "plan for a GPU target (--no-tpu-compile)": [*PLAN, "--no-tpu-compile"],
    "run on this machine (mlp, 20 steps)": ["-m", "migration", "run", "--workload", "mlp", "--steps", "20", "--quiet"],
}
WITH_TPU_COMPILE = "plan with the TPU side compiled"


def timed(python: str, args: list[str], cache: Path) -> tuple[float, int]:
    """Wall seconds of the command in a fresh process and the TPU lines it wrote to stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run([python, *args], cwd=ROOT, capture_output=True, text=True, timeout=1800,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(cache), "MIGRATION_CACHE_DIR": str(cache)})
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{python} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return seconds, sum(1 for line in proc.stderr.splitlines() if TPU_LINE.search(line))


def server_start(python: str, tmp: Path) -> tuple[float, int]:
    """Seconds from launching `python app.py` until it listens, and the TPU lines in its logs."""
    t0 = time.perf_counter()
    server = Server(tmp, python=python, client=False)
    seconds = time.perf_counter() - t0
    time.sleep(1.0)  # anything it logs just after listening
    server.close()
    return seconds, sum(1 for line in server.stderr_path.read_text(errors="replace").splitlines()
                        if TPU_LINE.search(line))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--without", required=True, help="the interpreter of an environment without libtpu")
    parser.add_argument("--with", dest="with_", default=sys.executable, help="the interpreter with libtpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", metavar="PATH", help="write the record (bench/results/libtpu_overhead.json)")
    args = parser.parse_args()
    sides = {"without libtpu": args.without, "with libtpu": args.with_}
    for name, python in sides.items():
        has = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec('libtpu') is not None)"],
                             capture_output=True, text=True).stdout.strip() == "True"
        if has != (name == "with libtpu"):
            raise SystemExit(f"{python}: libtpu {'missing' if not has else 'present'}; it is the {name} side")
    seconds: dict[tuple[str, str], list[float]] = {}
    lines: dict[tuple[str, str], int] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        for i in range(args.repeats):
            for side, python in sides.items():
                cache = tmp / f"cache-{i}-{side.replace(' ', '-')}"  # cold compile cache each time
                cache.mkdir()
                measured = {"server start-up (until it listens)": server_start(python, tmp / f"server-{i}-{len(side)}")}
                for name, cmd in COMMANDS.items():
                    measured[name] = timed(python, cmd, cache)
                if side == "with libtpu":
                    (tmp / f"cache-{i}-tpu").mkdir()
                    measured[WITH_TPU_COMPILE] = timed(python, PLAN, tmp / f"cache-{i}-tpu")
                for name, (s, n) in measured.items():
                    seconds.setdefault((name, side), []).append(s)
                    lines[(name, side)] = lines.get((name, side), 0) + n
                print(f"repeat {i + 1} {side}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in measured.items()),
                      flush=True)
    rows = []
    for name in ["server start-up (until it listens)", *COMMANDS, WITH_TPU_COMPILE]:
        without = seconds.get((name, "without libtpu"))
        with_ = seconds[(name, "with libtpu")]
        w = statistics.median(with_)
        base = statistics.median(without) if without else None
        rows.append([name, f"{base:.2f} s" if base else "n/a", f"{w:.2f} s",
                     f"{w / base:.3f}x" if base else "n/a",
                     f"{lines.get((name, 'without libtpu'), 0)} / {lines[(name, 'with libtpu')]}"])
    columns = ["what", "without libtpu (median)", "with libtpu (median)", "ratio", "TPU lines on stderr (without / with)"]
    print(" | ".join(columns))
    for row in rows:
        print(" | ".join(row))
    record.write(args.json, "libtpu_overhead", [record.table(
        f"libtpu installed against not: median of {args.repeats} alternating repeats, fresh processes, cold caches",
        columns, rows)])


if __name__ == "__main__":
    main()
