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
from realtime_app.endpoint.consumer import RealtimeConsumer
from realtime_app.endpoint.doors import Answer, encode_answer
from realtime_app.endpoint.refusals import log_bad_http_request, refusal_response
from realtime_app.endpoint.replies import Pending
from realtime_app.endpoint.sse import _closed_as, _error, auth_refusal, http_error
from realtime_app.endpoint.tokens import TOKEN, bearer
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

#: Seconds a request's body may take to arrive whole (408 past it).
BODY_TIMEOUT_S = 10.0
#: What :func:`_body` returns for a client gone before its body was whole.
GONE = object()
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
        self._answer: asyncio.Future[str | None] | None = None
        self._closed: tuple[int, str] | None = None
        self._jobs: list[asyncio.Future[Any]] = []  # the pool's work for this body, notifications included
        self._requests = 0  # requests (not notifications) among them

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"HttpRpcConsumer serves http scopes, got {scope['type']!r}")
        self.scope = scope
        if scope.get("method") != "POST":
            error = _error(protocol.INVALID_REQUEST, "POST a JSON-RPC request", "method_not_allowed")
            return await _reply(send, (405, http_error(405, error)[1], [(b"allow", b"POST")]))
        limit = settings().max_frame_bytes
        try:
            body = await asyncio.wait_for(_body(receive, limit), BODY_TIMEOUT_S)
        except TimeoutError:  # a body that trickles holds nothing for long
            error = _error(protocol.INVALID_REQUEST, f"body not received within {BODY_TIMEOUT_S:.0f} s", "too_slow")
            return await _reply(send, http_error(408, error))
        if body is GONE:
            return  # the client went away before its body was whole: nothing runs
        if body is None:
            error = _error(protocol.INVALID_REQUEST, f"body over {limit} bytes", "frame_too_big")
            return await _reply(send, http_error(413, error))
        try:
            hub = await get_hub()
        except BackplaneUnavailable:
            return await _reply(send, _closed_as(CloseCode.TRY_AGAIN_LATER, "backplane unavailable"))
        assert isinstance(body, bytes)
        refusal = await self._refusal(hub, body)
        if refusal is not None:
            return await _reply(send, refusal)
        conn = Connection(send, scope, transport=Discard())
        conn.identity = conn.owner = self.admission_identity()
        conn.address = self.address()
        self.connection = conn
        self.session = ServerSession(limit, settings().max_batch)
        self._answer = asyncio.get_running_loop().create_future()
        finished = False
        try:
            await self.receive_frame(body.decode("utf-8", "replace"), None)
            finished = await self._wait(receive)
        finally:
            if not finished or self._closed is not None:  # gone, cancelled, or refused as a whole
                hub.pool.abandon(self)
        await self._send_answer(send)

    async def _send_answer(self, send: Send) -> None:
        if self._closed is not None:
            code, reason = self._closed
            error = _error(protocol.INVALID_REQUEST, reason, reason.replace(" ", "_"))
            return await _reply(send, http_error(CLOSED_STATUS.get(code, 400), error))
        assert self._answer is not None
        text = self._answer.result() if self._answer.done() else None
        if text is None and self._requests:  # the pool closed under them (a shutdown)
            error = _error(protocol.OVERLOADED, "Shutting down", "shutting_down", retry_after_ms=1000)
            return await _reply(send, http_error(503, error, 1000))
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

    async def _refusal(self, hub: Any, body: bytes) -> Answer | None:
        scope = self.scope
        if (refused := await auth_refusal(self)) is not None:
            return refused
        if _by_session(scope) and not await _csrf_passes(scope, body):
            # costs the client's bucket as any bad request does: a flood is refused, not checked
            if (limited := await hub.gate.charge_error(self.admission_identity())) is not None:
                error = dict(refusal_response(None, limited)["error"])
                return http_error(429, error, limited.retry_after_ms)
            message = "CSRF token missing or incorrect (send X-CSRFToken)"
            return http_error(403, _error(protocol.INVALID_REQUEST, message, "csrf_failed"))
        if not await self.accept_connection():
            return http_error(403, _error(protocol.FORBIDDEN_CHANNEL, "Forbidden", "refused"))
        return None

    async def _wait(self, receive: Receive) -> bool:
        """Until every request and notification of the body is done (True), or the client
        went away (False)."""
        pending = [job for job in self._jobs if not job.done()]
        if not pending or self._closed is not None:
            await asyncio.sleep(0)  # the reply's callbacks of jobs just done run first
            return True
        gone = asyncio.ensure_future(receive())
        try:
            while pending:
                await asyncio.wait((*pending, gone), return_when=asyncio.FIRST_COMPLETED)
                pending = [job for job in pending if not job.done()]
                if gone.done() and pending:
                    if gone.result().get("type") == "http.disconnect":
                        return False
                    gone = asyncio.ensure_future(receive())
        finally:
            gone.cancel()
        await asyncio.sleep(0)  # the reply's callbacks run after the futures' own
        return True

    def _respond(self, hub: Any, text: str) -> None:
        if self._answer is not None and not self._answer.done():
            self._answer.set_result(text)

    async def handle_request(self, request: Request) -> Response | Pending | None:
        outcome = await super().handle_request(request)
        if not request.is_notification:
            self._requests += 1
        if isinstance(outcome, Pending):
            self._jobs.append(outcome.future)
        return outcome

    def count_error(self, reason: str, detail: str = "") -> None:
        """Counted as a socket's are; logged once a minute per reason for the process (each
        HTTP request is a connection of its own: once per connection would be once per request)."""
        if self.session is not None:
            self.session.count_error(reason)
        log_bad_http_request(reason, detail)

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
        try:
            middleware.process_request(request)
            return middleware.process_view(request, _csrf_target, (), {}) is None
        except Exception:  # DisallowedHost and the like: not a request to run
            return False

    return bool(await sync_to_async(check)())


def _csrf_target(request: Any) -> None:
    """The view the CSRF check is made for (none is run)."""


async def _body(receive: Receive, limit: int) -> bytes | object | None:
    """The request's body, None past ``limit`` bytes (read no further), :data:`GONE` when
    the client went away before it was whole."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return GONE
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
