"""The WebSocket endpoint: a thin ASGI adapter between the socket and the hub.

It parses frames with :mod:`realtime_app.wire.protocol`, checks channel access with
:mod:`realtime_app.channels.policies`, and subscribes through the :class:`~realtime_app.hub.core.Hub`.
It has no channel-layer channel of its own: frames reach it from the process's hub,
so a connection costs nothing on the backplane.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Hashable
from functools import partial
from typing import Any, Literal

from channels.db import database_sync_to_async

from realtime_app.channels.policies import allowed
from realtime_app.channels.registry import ChannelSpec, registry
from realtime_app.conf import get_config
from realtime_app.endpoint.addresses import client_address, client_network, trusted_networks
from realtime_app.endpoint.auth import AUTH_UNAVAILABLE
from realtime_app.endpoint.methods import BUILTIN_COSTS, Method, encodable, method_costs, methods, rpc_method
from realtime_app.endpoint.refusals import deny, log_auth_outage, log_refused_connection, log_unsupported_once, refuse
from realtime_app.endpoint.replies import Pending, Reply
from realtime_app.endpoint.sessions import current_user, needs_user
from realtime_app.endpoint.subscribing import bounded, require_existing
from realtime_app.exceptions import (
    NO_USER_HINT,
    BackplaneUnavailable,
    ForbiddenChannel,
    PublicationError,
    PublicationTooLarge,
    RPCError,
)
from realtime_app.hub.core import Connection, Hub, get_hub
from realtime_app.inbound.admission import Refusal
from realtime_app.inbound.workers import Call, Coalesce
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.transports import UnsupportedServer
from realtime_app.wire import protocol
from realtime_app.wire.deltas import FOSSIL
from realtime_app.wire.history import Since
from realtime_app.wire.protocol import CloseCode, Request, Response

__all__ = ["RealtimeConsumer", "method_costs", "rpc_method"]

logger = logging.getLogger("realtime_app.consumers")

#: How long a re-read user stays fresh for the next guarded requests of one connection.
FRESH_USER_S = 1.0


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
        self._identity: tuple[str, str] | None = None
        self._errors: dict[str, int] = {}  # bad requests of this connection by reason (logged once)
        self._current: list[ChannelSpec] = []  # state channels subscribed by this frame: their value after the answer

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
        """Who this connection is: the user's primary key, else the client's address
        (read through ``TRUSTED_PROXIES`` only, :mod:`realtime_app.endpoint.addresses`). Its
        connection cap, handshake rate, request cap and token bucket all belong to that
        identity, so reconnecting or opening more sockets gives a client nothing more."""
        user = self.user
        if user is not None and getattr(user, "is_authenticated", False):
            return ("user", str(user.pk))
        trusted = trusted_networks(tuple(get_config()["TRUSTED_PROXIES"]))
        config = get_config()
        address = client_address(self.scope, trusted, config["FORWARDED_HEADER"])
        return ("address", client_network(address, config["ADDRESS_PREFIX_V4"], config["ADDRESS_PREFIX_V6"]))

    # -- ASGI -----------------------------------------------------------------------

    async def __call__(self, scope: dict[str, Any], receive: Callable[..., Any], send: Callable[..., Any]) -> None:
        if scope["type"] != "websocket":
            raise ValueError(f"RealtimeConsumer serves websocket scopes, got {scope['type']!r}")
        self.scope = scope
        self._send = send
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if scope.get(AUTH_UNAVAILABLE):  # the session could not be read: come back, rights intact
            log_auth_outage(scope[AUTH_UNAVAILABLE])
            return await deny(send, scope, CloseCode.TRY_AGAIN_LATER, "database unavailable")
        if not await self.accept_connection():
            await send({"type": "websocket.close"})
            return
        try:
            hub = await get_hub()
        except BackplaneUnavailable:  # logged by the hub, once per outage: the client retries later
            return await deny(send, scope, CloseCode.TRY_AGAIN_LATER, "backplane unavailable")
        try:
            conn = Connection(send, scope)
        except UnsupportedServer as exc:
            log_unsupported_once(exc)  # accepted, then closed: the client sees 1011 and why, not a bare 403
            return await refuse(send, CloseCode.INTERNAL_ERROR, "unsupported server")
        config = get_config()
        conn.address = client_address(
            scope, trusted_networks(tuple(config["TRUSTED_PROXIES"])), config["FORWARDED_HEADER"]
        )
        identity = self.admission_identity()
        if not hub.gate.handshake(identity):  # logged by the hub, once while it lasts
            conn.closed = True
            return await deny(send, scope, CloseCode.TRY_AGAIN_LATER, "too many handshakes", conn.guard)
        refused = hub.add_connection(conn, identity)
        if refused is not None:  # its own cap: 1008, do not come back; the process's: 1013, later
            log_refused_connection(refused, identity[0])
            conn.closed = True
            code = CloseCode.TRY_AGAIN_LATER if refused == "server full" else CloseCode.POLICY_VIOLATION
            return await deny(send, scope, code, refused, conn.guard)
        try:
            await send({"type": "websocket.accept"})
            self.connection = conn
            while True:
                message = await receive()
                kind = message["type"]
                if kind == "websocket.disconnect":
                    break
                if kind == "websocket.receive" and not conn.closed:
                    await self.receive_frame(message.get("text"), message.get("bytes"))
        finally:
            hub.pool.abandon(self)
            await hub.remove_connection(conn)
            self._log_error_counts()

    async def close(self, code: int, reason: str) -> None:
        """Close this connection with ``code``; frames that arrive afterwards are ignored."""
        assert self.connection is not None
        if self.connection.closed:
            return
        logger.info("closing connection %s with %s: %s", self.connection.id, code, reason)
        self.connection.guard.close(code, reason)
        hub = await get_hub()
        await hub.remove_connection(self.connection)

    # -- frames ---------------------------------------------------------------------

    def _respond(self, hub: Hub, text: str) -> None:
        """Write one frame of answers, if the connection is still open."""
        conn = self.connection
        if conn is not None and not conn.closed:
            hub.fanout.send_to(conn, text, response=True)

    async def receive_frame(self, text: str | None, data: bytes | None) -> None:
        config = get_config()
        if text is None:
            await self.close(CloseCode.UNSUPPORTED_DATA, "binary frames are not supported")
            return
        limit = config["MAX_FRAME_BYTES"]
        if limit and len(text) * 4 > limit and len(text.encode("utf-8", "surrogatepass")) > limit:
            await self.close(CloseCode.MESSAGE_TOO_BIG, f"frame over {limit} bytes")
            return
        assert self.connection is not None
        hub = await get_hub()
        if hub.fanout.unread_responses(self.connection):
            return  # the client does not read its answers: none of these requests runs
        frame = protocol.parse_frame(text, config["MAX_BATCH"])
        errors: list[Response] = []
        for error in frame.errors:  # bad input costs tokens like any request
            reason = error.get("error", {}).get("data", {}).get("reason", "invalid")
            self.count_error(str(reason))
            answer = await self._charge_error(hub, error.get("id"))
            if self.connection.closed:
                return
            errors.append(error if answer is None else answer)
        reply = Reply(partial(self._respond, hub), frame.is_batch, errors)
        for request in frame.requests:
            outcome = await self.handle_request(request)
            if not request.is_notification:
                reply.add(outcome)
        if self._current:  # after the answer, which tells the client the channel's canonical name
            specs, self._current = self._current, []
            reply.then(lambda: hub.spawn(self._send_current(hub, specs)))
        reply.seal()

    async def _send_current(self, hub: Hub, specs: list[ChannelSpec]) -> None:
        for spec in specs:
            if self.connection is not None:
                await hub.send_current(self.connection, spec)

    def admission_identity(self) -> tuple[str, str]:
        """Whose bucket and cap a request draws on: the user's (shared by all of its
        connections, across the cluster on the Redis backplane), else the client
        address's (shared by its connections in this process): :meth:`identity`."""
        if self._identity is None:
            self._identity = self.identity()
        return self._identity

    async def handle_request(self, request: Request) -> Response | Pending | None:
        """Admit one request, then run it: a built-in inline (its answer is returned), an
        application method in the pool (a future of its answer is returned)."""
        method = methods().get(request.method)
        cost = method.cost if method is not None else BUILTIN_COSTS.get(request.method)
        if cost is None:  # unknown method: answered at once, but it costs like one
            cost = float(get_config()["ADMISSION_ERROR_COST"])
        hub = await get_hub()
        identity = self.admission_identity()
        key: Hashable | None = None
        units = 1.0
        if method is not None and method.coalesce is not None:
            key, units = self._coalescing(method.coalesce, identity, request)
        merged = method is not None and hub.pool.would_merge(key, units, method.coalesce.cap if method.coalesce else 0)
        limited = bool(method and (method.max_in_flight or method.rate))
        if method is not None and limited:  # the method's own limits first: no tokens spent on a refusal
            refusal = hub.gate.methods.take(request.method, identity, method.max_in_flight, method.rate, method.burst)
            if refusal is not None:
                if not await self._refused_again(hub, refusal):
                    return None
                return await self._refused(request, method, refusal)
        answer: Any = ...  # until admit answers
        try:
            answer = await hub.gate.admit(identity, cost, merged=merged)
        finally:  # refused, or cancelled while the shared bucket answered: the method's place back
            if limited and answer is not None:
                hub.gate.methods.done(request.method, identity)
        refusal = answer
        if refusal is not None:
            if not await self._refused_again(hub, refusal):
                return None
            return await self._refused(request, method, refusal)
        if method is None:  # a built-in: cheap, ordered with this connection's frames
            try:
                return await self._run(request)
            finally:
                hub.admission.release(identity)
        call = Call(self, request.method, request.params, identity, merged, method.coalesce, method.is_async)
        if limited:  # its place in the method's books is given back however it ends
            name, methods_limits = request.method, hub.gate.methods
            call.future.add_done_callback(lambda _: methods_limits.done(name, identity))
        coalesce = method.coalesce
        hub.pool.submit(call, key, units, coalesce.cap if coalesce else 0.0, bool(coalesce and coalesce.serial))
        return Pending(request.id, call.future)

    async def _refused_again(self, hub: Hub, refusal: Refusal) -> bool:
        """Count a refusal against the identity's budget: False (and the connection closed
        with 1008) when the client ignores its refusals. Over its own limits, nothing more
        is read from it until it may pass again (at most a second): TCP pushes back on a
        flood; answers go on."""
        if not hub.gate.spend_refusal(self.admission_identity()):
            await self.close(CloseCode.POLICY_VIOLATION, "too many refused requests")
            return False
        if self.connection is not None and refusal.reason != "overloaded":
            self.connection.guard.transport.pause_reading(min(refusal.retry_after_ms, 1000) / 1000)
        return True

    async def _charge_error(self, hub: Hub, request_id: Any) -> Response | None:
        """An invalid request takes ``ADMISSION_ERROR_COST`` tokens; None when it had them,
        else the refusal to answer instead of the error (a flood of bad input is refused,
        then closed, as other floods are)."""
        identity = self.admission_identity()
        refusal = await hub.gate.admit(identity, float(get_config()["ADMISSION_ERROR_COST"]))
        if refusal is None:
            hub.admission.release(identity)
            return None
        if not await self._refused_again(hub, refusal):
            return None
        return await self._refused(Request("", None, request_id), None, refusal)

    def count_error(self, reason: str, detail: str = "") -> None:
        """Count a bad request of this connection: the first of each reason is logged, the
        rest are counted and logged once, with their numbers, when the connection ends."""
        seen = self._errors.get(reason, 0)
        self._errors[reason] = seen + 1
        if not seen:
            logger.info(
                "connection %s: bad request (%s)%s; more are counted until it closes",
                self.connection.id if self.connection else "-",
                safe(reason),
                f" {safe(detail)}" if detail else "",
            )

    def _log_error_counts(self) -> None:
        repeated = {reason: n for reason, n in self._errors.items() if n > 1}
        if repeated:
            logger.info(
                "connection %s closed after %d bad requests (%s)",
                self.connection.id if self.connection else "-",
                sum(self._errors.values()),
                ", ".join(f"{safe(reason)}: {n}" for reason, n in sorted(repeated.items())),
            )

    def _coalescing(self, coalesce: Coalesce, identity: Hashable, request: Request) -> tuple[Hashable | None, float]:
        """The request's merge key and units; ``None`` (runs alone) when its params do not
        give them — the handler then answers what is wrong with them."""
        try:
            key = coalesce.key(identity, request.params)
            units = float(coalesce.units(request.params)) if key is not None else 1.0
        except Exception:
            return None, 1.0
        if key is None or not 0 < units <= coalesce.cap:
            return None, 1.0
        return (request.method, key), units

    async def _refused(self, request: Request, method: Method | None, refusal: Refusal) -> Response:
        data = refusal.data()
        if method is not None and method.snapshot is not None:
            try:
                snapshot = method.snapshot(self)
                data["snapshot"] = await snapshot if inspect.isawaitable(snapshot) else snapshot
            except Exception:
                logger.exception("method %s: snapshot failed", safe(request.method))
        message = {"overloaded": "Overloaded", "too_many_in_flight": "Too many in flight"}.get(
            refusal.reason, "Rate limited"
        )
        reason = data.pop("reason")
        return protocol.error_response(request.id, refusal.code, message, reason, **data)

    async def execute(self, method: str, params: Any) -> tuple[bool, Any]:
        """Run one (possibly merged) call: ``(True, result)`` or ``(False, error object)``."""
        response = await self._run(Request(method, params, 0))
        if "error" in response:
            return False, response["error"]
        return True, response["result"]

    async def _run(self, request: Request) -> Response:
        try:
            result = await self.dispatch(request.method, request.params)
        except BackplaneUnavailable:  # logged once per outage by the hub
            error = RPCError(protocol.OVERLOADED, "Backplane unavailable", "backplane_unavailable", retry_after_ms=1000)
            return {"jsonrpc": "2.0", "error": error.as_error(), "id": request.id}
        except RPCError as exc:
            if exc.code in protocol.LIBRARY_CODES:  # the request was wrong: counted, logged once
                self.count_error(exc.reason or "error", f"{request.method}: {exc}")
            else:  # the application's own answer (out of stock, ...): not a bad request
                logger.debug("method %s answered %s", safe(request.method), safe(str(exc)))
            return {"jsonrpc": "2.0", "error": exc.as_error(), "id": request.id}
        except Exception:
            logger.exception("method %s failed", safe(request.method))
            return protocol.error_response(request.id, protocol.INTERNAL_ERROR, "Internal error", "internal_error")
        if not encodable(request.method, result):
            return protocol.error_response(
                request.id, protocol.INTERNAL_ERROR, "Internal error", "result_not_serializable"
            )
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
        registered = methods().get(method)
        if registered is None:
            raise RPCError(protocol.METHOD_NOT_FOUND, "Method not found", "unknown_method", method=method[:100])
        if not registered.is_async:
            return await database_sync_to_async(registered.handler, thread_sensitive=False)(self, params)
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
        await require_existing(spec)
        assert self.connection is not None
        config = get_config()
        limit = config["MAX_SUBSCRIPTIONS"]
        if limit and spec.name not in self.connection.subscriptions and len(self.connection.subscriptions) >= limit:
            raise RPCError(
                protocol.TOO_MANY_SUBSCRIPTIONS, "Too many subscriptions", "too_many_subscriptions", limit=limit
            )
        since = self._since_param(params)
        delta = params.get("delta") if isinstance(params, dict) else None
        if delta is not None and delta != FOSSIL:
            raise _invalid(f'Invalid params: "delta" must be "{FOSSIL}"', "invalid_delta")
        hub = await get_hub()
        if spec.name not in hub.subscribers:
            spec = await bounded(hub, spec, config, partial(self._require, action="subscribe"))
        answer: dict[str, Any] = {"channel": spec.name, "kind": spec.kind, "interval_ms": spec.interval_ms}
        if spec.history is not None:  # a resume replays full frames, then deltas go on
            answer.update(await hub.subscribe_kept(self.connection, spec, since, deltas=delta is not None))
            return answer
        await hub.subscribe(self.connection, spec)
        self._current.append(spec)  # a state channel's value now, not a period later
        if delta is not None:  # granted: a full frame first (also on a subscribe again); never on a conflated channel
            answer["delta"] = FOSSIL if hub.fanout.want_deltas(self.connection, spec.name) else False
        if since is not None:  # nothing kept to resume from: the application resyncs
            answer.update(recovered=False, reason="no_history")
        return answer

    def _since_param(self, params: Any) -> Since | None:
        """``params["since"]``: where a client resumes a channel with history, or None."""
        if not isinstance(params, dict) or params.get("since") is None:
            return None
        try:
            return Since.parse(params["since"])
        except ValueError as exc:
            raise _invalid(f"Invalid params: {exc}", "invalid_since") from None

    async def _require(self, spec: ChannelSpec, action: Literal["subscribe", "publish"]) -> None:
        """Refuse unless the user may ``action`` the channel — the user as its session and
        the database say now, for a guarded channel (logout, deactivation, demotion)."""
        family = registry.family_of(spec.name)
        user = await self._current_user() if needs_user(spec.name, action) else self.user
        if not await allowed(user, spec.name, family.base if family else None, action):
            raise ForbiddenChannel(spec.name, action, None if "user" in self.scope else NO_USER_HINT)

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
        from realtime_app.hub.publishing import apublish

        name = self._channel_param(params)
        if not isinstance(params, dict) or "data" not in params:
            raise _invalid('Invalid params: expected {"channel": name, "data": ...}', "missing_data")
        spec = registry.resolve(name)
        if spec.kind != "event":
            raise ForbiddenChannel(spec.name, "publish")
        await self._require(spec, "publish")
        await require_existing(spec)
        try:
            seq = await apublish(spec.name, params["data"])
        except PublicationTooLarge as exc:
            raise _invalid(f"Invalid params: {exc}", "publication_too_large", limit=exc.limit) from None
        except PublicationError as exc:
            raise _invalid(f"Invalid params: {exc.problem}", "invalid_data") from None
        return {"channel": spec.name, "seq": seq}
