"""A state channel's current value for its new subscribers, at once.

A new subscriber of a state channel should not wait a period (or, for an app-fed channel
that rarely changes, forever) for its first frame: it is given the newest frame this
process has seen, else — for an app-fed channel — the value the backplane keeps.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Protocol

from realtime_app.channels.registry import ChannelSpec
from realtime_app.cluster.base import Backplane
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import Fanout
from realtime_app.hub.fed import FedStates
from realtime_app.outbound.backpressure import SEND
from realtime_app.wire.protocol import encode, notification_text

__all__ = ["CurrentValues"]


class Holder(Protocol):
    """What current values need of the hub: the values kept, the floor, the sends."""

    backplane: Backplane | None
    fed: FedStates
    fanout: Fanout
    last_seq: dict[str, int]

    def spawn(self, coro: Any) -> None: ...

    async def control(self, message: dict[str, Any]) -> None: ...


class CurrentValues:
    """The newest frame of each state channel with local subscribers."""

    def __init__(self, hub: Holder) -> None:
        self.hub = hub
        self.frames: dict[str, tuple[str, int]] = {}  # channel -> (notification, seq)

    def seen(self, channel: str, text: str, seq: int) -> None:
        self.frames[channel] = (text, seq)

    def forget(self, channel: str) -> None:
        self.frames.pop(channel, None)

    async def _ask_resend(self, channel: str) -> None:
        """Ask the process running ``channel``'s ticker to publish its last value again:
        every subscriber gets it as a frame, this new one within milliseconds."""
        with contextlib.suppress(BackplaneUnavailable):  # the next tick brings it
            await self.hub.control({"kind": "resend", "channel": channel})

    async def send(self, conn: Connection, spec: ChannelSpec) -> bool:
        """Give ``conn``, a new subscriber of ``spec``, its current value; True if sent."""
        if spec.kind != "state" or conn.closed or spec.name not in conn.subscriptions:
            return False
        hub, channel = self.hub, spec.name
        text, seq = self.frames.get(channel, (None, 0))
        backplane = hub.backplane
        if text is None and spec.fed is not None and backplane is not None:
            try:
                current = await hub.fed.current(spec.base)
            except backplane.errors:
                return False  # the next frame brings it
            if current is None or channel in self.frames:  # a live frame came meanwhile: newer
                return False
            data = json.loads(current[1])["params"]["data"]
            text = notification_text(channel, encode(data), hub.last_seq.get(channel, 0), int(time.time() * 1000))
        if text is None and spec.factory is not None:  # a ticker running elsewhere: ask for its last value
            hub.spawn(self._ask_resend(channel))
            return False
        if text is None or conn.closed or channel not in conn.subscriptions:
            return False
        decision = hub.fanout.push(conn, text.encode("utf-8"), channel=channel)  # full, to a delta subscriber
        if decision is SEND and channel in conn.deltas and seq and hub.fanout.deltas.prime(channel, text, seq):
            conn.deltas[channel] = seq  # it holds the base of the next delta
        return decision is SEND
