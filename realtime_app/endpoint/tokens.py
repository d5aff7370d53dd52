"""Connection tokens: a signed, expiring name of a user, for the clients a session cookie
does not serve — a mobile app, a bot, a page on another domain, a test.

Signed with Django's :mod:`django.core.signing` under a salt of this app's own: no new
dependency, the key is ``SECRET_KEY`` (and ``SECRET_KEY_FALLBACKS`` verify tokens signed
before a rotation), and nothing but this app ever reads them, so JWT's interoperability
buys nothing. A token carries the user's primary key, its expiry, a digest of the user's
session hash (a changed password, or a rotated key once its fallback is dropped, revokes
every token issued before) and, optionally, channels its holder may subscribe beyond the
rules (signed channel access: a private channel with no query per subscribe).

A token is read from the handshake's ``Authorization: Bearer`` header
(:func:`with_token`, in this app's ``AuthMiddlewareStack``) or from RPC
``auth {"token"}``; never from a URL. docs/auth.md says which to use where.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from django.core import signing

from realtime_app.conf.runtime import settings
from realtime_app.wire.asgi import Receive, Scope, Send
from realtime_app.wire.protocol import CloseCode

__all__ = [
    "AUTH_STACK",
    "AUTH_UNAVAILABLE",
    "TOKEN",
    "TOKEN_REFUSED",
    "Claims",
    "arm_expiry",
    "cancel_expiry",
    "TokenAuthMiddleware",
    "USER_FROM_OUTSIDE",
    "UNREAD_BEARER",
    "TokenError",
    "bearer",
    "granted",
    "issue",
    "token_user",
    "unread_bearer",
    "verify",
    "with_token",
]

logger = logging.getLogger("realtime_app.sessions")

SALT = "realtime_app.connection-token"


def site_salt() -> str:
    """The salt of this site's tokens: :data:`SALT` and ``TOKEN_SALT`` — by default the
    settings module and the host names of ``ALLOWED_HOSTS`` (not its addresses), so that
    another site sharing ``SECRET_KEY`` and a user table (a staging copy, a second
    project) does not take this one's tokens."""
    from django.conf import settings as django_settings

    own = settings().token_salt
    if own is None:  # host names only: a pod's own address in ALLOWED_HOSTS would split one site in two
        hosts = sorted(str(host) for host in django_settings.ALLOWED_HOSTS if not _is_address(str(host)))
        own = f"{django_settings.SETTINGS_MODULE}|{','.join(hosts)}"
    return f"{SALT}:{own}"


def _is_address(host: str) -> bool:
    import ipaddress

    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


#: The scope keys: the verified token's claims, and why a handshake's token was refused.
TOKEN = "realtime_token"
TOKEN_REFUSED = "realtime_token_refused"
#: The scope key that says why the user could not be loaded (the database's error): the
#: consumer closes with 1013, the client comes back (a session's or a token's alike).
AUTH_UNAVAILABLE = "realtime_auth_unavailable"
#: Set on a WebSocket's scope by this app's auth stack: its Bearer header, if any, was read
#: (behind Channels' own stack it is not, and the endpoint refuses it rather than serve an
#: anonymous user the client did not mean to be).
AUTH_STACK = "realtime_auth_stack"
#: Set when a signed-in user was in the scope before this app's stack (a JWT middleware
#: further out): re-validation reads that user again by its key, never from the cookie's
#: session (another user's, or an anonymous cart's), and that session's logout is not its.
USER_FROM_OUTSIDE = "realtime_user_from_outside"
#: Longest token read, bytes (a header or an ``auth`` call): more is refused unread.
MAX_TOKEN_BYTES = 4096
_DIGEST_CHARS = 20


class TokenError(Exception):
    """A token refused: ``reason`` is ``invalid`` (tampered, malformed, unknown user),
    ``expired``, or ``revoked`` (its user deactivated or its password changed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"token {reason}")
        self.reason = reason

    @property
    def close_code(self) -> int:
        return int(CloseCode.TOKEN_EXPIRED if self.reason == "expired" else CloseCode.TOKEN_REFUSED)


@dataclass(frozen=True, slots=True)
class Claims:
    """What a verified token says."""

    user: str  # the user's primary key, as text
    expires_at: int  # unix seconds
    digest: str  # of the user's session hash when issued
    channels: tuple[str, ...] = ()  # may be subscribed whatever the rules say


def _digest(user: Any, secret: str | None = None) -> str:
    """Of the user's password hash, keyed: a new password (or key) makes another."""
    from django.utils.crypto import salted_hmac

    value = f"{user.pk}:{getattr(user, 'password', '')}"
    return str(salted_hmac(SALT, value, secret=secret, algorithm="sha256").hexdigest())[:_DIGEST_CHARS]


def issue(user: Any, ttl_s: int | None = None, channels: tuple[str, ...] | list[str] = ()) -> tuple[str, int]:
    """A token of ``user`` valid ``ttl_s`` seconds (``TOKEN_TTL_S``; at most
    ``TOKEN_MAX_TTL_S``) and its expiry (unix seconds)."""
    config = settings()
    ttl = int(ttl_s if ttl_s is not None else config.token_ttl_s)
    if not 0 < ttl <= config.token_max_ttl_s:
        raise ValueError(f"a token lives 1..{config.token_max_ttl_s} s (TOKEN_MAX_TTL_S), not {ttl}")
    expires_at = int(time.time()) + ttl
    payload: dict[str, Any] = {"u": str(user.pk), "e": expires_at, "h": _digest(user)}
    if channels:
        payload["c"] = [str(c) for c in channels]
    token = signing.dumps(payload, salt=site_salt(), compress=True)
    if len(token) > MAX_TOKEN_BYTES:
        raise ValueError(f"a token over {MAX_TOKEN_BYTES} bytes would be refused: grant fewer channels")
    return token, expires_at


def verify(token: Any, now: float | None = None) -> Claims:
    """The claims of a well-signed, unexpired token; raises :class:`TokenError`."""
    if not isinstance(token, str) or not token or len(token.encode("utf-8", "replace")) > MAX_TOKEN_BYTES:
        raise TokenError("invalid")
    try:
        raw = signing.loads(token, salt=site_salt())
        claims = Claims(str(raw["u"]), int(raw["e"]), str(raw["h"]), tuple(str(c) for c in raw.get("c", ())))
    except (signing.BadSignature, KeyError, TypeError, ValueError, AttributeError):
        raise TokenError("invalid") from None
    if claims.expires_at <= (time.time() if now is None else now):
        raise TokenError("expired")
    return claims


def token_user(claims: Claims) -> Any:
    """The user a token names, as the database says now (sync: run it in a thread);
    raises :class:`TokenError` ``revoked`` when it is gone, inactive or changed its
    password, ``invalid`` when no such user ever was."""
    from django.conf import settings
    from django.contrib.auth import get_user_model
    from django.core.exceptions import ValidationError
    from django.utils.crypto import constant_time_compare

    model = get_user_model()
    try:
        pk = model._meta.pk.to_python(claims.user)
    except (ValidationError, ValueError, TypeError):  # a key of another shape: no such user
        raise TokenError("invalid") from None
    user = model._default_manager.filter(pk=pk).first()  # a DatabaseError is an outage, not a verdict
    if user is None:
        raise TokenError("revoked")
    if not getattr(user, "is_active", True):
        raise TokenError("revoked")
    digests = [_digest(user)] + [_digest(user, key) for key in getattr(settings, "SECRET_KEY_FALLBACKS", [])]
    if not any(constant_time_compare(claims.digest, d) for d in digests):
        raise TokenError("revoked")
    return user


def granted(scope: Scope, spec: Any) -> bool:
    """Whether the connection's token grants subscribing ``spec`` (a channel spec, or a
    name: its name, or its family's base — every cadence of a granted family)."""
    claims: Claims | None = scope.get(TOKEN)
    if claims is None or not claims.channels:
        return False
    if isinstance(spec, str):
        from realtime_app.declarations.registry import registry

        found = registry.find(spec)
        name, base = spec, (found.base if found is not None else spec)
    else:
        name, base = spec.name, spec.base
    return name in claims.channels or base in claims.channels


def bearer(scope: Scope) -> str | None:
    """The handshake's ``Authorization: Bearer`` token, if any (another scheme, HTTP Basic
    in front of a staging site say, is none of ours: None)."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"authorization":
            kind, _, token = value.decode("latin-1").partition(" ")
            return token.strip() or None if kind.lower() == "bearer" else None
    return None


async def with_token(scope: Scope, outer_user: bool = False, *, owned: bool = False) -> Scope:
    """The scope of a WebSocket handshake, its ``Authorization: Bearer`` read: one of this
    site's connection tokens makes the scope its user's (``scope[TOKEN]``, and no session:
    logging a cookie's session out does not close it; the token's own expiry and revocation
    do). Anything else leaves the scope as it is — the session and its user, or a user a
    middleware further out set — and only says, in ``scope[TOKEN_REFUSED]``, why the
    header is not a token of this site's (this app's endpoint closes with 4002 or 4004; the
    project's own consumers never look). ``outer_user``: a signed-in user was set by a
    middleware further out (a JWT middleware reading the same header): it stands, and the
    header is left to it. Marks the scope
    :data:`AUTH_STACK`: the header was read. ``owned``: ``scope`` is the caller's own copy,
    marked in place (a copy more would stay for the socket's life)."""
    if owned:
        scope[AUTH_STACK] = True
    else:
        scope = {**scope, AUTH_STACK: True}
    token = bearer(scope) if scope.get("type") in ("websocket", "http") else None
    if token is None or outer_user:
        return scope
    from channels.db import database_sync_to_async
    from django.db import DatabaseError

    try:
        claims = verify(token)
        user = await database_sync_to_async(token_user)(claims)
    except TokenError as error:
        return {**scope, TOKEN_REFUSED: error}
    except DatabaseError as exc:  # an outage: 1013, the client comes back (never a final 4002)
        return {**scope, AUTH_UNAVAILABLE: f"{type(exc).__name__}"}
    scope = {key: value for key, value in scope.items() if key not in ("session", AUTH_UNAVAILABLE)}
    return {**scope, "user": user, TOKEN: claims}  # the cookie's session, read or not, is not this socket's


#: The close reason of a Bearer handshake that no auth stack of this app read.
UNREAD_BEARER = "bearer token not read: wrap the router in realtime_app.routing.AuthMiddlewareStack"


def unread_bearer(scope: Scope) -> bool:
    """A handshake carries a Bearer header that this app's auth stack did not read
    (Channels' own stack in front) and nothing else signed it in: serving it would make the
    client anonymous without a word."""
    if scope.get(AUTH_STACK) or bearer(scope) is None:
        return False
    return not getattr(scope.get("user"), "is_authenticated", False)


class TokenAuthMiddleware:
    """A WebSocket handshake's Bearer token read (:func:`with_token`), with no session
    layer: for an endpoint served by tokens alone (``realtime_app.testing``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        outer = bool(getattr(scope.get("user"), "is_authenticated", False))
        if scope.get("type") == "websocket" and "user" not in scope:
            from django.contrib.auth.models import AnonymousUser

            scope = {**scope, "user": AnonymousUser()}
        await self.inner(await with_token(scope, outer), receive, send)


def schedule_expiry(loop: asyncio.AbstractEventLoop, scope: Scope, warn: Any, expire: Any) -> None:
    """Arm a token connection's two timers: ``warn()`` ``TOKEN_REFRESH_BEFORE_S`` before
    its token expires (the client refreshes it), ``expire()`` when it does; a refresh arms
    them again. Cancelled by :func:`cancel_expiry` when the connection ends."""
    cancel_expiry(scope)
    claims: Claims | None = scope.get(TOKEN)
    if claims is None:
        return
    left = claims.expires_at - time.time()
    before = settings().token_refresh_before_s
    handles = [loop.call_later(max(left, 0), expire)]
    if left > before:
        handles.append(loop.call_later(left - before, warn))
    scope["realtime_token_timers"] = handles


def arm_expiry(hub: Any, conn: Any, scope: Scope) -> None:
    """Arm ``conn``'s token timers (none without a token): a ``token_expiring``
    notification ``TOKEN_REFRESH_BEFORE_S`` before its expiry, the close with 4004 at it."""
    claims: Claims | None = scope.get(TOKEN)
    if claims is None:
        return
    from realtime_app.wire.protocol import encode

    def warn() -> None:
        if not conn.closed:
            notice = {"jsonrpc": "2.0", "method": "token_expiring", "params": {"expires_at": claims.expires_at}}
            hub.replies.send_to(conn, encode(notice), response=True)  # never dropped under backpressure

    def expire() -> None:
        if not conn.closed:
            logger.info("connection %s closed with 4004: its token expired", conn.id)
            conn.guard.close(int(CloseCode.TOKEN_EXPIRED), "token expired")
            hub.forget(conn)

    schedule_expiry(asyncio.get_running_loop(), scope, warn, expire)


def cancel_expiry(scope: Scope) -> None:
    for handle in scope.pop("realtime_token_timers", ()):
        handle.cancel()
