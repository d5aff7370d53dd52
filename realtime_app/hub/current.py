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

from realtime_app.cluster.roles import Reachable
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.exceptions import BackplaneUnavailable
from realtime_app.hub.connections import Connection
from realtime_app.hub.fanout import Fanout
from realtime_app.hub.fed import FedStates
from realtime_app.hub.tickers import Tickers
from realtime_app.outbound.backpressure import SEND
from realtime_app.wire.protocol import encode, notification_text

__all__ = ["ASK_S", "CurrentValues"]

#: A process asks for a ticker's last frame, and a ticker's process answers, at most this
#: often a channel: a client that toggles a subscription costs a control message a second.
ASK_S = 1.0
#: Channels remembered as asked or answered (the books are emptied past it).
MAX_ASKING = 10_000


class Holder(Protocol):
    """What current values need of the hub: the values kept, the floor, the sends."""

    @property
    def backplane(self) -> Reachable | None: ...

    instance_id: str
    fed: FedStates
    tickers: Tickers
    subscribers: dict[str, set[Connection]]
    fanout: Fanout
    last_seq: dict[str, int]

    def spawn(self, coro: Any) -> None: ...

    async def control(self, message: dict[str, Any]) -> None: ...


class CurrentValues:
    """The newest frame of each state channel with local subscribers."""

    def __init__(self, hub: Holder) -> None:
        self.hub = hub
        self.frames: dict[str, tuple[str, int]] = {}  # channel -> (notification, seq)
        self.asked: dict[str, float] = {}  # channel -> when this process asked for its last frame
        self.answered: dict[str, float] = {}  # channel -> when this process last answered for it

    def seen(self, channel: str, text: str, seq: int) -> None:
        self.frames[channel] = (text, seq)

    def forget(self, channel: str) -> None:
        self.frames.pop(channel, None)

    def _ask(self, channel: str) -> None:
        """Ask the process running ``channel``'s ticker for its last frame (a control
        message ``resend``): once per :data:`ASK_S` a channel, never of this process's own
        ticker (it publishes here by itself)."""
        hub, now = self.hub, time.monotonic()
        if channel in hub.tickers.book.tickers or now - self.asked.get(channel, float("-inf")) < ASK_S:
            return
        if len(self.asked) >= MAX_ASKING:
            self.asked.clear()
        self.asked[channel] = now
        hub.spawn(self._control({"kind": "resend", "channel": channel, "instance": hub.instance_id}))

    async def _control(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(BackplaneUnavailable):  # the next tick brings it
            await self.hub.control(message)

    def on_control(self, kind: str, message: dict[str, Any]) -> None:
        """``resend``: if the ticker runs here, answer the asking process alone with its
        last frame (``current``; once per :data:`ASK_S` a channel). ``current``: the
        answer; this process's subscribers of the channel, which have no frame of it yet,
        get it — the same publication, its own ``seq``: nothing is published again."""
        hub, channel = self.hub, message.get("channel")
        if not isinstance(channel, str):
            return
        if kind == "resend":
            found = self.frames.get(channel)
            now = time.monotonic()
            if found is None or channel not in hub.tickers.book.tickers:
                return
            if now - self.answered.get(channel, float("-inf")) < ASK_S:
                return
            if len(self.answered) >= MAX_ASKING:
                self.answered.clear()
            self.answered[channel] = now
            text, seq = found
            answer = {"kind": "current", "channel": channel, "instance": message.get("instance"), "text": text}
            hub.spawn(self._control({**answer, "seq": seq}))
            return
        frame, number = message.get("text"), message.get("seq")
        if message.get("instance") != hub.instance_id or not isinstance(frame, str) or not isinstance(number, int):
            return
        self.asked.pop(channel, None)
        if channel in self.frames or channel not in hub.subscribers:
            return  # a live frame came meanwhile (newer), or nobody here wants it any more
        self.frames[channel] = (frame, number)
        payload = frame.encode("utf-8")
        for conn in tuple(hub.subscribers[channel]):
            hub.fanout.push(conn, payload, channel=channel)

    async def send(self, conn: Connection, spec: ChannelSpec) -> bool:
        """Give ``conn``, a new subscriber of ``spec``, its current value; True if sent."""
        if spec.kind != "state" or conn.closed or spec.name not in conn.subscriptions:
            return False
        hub, channel = self.hub, spec.name
        text, seq = self.frames.get(channel, (None, 0))
        backplane = hub.backplane
        if text is None and spec.fed is not None and hub.fed.frame_coming(spec.base, channel):
            return False  # this process paces the cadence and its frame is due or on its way: that is the value
        if text is None and spec.fed is not None and backplane is not None:
            try:
                current = await hub.fed.current(spec.base)
            except backplane.errors:
                return False  # the next frame brings it
            if current is None or channel in self.frames:  # a live frame came meanwhile: newer
                return False
            data = json.loads(current[1])["params"]["data"]
            text = notification_text(channel, encode(data), hub.last_seq.get(channel, 0), int(time.time() * 1000))
        if text is None and spec.factory is not None:  # a ticker running elsewhere: ask for its last frame
            self._ask(channel)
            return False
        if text is None or conn.closed or channel not in conn.subscriptions:
            return False
        decision = hub.fanout.push(conn, text.encode("utf-8"), channel=channel)  # full, to a delta subscriber
        if decision is SEND and channel in conn.deltas and seq and hub.fanout.deltas.prime(channel, text, seq):
            conn.deltas[channel] = seq  # it holds the base of the next delta
        return decision is SEND
