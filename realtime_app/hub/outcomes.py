"""What the guards decided, counted once for the fan-out and the replies: frames dropped,
connections closed with 1013 for backpressure, sends that raised.

A failing send to one connection closes that connection and nothing else; a connection
over its backpressure threshold has frames dropped, then is closed with 1013
(docs/backpressure.md).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

from realtime_app.hub.connections import Connection
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.backpressure import CLOSE, DROP, Decision
from realtime_app.wire.protocol import CloseCode

__all__ = ["Outcomes"]

logger = logging.getLogger("realtime_app.hub")


class Outcomes:
    """The counters of what guards decided, and what a close decided there does."""

    def __init__(self, forget: Callable[[Connection], None]) -> None:
        self.forget = forget  # closes what a connection held, from synchronous code
        self.drops = 0  # frames refused by a guard, cumulative
        self.closes = 0  # connections closed with 1013 by a guard
        self.send_failures = 0  # connections closed because a send raised

    def send_failed(self, conn: Connection, exc: Exception) -> None:
        """A send raised (the server refused the frame): close that connection, only it."""
        if conn.closed:
            return
        self.send_failures += 1
        logger.warning(
            "connection %s closed with %s: a send failed (%s: %s)",
            conn.id,
            int(CloseCode.INTERNAL_ERROR),
            type(exc).__name__,
            safe(exc, 200),
        )
        with contextlib.suppress(Exception):
            conn.guard.close(CloseCode.INTERNAL_ERROR, "send failed")
        self.forget(conn)

    def account(self, conn: Connection, decision: Decision) -> None:
        if decision is DROP:
            self.drops += 1
        elif decision is CLOSE and not conn.closed:
            self.closes += 1
            logger.warning(
                "connection %s closed with %s: backpressure (%s bytes queued, %s drops)",
                conn.id,
                int(CloseCode.TRY_AGAIN_LATER),
                conn.guard.buffered(),
                conn.guard.state.drops,
            )
            self.forget(conn)
