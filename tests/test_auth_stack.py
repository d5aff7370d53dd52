"""``realtime_app.routing.AuthMiddlewareStack``: a WebSocket handshake gets its cookies,
session and user in one layer, with the server's own ``send``. Found: Channels' four
layers (cookies, session, user, token) each held a coroutine frame and a copy of the
scope for the socket's life, and the session layer wrapped every ``send`` for a save it
never makes on a WebSocket — some 3 KiB of every idle connection (docs/performance.md)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings

from realtime_app.endpoint.tokens import AUTH_UNAVAILABLE
from realtime_app.routing import AuthMiddlewareStack
from tests.support.cookies import session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


class Capture:
    """The application behind the stack: what it was given, and how deep it was called."""

    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}
        self.send: Any = None
        self.layers = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope, self.send = scope, send
        calls = 0
        for frame in inspect.stack(0)[1:]:  # the callers, up to the test
            if frame.function.startswith("test_"):
                break
            calls += frame.function == "__call__"
        self.layers = calls


async def _server_send(message: dict[str, Any]) -> None:
    return None


async def _receive() -> dict[str, Any]:
    return {"type": "websocket.connect"}


def _scope(kind: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": kind, "path": "/realtime/", "headers": headers, "client": ("127.0.0.1", 1), "query_string": b""}


async def test_a_websocket_gets_its_cookies_session_and_user_in_one_layer_with_the_servers_send(
    django_user_model: Any,
) -> None:
    user = await sync_to_async(django_user_model.objects.create_user)(username="ada", password="x-" * 8)
    cookie = await sync_to_async(session_cookie)(user)
    app = Capture()
    await AuthMiddlewareStack(app)(_scope("websocket", [(b"cookie", cookie)]), _receive, _server_send)
    scope = app.scope
    assert scope["user"].pk == user.pk and scope["user"].is_authenticated
    assert scope["session"].session_key == scope["cookies"][settings.SESSION_COOKIE_NAME]
    assert app.send is _server_send  # before: the session layer's wrapper of every send
    assert app.layers == 1  # before: four
    anonymous = Capture()
    await AuthMiddlewareStack(anonymous)(_scope("websocket", []), _receive, _server_send)
    assert not anonymous.scope["user"].is_authenticated and anonymous.scope["cookies"] == {}
    assert anonymous.scope["session"].session_key is None and AUTH_UNAVAILABLE not in anonymous.scope


async def test_http_goes_through_channels_layers() -> None:
    app = Capture()
    await AuthMiddlewareStack(app)(_scope("http", []), _receive, _server_send)
    assert "user" in app.scope and app.send is not _server_send  # the session layer saves on a response
