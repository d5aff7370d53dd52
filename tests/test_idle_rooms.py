"""Idle rooms cost nothing per beat (realtime_app.hub.presence, .reconciler, .probe).
Found: 200 idle anonymous sockets held 20,000 presence rooms and kept daphne at 85 % of a
core — every room's presence part written again every beat, every channel walked by
each beat, each probe and each re-validation round. The CPU ratio lives in
bench/idle_rooms.py; here, the work a beat does is counted."""

from __future__ import annotations

from types import SimpleNamespace

from realtime_app.cluster.base import PRESENCE_KEEP_MS
from realtime_app.hub import presence as presence_module
from realtime_app.hub import probe as probe_module
from tests.support.asgi_client import Client

ROOMS = 30


async def test_idle_rooms_are_written_once_then_a_third_of_their_life_later_not_every_beat(hub, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(presence_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    presence = hub.presence
    async with Client() as c:
        for n in range(ROOMS):
            assert "result" in await c.call("subscribe", {"channel": f"test:room:idle-{n}"})
        await presence.turn(renew=True, reading=False)  # the new members written
        written = presence.writes
        assert not presence.dirty
        for _ in range(10):  # ten beats of an idle process
            clock[0] += 1.0
            await presence.turn(renew=True, reading=False)
        assert presence.writes == written  # not one write per room per beat
        assert not [ch for ch in hub.reconciler.active if ch.startswith("test:room:")]  # nor a look per beat
        clock[0] += PRESENCE_KEEP_MS / 3000  # a third of a part's life: each written again, once
        await presence.turn(renew=True, reading=False)
        assert presence.writes == written + ROOMS
        await presence.turn(renew=True, reading=False)
        assert presence.writes == written + ROOMS
        await c.call("unsubscribe", {"channel": "test:room:idle-0"})  # a change is written at once
        await presence.turn(renew=False, reading=False)
        assert presence.writes == written + ROOMS + 1
        await presence.turn(renew=False, reading=False)
        assert "test:room:idle-0" not in presence.rooms  # an empty room forgotten


async def test_a_lost_mark_writes_every_part_again(hub):
    presence = hub.presence
    async with Client() as c:
        for n in range(3):
            await c.call("subscribe", {"channel": f"test:room:mark-{n}"})
        await presence.turn(renew=True, reading=False)
        written = presence.writes

        async def lost(ttl_ms: int) -> tuple[int, bool]:
            return PRESENCE_KEEP_MS, False  # as after a Redis that lost its keys

        hub.backplane.presence_alive = lost
        await presence.turn(renew=True, reading=False)
        assert presence.writes == written + 3


async def test_a_large_process_reuses_its_probe_walks_until_they_have_paid_for_themselves(hub, monkeypatch):
    monkeypatch.setattr(probe_module, "PROBE_CPU_SHARE", 1e-9)  # a walk pays for itself only after a long while
    async with Client() as c:
        for n in range(10):
            await c.call("subscribe", {"channel": f"test:room:probe-{n}"})
        first = hub.probe()  # a small process: walked
        assert first["subscriptions"] == 10
        monkeypatch.setattr(probe_module, "FRESH_UP_TO", 5)  # now a large one
        await c.call("subscribe", {"channel": "test:room:probe-new"})
        again = hub.probe()
        assert again["channel_count"] == first["channel_count"] + 1  # the counters are exact
        assert again["subscriptions"] == first["subscriptions"]  # the walks were reused
        monkeypatch.setattr(probe_module, "FRESH_UP_TO", 1000)
        assert hub.probe()["subscriptions"] == 11  # small again: walked each time
