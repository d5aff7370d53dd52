"""App-fed state: the application sets a value, each cadence delivers the latest.

``publish("lot:42", value)`` keeps the value on the backplane (a history of one, under
:func:`~realtime_app.declarations.registry.fed_channel`) and carries it to the processes that
pace a cadence of ``lot:42`` — the holders of those cadences' leases, one per cadence in
the cluster, as for tickers. Each cadence publishes the latest value at most once a period
and only when it differs from that cadence's last frame; nothing polls. The rule is
:class:`Pace` (pure); :class:`FedStates` keeps one per cadence run here and its timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from realtime_app.cluster.roles import HistoryStore
from realtime_app.declarations.registry import FED_PREFIX, ChannelSpec, fed_channel
from realtime_app.hub.reconciler import Reconciler
from realtime_app.wire.protocol import encode

__all__ = ["MISSING", "FedStates", "Pace", "fed_value"]

logger = logging.getLogger("realtime_app.hub")

#: How long a published frame of a cadence counts as on its way back to this process.
IN_FLIGHT_S = 1.0

#: What :meth:`Pace.due` returns when nothing is to be sent.
MISSING: Any = object()
#: A timer may fire this early (the loop's clock resolution): still on time.
EARLY_S = 0.001


@dataclass(slots=True)
class Pace:
    """One cadence of an app-fed family: the newest value known (by ``version``, the
    backplane's number of the value) and what the cadence last sent, and when."""

    period: float
    version: int = 0
    epoch: str = ""  # the kept value's history epoch: a new one (Redis lost its state) restarts versions
    text: str | None = None  # the newest value, encoded (what "changed" compares)
    value: Any = MISSING
    sent: str | None = None  # the encoded value of the last frame
    last_at: float = float("-inf")

    def offer(self, version: int, text: str, value: Any, now: float, epoch: str = "") -> float | None:
        """A value numbered ``version`` (of ``epoch``): when to send it (``now``, or when the
        period since the last frame ends), or None — an older value than one known, or no
        change. Versions count again from 1 in a new epoch (the backplane lost the value)."""
        if epoch < self.epoch or (epoch == self.epoch and version <= self.version):
            return None  # epochs order as strings (wire.history.new_epoch): an older one is stale
        self.version, self.epoch, self.text, self.value = version, epoch, text, value
        if text == self.sent:
            return None
        return max(now, self.last_at + self.period)

    def undelivered(self) -> float | None:
        """The last value handed out was not published (the backplane did not answer, the
        lease was not fresh): it is due again when the period ends, or None (nothing)."""
        self.sent = None
        return self.last_at + self.period if self.text is not None else None

    def due(self, now: float) -> Any:
        """The value to send now (and it counts as sent), or :data:`MISSING`."""
        if self.text is None or self.text == self.sent or now + EARLY_S < self.last_at + self.period:
            return MISSING
        self.sent, self.last_at = self.text, now
        return self.value


def fed_value(text: str) -> tuple[Any, str, str]:
    """The data of a value's ``message`` notification, its canonical encoding, its epoch."""
    params = json.loads(text)["params"]
    return params["data"], encode(params["data"]), str(params.get("epoch", ""))


class Joiner(Protocol):
    """What app-fed pacing needs of the hub: its backplane and the channels it joins."""

    loop: asyncio.AbstractEventLoop | None

    @property
    def backplane(self) -> HistoryStore | None: ...

    reconciler: Reconciler

    async def converge(self, channel: str) -> None: ...

    def spawn(self, coro: Any) -> None: ...


class FedStates:
    """The cadences of app-fed families paced by this process (it holds their leases)."""

    def __init__(self, hub: Joiner) -> None:
        self.hub = hub
        self.paces: dict[str, dict[str, tuple[Pace, Callable[[Any], None]]]] = {}  # base -> channel -> pace
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.updates = 0  # values received from the backplane

    async def start(self, spec: ChannelSpec, publish: Callable[[Any], None]) -> Callable[[], None]:
        """Pace ``spec`` (a cadence): join its family's values, read the current one."""
        assert spec.interval_ms is not None and spec.fed is not None
        base, channel = spec.base, spec.name
        first = base not in self.paces
        self.paces.setdefault(base, {})[channel] = (Pace(spec.interval_ms / 1000), publish)
        stopped = False

        def stop() -> None:
            nonlocal stopped
            if not stopped:
                stopped = True
                self.stop(base, channel)

        try:
            if first:
                self.hub.reconciler.subscribed(fed_channel(base), ticker=False)
                await self.hub.converge(fed_channel(base))  # each join reads the value again (resync)
            if not first:
                await self.resync(base)
        except BaseException:
            stop()
            raise
        return stop

    async def resync(self, base: str) -> None:
        """Read the value kept for ``base`` and offer it to its cadences: after each join
        (a first one, or again after the backplane lost this process's subscriptions),
        what was set meanwhile is not lost — pub/sub keeps nothing for the absent."""
        if not self.paces.get(base):
            return
        current = await self.current(base)
        if current is not None:
            self.update(base, *current)

    def undelivered(self, base: str, channel: str) -> None:
        """The cadence's last frame was not published: send the newest value again at the
        end of its period."""
        entry = self.paces.get(base, {}).get(channel)
        if entry is None:
            return
        at = entry[0].undelivered()
        if at is not None and channel not in self.timers:
            loop = asyncio.get_running_loop()
            self.timers[channel] = loop.call_at(max(at, loop.time()), self._fire, base, channel)

    async def current(self, base: str) -> tuple[int, str] | None:
        """The value kept for ``base`` (``(version, notification text)``), or None."""
        backplane = self.hub.backplane
        assert backplane is not None
        entries = await backplane.history_page(fed_channel(base), 0, 1)
        return (entries[-1].seq, entries[-1].text) if entries else None

    def frame_coming(self, base: str, channel: str) -> bool:
        """Whether this process paces ``channel`` and a frame of it is due (a timer) or was
        just published (on its way back through the backplane): a new subscriber gets that
        one, not a copy before it. A cadence idle since its last frame has none coming."""
        entry = self.paces.get(base, {}).get(channel)
        if entry is None:
            return False
        pace = entry[0]
        just_sent = asyncio.get_running_loop().time() - pace.last_at < IN_FLIGHT_S
        return channel in self.timers or pace.sent is None or just_sent

    def stop(self, base: str, channel: str) -> None:
        timer = self.timers.pop(channel, None)
        if timer is not None:
            timer.cancel()
        channels = self.paces.get(base)
        if channels is None or channels.pop(channel, None) is None or channels:
            return
        del self.paces[base]
        self.hub.reconciler.unsubscribed(fed_channel(base))
        self.hub.spawn(self.hub.converge(fed_channel(base)))

    def delivered(self, channel: str, text: str, seq: int) -> None:
        """A value set by the application arrived (a frame of a fed channel)."""
        self.updates += 1
        self.update(channel[len(FED_PREFIX) :], seq, text)

    def update(self, base: str, version: int, text: str) -> None:
        channels = self.paces.get(base)
        if not channels:
            return
        try:
            value, encoded, epoch = fed_value(text)
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring a malformed value of an app-fed channel")
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        for channel, (pace, _) in channels.items():
            at = pace.offer(version, encoded, value, now, epoch)
            if at is not None and channel not in self.timers:
                self.timers[channel] = loop.call_at(at, self._fire, base, channel)

    def _fire(self, base: str, channel: str) -> None:
        self.timers.pop(channel, None)
        entry = self.paces.get(base, {}).get(channel)
        if entry is None:
            return
        pace, publish = entry
        loop = asyncio.get_running_loop()
        value = pace.due(loop.time())
        if value is MISSING:
            if pace.text is not None and pace.text != pace.sent:  # woke early: the period ends later
                self.timers[channel] = loop.call_at(pace.last_at + pace.period, self._fire, base, channel)
            return
        if value is not MISSING:
            with contextlib.suppress(Exception):  # the publisher reports its own failures
                publish(value)
