"""Soak: does the server's memory stay flat over many runs?

Starts `app.py` (no auth: its token, as the printed URL gives it) with a fresh history, plans the
smallest workload once on `/plan` (mlp/tiny, this machine), then submits `--runs` runs of
`--steps` steps one after the other on `/run` through one client session, every progress event
streamed as a page would receive it. The server's resident memory (VmRSS of its process; its
workers are separate processes) is printed every `--every` runs; the figure the bench is for is the
growth from the end of the first `--every` runs (imports, caches and the first compile settled)
to the end: target under 50 MB.

    python bench/soak.py [--runs 100] [--steps 200] [--every 10] [--timeout-s 3600] [--json out.json]

Exit status 0 when every run finished and the growth is under the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.server import Server  # noqa: E402  (the launcher the app's tests use)

# The Migrate form in the app's order: mlp/tiny from a v5e-8 at global batch 8, planned for this machine.
FORM = ["mlp", "tiny", "tpu-v5e-8", 8, 0, "bf16", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0, 0,
        0, "preset", "auto", 8]
TARGET_GROWTH_MB = 50.0


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    deadline = time.monotonic() + args.timeout_s
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        server = Server(Path(tmp), "--max-steps", str(max(args.steps, 10)))
        try:
            client = server.connect()
            client.predict(*FORM, "soak plan", api_name="/plan")
            samples, failed, t0 = [], 0, time.monotonic()
            print(f"server pid {server.proc.pid}: {rss_mb(server.proc.pid):.1f} MB after start and plan", flush=True)
            for i in range(1, args.runs + 1):
                if time.monotonic() > deadline:
                    print(f"timed out after {i - 1} runs", flush=True)
                    return 1
                job = client.submit(None, args.steps, 0.003, False, False, False, False, False, *FORM, f"soak {i}",
                                    "", "", api_name="/run")
                updates = sum(1 for _ in job)  # every streamed update, as a page receives them
                headline = job.result()[0]
                failed += "Run finished" not in headline
                if i % args.every == 0:
                    samples.append({"runs": i, "rss_mb": rss_mb(server.proc.pid), "s": time.monotonic() - t0})
                    print(f"after {i:4d} runs: server RSS {samples[-1]['rss_mb']:.1f} MB ({samples[-1]['s']:.0f} s; "
                          f"last run {updates} streamed updates)", flush=True)
        finally:
            server.close()
    growth = samples[-1]["rss_mb"] - samples[0]["rss_mb"] if len(samples) > 1 else 0.0
    ok = failed == 0 and growth < TARGET_GROWTH_MB
    print(f"growth from {samples[0]['runs']} to {samples[-1]['runs']} runs: {growth:+.1f} MB "
          f"(target < {TARGET_GROWTH_MB:g} MB); runs failed: {failed}; {'ok' if ok else 'NOT OK'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "growth_mb": growth, "failed": failed}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
