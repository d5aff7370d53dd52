"""Transport backpressure applied to a connection: read, decide, then write, drop or close.

:class:`Guard` joins a connection's :class:`~realtime_app.outbound.transports.Transport` to the pure
:func:`~realtime_app.outbound.backpressure.decide_send`. The hub guards every frame it sends with
it (ticks, publications, RPC responses); :class:`GuardedSendMixin` gives a custom Channels
consumer the same protection.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

from realtime_app.outbound.backpressure import (
    CLOSE,
    DROP,
    HOLD,
    SEND,
    BackpressureConfig,
    Decision,
    DropState,
    decide_send,
)
from realtime_app.outbound.conflation import Held
from realtime_app.outbound.transports import Transport, transport_for
from realtime_app.wire.asgi import Send
from realtime_app.wire.protocol import CloseCode

__all__ = ["BACKPRESSURE_REASON", "Guard", "GuardedSendMixin", "backpressure_config"]

logger = logging.getLogger("realtime_app.backpressure")

BACKPRESSURE_REASON = "backpressure"


def backpressure_config() -> BackpressureConfig:
    """The guard's settings from ``REALTIME_APP``."""
    from realtime_app.conf.runtime import settings

    config = settings()
    return BackpressureConfig(config.max_backpressure, config.backpressure_policy, config.close_after_drops)


class Guard:
    """One connection's guard. Nominal path: one read of the queued bytes, no allocation."""

    __slots__ = (
        "closed",
        "config",
        "drain_s",
        "held",
        "measure",
        "never_drop_responses",
        "owner",
        "read_under",
        "state",
        "transport",
        "watchlist",
    )

    def __init__(
        self, send: Send, config: BackpressureConfig | None = None, transport: Transport | None = None
    ) -> None:
        from realtime_app.conf.runtime import settings as read_settings

        settings = read_settings()
        self.config = config or backpressure_config()
        measure = self.config.max_backpressure > 0
        self.transport: Transport = transport or transport_for(send, require_measurable=measure)
        self.state = DropState()
        self.drain_s = settings.close_drain_ms / 1000
        self.never_drop_responses = settings.never_drop_responses
        self.closed = False
        self.measure = self.config.max_backpressure > 0  # a disabled guard reads nothing
        #: Under this many bytes queued a transport may answer 0 without a syscall
        #: (:meth:`Transport.queued`): a quarter of the threshold and of the slow-consumer mark.
        self.read_under = min(self.config.max_backpressure, settings.slow_consumer_bytes or 1 << 62) // 4
        self.held: Held | None = None  # conflated frames waiting for the queue to drain
        #: Where this connection (``owner``) is noted once it lags: a frame found bytes still
        #: queued, was refused or held (every frame, when the guard measures nothing). The
        #: probe reads those, never every connection.
        self.watchlist: set[Any] | None = None
        self.owner: Any = None

    def watch(self, watchlist: set[Any], owner: Any) -> None:
        """Note ``owner`` in ``watchlist`` whenever this connection lags (see ``send``)."""
        self.watchlist, self.owner = watchlist, owner

    def buffered(self) -> int:
        return self.transport.buffered()

    def send(
        self, payload: bytes, *, response: bool = False, frame: bytes | None = None, policy: str | None = None
    ) -> Decision:
        """Send one text message (UTF-8 ``payload``) unless the guard refuses it.

        Returns the decision; on CLOSE the connection has been closed with 1013. A JSON-RPC
        response (``response=True``) is never dropped when ``NEVER_DROP_RESPONSES`` is on:
        it is written even above the threshold, but still adds to the drop balance, so a
        client that asks without ever reading is closed all the same. ``frame`` is the
        payload as a WebSocket frame, built once for every subscriber of a publication.
        ``policy``: the channel's own ``"drop"`` or ``"close"`` (``POLICIES``), when not the global.
        """
        if self.closed:
            return DROP
        if self.held:  # conflated frames wait for no newer frame of another channel
            self.flush_held()
        config = self.config if policy is None or policy == self.config.policy else _with_policy(self.config, policy)
        queued = self.transport.queued(self.read_under) if self.measure else 0
        decision = decide_send(queued, config, self.state)
        if decision is SEND or (decision is DROP and response and self.never_drop_responses):
            self.transport.write(payload, frame)
        elif decision is CLOSE:
            self.close(CloseCode.TRY_AGAIN_LATER, BACKPRESSURE_REASON)
        else:
            self.transport.dropped(payload)
        if (queued or decision is not SEND or not self.measure) and self.watchlist is not None:
            self.watchlist.add(self.owner)
        return decision

    def send_conflated(self, channel: str, payload: bytes, frame: bytes | None = None) -> Decision:
        """Send a frame of a conflated channel: written (SEND) while the queue is under the
        threshold and nothing is held, else held as ``channel``'s newest frame (HOLD),
        replacing the one held before. Never dropped, never a reason to close: what is
        held is one frame per channel."""
        if self.closed:
            return DROP
        if not self.held and (not self.measure or self.transport.buffered() <= self.config.max_backpressure):
            self.transport.write(payload, frame)
            if not self.measure and self.watchlist is not None:
                self.watchlist.add(self.owner)
            return SEND
        if self.held is None:
            self.held = Held()
        if self.watchlist is not None:
            self.watchlist.add(self.owner)
        self.held.put(channel, payload, frame)
        self.flush_held()  # behind what was held before it: order across channels kept
        return HOLD

    def flush_held(self) -> int:
        """Write held frames, oldest first, while the queue is under the threshold; returns
        how many were written."""
        held = self.held
        written = 0
        while held and not self.closed and self.transport.buffered() <= self.config.max_backpressure:
            _, payload, frame = held.take()
            self.transport.write(payload, frame)
            written += 1
        return written

    @property
    def conflated(self) -> int:
        return self.held.conflated if self.held is not None else 0

    def close(self, code: int, reason: str) -> None:
        """Close with ``code``; queued frames get ``CLOSE_DRAIN_MS`` to reach the client."""
        if not self.closed:
            self.closed = True
            self.transport.close(code, reason, self.drain_s)


@functools.cache
def _with_policy(config: BackpressureConfig, policy: str) -> BackpressureConfig:
    return dataclasses.replace(config, policy=policy)


class GuardedSendMixin:
    """Mixin for a Channels ``AsyncWebsocketConsumer``: guard its ``send()`` too.

    ``class Feed(GuardedSendMixin, AsyncWebsocketConsumer): ...`` — frames over the
    threshold are dropped or the connection is closed with 1013, per ``REALTIME_APP``.
    """

    _realtime_guard: Guard | None = None

    async def send(self, text_data: str | None = None, bytes_data: bytes | None = None, close: bool = False) -> None:
        if text_data is None or close:
            await super().send(text_data=text_data, bytes_data=bytes_data, close=close)  # type: ignore[misc]
            return
        if self._realtime_guard is None:
            self._realtime_guard = Guard(self.base_send)  # type: ignore[attr-defined]
        if self._realtime_guard.send(text_data.encode("utf-8")) is CLOSE:
            guard = self._realtime_guard
            logger.warning(
                "closed %s with 1013: backpressure (%s bytes queued, %s drops)",
                type(self).__name__,
                guard.buffered(),
                guard.state.drops,
            )
