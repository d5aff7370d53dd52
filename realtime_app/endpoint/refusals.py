"""Handshakes accepted only to be closed with a code and a reason — the client sees why
(1013: come back later; 1011: this server cannot serve it), not a bare HTTP 403 or 500 —
and their log lines, once per outage rather than once per socket."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from realtime_app.outbound.base import UnsupportedServer
from realtime_app.outbound.guard import Guard
from realtime_app.wire.protocol import CloseCode

__all__ = ["deny", "log_auth_outage", "log_refused_connection", "log_unsupported_once", "refuse"]

#: The HTTP answer of a refused handshake, by close code, where the server can give one
#: (the ASGI ``websocket.http.response`` extension: uvicorn): status and Retry-After (s).
#: Only for what passes: a browser sees any HTTP refusal as 1006 and comes back, so a
#: 1008 ("do not come back") is still accepted and closed with its code.
HTTP_ANSWERS = {CloseCode.TRY_AGAIN_LATER: (503, 2)}

logger = logging.getLogger("realtime_app.consumers")

#: At most one line this often for each kind of refused handshake, with the count since.
LOG_EVERY_S = 60.0

_unsupported_logged = False


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


async def deny(
    send: Callable[[dict[str, Any]], Awaitable[None]],
    scope: dict[str, Any],
    code: CloseCode,
    reason: str,
    guard: Guard | None = None,
) -> None:
    """Refuse a handshake before it is accepted: an HTTP 503 with ``Retry-After`` where the
    server allows one and the refusal passes (1013: no socket, no frame, nothing held),
    else accepted and closed with ``code`` (``guard``: the connection's own)."""
    if "websocket.http.response" in (scope.get("extensions") or {}) and code in HTTP_ANSWERS:
        status, retry_after = HTTP_ANSWERS[code]
        body = json.dumps({"error": reason, "close_code": int(code), "retry_after_s": retry_after}).encode()
        headers = [(b"content-type", b"application/json")]
        if retry_after:
            headers.append((b"retry-after", str(retry_after).encode()))
        await send({"type": "websocket.http.response.start", "status": status, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
        return
    if guard is None:
        return await refuse(send, code, reason)
    await send({"type": "websocket.accept"})
    guard.close(int(code), reason)


def log_unsupported_once(exc: UnsupportedServer) -> None:
    global _unsupported_logged
    if not _unsupported_logged:
        _unsupported_logged = True
        logger.error("refusing WebSocket connections: %s", exc)


_counts: dict[str, list[float]] = {}  # what is counted -> [when last logged, how many since]


def _count_then_log(key: str) -> int:
    """Count one more ``key``; the count since the last line when one is due (at most one a
    minute per key: a flood is counted, not logged socket by socket), else 0."""
    now = time.monotonic()
    seen = _counts.setdefault(key, [float("-inf"), 0])
    seen[1] += 1
    if now - seen[0] < LOG_EVERY_S:
        return 0
    count = int(seen[1])
    seen[0], seen[1] = now, 0
    return count


def log_refused_connection(reason: str, kind: str) -> None:
    """``server full``, ``too many connections``: one INFO line a minute per reason."""
    if count := _count_then_log(reason):
        logger.info("%d connection(s) refused: %s (the last of one %s; counted in the probe)", count, reason, kind)


def log_auth_outage(why: str) -> None:
    """One WARNING a minute of a database outage, with the handshakes refused since."""
    if count := _count_then_log("database unavailable"):
        logger.warning("%d signed-in handshake(s) closed with 1013: the database does not answer (%s)", count, why)
