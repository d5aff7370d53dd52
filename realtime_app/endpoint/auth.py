"""Channels' auth stack, as a drop-in that reads this site's connection tokens too.

For every consumer under it, a WebSocket's scope is the one Channels' ``AuthMiddlewareStack``
gives — its cookies, its session, its user, and a session or user set by a middleware further
out kept as they are — except where the handshake's ``Authorization: Bearer`` is a valid
connection token of this site: then the scope's user is the token's. A Bearer that is not
(another API's key, a JWT) leaves the session and its user alone; only this app's endpoint
refuses it (:data:`TOKEN_REFUSED`). A database outage while the user is read makes the user
anonymous with :data:`AUTH_UNAVAILABLE` set, which the endpoint answers with 1013, not 500."""

from __future__ import annotations

from typing import Any

from channels.auth import AuthMiddleware as ChannelsAuthMiddleware
from channels.sessions import CookieMiddleware, SessionMiddleware
from django.db import DatabaseError

from realtime_app.endpoint.tokens import AUTH_STACK, AUTH_UNAVAILABLE, USER_FROM_OUTSIDE, with_token
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import Receive, Scope, Send

__all__ = ["AUTH_STACK", "AUTH_UNAVAILABLE", "AuthMiddleware", "AuthMiddlewareStack", "AuthStack", "authenticated"]


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
    """Cookies, the session and the user of a WebSocket handshake — then a Bearer token's
    user where the header holds one of this site's — in one layer. Channels' stack is three
    (cookies, session, user): each a coroutine frame holding its own copy of the scope for as
    long as the socket is open, and the session layer's wrapper of ``send``, which saves a
    session only on an HTTP response, never on a WebSocket — some 3 KiB a connection, for
    nothing it does after the handshake. The scope the application gets is the same, with
    :data:`AUTH_STACK` set (the endpoint knows a Bearer was read). HTTP goes through
    Channels' layers."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.layers = CookieMiddleware(SessionMiddleware(AuthMiddleware(inner)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("type") != "websocket" or "headers" not in scope:
            await self.layers(scope, receive, send)
            return
        await self.inner(await authenticated(scope), receive, send)


async def authenticated(scope: Scope) -> Scope:
    """A handshake's (or an event stream's, an HTTP RPC's) scope with its cookies, session
    and user, then its Bearer token read: what :class:`AuthStack` gives a WebSocket."""
    outer = "user" in scope and _signed_in_user(scope["user"])  # set further out: it stands
    scope = await _signed_in(scope)
    if outer:
        scope[USER_FROM_OUTSIDE] = True  # re-validated by its key, not by the cookie's session
    return await with_token(scope, outer, owned=True)  # _signed_in made it a copy of its own


def _signed_in_user(user: Any) -> bool:
    """Whether a user set further out is signed in; one that cannot say (a lazy object
    not resolved yet, one that would query the database here) is taken as not."""
    try:
        return bool(getattr(user, "is_authenticated", False))
    except Exception:
        return False


def _cookies(scope: Scope) -> dict[str, str]:
    from django.http import parse_cookie

    for name, value in scope["headers"]:
        if name == b"cookie":
            return dict(parse_cookie(value.decode("latin1")))
    return {}


async def _signed_in(scope: Scope) -> Scope:
    """The scope with its cookies, its session and its user, as Channels' three layers make
    it: what a middleware further out set (a session, a user) is kept, never read again."""
    from importlib import import_module

    from channels.auth import UserLazyObject, get_user
    from django.conf import settings
    from django.contrib.auth.models import AnonymousUser
    from django.utils.functional import LazyObject

    scope = {**scope, AUTH_STACK: True}
    if "cookies" not in scope:
        scope["cookies"] = _cookies(scope)
    if "session" not in scope:
        session = LazyObject()
        store = import_module(settings.SESSION_ENGINE).SessionStore
        session._wrapped = store(scope["cookies"].get(settings.SESSION_COOKIE_NAME))
        scope["session"] = session
    if "user" not in scope:
        user = scope["user"] = UserLazyObject()
        try:
            user._wrapped = await get_user(scope)
        except DatabaseError as exc:
            user._wrapped = AnonymousUser()
            scope[AUTH_UNAVAILABLE] = f"{type(exc).__name__}: {safe(exc, 200)}"
    return scope


def AuthMiddlewareStack(inner: Any) -> Any:
    """Drop-in for ``channels.auth.AuthMiddlewareStack``: cookies, sessions, and the user,
    with :class:`AuthMiddleware` (a database outage is 1013, not a 500); a handshake whose
    ``Authorization: Bearer`` is one of this site's connection tokens is its token's user
    (:func:`~realtime_app.endpoint.tokens.with_token`). A WebSocket goes through one layer
    (:class:`AuthStack`), not three."""
    return AuthStack(inner)
