"""Presence: who is in each presence channel, kept on the backplane under this process's
lease, and the diffs its subscribers get — one per channel per ``PRESENCE_INTERVAL_MS`` at
most, whatever the join/leave traffic (docs/presence.md).

Every subscriber of a channel declared ``presence=True`` is in it; those that subscribed
with ``"presence": true`` also watch it. One loop per process does the rest, a few times
per interval:

* **write**: each room whose local members changed gets this process's part written
  (coalesced: one write per room per turn, however many joins), and each part is written
  again from the local book a third of its life after it was (STYLE practice 21). Where
  the backplane can mark a process alive (memory, Redis, shards) that life is long — an
  idle room costs nothing per beat — and one mark per beat (a lease) is what a process
  that dies takes its members with; a mark found gone (a Redis that lost its keys) has
  every part written again at once. Elsewhere (Redis Cluster) a part lives a lease and
  is written every beat;
* **read**, once per interval, each watched room whose version changed: the merged
  snapshot, its diff against what the watchers hold (:func:`~realtime_app.wire.presence.diff`),
  one frame to each watcher. A watcher over its backpressure threshold keeps one held
  frame: the next diff is merged into it (:func:`~realtime_app.wire.presence.compose`),
  never queued behind it.

The rules are pure (:mod:`realtime_app.wire.presence`); this room owns the books, the
loop and the counters.
"""

from __future__ import annotations

import asyncio
import heapq
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

from realtime_app.cluster.roles import PresenceStore
from realtime_app.conf import beat_period_s
from realtime_app.conf.runtime import runtime, settings
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import Fanout
from realtime_app.observability.schema import PresenceProbe
from realtime_app.outbound.backpressure import HOLD
from realtime_app.wire.presence import Diff, LocalRoom, Snapshot, compose, diff, merge, to_params
from realtime_app.wire.protocol import encode

__all__ = ["HELD_KEY", "Presence", "Room", "member_of"]

logger = logging.getLogger("realtime_app.presence")

#: The held-frame key of a channel's presence diffs (never a channel name: "\0" is not allowed in one).
HELD_KEY = "\0presence:"
#: Writes per interval at most: a change reaches the backplane within a quarter of it.
WRITES_PER_INTERVAL = 4


class Hosting(Protocol):
    """What the presence room uses of its hub."""

    @property
    def backplane(self) -> PresenceStore | None: ...

    fanout: Fanout


@dataclass(eq=False, slots=True)
class Room:
    """One presence channel (a family's cadences share their base's room) in this process."""

    local: LocalRoom = field(default_factory=LocalRoom)
    names: set[str] = field(default_factory=set)  # the subscribed channel names of this room
    watchers: dict[Connection, set[str]] = field(default_factory=dict)  # -> the names it watches by
    sent: Snapshot | None = None  # what the watchers hold (None: no watcher, nothing read)
    listed: bool = True
    version: str = ""  # of the snapshot read last ("": read again)
    dirty: bool = False  # local members changed since this process's part was written
    renew_at: float = 0.0  # when its part is written again (monotonic s)
    pending: dict[tuple[Connection, str], Diff] = field(default_factory=dict)  # merged, held for slow watchers
    cached: tuple[float, Snapshot] | None = None  # a read for RPC presence without watchers, and when


class Presence:
    """The presence books of one process."""

    def __init__(self, hub: Hosting) -> None:
        self.hub = hub
        self.rooms: dict[str, Room] = {}
        self.names: dict[str, str] = {}  # a subscribed channel -> its room
        self.changes = 0  # local joins and leaves (first and last connection of a room here)
        self.diffs = 0  # presence frames handed to watchers
        self.coalesced = 0  # diffs merged into a held one (a slow watcher)
        self.writes = 0
        self.reads = 0
        self.failures = 0
        self.dirty: set[str] = set()  # rooms whose part is written at the next turn
        self.watching: set[str] = set()  # rooms with watchers: read every interval
        self._renewals: deque[tuple[float, str]] = deque()  # (when, room): written again then, in order
        self._maybe_idle: set[str] = set()  # rooms that lost a member or a watcher: forgotten once idle
        self._keep_ms: int | None = None  # a part's life between writes (None: a lease, renewed every beat)
        self._marked = False  # marked alive once at least: parts are written the way the mark says
        self._writing = asyncio.Lock()  # one write at a time: an older part never lands last
        self._entered = asyncio.Event()  # a room was opened: the loop, asleep while none is, runs

    # -- the books (synchronous, at once) ------------------------------------------------

    def enter(self, conn: Connection, spec: ChannelSpec) -> None:
        """``conn`` subscribed to ``spec`` (a presence channel): in its room."""
        self.names[spec.name] = spec.base
        room = self.rooms.get(spec.base)
        if room is None:
            room = self.rooms[spec.base] = Room()
            self._entered.set()
        room.names.add(spec.name)
        user, info = conn.member if conn.member is not None else (None, None)
        if room.local.enter(conn.id, user, info):
            room.dirty = True
            self.dirty.add(spec.base)
            self.changes += 1

    def exit(self, conn: Connection, channel: str) -> None:
        """``conn`` left ``channel`` (unsubscribed, closed): out of its room when it was
        its last channel there."""
        base = self.names.get(channel)
        room = self.rooms.get(base) if base is not None else None
        if room is None or base is None:
            return
        if channel in room.watchers.get(conn, ()):
            self._unwatch(room, conn, channel)
        if room.local.exit(conn.id):
            room.dirty = True
            self.dirty.add(base)
            self._maybe_idle.add(base)
            self.changes += 1

    def _unwatch(self, room: Room, conn: Connection, name: str) -> None:
        names = room.watchers[conn]
        names.discard(name)
        if not names:
            del room.watchers[conn]
        room.pending.pop((conn, name), None)
        if conn.guard.held:
            conn.guard.held.frames.pop(HELD_KEY + name, None)
        if not room.watchers:
            room.sent, room.version, room.listed = None, "", True
            base = self.names.get(name)
            if base is not None:
                self.watching.discard(base)
                self._maybe_idle.add(base)

    def watched(self, conn: Connection) -> list[str]:
        """The channels whose presence ``conn`` watches (its rights are checked again):
        found through its own subscriptions, never a walk over every room."""
        found = []
        for name in conn.subscriptions:
            base = self.names.get(name)
            room = self.rooms.get(base) if base is not None else None
            if room is not None and name in room.watchers.get(conn, ()):
                found.append(name)
        return found

    async def watch(self, conn: Connection, spec: ChannelSpec) -> None:
        """``conn`` watches ``spec``'s presence: a ``reset`` frame with every member now —
        before its subscribe's answer — then the diffs of every interval. With the
        backplane down, the members this process knows: the next turns bring the rest."""
        room = self.rooms.get(spec.base)
        if room is None or spec.name in room.watchers.get(conn, ()):
            return
        snapshot = room.sent
        if snapshot is None:
            try:
                snapshot = await self.read(spec)
            except BackplaneUnavailable:
                snapshot = merge([room.local.part(0)])
        if conn.closed or spec.name not in conn.subscriptions or self.rooms.get(spec.base) is not room:
            return
        if room.sent is None:  # else another watcher's turn read it meanwhile: what they hold
            room.sent, room.listed, room.version = snapshot, self._listed(snapshot), ""
        first = diff(None, room.sent, True, self._list_up_to())
        if first is not None:
            self._send(room, conn, spec.name, first)
        room.watchers.setdefault(conn, set()).add(spec.name)
        self.watching.add(spec.base)

    async def read(self, spec: ChannelSpec) -> Snapshot:
        """The cluster's members of ``spec`` now: what the watchers here hold when this
        process has any (at most an interval old), else a read of the backplane (kept an
        interval for the next pages)."""
        room = self.rooms.get(spec.base)
        if room is not None and room.sent is not None:
            return room.sent
        now = time.monotonic()
        if room is not None and room.cached is not None and now - room.cached[0] < self._interval():
            return room.cached[1]
        backplane = self.hub.backplane
        assert backplane is not None
        try:
            if room is not None and room.dirty:  # its own members first
                await self._write(backplane, {spec.base: room})
            found = (await backplane.read_presence({spec.base: ""})).get(spec.base)
        except backplane.errors as exc:
            backplane.outage.failed(exc)
            raise BackplaneUnavailable("presence", exc) from exc
        self.reads += 1
        snapshot = merge(found[1]) if found is not None else Snapshot()
        if room is not None:
            room.cached = (now, snapshot)
        return snapshot

    # -- the loop ----------------------------------------------------------------------

    async def run(self) -> None:
        """Write changed parts a few times per interval, renew them every beat, read and
        send once per interval (the hub runs it while it runs; nothing ends it but that).
        While no room is open here it sleeps until one is."""
        config = settings()
        interval = self._interval()
        beat = beat_period_s(config.lease_ttl_ms)
        next_read = next_beat = time.monotonic()
        failing: set[type[BaseException]] = set()
        while True:
            if not self.rooms:  # no one present here: nothing to write or read until someone is
                self._entered.clear()
                await self._entered.wait()
            await asyncio.sleep(interval / WRITES_PER_INTERVAL)
            now = time.monotonic()
            renew = now >= next_beat
            if renew:
                next_beat = now + beat
            reading = now >= next_read
            if reading:
                next_read = now + interval
            try:
                await self.turn(renew=renew, reading=reading)
            except Exception as exc:  # a bug: logged once per kind, the next turn tries again
                if type(exc) not in failing:
                    failing.add(type(exc))
                    logger.exception("presence turn failed")

    async def turn(self, *, renew: bool = False, reading: bool = True) -> None:
        """One turn of the loop: write what changed (every part when ``renew``), then,
        when ``reading``, read the watched rooms and send their diffs. A write that fails
        leaves its rooms dirty (written next turn); the reads go on for what answers."""
        backplane = self.hub.backplane
        if backplane is None:
            return
        if renew:
            try:
                await self._mark_alive(backplane)
            except backplane.errors as exc:
                backplane.outage.failed(exc)
                self.failures += 1
        bases = self.dirty | self._due(time.monotonic())
        rooms = {base: self.rooms[base] for base in bases if base in self.rooms}
        self.dirty.difference_update(bases - rooms.keys())  # rooms forgotten meanwhile
        steps = [(self._write(backplane, rooms), bool(rooms)), (self._read(backplane), reading)]
        for step, due in steps:
            if not due:
                step.close()  # never started
                continue
            try:
                called = await step
            except backplane.errors as exc:
                backplane.outage.failed(exc)
                self.failures += 1
                continue
            if called and backplane.outage.succeeded():  # back after an outage: every part again
                self._all_dirty()
        for base in list(self._maybe_idle):
            room = self.rooms.get(base)
            if room is not None and (room.local or room.watchers):
                self._maybe_idle.discard(base)  # in use again
            elif room is None or self._idle(room):
                self._maybe_idle.discard(base)
                self._forget(base)

    def _forget(self, base: str) -> None:
        room = self.rooms.pop(base, None)
        if room is None:
            return
        self.watching.discard(base)
        for name in room.names:
            if self.names.get(name) == base:
                del self.names[name]

    def _all_dirty(self) -> None:
        """Every part written again (its mark or the backplane was lost): rare, so a walk."""
        for base, room in self.rooms.items():
            if room.local:
                room.dirty = True
                self.dirty.add(base)

    async def _mark_alive(self, backplane: PresenceStore) -> None:
        """This process's mark, once a beat: how long its parts live, and every part again
        when its mark was gone (its parts may have gone with it)."""
        mark = await backplane.presence_alive(int(settings().lease_ttl_ms))
        self._keep_ms, self._marked = (mark[0] if mark is not None else None), True
        if mark is not None and not mark[1]:
            self._all_dirty()

    def _due(self, now: float) -> set[str]:
        """The rooms whose part is to be written again now (in the order they were written)."""
        due: set[str] = set()
        renewals = self._renewals
        while renewals and renewals[0][0] <= now:
            at, base = renewals.popleft()
            room = self.rooms.get(base)
            if room is not None and room.renew_at == at and room.local:
                due.add(base)
        return due

    async def leave_all(self) -> None:
        """A clean stop: this process's parts withdrawn now, not a lease later."""
        backplane = self.hub.backplane
        if backplane is None or not self.rooms:
            return
        ttl = self._keep_ms or int(settings().lease_ttl_ms)
        await backplane.put_presence({base: None for base in self.rooms}, ttl, self._keep_ms is not None)

    async def _write(self, backplane: PresenceStore, rooms: dict[str, Room]) -> bool:
        if not self._marked:  # a first write (a watch, RPC presence) before any beat: one way from the start
            await self._mark_alive(backplane)
        config = settings()
        limit = config.presence_max_members
        ttl = self._keep_ms or int(config.lease_ttl_ms)
        async with self._writing:
            parts = {base: room.local.part(limit) if room.local else None for base, room in rooms.items()}
            for room in rooms.values():
                room.dirty = False  # changed while the write is on its way: dirty again, written next turn
            self.dirty.difference_update(rooms)
            try:
                await backplane.put_presence(parts, ttl, self._keep_ms is not None)
            except BaseException:
                for room in rooms.values():
                    room.dirty = True
                self.dirty.update(rooms)
                raise
        now = time.monotonic()
        for base, room in rooms.items():
            if room.local and room.renew_at <= now:  # one renewal due per room (a changed room keeps its turn)
                room.renew_at = now + ttl / 3000  # a third of its life: two more chances before it lapses
                self._renewals.append((room.renew_at, base))
        self.writes += len(parts)
        return True

    async def _read(self, backplane: PresenceStore) -> bool:
        watched = {base: self.rooms[base].version for base in self.watching if base in self.rooms}
        if not watched:
            return False
        found = await backplane.read_presence(watched)
        self.reads += len(watched)
        up_to = self._list_up_to()
        for base, answer in found.items():
            room = self.rooms.get(base)
            if answer is None or room is None or not room.watchers or room.sent is None:
                continue
            room.version = answer[0]
            snapshot = merge(answer[1])
            change = diff(room.sent, snapshot, room.listed, up_to)
            room.sent, room.listed = snapshot, self._listed(snapshot)
            if change is not None:
                for conn, names in list(room.watchers.items()):
                    for name in list(names):
                        self._send(room, conn, name, change)
        return True

    def _send(self, room: Room, conn: Connection, name: str, change: Diff) -> None:
        """One diff to one watcher, merged into the one still held for it, if any."""
        key = HELD_KEY + name
        held = conn.guard.held
        pending = room.pending.get((conn, name))
        merged = pending is not None and held is not None and key in held.frames
        if merged:
            assert pending is not None
            change = compose(pending, change)
        text = encode({"jsonrpc": "2.0", "method": "presence", "params": to_params(name, change)})
        decision = self.hub.fanout.send_merged(conn, key, text.encode("utf-8"))
        self.diffs += 1
        if decision is HOLD:
            room.pending[(conn, name)] = change
            self.coalesced += int(merged)
        else:
            room.pending.pop((conn, name), None)

    # -- rules and the probe -------------------------------------------------------------

    @staticmethod
    def _idle(room: Room) -> bool:
        return not room.local and not room.watchers and not room.dirty

    @staticmethod
    def _interval() -> float:
        return float(settings().presence_interval_ms) / 1000

    @staticmethod
    def _list_up_to() -> int:
        return int(settings().presence_diff_members)

    def _listed(self, snapshot: Snapshot) -> bool:
        up_to = self._list_up_to()
        return not up_to or len(snapshot.users) <= up_to

    def counters(self) -> dict[str, int]:
        """What the probe reads fresh each time (no walk over the rooms)."""
        return {
            "channels": len(self.rooms),
            "changes": self.changes,
            "diffs": self.diffs,
            "coalesced": self.coalesced,
            "writes": self.writes,
            "reads": self.reads,
            "failures": self.failures,
        }

    def probe(self, top: int) -> PresenceProbe:
        """Presence channels, members and watchers here, what was sent and merged, and the
        members of the busiest rooms as the cluster holds them (watched rooms) or as this
        process does."""
        rooms = self.rooms.items()
        sizes = {base: room.sent.count if room.sent is not None else len(room.local.conns) for base, room in rooms}
        busiest = heapq.nsmallest(top, sizes.items(), key=lambda item: (-item[1], item[0]))
        return {
            **self.counters(),  # type: ignore[typeddict-item]
            "connections": sum(len(room.local.conns) for room in self.rooms.values()),
            "watchers": sum(len(self.rooms[base].watchers) for base in self.watching if base in self.rooms),
            "members": dict(busiest),
        }


def member_of(user: Any) -> tuple[str | None, Any]:
    """A connection's presence identity: its username (None: anonymous) and the public
    info ``PRESENCE_INFO`` gives for it, bounded by ``PRESENCE_INFO_MAX_BYTES`` (over it,
    none: logged once per user). Runs in a thread (the hook may query)."""
    if user is None or not getattr(user, "is_authenticated", False):
        return None, None
    name = user.get_username()
    config = settings()
    hook = config.presence_info
    if not hook:
        return name, None
    from django.utils.module_loading import import_string

    from realtime_app.wire.protocol import encode as encode_json

    try:
        text = encode_json((import_string(hook) if isinstance(hook, str) else hook)(user))
        size = len(text.encode("utf-8"))
        info = json.loads(text)  # plain JSON from here on (a date is its ISO text, as sent)
    except Exception:
        logger.exception("PRESENCE_INFO failed for a user: listed without info")
        return name, None
    if size > config.presence_info_max_bytes:
        if runtime().first_time(name, family="presence info oversized"):
            logger.warning("PRESENCE_INFO gave %d bytes, over PRESENCE_INFO_MAX_BYTES: listed without info", size)
        return name, None
    return name, info
