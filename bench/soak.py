"""Soak: does the server's memory stay flat over many runs, and over many large code checks?

Starts `app.py` (no auth: its token, as the printed URL gives it) with a fresh history, then two phases
through one client session, each with its own figure:

1. runs: plans the smallest workload once on `/plan` (mlp/tiny, this machine), then submits `--runs`
   runs of `--steps` steps one after the other on `/run`, every progress event streamed as a page would
   receive it;
2. code checks: `--checks` checks on `/code_check` of a paste that makes `--findings` findings (one
   `jax.pmap(f)` a line): the worker keeps the first findings and counts the rest, so what the server
   holds does not grow with them.

The server's resident memory (VmRSS of its process; its workers are separate processes) is printed
every `--every` runs or checks; the figure of each phase is the growth from the end of its first
`--every` (imports, caches and the first compile settled) to its end: target under 50 MB each.

    python bench/soak.py [--runs 100] [--steps 200] [--checks 200] [--findings 50000] [--every 10]
                         [--timeout-s 3600] [--json out.json]

`--runs 2 --steps 3 --checks 2 --findings 500 --every 1` is the smoke size the suite runs
(tests/test_benches.py). Exit status 0 when every run and check finished and both growths are under
the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench import record  # noqa: E402
from migration.config.fields import api_values  # noqa: E402  (the form's field table)
from tests.server import Server  # noqa: E402  (the launcher the app's tests use)

# The Migrate form by name: mlp/tiny from a v5e-8 at global batch 8, planned for this machine; the other
# fields take the table's defaults.
FORM = {"workload": "mlp", "preset": "tiny", "global_batch": 8, "target": "local"}
TARGET_GROWTH_MB = 50.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def growth(samples: list[dict]) -> float:
    return samples[-1]["rss_mb"] - samples[0]["rss_mb"] if len(samples) > 1 else 0.0


def soak_runs(server: Server, client, args, deadline: float) -> tuple[list[dict], int]:
    client.predict(*api_values("plan", **FORM, label="soak plan"), api_name="/plan")
    samples, failed, t0 = [], 0, time.monotonic()
    print(f"server pid {server.proc.pid}: {rss_mb(server.proc.pid):.1f} MB after start and plan", flush=True)
    for i in range(1, args.runs + 1):
        if time.monotonic() > deadline:
            print(f"timed out after {i - 1} runs", flush=True)
            return samples, failed + args.runs - i + 1
        job = client.submit(None, *api_values("run", **FORM, steps=args.steps, label=f"soak {i}"), api_name="/run")
        updates = sum(1 for _ in job)  # every streamed update, as a page receives them
        headline = job.result()[0]
        failed += "Run finished" not in headline
        if i % args.every == 0:
            samples.append({"runs": i, "rss_mb": rss_mb(server.proc.pid), "s": time.monotonic() - t0})
            print(f"after {i:4d} runs: server RSS {samples[-1]['rss_mb']:.1f} MB ({samples[-1]['s']:.0f} s; "
                  f"last run {updates} streamed updates)", flush=True)
    return samples, failed


def soak_checks(server: Server, client, args, deadline: float) -> tuple[list[dict], int]:
    paste = "import jax\n" + "jax.pmap(f)\n" * args.findings
    samples, failed, t0 = [], 0, time.monotonic()
    for i in range(1, args.checks + 1):
        if time.monotonic() > deadline:
            print(f"timed out after {i - 1} checks", flush=True)
            return samples, failed + args.checks - i + 1
        summary = client.predict(paste, [], api_name="/code_check")[0]
        failed += f"{args.findings:,} finding(s)" not in summary
        if i % args.every == 0:
            samples.append({"checks": i, "rss_mb": rss_mb(server.proc.pid), "s": time.monotonic() - t0})
            print(f"after {i:4d} checks of {args.findings:,} findings: server RSS {samples[-1]['rss_mb']:.1f} MB "
                  f"({samples[-1]['s']:.0f} s)", flush=True)
    return samples, failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checks", type=int, default=200)
    parser.add_argument("--findings", type=int, default=50_000)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="write the figures as a record (bench/results/soak.json), the samples under data")
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout_s
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        server = Server(Path(tmp), "--max-steps", str(max(args.steps, 10)))
        try:
            client = server.connect()
            runs, runs_failed = soak_runs(server, client, args, deadline) if args.runs else ([], 0)
            checks, checks_failed = soak_checks(server, client, args, deadline) if args.checks else ([], 0)
        finally:
            server.close()
    ok, rows = True, []
    for what, samples, failed in (("runs", runs, runs_failed), ("checks", checks, checks_failed)):
        if not samples and not failed:
            continue
        grew = growth(samples)
        good = failed == 0 and grew < TARGET_GROWTH_MB
        ok &= good
        first, last = (samples[0][what], samples[-1][what]) if samples else (0, 0)
        print(f"{what}: growth from {first} to {last} {what}: {grew:+.1f} MB (target < {TARGET_GROWTH_MB:g} MB); "
              f"{what} failed: {failed}; {'ok' if good else 'NOT OK'}", flush=True)
        phase = (f"{args.runs} runs of {args.steps} steps" if what == "runs"
                 else f"{args.checks} checks of {args.findings:,} findings")
        rows.append([phase, f"{samples[0]['rss_mb']:.1f} MB ({first})" if samples else "",
                     f"{samples[-1]['rss_mb']:.1f} MB ({last})" if samples else "", f"{grew:+.1f} MB", str(failed)])
    record.write(args.json, "soak", [record.table(
        f"The server's resident memory, one client session (target growth < {TARGET_GROWTH_MB:g} MB)",
        ["phase", "first sample", "last sample", "growth", "failed"], rows)],
        data={"runs": {"samples": runs, "growth_mb": growth(runs), "failed": runs_failed},
              "checks": {"samples": checks, "growth_mb": growth(checks), "findings": args.findings,
                         "failed": checks_failed}})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
