"""One real daphne process of the demo site (in-memory layer), real WebSocket clients."""

from __future__ import annotations

import pytest
import websockets

from tests.support.servers import Server, login, prepare_database
from tests.support.wsclient import RPC

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    env = prepare_database(str(tmp_path_factory.mktemp("db") / "db.sqlite3"))
    server = Server({**env, "REDIS_URL": ""}).start()
    yield server
    server.stop()


async def test_cross_origin_handshake_is_refused(site):
    with pytest.raises(websockets.InvalidStatus) as info:
        async with RPC(site.ws, origin="http://evil.example"):
            pass
    assert info.value.response.status_code == 403


async def test_hostile_frames_over_a_real_socket(site):
    async with RPC(site.ws) as c:
        for text, code in [("not json", -32700), ("42", -32600), ("[]", -32600), ('{"id":1,"method":"x"}', -32600)]:
            await c.send(text)
            assert (await c.recv())["error"]["code"] == code
        await c.send('{"jsonrpc":"2.0","method":"ping","id":' + "9" * 4000 + "}")
        assert (await c.recv())["result"] == "pong"
        error = (await c.call("subscribe", {"channel": "demo:clock:" + "1" * 10_000}))["error"]
        assert error["data"]["reason"] == "channel_name_too_long"
        assert (await c.call("ping"))["result"] == "pong"


@pytest.mark.parametrize(("payload", "code"), [("x" * 70_000, 1009), (b"\x00binary", 1003)])
async def test_unusable_frames_close_with_the_spec_code(site, payload, code):
    # Daphne's own close refuses these codes: this pins the transport workaround.
    async with RPC(site.ws) as c:
        await c.ws.send(payload)
        with pytest.raises(websockets.ConnectionClosed) as info:
            await c.recv()
        assert info.value.rcvd.code == code
    async with RPC(site.ws) as c:  # the process is fine
        assert (await c.call("ping"))["result"] == "pong"
    assert "Traceback" not in site.output()


@pytest.mark.parametrize(
    "name", ["atelier:load", "atelier:load:250", "atelier:load:2000", "atelier:load:10", "atelier:load:60000"]
)
async def test_anonymous_is_refused_every_cadence_and_a_user_is_served(site, name):
    async with RPC(site.ws) as anon:
        error = (await anon.call("subscribe", {"channel": name}))["error"]
        assert error["data"]["reason"] == "forbidden_channel"
    cookie = login(site.http, "demo", "demo")
    async with RPC(site.ws, cookie=cookie) as user:
        result = await user.subscribe(name)
        assert result["channel"].startswith("atelier:load")
        frame = (await user.frames(1, timeout=70))[0] if result["interval_ms"] <= 2000 else None
        if frame is not None:
            assert 0 <= frame["data"]["load"] <= 1


async def test_clock_frames_keep_their_cadence(site):
    async with RPC(site.ws) as c:
        await c.subscribe("demo:clock:200")
        frames = await c.frames(11)
        seqs = [f["seq"] for f in frames]
        assert seqs == list(range(seqs[0], seqs[0] + 11))
        # The mean over ten gaps, not each gap: one late beat shortens the next one (the
        # schedule is drift-free), and a loaded machine delays beats; the default cadence
        # (1000 ms) or a second ticker (100 ms) stay far outside these bounds.
        mean = (frames[-1]["ts"] - frames[0]["ts"]) / 10
        assert 150 <= mean <= 600, [f["ts"] for f in frames]


async def test_demo_events_round_trip(site):
    async with RPC(site.ws) as a, RPC(site.ws) as b:
        await a.subscribe("demo:events")
        answer = await b.call("publish", {"channel": "demo:events", "data": {"text": "hello"}})
        frame = (await a.frames(1))[0]
        assert frame["data"] == {"text": "hello"} and frame["seq"] == answer["result"]["seq"]


def test_demo_pages_are_served(site):
    import urllib.request

    body = urllib.request.urlopen(site.http + "/").read().decode()
    assert "realtime_app/realtime.js" in body
    js = urllib.request.urlopen(site.http + "/static/realtime_app/realtime.js").read().decode()
    assert "export class RealtimeClient" in js
    assert urllib.request.urlopen(site.http + "/accounts/login/").status == 200


async def test_a_websocket_to_a_path_nothing_serves_is_refused_cleanly(site):
    """Found: Channels' default for an unknown WebSocket path is a 500 with a traceback."""
    with pytest.raises(websockets.InvalidStatus) as info:
        async with RPC(site.ws.replace("/realtime/", "/nowhere/")):
            pass
    assert info.value.response.status_code == 403
    assert "Traceback" not in site.output() and "no WebSocket route for /nowhere/" in site.output()
