"""Channels' auth middleware, made to survive a database outage: a signed-in user's
handshake that cannot load its session is closed with 1013 ``database unavailable`` (the
clients retry with backoff) instead of failing with HTTP 500."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddleware as ChannelsAuthMiddleware
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.db import DatabaseError

from realtime_app.endpoint.tokens import AUTH_UNAVAILABLE, TokenAuthMiddleware
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import Scope

__all__ = ["AUTH_UNAVAILABLE", "AuthMiddleware", "AuthMiddlewareStack"]


class AuthMiddleware(ChannelsAuthMiddleware):  # type: ignore[misc]
    """Channels' ``AuthMiddleware``; when the database does not answer, the scope's user is
    anonymous and ``scope[AUTH_UNAVAILABLE]`` says why — :class:`RealtimeConsumer` then
    refuses the handshake with 1013 rather than serve the user with fewer rights."""

    async def resolve_scope(self, scope: Scope) -> None:
        try:
            await super().resolve_scope(scope)
        except DatabaseError as exc:
            from django.contrib.auth.models import AnonymousUser

            scope["user"]._wrapped = AnonymousUser()
            scope[AUTH_UNAVAILABLE] = f"{type(exc).__name__}: {safe(exc, 200)}"


def AuthMiddlewareStack(inner: Any) -> Any:
    """Drop-in for ``channels.auth.AuthMiddlewareStack``: cookies, sessions, and the user,
    with :class:`AuthMiddleware`; a handshake with ``Authorization: Bearer`` is its
    token's user instead (:class:`~realtime_app.endpoint.tokens.TokenAuthMiddleware`)."""
    return CookieMiddleware(SessionMiddleware(AuthMiddleware(TokenAuthMiddleware(inner))))
