"""Channels' auth middleware, made to survive a database outage: a signed-in user's
handshake that cannot load its session is closed with 1013 ``database unavailable`` (the
clients retry with backoff) instead of failing with HTTP 500."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddleware as ChannelsAuthMiddleware
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.db import DatabaseError

from realtime_app.endpoint.tokens import AUTH_UNAVAILABLE, TokenAuthMiddleware, bearer
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import Receive, Scope, Send

__all__ = ["AUTH_UNAVAILABLE", "AuthMiddleware", "AuthMiddlewareStack", "AuthStack"]


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


class AuthStack:
    """Cookies, the session and the user — or a bearer token's user — of a WebSocket
    handshake, in one layer. Channels' stack is four (cookies, session, user, and the
    token's here): each a coroutine frame holding its own copy of the scope for as long as
    the socket is open, and the session layer's wrapper of ``send``, which saves a session
    only on an HTTP response, never on a WebSocket — some 3 KiB a connection, for nothing
    it does after the handshake. The scope the application gets is the same. HTTP, and a
    scope that already has a session or a user (set by a middleware further out), go
    through Channels' four layers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.token = TokenAuthMiddleware(inner)
        self.layers = CookieMiddleware(SessionMiddleware(AuthMiddleware(self.token)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "websocket" or "headers" not in scope or "session" in scope or "user" in scope:
            await self.layers(scope, receive, send)
            return
        if bearer(scope) is not None:  # the token's user; the session is not used
            await self.token({**scope, "cookies": _cookies(scope)}, receive, send)
            return
        await self.inner(await _signed_in(scope), receive, send)


def _cookies(scope: Scope) -> dict[str, str]:
    from django.http import parse_cookie

    for name, value in scope["headers"]:
        if name == b"cookie":
            return dict(parse_cookie(value.decode("latin1")))
    return {}


async def _signed_in(scope: Scope) -> Scope:
    """The scope with its cookies, its session and its user, as Channels' layers make it."""
    from importlib import import_module

    from channels.auth import UserLazyObject, get_user
    from django.conf import settings
    from django.contrib.auth.models import AnonymousUser
    from django.utils.functional import LazyObject

    cookies = _cookies(scope)
    session = LazyObject()
    session._wrapped = import_module(settings.SESSION_ENGINE).SessionStore(cookies.get(settings.SESSION_COOKIE_NAME))
    user = UserLazyObject()
    scope = {**scope, "cookies": cookies, "session": session, "user": user}
    try:
        user._wrapped = await get_user(scope)
    except DatabaseError as exc:
        user._wrapped = AnonymousUser()
        scope[AUTH_UNAVAILABLE] = f"{type(exc).__name__}: {safe(exc, 200)}"
    return scope


def AuthMiddlewareStack(inner: Any) -> Any:
    """Drop-in for ``channels.auth.AuthMiddlewareStack``: cookies, sessions, and the user,
    with :class:`AuthMiddleware` (a database outage is 1013, not a 500); a handshake with
    ``Authorization: Bearer`` is its token's user instead
    (:class:`~realtime_app.endpoint.tokens.TokenAuthMiddleware`). A WebSocket goes through
    one layer (:class:`AuthStack`), not four."""
    return AuthStack(inner)
