"""The app's queue over a Ray cluster, shown: a one-node Ray head on loopback declaring 2 GPU slots,
the app pointed at it (MIGRATION_RAY_ADDRESS), three clients each submitting a run at once. Prints
a timeline of what each client's page shows (its latest progress line, whenever it changes), then
the history rows. Two runs step at once and the third waits at queue position 1 until a slot frees.

On a CPU-only machine the declared GPUs are slots only: the workers run on JAX's CPU platform.

    python bench/ray_queue.py [--steps 40]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.server import Server, free_port, value  # noqa: E402

RAY = str(Path(sys.executable).with_name("ray"))
NO_AUTH = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
FORM = ["mlp", "tiny", "tpu-v5e-8", 32, 0, "fp32", "local", 1, 0.8, "multiple8", "auto", "auto", 0, 0, 0, 0, 0, 0,
        0, 0, "preset", "auto", 8]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be a whole number of at least 1; got {args.steps}")
    temp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    work = Path(tempfile.mkdtemp(prefix="ray-queue-"))
    env = {**os.environ, **NO_AUTH, "MIGRATION_CACHE_DIR": str(work / "node-cache")}
    port = free_port()
    subprocess.run([RAY, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-gpus=2",
                    "--num-cpus=2", "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                    f"--temp-dir={temp}", "--disable-usage-stats"], check=True, env=env, capture_output=True,
                   timeout=180)
    app = None
    try:
        os.environ.update(NO_AUTH)
        app = Server(work / "app", env={"MIGRATION_RAY_ADDRESS": f"127.0.0.1:{port}", **NO_AUTH})
        print(f"app: {app.first_line()}")
        clients = [app.client, app.connect(), app.connect()]
        t0 = time.monotonic()
        jobs = [c.submit(None, args.steps, 0.003, False, False, False, False, False, *FORM, f"ray queue {i}",
                         api_name="/run") for i, c in enumerate(clients)]
        shown = [""] * len(jobs)
        while not all(j.done() for j in jobs):
            for i, job in enumerate(jobs):
                outputs = job.outputs()
                text = str(value(outputs[-1][0])).strip() if outputs else ""
                line = " / ".join(text.splitlines()[-2:])[:150]
                if line != shown[i]:
                    shown[i] = line
                    print(f"{time.monotonic() - t0:7.1f} s  client {i}: {line}")
            time.sleep(0.2)
        history = app.client.predict("mine", "run", "all", "all", api_name="/history")
        print("history:", history["headers"])
        for row in history["data"]:
            print("  ", row)
    finally:
        if app is not None:
            app.close()
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120, check=False)
        shutil.rmtree(temp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
