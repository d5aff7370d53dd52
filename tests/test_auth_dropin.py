"""``realtime_app.routing.AuthMiddlewareStack`` is a drop-in for Channels' own: each test
runs the same assertions on both stacks, so what holds for Channels' holds for ours — the
scope a project's consumer gets (cookies, session, user), a user or session set further
out kept, ``channels.auth.login()``/``logout()`` on that scope (Channels' own tests of them,
tests/security/test_auth.py of channels 4.3.2, run on a scope each stack made), and the
sessions of several consumers (its test_multiple_websocket_consumers_with_sessions).

Found: any ``Authorization: Bearer`` turned a signed-in session user anonymous and removed
``scope["session"]`` (so ``login()`` raised "Cannot find session in scope"), and a user set
by an outer middleware was replaced by an anonymous one. The other way round, Channels' own
stack in front of the endpoint let a Bearer client in as anonymous without a word."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.auth import AuthMiddlewareStack as ChannelsStack
from channels.auth import login, logout
from channels.db import database_sync_to_async
from channels.generic.websocket import WebsocketConsumer
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator
from django.conf import settings
from django.contrib.auth import SESSION_KEY, user_logged_in, user_logged_out
from django.contrib.auth.models import AnonymousUser
from django.core.checks import run_checks
from django.test import override_settings
from django.urls import path

from realtime_app.endpoint.tokens import UNREAD_BEARER, issue
from realtime_app.routing import AuthMiddlewareStack, websocket_urlpatterns
from tests.support.cookies import session_cookie

pytestmark = pytest.mark.django_db(transaction=True)

STACKS = {"channels": ChannelsStack, "realtime_app": AuthMiddlewareStack}


@pytest.fixture(params=sorted(STACKS))
def stack(request: pytest.FixtureRequest) -> Any:
    return STACKS[request.param]


class Capture:
    def __init__(self) -> None:
        self.scope: dict[str, Any] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.scope = scope


class OuterUser:
    """A project's own middleware further out (a JWT one) that set the user."""

    def __init__(self, inner: Any, user: Any) -> None:
        self.inner, self.user = inner, user

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await self.inner({**scope, "user": self.user}, receive, send)


async def _receive() -> dict[str, Any]:
    return {"type": "websocket.connect"}


async def _send(message: dict[str, Any]) -> None:
    return None


async def _scope_of(app: Any, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    capture = Capture()
    scope = {"type": "websocket", "path": "/chat/", "headers": headers, "client": ("127.0.0.1", 1), "query_string": b""}
    await app(capture)(scope, _receive, _send)
    return capture.scope


async def _users(django_user_model: Any) -> tuple[Any, Any]:
    """Two users of their own (names no other test's user has)."""
    create = sync_to_async(django_user_model.objects.create_user)
    tag = secrets.token_hex(4)
    return await create(f"ann-{tag}", password="x" * 8), await create(f"bob-{tag}", password="y" * 8)


async def _user_of(scope: dict[str, Any]) -> Any:
    return await database_sync_to_async(lambda: scope["user"].pk if scope["user"].is_authenticated else None)()


async def test_a_foreign_bearer_leaves_the_session_and_its_user(stack: Any, django_user_model: Any) -> None:
    ann, _ = await _users(django_user_model)
    cookie = await sync_to_async(session_cookie)(ann)
    for bearer in (b"Bearer another-apis-key", b"Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig", b"Basic YTpi"):
        scope = await _scope_of(stack, [(b"cookie", cookie), (b"authorization", bearer)])
        assert await _user_of(scope) == ann.pk, bearer
        assert scope["session"].session_key == scope["cookies"][settings.SESSION_COOKIE_NAME]


async def test_a_user_set_further_out_is_kept(stack: Any, django_user_model: Any) -> None:
    ann, bob = await _users(django_user_model)
    cookie = await sync_to_async(session_cookie)(ann)
    for headers in ([(b"cookie", cookie)], [(b"authorization", b"Bearer jwt.bob")], []):
        scope = await _scope_of(lambda inner: OuterUser(stack(inner), bob), headers)
        assert await _user_of(scope) == bob.pk, headers
        assert "session" in scope


async def test_channels_login_and_logout_work_on_the_scope_it_makes(stack: Any, django_user_model: Any) -> None:
    """Channels' test_login_user_on_scope and test_logout, on a scope of the stack: a fresh
    anonymous socket, with a foreign Bearer header too."""
    ann, _ = await _users(django_user_model)
    fired: list[Any] = []

    def caught(sender: Any, **kwargs: Any) -> None:
        fired.append(kwargs["user"])

    for headers in ([], [(b"authorization", b"Bearer another-apis-key")]):
        scope = await _scope_of(stack, headers)
        assert not scope["user"].is_authenticated
        fired.clear()
        user_logged_in.connect(caught)
        try:
            await login(scope, ann)
        finally:
            user_logged_in.disconnect(caught)
        await database_sync_to_async(scope["session"].save)()
        assert scope["user"] == ann and fired == [ann]
        stored = await database_sync_to_async(scope["session"].__getitem__)(SESSION_KEY)
        assert stored == str(ann.pk)
        user_logged_out.connect(caught)
        try:
            await logout(scope)
        finally:
            user_logged_out.disconnect(caught)
        assert isinstance(scope["user"], AnonymousUser) and fired == [ann, ann]
        assert SESSION_KEY not in await database_sync_to_async(dict)(scope["session"])


class SessionCounter(WebsocketConsumer):
    """Channels' test consumer: counts in the session of each socket."""

    def connect(self) -> None:
        self.scope["session"]["visits"] = self.scope["session"].get("visits", 0) + 1
        self.scope["session"].save()
        self.accept()
        self.send(text_data=str(self.scope["session"]["visits"]))


async def test_multiple_websocket_consumers_with_sessions(stack: Any, django_user_model: Any) -> None:
    """Channels' test_multiple_websocket_consumers_with_sessions, with the auth stack."""
    app = stack(URLRouter([path("chat/", SessionCounter.as_asgi())]))
    first = WebsocketCommunicator(app, "/chat/")
    second = WebsocketCommunicator(app, "/chat/")
    assert (await first.connect())[0] and (await second.connect())[0]
    try:
        assert await first.receive_from() == "1" and await second.receive_from() == "1"  # a session each
    finally:
        await first.disconnect()
        await second.disconnect()


async def test_the_endpoint_refuses_a_bearer_channels_stack_never_read(django_user_model: Any) -> None:
    ann, _ = await _users(django_user_model)
    token, _ = await sync_to_async(issue)(ann)
    comm = WebsocketCommunicator(ChannelsStack(URLRouter(websocket_urlpatterns)), "/realtime/")
    comm.scope["headers"] = [(b"authorization", f"Bearer {token}".encode())]
    comm.scope["client"] = ("127.0.0.1", 1)
    connected, _ = await comm.connect()
    try:
        assert connected
        closed = await comm.receive_output(5)
        assert closed == {"type": "websocket.close", "code": 4002, "reason": UNREAD_BEARER}
    finally:
        await comm.disconnect()


def test_check_says_which_stack_serves_the_endpoint() -> None:
    assert [m for m in run_checks() if m.id == "realtime_app.W042"] == []  # the tests' application: this app's
    with override_settings(ASGI_APPLICATION="tests.testapp.channels_stack_asgi.application"):
        [warning] = [m for m in run_checks() if m.id == "realtime_app.W042"]
    assert (
        "Channels' own AuthMiddlewareStack" in warning.msg
        and "realtime_app.routing.AuthMiddlewareStack" in warning.hint
    )
