"""An idle process is not woken for nothing: the loops of the hub that have nothing to do
(no conflated frame held back, no presence room open, an empty outbox) set no timer and
ask the database once, not twice; each starts again as soon as there is work, which it
does as before. What the timers cost is measured in docs/performance.md (idle CPU
beside the floor); here, which timers are set."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from asgiref.sync import sync_to_async

from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import DRAIN_INTERVAL_S, Fanout, drain_held
from realtime_app.hub.presence import WRITES_PER_INTERVAL, Presence
from realtime_app.outbound.backpressure import HOLD, SEND, BackpressureConfig
from realtime_app.outbound.guard import Guard
from tests.support.queue_model import QueueModel, frame


@pytest.fixture
async def timers(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The delays of every timer the running loop is asked for from now on."""
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    real = loop.call_later

    def call_later(delay: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        delays.append(delay)
        return real(delay, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_later", call_later)
    return delays


async def _settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def _until(condition: Any, timeout: float = 5.0) -> None:
    """``tests.support.waiting.eventually``, but polling on a timer of its own length
    (10 ms): its 50 ms is the drain loop's, which these tests look for."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def test_the_drain_loop_sets_no_timer_while_nothing_is_held_and_writes_what_is(timers: list[float]) -> None:
    transport = QueueModel()
    conn = Connection(send=asyncio.Queue().put)
    conn.guard = Guard(lambda message: None, BackpressureConfig(100, "drop", 5), transport)
    fanout = Fanout({"a": {conn}}, {conn}, lambda c: None)
    task = asyncio.create_task(drain_held(SimpleNamespace(fanout=fanout)))
    try:
        await _settle()
        assert DRAIN_INTERVAL_S not in timers  # it was a 50 ms timer at once, and every 50 ms after
        assert fanout.send_merged(conn, "a", frame("a", 0, 150)) is SEND  # the queue is over the threshold
        assert fanout.send_merged(conn, "a", frame("a", 1, 10)) is HOLD
        transport.queue.clear()  # the client read everything
        await _until(lambda: not fanout.holding)
        assert [p.split(b":")[:2] for p in transport.queue] == [[b"a", b"1"]]
        assert DRAIN_INTERVAL_S in timers
        await _settle()
        timers.clear()
        await _settle()
        assert DRAIN_INTERVAL_S not in timers  # nothing held again: asleep again
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_presence_loop_sets_no_timer_while_no_room_is_open(timers: list[float]) -> None:
    presence = Presence(SimpleNamespace(backplane=None, fanout=None))
    step = presence._interval() / WRITES_PER_INTERVAL
    task = asyncio.create_task(presence.run())
    try:
        await _settle()
        assert step not in timers
        conn = Connection(send=asyncio.Queue().put)
        presence.enter(conn, SimpleNamespace(name="room:1", base="room:1"))  # type: ignore[arg-type]
        await _settle()
        assert step in timers  # someone is present here: written and renewed on the interval
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@pytest.mark.django_db(transaction=True)
async def test_an_empty_outbox_is_asked_once_a_pass_and_counted_all_the_same(
    hub: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from realtime_app.hub.outbox import OutboxDrain
    from realtime_app.models import OutboxEntry
    from realtime_app.persistence import outbox

    asked: list[str] = []
    real = outbox.stats

    def stats(alias: str) -> Any:
        asked.append(alias)
        return real(alias)

    monkeypatch.setattr(outbox, "stats", stats)
    drain = OutboxDrain(hub)
    await drain.drain()
    assert asked == [] and (drain.rows, drain.oldest) == (0, None)  # before: a count after every empty read
    # A row of a channel no process publishes (an older deploy's): it waits, and is counted.
    await sync_to_async(OutboxEntry.objects.create)(channel="gone:channel", data="{}")
    drain._counted = 0.0  # a beat later
    await drain.drain()
    assert set(asked) == {"default"} and drain.rows == 1 and drain.oldest is not None
