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

__all__ = ["check_auth_middleware", "check_settings_name", "realtime_routes"]

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


@register(Tags.security)
def check_auth_middleware(app_configs: Any = None, **kwargs: Any) -> list[CheckMessage]:
    """W041: the ASGI application routes the realtime endpoint with no auth middleware in
    front of it — every connection is anonymous, every guarded channel refused."""
    from django.conf import settings
    from django.utils.module_loading import import_string

    path = getattr(settings, "ASGI_APPLICATION", None)
    if not path:
        return []
    try:
        application = import_string(path)
    except Exception:  # the server reports its own application's import errors
        return []
    unguarded = sorted({name for name, authed in realtime_routes(application) if not authed})
    return (
        [
            Warning(
                f"{path} routes the realtime endpoint ({', '.join(unguarded)}) without an auth middleware: every "
                "connection is anonymous, and every channel with a policy is refused (forbidden_channel).",
                hint="Wrap the WebSocket application: AuthMiddlewareStack(URLRouter([...])) from channels.auth "
                "(docs/checks.md).",
                obj=path,
                id="realtime_app.W041",
            )
        ]
        if unguarded
        else []
    )


def realtime_routes(app: Any, authed: bool = False, depth: int = 0) -> Iterator[tuple[str, bool]]:
    """``(consumer class name, behind an auth middleware)`` for each route of the ASGI
    application ``app`` that leads to a :class:`~realtime_app.endpoint.consumer.RealtimeConsumer`.
    An auth middleware is Channels' ``AuthMiddleware`` or any middleware whose class name
    says ``Auth`` (token and JWT middlewares are named so)."""
    from realtime_app.endpoint.consumer import RealtimeConsumer

    if app is None or depth > 20:
        return
    mapping = getattr(app, "application_mapping", None)
    if isinstance(mapping, dict):  # ProtocolTypeRouter
        yield from realtime_routes(mapping.get("websocket"), authed, depth + 1)
        return
    consumer = getattr(app, "consumer_class", None)
    if isinstance(consumer, type):
        if issubclass(consumer, RealtimeConsumer):
            yield consumer.__name__, authed
        return
    authed = authed or "Auth" in type(app).__name__
    routes = getattr(app, "routes", None)
    if isinstance(routes, list):  # URLRouter
        for route in routes:
            yield from realtime_routes(getattr(route, "callback", None), authed, depth + 1)
        return
    for attribute in ("inner", "application", "app"):
        inner = getattr(app, attribute, None)
        if inner is not None and inner is not app:
            yield from realtime_routes(inner, authed, depth + 1)
            return
