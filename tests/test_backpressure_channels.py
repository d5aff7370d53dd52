"""A channel's own backpressure rule (``POLICIES``' ``"backpressure"``) at the hub, in one
process: it holds on every send path — here the plain one of a channel without history —
and a conflated frame held for a channel the connection has left is never sent.

Found: a channel's rule was tested only on channels with history (passing no rule on the
no-history path kept the suite green), and deleting the hold's removal on unsubscribe
survived every test."""

from __future__ import annotations

import pytest

from tests.support.asgi_client import Client
from tests.support.overfull import Overfull


@pytest.mark.parametrize(("process", "rule", "closed"), [("drop", "close", True), ("close", "drop", False)])
async def test_a_channel_without_history_follows_its_own_rule_not_the_processs(hub, settings, process, rule, closed):
    settings.REALTIME_APP = {
        **settings.REALTIME_APP,
        "BACKPRESSURE_POLICY": process,
        "POLICIES": [{"pattern": "test:state-dropped", "backpressure": rule}],
    }
    async with Client() as slow, Client() as publisher:
        await slow.call("subscribe", {"channel": "test:state-dropped"})
        [conn] = [c for c in hub.connections if "test:state-dropped" in c.subscriptions]
        conn.guard.transport = Overfull(conn.guard.transport)  # its queue over the threshold from now on
        before = (hub.outcomes.drops, hub.outcomes.closes)
        await publisher.call("test.publish_burst", {"channels": ["test:state-dropped"], "count": 1, "size": 10})
        assert conn.closed is closed
        assert (hub.outcomes.drops - before[0], hub.outcomes.closes - before[1]) == ((0, 1) if closed else (1, 0))


async def test_a_held_frame_of_a_channel_the_connection_left_is_never_sent(hub, settings):
    channel = "test:state-conflated"
    settings.REALTIME_APP = {**settings.REALTIME_APP, "POLICIES": [{"pattern": channel, "backpressure": "conflate"}]}
    async with Client() as slow, Client() as publisher:
        await slow.call("subscribe", {"channel": channel})
        [conn] = [c for c in hub.connections if channel in c.subscriptions]
        real = conn.guard.transport
        conn.guard.transport = Overfull(real)
        await publisher.call("test.publish_burst", {"channels": [channel], "count": 1, "size": 10})
        assert channel in conn.guard.held.frames  # held back, to be written once the queue drains
        assert await hub.unsubscribe(conn, channel)
        assert not conn.guard.held
        conn.guard.transport = real  # the client reads again
        assert hub.fanout.drain_held() == 0
        assert await slow.comm.receive_nothing(0.2)
