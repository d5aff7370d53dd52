"""The WebSocket endpoint: a thin ASGI adapter between the socket and the hub.

It parses frames with :mod:`realtime_app.protocol`, checks channel access with
:mod:`realtime_app.policies`, and subscribes through the :class:`~realtime_app.hub.Hub`.
It has no channel-layer channel of its own: frames reach it from the process's hub,
so a connection costs nothing on the backplane.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from . import protocol
from .conf import get_config
from .exceptions import BackplaneUnavailable, ForbiddenChannel, PublicationError, PublicationTooLarge, RPCError
from .hub import Connection, get_hub
from .logsafe import safe
from .policies import allowed
from .protocol import CloseCode, Request, Response
from .rate import nearest_cadence, rate_channel
from .registry import ChannelSpec, registry
from .sessions import current_user, needs_user
from .transports import UnsupportedServer

__all__ = ["RealtimeConsumer", "rpc_method"]

logger = logging.getLogger("realtime_app.consumers")

#: How long a re-read user stays fresh for the next guarded requests of one connection.
FRESH_USER_S = 1.0

Handler = Callable[["RealtimeConsumer", Any], Awaitable[Any] | Any]
Snapshot = Callable[["RealtimeConsumer"], Awaitable[Any] | Any]


@dataclass(frozen=True, slots=True)
class Method:
    """A registered application method and what admission needs to know of it."""

    handler: Handler
    cost: float = 1.0
    snapshot: Snapshot | None = None


_methods: dict[str, Method] = {}

#: Cost of the built-in ``publish`` in tokens of the publisher's bucket.
PUBLISH_COST = 1.0


def rpc_method(name: str, *, cost: float = 1.0, snapshot: Snapshot | None = None) -> Callable[[Handler], Handler]:
    """Register an application JSON-RPC method: ``handler(consumer, params) -> result``.

    Each call is admitted first (docs/admission.md): ``cost`` tokens of the caller's
    bucket (a float: 0.25 for cheap operations); a refusal is answered at once with its
    reason and ``retry_after_ms``, plus ``snapshot(consumer)`` (sync or async) when
    given, so that the client can resync. Raise
    :class:`~realtime_app.exceptions.RPCError` to answer an error; any other exception
    answers -32603 and is logged.
    """
    if name in ("subscribe", "unsubscribe", "ping", "publish") or name.startswith("rpc."):
        raise ValueError(f"method name {name!r} is reserved")
    if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not 0 <= cost < float("inf"):
        raise ValueError(f"method {name!r}: cost must be a number >= 0, got {cost!r}")

    def register(handler: Handler) -> Handler:
        _methods[name] = Method(handler, float(cost), snapshot)
        return handler

    return register


_unsupported_logged = False


def _log_unsupported_once(exc: UnsupportedServer) -> None:
    global _unsupported_logged
    if not _unsupported_logged:
        _unsupported_logged = True
        logger.error("refusing WebSocket connections: %s", exc)


def _invalid(message: str, reason: str, **data: Any) -> RPCError:
    return RPCError(protocol.INVALID_PARAMS, message, reason, **data)


class RealtimeConsumer:
    """ASGI application of the ``/realtime/`` endpoint. Subclass to add hooks.

    Use ``RealtimeConsumer.as_asgi()`` in a ``URLRouter`` behind
    ``AllowedHostsOriginValidator(AuthMiddlewareStack(...))``.
    """

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}
        self.connection: Connection | None = None
        self._fresh: tuple[float, Any] | None = None  # (when, user) of the last re-read

    @classmethod
    def as_asgi(cls, **initkwargs: Any) -> Callable[..., Awaitable[None]]:
        async def app(scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
            await cls(**initkwargs)(scope, receive, send)

        app.consumer_class = cls  # type: ignore[attr-defined]
        return app

    # -- hooks ----------------------------------------------------------------------

    async def accept_connection(self) -> bool:
        """Return False to refuse the handshake (403). Origin and auth come from middleware."""
        return True

    @property
    def user(self) -> Any:
        return self.scope.get("user")

    async def _current_user(self) -> Any:
        """The user as the session and the database say now, read at most once a second
        per connection (a batch of 50 guarded subscribes costs one read, not 50)."""
        now = time.monotonic()
        if self._fresh is None or now - self._fresh[0] >= FRESH_USER_S:
            self._fresh = (now, await current_user(self.scope))
        return self._fresh[1]

    def identity(self) -> tuple[str, str]:
        """Whose connection this is, for ``MAX_CONNECTIONS_PER_USER`` / ``_PER_ADDRESS``:
        the user's primary key, else the client's address (behind a proxy: the proxy's,
        hence 0 = unlimited by default)."""
        user = self.user
        if user is not None and getattr(user, "is_authenticated", False):
            return ("user", str(user.pk))
        client = self.scope.get("client") or ("?", 0)
        return ("address", str(client[0]))

    # -- ASGI -----------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "websocket":
            raise ValueError(f"RealtimeConsumer serves websocket scopes, got {scope['type']!r}")
        self.scope = scope
        self._send = send
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if not await self.accept_connection():
            await send({"type": "websocket.close"})
            return
        hub = await get_hub()
        try:
            conn = Connection(send, scope)
        except UnsupportedServer as exc:
            # Accepted, then closed: the client sees 1011 and the reason, not a bare 403.
            _log_unsupported_once(exc)
            await send({"type": "websocket.accept"})
            await send(
                {"type": "websocket.close", "code": int(CloseCode.INTERNAL_ERROR), "reason": "unsupported server"}
            )
            return
        await send({"type": "websocket.accept"})
        self.connection = conn
        if not hub.add_connection(conn, self.identity()):
            logger.info("connection %s refused: too many connections of %s", conn.id, self.identity()[0])
            conn.closed = True
            conn.guard.close(CloseCode.POLICY_VIOLATION, "too many connections")
            return
        try:
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "websocket.disconnect":
                    break
                if kind == "websocket.receive" and not conn.closed:
                    await self.receive_frame(message.get("text"), message.get("bytes"))
        finally:
            await hub.remove_connection(conn)

    async def close(self, code: int, reason: str) -> None:
        """Close this connection with ``code``; frames that arrive afterwards are ignored."""
        assert self.connection is not None
        if self.connection.closed:
            return
        logger.info("closing connection %s with %s: %s", self.connection.id, code, reason)
        self.connection.guard.close(code, reason)
        hub = await get_hub()
        await hub.remove_connection(self.connection)

    async def send_json(self, message: Any) -> None:
        """Send a JSON-RPC response (or batch) through the connection's guard."""
        assert self.connection is not None
        hub = await get_hub()
        hub.send_to(self.connection, protocol.encode(message), response=True)

    # -- frames ---------------------------------------------------------------------

    async def receive_frame(self, text: str | None, data: bytes | None) -> None:
        config = get_config()
        if text is None:
            await self.close(CloseCode.UNSUPPORTED_DATA, "binary frames are not supported")
            return
        limit = config["MAX_FRAME_BYTES"]
        if limit and len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            await self.close(CloseCode.MESSAGE_TOO_BIG, f"frame over {limit} bytes")
            return
        frame = protocol.parse_frame(text, config["MAX_BATCH"])
        responses: list[Response] = list(frame.errors)
        if frame.errors:  # once per frame, however many bad parts a batch has
            logger.info(
                "connection %s: %d bad request(s) (%s)",
                self.connection.id if self.connection else "-",
                len(frame.errors),
                frame.errors[0].get("error", {}).get("data", {}).get("reason"),
            )
        for request in frame.requests:
            response = await self.handle_request(request)
            if response is not None and not request.is_notification:
                responses.append(response)
        if not responses:
            return
        await self.send_json(responses if frame.is_batch else responses[0])

    def admission_identity(self) -> tuple[str, str]:
        """Whose bucket and cap a request draws on: the user's (shared by all of its
        connections in this process), else this connection's."""
        user = self.user
        if user is not None and getattr(user, "is_authenticated", False):
            return ("user", str(user.pk))
        return ("connection", str(self.connection.id if self.connection else id(self)))

    async def handle_request(self, request: Request) -> Response | None:
        """Admit one request, run it and build its response (None for notifications)."""
        method = _methods.get(request.method)
        cost = method.cost if method is not None else PUBLISH_COST if request.method == "publish" else None
        if cost is None:  # built-ins other than publish, unknown methods: no work to bound
            return await self._run(request)
        hub = await get_hub()
        identity = self.admission_identity()
        refusal = hub.admission.admit(identity, cost)
        if refusal is not None:
            data = refusal.data()
            if method is not None and method.snapshot is not None:
                snapshot = method.snapshot(self)
                data["snapshot"] = await snapshot if inspect.isawaitable(snapshot) else snapshot
            message = {"overloaded": "Overloaded", "too_many_in_flight": "Too many in flight"}.get(
                refusal.reason, "Rate limited"
            )
            reason = data.pop("reason")
            return protocol.error_response(request.id, refusal.code, message, reason, **data)
        try:
            return await self._run(request)
        finally:
            hub.admission.release(identity)

    async def _run(self, request: Request) -> Response:
        try:
            result = await self.dispatch(request.method, request.params)
        except BackplaneUnavailable:  # logged once per outage by the hub
            error = RPCError(protocol.OVERLOADED, "Backplane unavailable", "backplane_unavailable", retry_after_ms=1000)
            return {"jsonrpc": "2.0", "error": error.as_error(), "id": request.id}
        except RPCError as exc:
            logger.info(
                "connection %s: %s %s", self.connection.id if self.connection else "-", safe(request.method), safe(exc)
            )
            return {"jsonrpc": "2.0", "error": exc.as_error(), "id": request.id}
        except Exception:
            logger.exception("method %s failed", safe(request.method))
            return protocol.error_response(request.id, protocol.INTERNAL_ERROR, "Internal error", "internal_error")
        return protocol.result_response(request.id, result)

    async def dispatch(self, method: str, params: Any) -> Any:
        builtin = {
            "subscribe": self.rpc_subscribe,
            "unsubscribe": self.rpc_unsubscribe,
            "ping": self.rpc_ping,
            "publish": self.rpc_publish,
        }.get(method)
        if builtin is not None:
            return await builtin(params)
        registered = _methods.get(method)
        if registered is None:
            raise RPCError(protocol.METHOD_NOT_FOUND, "Method not found", "unknown_method", method=method[:100])
        result = registered.handler(self, params)
        if inspect.isawaitable(result):
            result = await result
        return result

    # -- built-in methods -----------------------------------------------------------

    def _channel_param(self, params: Any) -> str:
        if isinstance(params, dict):
            channel = params.get("channel")
        elif isinstance(params, list) and len(params) >= 1:
            channel = params[0]
        else:
            raise _invalid('Invalid params: expected {"channel": name}', "missing_channel")
        if not isinstance(channel, str) or not channel:
            raise _invalid("Invalid params: 'channel' must be a non-empty string", "invalid_channel")
        limit = get_config()["MAX_CHANNEL_NAME"]
        if len(channel) > limit:
            raise _invalid(
                f"Invalid params: channel name over {limit} characters", "channel_name_too_long", max_length=limit
            )
        return channel

    async def rpc_subscribe(self, params: Any) -> dict[str, Any]:
        name = self._channel_param(params)
        spec = registry.resolve(name)
        await self._require(spec, "subscribe")
        assert self.connection is not None
        config = get_config()
        limit = config["MAX_SUBSCRIPTIONS"]
        if limit and spec.name not in self.connection.subscriptions and len(self.connection.subscriptions) >= limit:
            raise RPCError(
                protocol.TOO_MANY_SUBSCRIPTIONS, "Too many subscriptions", "too_many_subscriptions", limit=limit
            )
        hub = await get_hub()
        if spec.name not in hub.subscribers:
            spec = await self._bounded(hub, spec, config)
        await hub.subscribe(self.connection, spec)
        return {"channel": spec.name, "kind": spec.kind, "interval_ms": spec.interval_ms}

    async def _require(self, spec: ChannelSpec, action: Literal["subscribe", "publish"]) -> None:
        """Refuse unless the user may ``action`` the channel — the user as its session and
        the database say now, for a guarded channel (logout, deactivation, demotion)."""
        family = registry.family_of(spec.name)
        user = await self._current_user() if needs_user(spec.name, action) else self.user
        if not await allowed(user, spec.name, family.base if family else None, action):
            raise ForbiddenChannel(spec.name, action)

    async def _bounded(self, hub: Any, spec: ChannelSpec, config: dict[str, Any]) -> ChannelSpec:
        """Keep what clients can start bounded: past ``MAX_CADENCES_PER_FAMILY`` the nearest
        running cadence instead of a new one; past ``MAX_TICKERS`` a refusal."""
        family = registry.family_of(spec.name)
        cap = config["MAX_CADENCES_PER_FAMILY"]
        if family is not None and spec.interval_ms is not None and cap:
            running = hub.running_cadences(family.base)
            if len(running) >= cap:
                ms = nearest_cadence(spec.interval_ms, running)
                spec = registry.resolve(rate_channel(family.base, ms, family.bounds.default))
                await self._require(spec, "subscribe")
                hub.refused["cadences"] += 1
                return spec
        tickers = config["MAX_TICKERS"]
        if spec.has_ticker and tickers and hub.ticker_count() >= tickers:
            hub.refused["tickers"] += 1
            raise RPCError(
                protocol.OVERLOADED, "Too many tickers", "too_many_tickers", limit=tickers, retry_after_ms=5000
            )
        return spec

    async def rpc_unsubscribe(self, params: Any) -> dict[str, Any]:
        name = self._channel_param(params)
        spec = registry.resolve(name)
        assert self.connection is not None
        hub = await get_hub()
        was = await hub.unsubscribe(self.connection, spec.name)
        return {"channel": spec.name, "unsubscribed": was}

    async def rpc_ping(self, params: Any) -> str:
        return "pong"

    async def rpc_publish(self, params: Any) -> dict[str, Any]:
        from .publishing import apublish

        name = self._channel_param(params)
        if not isinstance(params, dict) or "data" not in params:
            raise _invalid('Invalid params: expected {"channel": name, "data": ...}', "missing_data")
        spec = registry.resolve(name)
        if spec.kind != "event":
            raise ForbiddenChannel(spec.name, "publish")
        await self._require(spec, "publish")
        try:
            seq = await apublish(spec.name, params["data"])
        except PublicationTooLarge as exc:
            raise _invalid(f"Invalid params: {exc}", "publication_too_large", limit=exc.limit) from None
        except PublicationError as exc:
            raise _invalid(f"Invalid params: {exc.problem}", "invalid_data") from None
        return {"channel": spec.name, "seq": seq}
