"""URL routes of the WebSocket endpoint, for the project's ``URLRouter``.

``websocket_urlpatterns`` routes ``/realtime/``; wrap the router in this module's
``AuthMiddlewareStack`` (Channels' own, but a database outage closes a signed-in user's
handshake with 1013 instead of failing it with HTTP 500). Put ``not_found_urlpatterns`` last in your
``URLRouter`` so that a WebSocket to any other path is refused cleanly (HTTP 403, one
INFO line) instead of Channels' ``ValueError: No route found`` and a 500 with a traceback.
"""

from __future__ import annotations

import logging

from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.urls import path, re_path

from realtime_app.endpoint.auth import AuthMiddlewareStack
from realtime_app.endpoint.consumer import RealtimeConsumer
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import ASGIApp, Receive, Scope, Send

__all__ = [
    "AuthMiddlewareStack",
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
        from realtime_app.conf import get_config
        from realtime_app.endpoint.tokens import bearer

        if scope.get("type") == "websocket":
            if bearer(scope) is not None:  # its token is who it is: no cookie rides along
                cookieless = [(k, v) for k, v in scope.get("headers", ()) if k.lower() != b"cookie"]
                await self.inner({**scope, "headers": cookieless}, receive, send)
                return
            headers = scope.get("headers", ())
            origin = next((v.decode("latin-1") for k, v in headers if k.lower() == b"origin"), None)
            if origin is not None and origin in get_config()["TOKEN_ORIGINS"]:
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
