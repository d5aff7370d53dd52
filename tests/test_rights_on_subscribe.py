"""Rights are read again at each subscribe — once per frame that asks, never from a read
made for an earlier frame: a staff user demoted in the database is refused the next cadence
of a staff family, the family's base, and a presence watch only staff may have, on the
socket it already has, at once — not at the next re-validation round. Through the app's own
auth stack, as a project routes it, and through realtime_app.testing.

Found: a user read for one subscribe was kept a second for the next ones, so a subscribe
right after a demotion was granted, and closed only by the re-validation ~30 s later."""

from __future__ import annotations

import json
import secrets
from typing import Any

import pytest
from asgiref.sync import sync_to_async
from channels.routing import URLRouter
from channels.testing import WebsocketCommunicator

from realtime_app.routing import AuthMiddlewareStack, websocket_urlpatterns
from tests.support.cookies import session_cookie

pytestmark = pytest.mark.django_db(transaction=True)


async def test_a_demoted_user_is_refused_at_the_next_subscribe(hub: Any, django_user_model: Any) -> None:
    create = sync_to_async(django_user_model.objects.create_user)
    staff = await create(f"staff-{secrets.token_hex(4)}", password="x" * 8, is_staff=True)
    cookie = await sync_to_async(session_cookie)(staff)
    app = AuthMiddlewareStack(URLRouter(websocket_urlpatterns))
    comm = WebsocketCommunicator(app, "/realtime/", headers=[(b"cookie", cookie)])
    comm.scope["client"] = ("10.77.0.1", 40000)
    assert (await comm.connect())[0]
    ids = iter(range(1, 100))

    async def subscribe(params: dict[str, Any]) -> dict[str, Any]:
        request_id = next(ids)
        request = {"jsonrpc": "2.0", "id": request_id, "method": "subscribe", "params": params}
        await comm.send_to(text_data=json.dumps(request))
        while True:
            answer = json.loads(await comm.receive_from(5))
            if answer.get("id") == request_id:
                return answer  # type: ignore[no-any-return]

    try:
        assert "result" in await subscribe({"channel": "realtime:socket:700"})
        watched = await subscribe({"channel": "test:backstage", "presence": True})
        assert watched["result"]["presence"] is True
        await sync_to_async(django_user_model.objects.filter(pk=staff.pk).update)(is_staff=False)
        for params in (
            {"channel": "realtime:socket:1000"},
            {"channel": "realtime:socket"},
            {"channel": "realtime:socket:900"},
        ):
            assert (await subscribe(params))["error"]["data"]["reason"] == "forbidden_channel", params
        watch = await subscribe({"channel": "test:backstage", "presence": True})
        assert watch.get("result", {}).get("presence") is not True, watch  # its presence no longer shown
    finally:
        await comm.disconnect()


async def test_with_the_testing_client_too(realtime_client: Any, django_user_model: Any) -> None:
    from realtime_app.exceptions import RPCError

    create = sync_to_async(django_user_model.objects.create_user)
    staff = await create(f"staff-{secrets.token_hex(4)}", password="x" * 8, is_staff=True)
    client = await realtime_client(staff)
    await client.subscribe("realtime:socket:700")
    await sync_to_async(django_user_model.objects.filter(pk=staff.pk).update)(is_staff=False)
    with pytest.raises(RPCError):
        await client.subscribe("realtime:socket:1000")
