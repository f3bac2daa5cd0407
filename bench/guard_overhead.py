"""What the web guard (`ui.guard.WebGuard`: the route table, ownership checks, body caps) adds to a request,
side by side in one process: the same requests to the app's real Gradio server object, through the guard
and without it, over ASGI in-process (no sockets), alternated so that both see the same machine.

Requests: GET /config (the page's layout, public), POST /gradio_api/run/history (an unqueued event in a
session: the body is read as its handler reads it and checked for the session, events and files it
names, then the call is admitted in its lane; the lanes' rates are set out of reach here, so that every
call runs on both sides) and a GET of a route outside the table (refused by the guard alone, by
Gradio's 404 without it).

    python bench/guard_overhead.py [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
_TMP = tempfile.mkdtemp(prefix="guard-overhead-")
atexit.register(shutil.rmtree, _TMP, True)  # the app's history, exports and uploads of this run alone
os.environ.setdefault("MIGRATION_CACHE_DIR", _TMP)
os.environ.setdefault("GRADIO_TEMP_DIR", os.path.join(_TMP, "gradio"))
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

import httpx  # noqa: E402

from bench import record  # noqa: E402
from tests.server import free_port  # noqa: E402
from ui.demo import build_demo  # noqa: E402
from ui.guard import WebGuard, WebPolicy  # noqa: E402
from ui.lanes import Lane, LaneLimits  # noqa: E402
from ui.settings import Settings  # noqa: E402


class WithApp:
    """Sets scope["app"] as Starlette does before its middleware (the guard reads the route list there)."""

    def __init__(self, guard, app):
        self.guard, self.app = guard, app

    async def __call__(self, scope, receive, send):
        scope["app"] = self.app
        await self.guard(scope, receive, send)


async def timed(client: httpx.AsyncClient, method: str, path: str, **kw) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await client.request(method, path, **kw)
    return time.perf_counter() - t0, r.status_code


async def main_async(requests: int) -> list[list[str]]:
    demo = build_demo(Settings(history_db=os.path.join(_TMP, "history.sqlite")))
    demo.queue()
    app, _, _ = demo.launch(server_name="127.0.0.1", server_port=free_port(), prevent_thread_lock=True, quiet=True,
                            enable_monitoring=False, ssr_mode=False)
    fn = next(d._id for d in demo.fns.values() if d.api_name == "history")
    lanes = {lane: LaneLimits(burst=10**9, per_s=1e9, running=10**9, waiting=0) for lane in Lane}
    guard = WithApp(WebGuard(app, WebPolicy(hosts=frozenset({"test"}), export_dir=Path(_TMP) / "exports",
                                            lanes=lanes)), app)
    body = {"data": ["mine", "all", "all", "all"], "fn_index": fn, "session_hash": "bench-session"}
    cases = {"GET /config": ("GET", "/config", {}),
             "POST /gradio_api/run/history": ("POST", "/gradio_api/run/history", {"json": body}),
             "GET a route outside the table": ("GET", "/gradio_api/no-such-route", {})}
    clients = {name: httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://test")
               for name, a in (("without", app), ("with", guard))}
    rows: list[list[str]] = []
    print(f"{'request':<32} {'without guard':>14} {'with guard':>11} {'ratio':>6}  (median of {requests}, in-process ASGI)")
    try:
        for name, (method, path, kw) in cases.items():
            times: dict[str, list[float]] = {"without": [], "with": []}
            statuses: dict[str, set[int]] = {"without": set(), "with": set()}
            for _ in range(requests):
                for side in ("without", "with"):
                    t, status = await timed(clients[side], method, path, **kw)
                    times[side].append(t)
                    statuses[side].add(status)
            a, b = statistics.median(times["without"]), statistics.median(times["with"])
            print(f"{name:<32} {a * 1e3:>11.2f} ms {b * 1e3:>8.2f} ms {b / a:>5.2f}x  "
                  f"(status {sorted(statuses['without'])} / {sorted(statuses['with'])})")
            rows.append([name, f"{a * 1e3:.2f} ms", f"{b * 1e3:.2f} ms", f"{b / a:.2f}x",
                         f"{sorted(statuses['without'])} / {sorted(statuses['with'])}"])
    finally:
        for c in clients.values():
            await c.aclose()
        demo.close()
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--json", metavar="PATH", help="write the table as a record (bench/results/guard_overhead.json)")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args.requests))
    record.write(args.json, "guard_overhead", [record.table(
        f"Median of {args.requests} requests each, alternating, in-process ASGI",
        ["request", "without the guard", "with the guard", "ratio", "status without / with"], rows)])
    return 0


if __name__ == "__main__":
    sys.exit(main())
