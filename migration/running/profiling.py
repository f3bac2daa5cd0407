"""Profile capture summaries: a few steps under `jax.profiler.trace`, read back from the Perfetto
trace it writes (JSON, stdlib only) into the time split the checklist reports."""

from __future__ import annotations

import collections
import gzip
import json
from pathlib import Path
from typing import Any


def summarise_trace(log_dir: str | Path, steps: int, top: int = 8) -> dict[str, Any]:
    """Top operations by total duration, and the device-busy share where the trace has devices.

    Python frames (names starting with '$') are left out: they nest around everything else.
    """
    paths = sorted(Path(log_dir).glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        return {"path": str(log_dir), "steps": steps, "top_ops": [], "note": "no Perfetto trace was written"}
    data = json.loads(gzip.open(paths[-1]).read())
    events = data["traceEvents"] if isinstance(data, dict) else data
    process = {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}
    totals: collections.Counter[str] = collections.Counter()
    device_busy = 0.0
    start, end = float("inf"), 0.0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e or str(e.get("name", "")).startswith("$"):
            continue
        totals[e["name"]] += e["dur"]
        start, end = min(start, e["ts"]), max(end, e["ts"] + e["dur"])
        if "device" in process.get(e.get("pid"), "").lower():
            device_busy += e["dur"]
    span = max(end - start, 1e-9)
    return {
        "path": str(paths[-1]),
        "steps": steps,
        "span_ms": span / 1e3,
        "device_busy_share": device_busy / span if device_busy else None,
        "processes": sorted(set(process.values())),
        "top_ops": [{"name": name, "total_ms": dur / 1e3, "share": dur / span} for name, dur in totals.most_common(top)],
    }
