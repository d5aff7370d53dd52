"""The WebSocket endpoint in-process (Channels' WebsocketCommunicator, in-memory backplane)."""

from __future__ import annotations

import asyncio
import json

import pytest
from django.test import override_settings

from realtime_app.hub import CONTROL_CHANNEL
from tests.support.asgi_client import Client
from tests.support.waiting import eventually
from tests.testapp import realtime_channels as test_channels


async def test_subscribe_receives_numbered_frames(hub):
    async with Client() as c:
        answer = await c.call("subscribe", {"channel": "demo:clock:100"})
        assert answer["result"] == {"channel": "demo:clock:100", "kind": "state", "interval_ms": 100}
        frames = await c.frames(3)
        assert [f["seq"] for f in frames] == [1, 2, 3]
        assert all(f["channel"] == "demo:clock:100" and set(f["data"]) == {"n"} for f in frames)
        assert all(isinstance(f["ts"], int) for f in frames)


async def test_cadence_is_clamped_and_canonical(hub):
    async with Client() as c:
        answer = await c.call("subscribe", {"channel": "demo:clock:5"})
        assert answer["result"]["channel"] == "demo:clock:100"
        answer = await c.call("subscribe", ["demo:clock:1000"])
        assert answer["result"]["channel"] == "demo:clock"


async def test_one_ticker_per_cadence_started_at_first_and_cleaned_after_last(hub):
    test_channels.EVENTS.clear()
    async with Client() as a, Client() as b, Client() as c:
        await a.call("subscribe", {"channel": "test:counter:200"})
        await b.call("subscribe", {"channel": "test:counter:200"})
        await c.call("subscribe", {"channel": "test:counter:400"})
        fa, fb = await asyncio.gather(a.frames(3), b.frames(2))
        by_seq = {f["seq"]: f["data"] for f in fa}
        assert all(by_seq[f["seq"]] == f["data"] for f in fb)  # one shared ticker, same frames
        assert sorted(test_channels.EVENTS) == [("start", "test:counter:200"), ("start", "test:counter:400")]
        await a.call("unsubscribe", {"channel": "test:counter:200"})
        assert ("cleanup", "test:counter:200") not in test_channels.EVENTS  # b still there
        await b.call("unsubscribe", {"channel": "test:counter:200"})
        assert ("cleanup", "test:counter:200") in test_channels.EVENTS
    # c left by disconnecting without unsubscribing
    await eventually(lambda: ("cleanup", "test:counter:400") in test_channels.EVENTS, 5, "the cleanup of :400")
    assert hub.subscribers == {} and hub.probe()["tickers"] == [] and list(hub.reconciler.channels) == [CONTROL_CHANNEL]


async def test_unknown_and_garbage_channels_are_refused(hub):
    async with Client() as c:
        for name in ["nope", "demo:clock:abc", "demo:clock:-5", "demo:clock:1e3", "demo:clock:٣"]:
            error = (await c.call("subscribe", {"channel": name}))["error"]
            assert (error["code"], error["data"]["reason"]) == (-32002, "unknown_channel")
        error = (await c.call("subscribe", {"channel": "x" * 10_000}))["error"]
        assert (error["code"], error["data"]["reason"]) == (-32602, "channel_name_too_long")
        for params in [{}, {"channel": 5}, [], "x"]:
            answer = await c.call("subscribe", params)
            assert answer["error"]["code"] in (-32602, -32600)
        assert (await c.call("ping"))["result"] == "pong"


@pytest.mark.parametrize(
    "name", ["atelier:load", "atelier:load:250", "atelier:load:2000", "atelier:load:10", "atelier:load:60000"]
)
async def test_anonymous_is_refused_every_cadence_of_a_guarded_family(hub, name):
    async with Client() as c:
        error = (await c.call("subscribe", {"channel": name}))["error"]
        assert (error["code"], error["data"]["reason"]) == (-32001, "forbidden_channel")
    assert hub.subscribers == {}


@pytest.mark.django_db
async def test_logged_in_user_is_served_and_staff_rules_apply(hub, django_user_model):
    from asgiref.sync import sync_to_async

    user = await sync_to_async(django_user_model.objects.create_user)("u", password="p")
    async with Client(user) as c:
        answer = await c.call("subscribe", {"channel": "atelier:load:250"})
        assert answer["result"]["interval_ms"] == 250
        frame = (await c.frames(1, timeout=3))[0]
        assert 0 <= frame["data"]["load"] <= 1
        assert (await c.call("subscribe", {"channel": "test:staff"}))["error"]["code"] == -32001
        assert (await c.call("subscribe", {"channel": "realtime:socket"}))["error"]["code"] in (-32001, -32002)
        assert (await c.call("subscribe", {"channel": "test:perm"}))["error"]["code"] == -32001


async def test_hostile_frames_get_answers_and_the_connection_stays_healthy(hub):
    async with Client() as c:
        await c.send("not json")
        assert (await c.recv())["error"]["code"] == -32700
        for text in ["42", '"s"', "null", "[]", '{"method":"ping","id":1}', '{"jsonrpc":"2.0","method":1,"id":2}']:
            await c.send(text)
            assert (await c.recv())["error"]["code"] == -32600
        await c.send('{"jsonrpc":"2.0","method":"ping","id":' + "9" * 4000 + "}")
        assert (await c.recv())["result"] == "pong"
        await c.send("[1, 2]")
        batch = await c.recv()
        assert [m["error"]["code"] for m in batch] == [-32600, -32600]
        await c.send(json.dumps([{"jsonrpc": "2.0", "method": "ping", "id": i} for i in range(51)]))
        assert (await c.recv())["error"]["data"]["reason"] == "batch_too_large"
        assert (await c.call("nope"))["error"]["code"] == -32601
        crash = (await c.call("test.crash"))["error"]
        assert (crash["code"], crash["data"]["reason"]) == (-32603, "internal_error")
        assert (await c.call("test.echo", {"a": [1]}))["result"] == {"a": [1]}
        # notifications get no answer, a batch answers only its requests
        await c.send(
            json.dumps([{"jsonrpc": "2.0", "method": "ping"}, {"jsonrpc": "2.0", "method": "ping", "id": "z"}])
        )
        assert await c.recv() == [{"jsonrpc": "2.0", "result": "pong", "id": "z"}]
        await c.send(json.dumps({"jsonrpc": "2.0", "method": "ping"}))
        assert await c.comm.receive_nothing(0.1)
        assert (await c.call("ping"))["result"] == "pong"


async def test_oversize_frame_closes_with_1009(hub):
    async with Client() as c:
        await c.send("x" * (64 * 1024 + 1))
        closing = await c.comm.receive_output(2)
        assert closing == {"type": "websocket.close", "code": 1009, "reason": "frame over 65536 bytes"}


@override_settings(REALTIME_APP={"MAX_FRAME_BYTES": 200})
async def test_frame_limit_counts_utf8_bytes(hub):
    async with Client() as c:
        request = {"jsonrpc": "2.0", "method": "test.echo", "params": ["é" * 30], "id": 1}
        await c.send(json.dumps(request, ensure_ascii=False))
        assert (await c.recv())["result"] == ["é" * 30]
        request["params"] = ["é" * 80]  # 145 characters, 225 bytes
        await c.send(json.dumps(request, ensure_ascii=False))
        assert (await c.comm.receive_output(2))["code"] == 1009


async def test_binary_frames_close_with_1003(hub):
    async with Client() as c:
        await c.comm.send_to(bytes_data=b"\x00\x01")
        assert (await c.comm.receive_output(2))["code"] == 1003


async def test_clients_publish_only_where_a_rule_allows(hub):
    async with Client() as a, Client() as b:
        await a.call("subscribe", {"channel": "demo:events"})
        answer = await b.call("publish", {"channel": "demo:events", "data": {"text": "hi"}})
        assert answer["result"]["channel"] == "demo:events"
        frame = (await a.frames(1))[0]
        assert frame["data"] == {"text": "hi"} and frame["seq"] == answer["result"]["seq"]
        denied = await b.call("publish", {"channel": "test:events", "data": 1})
        assert denied["error"]["data"]["reason"] == "forbidden_channel"
        denied = await b.call("publish", {"channel": "demo:clock", "data": 1})
        assert denied["error"]["data"]["reason"] == "forbidden_channel"
        assert (await b.call("publish", {"channel": "demo:events"}))["error"]["code"] == -32602


async def test_apublish_from_application_code(hub):
    from realtime_app import apublish
    from realtime_app.exceptions import ConfigurationError, UnknownChannel

    async with Client() as c:
        await c.call("subscribe", {"channel": "test:events"})
        seqs = [await apublish("test:events", {"i": i}) for i in range(3)]
        frames = await c.frames(3)
        assert [f["data"]["i"] for f in frames] == [0, 1, 2]
        assert [f["seq"] for f in frames] == seqs == [1, 2, 3]
    with pytest.raises(ConfigurationError):
        await apublish("demo:clock:2000", {})
    with pytest.raises(UnknownChannel):
        await apublish("nope", {})


async def test_publish_from_a_sync_thread_reaches_the_hub(hub):
    from asgiref.sync import sync_to_async

    from realtime_app import publish

    async with Client() as c:
        await c.call("subscribe", {"channel": "test:events"})
        seq = await sync_to_async(publish)("test:events", {"from": "thread"})
        frame = (await c.frames(1))[0]
        assert frame == {**frame, "seq": seq, "data": {"from": "thread"}}


async def test_a_failing_factory_is_logged_once_and_does_not_break_the_connection(hub, caplog):
    async with Client() as c:
        answer = await c.call("subscribe", {"channel": "test:broken"})
        assert answer["result"]["channel"] == "test:broken"
        assert (await c.call("ping"))["result"] == "pong"
    assert sum("factory of test:broken failed" in r.message for r in caplog.records) == 1


@override_settings(REALTIME_APP={"MAX_SUBSCRIPTIONS": 2})
async def test_subscription_limit(hub):
    async with Client() as c:
        assert "result" in await c.call("subscribe", {"channel": "demo:clock:100"})
        assert "result" in await c.call("subscribe", {"channel": "demo:clock:200"})
        assert "result" in await c.call("subscribe", {"channel": "demo:clock:200"})  # idempotent
        error = (await c.call("subscribe", {"channel": "demo:clock:300"}))["error"]
        assert error["data"]["reason"] == "too_many_subscriptions"
