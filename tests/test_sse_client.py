"""The Python client with ``transport="sse"`` against a real daphne: the same calls,
subscriptions, refusals, adaptive cadence and resumes as over a WebSocket; and the
event-stream reader against the vectors the browser module passes too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from realtime_app.client import RealtimeClient, bind_adaptive_channel
from realtime_app.exceptions import RPCError
from realtime_app.wire.event_stream import EventParser, translate
from tests.support.servers import Server, login
from tests.support.waiting import eventually

pytestmark = pytest.mark.timeout(90)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "event_stream.json").read_text())


@pytest.fixture(scope="module")
def server(database):
    s = Server({**database, "REDIS_URL": ""}).start()
    yield s
    s.stop()


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: c["name"])
def test_the_event_stream_vectors(case):
    parser = EventParser()
    events = []
    for chunk in case["chunks"]:
        events += parser.feed(chunk)
    assert [{"event": e.event, "data": e.data, "id": e.id} for e in events] == case["events"]
    assert [list(translate(e)) for e in events] == case["translated"]
    assert parser.retry_ms == case.get("retry_ms")


async def test_calls_subscriptions_and_refusals_over_sse(server):
    got: list[dict] = []
    async with RealtimeClient(server.ws, transport="sse") as client:
        assert await client.call("ping") == "pong"
        answer = await client.subscribe("demo:events", got.append)
        assert answer["channel"] == "demo:events" and "epoch" in answer
        with pytest.raises(RPCError) as refused:
            await client.subscribe("atelier:load", lambda _: None)
        assert refused.value.reason == "forbidden_channel"
        published = await client.call("publish", {"channel": "demo:events", "data": {"over": "sse"}})
        await eventually(lambda: any(m["seq"] == published["seq"] for m in got))
        assert got[-1]["data"] == {"over": "sse"} and got[-1]["channel"] == "demo:events"
        with pytest.raises(RPCError) as unknown:
            await client.call("no_such_method")
        assert unknown.value.code == -32601


async def test_a_session_client_calls_with_its_csrf_token(server):
    cookie = login(server.http, "demo", "demo")
    loads: list[dict] = []
    async with RealtimeClient(server.ws, transport="sse", headers={"Cookie": cookie}) as client:
        await client.subscribe("atelier:load:250", loads.append)  # signed in: allowed
        await eventually(lambda: loads)
        published = await client.call("publish", {"channel": "demo:events", "data": 1})  # CSRF sent for it
        assert published["channel"] == "demo:events"


async def test_the_adaptive_cadence_switches_by_reopening_the_stream(server):
    received: list[str] = []
    slow = {"on": False}

    async def handler(params):
        received.append(params["channel"])
        if slow["on"]:
            await asyncio.sleep(0.3)

    async with RealtimeClient(server.ws, transport="sse") as client:
        bound = await bind_adaptive_channel(client, "demo:clock", 100, handler, ladder=[100, 400], recovery_window=4)
        await eventually(lambda: len(received) >= 5)
        slow["on"] = True
        await eventually(lambda: bound.interval_ms == 400)
        switched = len(received)
        await eventually(lambda: "demo:clock:400" in received[switched:])
        slow["on"] = False
        await bound.close()


async def test_a_reconnect_resumes_every_publication_once_in_order(server):
    got: list[int] = []
    recovered: list[int] = []
    async with (
        RealtimeClient(server.ws, transport="sse") as client,
        RealtimeClient(server.ws, transport="sse") as publisher,
    ):
        client.on_recovered.append(lambda channel, n: recovered.append(n))
        await client.subscribe("demo:events", lambda m: got.append(m["seq"]))
        first = await publisher.call("publish", {"channel": "demo:events", "data": 0})
        await eventually(lambda: first["seq"] in got)
        await client.reconnect(3000)
        await eventually(lambda: client.state == "reconnecting", 5, "away")
        seqs = [(await publisher.call("publish", {"channel": "demo:events", "data": n}))["seq"] for n in range(5)]
        assert client.state == "reconnecting"  # published while it was away: they come by the resume
        await eventually(lambda: seqs[-1] in got, 20)
        assert got[got.index(first["seq"]) :] == [first["seq"], *seqs]  # every one once, in order
        assert recovered and recovered[-1] >= 1


async def test_subscribes_made_together_are_all_served_by_the_stream(server):
    """Found: two stream opens in flight at once, the older, smaller set could win."""
    names = [f"demo:clock:{ms}" for ms in (300, 400, 500, 600, 700)]
    got: dict[str, int] = dict.fromkeys(names, 0)

    def counter(name):
        def handle(message):
            got[name] += 1

        return handle

    async with RealtimeClient(server.ws, transport="sse") as client:
        for name in names:  # one after the other, each while the previous stream is opening
            asyncio.get_running_loop().create_task(client.subscribe(name, counter(name)))
            await asyncio.sleep(0.01)
        await eventually(lambda: all(n >= 2 for n in got.values()), 15, f"every channel served: {got}")


def test_a_stream_refused_for_the_clients_own_pace_is_retried_not_final():
    """Found: a 429 of the client's bucket was taken as final (1008): the client stopped.
    The close a socket would have had, and when to come back, as the reconnect reads them."""
    from realtime_app.client.event_stream import refusal_of
    from realtime_app.client.reconnecting import is_reconnectable_close_code, retry_after_ms

    limited = json.dumps({"error": {"code": -32005, "message": "Rate limited", "data": {"retry_after_ms": 700}}})
    code, reason = refusal_of(429, limited.encode())
    assert is_reconnectable_close_code(code) and retry_after_ms(reason) == 700
    capped = json.dumps({"error": {"code": -32003, "message": "too many connections", "data": {"close_code": 1008}}})
    assert refusal_of(429, capped.encode())[0] == 1008  # past its own cap: do not come back
    expired = json.dumps({"error": {"code": -32003, "message": "token expired", "data": {"close_code": 4004}}})
    assert refusal_of(401, expired.encode())[0] == 4004  # the client asks for a new token


async def test_channels_subscribed_one_at_a_time_are_paced_by_the_bucket_never_stuck(server):
    """Found: each awaited subscribe opened a stream with every channel so far; past about
    eleven the bucket refused the stream, the client closed and reopened it the same way,
    forever. Now a refused new channel is the caller's ``Refused`` (as over a socket) and the
    open stream goes on; subscribing channels together costs one stream (docs/sse.md)."""
    from realtime_app.exceptions import Refused

    names = [f"demo:clock:{ms}" for ms in range(200, 2600, 100)]
    got: set[str] = set()
    refused = 0
    async with RealtimeClient(server.ws, transport="sse") as client:
        for name in names:
            while True:
                try:
                    await asyncio.wait_for(client.subscribe(name, lambda m, asked=name: got.add(asked)), 30)
                    break
                except Refused as error:  # the client's own pace: come back when told
                    refused += 1
                    await asyncio.sleep(error.retry_after_ms / 1000)
        await eventually(lambda: got == set(names), 30, "every channel served")
        assert client.last_close is None  # the stream was never dropped for it
