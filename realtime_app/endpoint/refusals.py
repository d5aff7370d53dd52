"""Refusals: handshakes accepted only to be closed with a code and a reason — the client
sees why (1013: come back later; 1011: this server cannot serve it), not a bare HTTP 403
or 500 — and their log lines, once per outage rather than once per socket; and the
JSON-RPC answer of a refused request (its reason, ``retry_after_ms``, a snapshot)."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from realtime_app.conf.runtime import runtime
from realtime_app.endpoint.tickets import give_back, redeem, shown_ticket
from realtime_app.hub.core import Connection, Hub
from realtime_app.inbound.admission import Refusal
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.base import UnsupportedServer
from realtime_app.outbound.guard import Guard
from realtime_app.wire import protocol
from realtime_app.wire.asgi import Scope, Send
from realtime_app.wire.protocol import CloseCode, RequestId, Response

__all__ = [
    "log_bad_http_request",
    "log_error_counts",
    "NO_SNAPSHOT",
    "deny",
    "refusal_response",
    "refused_socket",
    "token_refusal",
    "log_auth_outage",
    "log_refused_connection",
    "log_unsupported_once",
    "refuse",
]

#: The HTTP answer of a refused handshake, by close code, where the server can give one
#: (the ASGI ``websocket.http.response`` extension: uvicorn): status and Retry-After (s).
#: Only for what passes: a browser sees any HTTP refusal as 1006 and comes back, so a
#: 1008 ("do not come back") is still accepted and closed with its code.
HTTP_ANSWERS = {CloseCode.TRY_AGAIN_LATER: (503, 2)}

logger = logging.getLogger("realtime_app.consumers")

#: At most one line this often for each kind of refused handshake, with the count since.
LOG_EVERY_S = 60.0


#: A refusal without a snapshot (a method's snapshot may be None itself).
NO_SNAPSHOT: Any = object()
_MESSAGES = {"overloaded": "Overloaded", "too_many_in_flight": "Too many in flight"}


def refusal_response(request_id: RequestId, refusal: Refusal, snapshot: Any = NO_SNAPSHOT) -> Response:
    """The error answering a refused request: its code, reason and ``retry_after_ms``,
    and the method's snapshot (what the client may show meanwhile) when it has one."""
    data = refusal.data()
    if snapshot is not NO_SNAPSHOT:
        data["snapshot"] = snapshot
    reason = data.pop("reason")
    return protocol.error_response(
        request_id, refusal.code, _MESSAGES.get(refusal.reason, "Rate limited"), reason, **data
    )


async def refuse(send: Send, code: CloseCode, reason: str) -> None:
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
    send: Send,
    scope: Scope,
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
    if runtime().first_time("unsupported server"):
        logger.error("refusing WebSocket connections: %s", exc)


class LogCounts(dict[str, list[float]]):
    """What is counted -> [when last logged, how many since] (a part of the runtime)."""


def _count_then_log(key: str) -> int:
    """Count one more ``key``; the count since the last line when one is due (at most one a
    minute per key: a flood is counted, not logged socket by socket), else 0."""
    now = time.monotonic()
    seen = runtime().part(LogCounts).setdefault(key, [float("-inf"), 0])
    seen[1] += 1
    if now - seen[0] < LOG_EVERY_S:
        return 0
    count = int(seen[1])
    seen[0], seen[1] = now, 0
    return count


async def refused_socket(hub: Hub, conn: Connection, identity: tuple[str, str]) -> bool:
    """The door of one socket: its identity's handshake rate, then its connection caps.
    True when refused, the socket closed with why: 1008 past its own cap (do not come
    back), 1013 past the process's ceiling or the handshake rate (later). A handshake
    showing a drain's reconnect ticket skips the process's anonymous bucket only."""
    if hub.gate.draining:  # stopping: to another process, after a moment
        conn.closed = True
        await deny(conn.send, conn.scope, CloseCode.SERVICE_RESTART, "retry_after_ms=1000", conn.guard)
        return True
    taken: list[str] = []  # the nonce of the ticket this handshake took, if it took one

    def ticket() -> bool:
        if (nonce := redeem(shown_ticket(conn.scope), identity[1])) is not None:
            taken.append(nonce)
        return bool(taken)

    if not hub.gate.handshake(identity, ticket=ticket):
        conn.closed = True
        await deny(conn.send, conn.scope, CloseCode.TRY_AGAIN_LATER, "too many handshakes", conn.guard)
        return True
    refused = hub.add_connection(conn, identity)
    if refused is None:
        return False
    for nonce in taken:  # not let in: its ticket is good again here
        give_back(nonce)
    log_refused_connection(refused, identity[0])
    conn.closed = True
    code = CloseCode.TRY_AGAIN_LATER if refused == "server full" else CloseCode.POLICY_VIOLATION
    await deny(conn.send, conn.scope, code, refused, conn.guard)
    return True


async def token_refusal(scope: Scope, address: tuple[str, str]) -> tuple[CloseCode, str] | None:
    """The door of a handshake that carries a token, good or bad: it draws on its
    address's handshake bucket (and the process's anonymous one) as an anonymous
    handshake does — 300 bad tokens from one address in half a second passed every bound
    before. ``(close code, reason)`` when refused: 1013 past the bucket, the token's own
    code (4002, 4004) for a bad one (counted in the probe's ``refused.tokens``)."""
    from realtime_app.endpoint.tokens import TOKEN, TOKEN_REFUSED
    from realtime_app.exceptions import BackplaneUnavailable
    from realtime_app.hub.hubs import get_hub

    refused = scope.get(TOKEN_REFUSED)
    if refused is None and TOKEN not in scope:
        return None
    try:
        hub = await get_hub()
    except BackplaneUnavailable:  # logged by the hub, once per outage: the client retries later
        return CloseCode.TRY_AGAIN_LATER, "backplane unavailable"
    if not hub.gate.handshake(address, anonymous=refused is not None):  # a good token's user is known
        return CloseCode.TRY_AGAIN_LATER, "too many handshakes"
    if refused is not None:
        hub.gate.refused["tokens"] = hub.gate.refused.get("tokens", 0) + 1
        return CloseCode(refused.close_code), str(refused)
    return None


def log_refused_connection(reason: str, kind: str) -> None:
    """``server full``, ``too many connections``: one INFO line a minute per reason."""
    if count := _count_then_log(reason):
        logger.info("%d connection(s) refused: %s (the last of one %s; counted in the probe)", count, reason, kind)


def log_error_counts(session: Any, connection: Any) -> None:
    """A closed connection's bad requests past the first of each reason, summed up once."""
    if session is not None and (repeated := session.error_summary()):
        counts = ", ".join(f"{safe(reason)}: {n}" for reason, n in sorted(repeated.items()))
        total, cid = sum(session.errors.values()), connection.id if connection else "-"
        logger.info("connection %s closed after %d bad requests (%s)", cid, total, counts)


def log_auth_outage(why: str) -> None:
    """One WARNING a minute of a database outage, with the handshakes refused since."""
    if count := _count_then_log("database unavailable"):
        logger.warning("%d signed-in handshake(s) closed with 1013: the database does not answer (%s)", count, why)


def log_bad_http_request(reason: str, detail: str = "") -> None:
    """A bad JSON-RPC request over HTTP: one INFO line a minute per reason, with the count
    since (each HTTP request is a connection of its own)."""
    if count := _count_then_log(f"bad http rpc: {reason}"):
        suffix = f" (the last: {safe(detail, 200)})" if detail else ""
        logger.info("%d bad JSON-RPC request(s) over HTTP: %s%s", count, safe(reason), suffix)
