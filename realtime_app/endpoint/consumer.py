"""The WebSocket endpoint: a thin ASGI adapter between the socket and the hub.

The connection's protocol state is its :class:`~realtime_app.wire.session.ServerSession`
(frames checked and parsed, bad input counted, the values that follow an answer); every
request passes the hub's one door (:meth:`~realtime_app.hub.gate.Gate.admit_request`);
the built-in methods are :mod:`realtime_app.endpoint.builtins`. It has no channel-layer
channel of its own: frames reach it from the process's hub, so a connection costs nothing
on the backplane.
"""

from __future__ import annotations

import inspect
import logging
import time
from functools import partial
from typing import Any

from realtime_app.conf.runtime import settings
from realtime_app.declarations.instances import sync_in_pool
from realtime_app.declarations.registry import ChannelSpec
from realtime_app.endpoint.addresses import client_address, client_network, trusted_networks
from realtime_app.endpoint.auth import AUTH_UNAVAILABLE
from realtime_app.endpoint.builtins import BUILTINS
from realtime_app.endpoint.methods import BUILTIN_COSTS, Method, encodable, method_costs, methods, rpc_method
from realtime_app.endpoint.refusals import (
    NO_SNAPSHOT,
    deny,
    log_auth_outage,
    log_error_counts,
    log_unsupported_once,
    refusal_response,
    refuse,
    refused_socket,
    token_refusal,
)
from realtime_app.endpoint.replies import Pending, Reply
from realtime_app.endpoint.sessions import current_user
from realtime_app.endpoint.tokens import UNREAD_BEARER, arm_expiry, cancel_expiry, unread_bearer
from realtime_app.exceptions import BackplaneUnavailable, OutboxFull, RPCError
from realtime_app.hub.core import Connection, Hub
from realtime_app.hub.hubs import get_hub
from realtime_app.inbound.admission import Refusal
from realtime_app.observability.logsafe import safe
from realtime_app.outbound.transports import UnsupportedServer
from realtime_app.wire import protocol
from realtime_app.wire.asgi import ASGIApp, Receive, Scope, Send
from realtime_app.wire.protocol import CloseCode, Request, Response
from realtime_app.wire.session import Close, ServerSession

__all__ = ["RealtimeConsumer", "method_costs", "rpc_method"]

logger = logging.getLogger("realtime_app.consumers")


class RealtimeConsumer:
    """ASGI application of the ``/realtime/`` endpoint. Subclass to add hooks.

    Use ``RealtimeConsumer.as_asgi()`` in a ``URLRouter`` behind
    ``AllowedHostsOriginValidator(AuthMiddlewareStack(...))``.
    """

    def __init__(self) -> None:
        self.scope: Scope = {}
        self.connection: Connection | None = None
        self.session: ServerSession[ChannelSpec] | None = None  # from the accept on
        self._fresh: tuple[float, Any] | None = None  # (when the read began, user) of the last re-read
        self._frame_at = 0.0  # when the frame being answered arrived
        self._identity: tuple[str, str] | None = None

    @classmethod
    def as_asgi(cls, **initkwargs: Any) -> ASGIApp:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            await cls(**initkwargs)(scope, receive, send)

        app.consumer_class = cls  # type: ignore[attr-defined]
        return app

    async def accept_connection(self) -> bool:
        """Return False to refuse the handshake (403). Origin and auth come from middleware."""
        return True

    @property
    def user(self) -> Any:
        return self.scope.get("user")

    async def current_user(self) -> Any:
        """The user as the session and the database say now: read once for each frame that
        asks (a batch of 50 guarded subscribes costs one read, not 50), never taken from
        an earlier frame — a right revoked between two frames is refused at the second,
        not up to a re-validation round later. Each frame's requests cost the client tokens
        (admission), which bounds the reads."""
        if self._fresh is None or self._fresh[0] < self._frame_at:
            began = time.monotonic()
            self._fresh = (began, await current_user(self.scope))
        return self._fresh[1]

    def identity(self) -> tuple[str, str]:
        """Who this connection is: the user's primary key, else the client's address
        (read through ``TRUSTED_PROXIES`` only, :mod:`realtime_app.endpoint.addresses`). Its
        connection cap, handshake rate, request cap and token bucket all belong to that
        identity, so reconnecting or opening more sockets gives a client nothing more."""
        user = self.user
        if user is not None and getattr(user, "is_authenticated", False):
            return ("user", str(user.pk))
        return self.address_identity()

    def address(self) -> str:
        """The client's address, read through the ``TRUSTED_PROXIES`` only."""
        config = settings()
        return client_address(self.scope, trusted_networks(tuple(config.trusted_proxies)), config.forwarded_header)

    def address_identity(self) -> tuple[str, str]:
        """The client's network, whoever it signs in as (a token handshake's bucket)."""
        config = settings()
        return ("address", client_network(self.address(), config.address_prefix_v4, config.address_prefix_v6))

    def admission_identity(self) -> tuple[str, str]:
        """Whose bucket and cap a request draws on: the user's (shared by all of its
        connections, across the cluster on the Redis backplane), else the client
        address's (shared by its connections in this process): :meth:`identity`."""
        if self._identity is None:
            self._identity = self.identity()
        return self._identity

    # -- ASGI -----------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            raise ValueError(f"RealtimeConsumer serves websocket scopes, got {scope['type']!r}")
        self.scope = scope
        message = await receive()
        if message["type"] != "websocket.connect":
            return
        if scope.get(AUTH_UNAVAILABLE):  # the session could not be read: come back, rights intact
            log_auth_outage(scope[AUTH_UNAVAILABLE])
            return await deny(send, scope, CloseCode.TRY_AGAIN_LATER, "database unavailable")
        if (refused := await token_refusal(scope, self.address_identity())) is not None:
            return await deny(send, scope, *refused)  # a bad token is nobody's session
        if unread_bearer(scope):  # not silently anonymous: the client meant to be its token's user
            return await deny(send, scope, CloseCode.TOKEN_REFUSED, UNREAD_BEARER)
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
        conn.address = self.address()
        if await refused_socket(hub, conn, self.admission_identity()):
            return
        try:
            await send({"type": "websocket.accept"})
            self.connection = conn
            self.session = ServerSession(settings().max_frame_bytes, settings().max_batch)
            arm_expiry(hub, conn, scope)  # a token connection is told before its token expires
            while (message := await receive())["type"] != "websocket.disconnect":
                if message["type"] == "websocket.receive" and not conn.closed:
                    await self.receive_frame(message.get("text"), message.get("bytes"))
        finally:
            cancel_expiry(scope)
            hub.pool.abandon(self)
            await hub.remove_connection(conn)
            log_error_counts(self.session, self.connection)

    async def close(self, code: int, reason: str) -> None:
        """Close this connection with ``code``; frames that arrive afterwards are ignored."""
        assert self.connection is not None
        if self.connection.closed:
            return
        logger.info("closing connection %s with %s: %s", self.connection.id, code, reason)
        self.connection.guard.close(code, reason)
        hub = await get_hub()
        await hub.remove_connection(self.connection)

    def _respond(self, hub: Hub, text: str) -> None:
        """Write one frame of answers, if the connection is still open."""
        conn = self.connection
        if conn is not None and not conn.closed:
            hub.replies.send_to(conn, text, response=True)

    async def receive_frame(self, text: str | None, data: bytes | None) -> None:
        assert self.connection is not None and self.session is not None
        self._frame_at = time.monotonic()  # its guarded requests see the user as read from now on
        frame = self.session.receive(text)
        if isinstance(frame, Close):
            return await self.close(frame.code, frame.reason)
        hub = await get_hub()
        if frame is None or hub.replies.unread_responses(self.connection):
            return  # closing, or the client does not read its answers: none of these requests runs
        errors: list[Response] = []
        for error in frame.errors:  # bad input costs tokens like any request
            self.count_error(str(error.get("error", {}).get("data", {}).get("reason", "invalid")))
            refusal = await hub.gate.charge_error(self.admission_identity())
            answer = error if refusal is None else await self._refused(hub, Request("", None, error.get("id")), refusal)
            if answer is None or self.connection.closed:
                return
            errors.append(answer)
        reply = Reply(partial(self._respond, hub), frame.is_batch, errors)
        for request in frame.requests:
            outcome = await self.handle_request(request)
            if not request.is_notification:
                reply.add(outcome)
        if follow := self.session.answered():  # after the answer, which tells the client the channel's canonical name
            reply.then(lambda: hub.spawn(self._send_current(hub, follow)))
        reply.seal()

    async def _send_current(self, hub: Hub, specs: list[ChannelSpec]) -> None:
        for spec in specs if self.connection is not None else ():
            await hub.send_current(self.connection, spec)  # type: ignore[arg-type]

    async def handle_request(self, request: Request) -> Response | Pending | None:
        """Admit one request, then run it: a built-in inline (its answer is returned), an
        application method in the pool (a future of its answer is returned)."""
        method = methods().get(request.method)
        cost = method.cost if method is not None else BUILTIN_COSTS.get(request.method)
        if cost is None:  # unknown method: answered at once, but it costs like one
            cost = float(settings().admission_error_cost)
        hub = await get_hub()
        ticket = await hub.gate.admit_request(self.admission_identity(), request.method, method, cost, request.params)
        if isinstance(ticket, Refusal):
            return await self._refused(hub, request, ticket, method)
        if method is None:  # a built-in: cheap, ordered with this connection's frames
            try:
                return await self._run(request)
            finally:
                hub.gate.done(ticket)
        return Pending(request.id, hub.gate.submit(ticket, self, request.params, self.execute))

    async def _refused(
        self, hub: Hub, request: Request, refusal: Refusal, method: Method | None = None
    ) -> Response | None:
        """The answer to a refused request — None once the client ignored too many of them
        (the connection is closed with 1008). Over its own limits, nothing more is read
        from it until it may pass again (at most a second): TCP pushes back on a flood."""
        if not hub.gate.spend_refusal(self.admission_identity()):
            await self.close(CloseCode.POLICY_VIOLATION, "too many refused requests")
            return None
        if self.connection is not None and refusal.reason != "overloaded":
            self.connection.guard.transport.pause_reading(min(refusal.retry_after_ms, 1000) / 1000)
        snapshot: Any = NO_SNAPSHOT
        if method is not None and method.snapshot is not None:
            try:
                snapshot = method.snapshot(self)
                snapshot = await snapshot if inspect.isawaitable(snapshot) else snapshot
            except Exception:
                logger.exception("method %s: snapshot failed", safe(request.method))
                snapshot = NO_SNAPSHOT
        return refusal_response(request.id, refusal, snapshot)

    def count_error(self, reason: str, detail: str = "") -> None:
        """Count a bad request of this connection: the first of each reason is logged, the
        rest are counted and logged once, with their numbers, when the connection ends."""
        if self.session is not None and self.session.count_error(reason):
            cid = self.connection.id if self.connection else "-"
            suffix = f" {safe(detail)}" if detail else ""
            logger.info(
                "connection %s: bad request (%s)%s; more are counted until it closes", cid, safe(reason), suffix
            )

    def signed_in(self, user: Any) -> None:
        """The connection is ``user``'s from now on (RPC ``auth``): rights, identity, bucket."""
        self.scope["user"], self._fresh, self._identity = user, None, None
        if self.connection is not None and getattr(user, "is_authenticated", False):
            self.connection.owner = ("user", str(user.pk))  # its next subscriptions count in the user's shares

    async def execute(self, method: str, params: Any) -> tuple[bool, Any]:
        """Run one (possibly merged) call: ``(True, result)`` or ``(False, error object)``."""
        response = await self._run(Request(method, params, 0))
        ok = "error" not in response
        return ok, response["result"] if ok else response["error"]

    async def _run(self, request: Request) -> Response:
        try:
            result = await self.dispatch(request.method, request.params)
        except BackplaneUnavailable:  # logged once per outage by the hub
            error = RPCError(protocol.OVERLOADED, "Backplane unavailable", "backplane_unavailable", retry_after_ms=1000)
            return {"jsonrpc": "2.0", "error": error.as_error(), "id": request.id}
        except OutboxFull as full:  # a durable publication refused (said by the outbox): no traceback
            return {"jsonrpc": "2.0", "error": full.as_rpc().as_error(), "id": request.id}
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
        """Run ``method``: a built-in (:mod:`realtime_app.endpoint.builtins`) or the
        application's (a sync handler in a worker thread: it may use the ORM)."""
        builtin = BUILTINS.get(method)
        if builtin is not None:
            return await builtin(self, params)
        registered = methods().get(method)
        if registered is None:
            raise RPCError(protocol.METHOD_NOT_FOUND, "Method not found", "unknown_method", method=method[:100])
        if not registered.is_async:
            return await sync_in_pool(registered.handler, self, params)
        result = registered.handler(self, params)
        if inspect.isawaitable(result):
            result = await result
        return result
