"""Checks for the mistakes of a first afternoon: a misspelled settings name (every policy in
it silently ignored) and a WebSocket application without the middleware that gives each
connection its user (every guarded channel refused, with no hint why).

Ids are stable and listed in docs/checks.md. The third such mistake — ``realtime_app``
missing from ``INSTALLED_APPS`` — cannot be a check (the app's checks are registered by the
app itself): :mod:`realtime_app.routing` raises ``ImproperlyConfigured`` at start-up.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

from django.core.checks import CheckMessage, Tags, Warning, register

__all__ = [
    "CHANNELS_STACK",
    "OTHER_AUTH",
    "REALTIME_STACK",
    "check_auth_middleware",
    "check_old_declarations_name",
    "check_settings_name",
    "realtime_routes",
]

SETTING = "REALTIME_APP"


@register(Tags.compatibility)
def check_settings_name(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W040: no ``REALTIME_APP`` but a setting whose name is close to it."""
    from django.conf import settings

    if hasattr(settings, SETTING):
        return []
    names = [name for name in dir(settings) if name.isupper()]
    return [
        Warning(
            f"settings.{name} looks like a misspelling of {SETTING}: realtime_app does not read it, so its "
            "POLICIES and limits are not applied (guarded channels are public, limits are the defaults).",
            hint=f"Rename it {SETTING} (docs/configuration.md).",
            obj=name,
            id="realtime_app.W040",
        )
        for name in difflib.get_close_matches(SETTING, names, n=3, cutoff=0.75)
    ]


@register(Tags.compatibility)
def check_old_declarations_name(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W043: the project imports ``realtime_app.channels``, the deprecated name of
    ``realtime_app.declarations`` (its DeprecationWarning is hidden by Python's defaults)."""
    import sys

    if "realtime_app.channels" not in sys.modules:
        return []
    return [
        Warning(
            "realtime_app.channels is imported: it is now realtime_app.declarations, and the old name goes in "
            "the next release.",
            hint="Import from realtime_app.declarations (or the names exported by realtime_app); "
            "python -W error::DeprecationWarning manage.py check shows where.",
            id="realtime_app.W043",
        )
    ]


@register(Tags.security)
def check_auth_middleware(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W041: the ASGI application routes the realtime endpoint with no auth middleware in
    front of it — every connection is anonymous, every guarded channel refused. W042: it
    routes it behind Channels' own ``AuthMiddlewareStack``, which never reads a connection
    token — a client with ``Authorization: Bearer`` is refused (4002) instead of signed in."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    path = getattr(settings, "ASGI_APPLICATION", None)
    if not path:
        return []
    try:
        application = import_string(path)
    except Exception:  # the server reports its own application's import errors
        return []
    routes = list(realtime_routes(application))
    messages: list[CheckMessage] = []
    unguarded = sorted({name for name, stack in routes if stack is None})
    if unguarded:
        messages.append(
            Warning(
                f"{path} routes the realtime endpoint ({', '.join(unguarded)}) without an auth middleware: every "
                "connection is anonymous, and every channel with a policy is refused (forbidden_channel).",
                hint="Wrap the WebSocket application: AuthMiddlewareStack(URLRouter([...])) from realtime_app.routing "
                "(docs/checks.md).",
                obj=path,
                id="realtime_app.W041",
            )
        )
    channels_stack = sorted({name for name, stack in routes if stack == CHANNELS_STACK})
    if channels_stack:
        messages.append(
            Warning(
                f"{path} routes the realtime endpoint ({', '.join(channels_stack)}) behind Channels' own "
                "AuthMiddlewareStack: sessions work, but a connection token (Authorization: Bearer) is never read, "
                "so such a handshake is refused with 4002.",
                hint="Use realtime_app.routing.AuthMiddlewareStack, a drop-in for Channels' that reads the tokens "
                "too (docs/auth.md).",
                obj=path,
                id="realtime_app.W042",
            )
        )
    return messages


#: What :func:`realtime_routes` says of a route's auth middleware.
REALTIME_STACK, CHANNELS_STACK, OTHER_AUTH = "realtime_app", "channels", "other"


def _stack_of(app: Any) -> str | None:
    from channels.auth import AuthMiddleware as ChannelsAuthMiddleware

    from realtime_app.endpoint.auth import AuthStack
    from realtime_app.endpoint.tokens import TokenAuthMiddleware

    if isinstance(app, AuthStack | TokenAuthMiddleware):  # the ones that read a connection token
        return REALTIME_STACK
    if isinstance(app, ChannelsAuthMiddleware):  # Channels' own, or this app's outage-proof one alone
        return CHANNELS_STACK
    return OTHER_AUTH if "Auth" in type(app).__name__ else None


def realtime_routes(app: Any, stack: str | None = None, depth: int = 0) -> Iterator[tuple[str, str | None]]:
    """``(consumer class name, the auth middleware in front of it)`` for each route of the
    ASGI application ``app`` that leads to a :class:`~realtime_app.endpoint.consumer.RealtimeConsumer`:
    :data:`REALTIME_STACK` (this app's ``AuthMiddlewareStack``), :data:`CHANNELS_STACK`
    (Channels' own), :data:`OTHER_AUTH` (a middleware whose class name says ``Auth``: a
    token or JWT middleware), or None. The one nearest the consumer tells."""
    from realtime_app.endpoint.consumer import RealtimeConsumer

    if app is None or depth > 20:
        return
    mapping = getattr(app, "application_mapping", None)
    if isinstance(mapping, dict):  # ProtocolTypeRouter
        yield from realtime_routes(mapping.get("websocket"), stack, depth + 1)
        return
    consumer = getattr(app, "consumer_class", None)
    if isinstance(consumer, type):
        if issubclass(consumer, RealtimeConsumer):
            yield consumer.__name__, stack
        return
    stack = _stack_of(app) or stack
    routes = getattr(app, "routes", None)
    if isinstance(routes, list):  # URLRouter
        for route in routes:
            yield from realtime_routes(getattr(route, "callback", None), stack, depth + 1)
        return
    for attribute in ("inner", "application", "app"):
        inner = getattr(app, attribute, None)
        if inner is not None and inner is not app:
            yield from realtime_routes(inner, stack, depth + 1)
            return
