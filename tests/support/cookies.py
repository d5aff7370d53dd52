"""The session cookie of a signed-in user, as a handshake's ``Cookie`` header value."""

from __future__ import annotations

from typing import Any


def session_cookie(user: Any) -> bytes:
    """``sessionid=…`` of a fresh session of ``user`` (sync: call it through sync_to_async)."""
    from django.conf import settings
    from django.test import Client

    client = Client()
    client.force_login(user)
    return f"{settings.SESSION_COOKIE_NAME}={client.cookies[settings.SESSION_COOKIE_NAME].value}".encode()
