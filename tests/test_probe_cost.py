"""The probe reads only the connections that lagged (``Fanout.lagging``): whatever the
order of frames written, reads by the clients, drops, closes and probes, it reads no idle
connection, misses no connection with a backlog (two frames or more queued), keeps no
closed one, and lists the open connections with the most drops (also once the top ones
closed)."""

from __future__ import annotations

import asyncio
from collections import deque

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from realtime_app.hub.connections import Connection
from realtime_app.hub.core import Hub
from realtime_app.outbound.backpressure import BackpressureConfig
from realtime_app.outbound.base import Transport
from realtime_app.outbound.guard import Guard

CONNECTIONS = 6
FRAME = 100


class CountedQueue(Transport):
    """A connection's queue (what was written and not yet read), counting its reads."""

    measurable = True

    def __init__(self) -> None:
        self.queue: deque[bytes] = deque()
        self.reads = 0

    def buffered(self) -> int:
        self.reads += 1
        return sum(len(p) for p in self.queue)

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        self.queue.append(payload)
        return True

    def close(self, code: int, reason: str, drain_s: float) -> None:
        self.queue.clear()


class Probing(RuleBasedStateMachine):
    @initialize(threshold=st.integers(FRAME, 5 * FRAME))
    def setup(self, threshold: int) -> None:
        self.hub = Hub()
        self.connections: list[Connection] = []
        self.transports: list[CountedQueue] = []
        for _ in range(CONNECTIONS):
            conn = Connection(asyncio.Queue().put)  # a measurable transport, replaced below
            transport = CountedQueue()
            conn.guard = Guard(conn.send, BackpressureConfig(threshold, "drop", 0), transport)
            self.hub.add_connection(conn)
            self.connections.append(conn)
            self.transports.append(transport)
        self.last: dict[Connection, int] = {}

    def open(self) -> list[Connection]:
        return [c for c in self.connections if not c.closed]

    @rule(i=st.integers(0, CONNECTIONS - 1))
    def close(self, i: int) -> None:
        asyncio.run(self.hub.remove_connection(self.connections[i]))

    def _reads(self) -> int:
        return sum(t.reads for t in self.transports)

    @rule(i=st.integers(0, CONNECTIONS - 1), frames=st.integers(1, 8))
    def send(self, i: int, frames: int) -> None:
        if self.connections[i].closed:
            return
        for _ in range(frames):
            self.connections[i].guard.send(b"x" * FRAME)

    @rule(i=st.integers(0, CONNECTIONS - 1), frames=st.integers(1, 8))
    def client_reads(self, i: int, frames: int) -> None:
        queue = self.transports[i].queue
        for _ in range(min(frames, len(queue))):
            queue.popleft()

    @rule()
    def probe(self) -> None:
        fanout = self.hub.fanout
        watched = len(fanout.watched)
        before = self._reads()
        self.last = fanout.lagging(top=2)
        assert self._reads() - before == watched  # one read per lagging connection, none for the others
        for conn, transport in zip(self.connections, self.transports, strict=True):
            if conn.closed:
                assert conn not in self.last and conn not in fanout.watched and conn not in fanout.droppers
            elif len(transport.queue) >= 2:  # the second frame found the first still queued
                assert self.last[conn] == len(transport.queue) * FRAME
            if conn in self.last:
                assert self.last[conn] == len(transport.queue) * FRAME
        ranked = sorted(self.open(), key=lambda c: (-c.guard.state.drops, c.id))
        wanted = [c for c in ranked if c.guard.state.drops][:2]
        assert fanout.top_droppers == wanted  # also after the top ones closed
        assert set(fanout.watched) == set(self.last)  # the clear ones left the watch list

    @invariant()
    def closed_connections_are_never_watched(self) -> None:
        for conn in self.hub.fanout.watched:
            assert conn in self.hub.connections and not conn.closed


Probing.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_the_probe_reads_only_lagging_connections = Probing.TestCase


def test_a_probe_of_idle_connections_reads_none() -> None:
    """A thousand connections that were written to and read everything: the first probe
    reads those that lagged, the next reads nothing."""
    hub = Hub()
    transports = []
    for _ in range(1000):
        conn = Connection(asyncio.Queue().put)  # a measurable transport, replaced below
        transport = CountedQueue()
        conn.guard = Guard(conn.send, BackpressureConfig(10 * FRAME, "drop", 0), transport)
        hub.add_connection(conn)
        transports.append(transport)
        conn.guard.send(b"x" * FRAME)
        conn.guard.send(b"x" * FRAME)  # found one frame queued: watched
        transport.queue.clear()  # then the client read both
    assert len(hub.fanout.watched) == 1000
    assert hub.fanout.lagging(top=10) == {}
    reads = sum(t.reads for t in transports)
    assert hub.fanout.lagging(top=10) == {}
    assert sum(t.reads for t in transports) == reads
    assert not hub.fanout.watched
