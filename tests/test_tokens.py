"""Connection tokens, in one process: what a token says and refuses, and the RPC ``auth``
that switches a connection to the token's user without leaving the caps behind.

Found in review: another Authorization scheme (HTTP Basic in front of a staging site) was
read as a bad token and refused every socket; a refused ``auth`` left its connection
counted nowhere; a garbage ``auth`` first let a later one pass after anonymous calls."""

from __future__ import annotations

import asyncio
import secrets
import time

import pytest
from asgiref.sync import sync_to_async
from django.test import override_settings

from realtime_app.conf import get_config
from realtime_app.endpoint.tokens import TokenError, bearer, issue, token_user, verify
from realtime_app.exceptions import RPCError
from realtime_app.testing import RealtimeTestClient

pytestmark = pytest.mark.django_db(transaction=True)


async def user(django_user_model, name, **extra):
    return await sync_to_async(django_user_model.objects.create_user)(name, password="p", **extra)


def test_only_a_bearer_header_is_a_token():
    assert bearer({"headers": [(b"authorization", b"Bearer abc")]}) == "abc"
    assert bearer({"headers": [(b"authorization", b"Basic dXNlcjpwYXNz")]}) is None
    assert bearer({"headers": [(b"authorization", b"Bearer ")]}) is None
    assert bearer({"headers": []}) is None


async def test_a_token_names_its_user_until_it_expires_or_is_revoked(django_user_model):
    ann = await user(django_user_model, "ann")
    token, expires_at = issue(ann, 60, ["private:reports"])
    claims = verify(token)
    assert claims.channels == ("private:reports",) and claims.expires_at == expires_at
    assert (await sync_to_async(token_user)(claims)).pk == ann.pk
    with pytest.raises(TokenError, match="expired"):
        verify(token, now=time.time() + 61)
    with pytest.raises(TokenError, match="invalid"):
        verify(token[:-2] + "xx")
    ann.set_password("new")
    await sync_to_async(ann.save)()
    with pytest.raises(TokenError, match="revoked"):
        await sync_to_async(token_user)(claims)
    with pytest.raises(ValueError, match="bytes"):
        issue(ann, 60, [f"channel:{secrets.token_hex(8)}" for _ in range(500)])  # too large to be read back


async def test_auth_is_refused_after_any_other_request_even_a_failed_auth(realtime_hub, django_user_model):
    token, _ = issue(await user(django_user_model, "bob"), 60)
    async with RealtimeTestClient() as client:
        with pytest.raises(RPCError) as refused:
            await client.call("auth", {"token": "garbage"})
        assert refused.value.reason == "token_invalid"
        await client.call("ping")
        with pytest.raises(RPCError) as refused:
            await client.call("auth", {"token": token})
        assert refused.value.reason == "auth_not_first"


async def test_a_refused_auth_keeps_the_connection_counted_as_it_was(realtime_hub, django_user_model):
    cat = await user(django_user_model, "cat")
    token, _ = issue(cat, 60)
    with override_settings(REALTIME_APP={**get_config(), "MAX_CONNECTIONS_PER_USER": 1}):
        async with RealtimeTestClient(cat):
            before = dict(realtime_hub.gate.open)
            async with RealtimeTestClient(address="10.9.9.9") as anonymous:
                counted = dict(realtime_hub.gate.open)
                with pytest.raises(RPCError) as refused:
                    await anonymous.call("auth", {"token": token})
                assert refused.value.reason == "too_many_connections"
                assert realtime_hub.gate.open == counted  # still the address's, as it was
                assert counted["address"] == before["address"] + 1


async def test_token_expiring_goes_through_a_full_queue_where_frames_are_dropped(realtime_hub, django_user_model):
    """The notice that a token expires is a response: over the backpressure threshold,
    where a publication is dropped, it is written all the same (the client would be closed
    with 4004 for want of it). Found: no test held this."""
    import realtime_app
    from tests.support.overfull import Overfull

    ann = await user(django_user_model, "ann-expiring")
    with override_settings(REALTIME_APP={**get_config(), "TOKEN_REFRESH_BEFORE_S": 58}):
        token, expires_at = issue(ann, 60)  # told about 2 s from now
        async with RealtimeTestClient(token=token) as client:
            await client.call("subscribe", {"channel": "demo:events"})
            [conn] = [c for c in realtime_hub.connections if not c.closed]
            conn.guard.transport = Overfull(conn.guard.transport)  # the client reads nothing any more
            warn = min(conn.scope["realtime_token_timers"], key=lambda handle: handle.when())
            assert warn.when() > asyncio.get_running_loop().time()  # the notice is still to come: through Overfull
            await realtime_app.apublish("demo:events", {"n": 1})
            note = await client.notification(timeout=5)
            assert (note["method"], note["params"]) == ("token_expiring", {"expires_at": expires_at}), note
            assert conn.guard.state.drops >= 1 and not conn.closed  # publications were dropped, not it


@pytest.mark.django_db(transaction=True)
async def test_a_token_of_another_site_sharing_the_secret_key_is_refused(django_user_model, settings):
    """Found: the salt was a constant, so a staging copy with the same SECRET_KEY and user
    table issued tokens this site accepted. It now includes TOKEN_SALT, by default the
    settings module and ALLOWED_HOSTS."""
    ann = await user(django_user_model, "ann")
    settings.ALLOWED_HOSTS = ["staging.example.com"]
    token, _ = issue(ann)
    assert verify(token).user == str(ann.pk)  # its own site takes it
    settings.ALLOWED_HOSTS = ["staging.example.com", "10.0.3.7", "[::1]"]  # a pod's own address: the same site
    assert verify(token).user == str(ann.pk)
    settings.ALLOWED_HOSTS = ["www.example.com"]
    with pytest.raises(TokenError, match="invalid"):
        verify(token)
    both = {**settings.REALTIME_APP, "TOKEN_SALT": "shop-2026"}  # sites that mean to share tokens say so
    settings.REALTIME_APP = both
    token, _ = issue(ann)
    settings.ALLOWED_HOSTS = ["staging.example.com"]
    assert verify(token).user == str(ann.pk)
    settings.REALTIME_APP = {**both, "TOKEN_SALT": "shop-2027"}  # a new salt: every earlier token refused
    with pytest.raises(TokenError, match="invalid"):
        verify(token)


@pytest.mark.django_db(transaction=True)
async def test_token_handshakes_good_or_bad_draw_on_their_addresss_handshake_bucket(realtime_hub, django_user_model):
    """Found: handshakes with a bad or expired token skipped every handshake bound (300
    from one address in half a second) and no counter saw them."""
    from channels.routing import URLRouter
    from channels.testing import WebsocketCommunicator

    from realtime_app.routing import AuthMiddlewareStack, websocket_urlpatterns

    app = AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
    good, _ = issue(await user(django_user_model, "bo"))

    async def handshake(token: str, address: str) -> tuple[bool, int | None, str]:
        comm = WebsocketCommunicator(app, "/realtime/", headers=[(b"authorization", f"Bearer {token}".encode())])
        comm.scope["client"] = (address, 40000)
        connected, _ = await comm.connect()
        assert connected  # accepted, then closed with a code the client reads
        if await comm.receive_nothing(0.3):  # open: it would have been closed at once
            await comm.disconnect()
            return True, None, ""
        message = await comm.receive_output(3)
        return False, message.get("code"), message.get("reason", "")

    with override_settings(REALTIME_APP={**get_config(), "HANDSHAKES_PER_S": 1.0, "HANDSHAKE_BURST": 3}):
        realtime_hub.gate.handshakes.clock = lambda: 1000.0  # no refill: the counts are exact on a slow machine
        answers = [await handshake("not-a-token", "192.0.2.61") for _ in range(3)]
        assert [a[1] for a in answers] == [4002] * 3
        assert await handshake("not-a-token", "192.0.2.61") == (False, 1013, "too many handshakes")
        assert await handshake(good, "192.0.2.61") == (False, 1013, "too many handshakes")  # good or bad
        assert (await handshake(good, "192.0.2.62"))[0]  # another address: its own bucket
        assert realtime_hub.probe()["refused"]["tokens"] == 3
