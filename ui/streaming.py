"""Following a job from a page: its events as they come, the line a queued job shows, and the first streamed
update that hides and empties a job's result outputs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import gradio as gr

from migration.service.job import Job
from migration.service.jobs import JobService

POLL_S = 0.25  # how often a watcher looks for a job's new events
WAITING_REFRESH_S = 30.0  # a queued job's line is re-sent this often when its position has not changed


async def follow(service: JobService, job: Job) -> AsyncIterator[dict[str, Any]]:
    """A job's events as they come, with `waiting` events (queue position) while it is queued.
    Closing this (Stop, a closed tab, a dropped connection) stops the job."""
    cursor, last_position, last_wait = 0, None, 0.0
    try:
        while True:
            events = job.events_since(cursor)
            if events:
                cursor = events[-1]["seq"] + 1
            for ev in events:
                yield ev
            if job.finished and not job.events_since(cursor):
                return
            if job.state == "queued":
                position, now = service.position(job), time.monotonic()
                if position != last_position or now - last_wait > WAITING_REFRESH_S:
                    last_position, last_wait = position, now
                    ahead = ", ".join(j.summary for j in service.running(job.lane)) or "nothing yet"
                    yield {"event": "waiting", "position": position, "running": ahead}
            await asyncio.sleep(POLL_S if job.state != "queued" else 2 * POLL_S)
    finally:
        if not job.finished:
            service.cancel(job.id, job.user)


async def finished(service: JobService, job: Job) -> Job:
    """`job` once it has ended; a client that goes away (Stop, a closed tab) stops it."""
    try:
        while not job.finished:
            await asyncio.sleep(POLL_S / 2)
    finally:
        if not job.finished:
            service.cancel(job.id, job.user)
    return job


def waiting_line(ev: dict[str, Any], what: str) -> str:
    return f"⏳ {what} is queued: position {ev['position']} (running now: {ev['running']})."


def cleared(n: int) -> list[dict[str, Any]]:
    """`n` result outputs hidden and emptied: a job's first streamed update. Its later updates send
    them `None` (still hidden and empty) rather than `gr.skip()`, for which Gradio rebuilds the
    component and its API schema on every update: 8.5 against 1.7 ms of the event loop per update
    of a run's 12 outputs, times every open page."""
    return [gr.update(value=None, visible=False)] * n
