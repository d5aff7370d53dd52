"""Handshakes accepted only to be closed with a code and a reason — the client sees why
(1013: come back later; 1011: this server cannot serve it), not a bare HTTP 403 or 500 —
and their log lines, once per outage rather than once per socket."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from realtime_app.outbound.base import UnsupportedServer
from realtime_app.outbound.guard import Guard
from realtime_app.wire.protocol import CloseCode

__all__ = ["log_auth_outage", "log_refused_connection", "log_unsupported_once", "refuse"]

logger = logging.getLogger("realtime_app.consumers")

#: At most one WARNING this often while signed-in handshakes are refused for the database.
AUTH_OUTAGE_LOG_S = 60.0

_unsupported_logged = False
_auth_outage = {"since": float("-inf"), "refused": 0}


async def refuse(send: Callable[[dict[str, Any]], Awaitable[None]], code: CloseCode, reason: str) -> None:
    """Accept the handshake, then close it with ``code`` and ``reason`` — through the
    transport (the servers' ASGI close takes neither every code nor a reason), or, on a
    server whose transport is not supported, through ASGI."""
    try:
        guard = Guard(send)
    except UnsupportedServer:
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": int(code), "reason": reason})
        return
    await send({"type": "websocket.accept"})
    guard.close(int(code), reason)


def log_unsupported_once(exc: UnsupportedServer) -> None:
    global _unsupported_logged
    if not _unsupported_logged:
        _unsupported_logged = True
        logger.error("refusing WebSocket connections: %s", exc)


_refused: dict[str, list[float]] = {}  # reason -> [when last logged, refused since]


def log_refused_connection(reason: str, kind: str) -> None:
    """One INFO line a minute per reason (``server full``, ``too many connections``), with
    the count since: a flood of sockets is counted, not logged socket by socket."""
    now = time.monotonic()
    seen = _refused.setdefault(reason, [float("-inf"), 0])
    seen[1] += 1
    if now - seen[0] >= AUTH_OUTAGE_LOG_S:
        logger.info("%d connection(s) refused: %s (the last of one %s; counted in the probe)", seen[1], reason, kind)
        seen[0], seen[1] = now, 0


def log_auth_outage(why: str) -> None:
    """One WARNING per minute of a database outage, with the handshakes refused since."""
    now = time.monotonic()
    _auth_outage["refused"] += 1
    if now - _auth_outage["since"] >= AUTH_OUTAGE_LOG_S:
        count = _auth_outage["refused"]
        logger.warning("%d signed-in handshake(s) closed with 1013: the database does not answer (%s)", count, why)
        _auth_outage.update(since=now, refused=0)
