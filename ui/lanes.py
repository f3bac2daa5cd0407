"""The gateway's lanes: every call a user makes, however it reaches the server (the page's unqueued
`/run/...`, the queue's `/queue/join`, a plain client's `/call/...`), is admitted in its lane before it
takes anything shared: a worker of Gradio's queue, a thread, a place in a queue.

Each user has their own slots in each lane. A call past the user's rate (a token bucket) is refused at
once; a call past the user's running slots waits in the user's own short line, behind that user's own
calls only, and a call past that line is refused. Refusals are 429 with the seconds to wait. So one
user's flood costs other users nothing: nothing of it ever reaches the queue they share.

Lanes: `job` (plan, run, autotune, serving: the job service's own per-user limits apply as well),
`task` (code check, environment probe), `light` (history, compare, exports and the page's small events)
and `stop` (Stop and cancel_job: a lane of its own, so a user can stop their run whatever else they or
anyone else has sent).

A slot is held from admission until the call ends: the request itself for an unqueued call, the event
for a queued one (while Gradio's queue holds it). Everything here runs on the server's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import enum
import time
from collections.abc import Callable

from migration.service.job import Limits, TokenBuckets, retry_text
from ui.ownership import Refused

POLL_S = 0.01  # how often a waiting call looks for a free slot (a queued event ends inside Gradio)


class Lane(enum.Enum):
    JOB = "job"
    TASK = "task"
    LIGHT = "light"
    STOP = "stop"


API_LANES: dict[str, Lane] = {
    "plan": Lane.JOB, "run": Lane.JOB, "autotune": Lane.JOB, "serve_plan": Lane.JOB, "serve_run": Lane.JOB,
    "code_check": Lane.TASK, "environment": Lane.TASK,
    "stop": Lane.STOP, "serve_stop": Lane.STOP, "cancel_job": Lane.STOP,
    "history": Lane.LIGHT, "compare": Lane.LIGHT, "export_csv": Lane.LIGHT, "export_history_csv": Lane.LIGHT,
}  # every other event (the page's private ones: presets, a row selected, the page's load) is light


def lane_of(api_name: str | None) -> Lane:
    return API_LANES.get(api_name or "", Lane.LIGHT)


@dataclasses.dataclass(frozen=True)
class LaneLimits:
    burst: int  # calls at once before the rate applies
    per_s: float  # calls a second after the burst
    running: int  # calls of one user admitted and not yet finished
    waiting: int  # calls of one user waiting for one of their running slots
    wait_s: float = 30.0  # the longest a call waits for its slot before it is refused


def lane_limits(limits: Limits) -> dict[Lane, LaneLimits]:
    """Per user, in each lane. Jobs and tasks get one slot over the job service's own limit, so that the
    first call past it reads the service's own explanation; further ones are refused here. Their rate is
    loose (a script that submits and corrects a form in a loop is not a flood): the running slots are
    what bound them."""
    return {Lane.JOB: LaneLimits(burst=60, per_s=10.0, running=limits.jobs_per_user + 1, waiting=0),
            Lane.TASK: LaneLimits(burst=60, per_s=10.0, running=limits.tasks_per_user + 1, waiting=0),
            Lane.LIGHT: LaneLimits(burst=20, per_s=5.0, running=2, waiting=8),
            Lane.STOP: LaneLimits(burst=10, per_s=2.0, running=2, waiting=4)}


class Ticket:
    """One admitted call: its slot is free once it is released (an unqueued call's request ended, or a
    queued call that made no event) or once its event has left Gradio's queue."""

    def __init__(self, user: str, lane: Lane):
        self.user, self.lane = user, lane
        self.event_id: str | None = None
        self.released = False

    def finished(self, event_live: Callable[[str], bool]) -> bool:
        return self.released or (self.event_id is not None and not event_live(self.event_id))


@dataclasses.dataclass
class _Slots:
    running: list[Ticket] = dataclasses.field(default_factory=list)
    waiting: collections.deque[object] = dataclasses.field(default_factory=collections.deque)

    def prune(self, event_live: Callable[[str], bool]) -> None:
        self.running = [t for t in self.running if not t.finished(event_live)]


class Gateway:
    """The lanes' state: token buckets per user and lane, and each user's running and waiting calls."""

    def __init__(self, limits: dict[Lane, LaneLimits], event_live: Callable[[str], bool] = lambda _: False):
        self.limits = limits
        self.event_live = event_live  # whether Gradio's queue still holds an event (waiting or running)
        self._rates = {lane: TokenBuckets(lim.per_s, lim.burst) for lane, lim in limits.items()}
        self._slots: dict[tuple[str, Lane], _Slots] = {}

    async def admit(self, user: str, lane: Lane) -> Ticket:
        """A slot for one call of `user` in `lane`, waiting behind the user's own earlier calls; Refused
        (429, with the seconds to wait) past the user's rate, their line or the longest wait."""
        lim = self.limits[lane]
        wait = self._rates[lane].take(user)
        if wait > 0.0:
            raise Refused(429, f"too many requests: at most {lim.burst} {lane.value} calls in a burst and "
                               f"{lim.per_s:g} a second per user; retry in {retry_text(wait)}", retry_after_s=wait)
        key = (user, lane)
        slots = self._slots.setdefault(key, _Slots())
        slots.prune(self.event_live)
        if not slots.waiting and len(slots.running) < lim.running:
            return self._start(slots, user, lane)
        if len(slots.waiting) >= lim.waiting:
            raise Refused(429, f"too many requests: {len(slots.running)} {lane.value} calls of yours running and "
                               f"{len(slots.waiting)} waiting (at most {lim.running} and {lim.waiting}); "
                               "retry in 1 s", retry_after_s=1.0)
        me = object()
        slots.waiting.append(me)
        deadline = time.monotonic() + lim.wait_s
        try:
            while True:
                await asyncio.sleep(POLL_S)
                slots.prune(self.event_live)
                if slots.waiting[0] is me and len(slots.running) < lim.running:
                    slots.waiting.popleft()
                    return self._start(slots, user, lane)
                if time.monotonic() > deadline:
                    raise Refused(429, f"too many requests: your earlier {lane.value} calls still hold your "
                                       f"{lim.running} slots after {lim.wait_s:g} s; retry in 5 s", retry_after_s=5.0)
        finally:
            if me in slots.waiting:
                slots.waiting.remove(me)
            self._tidy(key)

    def bind(self, ticket: Ticket, event_id: str) -> None:
        """A queued call's event: the slot is held while Gradio's queue holds the event."""
        ticket.event_id = event_id

    def release(self, ticket: Ticket) -> None:
        """An unqueued call ended, or a queued call made no event."""
        ticket.released = True
        self._tidy((ticket.user, ticket.lane))

    def in_use(self, user: str, lane: Lane) -> tuple[int, int]:
        """(running, waiting) calls of `user` in `lane`."""
        slots = self._slots.get((user, lane))
        if slots is None:
            return 0, 0
        slots.prune(self.event_live)
        return len(slots.running), len(slots.waiting)

    def _start(self, slots: _Slots, user: str, lane: Lane) -> Ticket:
        ticket = Ticket(user, lane)
        slots.running.append(ticket)
        return ticket

    def _tidy(self, key: tuple[str, Lane]) -> None:
        """Forget a user's lane once nothing of theirs is in it (bounded by the users who have calls)."""
        slots = self._slots.get(key)
        if slots is not None:
            slots.prune(self.event_live)
            if not slots.running and not slots.waiting:
                del self._slots[key]
