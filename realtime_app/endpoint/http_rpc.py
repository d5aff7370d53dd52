"""``POST /realtime/rpc``: JSON-RPC 2.0 over HTTP, the socket's methods and doors.

One request or a batch, parsed, admitted, coalesced and answered exactly as a socket's
frame is (:meth:`~realtime_app.endpoint.consumer.RealtimeConsumer.receive_frame`): the
same methods (``subscribe`` and ``unsubscribe`` are a stream's, ``GET /realtime/sse``;
``auth`` is the ``Authorization: Bearer`` header), the same identity, bucket and caps,
the same idempotency. A request signed in by its session cookie needs Django's CSRF
token (``X-CSRFToken``, checked by Django's own ``CsrfViewMiddleware``): a page of
another site must not call methods as its visitor. A Bearer or anonymous request carries
no ambient right and needs none. The body is bounded by ``MAX_FRAME_BYTES`` (413).
"""

from __future__ import annotations

import asyncio
import io
import logging
from typing import Any

from realtime_app.conf.runtime import settings
from realtime_app.endpoint.auth import AUTH_UNAVAILABLE
from realtime_app.endpoint.consumer import RealtimeConsumer
from realtime_app.endpoint.doors import Answer, encode_answer
from realtime_app.endpoint.refusals import log_auth_outage, log_error_counts, token_refusal
from realtime_app.endpoint.replies import Pending
from realtime_app.endpoint.sse import _closed_as, _error, http_error
from realtime_app.endpoint.tokens import TOKEN, UNREAD_BEARER, bearer, unread_bearer
from realtime_app.exceptions import BackplaneUnavailable, RPCError
from realtime_app.hub.core import Connection
from realtime_app.hub.hubs import get_hub
from realtime_app.outbound.base import Transport
from realtime_app.wire import protocol
from realtime_app.wire.asgi import Receive, Scope, Send
from realtime_app.wire.protocol import CloseCode, Request, Response
from realtime_app.wire.session import ServerSession

__all__ = ["STREAM_ONLY", "HttpRpcConsumer"]

logger = logging.getLogger("realtime_app.consumers")

#: Methods of a connection that lives on: over HTTP they are answered with where to go.
STREAM_ONLY = {
    "subscribe": "subscribe with GET /realtime/sse?channel=…",
    "unsubscribe": "close or reopen the stream of GET /realtime/sse",
    "auth": "send the token as Authorization: Bearer",
}
#: The HTTP status of a request refused as a whole (what would close a socket).
CLOSED_STATUS: dict[int, int] = {CloseCode.MESSAGE_TOO_BIG: 413, CloseCode.POLICY_VIOLATION: 429}


class Discard(Transport):
    """An HTTP request's connection: its answer is the response, nothing is pushed."""

    kind = "http"

    def write(self, payload: bytes, frame: bytes | None = None) -> bool:
        return False

    def close(self, code: int, reason: str, drain_s: float) -> None:
        pass


class HttpRpcConsumer(RealtimeConsumer):
    """ASGI application of ``POST /realtime/rpc`` (routed by :class:`~realtime_app.routing.MetricsShortcut`)."""

    def __init__(self) -> None:
        super().__init__()
        self._answer: asyncio.Future[str] | None = None
        self._closed: tuple[int, str] | None = None
        self._waiting = 0  # requests (not notifications) whose answer comes from the pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"HttpRpcConsumer serves http scopes, got {scope['type']!r}")
        self.scope = scope
        if scope.get("method") != "POST":
            return await _reply(send, (405, {"error": "POST a JSON-RPC request"}, [(b"allow", b"POST")]))
        body = await _body(receive, settings().max_frame_bytes)
        if body is None:
            limit = settings().max_frame_bytes
            error = _error(protocol.INVALID_REQUEST, f"body over {limit} bytes", "frame_too_big")
            return await _reply(send, http_error(413, error))
        refusal = await self._refusal(body)
        if refusal is not None:
            return await _reply(send, refusal)
        try:
            hub = await get_hub()
        except BackplaneUnavailable:
            return await _reply(send, _closed_as(CloseCode.TRY_AGAIN_LATER, "backplane unavailable"))
        conn = Connection(send, scope, transport=Discard())
        conn.identity = conn.owner = self.admission_identity()
        conn.address = self.address()
        self.connection = conn
        self.session = ServerSession(settings().max_frame_bytes, settings().max_batch)
        self._answer = asyncio.get_running_loop().create_future()
        try:
            await self.receive_frame(body.decode("utf-8", "replace"), None)
            text = await self._wait(receive)
        finally:
            hub.pool.abandon(self)
            log_error_counts(self.session, conn)
        if self._closed is not None:
            code, reason = self._closed
            status = CLOSED_STATUS.get(code, 400)
            error = _error(protocol.INVALID_REQUEST, reason, reason.replace(" ", "_"))
            return await _reply(send, http_error(status, error))
        if text is None:
            await send({"type": "http.response.start", "status": 204, "headers": [(b"cache-control", b"no-store")]})
            await send({"type": "http.response.body", "body": b""})
            return
        data = text.encode("utf-8")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(data)).encode()),
            (b"cache-control", b"no-store"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _refusal(self, body: bytes) -> Answer | None:
        scope = self.scope
        if scope.get(AUTH_UNAVAILABLE):
            log_auth_outage(scope[AUTH_UNAVAILABLE])
            return _closed_as(CloseCode.TRY_AGAIN_LATER, "database unavailable")
        if (refused := await token_refusal(scope, self.address_identity())) is not None:
            return _closed_as(*refused)
        if unread_bearer(scope):
            return _closed_as(CloseCode.TOKEN_REFUSED, UNREAD_BEARER)
        if _by_session(scope) and not await _csrf_passes(scope, body):
            message = "CSRF token missing or incorrect (send X-CSRFToken)"
            error = _error(protocol.INVALID_REQUEST, message, "csrf_failed")
            return http_error(403, error)
        if not await self.accept_connection():
            return http_error(403, _error(protocol.FORBIDDEN_CHANNEL, "Forbidden", "refused"))
        return None

    async def _wait(self, receive: Receive) -> str | None:
        """The answer, once every request of the body is done (None: notifications only);
        a client that goes away meanwhile abandons what it asked."""
        assert self._answer is not None
        if self._closed is not None:
            return None
        if not self._answer.done():
            gone = asyncio.ensure_future(receive())
            try:
                while not self._answer.done():
                    await asyncio.wait((self._answer, gone), return_when=asyncio.FIRST_COMPLETED)
                    if gone.done() and not self._answer.done():
                        if gone.result().get("type") == "http.disconnect":
                            return None
                        gone = asyncio.ensure_future(receive())
            finally:
                gone.cancel()
        return self._answer.result()

    def _respond(self, hub: Any, text: str) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(text)

    async def receive_frame(self, text: str | None, data: bytes | None) -> None:
        await super().receive_frame(text, data)
        if self._answer is not None and not self._answer.done() and not self._pending():
            self._answer.set_result(None)  # type: ignore[arg-type]

    def _pending(self) -> bool:
        """True while an answer is still to come (a queued method's)."""
        return bool(self._waiting)

    async def handle_request(self, request: Request) -> Response | Pending | None:
        outcome = await super().handle_request(request)
        if isinstance(outcome, Pending) and not request.is_notification:
            self._waiting += 1
        return outcome

    async def close(self, code: int, reason: str) -> None:
        self._closed = (int(code), reason)
        if self.connection is not None:
            self.connection.closed = True

    async def dispatch(self, method: str, params: Any) -> Any:
        if method in STREAM_ONLY:
            message = f"Not over HTTP: {STREAM_ONLY[method]}"
            raise RPCError(protocol.METHOD_NOT_FOUND, message, "stream_only", method=method)
        return await super().dispatch(method, params)


def _by_session(scope: Scope) -> bool:
    """Signed in by the session cookie (not a token, not a Bearer the client sent)."""
    user = scope.get("user")
    return bool(getattr(user, "is_authenticated", False)) and TOKEN not in scope and bearer(scope) is None


async def _csrf_passes(scope: Scope, body: bytes) -> bool:
    """Django's own CSRF check of this request (its cookie or session, ``X-CSRFToken``,
    Origin and Referer against ``CSRF_TRUSTED_ORIGINS``)."""
    from asgiref.sync import sync_to_async
    from django.core.handlers.asgi import ASGIRequest
    from django.middleware.csrf import CsrfViewMiddleware

    def check() -> bool:
        request = ASGIRequest(scope, io.BytesIO(body))
        request.session = scope.get("session")
        middleware = CsrfViewMiddleware(lambda r: None)
        middleware.process_request(request)
        return middleware.process_view(request, _csrf_target, (), {}) is None

    return bool(await sync_to_async(check)())


def _csrf_target(request: Any) -> None:
    """The view the CSRF check is made for (none is run)."""


async def _body(receive: Receive, limit: int) -> bytes | None:
    """The request's body, None past ``limit`` bytes (read no further)."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b""
        chunk = message.get("body", b"")
        size += len(chunk)
        if limit and size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _reply(send: Send, answer: Answer) -> None:
    status, headers, body = encode_answer(answer)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
