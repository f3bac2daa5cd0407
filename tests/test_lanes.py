"""The gateway's lanes (`ui.lanes`), in-process on an event loop: per-user rate and slots, a user's
backlog waiting behind that user's own calls only, refusals that say when to retry, queued calls held
by their events, and a caller who leaves giving their place back."""

from __future__ import annotations

import asyncio
import time

import pytest

from ui.lanes import Gateway, Lane, LaneLimits
from ui.ownership import Refused

LIMITS = {Lane.LIGHT: LaneLimits(burst=100, per_s=100.0, running=2, waiting=3, wait_s=5.0),
          Lane.STOP: LaneLimits(burst=3, per_s=1.0, running=1, waiting=1, wait_s=5.0)}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_past_the_burst_a_user_is_refused_with_the_seconds_to_wait_and_others_are_not():
    async def main():
        gateway = Gateway(LIMITS)
        for _ in range(3):
            gateway.release(await gateway.admit("alice", Lane.STOP))
        with pytest.raises(Refused) as refused:
            await gateway.admit("alice", Lane.STOP)
        assert refused.value.status == 429 and refused.value.text.startswith("too many requests")
        assert "retry in 1 s" in refused.value.text and 0 < refused.value.retry_after_s <= 1.0
        gateway.release(await gateway.admit("bob", Lane.STOP))  # bob's own bucket
        gateway.release(await gateway.admit("alice", Lane.LIGHT))  # and alice's other lanes
    run(main())


def test_a_users_backlog_waits_behind_their_own_calls_in_order_and_past_it_is_refused():
    async def main():
        gateway = Gateway(LIMITS)
        held = [await gateway.admit("alice", Lane.LIGHT) for _ in range(2)]
        order: list[int] = []

        async def waiter(i: int) -> None:
            ticket = await gateway.admit("alice", Lane.LIGHT)
            order.append(i)
            await asyncio.sleep(0.02)
            gateway.release(ticket)

        waiters = [asyncio.create_task(waiter(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        assert gateway.in_use("alice", Lane.LIGHT) == (2, 3) and order == []
        with pytest.raises(Refused) as refused:  # her line is full
            await gateway.admit("alice", Lane.LIGHT)
        assert "2 light calls of yours running and 3 waiting" in refused.value.text
        t0 = time.monotonic()
        bobs = await gateway.admit("bob", Lane.LIGHT)  # bob waits behind nothing of alice's
        assert time.monotonic() - t0 < 0.005
        gateway.release(bobs)
        for ticket in held:
            gateway.release(ticket)
        await asyncio.gather(*waiters)
        assert order == [0, 1, 2]  # her own calls in the order she sent them
        assert gateway.in_use("alice", Lane.LIGHT) == (0, 0) and not gateway._slots
    run(main())


def test_a_queued_call_holds_its_slot_while_its_event_is_in_the_queue():
    live = {"e1"}

    async def main():
        gateway = Gateway(LIMITS, event_live=lambda e: e in live)
        ticket = await gateway.admit("alice", Lane.STOP)
        gateway.bind(ticket, "e1")
        waiting = asyncio.create_task(gateway.admit("alice", Lane.STOP))
        await asyncio.sleep(0.05)
        assert not waiting.done() and gateway.in_use("alice", Lane.STOP) == (1, 1)
        live.discard("e1")  # Gradio finished the event
        second = await waiting
        assert gateway.in_use("alice", Lane.STOP) == (1, 0)
        gateway.release(second)
    run(main())


def test_a_caller_who_leaves_gives_their_place_back_and_a_long_wait_is_refused():
    async def main():
        gateway = Gateway({Lane.LIGHT: LaneLimits(burst=100, per_s=100.0, running=1, waiting=2, wait_s=0.1)})
        held = await gateway.admit("alice", Lane.LIGHT)
        leaving = asyncio.create_task(gateway.admit("alice", Lane.LIGHT))
        await asyncio.sleep(0.03)
        leaving.cancel()  # the client disconnected while it waited
        await asyncio.gather(leaving, return_exceptions=True)
        assert gateway.in_use("alice", Lane.LIGHT) == (1, 0)
        with pytest.raises(Refused) as refused:  # her slot stays held past the longest wait
            await gateway.admit("alice", Lane.LIGHT)
        assert refused.value.status == 429 and "still hold" in refused.value.text
        gateway.release(held)
        gateway.release(await gateway.admit("alice", Lane.LIGHT))
    run(main())


def test_a_flood_of_250_calls_from_one_user_costs_another_user_nothing():
    """Alice sends 250 calls at once; each admitted one holds its slot 20 ms. Bob's calls meanwhile are
    admitted at once, and alice's past her rate and line are refused at once, never queued."""
    async def main():
        gateway = Gateway({Lane.LIGHT: LaneLimits(burst=20, per_s=5.0, running=2, waiting=8)})
        outcomes: list[str] = []

        async def call(user: str) -> float:
            t0 = time.monotonic()
            try:
                ticket = await gateway.admit(user, Lane.LIGHT)
            except Refused as exc:
                outcomes.append(f"{exc.status}")
                return time.monotonic() - t0
            waited = time.monotonic() - t0
            await asyncio.sleep(0.02)
            gateway.release(ticket)
            outcomes.append("ok")
            return waited

        flood = [asyncio.create_task(call("alice")) for _ in range(250)]
        await asyncio.sleep(0)
        bob_waits = [await call("bob") for _ in range(5)]
        await asyncio.gather(*flood)
        return outcomes, bob_waits

    outcomes, bob_waits = run(main())
    assert max(bob_waits) < 0.005, bob_waits
    # alice: of her burst of 20, 2 run and 8 wait in her line, 10 find it full; the other 230 are past her rate
    assert outcomes.count("ok") == 2 + 8 + 5 and outcomes.count("429") == 240
