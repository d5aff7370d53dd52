"""An open socket keeps only the rights its session still has.

The user of a WebSocket comes from its Django session at the handshake; a socket may stay
open for days. Three things keep its rights current:

* **each subscribe** to a guarded channel reads the user again from the session store and
  the database (logged out, deactivated, demoted, password changed: refused at once);
* **logout** (``user_logged_out``) tells every process of the cluster, through the
  backplane, to close the sockets of that session with 4001;
* **every** ``REVALIDATE_INTERVAL_MS`` each socket holding guarded subscriptions is
  checked again: 4001 when its session no longer yields its user (deactivation, a
  session deleted or expired), 4003 when one of its subscriptions is now forbidden
  (demotion, a permission removed).

Session keys never travel: the control message carries a digest of the key.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
from collections.abc import Callable, Iterable
from importlib import import_module
from typing import Any

from realtime_app.conf.runtime import settings
from realtime_app.declarations.policies import Action, active_rules, allowed, requirement_for
from realtime_app.declarations.registry import registry
from realtime_app.endpoint.tokens import TOKEN, USER_FROM_OUTSIDE, TokenError, granted, token_user
from realtime_app.hub.core import Connection, Hub
from realtime_app.observability.logsafe import safe
from realtime_app.wire.asgi import Scope
from realtime_app.wire.protocol import CloseCode

__all__ = [
    "current_user",
    "needs_user",
    "on_logout",
    "on_logout_message",
    "revalidate",
    "revalidation_loop",
    "session_auth_hash",
    "session_digest",
]

logger = logging.getLogger("realtime_app.sessions")

#: Channels whose rule the re-validation remembers (while the rules stay the same).
NEEDS_CACHE = 100_000
#: How long a logout waits to tell the other processes (the re-validation closes the rest).
LOGOUT_NOTICE_S = 1.0


def session_digest(session_key: str) -> str:
    """What identifies a session across the cluster without revealing its key."""
    return hashlib.sha256(f"realtime_app.session:{session_key}".encode()).hexdigest()[:32]


def needs_user(channel: str, action: Action = "subscribe") -> bool:
    """True when ``action`` on ``channel`` depends on who the user is (not open to anyone,
    or a template's owner's)."""
    spec = registry.find(channel)
    if spec is not None and spec.declared is not None and spec.declared.owner is not None:
        return True
    family = registry.family_of(channel)
    req = requirement_for(active_rules(), channel, family.base if family else None, action)
    identified = req.authenticated or req.staff or req.superuser or bool(req.permissions)
    return req.allowed and (identified or req.check is not None)


def _load_user(session_key: str | None) -> Any:
    """The user of a freshly read session, checked as Django checks a request's: its
    backend still configured, the user still there (and active, for the usual backends),
    the session hash still valid (a changed password ends the session). Unlike Django's
    ``get_user`` it never writes the session: a hash valid under ``SECRET_KEY_FALLBACKS``
    is accepted without cycling the key, which the browser would lose."""
    from django.conf import settings
    from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model, load_backend
    from django.contrib.auth.models import AnonymousUser
    from django.utils.crypto import constant_time_compare

    anonymous = AnonymousUser()
    if not session_key:
        return anonymous
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        user_id = get_user_model()._meta.pk.to_python(store[SESSION_KEY])
        backend_path = store[BACKEND_SESSION_KEY]
    except (KeyError, ValueError):
        return anonymous
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return anonymous
    user = load_backend(backend_path).get_user(user_id)
    if user is None:
        return anonymous
    if hasattr(user, "get_session_auth_hash"):
        session_hash = store.get(HASH_SESSION_KEY) or ""
        hashes = [user.get_session_auth_hash()]
        hashes += [session_auth_hash(user, key) for key in getattr(settings, "SECRET_KEY_FALLBACKS", [])]
        if not any(constant_time_compare(session_hash, h) for h in hashes):
            return anonymous
    return user


#: Django series whose private ``AbstractBaseUser._get_session_auth_hash`` this module uses.
TESTED_DJANGO = ((5, 2),)
_SESSION_HASH_SALT = "django.contrib.auth.models.AbstractBaseUser.get_session_auth_hash"


def session_auth_hash(user: Any, secret: str) -> str:
    """The user's session hash under another secret (a key of ``SECRET_KEY_FALLBACKS``):
    Django's private method on the tested series, else the same rule through the public
    ``salted_hmac`` (``tests/test_sessions.py`` holds the two together)."""
    import django
    from django.utils.crypto import salted_hmac

    private = getattr(user, "_get_session_auth_hash", None)
    if private is not None and django.VERSION[:2] in TESTED_DJANGO:
        return str(private(secret=secret))
    return str(salted_hmac(_SESSION_HASH_SALT, user.password, secret=secret, algorithm="sha256").hexdigest())


def _reload_user(user: Any) -> Any:
    """A user authenticated by something other than a session: read again by primary key."""
    from django.contrib.auth import get_user_model
    from django.contrib.auth.models import AnonymousUser

    fresh = get_user_model()._default_manager.filter(pk=user.pk).first()
    return fresh if fresh is not None and getattr(fresh, "is_active", True) else AnonymousUser()


def _token_user(claims: Any) -> Any:
    from django.contrib.auth.models import AnonymousUser

    try:
        return token_user(claims)
    except TokenError:
        return AnonymousUser()


async def current_user(scope: Scope) -> Any:
    """The socket's user as its session and the database say *now* (the handshake's user
    for anonymous sockets: they have no rights to lose)."""
    user = scope.get("user")
    if not getattr(user, "is_authenticated", False):
        return user
    from channels.db import database_sync_to_async

    claims = scope.get(TOKEN)
    key = None if scope.get(USER_FROM_OUTSIDE) else getattr(scope.get("session"), "session_key", None)
    if claims is not None:  # a connection token's user: active, its password unchanged
        fresh = await database_sync_to_async(_token_user)(claims)
    elif key is None:  # authenticated by other middleware: the database alone
        fresh = await database_sync_to_async(_reload_user)(user)
    else:
        fresh = await database_sync_to_async(_load_user)(key)
    if getattr(fresh, "pk", None) != getattr(user, "pk", None):
        from django.contrib.auth.models import AnonymousUser

        return AnonymousUser()
    return fresh


Stakes = tuple[list[tuple[str, Action]], bool]


def stakes(conn: Connection, watched: Iterable[str] = (), needs: Callable[..., bool] = needs_user) -> Stakes:
    """What ``conn`` could lose: the channels whose rule depends on its user (those it
    subscribed, those whose presence it watches: ``watched``), and whether it is signed in."""
    # a channel its token grants is its holder's (while the token's user holds: checked after)
    guarded: list[tuple[str, Action]] = [
        (c, "subscribe") for c in conn.subscriptions if needs(c) and not granted(conn.scope, c)
    ]
    guarded += [(c, "presence") for c in watched if needs(c, "presence")]
    return guarded, bool(getattr(conn.scope.get("user"), "is_authenticated", False))


async def revalidate(conn: Connection, watched: Iterable[str] = (), at_stake: Stakes | None = None) -> int | None:
    """The close code ``conn`` deserves now (None: its rights still hold); ``watched``: the
    channels whose presence it watches (their ``presence`` rule is checked too);
    ``at_stake``: :func:`stakes`, when the caller has it."""
    guarded, was_authenticated = at_stake if at_stake is not None else stakes(conn, watched)
    if not guarded and not was_authenticated:
        return None  # an anonymous socket on public channels has nothing to lose
    user = await current_user(conn.scope)
    if was_authenticated and not getattr(user, "is_authenticated", False):
        return int(CloseCode.SESSION_ENDED)  # also for application methods that read the user
    for channel, action in guarded:
        family = registry.family_of(channel)
        if not await allowed(user, channel, family.base if family else None, action):
            return int(CloseCode.RIGHTS_REVOKED)
    conn.scope["user"] = user  # the next checks start from the fresh user
    return None


async def revalidation_loop(hub: Hub) -> None:
    """Every ``REVALIDATE_INTERVAL_MS``, close the sockets whose rights have gone."""
    from django.db import DatabaseError

    outage = False  # the database did not answer the last round: said once, not per socket
    # A channel's rule read once while the rules stay (not once a round: 20,000 rooms had
    # each matched against every rule every 30 s).
    rules: object = None
    needs: Callable[..., bool] = needs_user
    while True:
        interval = settings().revalidate_interval_ms
        await asyncio.sleep(max(interval, 1000) / 1000)
        if not interval:
            continue
        if active_rules() is not rules:
            rules, needs = active_rules(), functools.lru_cache(maxsize=NEEDS_CACHE)(needs_user)
        connections = [c for c in hub.connections if not c.closed]
        failed: DatabaseError | None = None
        for conn in connections:
            try:
                at_stake = stakes(conn, hub.presence.watched(conn), needs)
                if not at_stake[0] and not at_stake[1]:
                    continue  # nothing to lose: not even a coroutine
                code = await revalidate(conn, at_stake=at_stake)
            except asyncio.CancelledError:
                raise
            except DatabaseError as exc:  # an outage: every socket would fail alike; none loses its rights
                failed = exc
                break
            except Exception:
                logger.exception("re-validating connection %s failed", conn.id)
                continue
            if code is not None:
                hub.revoke(conn, code)
        if failed is not None and not outage:
            logger.warning(
                "re-validation paused: the database does not answer; %d connection(s) keep their rights "
                "until it does (%s: %s)",
                len(connections),
                type(failed).__name__,
                safe(failed, 200),
            )
        elif failed is None and outage:
            logger.info("re-validation resumed: the database answers again")
        outage = failed is not None


def close_session(hub: Hub, digest: str) -> int:
    """Close this process's sockets of the session with ``digest``; how many were closed."""
    closed = 0
    for conn in list(hub.connections):
        key = getattr(conn.scope.get("session"), "session_key", None)
        if key and session_digest(key) == digest and not conn.closed and not conn.scope.get(USER_FROM_OUTSIDE):
            hub.revoke(conn, int(CloseCode.SESSION_ENDED))
            closed += 1
    return closed


def on_logout(sender: Any, request: Any = None, user: Any = None, **kwargs: Any) -> None:
    """``user_logged_out`` receiver: every process closes the sockets of this session."""
    key = getattr(getattr(request, "session", None), "session_key", None)
    if not key or not getattr(user, "is_authenticated", False):
        return  # an anonymous session has no socket rights to end
    from asgiref.sync import async_to_sync

    from realtime_app.hub.publishing import acontrol

    async def tell() -> None:  # bounded: a logout page never waits on a hung backplane
        await asyncio.wait_for(acontrol({"kind": "logout", "session": session_digest(key)}), LOGOUT_NOTICE_S)

    try:
        async_to_sync(tell)()
    except Exception as exc:  # the periodic re-validation closes them anyway
        logger.warning(
            "telling the cluster about a logout failed (re-validation closes its sockets): %s", safe(exc, 200)
        )


def on_logout_message(hub: Hub, message: dict[str, Any]) -> None:
    """A ``logout`` control message: close this process's sockets of that session."""
    closed = close_session(hub, str(message.get("session", "")))
    if closed:
        logger.info("closed %d connection(s) of a session that logged out", closed)
