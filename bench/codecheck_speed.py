"""The code check's speed as a linter: the whole real corpus (tests/fixtures/codecheck/real/) checked by
`python -m migration.codecheck`, in a fresh process that refuses to import JAX, Flax, Optax, NumPy, pandas,
Gradio and LibCST (as in pre-commit or CI without JAX). Each run's CPU time (user + system of the child,
interpreter start-up included) and wall time; the goal is under 1 s of CPU for the whole corpus.

Side by side in the same loop: the same process checking one one-line file (start-up and imports alone),
and Python's own parser reading the corpus (`ast.parse`, in this process): this machine's speed drifts, and
the ratio to the parse says what the check costs in units of the work every linter must do.

    python bench/codecheck_speed.py [--runs 7] [--before REF] [--json bench/results/codecheck_speed.json]

With `--before REF` (a git commit, tag or branch of this repository), that commit's linter (its `migration/`
package and `pyproject.toml`, unpacked into a temporary folder) checks the same corpus in the same loop: the
baseline, measured side by side with this checkout's.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import resource
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from tests.test_codecheck_lint import NO_HEAVY  # noqa: E402  (the same import guard as the linter's tests)

CORPUS = ROOT / "tests" / "fixtures" / "codecheck" / "real"
GOAL_CPU_S = 1.0


def run(paths: list[str], root: Path = ROOT) -> tuple[float, float, int]:
    """(CPU seconds of the child, wall seconds, exit code) for one linter run of the code in `root`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", NO_HEAVY, *paths, "--format", "json"], cwd=root,
                          capture_output=True, text=True, env={"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"})
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise SystemExit(f"the linter failed (rc {done.returncode}): {done.stderr[-2000:]}")
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, wall, done.returncode


def unpack(ref: str, folder: Path) -> Path:
    """The linter of commit `ref` (its migration/ package and pyproject.toml) unpacked into `folder`."""
    archive = subprocess.run(["git", "archive", "--format=tar", ref, "migration", "pyproject.toml"], cwd=ROOT,
                             capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--before {ref}: {archive.stderr.decode(errors='replace').strip()[-500:]}")
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(folder, filter="data")
    return folder


def _positive(text: str) -> int:
    try:
        runs = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 1 <= runs <= 100:
        raise argparse.ArgumentTypeError(f"{runs} runs: allowed are 1 to 100")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=_positive, default=7, help="runs of each command (1 to 100)")
    parser.add_argument("--before", metavar="REF", default=None,
                        help="a commit whose linter checks the same corpus in the same loop (the baseline)")
    parser.add_argument("--json", metavar="PATH", default=None, help="write the figures as a record")
    args = parser.parse_args(argv)
    files = sorted(CORPUS.glob("*.py"))
    lines = sum(p.read_text(encoding="utf-8").count("\n") + 1 for p in files)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = Path(tmp) / "one.py"
        tiny.write_text("x = 1\n")
        baseline = unpack(args.before, Path(tmp) / "before") if args.before else None
        corpus, startup, parse, before = [], [], [], []
        texts = [p.read_text(encoding="utf-8") for p in files]
        for _ in range(args.runs):  # interleaved, so that all of them see the same machine
            corpus.append(run([str(CORPUS)]))
            if baseline is not None:
                before.append(run([str(CORPUS)], baseline))
            startup.append(run([str(tiny)]))
            start = time.process_time()
            for text in texts:
                ast.parse(text)
            parse.append(time.process_time() - start)
    cpu = [c for c, _, _ in corpus]
    base = [c for c, _, _ in startup]
    result = {
        "files": len(files), "lines": lines, "runs": args.runs,
        "corpus_cpu_s": {"min": round(min(cpu), 3), "median": round(statistics.median(cpu), 3)},
        "corpus_wall_s": {"min": round(min(w for _, w, _ in corpus), 3)},
        "startup_cpu_s": {"min": round(min(base), 3), "median": round(statistics.median(base), 3)},
        "analysis_cpu_s_median": round(statistics.median(cpu) - statistics.median(base), 3),
        "parse_cpu_s": {"min": round(min(parse), 3), "median": round(statistics.median(parse), 3)},
        "corpus_over_parse_median": round(statistics.median(c / p for c, p in zip(cpu, parse)), 2),
        "lines_per_cpu_s": round(lines / statistics.median(cpu)),
        "goal_cpu_s": GOAL_CPU_S, "median_over_goal": round(statistics.median(cpu) / GOAL_CPU_S, 3),
    }
    seconds = lambda values: f"{min(values):.2f} / {statistics.median(values):.2f} s"  # noqa: E731
    rows = [["the whole corpus", seconds(cpu), f"{min(w for _, w, _ in corpus):.2f} s"]]
    notes = [f"The whole corpus costs {result['corpus_over_parse_median']}x Python's parse of it (median of the "
             "runs' ratios); the goal's 1 s is absolute."]
    if before:
        prior = [c for c, _, _ in before]
        result["before"] = {"ref": args.before, "corpus_cpu_s": {"min": round(min(prior), 3),
                                                                 "median": round(statistics.median(prior), 3)},
                            "median_ratio": round(statistics.median(c / b for c, b in zip(cpu, prior)), 3)}
        rows.append([f"the whole corpus, by the linter of {args.before} (before)", seconds(prior),
                     f"{min(w for _, w, _ in before):.2f} s"])
        notes.append(f"This checkout's linter takes {result['before']['median_ratio']}x the CPU time of "
                     f"{args.before}'s over the same corpus (median of the runs' ratios, runs interleaved).")
    rows += [["one one-line file (start-up)", seconds(base), f"{min(w for _, w, _ in startup):.2f} s"],
             ["ast.parse of the corpus alone (in the bench's process)", seconds(parse), ""]]
    print(json.dumps(result, indent=1))
    record.write(args.json, "codecheck_speed", [record.table(
        f"The linter over the real corpus ({len(files)} files, {lines:,} lines), {args.runs} runs interleaved, "
        f"JAX and NumPy refused (goal: under {GOAL_CPU_S:g} s of CPU)",
        ["run", "CPU min / median", "wall min"], rows)], notes, data=result)
    return 0 if statistics.median(cpu) < GOAL_CPU_S else 1


if __name__ == "__main__":
    sys.exit(main())
