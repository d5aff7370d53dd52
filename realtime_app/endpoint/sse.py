"""``GET /realtime/sse?channel=…``: the socket's channels over Server-Sent Events.

A stream is a connection like a socket's: the same identity, connection ceilings and
per-identity shares, handshake bucket and admission (each channel costs a ``subscribe``),
the same rules, the same guard on the bytes really queued, the same re-validation, logout
and drain. Everything that refuses it answers before the stream starts, as HTTP with the
JSON-RPC error object: 400 (bad parameters), 401 (a token refused), 403 (a channel it may
not subscribe), 404 (an unknown channel), 429 (its own limits), 503 (the server's).

Then, in order: ``retry:``; per channel a ``realtime.subscribed`` event (the subscribe
answer: canonical name, kind, cadence, position) or ``realtime.error``; the publications
(:mod:`realtime_app.outbound.sse` says their form, their ``id`` and the resync and close
events); a comment every ``HEARTBEAT_SECONDS`` (20 s when 0). ``Last-Event-ID`` (or the
``last_event_id`` query parameter: a page's ``EventSource`` cannot set headers) resumes
channels with history. A change of cadence is a new stream with the new name, opened
before the old one is closed (the clients do that). docs/sse.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import urllib.parse
from typing import Any

from realtime_app.conf.runtime import runtime, settings
from realtime_app.declarations.registry import ChannelSpec, registry
from realtime_app.endpoint.auth import AUTH_UNAVAILABLE
from realtime_app.endpoint.builtins import channel_param, require
from realtime_app.endpoint.consumer import RealtimeConsumer
from realtime_app.endpoint.doors import Answer, encode_answer
from realtime_app.endpoint.methods import BUILTIN_COSTS
from realtime_app.endpoint.refusals import log_auth_outage, log_error_counts, log_refused_connection, refusal_response
from realtime_app.endpoint.subscribing import require_existing
from realtime_app.endpoint.tokens import UNREAD_BEARER, arm_expiry, cancel_expiry, unread_bearer
from realtime_app.exceptions import BackplaneUnavailable, RPCError
from realtime_app.hub.core import Connection, Hub
from realtime_app.hub.hubs import get_hub
from realtime_app.inbound.admission import Refusal
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.base import UnsupportedServer
from realtime_app.outbound.sse import MAX_LAST_EVENT_ID, EventStream, parse_positions, sink_for
from realtime_app.wire import protocol
from realtime_app.wire.asgi import Receive, Scope, Send
from realtime_app.wire.protocol import CloseCode, Request

__all__ = ["EventStreamConsumer", "OpenStreams", "auth_refusal", "heartbeat_loop", "http_error"]

logger = logging.getLogger("realtime_app.consumers")

#: Query parameters read at most (channels are bounded by ``MAX_SUBSCRIPTIONS`` after).
MAX_FIELDS = 1000
#: The ``retry:`` a stream starts with: how long a browser waits before it reconnects.
RETRY_MS = 1000
#: Heartbeat interval when ``HEARTBEAT_SECONDS`` is 0 (under most proxies' 60 s idle timeout).
DEFAULT_HEARTBEAT_S = 20.0
#: The HTTP status of a refusal, by JSON-RPC error code.
STATUS = {
    protocol.FORBIDDEN_CHANNEL: 403,
    protocol.UNKNOWN_CHANNEL: 404,
    protocol.RATE_LIMITED: 429,
    protocol.TOO_MANY_IN_FLIGHT: 429,
    protocol.TOO_MANY_SUBSCRIPTIONS: 400,
    protocol.OVERLOADED: 503,
}
#: The HTTP status of a handshake refusal, by the close code a socket would get.
CLOSE_STATUS = {
    CloseCode.TRY_AGAIN_LATER: 503,
    CloseCode.SERVICE_RESTART: 503,
    CloseCode.POLICY_VIOLATION: 429,
    CloseCode.TOKEN_REFUSED: 401,
    CloseCode.TOKEN_EXPIRED: 401,
    CloseCode.INTERNAL_ERROR: 500,
}
HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-store"),
    (b"x-accel-buffering", b"no"),  # nginx: do not buffer the stream (docs/sse.md)
    (b"connection", b"close"),  # a stream's connection is its own: its end (or cut) touches no other request
]


class OpenStreams:
    """The streams this process serves (a part of its runtime): the heartbeat's round."""

    def __init__(self) -> None:
        self.streams: set[EventStream] = set()


def http_error(status: int, error: dict[str, Any], retry_after_ms: int | None = None) -> Answer:
    """A refusal as HTTP: ``{"jsonrpc": "2.0", "error": …, "id": null}``."""
    extra = []
    if retry_after_ms:
        extra.append((b"retry-after", str(max(1, -(-retry_after_ms // 1000))).encode()))
    return status, {"jsonrpc": "2.0", "error": error, "id": None}, extra


async def auth_refusal(consumer: RealtimeConsumer) -> Answer | None:
    """The socket's auth doors for an HTTP request (a stream, an RPC), as HTTP: the
    database unreadable (503), a token refused or past its handshake bucket, a Bearer this
    app's auth stack did not read (401)."""
    from realtime_app.endpoint.refusals import token_refusal

    scope = consumer.scope
    if scope.get(AUTH_UNAVAILABLE):
        log_auth_outage(scope[AUTH_UNAVAILABLE])
        return _closed_as(CloseCode.TRY_AGAIN_LATER, "database unavailable")
    if (refused := await token_refusal(scope, consumer.address_identity())) is not None:
        return _closed_as(*refused)
    if unread_bearer(scope):
        return _closed_as(CloseCode.TOKEN_REFUSED, UNREAD_BEARER)
    return None


def _error(code: int, message: str, reason: str, **data: Any) -> dict[str, Any]:
    return dict(protocol.error_response(None, code, message, reason, **data)["error"])


def _closed_as(code: int, reason: str) -> Answer:
    """What a socket would be closed with, as an HTTP refusal."""
    status = CLOSE_STATUS.get(CloseCode(code), 403) if code in CloseCode.__members__.values() else 403
    retry = 1000 if status == 503 else None
    error = _error(protocol.OVERLOADED, reason, reason.replace(" ", "_"), close_code=int(code))
    return http_error(status, error, retry)


class EventStreamConsumer(RealtimeConsumer):
    """ASGI application of ``GET /realtime/sse`` (routed by :class:`~realtime_app.routing.MetricsShortcut`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"EventStreamConsumer serves http scopes, got {scope['type']!r}")
        self.scope = scope
        if scope.get("method") != "GET":
            error = _error(protocol.INVALID_REQUEST, "GET an event stream", "method_not_allowed")
            return await _answer(send, (405, http_error(405, error)[1], [(b"allow", b"GET")]))
        try:
            query = urllib.parse.parse_qs(scope.get("query_string", b"").decode("latin-1"), max_num_fields=MAX_FIELDS)
        except ValueError:
            error = _error(protocol.INVALID_PARAMS, "Invalid params: too many query parameters", "too_many_fields")
            return await _answer(send, http_error(400, error))
        names = query.get("channel", [])
        headers = dict(scope.get("headers", ()))
        last_id = headers.get(b"last-event-id", b"").decode("latin-1") or (query.get("last_event_id") or [""])[0]
        refusal = await self._refusal(names, last_id)
        if refusal is not None:
            return await _answer(send, refusal)
        try:
            hub = await get_hub()
        except BackplaneUnavailable:
            return await _answer(send, _closed_as(CloseCode.TRY_AGAIN_LATER, "backplane unavailable"))
        await self._serve(hub, names, parse_positions(last_id), receive, send)

    async def _refusal(self, names: list[str], last_id: str) -> Answer | None:
        """Refusals that need no hub: parameters, then the socket's own auth doors."""
        limit = settings().max_subscriptions or 100
        if not names:
            error = _error(protocol.INVALID_PARAMS, "Invalid params: ?channel= is required", "missing_channel")
            return http_error(400, error)
        if len(names) > limit:
            error = _error(protocol.TOO_MANY_SUBSCRIPTIONS, "Too many subscriptions", "too_many_subscriptions")
            return http_error(400, {**error, "data": {**error["data"], "limit": limit}})
        if len(last_id) > MAX_LAST_EVENT_ID:
            return http_error(400, _error(protocol.INVALID_PARAMS, "Last-Event-ID too long", "invalid_since"))
        scope = self.scope
        if (refused := await auth_refusal(self)) is not None:
            return refused
        if not _origin_allowed(scope):  # another site's page riding on the visitor's session
            error = _error(protocol.FORBIDDEN_CHANNEL, "Origin not allowed", "origin_not_allowed")
            return http_error(403, error)
        if not await self.accept_connection():
            return http_error(403, _error(protocol.FORBIDDEN_CHANNEL, "Forbidden", "refused"))
        return None

    async def _door(self, hub: Hub, conn: Connection) -> Answer | None:
        """The socket's door: draining, the handshake bucket, the connection caps."""
        identity = self.admission_identity()
        if hub.gate.draining:
            return _closed_as(CloseCode.SERVICE_RESTART, "draining")
        if not hub.gate.handshake(identity):
            return _closed_as(CloseCode.TRY_AGAIN_LATER, "too many handshakes")
        refused = hub.add_connection(conn, identity)
        if refused is None:
            return None
        log_refused_connection(refused, identity[0])
        code = CloseCode.TRY_AGAIN_LATER if refused == "server full" else CloseCode.POLICY_VIOLATION
        return _closed_as(code, refused)

    async def _checked(self, hub: Hub, names: list[str]) -> tuple[list[ChannelSpec], Answer | None]:
        """The stream admitted and each channel allowed, before the stream starts: the specs,
        or the refusal. A stream costs a subscribe per channel, charged at once (at most a
        full bucket: any stream ``MAX_SUBSCRIPTIONS`` allows can open), all or nothing — a
        stream refused halfway would have spent tokens on channels its retry pays again —
        and holds one in-flight slot of its identity's while it is checked."""
        from django.db import DatabaseError

        from realtime_app.wire.session import ServerSession

        config = settings()
        self.session = ServerSession(config.max_frame_bytes, config.max_batch)
        cost = min(BUILTIN_COSTS["subscribe"] * len(names), float(config.admission_bucket_capacity) or float("inf"))
        params = {"channels": names[:3]}
        ticket = await hub.gate.admit_request(self.admission_identity(), "subscribe", None, cost, params)
        if isinstance(ticket, Refusal):
            error = refusal_response(None, ticket)["error"]
            return [], http_error(STATUS.get(ticket.code, 429), dict(error), ticket.retry_after_ms)
        admitted: list[ChannelSpec] = []
        try:
            for name in names:
                spec = registry.resolve(channel_param({"channel": name}))
                await require(self, spec, "subscribe")
                await require_existing(spec)
                admitted.append(spec)
        except RPCError as exc:
            refused: dict[str, Any] = dict(exc.as_error())
            refused["data"] = {**refused.get("data", {}), "requested": name[:200]}  # the name the client asked
            return [], http_error(STATUS.get(exc.code, 400), refused)
        except (DatabaseError, BackplaneUnavailable) as exc:  # an outage: later, not a 500
            logger.warning("an event stream refused for now: %s", safe(exc, 200))
            return [], _closed_as(CloseCode.TRY_AGAIN_LATER, "database unavailable")
        finally:
            hub.gate.done(ticket)
        return admitted, None

    async def _serve(self, hub: Hub, names: list[str], positions: Any, receive: Receive, send: Send) -> None:
        try:
            sink = sink_for(send, require_measurable=settings().max_backpressure > 0)
        except ConnectionError:
            return  # the client went away before its stream began: nothing to answer
        except UnsupportedServer as exc:
            if runtime().first_time("unsupported stream server"):
                logger.error("refusing event streams: %s", exc)
            return await _answer(send, _closed_as(CloseCode.INTERNAL_ERROR, "unsupported server"))
        ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        stream = EventStream(sink, positions, settings().close_drain_ms / 1000, ended)
        conn = Connection(send, self.scope, transport=stream)
        conn.address = self.address()
        self.connection = conn
        streams = runtime().part(OpenStreams).streams
        try:
            refusal = await self._door(hub, conn)
            admitted: list[ChannelSpec] = []
            if refusal is None:
                admitted, refusal = await self._checked(hub, names)
            if refusal is None and stream.final is not None:  # closed while it was checked (a drain, a logout)
                refusal = _closed_as(*stream.final)
            if refusal is not None:
                conn.closed = True
                return await _answer(send, refusal)
            for name, spec in zip(names, admitted, strict=True):  # a position given under the name asked
                if name in stream.positions and spec.name not in stream.positions:
                    stream.positions[spec.name] = stream.positions[name]
            stream.keep_only({spec.name for spec in admitted})
            await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
            stream.open(RETRY_MS)
            streams.add(stream)
            arm_expiry(hub, conn, self.scope)  # a token's stream is told before its token expires
            try:
                await self._subscribe(hub, stream, admitted)
            except Exception:  # a bug: the stream ends with 1011, said, never left open
                logger.exception("event stream %s failed", conn.id)
                stream.close(CloseCode.INTERNAL_ERROR, "internal error", stream.drain_s)
            await _wait(receive, stream)
        finally:
            streams.discard(stream)
            cancel_expiry(self.scope)
            hub.pool.abandon(self)
            await hub.remove_connection(conn)
            log_error_counts(self.session, conn)
        if stream.final is not None:  # closed by the server: its final event, then the end
            await _end(send, stream)
        else:  # the client went (or its connection did): the response ends all the same
            with contextlib.suppress(Exception):
                await asyncio.wait_for(send({"type": "http.response.body", "body": b"", "more_body": False}), 1)

    async def _subscribe(self, hub: Hub, stream: EventStream, admitted: list[ChannelSpec]) -> None:
        """Subscribe (or resume) each admitted channel as the socket's ``subscribe`` does;
        each answer is a ``realtime.subscribed`` or ``realtime.error`` event."""
        for index, spec in enumerate(admitted):
            params: dict[str, Any] = {"channel": spec.name}
            at = stream.positions.get(spec.name)
            if at is not None and spec.history is not None:
                params["since"] = {"epoch": at[0], "seq": at[1]}
            stream.settling(spec.name)
            response = await self._run(Request("subscribe", params, index))
            if stream.closed:
                return
            if "error" in response:
                stream.settled(spec.name, {})  # not subscribed: what it held is nobody's
                stream.send_event("realtime.error", {"channel": spec.name, "error": response["error"]})
                continue
            answer = response["result"]
            held = stream.settled(spec.name, answer)
            stream.send_event("realtime.subscribed", answer)
            assert self.connection is not None
            for payload in held:  # through the guard, as every frame
                hub.fanout.push(self.connection, payload, channel=spec.name)
        assert self.session is not None
        for spec in self.session.answered() or ():
            assert self.connection is not None
            await hub.send_current(self.connection, spec)

    async def dispatch(self, method: str, params: Any) -> Any:
        if method != "subscribe":  # nothing else is asked over a stream
            raise RPCError(protocol.METHOD_NOT_FOUND, "Method not found", "unknown_method", method=method[:100])
        return await super().dispatch(method, params)


def _origin_allowed(scope: Scope) -> bool:
    """A stream signed in by the session cookie and opened by a page of another origin is
    refused as a socket's handshake is: the origin's host must be one of ``ALLOWED_HOSTS``
    (Channels' own ``AllowedHostsOriginValidator`` decides, with its rules for wildcards,
    ports and ``DEBUG``). No origin said (not a browser's cross-origin request), a Bearer
    or an anonymous stream pass: they carry no ambient right."""
    from channels.security.websocket import AllowedHostsOriginValidator

    from realtime_app.endpoint.tokens import TOKEN, USER_FROM_OUTSIDE

    user = scope.get("user")
    if not getattr(user, "is_authenticated", False) or TOKEN in scope or scope.get(USER_FROM_OUTSIDE):
        return True
    origin = dict(scope.get("headers", ())).get(b"origin", b"").decode("latin-1")
    if not origin:
        return True
    return bool(AllowedHostsOriginValidator(None).valid_origin(urllib.parse.urlparse(origin.lower())))


async def _answer(send: Send, answer: Answer) -> None:
    status, headers, body = encode_answer(answer)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _wait(receive: Receive, stream: EventStream) -> None:
    """Until the client goes away or the server closes the stream."""
    assert stream.ended is not None
    while True:
        message = asyncio.ensure_future(receive())
        try:
            await asyncio.wait((message, stream.ended), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not message.done():
                message.cancel()
        if not message.done() or message.cancelled():
            return
        if message.result().get("type") == "http.disconnect":
            stream.closed = True
            return


async def _end(send: Send, stream: EventStream) -> None:
    """End the response after the final event; a client that does not read what is still
    queued within ``CLOSE_DRAIN_MS`` is cut off."""
    try:
        drained = getattr(stream.sink, "drained", None)  # a sink that queues: its events first
        if drained is not None:
            await asyncio.wait_for(drained(), max(stream.drain_s, 0.1))
        end = send({"type": "http.response.body", "body": b"", "more_body": False})
        await asyncio.wait_for(end, max(stream.drain_s, 0.1))
    except Exception:  # too slow, or the connection went meanwhile (uvicorn raises RuntimeError then)
        with contextlib.suppress(Exception):
            stream.sink.abort()
        return
    if stream.buffered():
        loop = asyncio.get_running_loop()
        loop.call_later(max(stream.drain_s, 0.1), _abort_unread, stream)


def _abort_unread(stream: EventStream) -> None:
    if stream.buffered():
        stream.sink.abort()


async def heartbeat_loop(hub: Any) -> None:
    """Every ``HEARTBEAT_SECONDS`` (20 s when 0) a comment on each stream whose queue is
    under the guard's threshold: proxies see bytes, and a dead client is found by the write."""
    streams = runtime().part(OpenStreams).streams
    while True:
        config = settings()
        await asyncio.sleep(config.heartbeat_seconds or DEFAULT_HEARTBEAT_S)
        limit = config.max_backpressure
        for stream in list(streams):
            if not stream.closed and (not limit or stream.buffered() <= limit):
                stream.comment()
