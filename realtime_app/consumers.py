"""The WebSocket endpoint: a thin ASGI adapter between the socket and the hub.

It parses frames with :mod:`realtime_app.protocol`, checks channel access with
:mod:`realtime_app.policies`, and subscribes through the :class:`~realtime_app.hub.Hub`.
It has no channel-layer channel of its own: frames reach it from the process's hub,
so a connection costs nothing on the backplane.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from . import protocol
from .conf import get_config
from .exceptions import RPCError
from .hub import Connection, get_hub
from .policies import allowed
from .protocol import CloseCode, Request, Response
from .registry import registry
from .transports import UnsupportedServer

__all__ = ["RealtimeConsumer", "rpc_method"]

logger = logging.getLogger("realtime_app.consumers")

Handler = Callable[["RealtimeConsumer", Any], Awaitable[Any] | Any]
_methods: dict[str, Handler] = {}


def rpc_method(name: str) -> Callable[[Handler], Handler]:
    """Register an application JSON-RPC method: ``handler(consumer, params) -> result``.

    Raise :class:`~realtime_app.exceptions.RPCError` to answer an error; any other
    exception answers -32603 and is logged.
    """
    if name in ("subscribe", "unsubscribe", "ping", "publish") or name.startswith("rpc."):
        raise ValueError(f"method name {name!r} is reserved")

    def register(handler: Handler) -> Handler:
        _methods[name] = handler
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
            _log_unsupported_once(exc)
            await send({"type": "websocket.close", "code": int(CloseCode.INTERNAL_ERROR)})
            return
        await send({"type": "websocket.accept"})
        self.connection = conn
        hub.add_connection(conn)
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
        for error in frame.errors:
            logger.info(
                "connection %s: bad request (%s)",
                self.connection.id if self.connection else "-",
                error.get("error", {}).get("data", {}).get("reason"),
            )
        for request in frame.requests:
            response = await self.handle_request(request)
            if response is not None and not request.is_notification:
                responses.append(response)
        if not responses:
            return
        await self.send_json(responses if frame.is_batch else responses[0])

    async def handle_request(self, request: Request) -> Response | None:
        """Run one request and build its response (None for notifications)."""
        try:
            result = await self.dispatch(request.method, request.params)
        except RPCError as exc:
            logger.info("connection %s: %s %s", self.connection.id if self.connection else "-", request.method, exc)
            return {"jsonrpc": "2.0", "error": exc.as_error(), "id": request.id}  # type: ignore[typeddict-item]
        except Exception:
            logger.exception("method %s failed", request.method)
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
        handler = _methods.get(method)
        if handler is None:
            raise RPCError(protocol.METHOD_NOT_FOUND, "Method not found", "unknown_method", method=method[:100])
        result = handler(self, params)
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
        from .exceptions import ForbiddenChannel

        name = self._channel_param(params)
        spec = registry.resolve(name)
        family = registry.family_of(spec.name)
        if not await allowed(self.user, spec.name, family.base if family else None, "subscribe"):
            raise ForbiddenChannel(spec.name, "subscribe")
        assert self.connection is not None
        limit = get_config()["MAX_SUBSCRIPTIONS"]
        if limit and spec.name not in self.connection.subscriptions and len(self.connection.subscriptions) >= limit:
            raise RPCError(
                protocol.TOO_MANY_SUBSCRIPTIONS, "Too many subscriptions", "too_many_subscriptions", limit=limit
            )
        hub = await get_hub()
        await hub.subscribe(self.connection, spec)
        return {"channel": spec.name, "kind": spec.kind, "interval_ms": spec.interval_ms}

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
        from .exceptions import ForbiddenChannel
        from .publishing import apublish

        name = self._channel_param(params)
        if not isinstance(params, dict) or "data" not in params:
            raise _invalid('Invalid params: expected {"channel": name, "data": ...}', "missing_data")
        spec = registry.resolve(name)
        if spec.kind != "event" or not await allowed(self.user, spec.name, None, "publish"):
            raise ForbiddenChannel(spec.name, "publish")
        seq = await apublish(spec.name, params["data"])
        return {"channel": spec.name, "seq": seq}
