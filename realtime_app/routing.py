"""URL routes of the WebSocket endpoint, for the project's ``URLRouter``.

``websocket_urlpatterns`` routes ``/realtime/``; wrap the router in this module's
``AuthMiddlewareStack`` (a drop-in for Channels' own that also reads this site's connection
tokens from ``Authorization: Bearer``; a database outage closes a signed-in user's
handshake with 1013 instead of failing it with HTTP 500). Put ``not_found_urlpatterns`` last in your
``URLRouter`` so that a WebSocket to any other path is refused cleanly (HTTP 403, one
INFO line) instead of Channels' ``ValueError: No route found`` and a 500 with a traceback.
"""

from __future__ import annotations

import hmac
import logging

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.urls import path, re_path

from realtime_app.endpoint.auth import AuthMiddlewareStack
from realtime_app.endpoint.consumer import RealtimeConsumer
from realtime_app.endpoint.doors import Answer
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import ASGIApp, Receive, Scope, Send

__all__ = [
    "AuthMiddlewareStack",
    "MetricsShortcut",
    "OriginValidator",
    "WebSocketNotFound",
    "not_found_urlpatterns",
    "websocket_urlpatterns",
]

logger = logging.getLogger("realtime_app.consumers")


class OriginValidator:
    """Channels' ``AllowedHostsOriginValidator``, with the two ways past it that carry no
    cookie (docs/auth.md): a handshake with ``Authorization: Bearer`` — a browser cannot
    set that header, so no page can ride on a visitor's session with it — and a page of
    one of ``TOKEN_ORIGINS`` (another domain), whose cookies are dropped: it is anonymous
    until it signs in with RPC ``auth``."""

    def __init__(self, inner: ASGIApp) -> None:
        from channels.security.websocket import AllowedHostsOriginValidator

        self.inner = inner
        self.validated = AllowedHostsOriginValidator(inner)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        from realtime_app.conf.runtime import settings
        from realtime_app.endpoint.tokens import bearer

        if scope.get("type") == "websocket":
            if bearer(scope) is not None:  # its token is who it is: no cookie rides along
                cookieless = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"cookie"]
                await self.inner({**scope, "headers": cookieless}, receive, send)
                return
            headers = scope.get("headers", ())
            origin = next((v.decode("latin-1") for k, v in headers if k.lower() == b"origin"), None)
            if origin is not None and origin in settings().token_origins:
                cookieless = [(k, v) for k, v in headers if k.lower() != b"cookie"]
                await self.inner({**scope, "headers": cookieless}, receive, send)
                return
        await self.validated(scope, receive, send)


class WebSocketNotFound:
    """ASGI app refusing a WebSocket handshake on a path nothing serves."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "websocket":
            raise ValueError(f"WebSocketNotFound serves websocket scopes, got {scope['type']!r}")
        message = await receive()
        if message["type"] == "websocket.connect":
            logger.info("no WebSocket route for %s", safe(scope.get("path", "")))
            await send({"type": "websocket.close"})  # before accept: the server answers 403


class MetricsShortcut:
    """Wraps the project's HTTP application and answers, before Django's middleware:

    * a ``GET`` of the metrics URL that carries the ``METRICS_TOKEN`` bearer (a Prometheus
      scrape), so a read costs the probe and its text and not a request through every
      middleware (two thirds of a read's CPU with the demo's seven, docs/observability.md);
    * ``GET /realtime/ready`` (a load balancer's poll: a drain's 503 is a state, not the
      ERROR line Django writes for every 5xx);
    * a ``POST`` of the publish API without a valid key: 401, or 429 for an address
      that keeps failing (:class:`~realtime_app.endpoint.doors.PublishDoor`), so a
      keyless flood costs a header comparison.

    * ``GET /realtime/sse`` (Server-Sent Events) and ``POST /realtime/rpc`` (JSON-RPC over
      HTTP): the socket's endpoint over HTTP (docs/sse.md), under the same auth as the
      socket (this module's :func:`AuthMiddlewareStack`: the session cookie or a Bearer).

    The same bytes as the views. Anything else goes to the wrapped application unchanged."""

    def __init__(self, app: ASGIApp) -> None:
        from realtime_app.endpoint.doors import PublishDoor

        self.app = app
        self._paths: dict[str, str] = {}
        self.publish_door = PublishDoor()

    def _path_of(self, name: str) -> str:
        """A view's path below the script prefix; ``""`` when the app's URLs are not included."""
        path = self._paths.get(name)
        if path is None:
            from django.conf import settings
            from django.urls import NoReverseMatch, reverse

            try:
                path = reverse(f"realtime_app:{name}", urlconf=settings.ROOT_URLCONF)
            except NoReverseMatch:
                path = ""
            self._paths[name] = path
        return path

    def _metrics_path(self) -> str:
        return self._path_of("metrics")

    def _door(self, scope: Scope) -> Answer | None:
        """The answer given here to a ready poll or a publish without a valid key; None
        for anything else."""
        from realtime_app.endpoint.doors import readiness

        method, path = scope.get("method"), _below_root(scope)
        if not path:
            return None
        if method in ("GET", "HEAD") and path == self._path_of("ready"):
            return readiness()
        if method == "POST" and path == self._path_of("publish"):
            return self.publish_door.answer(scope)
        return None

    def _authorized(self, scope: Scope) -> bool:
        from realtime_app.conf.runtime import settings

        token = settings().metrics_token
        if not token or scope.get("method") != "GET":
            return False
        path = _below_root(scope)
        if not path or path != self._metrics_path():
            return False
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        return hmac.compare_digest(header, f"Bearer {token}".encode())

    async def _endpoint(self, scope: Scope, receive: Receive, send: Send) -> bool:
        """Serve the event stream or the HTTP RPC when ``scope`` asks for one."""
        path = _below_root(scope)
        if not path or path not in (self._path_of("sse"), self._path_of("rpc")):
            return False
        from realtime_app.endpoint.auth import authenticated

        if path == self._path_of("sse"):
            from realtime_app.endpoint.sse import EventStreamConsumer as consumer
        else:
            from realtime_app.endpoint.http_rpc import HttpRpcConsumer as consumer  # type: ignore[assignment]
        await consumer()(await authenticated(scope), receive, send)
        return True

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") == "http" and await self._endpoint(scope, receive, send):
            return
        if scope.get("type") == "http" and (answer := self._door(scope)) is not None:
            from realtime_app.endpoint.doors import encode_answer

            status, headers, body = encode_answer(answer)
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": b"" if scope.get("method") == "HEAD" else body})
            return
        if scope.get("type") != "http" or not self._authorized(scope):
            await self.app(scope, receive, send)
            return
        from prometheus_client import CONTENT_TYPE_LATEST

        from realtime_app.observability.metrics import render
        from realtime_app.observability.probes import served_probe

        body = render(await served_probe(serving=True))
        headers = [
            (b"content-type", CONTENT_TYPE_LATEST.encode()),
            (b"content-length", str(len(body)).encode()),
            (b"x-content-type-options", b"nosniff"),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _below_root(scope: Scope) -> str:
    """The request's path below the script prefix (``root_path``)."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def _installed() -> None:
    """Routing the endpoint of an app that is not installed answers every method
    ``unknown_method`` and every channel ``unknown_channel`` (nothing registered them):
    say so at start-up instead."""
    if apps.ready and not apps.is_installed("realtime_app"):
        raise ImproperlyConfigured(
            'realtime_app.routing is used but "realtime_app" is not in INSTALLED_APPS: add it, so that its '
            "channels, methods and checks are registered (README, Quick start)."
        )


_installed()

websocket_urlpatterns = [path("realtime/", RealtimeConsumer.as_asgi())]
not_found_urlpatterns = [re_path(r"", WebSocketNotFound())]
