"""What one streamed update of the Run event costs the server's event loop, side by side: the
result outputs sent as `gr.skip()` (Gradio rebuilds each skipped component and its API schema)
against `None` (what the app sends now, after a first update that hides and empties them).
Gradio's own `Blocks.postprocess_data` on the app's real Run event and one session, in one process.

    python bench/stream_update_cost.py [--updates 200]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_TMP = tempfile.mkdtemp(prefix="stream-cost-")
atexit.register(shutil.rmtree, _TMP, True)
os.environ.setdefault("MIGRATION_CACHE_DIR", _TMP)  # the app's files go there, not to the user's ~/.cache
os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(_TMP, "gradio"))

import gradio as gr  # noqa: E402
from gradio.state_holder import SessionState  # noqa: E402

from bench import record  # noqa: E402
from ui.demo import build_demo  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=200)
    parser.add_argument("--json", metavar="PATH", help="write the figures as a record (bench/results/stream_update_cost.json)")
    args = parser.parse_args()
    demo = build_demo()
    run = next(f for f in demo.fns.values() if f.api_name == "run")
    state = SessionState(demo)
    n = len(run.outputs)  # status, 10 result outputs, the job id (a State)
    cases = {"gr.skip() (before)": ["Step 3/8 ...", *[gr.skip()] * (n - 1)],
             "None, plot skipped (now)": ["Step 3/8 ...", None, gr.skip(), *[None] * (n - 4), gr.skip()]}

    async def per_update_ms(update: list) -> float:
        start = time.perf_counter()
        for _ in range(args.updates):
            await demo.postprocess_data(run, list(update), state)
        return (time.perf_counter() - start) / args.updates * 1000

    times = {}
    for _ in range(2):  # alternating, best of two each
        for name, update in cases.items():
            times[name] = min(times.get(name, float("inf")), asyncio.run(per_update_ms(update)))
    for name, ms in times.items():
        print(f"{name:28s} {ms:6.2f} ms per update of the Run event's {n} outputs")
    before, now = times.values()
    print(f"ratio before / now: {before / now:.1f}x")
    record.write(args.json, "stream_update_cost", [record.table(
        f"Gradio's postprocessing of one streamed update of the Run event ({n} outputs), best of 2 x {args.updates}",
        ["update", "ms of the event loop per update"], [[name, f"{ms:.2f}"] for name, ms in times.items()])],
        [f"Ratio before / now: {before / now:.1f}x."])


if __name__ == "__main__":
    main()
