"""An idle process is not woken for nothing: the loops of the hub that have nothing to do
(no conflated frame held back, no presence room open, an empty outbox) set no timer and
ask the database once, not twice; each starts again as soon as there is work, which it
does as before. What the timers cost is measured in docs/performance.md (idle CPU
beside the floor); here, which timers are set."""

from __future__ import annotations

import asyncio
import types
from collections.abc import Coroutine, Generator
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
    """The delays of every timer the running loop is asked for from now on, whatever asks
    (``call_later``, ``sleep``, ``wait_for`` and ``timeout`` all end in ``call_at``).

    Found: only ``call_later`` with one exact delay was looked for, so a poll of another
    period (0.25 s in the drain, a 0.5 s ``wait_for`` in presence) passed."""
    loop = asyncio.get_running_loop()
    delays: list[float] = []
    real = loop.call_at

    def call_at(when: float, callback: Any, *args: Any, **kwargs: Any) -> asyncio.TimerHandle:
        delays.append(when - loop.time())
        return real(when, callback, *args, **kwargs)

    monkeypatch.setattr(loop, "call_at", call_at)
    return delays


def stepping(coro: Coroutine[Any, Any, Any], steps: list[int]) -> Any:
    """``coro``, counting in ``steps[0]`` each time the loop wakes it: a wake-up with no
    timer (a ``sleep(0)`` spin, a ``call_soon`` chain) counts too."""

    @types.coroutine
    def run() -> Generator[Any, Any, Any]:
        value: Any = None
        error: BaseException | None = None
        while True:
            steps[0] += 1
            try:
                out = coro.throw(error) if error is not None else coro.send(value)
            except StopIteration as stop:
                return stop.value
            try:
                value, error = (yield out), None
            except BaseException as exc:  # a cancellation goes on into the coroutine
                value, error = None, exc

    return run()


def near(delay: float, timers: list[float]) -> bool:
    """A timer of about ``delay`` was set (its clock read twice: a preemption between)."""
    return any(abs(d - delay) < 0.005 for d in timers)


async def _asleep(steps: list[int], timers: list[float]) -> None:
    """No timer of any length (a poll of any period is seen at once: it sets its first
    timer straight away), and not one step while the loop turns 200 times (a wake-up with
    no timer — a ``sleep(0)`` spin, a ``call_soon`` chain — would take some)."""
    await _settle()
    assert timers == [], timers
    before = steps[0]
    await _settle(200)
    assert steps[0] == before, f"woken {steps[0] - before} times while idle"
    timers.clear()


async def _settle(turns: int = 20) -> None:
    """Let the loop turn ``turns`` times (no timer: no wall-clock time waited for)."""
    for _ in range(turns):
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
    steps = [0]
    task = asyncio.ensure_future(stepping(drain_held(SimpleNamespace(fanout=fanout)), steps))
    try:
        await _asleep(steps, timers)  # it was a 50 ms timer at once, and every 50 ms after
        assert fanout.send_merged(conn, "a", frame("a", 0, 150)) is SEND  # the queue is over the threshold
        assert fanout.send_merged(conn, "a", frame("a", 1, 10)) is HOLD
        transport.queue.clear()  # the client read everything
        await _until(lambda: not fanout.holding)
        assert [p.split(b":")[:2] for p in transport.queue] == [[b"a", b"1"]]
        assert near(DRAIN_INTERVAL_S, timers)
        await _settle()
        timers.clear()
        await _asleep(steps, timers)  # nothing held again: asleep again
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_the_presence_loop_sets_no_timer_while_no_room_is_open(timers: list[float]) -> None:
    presence = Presence(SimpleNamespace(backplane=None, fanout=None))
    step = presence._interval() / WRITES_PER_INTERVAL
    steps = [0]
    task = asyncio.ensure_future(stepping(presence.run(), steps))
    try:
        await _asleep(steps, timers)
        conn = Connection(send=asyncio.Queue().put)
        presence.enter(conn, SimpleNamespace(name="room:1", base="room:1"))  # type: ignore[arg-type]
        await _settle()
        assert near(step, timers)  # someone is present here: written and renewed on the interval
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
    await drain.aclose()
    assert set(asked) == {"default"} and drain.rows == 1 and drain.oldest is not None
